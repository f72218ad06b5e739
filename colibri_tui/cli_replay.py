"""`coli replay TRACE --cap N`: score cache policies on a recorded routing trace against the
offline optimum (Belady/MIN). Wired into the main parser by ``colibri_tui/cli.py``."""
from __future__ import annotations

import json

from core.errors import ColiError
from core.replay import DEFAULT_POLICIES as KNOWN  # every policy the store has


def add_parser(subparsers):
    """Add the ``replay`` subcommand to an argparse subparsers object; returns its parser."""
    p = subparsers.add_parser(
        "replay", help="score cache policies on a routing trace against the optimum (Belady)",
        description="Replay a routing trace (recorded with `coli run --trace FILE`) through each "
                    "cache policy with N expert slots per layer, and compare the hit rates with "
                    "Belady's offline optimum. 'pinned' learns its hot set from the first half "
                    "of the trace and is scored on all of it.")
    p.add_argument("trace", metavar="TRACE", help="routing trace file")
    p.add_argument("--cap", type=int, required=True, metavar="N",
                   help="routed experts per layer resident in RAM")
    p.add_argument("--policies", default=",".join(KNOWN), metavar="LIST",
                   help=f"comma-separated policies to score (default: {','.join(KNOWN)})")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p


def _policies(text: str) -> list[str]:
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    names = [n for n in dict.fromkeys(names) if n != "belady"]  # belady is always reported
    if not names:
        raise ColiError(f"--policies: give at least one of {', '.join(KNOWN)}")
    bad = [n for n in names if n not in KNOWN]
    if bad:
        raise ColiError(f"--policies: unknown policy {bad[0]!r} (choose from {', '.join(KNOWN)})")
    return names


def _pct(entry: dict) -> str:
    return f"{100 * entry['hit_rate']:.1f}%"


def _ratio(entry: dict) -> str:
    r = entry.get("ratio_to_belady")
    return "-" if r is None else f"{r:.3f}"


def cmd_replay(args) -> int:
    from core.replay import replay
    from core.trace import read_trace

    if args.cap is None or args.cap < 1:
        raise ColiError(f"--cap must be >= 1, got {args.cap}")
    names = _policies(args.policies)
    trace = read_trace(args.trace)
    if not trace.records:
        raise ColiError(f"{args.trace}: the trace has no routing records")
    try:
        res = replay(trace, args.cap, names)
    except ValueError as e:
        raise ColiError(str(e)) from None

    from core.routing import summary
    routing = summary(trace)
    if args.json:
        out = {"trace": str(args.trace), "layers": trace.layers, "experts": trace.experts,
               "top_k": trace.top_k, "positions": trace.positions, **res, "routing": routing}
        print(json.dumps(out))
        return 0

    cols = [*names, "belady", *(f"{n}/belady" for n in names)]
    rows = []
    for layer, r in res["per_layer"].items():
        rows.append([str(layer), *(_pct(r[n]) for n in [*names, "belady"]),
                     *(_ratio(r[n]) for n in names)])
    o = res["overall"]
    rows.append(["all", *(_pct(o[n]) for n in [*names, "belady"]), *(_ratio(o[n]) for n in names)])
    header = ["layer", *cols]
    widths = [max(len(header[i]), *(len(row[i]) for row in rows)) for i in range(len(header))]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
    print(f"{args.trace}: {trace.layers} layers x {trace.experts} experts, top-{trace.top_k}, "
          f"{trace.positions} positions; cap {args.cap} experts per layer")
    print("hit rate per layer (pinned: hot set learned from the first half of the trace)")
    print(fmt(header))
    for row in rows[:-1]:
        print(fmt(row))
    print("  ".join("-" * w for w in widths))
    print(fmt(rows[-1]))
    m = routing["mean"]
    print(f"routing: hottest 10% of experts take {m['top10_share']:.1%} of the traffic, max/mean load "
          f"{m['max_over_mean']:.2f}, consecutive tokens share {m['overlap']:.1%} of their experts")
    return 0
