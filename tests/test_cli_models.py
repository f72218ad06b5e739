"""CLI housekeeping: help on every flag, the files `coli --help` names, the app log, shell
completion (run in a real bash), `coli list` / `coli rm`, a GGUF given as --model, and models
taken from a Hugging Face cache (filled by the real huggingface_hub client from tests/hub_server.py)."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, tiny_config, tokenizer_files, write_hf_model
from tests.hub_server import HubServer, build_tiny_repo

REPO = "acme/tiny-moe"


@pytest.fixture
def home(tmp_path, monkeypatch):
    """The user's dirs, all under tmp (and the same for child processes)."""
    env = {"COLI_DATA_DIR": tmp_path / "data", "COLI_CONFIG_DIR": tmp_path / "config",
           "COLI_LOG_DIR": tmp_path / "log", "HF_HOME": tmp_path / "hf-home"}
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))
    for k in ("COLI_MODEL", "COLI_RAM_GB", "HF_HUB_OFFLINE", "HF_HUB_CACHE"):
        monkeypatch.delenv(k, raising=False)
    return tmp_path


def coli(*args, input=None):
    return subprocess.run([sys.executable, "-m", "colibri_tui", *map(str, args)], cwd=ROOT, env=os.environ.copy(),
                          capture_output=True, text=True, timeout=300, input=input)


def one_error_line(r, message):
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("coli: error: ") and message in lines[0], r.stderr


# --- help, files, log ----------------------------------------------------------------------------

def _walk(parser, path=("coli",)):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            helps = {c.dest: c.help for c in a._choices_actions}
            for name, sub in a.choices.items():
                yield (*path, name), "(the command)", helps.get(name)
                yield from _walk(sub, (*path, name))
        elif not isinstance(a, argparse._HelpAction):
            yield path, "/".join(a.option_strings) or a.dest, a.help


def test_every_flag_and_command_has_help():
    from colibri_tui.cli import build_parser
    items = list(_walk(build_parser()))
    assert len(items) > 60                                     # the walk reaches every subcommand
    missing = [f"{' '.join(p)} {flag}" for p, flag, h in items if not (h and h.strip())]
    assert missing == []


def test_policy_help_names_all_four_policies():
    from colibri_tui.cli import build_parser
    from core.policies import POLICY_NAMES
    assert len(POLICY_NAMES) == 4
    for cmd in ("run", "logits", "chat"):
        sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[cmd]
        (pol,) = [a for a in sub._actions if "--policy" in a.option_strings]
        assert all(n in pol.help for n in POLICY_NAMES), (cmd, pol.help)


def test_help_names_the_config_and_log_files_and_errors_go_to_the_log(home):
    from colibri_tui.paths import log_path
    r = coli("--help")
    assert r.returncode == 0
    flat = " ".join(r.stdout.split())
    assert str(home / "config" / "config.toml") in flat and str(home / "log" / "colibri.log") in flat
    assert log_path() == home / "log" / "colibri.log"
    one_error_line(coli("run", "--model", home / "nowhere", "hi"), "no such model directory")
    log = (home / "log" / "colibri.log").read_text()
    assert "colibri.cli INFO" in log and "no such model directory" in log and " hi" not in log


def test_policy_is_checked_by_the_parser(home):
    one_error_line(coli("run", "--policy", "belady", "hi"), "invalid choice: 'belady'")


# --- shell completion ----------------------------------------------------------------------------

def _complete(script: str, words: list[str], cwd) -> list[str]:
    """Run the generated bash completion for the command line ``words`` (the last is being typed)."""
    prog = (script + "\nCOMP_WORDS=(" + " ".join(f"'{w}'" for w in words) + ")\n"
            f"COMP_CWORD={len(words) - 1}\n_coli\nprintf '%s\\n' \"${{COMPREPLY[@]}}\"\n")
    r = subprocess.run(["bash", "--norc", "--noprofile"], input=prog, cwd=cwd, capture_output=True,
                       text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return [w for w in r.stdout.splitlines() if w]


def test_bash_completion_completes_commands_flags_choices_and_files(home, tmp_path):
    r = coli("completion", "bash")
    assert r.returncode == 0 and "complete -o filenames" in r.stdout
    script = r.stdout
    assert set(_complete(script, ["coli", "r"], tmp_path)) == {"run", "replay", "rm"}
    assert "--max-new-tokens" in _complete(script, ["coli", "run", "--max"], tmp_path)
    assert _complete(script, ["coli", "run", "--policy", ""], tmp_path) == ["lru", "lfru", "markov", "pinned"]
    assert _complete(script, ["coli", "convert", "x", "y", "--bits", ""], tmp_path) == ["4", "8", "16"]
    (tmp_path / "model-dir").mkdir()
    assert _complete(script, ["coli", "run", "--model", "mod"], tmp_path) == ["model-dir"]
    assert _complete(script, ["coli", "run", "--seed", "mod"], tmp_path) == []      # a number, not a file
    assert _complete(script, ["coli", "completion", ""], tmp_path) == ["bash", "zsh", "fish"]


def test_zsh_and_fish_scripts_cover_every_command(home):
    from colibri_tui.cli import build_parser
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    zsh, fish = coli("completion", "zsh").stdout, coli("completion", "fish").stdout
    assert zsh.startswith("# coli zsh") and "bashcompinit" in zsh and "complete -o filenames -F _coli coli" in zsh
    for name in sub.choices:
        assert f"-a {name} -d" in fish
    assert "-l policy -x -a 'lru lfru markov pinned'" in fish
    one_error_line(coli("completion", "tcsh"), "invalid choice: 'tcsh'")


# --- GGUF ----------------------------------------------------------------------------------------

def test_a_gguf_file_as_model_gets_a_clear_line(home):
    gguf = home / "model-Q4_K_M.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)
    msg = "GGUF is not supported yet: convert the Hugging Face checkpoint with coli convert"
    for args in (("run", "--model", gguf, "hi"), ("info", "--model", gguf), ("plan", "--model", gguf)):
        one_error_line(coli(*args), msg)
    other = home / "notes.txt"
    other.write_text("x")
    one_error_line(coli("info", "--model", other), "--model takes a colibrì container directory")
    from core.errors import ColiError
    from models import open_model
    with pytest.raises(ColiError, match="GGUF is not supported yet"):
        open_model(gguf)                                       # the app opens models this way


# --- coli list / coli rm -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_src(tmp_path_factory):
    src = tmp_path_factory.mktemp("src") / "hf"
    src.mkdir()
    write_hf_model(src, tiny_config(vocab_size=tokenizer_files(src, 300)))
    return src


def test_list_then_rm_asks_and_removes_only_containers(home, hf_src):
    assert coli("convert", hf_src, home / "mine" / "tiny-a").returncode == 0     # recorded by convert
    from colibri_tui.wizard import default_base_dir
    assert coli("convert", hf_src, default_base_dir() / "tiny-b", "--bits", "8").returncode == 0
    r = coli("list", "--json")
    models = {m["name"]: m for m in json.loads(r.stdout)}
    assert {"tiny-a", "tiny-b", "qwen3-moe-demo"} <= set(models)
    assert models["tiny-a"]["family"] == "qwen3_moe" and models["tiny-a"]["size_bytes"] > 10_000
    assert models["tiny-a"]["path"] == str((home / "mine" / "tiny-a").resolve())
    assert models["qwen3-moe-demo"]["demo"] is True
    table = coli("list").stdout
    assert table.splitlines()[0].split() == ["NAME", "FAMILY", "SIZE", "WHERE"] and "tiny-a" in table

    one_error_line(coli("rm", "tiny-a"), "pass --yes")          # no terminal, no --yes: nothing happens
    assert (home / "mine" / "tiny-a" / "colibri.json").exists()
    one_error_line(coli("rm", "qwen3-moe-demo", "--yes"), "is the embedded demo model")
    one_error_line(coli("rm", hf_src, "--yes"), "is not a colibrì container")
    assert (hf_src / "config.json").exists()
    one_error_line(coli("rm", "nothing-here", "--yes"), "no such model (see `coli list`)")

    r = coli("rm", "tiny-a", "--yes")
    assert r.returncode == 0 and "removed " + str((home / "mine" / "tiny-a").resolve()) in r.stderr
    assert not (home / "mine" / "tiny-a").exists()
    assert "tiny-a" not in {m["name"] for m in json.loads(coli("list", "--json").stdout)}


def test_rm_of_the_configured_model_resets_the_config(home, hf_src):
    from colibri_tui import settings as settings_mod
    out = home / "models" / "cfg"
    assert coli("convert", hf_src, out).returncode == 0
    s = settings_mod.Settings(model=str(out))
    settings_mod.save(s)
    assert json.loads(coli("list", "--json").stdout)[0]["configured"] is True
    r = coli("rm", out, "-y")
    assert r.returncode == 0 and "config now opens the demo model" in r.stderr
    assert settings_mod.load().model == ""


# --- the Hugging Face cache ----------------------------------------------------------------------

@pytest.fixture
def hub_cache(home, tmp_path):
    """REPO in a Hugging Face cache under HF_HOME, put there by huggingface_hub itself."""
    from huggingface_hub import snapshot_download
    repo_dir = build_tiny_repo(tmp_path / "repo")
    with HubServer() as hub:
        hub.add_repo(REPO, repo_dir)
        snap = Path(snapshot_download(REPO, cache_dir=home / "hf-home" / "hub", endpoint=hub.endpoint))
        hub.clear()
        yield hub, snap


def test_convert_takes_a_repo_id_from_the_hf_cache(hub_cache, home, monkeypatch):
    hub, snap = hub_cache
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    r = coli("convert", REPO, home / "c")
    assert r.returncode == 0, r.stderr
    assert "from the Hugging Face cache" in r.stderr and (home / "c" / "colibri.json").exists()
    assert json.loads((home / "c" / "colibri.json").read_text())["converter"]["params"]["source"] == str(snap.resolve())
    assert hub.requests == []                                  # nothing fetched
    one_error_line(coli("convert", "acme/not-cached", home / "d"), "not-cached: no such directory, "
                   "and no such repo in the Hugging Face cache; fetch it with `coli download acme/not-cached`")


def test_download_uses_the_hf_cache(hub_cache, home, monkeypatch):
    hub, snap = hub_cache
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    r = coli("download", REPO, "--dir", home / "dl")
    assert r.returncode == 0 and "already in the Hugging Face cache" in r.stderr, r.stderr
    assert hub.requests == [] and not (home / "dl").exists()
    from core.downloader import cached_snapshot, repo_from_cache_path
    assert cached_snapshot(REPO) == snap and repo_from_cache_path(snap) == REPO
    (cached,) = [m for m in json.loads(coli("list", "--json").stdout) if m["kind"] == "hf-cache"]
    assert cached["name"] == REPO and cached["family"] == "qwen3_moe" and cached["path"] == str(snap)
    assert cached["size_bytes"] > 10_000 and "coli convert NAME OUT" in coli("list").stdout
    one_error_line(coli("rm", REPO, "--yes"), "no such model")            # rm never touches the cache
    # a shard missing from the cache (an interrupted download): not used
    shard = next(p for p in snap.iterdir() if p.name.endswith("00002.safetensors"))
    shard.unlink()
    assert cached_snapshot(REPO) is None
    assert coli("download", REPO, "--dir", home / "dl").returncode == 0
    assert hub.gets(shard.name) and (home / "dl" / shard.name).exists()
    r = coli("convert", home / "dl", home / "dl-coli")          # the download is not needed after this
    assert r.returncode == 0 and f"{home / 'dl'} (0.00 GB) is not needed to run" in r.stderr, r.stderr


def _rm_on_a_terminal(target, answer: str) -> str:
    """`coli rm TARGET` on a real pseudo-terminal; types ``answer`` at the question."""
    import select
    master, slave = os.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "colibri_tui", "rm", str(target)], cwd=ROOT,
                            stdin=slave, stdout=slave, stderr=slave, env=os.environ.copy())
    os.close(slave)
    out, answered = b"", False
    while True:
        ready, _, _ = select.select([master], [], [], 60)
        if not ready:
            proc.kill()
            raise AssertionError(f"no output from coli rm: {out!r}")
        try:
            chunk = os.read(master, 4096)
        except OSError:            # the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
        if not answered and b"[y/N]" in out:
            os.write(master, answer.encode() + b"\n")
            answered = True
    proc.wait(timeout=60)
    os.close(master)
    assert proc.returncode == 0, out
    return out.decode(errors="replace")


def test_rm_asks_on_a_terminal(home, hf_src):
    target = home / "mine" / "asked"
    assert coli("convert", hf_src, target).returncode == 0
    out = _rm_on_a_terminal(target, "n")
    assert f"remove {target.resolve()} (" in out and "nothing removed" in out and target.exists()
    out = _rm_on_a_terminal(target, "y")
    assert f"removed {target.resolve()}" in out and not target.exists()


def test_the_log_follows_coli_log_dir_in_one_process(tmp_path, monkeypatch):
    import logging
    from colibri_tui.paths import logger, setup_logging
    for name in ("a", "b"):
        monkeypatch.setenv("COLI_LOG_DIR", str(tmp_path / name))
        assert setup_logging() == tmp_path / name / "colibri.log"
        assert setup_logging() == tmp_path / name / "colibri.log"            # idempotent
        logger("test").info("to %s", name)
    root = logging.getLogger("colibri")
    handlers = [h for h in root.handlers if isinstance(h, logging.FileHandler)]
    try:
        assert len(handlers) == 1
        handlers[0].flush()
        assert "to b" in (tmp_path / "b" / "colibri.log").read_text()
        assert "to b" not in (tmp_path / "a" / "colibri.log").read_text()
    finally:                                   # leave the process's logging as it was
        for h in handlers:
            root.removeHandler(h)
            h.close()
        root.propagate = True
