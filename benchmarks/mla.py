"""Multi-head latent attention, one decode step of one layer (issue 17). Prints numbers; asserts
nothing.

At the real per-layer geometry of GLM-5 and DeepSeek-V3 (random int4 g64 weights, the latent
cache filled to S - 1 positions), three ways of running the step, paired in-process round by
round (A/B/C in each round, median over rounds: this machine is shared and noisy):

  float32  the block before issue 17: W_kb / W_vb dequantized to float32 at load, np.matmul per
           head batch, kernels.attention over the latent rows (one kv head)
  step     today's step-by-step composition: kv_b kept int4, matmul_t / matmul per head,
           attend_latent (MLAAttention with the engine's fused_attention off)
  block    the compiled block (cython_kernels/mla_block.h, one call)

with the RAM the absorbed matrices hold per layer (float32 before, int4 bytes + scales now), the
bytes one step reads (weights + the latent cache, which the block reads twice: scores, then
the weighted sum), the machine's read bandwidth (benchmarks/common.ram_read_gbps) and the
achieved ratio.

    python benchmarks/mla.py [--rounds N] [--threads 2] [--contexts 1,4096] [--models glm5,dsv3]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import format_summary, machine_summary, ram_read_gbps  # noqa: E402
from core import kernels, quant  # noqa: E402
from core.blocks.mla import MLA, MLAAttention, rope_interleaved  # noqa: E402
from core.container import Weight  # noqa: E402
from core.cache import KVCache  # noqa: E402
from core.rope import Rope  # noqa: E402
from core.step import Step  # noqa: E402

GEOMETRY = {
    # hidden, heads, q_lora, kv_lora, nope, rope, v
    "glm5": (6144, 64, 2048, 512, 192, 64, 256),
    "dsv3": (7168, 128, 1536, 512, 128, 64, 128),
}
LAYERS = {"glm5": 78, "dsv3": 61}


class _Container(dict):
    def load(self, name):
        return self[name]


def _int4(rng, rows, cols, gs=64):
    """Random packed nibbles and scales (quantizing float matrices this size takes minutes)."""
    data = rng.integers(0, 256, (rows, (cols + 1) // 2), dtype=np.uint8)
    scales = (0.02 + 0.01 * rng.random((rows, (cols + gs - 1) // gs))).astype(np.float32)
    return Weight("int4", (rows, cols), data, scales, gs)


def _layer(spec: MLA, rng) -> MLAAttention:
    c = _Container()
    for need in spec.tensors("a."):
        if need.optional:
            continue
        if len(need.shape) == 1:
            c[need.name] = Weight("dense", need.shape, (1 + 0.1 * rng.standard_normal(need.shape)).astype(np.float32))
        else:
            c[need.name] = _int4(rng, *need.shape)
    return MLAAttention(spec, c, "a.", 1e-5)


class Float32Absorbed:
    """The block as it was before issue 17 (float32 W_kb / W_vb, np.matmul per head batch)."""

    def __init__(self, attn: MLAAttention):
        s = attn.spec
        kv_b = quant.dequantize_int4(attn.kv_b.data, attn.kv_b.scales, s.kv_lora_rank, 64).reshape(
            s.heads, s.qk_nope + s.v_head_dim, s.kv_lora_rank)
        self.w_kb = np.ascontiguousarray(kv_b[:, : s.qk_nope])
        self.w_vb_t = np.ascontiguousarray(kv_b[:, s.qk_nope:].transpose(0, 2, 1))
        self.a = attn

    def nbytes(self):
        return self.w_kb.nbytes + self.w_vb_t.nbytes

    def __call__(self, h, cos, sin, cache, pos):
        a, s, T = self.a, self.a.spec, 1
        q = kernels.matmul(kernels.rms_norm(kernels.matmul(h, a.q_a), a.q_a_norm, 1e-6), a.q_b)
        q = q.reshape(T, s.heads, s.qk_nope + s.qk_rope)
        q_nope, q_rot = q[..., : s.qk_nope], rope_interleaved(q[..., s.qk_nope:], cos, sin)
        kv = kernels.matmul(h, a.kv_a)
        latent = kernels.rms_norm(kv[:, : s.kv_lora_rank], a.kv_a_norm, 1e-6)
        k_rot = rope_interleaved(kv[:, None, s.kv_lora_rank:], cos, sin)[:, 0]
        rows = cache.append_part(0, "latent", np.concatenate([latent, k_rot], axis=-1)[:, None, :])
        q_lat = np.matmul(q_nope.transpose(1, 0, 2), self.w_kb).transpose(1, 0, 2)
        qq = np.ascontiguousarray(np.concatenate([q_lat, q_rot], axis=-1), dtype=np.float32)
        o = kernels.attention(qq, rows, rows, a.scale, pos, None).reshape(T, s.heads, -1)[..., : s.kv_lora_rank]
        out = np.matmul(o.transpose(1, 0, 2), self.w_vb_t).transpose(1, 0, 2)
        return kernels.matmul(np.ascontiguousarray(out.reshape(T, -1)), a.o)


def _weights_bytes(attn: MLAAttention) -> int:
    s = attn.spec
    ws = [attn.q_a, attn.q_b, attn.kv_a, attn.kv_b, attn.o] if s.q_lora_rank else [attn.q, attn.kv_a, attn.kv_b, attn.o]
    return sum(w.data.nbytes + w.scales.nbytes for w in ws)


def run(name: str, contexts, rounds: int, threads: int, bw: float) -> list[str]:
    hidden, heads, ql, rank, nope, rope, v = GEOMETRY[name]
    rng = np.random.default_rng(0)
    spec = MLA(hidden, heads, ql, rank, nope, rope, v, scale=(nope + rope) ** -0.5)
    attn = _layer(spec, rng)
    old = Float32Absorbed(attn)
    kv_b = attn.kv_b.data.nbytes + attn.kv_b.scales.nbytes
    lines = [f"{name}: hidden {hidden}, {heads} heads, q_lora {ql}, kv_lora {rank}, nope {nope}, rope {rope}, "
             f"v {v}; int4 g64 weights {_weights_bytes(attn) / 1e6:.1f} MB per layer",
             f"  absorbed matrices held per layer: float32 {old.nbytes() / 1e6:.1f} MB before, "
             f"int4 kv_b_proj {kv_b / 1e6:.1f} MB now (x {LAYERS[name]} layers: "
             f"{LAYERS[name] * old.nbytes() / 1e9:.2f} GB -> {LAYERS[name] * kv_b / 1e9:.2f} GB)"]
    h = rng.standard_normal((1, hidden)).astype(np.float32)
    D = rank + rope
    kernels.set_threads(threads)
    for S in contexts:
        arch = SimpleNamespace(cache_kinds=[spec.cache_kind()], max_position_embeddings=1 << 20)
        cache = KVCache(arch)
        if S > 1:
            cache.append_part(0, "latent", rng.standard_normal((S - 1, 1, D)).astype(np.float32))
        cache.length = S - 1
        cache.ensure(0, S)
        pos = np.array([S - 1])
        table = Rope({"rope_theta": 10000.0}, rope)
        cos, sin = table.cos_sin(pos)
        step = Step([0], pos, cache, {"main": table}, fused=False)
        ways = {"float32": lambda: old(h, cos, sin, cache, pos),
                "step": lambda: attn(0, h, step),
                "block": lambda: attn.fast(h, cos, sin, cache.arrays[0]["latent"], S - 1, attn.scale)}
        times = {k: [] for k in ways}
        for f in ways.values():
            f()
        for _ in range(rounds):
            for k, f in ways.items():
                t0 = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t0)
        med = {k: float(np.median(t)) for k, t in times.items()}
        moved = _weights_bytes(attn) + 2 * S * D * 4
        lines.append(f"  S={S:>5}, {threads} thr: float32 {med['float32'] * 1e3:7.2f} ms | step {med['step'] * 1e3:7.2f} ms"
                     f" | block {med['block'] * 1e3:7.2f} ms ({med['float32'] / med['block']:.2f}x float32, "
                     f"{med['step'] / med['block']:.2f}x step); block reads {moved / 1e6:.1f} MB -> "
                     f"{moved / med['block'] / 1e9:.1f} GB/s = {moved / med['block'] / 1e9 / bw:.2f} of {bw:.1f} GB/s")
    return lines


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--contexts", default="1,4096")
    ap.add_argument("--models", default="glm5,dsv3")
    a = ap.parse_args(argv)
    print("machine:")
    print(format_summary(machine_summary()))
    print(f"kernels: {kernels.backend()}, simd {kernels.simd_level()}")
    bw = ram_read_gbps(a.threads)
    print(f"RAM read bandwidth ({a.threads} threads): {bw:.1f} GB/s")
    for name in a.models.split(","):
        for line in run(name, [int(c) for c in a.contexts.split(",")], a.rounds, a.threads, bw):
            print(line, flush=True)


if __name__ == "__main__":
    main()
