"""A Gated DeltaNet layer's core as one compiled call (cython_kernels/linear_attention.h,
``gdn_block``: conv update + SiLU, l2norms, gates, the delta rule, the gated norm) against the
step-by-step composition of its compiled pieces (core.blocks.linear_attention's
``GatedDeltaNetMixer.core_steps``): the same bits of the output and of the conv and recurrent
state it leaves, for decode (one position continuing a state) and prefill, grouped k heads, conv
kernels 1-4, several thread counts, and a prompt split into chunks or fed one position at a time;
against the numpy reference to float32 rounding; and through the engine (fused_attention on and
off: the same logits)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from core.blocks.linear_attention import GatedDeltaNetMixer
from tests.conftest import assert_block_has_the_bits_of_its_steps

qm = pytest.importorskip("cython_kernels.qmatmul", reason="compiled kernels not built")
if not hasattr(qm, "gdn_block"):
    pytest.skip("compiled kernels built before the linear-attention block", allow_module_level=True)

pytestmark = pytest.mark.usefixtures("kernel_settings")


def _mixer(rng, Hk, Hv, dk, dv, K):
    C = 2 * Hk * dk + Hv * dv
    m = GatedDeltaNetMixer.__new__(GatedDeltaNetMixer)
    m.spec = SimpleNamespace(k_heads=Hk, v_heads=Hv, k_dim=dk, v_dim=dv, conv_kernel=K, conv_channels=C)
    m.eps = 1e-6
    m.conv_w = (rng.standard_normal((C, K)) / np.sqrt(K)).astype(np.float32)
    m.dt_bias = rng.standard_normal(Hv).astype(np.float32)
    m.neg_a = -np.exp(np.log(rng.uniform(1, 16, Hv))).astype(np.float32)
    m.norm_w = (1 + 0.1 * rng.standard_normal(dv)).astype(np.float32)
    m.scale = np.float32(dk ** -0.5)
    return m


def _inputs(rng, m, T):
    s = m.spec
    return (rng.standard_normal((T, s.conv_channels)).astype(np.float32),
            rng.standard_normal((T, s.v_heads * s.v_dim)).astype(np.float32),
            rng.standard_normal((T, s.v_heads)).astype(np.float32),
            rng.standard_normal((T, s.v_heads)).astype(np.float32))


def _state(rng, m, warm: bool):
    s = m.spec
    conv = np.zeros((s.conv_channels, s.conv_kernel - 1), np.float32)
    rec = np.zeros((s.v_heads, s.k_dim, s.v_dim), np.float32)
    if warm:       # a state some positions have folded into already
        conv[...] = rng.standard_normal(conv.shape)
        rec[...] = 0.3 * rng.standard_normal(rec.shape)
    return {"conv": conv, "recurrent": rec}


def _block(m, x, state):
    s = m.spec
    qkv, z, b, a = x
    return qm.gdn_block(qkv, z, b, a, m.conv_w, state["conv"], state["recurrent"], m.dt_bias, m.neg_a,
                        m.norm_w, m.eps, m.scale, s.k_heads, s.v_heads, s.k_dim, s.v_dim)


@pytest.mark.parametrize("Hk, Hv, dk, dv, K", [(2, 4, 8, 12, 4), (1, 3, 10, 6, 3), (3, 3, 16, 16, 2),
                                               (4, 8, 32, 24, 1), (16, 32, 128, 128, 4)])
@pytest.mark.parametrize("T", [1, 9])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_the_block_has_the_bits_of_its_steps(Hk, Hv, dk, dv, K, T, threads):
    qm.set_num_threads(threads)
    rng = np.random.default_rng(Hk * 1000 + dk + T)
    m = _mixer(rng, Hk, Hv, dk, dv, K)
    x = _inputs(rng, m, T)
    base = _state(rng, m, warm=True)
    assert_block_has_the_bits_of_its_steps(m, x, base, _block, qm)


@pytest.mark.parametrize("cuts", [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [4], [3, 11]])
def test_a_prompt_in_chunks_or_decoded_gives_the_bits_of_one_pass(cuts):
    rng = np.random.default_rng(7)
    m = _mixer(rng, 2, 6, 16, 12, 4)
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


@pytest.mark.parametrize("name", ["qwen35moe-a", "qwen35moe-b"])
def test_the_engine_gives_the_same_bits_with_the_block_or_the_steps(name, containers):
    from core.cache import KVCache  # noqa: F401  (the engine's cache, through new_cache)
    from models import open_model
    from tests.conftest import COMMITTED
    ids = np.load(COMMITTED / name / "reference.npz")["ids"].tolist()
    for bits in (4, 16):
        engine = open_model(containers(name, bits))
        fused = engine.logits(ids)
        cache = engine.new_cache()
        decoded = [engine.forward(ids[:3], cache)[-1]] + [engine.forward([t], cache)[-1] for t in ids[3:]]
        engine.fused_attention = False
        np.testing.assert_array_equal(engine.logits(ids), fused)
        if bits == 16:       # (int4's products differ between one row and many: not this block)
            assert np.abs(np.stack(decoded) - fused[2:]).max() <= 2e-4      # see tests/test_qwen3_5_moe.py
