"""`coli chat` in a real terminal (tmux): a saved message holding ``\\x1b[2J`` does not clear the
screen when the chat opens, and Ctrl+Q during a long prefill ends the process at once (the
interpreter's own exit included, not only the app's)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from tests.test_app_release import LONG_TURN, slow_model  # noqa: F401  (the 96-layer model)

pytestmark = pytest.mark.skipif(shutil.which("tmux") is None or sys.platform == "win32",
                                reason="needs tmux")


def tmux(*args: str) -> str:
    return subprocess.run(["tmux", *args], check=True, capture_output=True, text=True).stdout


def pane(session: str) -> str:
    return tmux("capture-pane", "-p", "-t", session)


def wait_pane(session: str, cond, timeout: float = 60.0) -> str:
    t0 = time.monotonic()
    while True:
        text = pane(session)
        if cond(text):
            return text
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out; the pane shows:\n{text}")
        time.sleep(0.05)


def test_saved_escape_codes_and_ctrl_q_in_a_real_terminal(slow_model, tmp_path):
    from colibri_tui.history import History
    data = tmp_path / "data"
    h = History(data / "history.sqlite3")
    chat = h.new_chat("escape codes")
    for _ in range(3):
        h.add_message(chat.id, "user", LONG_TURN)
        h.add_message(chat.id, "assistant", LONG_TURN)
    h.add_message(chat.id, "user", "clear the screen")
    h.add_message(chat.id, "assistant", "\x1b[2J\x1b[Hcleared?\x07\x0e shifted")
    h.close()
    done = tmp_path / "exit-status"
    session = f"coli-test-{time.monotonic_ns()}"
    env = (f"COLI_DATA_DIR='{data}' COLI_CONFIG_DIR='{tmp_path / 'config'}' COLI_LOG_DIR='{tmp_path / 'log'}' "
           f"TERM=xterm-256color")
    cmd = (f"env {env} '{sys.executable}' -m colibri_tui chat --model '{slow_model}' --threads 1; "
           f"echo $? > '{done}.tmp'; mv '{done}.tmp' '{done}'; sleep 30")   # appears complete or not at all
    tmux("new-session", "-d", "-s", session, "-x", "120", "-y", "40", cmd)
    try:
        text = wait_pane(session, lambda t: "ready" in t)
        # the saved control codes are shown, not obeyed: the message above them is still there
        assert "␛[2J␛[Hcleared?␇␎ shifted" in text
        assert "colibrì · escape codes" in text and "quick brown fox" in text
        tmux("send-keys", "-t", session, "go", "Enter")
        wait_pane(session, lambda t: "generating" in t)
        time.sleep(1.0)                                  # well into the ~1500-token prefill
        assert not done.exists()
        t0 = time.monotonic()
        tmux("send-keys", "-t", session, "C-q")
        while not done.exists() and time.monotonic() - t0 < 60:
            time.sleep(0.01)
        took = time.monotonic() - t0
        print(f"Ctrl+Q during prefill: the process exited in {took:.3f} s")
        assert done.read_text().strip() == "0"
        assert took < 1.0, f"the process took {took:.2f} s to exit"
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
