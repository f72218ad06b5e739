"""The `coli` command line. Bad input ends in one clear line on stderr and a non-zero exit."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from core.arch import KV_CACHES
from core.errors import ColiError
from core.policies import POLICY_NAMES

EXIT_ERROR, EXIT_INTERNAL, EXIT_INTERRUPTED = 1, 2, 130


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, like every other error
        self.exit(EXIT_ERROR, f"coli: error: {message} (see `{self.prog} --help`)\n")


def _version() -> str:
    try:
        from importlib.metadata import version
        return version("colibri")
    except Exception:
        return "0+unknown"


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise ColiError(f"--ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ColiError("--ids is empty")
    return ids


def _add_model(p, store=True):
    p.add_argument("--model", metavar="DIR", default=os.environ.get("COLI_MODEL"),
                   help="a converted colibrì container (default: $COLI_MODEL, else the demo model)")
    p.add_argument("--threads", type=int, default=None, metavar="N", help="compute threads (default: the physical cores other programs leave free, followed as it runs)")
    p.add_argument("--int8-activations", action="store_true",
                   help="faster int4 products with x rounded to int8 (~0.5%% rms error; off by default)")
    p.add_argument("--kv-cache", choices=KV_CACHES, default="float32",
                   help="KV cache precision: float16 halves its memory and attention's reads at long "
                        "contexts, and changes outputs slightly (default: float32)")
    if not store:
        return
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ram-gb", type=float, default=_env_float("COLI_RAM_GB"), metavar="G",
                   help="RAM for routed experts, in GB (default: automatic, or $COLI_RAM_GB)")
    g.add_argument("--cap", type=int, default=None, metavar="N", help="at most N routed experts per layer in RAM")
    p.add_argument("--policy", default=None, choices=POLICY_NAMES, help=POLICY_HELP)
    p.add_argument("--no-prefetch", action="store_true", help="no lookahead prefetch")
    p.add_argument("--o-direct", action="store_true", help="read experts with O_DIRECT")


def add_prefix_cache_flag(p) -> None:
    p.add_argument("--no-prefix-cache", action="store_true",
                   help="compute every prompt in full: no reuse of the positions an earlier "
                        "generation's cache shares with it (outputs then equal a fresh run's bit for "
                        "bit; reuse changes them by float rounding, see README)")


POLICY_HELP = ("RAM cache policy: lfru (default: recent and frequent), lru (least recently used), "
               "markov (routing transitions; more memory) or pinned (hottest experts from the usage history)")


def _env_float(name: str):
    v = os.environ.get(name)
    try:
        return float(v) if v else None
    except ValueError:
        return None


def _open(args, context: int | None = None):
    from models import open_model
    from models import DEFAULT_POLICY
    from core import kernels
    kernels.set_int8_activations(getattr(args, "int8_activations", False))
    engine = open_model(_need_model(args), threads=args.threads, ram_gb=args.ram_gb, cap=args.cap,
                        policy=args.policy or DEFAULT_POLICY, prefetch=not args.no_prefetch,
                        o_direct=args.o_direct, kv_cache=args.kv_cache, context=context)
    engine.prefix_cache = not getattr(args, "no_prefix_cache", False)
    return engine


def _epilog() -> str:
    from .paths import config_path, data_dir, log_path
    return (f"files:\n  config   {config_path()}  ($COLI_CONFIG_DIR moves it)\n"
            f"  log      {log_path()}  ($COLI_LOG_DIR moves it)\n"
            f"  data     {data_dir()}  (chats, models; $COLI_DATA_DIR moves it)\n"
            "shell completion: coli completion bash|zsh|fish (see `coli completion --help`)")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="coli", description="colibrì: run Mixture-of-Experts models bigger than RAM.",
                 epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"colibri {_version()}",
                    help="print the version and exit")
    sub = ap.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")

    p = sub.add_parser("convert", help="convert a Hugging Face model directory into a container")
    p.add_argument("src", metavar="SRC", help="a Hugging Face model directory, or a repo id (owner/name) "
                                              "that is in the Hugging Face cache ($HF_HOME)")
    p.add_argument("out", metavar="OUT", help="output container directory")
    p.add_argument("--bits", type=int, choices=(4, 8, 16), default=None,
                   help="4: int4 experts/attention (the default, except for a release that ships "
                        "FP4 experts, e.g. DeepSeek V4: then 16, its FP4 experts kept as they are); "
                        "8: int8; 16: nothing quantized")
    p.add_argument("--group-size", type=int, default=64, help="int4 group size (default 64)")
    p.add_argument("--drop-mtp", action="store_true",
                   help="leave out the multi-token-prediction (MTP) layers; by default they are kept "
                        "in mtp-* shards of their own, which the engine does not load")

    p = sub.add_parser("import-colibri", help="import a container of colibrì's C engine (out-NNNNN "
                       "shards, e.g. its GLM-5.x int4-g64) without requantizing",
                       description="Copy a directory written by colibrì's C engine (out-NNNNN, "
                       "out-mtp-*, out-idx-* safetensors of flattened U8 + F32 .qs tensors, no "
                       "manifest) into a container: shapes from config.json, each tensor's scheme "
                       "from its byte counts, int4/int8 bytes and scales copied bit for bit, experts "
                       "laid contiguous, checksums recorded, the MTP head set aside in mtp-* shards. "
                       "Resumable: rerun the same command after an interruption.")
    p.add_argument("src", metavar="SRC", help="the C engine's model directory (out-*.safetensors, "
                                              "out-mtp-*, out-idx-*, config.json)")
    p.add_argument("out", metavar="OUT", help="output container directory")
    p.add_argument("--group-size", type=int, default=64,
                   help="the source's int4 group size (default 64); the bytes are copied as they are")

    p = sub.add_parser("download", help="download a Hugging Face model (resumable)")
    p.add_argument("repo", metavar="REPO", help="Hugging Face repo id, e.g. allenai/OLMoE-1B-7B-0924")
    p.add_argument("--dir", metavar="DIR", default=None, help="where to put it (default: ./REPO-NAME); "
                   "nothing is fetched when the Hugging Face cache ($HF_HOME) holds the repo")
    p.add_argument("--revision", metavar="REV", default=None,
                   help="a branch, tag or commit (default: the main branch)")

    p = sub.add_parser("run", help="generate text (or token ids) from a prompt")
    _add_model(p)
    p.add_argument("prompt", nargs="?", metavar="PROMPT", help="the user message (wrapped in the chat template)")
    p.add_argument("--ids", metavar="IDS", help="comma-separated prompt token ids instead of PROMPT")
    p.add_argument("--raw", action="store_true", help="do not wrap PROMPT in the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N",
                   help="stop after N new tokens (default 128)")
    p.add_argument("--temperature", type=float, default=0.7, metavar="T",
                   help="sampling temperature (default 0.7)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="nucleus sampling: keep the most likely tokens up to probability P (default 1: all)")
    p.add_argument("--top-k", type=int, default=0, metavar="K",
                   help="sample from the K most likely tokens only (default 0: no limit)")
    p.add_argument("--seed", type=int, default=None, metavar="S",
                   help="random seed, for repeatable samples (default: random)")
    p.add_argument("--greedy", action="store_true", help="always take the most likely token")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop when TEXT is generated (repeatable)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--trace", metavar="FILE", help="record routing (position, layer, experts) to FILE")
    add_prefix_cache_flag(p)

    p = sub.add_parser("logits", help="teacher-forced logits for token ids, saved as .npy")
    _add_model(p)
    p.add_argument("--ids", required=True, metavar="IDS", help="comma-separated token ids")
    p.add_argument("--out", required=True, metavar="FILE.npy", help="where to write the float32 [T, vocab] array")

    p = sub.add_parser("info", help="describe a container")
    _add_model(p, store=False)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    p = sub.add_parser("verify", help="check every shard of a container against the checksums "
                                      "recorded at conversion")
    p.add_argument("--model", metavar="DIR", default=os.environ.get("COLI_MODEL"),
                   help="a converted colibrì container (default: $COLI_MODEL, else the demo model)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    p = sub.add_parser("plan", help="RAM budget, slots per tier, projected hit rate, what bounds speed")
    _add_model(p, store=False)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--ram-gb", type=float, default=_env_float("COLI_RAM_GB"), metavar="G",
                   help="plan for G GB of RAM for routed experts (default: automatic, or $COLI_RAM_GB)")
    g.add_argument("--cap", type=int, default=None, metavar="N", help="plan for N routed experts per layer in RAM")
    p.add_argument("--context", type=int, default=None, metavar="N",
                   help="plan the KV room for a session of N positions (default: not known: "
                        "4096, at most a quarter of the room)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    from .cli_replay import add_parser as add_replay
    add_replay(sub)
    from .app_cli import add_parsers as add_chat
    add_chat(sub)
    from .cli_models import add_parsers as add_models
    add_models(sub)
    from .server import add_parser as add_serve
    add_serve(sub, _add_model)
    from .completion import SHELLS
    p = sub.add_parser("completion", help="print a shell completion script",
                       description="Print a completion script for coli. bash: add "
                                   "`eval \"$(coli completion bash)\"` to ~/.bashrc; zsh: the same with zsh "
                                   "in ~/.zshrc; fish: `coli completion fish > "
                                   "~/.config/fish/completions/coli.fish`.")
    p.add_argument("shell", choices=SHELLS, help="the shell: " + ", ".join(SHELLS))
    return ap


def _need_model(args) -> str:
    if args.model:
        from models import check_model_path
        check_model_path(args.model)
        return args.model
    from models import default_model
    demo = default_model()
    if demo is None:
        raise ColiError("no model given: pass --model DIR (a container made by `coli convert`) "
                        "or set COLI_MODEL")
    print(f"coli: no model configured; using the embedded demo model ({demo.name})", file=sys.stderr)
    return str(demo)


@contextlib.contextmanager
def _progress_bar(label: str, update):
    """A rich progress bar on a terminal: yields a callback for the long job (None elsewhere).
    ``update(event) -> (done, total, description)`` reads the job's progress events."""
    if not sys.stderr.isatty():
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn
    with Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                  TimeRemainingColumn(), transient=True) as bar:
        task = bar.add_task(label, total=None)

        def report(event) -> None:
            done, total, description = update(event)
            bar.update(task, completed=done, total=total, description=description)
        yield report


def _convert_source(src: str) -> str:
    """SRC as given, or the Hugging Face cache's snapshot when SRC is a cached repo id."""
    from core.downloader import cached_snapshot, looks_like_repo_id
    if Path(src).expanduser().exists() or not looks_like_repo_id(src):
        return src
    snap = cached_snapshot(src)
    if snap is None:
        raise ColiError(f"{src}: no such directory, and no such repo in the Hugging Face cache; "
                        f"fetch it with `coli download {src}`")
    print(f"coli: {src} from the Hugging Face cache: {snap}", file=sys.stderr)
    return str(snap)


def cmd_convert(args) -> int:
    from core.converter import convert
    from models import validate_config
    from .cli_models import remember

    args.src = _convert_source(args.src)
    from core.import_colibri import is_colibri_dir
    if is_colibri_dir(args.src):
        raise ColiError(f"{args.src} is a container of colibrì's C engine (out-NNNNN shards); import "
                        f"it without requantizing: coli import-colibri {args.src} {args.out}")

    with _progress_bar("converting", lambda p: (p.done_bytes, p.total_bytes,
                                                f"{p.shard} ({p.shard_index + 1}/{p.shard_count})")) as progress:
        out = convert(args.src, args.out, bits=args.bits, group_size=args.group_size,
                      validate_config=validate_config, progress=progress, drop_mtp=args.drop_mtp)
    size = sum(f.stat().st_size for f in Path(out).iterdir() if f.is_file())
    remember(out)
    from core.container import Container
    bits = Container(out).manifest["converter"]["params"]["bits"]      # --bits, or the release's default
    print(f"converted {args.src} -> {out} ({size / 1e6:.1f} MB, bits={bits})", file=sys.stderr)
    mtp = _mtp_summary(Path(out))
    if mtp is not None:
        print(f"MTP layers: {mtp}", file=sys.stderr)
    from core.downloader import STATE
    if (Path(args.src) / STATE).is_file():        # a `coli download` folder: say it can go
        from .cli_models import dir_size
        print(f"{args.src} ({dir_size(Path(args.src)) / 1e9:.2f} GB) is not needed to run {out}; "
              f"delete it to free the space", file=sys.stderr)
    return 0


def cmd_import_colibri(args) -> int:
    from core.import_colibri import import_colibri
    from models import validate_config
    from .cli_models import remember
    with _progress_bar("importing", lambda p: (p.done_bytes, p.total_bytes,
                                               f"{p.shard} ({p.shard_index + 1}/{p.shard_count})")) as progress:
        out = import_colibri(args.src, args.out, group_size=args.group_size,
                             validate_config=validate_config, progress=progress)
    size = sum(f.stat().st_size for f in Path(out).iterdir() if f.is_file())
    remember(out)
    print(f"imported {args.src} -> {out} ({size / 1e6:.1f} MB, bytes copied, nothing requantized)",
          file=sys.stderr)
    return 0


def cmd_download(args) -> int:
    from core.downloader import cached_snapshot, download
    from models import validate_config

    snap = cached_snapshot(args.repo, args.revision)
    if snap is not None:                  # the Hugging Face cache has it: fetch nothing
        print(f"{args.repo} is already in the Hugging Face cache: {snap}; next: coli convert "
              f"{args.repo} {args.repo.rsplit('/', 1)[-1]}-coli", file=sys.stderr)
        return 0
    target = Path(args.dir or args.repo.rsplit("/", 1)[-1])
    with _progress_bar("downloading", lambda p: (p.done, p.total,
                                                 f"{p.file} ({p.file_index + 1}/{p.file_count})")) as progress:
        out = download(args.repo, target, revision=args.revision, progress=progress,
                       validate_config=validate_config)
    print(f"downloaded {args.repo} -> {out}; next: coli convert {out} {out}-coli", file=sys.stderr)
    return 0


def cmd_run(args) -> int:
    from core.events import Done, Stats, Token
    from core.sampling import SamplingParams

    if (args.prompt is None) == (args.ids is None):
        raise ColiError("give either PROMPT or --ids")
    if args.prompt is not None:
        try:
            args.prompt.encode("utf-8")       # undecodable bytes in argv arrive as lone surrogates
        except UnicodeEncodeError:
            raise ColiError("PROMPT is not valid UTF-8 text") from None
    if args.max_new_tokens < 0:
        raise ColiError("--max-new-tokens must be >= 0")
    try:
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  seed=args.seed, greedy=args.greedy)
    except ValueError as e:
        raise ColiError(str(e)) from None
    prompt = _parse_ids(args.ids) if args.ids is not None else args.prompt
    engine = _open(args, context=_context_needed(prompt, args.max_new_tokens))
    engine.warm_experts()       # the model fits: every expert read now, not at its first token
    stats = None
    if args.trace:
        from core.trace import TraceWriter
        engine.trace = TraceWriter(args.trace, engine.spec.num_layers, engine.spec.num_experts,
                                   engine.spec.top_k)
    try:
        for ev in engine.generate(prompt, sampling, stop=args.stop, max_new_tokens=args.max_new_tokens,
                                  raw=args.raw):
            if isinstance(ev, Token) and not args.json:
                sys.stdout.write(ev.text)
                sys.stdout.flush()
            elif isinstance(ev, Stats):
                stats = ev
            elif isinstance(ev, Done) and not args.json:
                sys.stdout.write("\n")
    finally:
        if engine.trace is not None:
            engine.trace.close()
    d = stats.as_dict()
    ids, text = d.pop("ids"), d.pop("text")
    if args.json:
        print(json.dumps({"ids": ids, "text": text, "stats": d}))
    else:
        print(f"[{d['new_tokens']} tokens, prefill {d['prefill_tok_s']:.1f} tok/s, "
              f"decode {d['decode_tok_s']:.1f} tok/s, hit rate {d['hit_rate']:.1%}, "
              f"read {d['bytes_read'] / 1e6:.1f} MB{_page_cache_note(d)}, stop: {d['reason']}]",
              file=sys.stderr)
    return 0


def _page_cache_note(stats: dict) -> str:
    """", 62 % of it from the OS page cache" when the page cache served a share of the reads."""
    from core.pagecache import TIER_SHARE
    share = stats.get("page_cache_share")
    if not stats.get("bytes_read") or share is None or share < TIER_SHARE:
        return ""
    return f", {share:.0%} of it from the OS page cache"


# a chat template's own tokens around a prompt (role markers, a default system line): a bound
# for the KV room, which grows past it anyway (core.planner.grow_kv_room)
TEMPLATE_ALLOWANCE = 256


def _context_needed(prompt, max_new_tokens: int) -> int:
    """The positions a run needs at most: its ids, or a text prompt's UTF-8 bytes (no tokenizer
    makes fewer than one byte per token) with the template's, plus the reply."""
    n = len(prompt) if not isinstance(prompt, str) else len(prompt.encode("utf-8")) + TEMPLATE_ALLOWANCE
    return max(1, n + max_new_tokens)


def cmd_logits(args) -> int:
    import numpy as np

    ids = _parse_ids(args.ids)
    out = Path(args.out)
    if not out.parent.exists():
        raise ColiError(f"--out: directory {out.parent} does not exist")
    if out.is_dir():
        raise ColiError(f"--out {out} is a directory; give a file name (FILE.npy)")
    logits = _open(args).logits(ids)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "wb") as f:
        np.save(f, logits.astype(np.float32))
    os.replace(tmp, out)
    print(f"wrote {out} {tuple(logits.shape)}", file=sys.stderr)
    return 0


def _mtp_summary(path: Path, manifest: dict | None = None) -> str | None:
    """One line on the MTP layers the converter set aside or dropped (None: the source had none)."""
    if manifest is None:
        try:
            manifest = json.loads((path / "colibri.json").read_text())
        except (OSError, ValueError):
            return None
    m = manifest.get("mtp") if isinstance(manifest, dict) else None
    if not isinstance(m, dict):
        return None
    which = ", ".join(str(g) for g in m.get("groups", [])) or "?"
    if m.get("dropped"):
        return (f"{which} dropped at conversion (--drop-mtp; "
                f"{m.get('source_bytes', 0) / 1e6:.1f} MB of source)")
    n = len(m.get("shards", []))
    return (f"{which} kept aside, not loaded ({n} shard{'s' if n != 1 else ''}, "
            f"{m.get('bytes', 0) / 1e6:.1f} MB)")


def cmd_info(args) -> int:
    from core import kernels
    from core.container import Container
    from models import family_for

    c = Container(_need_model(args))
    spec = family_for(c.config).spec(c.config)
    expert_bytes = sum(l.end - l.start for l in c.experts.values())
    total = sum(f.path.stat().st_size for f in c.files)
    info = {
        "path": str(c.path), "model_type": c.config.get("model_type"),
        "layers": spec.num_layers, "experts": spec.num_experts, "top_k": spec.top_k,
        "hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size,
        "quantization": c.manifest.get("classes"),
        "bytes_total": total, "bytes_experts": expert_bytes, "bytes_dense": total - expert_bytes,
        "mtp": ({k: c.mtp.get(k) for k in ("dropped", "groups", "layers", "shards", "tensors", "bytes",
                                             "source_bytes") if k in c.mtp} if c.mtp else None),
        "kernels": kernels.backend(), "openmp": kernels.openmp_enabled(),
        "threads": kernels.get_threads(), "simd": kernels.simd_level(),
    }
    dropped = c.manifest.get("dropped")
    if isinstance(dropped, dict):       # a vision tower the converter left out
        info["dropped"] = dropped
    if args.json:
        print(json.dumps(info))
    else:
        info["mtp"] = _mtp_summary(c.path, c.manifest) or "none"
        if isinstance(dropped, dict):
            info["dropped"] = (f"{', '.join(p + '*' for p in dropped.get('prefixes', []))} left out at conversion "
                               f"(no part of the language model: {dropped.get('tensors', 0)} tensors, "
                               f"{dropped.get('source_bytes', 0) / 1e6:.1f} MB of source)")
        for k, v in info.items():
            print(f"{k:>14}: {v}")
    return 0


def cmd_plan(args) -> int:
    from core.container import Container
    from core.planner import AUTO_SHARE, make_plan
    from models import family_for, load_model_usage

    c = Container(_need_model(args))
    spec = family_for(c.config).spec(c.config)
    plan = make_plan(c, spec, ram_gb=args.ram_gb, cap=args.cap, usage=load_model_usage(c, spec),
                     kv_cache=args.kv_cache, context=args.context)
    d = plan.as_dict()
    d["page_cache_tier"] = plan.page_cache_tier
    from core.cache_kinds import by_kind, describe
    d["cache_kinds"] = by_kind(spec.cache_kinds, args.kv_cache)
    if args.json:
        print(json.dumps(d))
        return 0
    gb = lambda n: f"{n / 1e9:.3f} GB"
    print(f"model            {c.path}")
    print(f"dense (RAM)      {gb(plan.dense_bytes)}")
    print(f"experts (disk)   {gb(plan.expert_bytes)} = {plan.moe_layers} layers x {plan.num_experts} experts")
    print(f"RAM tier         {plan.cap} slots/layer x {plan.moe_layers} layers = {gb(plan.ram_expert_bytes)} "
          f"({plan.mode}; available {gb(plan.available_bytes)})")
    if plan.mode == "auto":
        print(f"budget           available - dense - runtime - one prefill pass "
              f"{gb(plan.working_bytes)} - KV: {AUTO_SHARE:.0%} of the rest to the pool, the rest "
              f"to the OS; runtime " + (f"{gb(plan.runtime_bytes)} measured" if plan.runtime_measured else
                                        "measured when the model opens (coli run), not counted here"))
    print(f"KV cache         {gb(plan.kv_bytes_per_position * 1024)} per 1024 positions"
          + (f" ({gb(plan.kv_reserved_bytes)} kept free for {plan.kv_positions} positions; "
             f"it grows with the context, the pool giving back slots)" if plan.mode == "auto" else ""))
    print(f"per position     {plan.kv_bytes_per_position:,} bytes: {describe(spec.cache_kinds, args.kv_cache)}")
    if plan.fixed_state_bytes:        # rings, recurrent / conv state, open blocks: whatever the context
        print(f"fixed state      {gb(plan.fixed_state_bytes)} ({plan.fixed_state_bytes:,} bytes whatever the context)")
    kinds = d["cache_kinds"]
    if len(kinds) > 1:                # each kind apart (per layer it is on)
        for n, k in enumerate(kinds):
            layers = f"{k['layers']} layer{'s' if k['layers'] != 1 else ''}"
            print(f"{'by kind' if n == 0 else '':17}{k['kind']} on {layers}: "
                  f"{k['bytes_per_position']:,} bytes per position + {k['fixed_bytes']:,} fixed each")
    print(f"per token        {gb(plan.active_expert_bytes_per_token)} of routed experts")
    print(f"projected hits   {plan.projected_hit_rate:.1%}")
    if plan.cap < plan.num_experts:
        tier = ("the OS page cache acts as a tier: " if plan.page_cache_tier else "")
        print(f"page cache       {tier}{gb(plan.page_cache_bytes)} left to the OS could keep "
              f"{plan.page_cache_share:.0%} of the experts outside the pool cached (buffered reads "
              f"of those never reach the disk; --o-direct bypasses it; coli run --json reports "
              f"the share measured: stats.page_cache_share)")
    print(f"bound by         {plan.bound}")
    return 0


def cmd_verify(args) -> int:
    from core.integrity import verify

    path = Path(_need_model(args))
    with _progress_bar("verifying", lambda e: e) as bar:      # e: (done, total, shard)
        result = verify(path, progress=(lambda *e: bar(e)) if bar is not None else None)
    if args.json:
        print(json.dumps({"path": str(path), "ok": result.ok, "checked": result.checked,
                          "damaged": result.damaged, "unrecorded": result.unrecorded}))
    if result.unrecorded:
        raise ColiError(f"{path} has no recorded checksums (converted by an older coli); convert it "
                        f"again to add them")
    if result.damaged:
        raise ColiError(f"{len(result.damaged)} of {len(result.damaged) + len(result.checked)} shards "
                        f"of {path} are damaged ({'; '.join(result.damaged)}); convert the model again")
    if not args.json:
        print(f"{path}: all {len(result.checked)} shards match their checksums", file=sys.stderr)
    return 0


def _cmd_chat(args) -> int:
    from .app_cli import run_app
    return run_app(args)


def _cmd_replay(args) -> int:
    from .cli_replay import cmd_replay
    return cmd_replay(args)


def _cmd_list(args) -> int:
    from .cli_models import cmd_list
    return cmd_list(args)


def _cmd_rm(args) -> int:
    from .cli_models import cmd_rm
    return cmd_rm(args)


def _cmd_serve(args) -> int:
    from .server import cmd_serve
    return cmd_serve(args, _open)


def _cmd_completion(args) -> int:
    from .completion import script
    sys.stdout.write(script(args.shell, build_parser()))
    return 0


COMMANDS = {"download": cmd_download, "convert": cmd_convert, "import-colibri": cmd_import_colibri, "run": cmd_run, "logits": cmd_logits, "info": cmd_info,
            "plan": cmd_plan, "verify": cmd_verify, "replay": _cmd_replay, "chat": _cmd_chat, "list": _cmd_list, "rm": _cmd_rm,
            "completion": _cmd_completion, "serve": _cmd_serve}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:          # plain `coli`: the app in a terminal, help otherwise
        if not (sys.stdin.isatty() and sys.stdout.isatty()):
            parser.print_help(sys.stderr)
            return 0
        args.command = "chat"
    from .paths import logger, setup_logging
    setup_logging()
    log = logger("cli")
    log.info("coli %s: %s", _version(), args.command)      # not the arguments: prompts stay private
    try:
        if getattr(args, "threads", None) is not None and args.threads < 1:
            raise ColiError("--threads must be >= 1")
        return COMMANDS[args.command](args)
    except ColiError as e:
        log.info("error: %s", e)
        print(f"coli: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("coli: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug: still one line, the traceback only on request (and in the log)
        log.exception("internal error")
        if os.environ.get("COLI_DEBUG"):
            raise
        from .paths import log_path
        print(f"coli: internal error: {e.__class__.__name__}: {e} (details in {log_path()}, or set "
              f"COLI_DEBUG=1)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
