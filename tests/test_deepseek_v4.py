"""DeepSeek V4 (models/deepseek_v4.py on core.blocks.mhc / shared_kv) against transformers 5.25's
DeepseekV4ForCausalLM: tiny random models with every feature on -- the three layer types, hash
layers, sinks, a window shorter than the prompt, compression ratios 4 and 8 completing several
blocks, an indexer top-k below the entries, yarn on the compress table, clamping active -- saved
with save_pretrained, converted (coli convert --bits 16) and run by core.engine.Engine
(models.open_model). Prefill logits within 1e-4 of transformers; decode through the caches one
position at a time within 2e-5 of our prefill and 1e-4 of transformers' own decode."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DeepseekV4ForCausalLM"):
    pytest.skip("this transformers has no deepseek_v4", allow_module_level=True)

from core import kernels                                       # noqa: E402
from core.converter import convert                             # noqa: E402
from core.errors import ColiError                              # noqa: E402
from models import open_model                                  # noqa: E402
from models.deepseek_v4 import DeepseekV4                      # noqa: E402
from models.registry import validate_config                    # noqa: E402

T = 40
LIMIT = 1.0


def tiny_config(**kw):
    cfg = dict(vocab_size=64, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=4,
               num_attention_heads=4, head_dim=16, q_lora_rank=16, num_experts_per_tok=2, n_routed_experts=8,
               layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                            "compressed_sparse_attention"],
               mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
               compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
               sliding_window=8, o_groups=2, o_lora_rank=8, index_n_heads=8, index_head_dim=8, index_topk=3,
               partial_rotary_factor=0.5, max_position_embeddings=64, swiglu_limit=LIMIT,
               rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    cfg.update(kw)
    return transformers.DeepseekV4Config(**cfg)


def randomize(m, seed):
    """Every parameter and buffer random (sinks, biases, position biases and hc scales are zero
    or one at init), gate / up scaled so the clamp bites; tid2eid rows distinct experts."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.5 * torch.randn(p.shape, generator=g) + (1 if name.endswith("scale") else 0))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 * (2 if "gate_up" in name else 1))
        for name, b in m.named_buffers():
            if name.endswith("tid2eid"):
                E = m.config.n_routed_experts
                b.copy_(torch.stack([torch.randperm(E, generator=g)[: b.shape[1]] for _ in range(b.shape[0])]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


def reference(cfg, seed, path, decode=True, length=T):
    """transformers' prefill and (decode) decode logits of a random model, saved at path."""
    torch.manual_seed(seed)
    m = transformers.DeepseekV4ForCausalLM(cfg).eval()
    randomize(m, seed)
    ids = torch.randint(0, cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed + 1))
    clamped = []
    experts = type(m.model.layers[0].mlp.experts)
    gate = experts._apply_gate

    def spy(self, gate_up):
        clamped.append(bool((gate_up.abs() > self.limit).any()))
        return gate(self, gate_up)

    experts._apply_gate, threads = spy, torch.get_num_threads()
    torch.set_num_threads(1)        # tiny products: threads only wait on each other
    try:
        with torch.no_grad():
            full = m(ids).logits[0].numpy()
            cache = transformers.DynamicCache(config=cfg)
            steps = np.stack([m(ids[:, t: t + 1], cache=cache, use_cache=True).logits[0, 0].numpy()
                              for t in range(length)]) if decode else None
    finally:
        experts._apply_gate = gate
        torch.set_num_threads(threads)
    assert any(clamped), "the test model must clamp"
    m.save_pretrained(path)
    return ids[0].numpy(), full, steps


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """transformers' logits of the random model, and our container of it (coli convert --bits 16)."""
    src, out = tmp_path_factory.mktemp("dsv4"), tmp_path_factory.mktemp("dsv4c") / "c16"
    ids, full, steps = reference(tiny_config(), 0, src)
    convert(src, out, bits=16, validate_config=validate_config)
    return out, ids, full, steps, src


def test_prefill_and_decode_match_transformers(case):
    out, ids, full, steps, _ = case
    engine = open_model(out, threads=1)
    got = engine.logits(ids)
    assert np.abs(got - full).max() <= 1e-4
    assert (got.argmax(-1) == full.argmax(-1)).all()
    cache = engine.new_cache()
    dec = np.concatenate([engine.forward([t], cache) for t in ids])
    assert np.abs(dec - got).max() <= 2e-5
    assert np.abs(dec - steps).max() <= 1e-4


def test_chunked_prefill_continues_the_caches(case):
    """A prompt in uneven chunks (partial blocks carried, overlap state across calls) gives the
    one-pass logits."""
    out, ids, full, _, _ = case
    engine = open_model(out, threads=1)
    cache, parts, at = engine.new_cache(), [], 0
    for n in (5, 11, 1, 3, 20):
        parts.append(engine.forward(ids[at: at + n], cache, all_logits=True))
        at += n
    assert np.abs(np.concatenate(parts) - full).max() <= 1e-4


def test_placement_never_changes_the_logits(case):
    """One expert slot per layer, prefetch off, or every expert resident: the same bits."""
    out, ids, _, _, _ = case
    base = open_model(out, threads=1).logits(ids)
    for kw in (dict(cap=1), dict(cap=1, prefetch=False), dict(cap=2, threads=2)):
        assert np.array_equal(open_model(out, **kw).logits(ids), base)


def test_an_unfinished_pass_refuses_to_continue(case):
    """The ring and compressors fold positions in: a pass cut short leaves them ahead of the
    cache, and the next pass says so instead of computing from a wrong state."""
    out, ids, _, _, _ = case
    engine = open_model(out, threads=1)
    cache = engine.new_cache()
    engine.layers[2].ffn = None           # the pass dies in layer 2's ffn, after its attention
    with pytest.raises(TypeError):
        engine.forward(ids[:5], cache)
    with pytest.raises(ColiError, match="holds 5 positions but the cache 0"):
        engine.forward(ids[:5], cache)


@pytest.mark.parametrize("field, value, words", [
    ("scoring_func", "softmax", "scoring_func 'softmax'"),
    ("mlp_bias", True, "mlp_bias"),
    ("layer_types", ["sliding_attention", "full_attention"], "layer_types must list"),
    ("hidden_act", "gelu", "hidden_act"),
    ("rope_parameters", {"main": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.25},
                         "compress": {"rope_type": "default", "rope_theta": 1e4}}, "main rotary table over 0.25"),
])
def test_refuses_what_it_does_not_run(field, value, words):
    config = tiny_config(num_hidden_layers=2, layer_types=None, mlp_layer_types=None).to_dict()
    config[field] = value
    with pytest.raises(ColiError, match=words):
        DeepseekV4.spec(config)


def test_reads_deepseeks_own_config_fields():
    """The release's config.json: compress_ratios per layer (MTP entries past the layers),
    num_hash_layers, qk_rope_head_dim, rope_scaling (yarn) at the top level."""
    config = dict(model_type="deepseek_v4", vocab_size=64, hidden_size=32, moe_intermediate_size=16,
                  num_hidden_layers=3, num_attention_heads=4, head_dim=16, q_lora_rank=16, n_routed_experts=8,
                  num_experts_per_tok=2, compress_ratios=[0, 4, 16, 4], num_hash_layers=1, qk_rope_head_dim=8,
                  o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8,
                  rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536})
    spec = DeepseekV4.spec(config)
    kinds = [tuple(k.name for k in kind) for kind in spec.cache_kinds]
    assert kinds == [("ring",), ("ring", "compressor", "indexer"), ("ring", "compressor")]
    assert spec.cache_kinds[2][1].ratio == 16 and spec.rope_dim == 8
    assert [type(l.ffn.moe.router).__name__ for l in spec.layers] == ["HashRouter", "ScoreRouter", "ScoreRouter"]
    main, compress = spec.rope_tables["main"], spec.rope_tables["compress"]
    assert compress.attention_scaling == 1.0 and not np.allclose(main.inv_freq, compress.inv_freq)


def test_lookahead_sees_what_the_router_sees(case):
    """router_input of the streams after a layer's attention (the engine's lookahead, at
    step.mixed) is the ffn's own input; a hash layer's known experts are the ones it routes to."""
    out, ids, _, _, _ = case
    engine = open_model(out, threads=1)
    seen, mixed = {}, {}
    for i, L in enumerate(engine.layers):
        def spy(j, h, step, routed=None, inner=L.ffn):
            seen[j] = (h, inner.router.route(h, step.ids) if hasattr(inner, "known_experts") else inner.router.route(h))
            return inner(j, h, step, routed)
        L.ffn = spy
    engine.lookahead = lambda i, x, step: mixed.__setitem__(i, engine.layers[i].router_input(x, step))
    engine.logits(ids)
    hashed = [i for i, L in enumerate(engine.layers) if hasattr(L, "known_experts")]
    assert hashed == [0, 1]
    for i in range(len(engine.layers)):
        assert np.array_equal(mixed[i], seen[i][0])
    step = engine.step(np.asarray(ids), engine.new_cache())
    for i in hashed:
        assert set(engine.layers[i].known_experts(step)) == set(np.unique(seen[i][1][0]).tolist())


def test_cache_kinds_of_the_flash_geometry():
    """Bytes per position and fixed bytes per kind at DeepSeek V4 Flash's sizes (coli plan's)."""
    from core.cache_kinds import describe
    config = dict(model_type="deepseek_v4", num_hidden_layers=4, compress_ratios=[0, 0, 4, 128, 4])
    kinds = DeepseekV4.spec(config).cache_kinds
    ring, (_, csa, index), (_, hca) = kinds[0][0], kinds[2], kinds[3]
    assert ring.fixed_bytes() == 128 * 512 * 4 and ring.bytes_per_position() == 0
    assert (csa.bytes_per_position(), index.bytes_per_position(), hca.bytes_per_position()) == (512, 128, 16)
    assert "compressed entries (512 per 4 positions) + indexer keys (128 per 4 positions)" in describe(kinds)


def test_tied_head_and_sigmoid_scores(tmp_path):
    """tie_word_embeddings (the head is the embedding; no head.weight saved) and
    scoring_func sigmoid, prefill only."""
    cfg = tiny_config(num_hidden_layers=2, layer_types=["compressed_sparse_attention", "sliding_attention"],
                      mlp_layer_types=["moe", "hash_moe"], tie_word_embeddings=True, scoring_func="sigmoid")
    ids, full, _ = reference(cfg, 3, tmp_path / "src", decode=False)
    convert(tmp_path / "src", tmp_path / "c16", bits=16, validate_config=validate_config)
    engine = open_model(tmp_path / "c16", threads=1)
    assert "head.weight" not in engine.container
    assert np.abs(engine.logits(ids) - full).max() <= 1e-4


def test_bits4_against_transformers_on_the_dequantized_weights(case, tmp_path):
    """--bits 4 (experts and attention int4, the mHC mixes, router, grouped o_a and compressors
    float32 as the blocks declare): transformers run on the container's own dequantized weights
    gives our logits (argmax at T - 1 positions at least)."""
    from safetensors.torch import save_file

    from core.blocks.common import float32_matrix
    from core.container import Container
    _, ids, _, _, src = case
    out = tmp_path / "c4"
    convert(src, out, bits=4, validate_config=validate_config)
    c = Container(out)
    assert c.load("model.layers.0.hc_attn_fn").scheme == "dense"
    assert c.load("model.layers.1.attn.wq_a.weight").scheme == "int4"
    tensors = {n: torch.from_numpy(np.array(c.load_ints(n) if n.endswith("tid2eid") else float32_matrix(c.load(n))))
               for n in c.names() if not n.endswith(".qs")}
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    m = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = m(torch.from_numpy(ids)[None]).logits[0].numpy()
    got = open_model(out, threads=1).logits(ids)
    assert (got.argmax(-1) == ref.argmax(-1)).sum() >= T - 1
    assert np.abs(got - ref).max() <= 1e-3


def test_prefix_reuse_continues_at_the_checkpoint_or_the_end(case):
    """The ring and compressors cannot truncate: a chat's next prompt continues the cache from the
    checkpoint taken at the last prompt's end (partial blocks and overlap restored) or from its
    very end, and the replies are a fresh run's."""
    from core.events import Token
    from core.sampling import SamplingParams
    out, ids, _, _, _ = case
    engine, fresh = open_model(out, threads=1), open_model(out, threads=1)
    engine.usage_file = fresh.usage_file = None
    fresh.prefix_cache = False
    assert not engine.prefixes.truncatable
    assert engine.new_cache().savable           # saved sessions write its objects (core.sessions)

    def turn(e, prompt):
        evs = list(e.generate(list(map(int, prompt)), SamplingParams(temperature=0.0), max_new_tokens=3))
        return [ev.id for ev in evs if isinstance(ev, Token) and ev.id >= 0], evs[-2]

    p1 = ids[:10]
    r1, _ = turn(engine, p1)
    p2 = list(p1) + [(t + 1) % 64 for t in r1] + list(ids[10:19])      # branches after the prompt
    r2, stats = turn(engine, p2)
    assert stats.cached_tokens == 10 and r2 == turn(fresh, p2)[0]
    p3 = p2 + r2[:-1] + list(ids[19:25])                                 # extends the whole entry
    r3, stats = turn(engine, p3)
    assert stats.cached_tokens == len(p2) + len(r2) - 1 and r3 == turn(fresh, p3)[0]


def test_a_prompt_longer_than_a_query_block(tmp_path):
    """300 positions: attention and the indexer in blocks of query rows (256), dozens of entries."""
    from core import kernels
    cfg = tiny_config(max_position_embeddings=512, num_hidden_layers=2, mlp_layer_types=["hash_moe", "moe"],
                      layer_types=["compressed_sparse_attention", "heavily_compressed_attention"])
    ids, full, _ = reference(cfg, 4, tmp_path / "src", decode=False, length=300)
    assert len(ids) > kernels.ATTENTION_QUERY_BLOCK
    convert(tmp_path / "src", tmp_path / "c16", bits=16, validate_config=validate_config)
    got = open_model(tmp_path / "c16", threads=1).logits(ids)
    assert np.abs(got - full).max() <= 1e-4


@pytest.mark.parametrize("table, words", [
    ([[0, 0]] * 64, "distinct experts"),
    ([[0, 8]] * 64, "distinct experts in 0..7"),
    ([[0, 1]] * 63, r"shape \[63, 2\]"),
])
def test_a_bad_hash_table_is_refused_at_open(table, words):
    """tid2eid naming an expert twice or out of range, or of the wrong shape: one line at open."""
    from core.container import Weight
    from models.deepseek_v4 import HashRouter

    class Tensors:
        def load_ints(self, name):
            return np.asarray(table, np.int64)

        def load(self, name):
            return Weight("dense", (8, 32), np.zeros((8, 32), np.float32))
    with pytest.raises(ColiError, match=words):
        HashRouter(2, "sqrtsoftplus", 1.5, 64).build(Tensors(), "model.layers.0.ffn.", 8, 32)


@pytest.fixture(scope="module")
def hub_fp4(tmp_path_factory):
    """The dsv4-a Hub fixture converted with the defaults: its FP4 experts as shipped."""
    from tests.conftest import COMMITTED
    out = tmp_path_factory.mktemp("dsv4hub") / "c"
    convert(COMMITTED / "dsv4-a" / "hub", out, validate_config=validate_config)
    return out, np.load(COMMITTED / "dsv4-a" / "reference.npz")["ids"]


def test_fp4_experts_placement_and_threads_never_change_the_bits(hub_fp4):
    """FP4 experts through the compiled kernels: every placement, prefetch off, 2 threads, and the
    decode steps too, give the bits of all experts resident on one thread."""
    out, ids = hub_fp4
    base = open_model(out, threads=1)
    want = base.logits(ids)
    cache = base.new_cache()
    want_steps = np.concatenate([base.forward([t], cache) for t in ids[:12]])
    for kw in (dict(cap=1), dict(cap=2, prefetch=False), dict(cap=1, threads=2)):
        e = open_model(out, **kw)
        assert np.array_equal(e.logits(ids), want)
        cache = e.new_cache()
        assert np.array_equal(np.concatenate([e.forward([t], cache) for t in ids[:12]]), want_steps)
    kernels.set_threads(None)


def test_the_compiled_kernels_agree_with_the_numpy_composition(hub_fp4, monkeypatch):
    out, ids = hub_fp4
    engine = open_model(out, threads=1)
    fast = engine.logits(ids)
    monkeypatch.setattr(kernels, "_compiled", None)
    slow = engine.logits(ids)
    assert np.abs(fast - slow).max() <= 1e-4 and (fast.argmax(-1) == slow.argmax(-1)).all()


def test_info_names_the_matrices_kept_float32(tmp_path):
    """At --bits 4 the tensors the blocks read as numbers stay F32, and coli info's classes say so."""
    import json

    from tests.conftest import COMMITTED
    out = convert(COMMITTED / "dsv4-a" / "model", tmp_path / "c", bits=4, validate_config=validate_config)
    classes = json.loads((out / "colibri.json").read_text())["classes"]
    assert classes["attention"] == "int4-g64" and "hc_attn_fn" in classes["f32_matrices"]
