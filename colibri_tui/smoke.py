"""``COLI_SMOKE=1 coli chat``: start the full-screen app headless, then quit it.

For machines without a terminal to drive (the Windows release build has no tmux): the app starts
as it would in a terminal, renders its first screen into Textual's headless driver, waits until
the model is open (or has failed to open), prints one line and exits. Exit status 0 when the
first screen was rendered and the model opened (or none is configured: the setup wizard is then
the first screen); 1 when the model failed to open, the app crashed or the wait timed out.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Mapping

SMOKE = "COLI_SMOKE"
SIZE = (120, 36)          # columns, rows of the headless screen
TIMEOUT_S = 300.0         # for the model to open


def requested(env: Mapping[str, str] | None = None) -> bool:
    value = (os.environ if env is None else env).get(SMOKE, "")
    return value.strip().lower() not in ("", "0", "false", "no", "off")


def _printable(text: str) -> str:
    """One line of ASCII: the model's name comes from a file, and a frozen Windows binary's
    stdout may not encode anything else."""
    return "".join(c if " " <= c <= "~" else "?" for c in str(text))


def run(app, timeout_s: float = TIMEOUT_S, out=None, err=None) -> int:
    """Run ``app`` (a ColiApp) headless until its first screen is up and its model settled."""
    out = sys.stdout if out is None else out
    err = sys.stderr if err is None else err
    report: dict = {}
    t0 = time.perf_counter()

    async def pilot(p) -> None:
        await p.pause()                       # the first screen mounted and refreshed
        report["first_s"] = time.perf_counter() - t0
        deadline = time.monotonic() + timeout_s
        while getattr(app, "loading", False) and time.monotonic() < deadline:
            await p.pause(0.05)
        await p.pause()
        report["screen"] = type(app.screen).__name__
        report["loading"] = getattr(app, "loading", False)
        report["error"] = getattr(app, "engine_error", None)
        report["model"] = getattr(app, "model_name", "")
        app.exit()

    app.run(headless=True, size=SIZE, auto_pilot=pilot)
    if "screen" not in report:
        print(f"coli: error: smoke: the app stopped before its first screen (status "
              f"{getattr(app, 'return_code', None)})", file=err)
        return 1
    where = f"first screen in {report['first_s']:.1f} s, {report['screen']} after " \
            f"{time.perf_counter() - t0:.1f} s"
    if report["loading"]:
        print(f"coli: error: smoke: the model was still opening after {timeout_s:.0f} s ({where})",
              file=err)
        return 1
    error = report["error"]
    if error and error != "no model configured":
        print(f"coli: error: smoke: the model did not open: {_printable(error)} ({where})", file=err)
        return 1
    model = f"model {report['model']} ready" if report["model"] else "no model configured"
    print(_printable(f"coli: smoke: OK, {where}; {model}"), file=out, flush=True)
    return 0
