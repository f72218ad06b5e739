"""DeepSeek V4's part of the oracle generator (tests/oracle/generate.py calls in here).

* ``write_hub``: the fixture's model again, as DeepSeek's release ships it (``fixtures/NAME/hub/``):
  DeepSeek's tensor names, routed experts FP4 E2M1 + UE8M0 per 32, the attention projections,
  indexer query and shared experts FP8 E4M3 + UE8M0 per 128×128, BF16 / F32 / I64 elsewhere, an
  MTP block ``mtp.0.*`` (random: the converter sets it aside), the release's config.json. Its
  reference is transformers run on the exactly dequantized weights, loaded from DeepSeek's names
  through transformers' own conversion mapping (checked to land on the same tensors).
* ``scheme``: which tensors the int4 / int8 references quantize (what the release ships FP4 or FP8
  -> int4 at --bits 4, int8 at --bits 8; embed / head -> int8; the rest float).
* ``IndexerWatch`` / ``ClampWatch``: how active the Lightning indexer's top-k and the SwiGLU clamp
  are, for meta.json; the indexer's boundary gaps drive the same fresh-weights retries as DSA.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import torch

from tests.oracle import hub_formats as hf
from tests.oracle.hooks import Watch, topk_boundary_gap

HC_GAIN = 0.5        # mHC projections: std HC_GAIN / sqrt(fan_in) -> pre/post/comb logits O(0.5)


def hc_init(leaf: str, shape, normal) -> torch.Tensor:
    """mHC fn [m, hc·H] / base [m] / scale [3] (attn_hc, ffn_hc) or [1] (hc_head)."""
    if leaf.endswith("fn"):
        return normal(shape, HC_GAIN / shape[-1] ** 0.5)
    if leaf.endswith("base"):
        return normal(shape, 0.5)
    return normal(shape, 0.2, 1.0)


# --- names: transformers' saved names <-> the release's ------------------------------------
def hub_name(saved: str) -> str:
    """The release's name of one tensor transformers 5.25's save_pretrained wrote (the inverse of
    models/deepseek_v4.RENAMES, written out separately so the test checks one against the
    other)."""
    special = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
               "head.weight": "head.weight"}
    if saved in special:
        return special[saved]
    m = re.fullmatch(r"model\.hc_head\.hc_(fn|base|scale)", saved)
    if m:
        return f"hc_head_{m.group(1)}"
    m = re.fullmatch(r"model\.(layers\.\d+\.attn)\.norm\.weight", saved)
    if m:
        return f"{m.group(1)}.kv_norm.weight"
    if saved.startswith("model.layers."):
        return saved[len("model."):]
    raise ValueError(f"no release name for {saved}")


def scheme(saved: str, ndim: int, bits: int) -> str:
    """'int4' | 'int8' | 'f32' | 'keep' for the q4 / q8 references (tensors in saved names)."""
    if bits == 16:
        return "keep"
    hub = hub_name(saved)
    if hub in ("embed.weight", "head.weight"):
        return "int8"
    if hf.hub_class(hub) in ("fp4", "fp8"):
        return "int4" if bits == 4 else "int8"
    return "f32"


def scheme_table(saved: dict[str, np.ndarray]) -> dict[str, list[str]]:
    """{int4 | int8 | f32 | keep: the tensor names of each class, layer and expert numbers as L, E}."""
    out: dict[str, set[str]] = {}
    for name, w in saved.items():
        s = scheme(name, w.ndim, 4) if np.issubdtype(w.dtype, np.floating) else "keep"
        out.setdefault(s, set()).add(re.sub(r"\.experts\.\d+\.", ".experts.E.", re.sub(r"\.layers\.\d+\.", ".layers.L.", name)))
    return {k: sorted(v) for k, v in sorted(out.items())}


# --- the release's layout -------------------------------------------------------------------
def _encode(name: str, w: np.ndarray) -> dict[str, tuple[str, np.ndarray]]:
    cls = hf.hub_class(name)
    if cls == "fp4":
        packed, scale = hf.encode_fp4(w)
        return {name: ("I8", packed), hf.scale_name(name): ("F8_E8M0", scale)}
    if cls == "fp8":
        code, scale = hf.encode_fp8(w)
        ref = torch.from_numpy(hf.decode_fp8(code, np.full_like(scale, 127)))
        x = torch.from_numpy(np.asarray(w, np.float32)) / torch.from_numpy(
            hf._expand(hf.e8m0(scale), w.shape, hf.FP8_BLOCK, hf.FP8_BLOCK))
        if not torch.equal(x.to(torch.float8_e4m3fn).float(), ref):   # our RNE == torch's cast
            raise AssertionError(f"{name}: E4M3 encoding differs from torch's float8_e4m3fn cast")
        return {name: ("F8_E4M3", code), hf.scale_name(name): ("F8_E8M0", scale)}
    if cls == "i64":
        return {name: ("I64", np.asarray(w, np.int64))}
    if cls == "f32":
        return {name: ("F32", np.asarray(w, np.float32))}
    from core.safetensors_io import bf16_from_float32
    return {name: ("BF16", bf16_from_float32(w))}


_TORCH = {"I8": torch.int8, "F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu,
          "BF16": torch.bfloat16, "F32": torch.float32, "I64": torch.int64}


def _to_torch(dtype: str, arr: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(arr))
    if dtype in ("F8_E4M3", "F8_E8M0"):
        return t.view(torch.uint8).view(_TORCH[dtype])
    if dtype == "BF16":
        return t.view(torch.int16).view(torch.bfloat16)
    return t


def _mtp_block(hub: dict[str, np.ndarray], cfg: dict, gen: torch.Generator) -> dict[str, np.ndarray]:
    """One MTP block with random weights: a sliding layer's tensors (vLLM gives the MTP layer no
    compressor) with a routed, not hashed, gate under ``mtp.0.``, plus e_proj, h_proj, enorm,
    hnorm, norm and its own hc head."""
    src = f"layers.{cfg['layer_types'].index('sliding_attention')}."
    h = cfg["hidden_size"]

    def rnd(shape, std):
        return (torch.randn(tuple(shape), generator=gen) * std).numpy()
    out = {}
    for name, w in hub.items():
        if name.endswith(".ffn.gate.tid2eid"):
            name, w = name[: -len("tid2eid")] + "bias", np.zeros(cfg["n_routed_experts"], np.float32)
        if name.startswith(src):
            out["mtp.0." + name[len(src):]] = rnd(w.shape, 1.0 / w.shape[-1] ** 0.5)
    out.update({"mtp.0.e_proj.weight": rnd((h, h), h ** -0.5), "mtp.0.h_proj.weight": rnd((h, h), h ** -0.5),
                "mtp.0.enorm.weight": 1 + rnd((h,), 0.1), "mtp.0.hnorm.weight": 1 + rnd((h,), 0.1),
                "mtp.0.norm.weight": 1 + rnd((h,), 0.1)})
    for part, shape in (("fn", hub["hc_head_fn"].shape), ("base", hub["hc_head_base"].shape),
                        ("scale", hub["hc_head_scale"].shape)):
        out[f"mtp.0.hc_head_{part}"] = rnd(shape, 0.1)
    return out


def _hub_config(cfg: dict) -> dict:
    """config.json as the release writes it: DeepSeek's own field spellings (compress_ratios per
    layer with the MTP layer's entry, 0, last; num_hash_layers; qk_rope_head_dim; rope_scaling;
    topk_method noaux_tc, which vLLM reads before it loads gate.bias), expert_dtype fp4 and the
    FP8 quantization_config."""
    ratio = {"sliding_attention": 0, **cfg["compress_rates"]}
    ratios = [ratio[t] for t in cfg["layer_types"]]
    n_hash = cfg["mlp_layer_types"].count("hash_moe")
    assert cfg["mlp_layer_types"] == ["hash_moe"] * n_hash + ["moe"] * (len(ratios) - n_hash)
    compress = cfg["rope_parameters"]["compress"]
    scaling = None
    if compress["rope_type"] == "yarn":
        scaling = {"type": "yarn", **{k: compress[k] for k in (
            "factor", "original_max_position_embeddings", "beta_fast", "beta_slow") if k in compress}}
    keep = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "moe_intermediate_size",
            "n_routed_experts", "n_shared_experts", "num_experts_per_tok", "scoring_func", "norm_topk_prob",
            "routed_scaling_factor", "swiglu_limit", "sliding_window", "compress_rope_theta", "rope_theta",
            "hc_mult", "hc_sinkhorn_iters", "hc_eps", "index_n_heads", "index_head_dim", "index_topk",
            "max_position_embeddings", "rms_norm_eps", "bos_token_id", "eos_token_id", "hidden_act",
            "tie_word_embeddings", "initializer_range", "attention_bias")
    out = {k: cfg[k] for k in keep}
    out.update({"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
                "compress_ratios": ratios + [0], "num_hash_layers": n_hash, "topk_method": "noaux_tc",
                "qk_rope_head_dim": cfg["qk_rope_head_dim"], "rope_scaling": scaling,
                "num_nextn_predict_layers": 1, "expert_dtype": "fp4", "torch_dtype": "bfloat16",
                "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                        "scale_fmt": "ue8m0", "weight_block_size": [128, 128]}})
    return dict(sorted(out.items()))


def _shards(names: list[str], sharded: bool) -> dict[str, list[str]]:
    if not sharded:
        return {"model.safetensors": names}
    # three files split at layer boundaries, MTP last, as the release's index maps them
    def part(n):
        m = re.match(r"layers\.(\d+)\.", n)
        return 2 if n.startswith("mtp.") else (1 if m and int(m.group(1)) >= 2 else 0)
    files = [f"model-{i + 1:05d}-of-00003.safetensors" for i in range(3)]
    return {f: [n for n in names if part(n) == i] for i, f in enumerate(files)}


def write_hub(model_dir: str, out_dir: str, work: str, hub_spec: dict, gen: torch.Generator,
              model_cls, load_kwargs: dict):
    """Write ``out_dir`` (the release's layout of the checkpoint in ``model_dir``) and return
    transformers' model on its exactly dequantized weights plus statistics for meta.json."""
    from safetensors.numpy import load_file
    from safetensors.torch import save_file
    saved = {}
    for fn in sorted(os.listdir(model_dir)):
        if fn.endswith(".safetensors"):
            saved.update(load_file(os.path.join(model_dir, fn)))
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    src = {hub_name(n): w for n, w in saved.items()}
    src.update(_mtp_block(src, cfg, gen))
    raw: dict[str, tuple[str, np.ndarray]] = {}
    for name in sorted(src):
        raw.update(_encode(name, src[name]))

    if os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir)
    shards = _shards(sorted(raw), hub_spec.get("shard", False))
    for fn, names in shards.items():
        save_file({n: _to_torch(*raw[n]) for n in names}, os.path.join(out_dir, fn), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": int(sum(a.nbytes for _, a in raw.values()))},
                 "weight_map": {n: fn for fn, names in shards.items() for n in sorted(names)}}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(_hub_config(cfg), f, indent=2)
        f.write("\n")

    # read back what was written and decode it exactly: the reference's weights
    back = hf.read_raw(out_dir)
    if set(back) != set(raw) or any(back[n][0] != raw[n][0] or not np.array_equal(back[n][1], raw[n][1])
                                    for n in raw):
        raise AssertionError("the release-layout files do not read back as written")
    deq = hf.dequantized(back)

    # transformers loads the dequantized weights under DeepSeek's names through its own
    # conversion mapping (MTP ignored); it must land on exactly the tensors our name map says
    ddir = os.path.join(work, "hub-dequantized")
    os.makedirs(ddir)
    shutil.copy(os.path.join(model_dir, "config.json"), ddir)
    shutil.copy(os.path.join(model_dir, "generation_config.json"), ddir)
    save_file({n: torch.from_numpy(np.ascontiguousarray(w)) for n, w in deq.items()},
              os.path.join(ddir, "model.safetensors"), metadata={"format": "pt"})
    model, info = model_cls.from_pretrained(ddir, output_loading_info=True, **load_kwargs)
    model.eval()
    if info["missing_keys"] or info["mismatched_keys"] or any(
            not k.startswith("mtp.") for k in info["unexpected_keys"]):
        raise AssertionError(f"transformers did not load the release's names cleanly: {info}")
    rdir = os.path.join(work, "hub-roundtrip")
    model.save_pretrained(rdir, safe_serialization=True)
    rt = load_file(os.path.join(rdir, "model.safetensors"))
    if set(rt) != set(saved) or any(not np.array_equal(rt[n], deq[hub_name(n)]) for n in rt):
        raise AssertionError("transformers' renaming of the release's names differs from ours")
    _check_fused_experts(model, deq)

    classes: dict[str, int] = {}
    for n in src:
        classes[hf.hub_class(n)] = classes.get(hf.hub_class(n), 0) + 1
    return model, {
        "files": sorted(shards), "tensor_classes": dict(sorted(classes.items())),
        "mtp_tensors": sum(1 for n in raw if n.startswith("mtp.")),
        "safetensors_bytes": sum(os.path.getsize(os.path.join(out_dir, f)) for f in shards),
        "max_err_over_absmax_fp4": _max_rel(src, deq, "fp4"),
        "max_err_over_absmax_fp8": _max_rel(src, deq, "fp8")}


def _max_rel(src, deq, cls) -> float:
    """Largest |dequantized − original| over the tensor's largest |original| (coarse in FP4)."""
    errs = [float(np.abs(deq[n] - src[n]).max() / np.abs(src[n]).max()) for n in src
            if hf.hub_class(n) == cls and not n.startswith("mtp.")]
    return max(errs)


def _check_fused_experts(model, deq: dict[str, np.ndarray]) -> None:
    """transformers' gate_up_proj[e] is w1 (gate) over w3 (up); down_proj[e] is w2."""
    for li, layer in enumerate(model.model.layers):
        ex = layer.mlp.experts
        for e in range(ex.num_experts):
            p = f"layers.{li}.ffn.experts.{e}."
            want = np.concatenate([deq[p + "w1.weight"], deq[p + "w3.weight"]], axis=0)
            if not (np.array_equal(ex.gate_up_proj[e].detach().numpy(), want)
                    and np.array_equal(ex.down_proj[e].detach().numpy(), deq[p + "w2.weight"])):
                raise AssertionError(f"fused expert layout differs at layer {li} expert {e}")


# --- what meta.json records -----------------------------------------------------------------
class IndexerWatch(Watch):
    """Hooks on every Lightning indexer: the index scores of each query row over the compressed
    entries it may see ((t+1) // ratio of them), the gap between the k-th and (k+1)-th score where
    the top-k really chooses (more visible entries than index_topk), and a check that the
    selection equals (score desc) over the visible entries."""

    def __init__(self):
        super().__init__()
        self.gaps: dict[str, list[float]] = {}
        self.rows: dict[str, list[int]] = {}      # per pass: [rows where top-k chooses, rows]
        self.entries: set[int] = set()
        self.phase = ""
        self._scores = None

    def watch(self, model, phase: str):
        self.phase = phase
        for mod in model.modules():
            name = type(mod).__name__
            if name == "DeepseekV4IndexerScorer":
                self._undo.append(mod.register_forward_hook(self._score_hook).remove)
            elif name == "DeepseekV4Indexer":
                self._undo.append(mod.register_forward_hook(self._select_hook, with_kwargs=True).remove)
        return self

    def _score_hook(self, _mod, _args, out):
        self._scores = out.detach()[0]                          # [S, T]

    @torch.no_grad()
    def _select_hook(self, mod, args, kwargs, out):
        pos = kwargs.get("position_ids", args[2] if len(args) > 2 else None)[0]
        scores, sel = self._scores, out[0]
        self.entries.add(int(scores.shape[1]))
        k = mod.index_topk
        gaps = self.gaps.setdefault(self.phase, [])
        rows = self.rows.setdefault(self.phase, [0, 0])
        for t in range(scores.shape[0]):
            vis = scores[t, : int(pos[t] + 1) // mod.compress_rate]
            rows[1] += 1
            if len(vis) <= k:
                continue
            rows[0] += 1
            gaps.append(topk_boundary_gap(vis, k, sel[t], t))

    def summary(self) -> dict:
        return {"dsa_min_boundary_gap": {p: min(g) for p, g in sorted(self.gaps.items())},
                "dsa_boundary_ties": sum(1 for g in self.gaps.values() for x in g if x == 0.0),
                "indexer_choosing_rows": {p: f"{r[0]}/{r[1]}" for p, r in sorted(self.rows.items())},
                "compressed_entries_seen_by_indexer": sorted(self.entries)}


class ClampWatch(Watch):
    """The share of SwiGLU pre-activations the swiglu_limit clamp changes: gate > limit,
    |up| > limit, for the routed experts (tokens routed to each) and the shared experts."""

    def __init__(self):
        super().__init__()
        self.counts = {"routed_gate": [0, 0], "routed_up": [0, 0], "shared_gate": [0, 0], "shared_up": [0, 0]}

    def watch(self, model):
        experts_cls = next((type(m) for m in model.modules() if type(m).__name__ == "DeepseekV4Experts"), None)
        if experts_cls is None:           # another family: nothing to count
            return self
        original = experts_cls._apply_gate
        watch = self

        def counting(mod, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            watch._count("routed", gate, up, mod.limit)
            return original(mod, gate_up)
        experts_cls._apply_gate = counting
        self._undo.append(lambda: setattr(experts_cls, "_apply_gate", original))
        for m in model.modules():
            if type(m).__name__ == "DeepseekV4MLP":
                outs = {}
                h1 = m.gate_proj.register_forward_hook(lambda _m, _i, o, outs=outs: outs.__setitem__("g", o))
                h2 = m.up_proj.register_forward_hook(
                    lambda _m, _i, o, outs=outs, lim=m.limit: self._count("shared", outs["g"], o, lim))
                self._undo += [h1.remove, h2.remove]
        return self

    def _count(self, kind, gate, up, limit):
        for part, clipped, t in (("gate", gate > limit, gate), ("up", up.abs() > limit, up)):
            c = self.counts[f"{kind}_{part}"]
            c[0] += int(clipped.sum())
            c[1] += t.numel()

    def summary(self) -> dict:
        return {"swiglu_clamped_frac": {k: round(c[0] / c[1], 4) for k, c in self.counts.items() if c[1]}}


def derived(model) -> dict:
    """What transformers derived from the config."""
    cfg = model.config
    rot = model.model.rotary_emb
    out = {"layer_types": list(cfg.layer_types), "mlp_layer_types": list(cfg.mlp_layer_types),
           "compress_rates": dict(cfg.compress_rates), "qk_rope_head_dim": cfg.qk_rope_head_dim,
           "sliding_window": cfg.sliding_window, "softmax_scale": float(model.model.layers[0].self_attn.scaling),
           "rope_parameters": cfg.rope_parameters}
    for kind in ("main", "compress"):
        out[f"rope_inv_freq_{kind}"] = [float(x) for x in getattr(rot, f"{kind}_inv_freq")]
        out[f"rope_attention_scaling_{kind}"] = float(getattr(rot, f"{kind}_attention_scaling"))
    n = 32
    out["compressed_entries_at_32_ids"] = {t: n // r for t, r in cfg.compress_rates.items()}
    return out
