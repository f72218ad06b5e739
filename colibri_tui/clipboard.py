"""Copying text out of the app. Textual's ``copy_to_clipboard`` writes an OSC 52 sequence, which
many terminals ignore (and none confirms), so a copy also goes through the system's clipboard
tool when one can reach a clipboard here (wl-copy under Wayland, xclip or xsel under X11,
pbcopy on macOS, clip on Windows). Without one, the caller says so and saves the text to a file."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

TOOL_TIMEOUT_S = 2.0


def tools() -> list[list[str]]:
    """The clipboard commands usable in this session, best first."""
    found = []
    if sys.platform == "darwin":
        found.append(["pbcopy"])
    elif sys.platform == "win32":
        found.append(["clip"])
    else:
        if os.environ.get("WAYLAND_DISPLAY"):
            found.append(["wl-copy"])
        if os.environ.get("DISPLAY"):
            found += [["xclip", "-selection", "clipboard"], ["xsel", "--clipboard", "--input"]]
    return [cmd for cmd in found if shutil.which(cmd[0])]


def system_copy(text: str) -> str | None:
    """Put ``text`` on the system clipboard; the tool's name, or None when no tool did it."""
    for cmd in tools():
        try:
            # xclip/xsel fork a child that serves the selection: never wait on inherited pipes
            data = text.encode("utf-16" if cmd[0] == "clip" else "utf-8")     # clip: UTF-16 with BOM
            done = subprocess.run(cmd, input=data, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, timeout=TOOL_TIMEOUT_S)
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return cmd[0]
    return None
