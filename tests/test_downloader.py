"""core.downloader with the real huggingface_hub client against a loopback Hub (tests/hub_server.py)."""
from __future__ import annotations

import json
import threading

import pytest

from core.downloader import DownloadCancelled, download, plan_download, read_state
from core.errors import ColiError
from tests.hub_server import HubServer, build_tiny_repo

REPO = "acme/tiny-moe"
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
WANTED = {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
          "model.safetensors.index.json", SHARD1, SHARD2}


@pytest.fixture(scope="module")
def repo_dir(tmp_path_factory):
    return build_tiny_repo(tmp_path_factory.mktemp("hub") / "repo")


@pytest.fixture
def hub(repo_dir, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))     # never the user's cache
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with HubServer() as server:
        server.add_repo(REPO, repo_dir)
        monkeypatch.setenv("HF_ENDPOINT", server.endpoint)       # read at call time
        yield server


def _same(a, b) -> bool:
    return a.read_bytes() == b.read_bytes()


def test_full_download_then_nothing_refetched(hub, repo_dir, tmp_path):
    events = []
    out = download(REPO, tmp_path / "m", progress=events.append)
    got = {p.name for p in out.iterdir() if p.is_file() and not p.name.startswith(".")}
    assert got == WANTED                                   # no README, no .bin
    assert all(_same(out / n, repo_dir / n) for n in WANTED)
    last = events[-1]
    assert last.done == last.total == sum((repo_dir / n).stat().st_size for n in WANTED)
    assert last.file_index == last.file_count - 1
    assert [e.done for e in events] == sorted(e.done for e in events)      # total never goes back
    assert read_state(out)["complete"] is True
    hub.clear()
    events.clear()
    download(REPO, out, progress=events.append)
    assert hub.requests == []                             # finished: not even the model info
    assert all(e.skipped for e in events)


def test_resume_after_interruption_across_runs(hub, repo_dir, tmp_path):
    hub.drop_after[SHARD2] = 40_000          # the connection dies once, 40 kB into the second shard
    with pytest.raises(ColiError) as err:
        download(REPO, tmp_path / "m", retries=0)
    msg = str(err.value)
    assert "\n" not in msg and "resume" in msg and "Traceback" not in msg
    assert (tmp_path / "m" / SHARD1).exists() and not (tmp_path / "m" / SHARD2).exists()
    hub.clear()
    download(REPO, tmp_path / "m")           # a new run, as after closing the app
    assert hub.gets(SHARD2) == ["bytes=40000-"]            # continued, not restarted
    for name in WANTED - {SHARD2}:
        assert hub.gets(name) == []                        # completed files are never fetched twice
    assert _same(tmp_path / "m" / SHARD2, repo_dir / SHARD2)


def test_connection_drop_is_retried_within_a_run(hub, repo_dir, tmp_path):
    hub.drop_after[SHARD1] = 20_000
    download(REPO, tmp_path / "m", retries=2)
    assert hub.gets(SHARD1) == [None, "bytes=20000-"]
    assert _same(tmp_path / "m" / SHARD1, repo_dir / SHARD1)


def test_cancel_between_chunks_keeps_the_partial_file(hub, repo_dir, tmp_path):
    cancel = threading.Event()
    hub.delay[SHARD1] = 0.01

    def progress(p):
        if p.file == SHARD1 and p.file_done > 0:
            cancel.set()
    with pytest.raises(DownloadCancelled):
        download(REPO, tmp_path / "m", progress=progress, cancel=cancel)
    parts = list((tmp_path / "m" / ".cache" / "colibri").glob(SHARD1 + ".*.part"))
    assert len(parts) == 1 and 0 < parts[0].stat().st_size < (repo_dir / SHARD1).stat().st_size
    have = parts[0].stat().st_size
    hub.clear()
    hub.delay.clear()
    download(REPO, tmp_path / "m")
    assert hub.gets(SHARD1) == [f"bytes={have}-"]
    assert _same(tmp_path / "m" / SHARD1, repo_dir / SHARD1)


def test_cdn_redirect_keeps_the_token_on_the_hub_and_resumes(hub, repo_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")
    hub.cdn = True                           # weights: 302 from /resolve/ to another host, as the Hub does
    hub.drop_after[SHARD1] = 30_000
    with pytest.raises(ColiError):
        download(REPO, tmp_path / "m", retries=0)
    download(REPO, tmp_path / "m")
    assert hub.gets(SHARD1) == [None, "bytes=30000-"]
    assert any(p.startswith("/cdn/") for _, p, _ in hub.requests)
    assert hub.auth and not any(p.startswith("/cdn/") for p in hub.auth)
    assert all(_same(tmp_path / "m" / n, repo_dir / n) for n in WANTED)


def test_corrupt_shard_is_refused_then_fetched_anew(hub, repo_dir, tmp_path):
    hub.corrupt.add(SHARD1)
    with pytest.raises(ColiError, match=f"{SHARD1} arrived corrupt"):
        download(REPO, tmp_path / "m")
    assert not (tmp_path / "m" / SHARD1).exists()
    download(REPO, tmp_path / "m")
    assert _same(tmp_path / "m" / SHARD1, repo_dir / SHARD1)


def test_clear_errors(hub, repo_dir, tmp_path):
    with pytest.raises(ColiError, match=r"acme/nope: no such model on 127\.0\.0\.1") as err:
        download("acme/nope", tmp_path / "a" / "nope")
    assert not (tmp_path / "a" / "nope").exists()              # a mistyped id leaves no empty folder
    assert "hf auth" not in str(err.value) and "HF_TOKEN" in str(err.value)   # the binary has no `hf`
    (tmp_path / "mine").mkdir()
    with pytest.raises(ColiError, match="no such model"):
        download("acme/nope", tmp_path / "mine")
    assert (tmp_path / "mine").is_dir()                        # a folder that was there stays
    hub.gated.add(REPO)
    with pytest.raises(ColiError, match=r"acme/tiny-moe is gated: accept its terms on 127\.0\.0\.1.*, then set "
                                        r"HF_TOKEN to an access token from http://127\.0\.0\.1:\d+/settings/tokens"):
        download(REPO, tmp_path / "g")
    hub.gated.clear()
    with pytest.raises(ColiError, match="not a Hugging Face repo id"):
        plan_download("not a repo!")

    def refuse(cfg):
        raise ColiError(f"unsupported model_type {cfg['model_type']!r}")
    with pytest.raises(ColiError, match="unsupported model_type 'qwen3_moe'"):
        download(REPO, tmp_path / "b", validate_config=refuse)
    assert not (tmp_path / "b" / SHARD1).exists()          # refused before the weights
    hub.stop()
    with pytest.raises(ColiError, match="cannot reach 127.0.0.1"):
        download(REPO, tmp_path / "c", retries=0)


def test_unsupported_family_from_the_real_registry(tmp_path, monkeypatch):
    from models import validate_config
    d = build_tiny_repo(tmp_path / "mixtral")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "mixtral"}))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    with HubServer() as hub:
        hub.add_repo("acme/mixtral", d)
        with pytest.raises(ColiError, match="unsupported model_type 'mixtral'"):
            download("acme/mixtral", tmp_path / "out", endpoint=hub.endpoint, validate_config=validate_config)


def test_disk_full_is_one_line(hub, tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(ColiError, match=r"not enough free space in .*: the download needs 0\.00 GB more"):
        download(REPO, tmp_path / "m")


def test_catalog_numbers_match_the_estimate_and_fit_check():
    """Every entry's stored numbers are the family-layout estimate of its config (tests/test_catalog.py
    checks that estimate against what `coli convert` writes)."""
    from models import supported_types
    from models.catalog import estimate, fit, load
    entries = load(include_pending=True)
    assert {e.family for e in entries} <= set(supported_types())
    assert any(e.repo == "allenai/OLMoE-1B-7B-0924" for e in entries)
    assert any(e.repo == "Qwen/Qwen3-30B-A3B" for e in entries)
    for e in entries:
        assert e.config, e.repo
        est = estimate(e.config, e.family)
        for k in ("params_b", "active_b", "disk_gb", "download_gb", "active_expert_gb", "min_ram_gb",
                  "dense_gb", "mtp_gb", "kv_bytes_per_pos"):
            assert abs(getattr(e, k) - est[k]) <= 0.03 * est[k] + 0.01, (e.repo, k, getattr(e, k), est[k])
    olmoe = next(e for e in entries if e.repo == "allenai/OLMoE-1B-7B-0924")
    assert 6.5 < olmoe.params_b < 7.5 and 1.0 < olmoe.active_b < 1.5
    big = next(e for e in entries if e.repo == "Qwen/Qwen3-235B-A22B")
    G = 10**9
    assert fit(olmoe, ".", available_ram=64 * G, free=10**12).verdict == "ram"
    s = fit(big, ".", available_ram=32 * G, free=10**13)
    assert s.verdict == "stream" and 0 < s.tok_s < 5 and "tok/s" in s.text
    assert fit(big, ".", available_ram=32 * G, free=100 * G).verdict == "no-disk"
    assert fit(big, ".", available_ram=4 * G, free=10**13).verdict == "no-ram"


def test_coli_download_command(hub, repo_dir, tmp_path):
    """`coli download` drives the same downloader (and refuses an unknown repo in one line)."""
    from colibri_tui.cli import main
    assert main(["download", REPO, "--dir", str(tmp_path / "dl")]) == 0
    assert all(_same(tmp_path / "dl" / n, repo_dir / n) for n in WANTED)
    assert main(["download", "nobody/nothing", "--dir", str(tmp_path / "x")]) == 1
