"""A KDA layer's core (Kimi-Linear) as one compiled call (cython_kernels/kda_block.h, ``kda_block``:
the three convs + SiLU, the divide-form l2norms, the per-channel forget gate and beta, the
per-channel delta rule, the sigmoid-gated o_norm) against the step-by-step composition of its
compiled pieces (core.blocks.linear_attention's ``KDAMixer.core_steps``): the same bits of the
output and of the conv and recurrent state it leaves, for decode (one position continuing a state)
and prefill, conv kernels 1-4, several thread counts, and a prompt split into chunks or fed one
position at a time; against the numpy reference to float32 rounding; and through the engine
(fused_attention on and off: the same logits)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from core.blocks.linear_attention import KDAMixer
from tests.conftest import assert_block_has_the_bits_of_its_steps

qm = pytest.importorskip("cython_kernels.qmatmul", reason="compiled kernels not built")
if not hasattr(qm, "kda_block"):
    pytest.skip("compiled kernels built before the KDA block", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("kernel_settings")


def _mixer(rng, H, d, K):
    W = H * d
    m = KDAMixer.__new__(KDAMixer)
    m.spec = SimpleNamespace(heads=H, head_dim=d, conv_kernel=K, width=W)
    m.eps = 1e-6
    m.conv_w = (rng.standard_normal((3 * W, K)) / np.sqrt(K)).astype(np.float32)
    m.dt_bias = rng.standard_normal(W).astype(np.float32)
    m.neg_a = (-rng.uniform(1, 16, H)).astype(np.float32)[:, None]
    m.norm_w = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    m.scale = np.float32(1 / (d ** 0.5))
    return m


def _inputs(rng, m, T):
    W, H = m.spec.width, m.spec.heads
    f = rng.standard_normal((T, W)).astype(np.float32)
    f[:, :3] = [25.0, 20.0, -30.0]         # softplus' branches (x > 20, the threshold, a tiny e^x)
    return (rng.standard_normal((T, 3 * W)).astype(np.float32), f,
            rng.standard_normal((T, H)).astype(np.float32),
            rng.standard_normal((T, W)).astype(np.float32))


def _state(rng, m, warm: bool):
    s = m.spec
    conv = np.zeros((3 * s.width, s.conv_kernel - 1), np.float32)
    rec = np.zeros((s.heads, s.head_dim, s.head_dim), np.float32)
    if warm:       # a state some positions have folded into already
        conv[...] = rng.standard_normal(conv.shape)
        rec[...] = 0.3 * rng.standard_normal(rec.shape)
    return {"conv": conv, "recurrent": rec}


def _block(m, x, state):
    qkv, f, b, gate = x
    return qm.kda_block(qkv, f, b, gate, m.conv_w, state["conv"], state["recurrent"], m.dt_bias, m.neg_a,
                        m.norm_w, m.eps, m.scale, m.spec.heads, m.spec.head_dim)


@pytest.mark.parametrize("H, d, K", [(2, 8, 4), (3, 10, 3), (4, 16, 2), (1, 24, 1), (32, 128, 4)])
@pytest.mark.parametrize("T", [1, 9])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_block_has_the_bits_of_its_steps(H, d, K, T, threads):
    qm.set_num_threads(threads)
    rng = np.random.default_rng(H * 1000 + d + T)
    m = _mixer(rng, H, d, K)
    x = _inputs(rng, m, T)
    base = _state(rng, m, warm=True)
    assert_block_has_the_bits_of_its_steps(m, x, base, _block, qm)


def test_the_bits_do_not_depend_on_the_thread_count():
    rng = np.random.default_rng(3)
    m = _mixer(rng, 6, 16, 4)
    x = _inputs(rng, m, 5)
    base = _state(rng, m, warm=True)
    runs = []
    for threads in (1, 2, 3):
        qm.set_num_threads(threads)
        st = {k: v.copy() for k, v in base.items()}
        runs.append((_block(m, x, st), st))
    for out, st in runs[1:]:
        np.testing.assert_array_equal(out, runs[0][0])
        for part in base:
            np.testing.assert_array_equal(st[part], runs[0][1][part])


@pytest.mark.parametrize("cuts", [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [4], [3, 11]])
def test_a_prompt_in_chunks_or_decoded_gives_the_bits_of_one_pass(cuts):
    rng = np.random.default_rng(7)
    m = _mixer(rng, 3, 16, 4)
    T = 12
    x = _inputs(rng, m, T)
    whole_state = _state(rng, m, warm=False)
    whole = _block(m, x, whole_state)
    state, parts, at = _state(rng, m, warm=False), [], 0
    for end in cuts + [T]:
        parts.append(_block(m, tuple(p[at:end] for p in x), state))
        at = end
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    for part in state:
        np.testing.assert_array_equal(state[part], whole_state[part])


@pytest.mark.parametrize("name", ["kimilinear-a", "kimilinear-b"])
def test_the_engine_gives_the_same_bits_with_the_block_or_the_steps(name, containers, monkeypatch):
    from models import open_model
    from tests.conftest import COMMITTED
    ids = np.load(COMMITTED / name / "reference.npz")["ids"].tolist()
    calls = {"block": 0, "steps": 0}
    block, steps = qm.kda_block, KDAMixer.core_steps

    def counted_block(*a):
        calls["block"] += 1
        return block(*a)

    def counted_steps(self, *a):
        calls["steps"] += 1
        return steps(self, *a)
    monkeypatch.setattr(qm, "kda_block", counted_block)
    monkeypatch.setattr(KDAMixer, "core_steps", counted_steps)
    for bits in (4, 16):
        engine = open_model(containers(name, bits))
        fused = engine.logits(ids)
        cache = engine.new_cache()
        decoded = [engine.forward(ids[:3], cache)[-1]] + [engine.forward([t], cache)[-1] for t in ids[3:]]
        assert calls["block"] > 0 and calls["steps"] == 0
        engine.fused_attention = False
        np.testing.assert_array_equal(engine.logits(ids), fused)
        assert calls["steps"] > 0
        calls["block"] = calls["steps"] = 0
        if bits == 16:
            assert np.abs(np.stack(decoded) - fused[2:]).max() <= 2e-4
