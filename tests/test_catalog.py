"""The catalog's size estimate (models.catalog.estimate: the family's own layout) against what
`coli convert --bits 4` really writes for the real tiny checkpoints of each family
(tests/oracle/fixtures), MTP layers included; and the fit check / wizard with the huge entries
(GLM-5: ~420 GB at int4, 1.5 TB to download)."""
from __future__ import annotations

import asyncio
import json
import math
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import wait_for

FIXTURES = Path(__file__).resolve().parent / "oracle" / "fixtures"
G = 10**9


def data_bytes(path: Path) -> tuple[int, int, int]:
    """(tensor bytes, routed-expert tensor bytes, header bytes) of one safetensors file."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    total = experts = 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        b = info["data_offsets"][1] - info["data_offsets"][0]
        total += b
        experts += b if ".experts." in name else 0          # mlp.experts / kimi's block_sparse_moe.experts
    return total, experts, 8 + n


def _offsets(path: Path) -> dict[str, tuple[int, int]]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return {k: tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__"}


def container_bytes(out: Path, mtp: bool = False) -> tuple[int, int, int]:
    shards = [p for p in sorted(out.glob("*.safetensors")) if p.name.startswith("mtp-") == mtp]
    sums = [data_bytes(p) for p in shards]
    return tuple(sum(s[i] for s in sums) for i in range(3))


def no_mtp(config: dict) -> dict:
    """transformers' tiny checkpoints declare an MTP layer they do not carry."""
    return {k: v for k, v in config.items() if k != "num_nextn_predict_layers"}


@pytest.mark.parametrize("fixture", ["glm4moe-a", "glm4moe-b", "deepseekv3-a", "deepseekv3-b",
                                     "glmdsa-a", "glmdsa-b", "olmoe-a", "qwen3moe-a",
                                     "qwen35moe-a", "qwen35moe-b", "kimilinear-a", "kimilinear-b"])
def test_the_estimate_is_what_coli_convert_writes(fixture, tmp_path):
    from core.converter import convert
    from models.catalog import GB, estimate
    src = FIXTURES / fixture / "model"
    config = no_mtp(json.loads((src / "config.json").read_text()))
    from models import validate_config
    out = convert(src, tmp_path / "c", bits=4, validate_config=validate_config)   # as coli convert:
    total, experts, headers = container_bytes(out)     # the family's spec drops a vision tower
    est = estimate(config)
    b = est["bytes"]
    assert (b["total"], b["experts"], b["dense"]) == (total, experts, total - experts)      # byte for byte
    files = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert files == total + headers                        # the rest of the files is their headers
    assert abs(est["disk_gb"] * GB - files) <= headers
    # the download: the source's tensors (float32 here, the config's dtype)
    # (a composite checkpoint's vision tower, which the family drops, is not counted: see below)
    visual = sum(e - s for p in src.glob("*.safetensors") for n, (s, e) in _offsets(p).items()
                 if n.startswith("model.visual."))
    assert b["source"] == sum(data_bytes(p)[0] for p in src.glob("*.safetensors")) - visual
    assert (visual > 0) == (fixture == "qwen35moe-b")
    # one token's routed experts: top_k x MoE layers x one expert, from the container's own index
    from core.container import Container
    c = Container(out)
    per_expert = {k: v.end - v.start for k, v in c.experts.items()}
    sizes = set(per_expert.values())
    assert len(sizes) == 1
    moe_layers = len({layer for layer, _ in per_expert})
    from models import family_for
    top_k = family_for(config).spec(config).top_k        # num_experts_per_tok, or kimi's alias
    assert est["active_expert_gb"] * GB == pytest.approx(top_k * moe_layers * sizes.pop())


@pytest.mark.parametrize("fixture", ["glm4moe-a", "deepseekv3-a", "glmdsa-a"])
def test_mtp_layers_count_in_the_download_and_go_aside_in_the_container(fixture, tmp_path):
    """A checkpoint with its MTP layer as the Hub ships it (GLM: one more decoder layer + eh_proj
    and norms; DeepSeek-V3: also copies of the embedding and head): the download estimate counts
    it, the container estimate does not, mtp_gb is what `coli convert` writes to mtp-* shards."""
    from safetensors.numpy import save_file

    from core.converter import convert
    from models.catalog import GB, estimate
    from models.registry import family_for, validate_config
    src = tmp_path / "src"
    shutil.copytree(FIXTURES / fixture / "model", src)
    config = {**json.loads((src / "config.json").read_text()), "num_nextn_predict_layers": 1}
    (src / "config.json").write_text(json.dumps(config))      # GLM-5's says so; the tiny one does not
    fam = family_for(config)
    extra = fam.mtp_tensors(fam.spec(config), config)
    assert extra and all(n.startswith(f"model.layers.{config['num_hidden_layers']}.") for n, _ in extra)
    rng = np.random.default_rng(0)
    save_file({n: rng.standard_normal(s).astype(np.float32) for n, s in extra},
              str(src / "model-mtp.safetensors"))
    index_path = src / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
        index["weight_map"].update({n: "model-mtp.safetensors" for n, _ in extra})
        index_path.write_text(json.dumps(index))
    out = convert(src, tmp_path / "c", bits=4, validate_config=validate_config)
    est = estimate(config)
    assert est["bytes"]["total"] == container_bytes(out)[0]
    assert est["bytes"]["mtp"] == container_bytes(out, mtp=True)[0] > 0
    assert est["bytes"]["source"] == sum(data_bytes(p)[0] for p in src.glob("*.safetensors"))
    assert json.loads((out / "colibri.json").read_text())["mtp"]["groups"]
    assert est["mtp_gb"] * GB == est["bytes"]["mtp"]


def test_latent_and_kv_cache_bytes_per_position():
    """GQA keeps keys and values; MLA the latent + RoPE key (576 values for DeepSeek-V3 and GLM-5);
    GLM-5's DSA adds its indexer's 128-value key, on every layer ("full" by default)."""
    from models.catalog import load
    entries = {e.repo: e for e in load(include_pending=True)}
    assert entries["zai-org/GLM-4.5-Air"].kv_bytes_per_pos == 46 * 2 * 8 * 128 * 4
    assert entries["deepseek-ai/DeepSeek-V3.1"].kv_bytes_per_pos == 61 * (512 + 64) * 4
    assert entries["moonshotai/Kimi-K2-Instruct"].kv_bytes_per_pos == 61 * (512 + 64) * 4
    glm5 = entries["zai-org/GLM-5"]
    assert glm5.kv_bytes_per_pos == 78 * (512 + 64 + 128) * 4
    assert glm5.context_positions == 4096 and glm5.context_gb == pytest.approx(78 * 704 * 4 * 4096 / G)



def test_hybrid_entries_count_the_fixed_state_once():
    """Qwen3.6-35B-A3B (30 Gated DeltaNet + 10 attention layers) and Kimi-Linear (20 KDA + 7 MLA):
    only the full layers grow per position; the linear layers' conv + recurrent state (float32) is
    counted once, in the reserved context, min RAM and the fit line, whatever the context."""
    from models.catalog import estimate, fit, load
    every = {e.repo: e for e in load(include_pending=True)}
    qwen, kimi = every["Qwen/Qwen3.6-35B-A3B"], every["moonshotai/Kimi-Linear-48B-A3B-Instruct"]
    assert qwen.kv_bytes_per_pos == 10 * 2 * 2 * 256 * 4                  # 10 full layers' K + V
    assert qwen.state_bytes == 30 * ((2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128) * 4
    assert kimi.kv_bytes_per_pos == 7 * (512 + 64) * 4                     # 7 MLA layers' latent
    assert kimi.state_bytes == 20 * (3 * 32 * 128 * 3 + 32 * 128 * 128) * 4
    assert not kimi.pending and not qwen.pending      # Kimi's tiktoken.model: core/tiktoken_bpe.py
    for e in (qwen, kimi):
        est = estimate(e.config, e.family)
        assert est["state_bytes"] == e.state_bytes
        assert e.context_gb == pytest.approx((e.kv_bytes_per_pos * 4096 + e.state_bytes) / G)
        assert e.context_gb == pytest.approx(est["context_gb"])
        assert 0 < est["active_expert_gb"] < 1 and est["dense_gb"] < 2      # experts under any ffn prefix
    assert 34 < qwen.params_b < 36 and 3 < qwen.active_b < 4 and qwen.mtp_gb > 0
    assert 48 < kimi.params_b < 50 and 3 < kimi.active_b < 4
    s = fit(qwen, ".", available_ram=32 * G, free=200 * G)
    assert s.verdict == "ram" and "4096-token context 0.2 GB (fixed state 0.07 GB)" in s.text

def test_huge_entries_numbers_and_fit():
    """GLM-5 (744B-A40B): ~420 GB at int4, a 1.5 TB BF16 download; DeepSeek-V3.1 671B; Kimi-K2 1T.
    The fit check streams them, or says what is missing."""
    from models.catalog import fit, load
    offered = {e.repo: e for e in load()}
    every = {e.repo: e for e in load(include_pending=True)}
    assert "moonshotai/Kimi-K2-Instruct" in offered and not every["moonshotai/Kimi-K2-Instruct"].pending
    glm5 = offered["zai-org/GLM-5"]
    assert 740 < glm5.params_b < 748 and 39 < glm5.active_b < 43
    assert 400 < glm5.disk_gb < 440 and 1450 < glm5.download_gb < 1550 and glm5.mtp_gb > 0
    assert 670 < offered["deepseek-ai/DeepSeek-V3.1"].params_b < 672
    assert 1000 < every["moonshotai/Kimi-K2-Instruct"].params_b < 1050
    s = fit(glm5, ".", available_ram=128 * G, free=3000 * G)
    assert s.verdict == "stream" and 0 < s.tok_s < 1 and "streams from disk" in s.text
    assert "4096-token context 0.9 GB" in s.text
    assert s.need_disk_gb == pytest.approx(glm5.download_gb + glm5.disk_gb + glm5.mtp_gb)
    d = fit(glm5, ".", available_ram=128 * G, free=1000 * G)
    assert d.verdict == "no-disk" and d.short == "too little disk" and "needs 1933 GB" in d.text
    r = fit(glm5, ".", available_ram=16 * G, free=3000 * G)
    assert r.verdict == "no-ram" and f"{glm5.min_ram_gb:.0f} GB" in r.text
    # a machine that holds it all: in RAM
    assert fit(glm5, ".", available_ram=1000 * G, free=3000 * G).verdict == "ram"


# --- the wizard lists it ---------------------------------------------------------------------------
from tests.test_wizard import env, make_app, repo_dir, wizard_shown  # noqa: E402,F401  (fixtures)


def test_the_wizard_lists_glm5_streaming(env, monkeypatch):
    """The catalog with GLM-5 on a 64 GB machine with 3 TB free: its row says it streams, the line
    under the table gives the speed and the 4096-token context's cost; Kimi-K2 is offered too."""
    from collections import namedtuple

    import psutil

    from models import catalog
    pytest.importorskip("textual")
    monkeypatch.setattr(catalog, "CATALOG", Path(catalog.__file__).resolve().parent / "catalog.toml")
    VM = namedtuple("VM", "total available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM(64 * G, 60 * G))
    monkeypatch.setattr(catalog, "free_disk", lambda directory: 3000 * G)

    async def run():
        app = make_app()
        async with app.run_test(size=(130, 45)) as pilot:
            await wait_for(pilot, lambda: wizard_shown(app))
            wiz = app.screen
            table = wiz.query_one("#catalog")
            await wait_for(pilot, lambda: table.row_count > 0)
            keys = [r.key.value for r in table.ordered_rows]
            assert "zai-org/GLM-5" in keys and "moonshotai/Kimi-K2-Instruct" in keys
            row = keys.index("zai-org/GLM-5")
            cells = [str(c) for c in table.get_row("zai-org/GLM-5")]
            assert "743.9B (41.8B)" in cells and any(c.startswith("streams ≈") for c in cells)
            assert "419.8 GB" in cells and "1507.7 GB" in cells           # int4 container, BF16 download
            table.move_cursor(row=row)
            await pilot.pause()
            detail = str(wiz.query_one("#fit-detail").render())
            assert "zai-org/GLM-5 · streams from disk" in detail and "4096-token context 0.9 GB" in detail
    asyncio.run(run())


# --- DeepSeek-V4-Flash: FP4 experts kept as shipped, the dense part as the converter stores it -----
def test_dsv4_flash_entry_counts_fp4_experts_natively_and_the_dense_part_by_class():
    """Converted with the defaults (--bits 16 for a release with FP4 experts), the routed experts
    stay FP4 (E2M1 two a byte + a UE8M0 byte per 32 values) in the container as in the download,
    the FP8 dense part is widened to F32; --bits 4 / 8 requantize everything by the converter's
    class rule (tensors the blocks read as numbers F32); the MTP block goes aside."""
    from models.catalog import GB, estimate, load
    e = next(x for x in load() if x.repo == "deepseek-ai/DeepSeek-V4-Flash")
    assert e.family == "deepseek_v4" and "FP4 experts kept as shipped" in e.note
    est = estimate(e.config, e.family)
    one = 2048 * 4096 // 2 + 2048 * 4096 // 32          # one expert matrix [2048, 4096] / [4096, 2048]
    assert est["bytes"]["experts"] == 43 * 256 * 3 * one
    assert est["active_expert_gb"] * GB == pytest.approx(43 * 6 * 3 * one)
    assert 283 < e.params_b < 286 and 13 < e.active_b < 15             # 284B-A13B
    four, eight = (estimate(e.config, e.family, bits=b) for b in (4, 8))
    assert four["bytes"]["experts"] > est["bytes"]["experts"]        # int4-g64: 0.5625 bytes a weight
    assert est["bytes"]["dense"] > eight["bytes"]["dense"] > four["bytes"]["dense"]   # F32, int8, int4
    # the cache: 21 CSA layers (entries 512 + indexer 128 values per 4 positions) + 20 HCA (512 / 128)
    assert e.kv_bytes_per_pos == 21 * (512 + 128) * 4 // 4 + 20 * 512 * 4 // 128
    assert est["mtp_gb"] > 0 and e.state_bytes > 43 * 128 * 512 * 4   # the window rings, fixed


def test_dsv4_estimate_is_what_coli_convert_writes(tmp_path):
    """On the tiny transformers-layout DeepSeek V4 (float32, no FP4): byte for byte, the hash
    tables aside (integers kept as stored: I64 here, counted at 4 bytes as the release's int32)."""
    from core.converter import convert
    from models import validate_config
    from models.catalog import estimate
    src = FIXTURES / "dsv4-a" / "model"
    config = no_mtp(json.loads((src / "config.json").read_text()))
    out = convert(src, tmp_path / "c", bits=4, validate_config=validate_config)
    total, experts, _ = container_bytes(out)
    b = estimate(config)["bytes"]
    tables = 2 * config["vocab_size"] * config["num_experts_per_tok"]    # two hash layers' tid2eid
    assert (b["total"] + 4 * tables, b["experts"]) == (total, experts)


def test_dsv4_hub_layout_estimate_is_what_coli_convert_writes(tmp_path):
    """The release's layout (tiny dsv4-a/hub: FP4 experts, FP8 dense with UE8M0 scales, an MTP
    block): the download is the estimate; converted with the defaults, the container and its MTP
    shards are too, the experts in their native FP4 bytes (the hash tables aside, as above)."""
    from core.converter import convert
    from core.errors import ColiError
    from models import validate_config
    from models.catalog import estimate
    src = FIXTURES / "dsv4-a" / "hub"
    config = json.loads((src / "config.json").read_text())
    b = estimate(config)["bytes"]
    # the download: byte for byte but for the parameters the release keeps F32 (hc_*, ape, sinks,
    # gate biases: counted at BF16, tens of MB at Flash's size) and the I64 hash tables (BF16 here)
    with open(src / "model.safetensors", "rb") as f:
        header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
    header.pop("__metadata__", None)
    values = {d: sum(math.prod(v["shape"]) for v in header.values() if v["dtype"] == d) for d in ("F32", "I64")}
    assert b["source"] + 2 * values["F32"] + 6 * values["I64"] == data_bytes(src / "model.safetensors")[0]
    try:
        out = convert(src, tmp_path / "c", validate_config=validate_config)
    except ColiError as e:
        if "unsupported dtype" in str(e):
            pytest.skip(f"this converter does not read the release's layout yet ({e})")
        raise
    total, experts, _ = container_bytes(out)
    # as shipped (--bits 16): the same F32 / I64 under-count as the download's, FP8 widened to F32
    off = {part: sum(2 * math.prod(v["shape"]) if v["dtype"] == "F32" else 6 * math.prod(v["shape"])
                     for n, v in header.items() if v["dtype"] in ("F32", "I64") and n.startswith("mtp.") == part)
           for part in (False, True)}
    assert (b["total"] + off[False], b["experts"], b["mtp"] + off[True]) == (total, experts, container_bytes(out, mtp=True)[0])


def test_the_wizard_shows_dsv4_flash(env, monkeypatch):
    """On a 64 GB machine with 2 TB free, DeepSeek-V4-Flash's row: 284B (13.8B active), a 173.5 GB
    container (FP4 experts as shipped, FP8 dense widened), streaming; the detail line gives the
    small cache."""
    from collections import namedtuple

    import psutil

    from models import catalog
    pytest.importorskip("textual")
    monkeypatch.setattr(catalog, "CATALOG", Path(catalog.__file__).resolve().parent / "catalog.toml")
    VM = namedtuple("VM", "total available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM(64 * G, 60 * G))
    monkeypatch.setattr(catalog, "free_disk", lambda directory: 2000 * G)
    repo = "deepseek-ai/DeepSeek-V4-Flash"

    async def run():
        app = make_app()
        async with app.run_test(size=(130, 45)) as pilot:
            await wait_for(pilot, lambda: wizard_shown(app))
            wiz = app.screen
            table = wiz.query_one("#catalog")
            await wait_for(pilot, lambda: table.row_count > 0)
            keys = [r.key.value for r in table.ordered_rows]
            cells = [str(c) for c in table.get_row(repo)]
            assert "284.3B (13.8B)" in cells and "173.5 GB" in cells and "159.5 GB" in cells
            assert any(c.startswith("streams ≈") for c in cells)
            table.move_cursor(row=keys.index(repo))
            await pilot.pause()
            detail = str(wiz.query_one("#fit-detail").render())
            assert f"{repo} · streams from disk" in detail
            assert "4096-token context 0.1 GB (fixed state 0.02 GB)" in detail
    asyncio.run(run())
