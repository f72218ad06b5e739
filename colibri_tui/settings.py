"""The app's settings: a TOML file under platformdirs' user config dir, with environment overrides.

``COLI_CONFIG_DIR`` moves the config (tests), ``COLI_MODEL`` and ``COLI_RAM_GB`` override the
stored model and RAM budget. Writes are atomic (``core.fileio.atomic_write_text``). The file is
untrusted: an invalid value falls back to its default and an unreadable file to the defaults,
each with a line in ``Settings.notices`` (the app shows them); saving over an unreadable file
moves it aside first, so nothing the user wrote is lost.
"""
from __future__ import annotations

import math
import os
import stat
import time
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from core.arch import KV_CACHES
from core.userdirs import APP_NAME, data_dir  # noqa: F401  (data_dir: one definition, shared with core)
from core.policies import POLICY_NAMES as POLICIES
from core.sampling import MAX_SEED


def config_dir() -> Path:
    env = os.environ.get("COLI_CONFIG_DIR")
    if env:
        return Path(env)
    from platformdirs import user_config_dir
    return Path(user_config_dir(APP_NAME, appauthor=False))




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


MAX_THREADS = 1024       # a typo like 100000 would have OpenMP start that many threads
_SHOW = 40


def show_value(v) -> str:
    """A value or key from a file, short (it goes into a notice; notify makes it plain text)."""
    r = repr(v)
    return r if len(r) <= _SHOW else r[: _SHOW - 1] + "…"


def _note(notices: list | None, text: str) -> None:
    if notices is not None and text not in notices:
        notices.append(text)


def _number(v) -> float:
    """A finite number from TOML/JSON (a numeric string too); never a bool, inf or NaN."""
    if isinstance(v, bool) or not isinstance(v, (int, float, str)):
        raise TypeError("not a number")
    try:
        f = float(v)
    except ValueError:
        raise ValueError("not a number") from None
    if not math.isfinite(f):
        raise ValueError("not a finite number")
    return f


def _whole(v) -> int:
    """A whole number: 12 or 12.0 (or "12"), never 12.5, a bool, inf or NaN."""
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            pass
    f = _number(v)
    if f != int(f):
        raise ValueError("not a whole number")
    return int(f)


def _between(kind, lo=None, hi=None, lo_open=False):
    """A check: ``kind(v)`` within [lo, hi] ((lo, hi] with lo_open); None = unbounded."""
    bounds = [f"{'>' if lo_open else '>='} {lo}"] if lo is not None else []
    bounds += [f"<= {hi}"] if hi is not None else []
    why = "must be " + " and ".join(bounds)

    def check(v):
        x = kind(v)
        if (lo is not None and (x < lo or (lo_open and x == lo))) or (hi is not None and x > hi):
            raise ValueError(why)
        return x
    return check


_SAMPLING_CHECKS = {
    "temperature": _between(_number, 0.0),
    "top_p": _between(_number, 0.0, 1.0, lo_open=True),
    "top_k": _between(_whole, 0),
    "max_new_tokens": _between(_whole, 1),
    "seed": _between(_whole, 0, MAX_SEED),            # numpy's generators take 0..2^64-1
}


@dataclass
class Sampling:
    """Per-chat sampling (the defaults live in the config)."""
    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 512
    seed: int | None = None

    @classmethod
    def from_dict(cls, d, notices: list | None = None, where: str = "sampling") -> "Sampling":
        """Sampling from a config table or a chat's stored JSON, both untrusted: a value that is
        not valid (``inf``, ``-1``, a list, a string) falls back to its default, and ``notices``
        (when given) gets one line naming the key, so nothing goes wrong in silence."""
        s = cls()
        if d is None:
            return s
        if not isinstance(d, dict):
            _note(notices, f"{where} is not a table of settings ({show_value(d)}): the defaults are used")
            return s
        for name, value in d.items():
            check = _SAMPLING_CHECKS.get(name)
            if check is None:
                _note(notices, f"{where}: unknown key {show_value(name)} ignored")
                continue
            if value is None:
                continue
            try:
                setattr(s, name, check(value))
            except (TypeError, ValueError, OverflowError) as e:
                default = getattr(cls(), name)
                _note(notices, f"{where}.{name} = {show_value(value)} is invalid ({e}): the default "
                               f"({'a random seed' if default is None else default}) is used")
        return s

    def validate(self) -> None:
        from core.sampling import check_sampling
        check_sampling(self.temperature, self.top_k, self.top_p, self.seed)
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or self.max_new_tokens < 1:
            raise ValueError("max new tokens must be a whole number >= 1")

    def as_dict(self) -> dict:
        return asdict(self)


# the [engine] keys: a change to any of them reopens the model
ENGINE_KEYS = ("ram_gb", "policy", "prefetch", "threads", "o_direct", "kv_cache")
# [engine] keys applied to the open model as they are: prompt-prefix reuse, the saved chat caches
CACHE_KEYS = ("prefix_cache", "session_cache_gb")


@dataclass
class Settings:
    model: str = ""                 # container directory; "" = the embedded demo model
    ram_gb: float | None = None     # expert RAM budget in GB; None = automatic
    policy: str = "lfru"
    prefetch: bool = True
    threads: int | None = None      # None = automatic: the cores other programs leave free (core.threads)
    o_direct: bool = False
    kv_cache: str = "float32"       # KV cache precision; "float16" is opt-in (outputs change slightly)
    prefix_cache: bool = True       # a turn computes only what the chat's cache lacks (README: bits)
    session_cache_gb: float = 2.0   # disk for saved chat caches (least recently used go first); 0: none
    sampling: Sampling = field(default_factory=Sampling)
    theme: str = ""                 # a Textual theme name; "" = the default
    # the app's `coli serve` for the loaded model ([serve]): off unless switched on in settings
    serve: bool = False
    serve_host: str = "127.0.0.1"
    serve_port: int = 8080          # 0: a free port (shown in the tier panel)
    serve_key: str = ""             # "" = $COLI_API_KEY, else none (loopback only)
    # where each value came from when an environment variable overrode it (not saved)
    overridden: dict = field(default_factory=dict, repr=False)
    # what was wrong with the config (invalid values, an unreadable file): the app shows these
    notices: list = field(default_factory=list, repr=False, compare=False)

    def validate(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}")
        if self.ram_gb is not None and not (isinstance(self.ram_gb, (int, float)) and math.isfinite(self.ram_gb)
                                            and self.ram_gb > 0):
            raise ValueError("RAM budget must be a finite number > 0 GB")
        if self.threads is not None and not (isinstance(self.threads, int) and 1 <= self.threads <= MAX_THREADS):
            raise ValueError(f"threads must be a whole number in 1..{MAX_THREADS}")
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"KV cache must be one of {', '.join(KV_CACHES)}")
        if not (isinstance(self.session_cache_gb, (int, float)) and not isinstance(self.session_cache_gb, bool)
                and math.isfinite(self.session_cache_gb) and self.session_cache_gb >= 0):
            raise ValueError("the disk for saved chat caches must be a finite number >= 0 GB")
        if not isinstance(self.serve_port, int) or isinstance(self.serve_port, bool) or not 0 <= self.serve_port <= 65535:
            raise ValueError("the server's port must be a whole number in 0..65535")
        if not isinstance(self.serve_host, str) or not self.serve_host.strip():
            raise ValueError("the server's host must not be empty")
        from .server import is_loopback
        if self.serve and not is_loopback(self.serve_host) and not (self.serve_key or os.environ.get("COLI_API_KEY")):
            raise ValueError(f"serving on {self.serve_host} (reachable from other machines) must have an API key")
        self.sampling.validate()


def _host(v) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ValueError("not a host name or address")
    return v.strip()


def _num(v, kind):
    """An environment value: None when it is not a finite number."""
    if v is None or v == "":
        return None
    try:
        x = kind(v)
    except (TypeError, ValueError, OverflowError):
        return None
    return x if math.isfinite(x) else None


def _bool(v) -> bool:
    if not isinstance(v, bool):
        raise TypeError("not true or false")
    return v


def _one_of(names):
    def check(v):
        if not isinstance(v, str) or v not in names:
            raise ValueError(f"not one of {', '.join(names)}")
        return v
    return check


def _text(v) -> str:
    if not isinstance(v, str):
        raise TypeError("not a string")
    return v


# [engine]: key -> check (None = absent = automatic, for ram_gb and threads)
_ENGINE_CHECKS = {
    "ram_gb": _between(_number, 0.0, lo_open=True),
    "policy": _one_of(POLICIES),
    "prefetch": _bool,
    "threads": _between(_whole, 1, MAX_THREADS),
    "o_direct": _bool,
    "kv_cache": _one_of(KV_CACHES),
    "prefix_cache": _bool,
    "session_cache_gb": _between(_number, 0.0),
}
_TOP_CHECKS = {"model": _text, "theme": _text}
# [serve]: key -> (the Settings field, check)
_SERVE_CHECKS = {"enabled": _bool, "host": _host, "port": _between(_whole, 0, 65535), "api_key": _text}
_SERVE_FIELDS = {"enabled": "serve", "host": "serve_host", "port": "serve_port", "api_key": "serve_key"}


def _read(path: Path) -> tuple[dict, str | None]:
    """(the config's table, None) or ({}, why it cannot be used). A missing file is fine."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return {}, None
    except OSError as e:
        return {}, e.strerror or str(e)
    if not stat.S_ISREG(st.st_mode):              # a directory; a FIFO would block the read
        return {}, "not a regular file"
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8")), None
    except OSError as e:
        return {}, e.strerror or str(e)
    except UnicodeDecodeError:
        return {}, "not UTF-8 text"
    except tomllib.TOMLDecodeError as e:
        return {}, f"not valid TOML ({e})"
    except RecursionError:
        return {}, "not valid TOML (nested too deeply)"


def _check(table: dict, checks: dict, target, where: str, notices: list) -> None:
    """Set each valid key of ``table`` on ``target``; an invalid one keeps the default, noted."""
    for key, value in table.items():
        check = checks.get(key)
        if check is None:
            continue
        try:
            setattr(target, key, check(value))
        except (TypeError, ValueError, OverflowError) as e:
            default = getattr(Settings(), key)
            shown = "automatic" if default is None else repr(default) if isinstance(default, str) else default
            _note(notices, f"{where}{key} = {show_value(value)} is invalid ({e}): the default ({shown}) is used")


def load(path: Path | None = None, env: dict | None = None) -> Settings:
    """Read the config and apply env overrides. Never raises: an unreadable file gives the
    defaults, an invalid value its default, and each says so in ``Settings.notices``."""
    path = path or config_path()
    env = os.environ if env is None else env
    s = Settings()
    notes: list[str] = []
    data, problem = _read(path)
    if problem:
        notes.append(f"{path} cannot be used ({problem}): the default settings are used; saving the "
                     f"settings keeps that file, moved aside")
    _check(data, _TOP_CHECKS, s, "", notes)
    for key, value in data.items():
        if key in ("engine", "sampling", "serve") and not isinstance(value, dict):
            notes.append(f"{key} = {show_value(value)} is not a table of settings: its defaults are used")
        elif key not in _TOP_CHECKS and key not in ("engine", "sampling", "serve"):
            notes.append(f"unknown key {show_value(key)} ignored")
    eng = data.get("engine")
    if isinstance(eng, dict):
        _check(eng, _ENGINE_CHECKS, s, "engine.", notes)
        notes += [f"engine: unknown key {show_value(k)} ignored" for k in eng if k not in _ENGINE_CHECKS]
    if isinstance(data.get("sampling"), dict):
        s.sampling = Sampling.from_dict(data["sampling"], notes)
    srv = data.get("serve")
    if isinstance(srv, dict):
        for key, value in srv.items():
            if key not in _SERVE_CHECKS:
                notes.append(f"serve: unknown key {show_value(key)} ignored")
                continue
            try:
                setattr(s, _SERVE_FIELDS[key], _SERVE_CHECKS[key](value))
            except (TypeError, ValueError, OverflowError) as e:
                default = getattr(Settings(), _SERVE_FIELDS[key])
                _note(notes, f"serve.{key} = {show_value(value)} is invalid ({e}): the default "
                             f"({default!r}) is used")
    s.notices = [n if n.startswith(str(path)) else f"{path.name}: {n}" for n in notes]
    if env.get("COLI_MODEL"):
        s.model = env["COLI_MODEL"]
        s.overridden["model"] = "COLI_MODEL"
    raw_ram = env.get("COLI_RAM_GB")
    ram = _num(raw_ram, float)
    if ram is not None and ram > 0:
        s.ram_gb = ram
        s.overridden["ram_gb"] = "COLI_RAM_GB"
    elif raw_ram:
        s.notices.append(f"COLI_RAM_GB={show_value(raw_ram)} is not a RAM budget in GB (a finite number > 0): "
                         f"ignored")
    return s


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    # control characters escaped: a raw one makes the file invalid TOML (and the settings lost)
    s = "".join(c if c >= " " and c not in '"\\\x7f' else f"\\u{ord(c):04x}" for c in str(v))
    return f'"{s}"'


def dumps(s: Settings) -> str:
    """TOML text for the settings (None values are left out: TOML has no null)."""
    lines = ["# colibrì settings (coli chat). Environment overrides: COLI_MODEL, COLI_RAM_GB.", ""]
    if s.model:
        lines.append(f"model = {_toml_value(s.model)}")
    if s.theme:
        lines.append(f"theme = {_toml_value(s.theme)}")
    lines += ["", "[engine]"]
    for k in ENGINE_KEYS + CACHE_KEYS:
        v = getattr(s, k)
        if v is not None:
            lines.append(f"{k} = {_toml_value(v)}")
    lines += ["", "[sampling]"]
    for k, v in s.sampling.as_dict().items():
        if v is not None:
            lines.append(f"{k} = {_toml_value(v)}")
    lines += ["", "[serve]"]
    for k, f in _SERVE_FIELDS.items():
        v = getattr(s, f)
        if k != "api_key" or v:
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def aside_name(path: Path) -> Path:
    """Where a damaged file is moved so that nothing the user had is lost."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        p = path.with_name(f"{path.name}.damaged-{stamp}" + (f"-{n}" if n else ""))
        if not os.path.lexists(p):
            return p
    raise OSError(f"no free name beside {path}")


def save(s: Settings, path: Path | None = None) -> Path:
    """Write atomically. Values that came from the environment are not written back. A config
    that cannot be read is moved aside first (kept, named in ``s.notices``), never overwritten.
    OSError when the file cannot be written."""
    from core.errors import ColiError
    from core.fileio import atomic_write_text
    path = path or config_path()
    _, problem = _read(path)
    stored = load(path, env={}) if not problem else Settings()
    out = Settings(**{f.name: getattr(s, f.name) for f in fields(Settings)})
    for k in s.overridden:
        setattr(out, k, getattr(stored, k))
    path.parent.mkdir(parents=True, exist_ok=True)
    if problem and os.path.lexists(path):
        aside = aside_name(path)
        os.replace(path, aside)
        _note(s.notices, f"the old {path.name} ({problem}) is kept as {aside}")
    try:
        atomic_write_text(path, dumps(out))
    except ColiError as e:                   # callers handle OSError (the file could not be written)
        raise OSError(str(e)) from None
    return path
