"""`coli list` and `coli rm NAME`: the models the app knows.

Known = the containers the app made or opened (``coli convert`` and the wizard record them in
``models.json`` under the user data dir), every container in the wizard's default folder
(``DATA_DIR/models``), the model in the config file, and the embedded demo model; and, to
convert, the Hugging Face cache's checkpoints (huggingface_hub's ``scan_cache_dir``). ``coli rm``
deletes only a colibrì container (a ``colibri.json`` of format "colibri"), never the demo
model, and asks first unless given ``--yes``.
"""
from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from core.errors import ColiError

from . import settings as settings_mod

KNOWN_FILE = "models.json"
MANIFEST = "colibri.json"


@dataclass
class KnownModel:
    name: str
    family: str
    size_bytes: int
    path: str
    configured: bool = False     # the config file's model (what `coli chat` opens)
    demo: bool = False
    kind: str = "container"      # or "hf-cache": a checkpoint to convert (`coli convert REPO OUT`)


def _known_file() -> Path:
    return settings_mod.data_dir() / KNOWN_FILE


def _remembered() -> list[str]:
    try:
        d = json.loads(_known_file().read_text())
        return [str(p) for p in d.get("models", []) if isinstance(p, str)] if isinstance(d, dict) else []
    except (OSError, ValueError):
        return []


def _write_remembered(paths: list[str]) -> None:
    from core.fileio import atomic_write_text
    f = _known_file()
    f.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(f, json.dumps({"models": paths}, indent=1))


def remember(path: str | Path) -> None:
    """Record a container the app made or opened (best effort: listing is a convenience)."""
    p = str(Path(path).expanduser().resolve())
    try:
        paths = _remembered()
        if p not in paths:
            _write_remembered([*paths, p])
    except OSError:
        pass


def forget(path: str | Path) -> None:
    p = str(Path(path).resolve())
    paths = _remembered()
    if p in paths:
        _write_remembered([x for x in paths if x != p])


def is_container(path: Path) -> bool:
    try:
        m = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(m, dict) and m.get("format") == "colibri"


def _family(path: Path) -> str:
    try:
        return str(json.loads((path / "config.json").read_text()).get("model_type", "?"))
    except (OSError, ValueError, AttributeError):
        return "?"


def dir_size(path: Path) -> int:
    total = 0
    for f in path.rglob("*"):
        try:
            if f.is_file() and not f.is_symlink():
                total += f.stat().st_size
        except OSError:
            pass
    return total


def _demo() -> Path | None:
    from models import default_model
    d = default_model()
    return d.resolve() if d is not None else None


def known_models() -> list[KnownModel]:
    settings = settings_mod.load(env={})
    configured = Path(settings.model).expanduser().resolve() if settings.model else None
    demo = _demo()
    candidates = [Path(p) for p in _remembered()]
    base = settings_mod.data_dir() / "models"
    if base.is_dir():
        candidates += sorted(p for p in base.iterdir() if p.is_dir())
    if configured is not None:
        candidates.append(configured)
    if demo is not None:
        candidates.append(demo)
    out, seen = [], set()
    for p in candidates:
        p = p.expanduser().resolve()
        if p in seen or not is_container(p):
            continue
        seen.add(p)
        out.append(KnownModel(p.name, _family(p), dir_size(p), str(p), configured == p, demo == p))
    return out


def hf_cache_models() -> list[KnownModel]:
    """Checkpoints with safetensors weights in the Hugging Face cache (no network)."""
    from core.downloader import _has_weights, hf_cache_dir
    cache = hf_cache_dir()
    if not cache.is_dir():
        return []
    from huggingface_hub import scan_cache_dir
    try:
        info = scan_cache_dir(cache)
    except Exception:                 # an unreadable or foreign folder: nothing to list
        return []
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        rev = max(repo.revisions, key=lambda r: r.last_modified)
        if _has_weights(Path(rev.snapshot_path)):
            out.append(KnownModel(repo.repo_id, _family(Path(rev.snapshot_path)), repo.size_on_disk,
                                  str(rev.snapshot_path), kind="hf-cache"))
    return out


def _human(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def cmd_list(args) -> int:
    models = known_models() + hf_cache_models()
    if args.json:
        print(json.dumps([asdict(m) for m in models]))
        return 0
    if not models:
        print("no models yet: `coli download REPO` then `coli convert`, or `coli` for the setup wizard",
              file=sys.stderr)
        return 0
    rows = [("NAME", "FAMILY", "SIZE", "WHERE")]
    for m in models:
        mark = (" (demo)" if m.demo else " (configured)" if m.configured
                else " (Hugging Face cache: coli convert NAME OUT)" if m.kind == "hf-cache" else "")
        rows.append((m.name, m.family, _human(m.size_bytes), m.path + mark))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
    return 0


def _resolve(name: str) -> Path:
    p = Path(name).expanduser()
    if p.is_dir():
        return p.resolve()
    matches = [m for m in known_models() if m.name == name]
    if not matches:
        raise ColiError(f"{name}: no such model (see `coli list`)")
    if len(matches) > 1:
        raise ColiError(f"{name}: {len(matches)} models have that name; give the path "
                        f"({', '.join(m.path for m in matches)})")
    return Path(matches[0].path)


def cmd_rm(args) -> int:
    path = _resolve(args.name)
    demo = _demo()
    if demo is not None and (path == demo or demo.is_relative_to(path)):
        raise ColiError(f"{path} is the embedded demo model; it cannot be removed")
    if not is_container(path):
        raise ColiError(f"{path} is not a colibrì container (no {MANIFEST}); coli rm removes only "
                        f"containers")
    size = dir_size(path)
    if not args.yes:
        if not sys.stdin.isatty():
            raise ColiError(f"remove {path}? pass --yes to confirm without a terminal")
        answer = input(f"remove {path} ({_human(size)})? [y/N] ").strip().lower()
        if answer not in ("y", "yes"):
            print("nothing removed", file=sys.stderr)
            return 0
    try:
        shutil.rmtree(path)
    except OSError as e:
        raise ColiError(f"could not remove {path}: {e.strerror or e}") from None
    try:
        forget(path)
    except OSError:
        pass
    note = ""
    settings = settings_mod.load(env={})
    if settings.model and Path(settings.model).expanduser().resolve() == path:
        settings.model = ""
        settings_mod.save(settings)
        note = "; the config now opens the demo model (or the setup wizard)"
    print(f"removed {path} ({_human(size)}){note}", file=sys.stderr)
    return 0


def add_parsers(sub) -> None:
    p = sub.add_parser("list", help="the models this app knows: name, family, size on disk, where")
    p.add_argument("--json", action="store_true", help="print one JSON array on stdout")
    p = sub.add_parser("rm", help="delete a converted model (asks first)")
    p.add_argument("name", metavar="NAME", help="a name from `coli list`, or a container's path")
    p.add_argument("--yes", "-y", action="store_true", help="do not ask for confirmation")
