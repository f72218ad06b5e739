"""Shard checksums (core.integrity): recorded at conversion, checked by `coli verify` (issue 16)."""
from __future__ import annotations

import json
import shutil

import pytest

from core import converter as conv
from core.integrity import shard_digest, verify
from models import validate_config
from tests.conftest import ROOT, tiny_config, write_hf_model


def _convert(src, out, **kw):
    return conv.convert(src, out, validate_config=validate_config, **kw)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify")
    src = write_hf_model(d / "src", tiny_config(num_hidden_layers=3))
    return _convert(src, d / "c")


def test_conversion_records_every_shard_and_verify_passes(converted):
    m = json.loads((converted / "colibri.json").read_text())
    assert set(m["checksums"]) == set(m["shards"]) and len(m["shards"]) == 4
    for s in m["shards"]:
        assert m["checksums"][s]["sha256"] == shard_digest(converted / s)
    r = verify(converted)
    assert r.ok and r.checked == m["shards"]


def test_a_flipped_byte_in_any_shard_is_found(converted, tmp_path):
    shards = json.loads((converted / "colibri.json").read_text())["shards"]
    for s in shards:
        bad = tmp_path / s.replace(".", "_")
        shutil.copytree(converted, bad)
        data = bytearray((bad / s).read_bytes())
        data[len(data) * 2 // 3] ^= 0x10          # one bit, in the tensor data
        (bad / s).write_bytes(bytes(data))
        r = verify(bad)
        assert not r.ok and r.damaged == [f"{s}: checksum mismatch (the file's bytes changed)"], r
        assert len(r.checked) == len(shards) - 1


def test_a_missing_shard_and_an_unrecorded_container(converted, tmp_path):
    bad = tmp_path / "m"
    shutil.copytree(converted, bad)
    (bad / "layer-001.safetensors").unlink()
    assert verify(bad).damaged == ["layer-001.safetensors: missing"]
    old = tmp_path / "old"
    shutil.copytree(converted, old)
    m = json.loads((old / "colibri.json").read_text())
    del m["checksums"]
    (old / "colibri.json").write_text(json.dumps(m))
    r = verify(old)
    assert r.unrecorded and not r.ok


def test_a_resumed_conversion_from_an_older_journal_still_records_checksums(tmp_path):
    """Shards an older converter finished (journal entries `true`, no digest) are hashed at the end."""
    src = write_hf_model(tmp_path / "src", tiny_config())

    def stop(p):
        if p.shard_index == 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        _convert(src, tmp_path / "out", progress=stop)
    journal = tmp_path / "out" / conv.JOURNAL
    j = json.loads(journal.read_text())
    assert all(isinstance(v, dict) for v in j["done"].values()) and j["done"]
    j["done"] = {k: True for k in j["done"]}
    journal.write_text(json.dumps(j))
    _convert(src, tmp_path / "out")
    assert verify(tmp_path / "out").ok


def test_the_demo_model_carries_its_checksums():
    demo = ROOT / "models" / "demo" / "qwen3-moe-demo"
    if not (demo / "colibri.json").exists():
        pytest.skip("no embedded demo model")
    assert verify(demo).ok


# --- coli verify ---------------------------------------------------------------------------------
def test_coli_verify_passes_and_names_a_flipped_byte(converted, tmp_path, capsys):
    from colibri_tui.cli import main as coli
    capsys.readouterr()
    assert coli(["verify", "--model", str(converted)]) == 0
    assert "all 4 shards match" in capsys.readouterr().err
    bad = tmp_path / "bad"
    shutil.copytree(converted, bad)
    shard = bad / "layer-002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 1
    shard.write_bytes(bytes(data))
    assert coli(["verify", "--model", str(bad), "--json"]) == 1
    out, err = capsys.readouterr()
    assert json.loads(out)["damaged"] == ["layer-002.safetensors: checksum mismatch (the file's bytes changed)"]
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("coli: error: 1 of 4 shards") and "layer-002" in lines[0]


def test_coli_verify_on_a_container_without_checksums(converted, tmp_path, capsys):
    from colibri_tui.cli import main as coli
    old = tmp_path / "old"
    shutil.copytree(converted, old)
    m = json.loads((old / "colibri.json").read_text())
    del m["checksums"]
    (old / "colibri.json").write_text(json.dumps(m))
    capsys.readouterr()
    assert coli(["verify", "--model", str(old)]) == 1
    assert "no recorded checksums" in capsys.readouterr().err


def test_coli_verify_shows_progress_on_a_terminal(converted):
    """On a terminal the progress bar takes verify's (done, total, shard) events."""
    import os
    import pty
    import subprocess
    import sys
    m, s = pty.openpty()
    r = subprocess.run([sys.executable, "-m", "colibri_tui", "verify", "--model", str(converted)],
                       stdin=s, stdout=s, stderr=s, timeout=120, cwd=ROOT)
    os.close(s)
    out = b""
    try:
        while True:
            chunk = os.read(m, 65536)
            if not chunk:
                break
            out += chunk
    except OSError:
        pass
    os.close(m)
    assert r.returncode == 0, out.decode(errors="replace")[-2000:]
    assert b"all 4 shards match" in out
