"""Model families and the engine entry point ``open_model``."""
from __future__ import annotations

import json
from pathlib import Path

from core.container import Container
from core.engine import Engine
from core.errors import ColiError

from .registry import FAMILIES, family_for, supported_types, validate_config

__all__ = ["open_model", "default_model", "FAMILIES", "family_for", "supported_types", "validate_config"]

# The embedded demo model (issue 3), shipped as package data.
DEMO_MODEL = Path(__file__).resolve().parent / "demo" / "qwen3-moe-demo"


def default_model() -> Path | None:
    """The model used when none is configured: the embedded demo, when this install has it."""
    return DEMO_MODEL if (DEMO_MODEL / "colibri.json").exists() else None


def _read_json(path: Path) -> dict | None:
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ColiError(f"{path}: invalid JSON ({e})") from None


def open_model(path: str | Path, threads: int | None = None) -> Engine:
    """Open a converted container: pick the family from config.json, build the engine."""
    container = Container(path)
    try:
        validate_config(container.config)
        spec = family_for(container.config).spec(container.config,
                                                   _read_json(container.path / "generation_config.json"))
        tokenizer = None
        if (container.path / "tokenizer.json").exists():
            from core.tokenizer import ChatTokenizer
            tokenizer = ChatTokenizer.from_dir(container.path)
        return Engine(container, spec, tokenizer=tokenizer, threads=threads)
    except BaseException:
        container.close()
        raise
