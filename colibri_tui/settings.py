"""The app's settings: a TOML file under platformdirs' user config dir, with environment overrides.

``COLI_CONFIG_DIR`` moves the config (tests), ``COLI_MODEL`` and ``COLI_RAM_GB`` override the
stored model and RAM budget. Writes are atomic (temporary file + rename).
"""
from __future__ import annotations

import os
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from core.arch import KV_CACHES
from core.policies import POLICY_NAMES as POLICIES

APP_NAME = "colibri"


def config_dir() -> Path:
    env = os.environ.get("COLI_CONFIG_DIR")
    if env:
        return Path(env)
    from platformdirs import user_config_dir
    return Path(user_config_dir(APP_NAME, appauthor=False))


def data_dir() -> Path:
    env = os.environ.get("COLI_DATA_DIR")
    if env:
        return Path(env)
    from platformdirs import user_data_dir
    return Path(user_data_dir(APP_NAME, appauthor=False))


def config_path() -> Path:
    return config_dir() / "config.toml"


def export_dir() -> Path:
    """Where F7 writes chats as Markdown: a folder the user can find (Documents/colibri),
    not the hidden data dir. ``COLI_EXPORT_DIR`` moves it; with ``COLI_DATA_DIR`` set (tests,
    a portable install) exports stay beside the data, under ``exports``."""
    env = os.environ.get("COLI_EXPORT_DIR")
    if env:
        return Path(env)
    if os.environ.get("COLI_DATA_DIR"):
        return data_dir() / "exports"
    from platformdirs import user_documents_dir
    return Path(user_documents_dir()) / APP_NAME


@dataclass
class Sampling:
    """Per-chat sampling (the defaults live in the config)."""
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 512
    seed: int | None = None

    @classmethod
    def from_dict(cls, d: dict | None) -> "Sampling":
        d = d or {}
        s = cls()
        kinds = {"temperature": float, "top_p": float, "top_k": int, "max_new_tokens": int, "seed": int}
        for name, kind in kinds.items():
            if d.get(name) is not None:
                try:
                    setattr(s, name, kind(d[name]))
                except (TypeError, ValueError):
                    pass
        s.validate()
        return s

    def validate(self) -> None:
        from core.sampling import check_sampling
        check_sampling(self.temperature, self.top_k, self.top_p)
        if self.max_new_tokens < 1:
            raise ValueError("max new tokens must be >= 1")

    def as_dict(self) -> dict:
        return asdict(self)


# the [engine] keys: a change to any of them reopens the model
ENGINE_KEYS = ("ram_gb", "policy", "prefetch", "threads", "o_direct", "kv_cache")


@dataclass
class Settings:
    model: str = ""                 # container directory; "" = the embedded demo model
    ram_gb: float | None = None     # expert RAM budget in GB; None = automatic
    policy: str = "lfru"
    prefetch: bool = True
    threads: int | None = None      # None = all cores
    o_direct: bool = False
    kv_cache: str = "float32"       # KV cache precision; "float16" is opt-in (outputs change slightly)
    sampling: Sampling = field(default_factory=Sampling)
    theme: str = ""                 # a Textual theme name; "" = the default
    # where each value came from when an environment variable overrode it (not saved)
    overridden: dict = field(default_factory=dict, repr=False)

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        if self.ram_gb is not None and self.ram_gb <= 0:
            raise ValueError("RAM budget must be > 0 GB")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be >= 1")
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"KV cache must be one of {', '.join(KV_CACHES)}")
        self.sampling.validate()


def _num(v, kind):
    if v is None or v == "":
        return None
    try:
        return kind(v)
    except (TypeError, ValueError):
        return None


def load(path: Path | None = None, env: dict | None = None) -> Settings:
    """Read the config (a missing or unreadable file gives the defaults) and apply env overrides."""
    path = path or config_path()
    env = os.environ if env is None else env
    s = Settings()
    data: dict = {}
    if path.exists():
        try:
            data = tomllib.loads(path.read_text())
        except (tomllib.TOMLDecodeError, OSError, UnicodeDecodeError):
            data = {}
    eng = data.get("engine", {}) if isinstance(data.get("engine"), dict) else {}
    s.model = str(data.get("model", "") or "")
    s.theme = str(data.get("theme", "") or "")
    s.ram_gb = _num(eng.get("ram_gb"), float)
    if eng.get("policy") in POLICIES:
        s.policy = eng["policy"]
    s.prefetch = bool(eng.get("prefetch", True))
    s.threads = _num(eng.get("threads"), int)
    s.o_direct = bool(eng.get("o_direct", False))
    if eng.get("kv_cache") in KV_CACHES:
        s.kv_cache = eng["kv_cache"]
    try:
        s.sampling = Sampling.from_dict(data.get("sampling"))
    except ValueError:
        s.sampling = Sampling()
    if env.get("COLI_MODEL"):
        s.model = env["COLI_MODEL"]
        s.overridden["model"] = "COLI_MODEL"
    ram = _num(env.get("COLI_RAM_GB"), float)
    if ram is not None and ram > 0:
        s.ram_gb = ram
        s.overridden["ram_gb"] = "COLI_RAM_GB"
    return s


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{s}"'


def dumps(s: Settings) -> str:
    """TOML text for the settings (None values are left out: TOML has no null)."""
    lines = ["# colibrì settings (coli chat). Environment overrides: COLI_MODEL, COLI_RAM_GB.", ""]
    if s.model:
        lines.append(f"model = {_toml_value(s.model)}")
    if s.theme:
        lines.append(f"theme = {_toml_value(s.theme)}")
    lines += ["", "[engine]"]
    for k in ENGINE_KEYS:
        v = getattr(s, k)
        if v is not None:
            lines.append(f"{k} = {_toml_value(v)}")
    lines += ["", "[sampling]"]
    for k, v in s.sampling.as_dict().items():
        if v is not None:
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def save(s: Settings, path: Path | None = None) -> Path:
    """Write atomically. Values that came from the environment are not written back."""
    path = path or config_path()
    stored = load(path, env={}) if path.exists() else Settings()
    out = Settings(**{f.name: getattr(s, f.name) for f in fields(Settings)})
    for k in s.overridden:
        setattr(out, k, getattr(stored, k))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(out))
    os.replace(tmp, path)
    return path
