"""`coli chat` (and bare `coli`): the command-line entry to the full-screen app.

The main CLI wires it in with ``add_parsers(subparsers)`` and dispatches ``chat`` to ``run_app``.
Command-line flags beat the config file (``settings.toml``), which the environment overrides.
"""
from __future__ import annotations

import argparse
import sys

from core.arch import KV_CACHES
from core.errors import ColiError


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="DIR", default=None,
                   help="a converted colibrì container (default: $COLI_MODEL, the config, else the demo model)")
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: the config, or the physical cores other programs leave free, followed as it runs)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ram-gb", type=float, default=None,
                   help="RAM for routed experts, in GB (default: $COLI_RAM_GB, the config, or automatic)")
    g.add_argument("--cap", type=int, default=None, help="at most N routed experts per layer in RAM")
    p.add_argument("--policy", default=None, help="RAM cache policy: lfru, lru, markov or pinned (default: the config, else lfru)")
    p.add_argument("--no-prefetch", action="store_true", default=None, help="no lookahead prefetch")
    p.add_argument("--o-direct", action="store_true", default=None, help="read experts with O_DIRECT")
    p.add_argument("--kv-cache", choices=KV_CACHES, default=None,
                   help="KV cache precision (float16: half the memory, outputs change slightly)")
    p.add_argument("--no-prefix-cache", action="store_true", default=None,
                   help="compute each turn's whole conversation again: no reuse of the chat's cache "
                        "in memory or saved (default: the config, else reuse)")


def add_parsers(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("chat", help="the full-screen chat app (also: `coli` with no command)")
    add_chat_arguments(p)
    return p


def engine_options(args) -> dict:
    """The store/engine flags that were given on the command line (None = not given)."""
    opts = {"threads": getattr(args, "threads", None), "ram_gb": getattr(args, "ram_gb", None),
            "cap": getattr(args, "cap", None), "policy": getattr(args, "policy", None),
            "prefetch": False if getattr(args, "no_prefetch", None) else None,
            "o_direct": True if getattr(args, "o_direct", None) else None,
            "kv_cache": getattr(args, "kv_cache", None),
            "prefix_cache": False if getattr(args, "no_prefix_cache", None) else None}
    if opts["threads"] is not None and opts["threads"] < 1:
        raise ColiError("--threads must be >= 1")
    from core.policies import POLICY_NAMES
    if opts["policy"] is not None and opts["policy"] not in POLICY_NAMES:
        raise ColiError(f"--policy must be one of {', '.join(POLICY_NAMES)}")
    return {k: v for k, v in opts.items() if v is not None}


def run_app(args) -> int:
    """Open the app; returns the exit code. Works for ``coli chat ...`` and for a bare ``coli``
    (an argparse namespace without the chat flags). ``COLI_SMOKE=1``: headless start and quit
    (colibri_tui/smoke.py), for CI machines without a terminal."""
    from . import smoke
    if not smoke.requested() and (not sys.stdin.isatty() or not sys.stdout.isatty()):
        raise ColiError("coli chat needs a terminal (for scripts use `coli run`)")
    from .app import ColiApp
    from .settings import load
    settings = load()
    app = ColiApp(model_path=getattr(args, "model", None), settings=settings,
                  engine_options=engine_options(args), setup_wizard=True)
    if smoke.requested():
        return smoke.run(app)
    app.run()
    return app.return_code or 0        # 1 when the app crashed (Textual printed the traceback)


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (``python -m colibri_tui.app_cli [chat flags]``), until cli.py wires it."""
    ap = argparse.ArgumentParser(prog="coli chat")
    add_chat_arguments(ap)
    args = ap.parse_args(argv)
    try:
        return run_app(args)
    except ColiError as e:
        print(f"coli: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
