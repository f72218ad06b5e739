"""Model families and the engine entry point ``open_model``."""
from __future__ import annotations

import json
from pathlib import Path

from core.container import Container
from core.engine import Engine
from core.errors import ColiError

from .registry import FAMILIES, family_for, supported_types, validate_config

__all__ = ["open_model", "default_model", "check_model_path", "FAMILIES", "family_for", "supported_types",
           "validate_config"]

# Measured on the demo trace at 25 % capacity (coli replay): LFRU 0.937 of MIN, markov 0.942,
# LRU 0.865. LFRU stays the default: markov's +0.005 costs O(experts^2) counters per layer in
# Python dicts (up to ~1 GB for 256 experts x 60 layers) and O(candidates x k) work per eviction.
DEFAULT_POLICY = "lfru"


def model_usage_path(path: Path) -> Path:
    """Where the model's routing history (``.coli_usage``) lives; the embedded demo's is user
    data, never written into the installed package."""
    from core.usage import usage_path
    return usage_path(path, shipped=Path(path).resolve() == DEMO_MODEL.resolve())


def load_model_usage(container: Container, spec) -> dict:
    """The model's routing history (``.coli_usage``), {} when there is none yet."""
    from core.usage import load_usage
    return load_usage(model_usage_path(container.path), spec.num_layers, spec.num_experts)


# The embedded demo model (issue 3), shipped as package data.
DEMO_MODEL = Path(__file__).resolve().parent / "demo" / "qwen3-moe-demo"


def default_model() -> Path | None:
    """The model used when none is configured: the embedded demo, when this install has it."""
    return DEMO_MODEL if (DEMO_MODEL / "colibri.json").exists() else None


GGUF_MAGIC = b"GGUF"


def check_model_path(path: str | Path) -> None:
    """Refuse, with a useful line, a --model that is a file (a GGUF, say) instead of a container."""
    p = Path(path).expanduser()
    if not p.is_file():
        return                         # a directory, or missing: the container says which
    try:
        with open(p, "rb") as f:
            magic = f.read(4)
    except OSError:
        magic = b""
    if magic == GGUF_MAGIC or p.suffix.lower() == ".gguf":
        raise ColiError(f"{p}: GGUF is not supported yet: convert the Hugging Face checkpoint with "
                        f"coli convert")
    raise ColiError(f"{p} is a file; --model takes a colibrì container directory (made by coli convert)")


def _read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ColiError(f"{path}: invalid JSON ({e})") from None


def open_model(path: str | Path, threads: int | None = None, ram_gb: float | None = None,
               cap: int | None = None, policy: str = DEFAULT_POLICY, prefetch: bool = True,
               o_direct: bool = False, io_threads: int = 4, kv_cache: str = "float32",
               context: int | None = None) -> Engine:
    """Open a converted container: pick the family from config.json, size the RAM tier
    (``cap`` experts per layer, or ``ram_gb`` for the slot pool, or automatic), build the engine.
    ``kv_cache``: "float32", or the opt-in "float16" (half the KV memory and attention's reads;
    outputs change slightly). ``context``: the positions the session needs (prompt + reply) when
    known, for the automatic budget's KV room (core.planner; it grows past them anyway).

    The automatic budget is sized twice: before the engine is built (the pool's arena is address
    space until read into, and nothing is pinned yet) and after, with what opening the model added
    to the process measured (its RSS); the pool then shrinks to the second figure and pins."""
    import psutil

    from core.memory import rss_bytes
    from core.planner import make_plan
    from core.policies import make_policy
    from core.tiered_store import TieredStore

    check_model_path(path)
    container = Container(path)
    try:
        validate_config(container.config, container.logical_shapes(), str(container.path))
        spec = family_for(container.config).spec(container.config,
                                                   _read_json(container.path / "generation_config.json"))
        available, rss = psutil.virtual_memory().available, rss_bytes()
        plan = make_plan(container, spec, ram_gb=ram_gb, cap=cap, kv_cache=kv_cache, context=context,
                         available=available)
        layers = sorted({l for l, _ in container.experts})
        history = load_model_usage(container, spec)
        try:
            pol = make_policy(policy, usage=history, layers=layers, cap=plan.cap)
        except ValueError as e:
            raise ColiError(str(e)) from None
        store = TieredStore(container, cap=plan.cap, policy=pol, o_direct=o_direct,
                            io_threads=io_threads, prefetch=prefetch, pin=False)
        from core.tokenizer import load_tokenizer
        tokenizer = load_tokenizer(container.path)
        engine = Engine(container, spec, store=store, tokenizer=tokenizer, threads=threads,
                        kv_dtype=kv_cache)
        # what opening added besides the dense weights (libraries, tokenizer, threads), measured
        runtime = max(0, rss_bytes() - rss - plan.dense_bytes)
        plan = make_plan(container, spec, ram_gb=ram_gb, cap=cap, kv_cache=kv_cache, context=context,
                         available=available, runtime_bytes=runtime)
        if plan.cap < store.cap:
            store.shrink(plan.cap)
        plan.cap = store.cap            # never more slots than the arena has (a smaller runtime)
        plan.ram_expert_bytes = store.slot_bytes * store.cap * plan.moe_layers
        store.pin()
        engine.plan = plan
        engine.usage_history = dict(history)
        engine.usage_file = model_usage_path(container.path)
        return engine
    except BaseException:
        container.close()
        raise
