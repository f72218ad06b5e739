"""The setup wizard: from nothing to a running model.

1. choose a model from the catalog (fit check per row), any Hub repo id, a folder the user already
   has (a Hugging Face model directory or a colibrì container), or the embedded demo model;
2. choose where it lives (free-space check);
3. download (per-file and total progress, cancel, resume: ``core.downloader``);
4. convert (the converter's progress callback; resumable);
5. verify (every shard's checksum, then the container opens and a short generation runs) and
   open the chat.

A repo the Hugging Face cache already holds is converted from the cache (nothing is fetched); a
folder picked inside a cache snapshot is named after its repo, not its commit. After a download
and conversion the wizard offers to delete the download (it can be hundreds of GB).

The wizard's position is saved after every step in ``wizard.json`` under the user data dir, so a
closed, cancelled or killed wizard continues where it stopped. Work runs in one thread worker; it
only writes the latest progress into a dict that a 10 Hz timer paints (no per-chunk messages).
Errors are one line in the UI, never a traceback.
"""
from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import (Button, ContentSwitcher, DataTable, Footer, Header, Input, Label, ProgressBar,
                             Static)

from . import settings as settings_mod
from .paths import logger
from .tierpanel import human_bytes

log = logger("wizard")

STATE_FILE = "wizard.json"
STEPS = ("choose", "where", "download", "convert", "verify", "done")
TITLES = {"choose": "1 · choose a model", "where": "2 · where it lives", "download": "3 · download",
          "convert": "4 · convert", "verify": "5 · verify", "done": "done"}
DOWNLOAD_RETRIES = 3
VERIFY_TOKENS = 4
BITS = 4


@dataclass
class WizardState:
    step: str = "choose"
    kind: str = ""               # 'hub' | 'folder' | 'container' | 'demo' ('folder': also a cache snapshot)
    repo: str = ""
    label: str = ""
    base_dir: str = ""
    download_dir: str = ""
    container_dir: str = ""
    need_gb: float = 0.0         # catalog estimate: download + container
    error: str = ""

    @property
    def resumable(self) -> bool:
        return self.step in ("download", "convert", "verify")


def state_path() -> Path:
    return settings_mod.data_dir() / STATE_FILE


def load_state() -> WizardState:
    try:
        d = json.loads(state_path().read_text())
        st = WizardState(**{f.name: d[f.name] for f in fields(WizardState) if f.name in d})
        return st if st.step in STEPS else WizardState()
    except (OSError, ValueError, TypeError):
        return WizardState()


def save_state(st: WizardState) -> None:
    from core.fileio import atomic_write_text
    p = state_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(p, json.dumps(asdict(st), indent=1))


def clear_state() -> None:
    try:
        state_path().unlink()
    except OSError:
        pass


def pending_setup() -> WizardState | None:
    """An unfinished setup the wizard can resume, or None."""
    st = load_state()
    return st if st.resumable else None


def default_base_dir() -> Path:
    return settings_mod.data_dir() / "models"


def _slug(text: str) -> str:
    return re.sub(r"[^\w.\-]+", "-", text.strip().split("/")[-1]).strip("-") or "model"


class _Cancelled(Exception):
    pass


# the catalog's columns; Model and the fit check ("Here") always show, a narrow terminal drops the
# others in this order until the rest fits (the fit-detail line below the table says more)
COLUMNS = ("Model", "Family", "Params (active)", "Disk int4", "Download", "Min RAM", "Here")
DROP_ORDER = ("Family", "Download", "Min RAM", "Disk int4", "Params (active)")
CELL_PADDING = 2                 # DataTable's default: one cell each side
WIZARD_CHROME = 4                # the wizard's side padding and the scroll bar
MAX_WIDTH = 130                  # as #wizard's max-width


def catalog_columns(rows: list[dict[str, str]], width: int) -> tuple[str, ...]:
    """The columns that fit in ``width`` terminal cells, for these rows (column -> cell text)."""
    from rich.cells import cell_len
    need = {c: CELL_PADDING + max([cell_len(c), *(cell_len(str(r[c])) for r in rows)]) for c in COLUMNS}
    room = min(width, MAX_WIDTH) - WIZARD_CHROME
    cols = list(COLUMNS)
    for c in DROP_ORDER:
        if sum(need[k] for k in cols) <= room:
            break
        cols.remove(c)
    return tuple(cols)


class SetupWizard(Screen):
    """Push it on the app; on success it sets ``settings.model``, hands the verified engine to the
    app (``app._engine_loaded``) and closes itself, which shows the chat."""

    BINDINGS = [Binding("escape", "close", "Close (resumes later)")]
    DEFAULT_CSS = """
    SetupWizard { align-horizontal: center; }
    SetupWizard #wizard { width: 100%; max-width: 130; padding: 0 1; }
    SetupWizard #step-title { text-style: bold; color: $accent; margin: 1 0; }
    SetupWizard .hint { color: $text-muted; height: auto; }
    SetupWizard DataTable { height: auto; max-height: 14; margin-bottom: 1; }
    SetupWizard .row { height: auto; margin-bottom: 1; }
    SetupWizard .row Input { width: 1fr; }
    SetupWizard .row Button { margin-left: 1; }
    SetupWizard ProgressBar { margin-bottom: 1; }
    SetupWizard #error { color: $error; height: auto; margin-bottom: 1; }
    SetupWizard .buttons Button { margin-right: 1; }
    """

    def __init__(self, catalog=None, endpoint: str | None = None):
        super().__init__()
        self.catalog = catalog
        self.endpoint = endpoint
        self.state = load_state()
        self.cancel_event = threading.Event()
        self.running = False
        self._progress: dict = {}
        self._lock = threading.Lock()
        self._entries: dict[str, object] = {}
        self._fits: dict[str, object] = {}
        self._columns: tuple[str, ...] = ()
        self._finished = None              # (state, engine) while asking about the download

    # --- layout --------------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Vertical(id="wizard"):
            yield Label("", id="step-title")
            yield Static("", id="error")
            with ContentSwitcher(initial="choose", id="steps"):
                with VerticalScroll(id="choose"):
                    yield Static("", id="machine", classes="hint")
                    yield DataTable(id="catalog", cursor_type="row", zebra_stripes=True)
                    yield Static("", id="fit-detail", classes="hint")
                    with Horizontal(classes="row"):
                        yield Input(placeholder="or any Hugging Face repo id (owner/name)", id="repo")
                        yield Button("Use repo", id="use-repo")
                    with Horizontal(classes="row"):
                        yield Input(placeholder="a folder I already have: a Hugging Face model or a colibrì "
                                                "container", id="folder")
                        yield Button("Use folder", id="use-folder")
                    with Horizontal(classes="row"):
                        yield Button("Use the demo model", id="demo")
                with Vertical(id="where"):
                    yield Static("", id="where-what", classes="hint")
                    with Horizontal(classes="row"):
                        yield Input(id="base")
                    yield Static("", id="space", classes="hint")
                    with Horizontal(classes="buttons row"):
                        yield Button("Back", id="back")
                        yield Button("Start", variant="primary", id="start")
                with Vertical(id="work"):
                    yield Static("", id="stage")
                    yield Static("", id="file-line", classes="hint")
                    yield ProgressBar(id="file-bar", show_eta=False)
                    yield Static("", id="total-line", classes="hint")
                    yield ProgressBar(id="total-bar")
                    yield Static("", id="convert-line", classes="hint")
                    yield ProgressBar(id="convert-bar")
                    yield Static("", id="verify-line", classes="hint")
                    with Horizontal(classes="buttons row"):
                        yield Button("Cancel", variant="warning", id="cancel")
                        yield Button("Resume", variant="primary", id="resume")
                        yield Button("Start over", id="restart")
                    yield Static("", id="source-question", classes="hint")
                    with Horizontal(classes="buttons row", id="source-buttons"):
                        yield Button("Delete the download", variant="error", id="delete-source")
                        yield Button("Keep it", variant="primary", id="keep-source")
        yield Footer()

    def on_mount(self) -> None:
        self.title = "colibrì · set up a model"
        self._fill_catalog()
        self.set_interval(0.1, self._paint)
        try:
            from models import default_model
            has_demo = default_model() is not None
        except Exception:
            has_demo = False
        self.query_one("#demo", Button).disabled = not has_demo
        self._show_source_question(False)
        if self.state.resumable:
            self._show_work(paused=True)
            self._paint_paused()
            self._error(self.state.error or f"setup of {self.state.label} stopped at "
                                              f"{self.state.step}: Resume continues from there")
            self.query_one("#resume", Button).focus()          # Enter resumes
        else:
            self.state = WizardState()
            self._go("choose")

    # --- helpers -------------------------------------------------------------------------------
    def _go(self, step: str) -> None:
        panel = step if step in ("choose", "where") else "work"
        self.query_one("#steps", ContentSwitcher).current = panel
        self.query_one("#step-title", Label).update(f"Set up a model · {TITLES[step]}")
        if panel == "choose":
            self.query_one("#catalog", DataTable).focus()

    def _error(self, text: str) -> None:
        self.query_one("#error", Static).update(Text(text))

    def _save(self) -> None:
        try:
            save_state(self.state)
        except Exception:
            pass                 # the wizard still works; it just cannot resume after a restart

    def _fill_catalog(self) -> None:
        import psutil
        from models import catalog as cat
        try:
            entries = self.catalog if self.catalog is not None else cat.load()
        except Exception as e:
            entries = []
            self._error(f"catalog unreadable: {e}")
        base = default_base_dir()
        vm = psutil.virtual_memory()
        self.query_one("#machine", Static).update(Text(
            f"This machine: {vm.total / 1e9:.0f} GB RAM ({vm.available / 1e9:.1f} GB available), "
            f"{cat.free_disk(base) / 1e9:.0f} GB free at {base}. Enter picks a model."))
        for e in entries:
            self._entries[e.repo] = e
            self._fits[e.repo] = cat.fit(e, base)
        self._fill_rows(self.app.size.width)

    def _cells(self) -> list[dict]:
        rows = []
        for e in self._entries.values():
            f = self._fits[e.repo]
            colour = {"ram": "green", "stream": "yellow"}.get(f.verdict, "red")
            rows.append({"Model": e.name, "Family": e.family,
                         "Params (active)": f"{e.params_b:.1f}B ({e.active_b:.1f}B)",
                         "Disk int4": f"{e.disk_gb:.1f} GB", "Download": f"{e.download_gb:.1f} GB",
                         "Min RAM": f"{e.min_ram_gb:.0f} GB", "Here": Text(f.short, style=colour),
                         "key": e.repo})
        return rows

    def _fill_rows(self, width: int) -> None:
        """(Re)build the table for this terminal width; the fit check column always shows."""
        rows = self._cells()
        columns = catalog_columns(rows, width)
        if columns == self._columns:
            return
        self._columns = columns
        table = self.query_one("#catalog", DataTable)
        row = table.cursor_row
        table.clear(columns=True)
        table.add_columns(*columns)
        for cells in rows:
            table.add_row(*(cells[c] for c in columns), key=cells["key"])
        if table.row_count:
            table.move_cursor(row=min(row, table.row_count - 1))

    def on_resize(self, event) -> None:
        if self._entries:
            self._fill_rows(self.app.size.width)

    # --- step 1: choose ------------------------------------------------------------------------
    @on(DataTable.RowHighlighted, "#catalog")
    def _row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        e, f = self._entries.get(event.row_key.value), self._fits.get(event.row_key.value)
        if e is not None and f is not None:
            self.query_one("#fit-detail", Static).update(Text(
                f"{e.repo} · {f.text}" + (f" · {e.note}" if e.note else "")))

    @on(DataTable.RowSelected, "#catalog")
    def _row_selected(self, event: DataTable.RowSelected) -> None:
        e = self._entries.get(event.row_key.value)
        if e is not None:
            self._choose_hub(e.repo, e.name, e.download_gb + e.disk_gb + e.mtp_gb)   # as fit()'s need

    @on(Button.Pressed, "#use-repo")
    @on(Input.Submitted, "#repo")
    def _use_repo(self) -> None:
        repo = self.query_one("#repo", Input).value.strip()
        if not re.fullmatch(r"[\w.\-]+/[\w.\-]+", repo):
            self._error("a Hugging Face repo id looks like owner/name")
            return
        self._choose_hub(repo, repo, 0.0)

    def _choose_hub(self, repo: str, label: str, need_gb: float) -> None:
        from core.downloader import cached_snapshot
        snap = cached_snapshot(repo)
        if snap is not None:              # the Hugging Face cache has it: convert from there
            self.state = WizardState(step="where", kind="folder", repo=repo, label=label, download_dir=str(snap))
            self._where(f"{label} ({repo}) is in the Hugging Face cache ({snap}): nothing to download. "
                        f"It will be converted into a colibrì container in a folder here.")
            return
        self.state = WizardState(step="where", kind="hub", repo=repo, label=label, need_gb=need_gb)
        self._where(f"{label} ({repo}) will be downloaded into a folder here and converted beside it. "
                    + (f"It needs about {need_gb:.1f} GB." if need_gb else ""))

    @on(Button.Pressed, "#use-folder")
    @on(Input.Submitted, "#folder")
    def _use_folder(self) -> None:
        raw = self.query_one("#folder", Input).value.strip()
        if not raw:
            self._error("type the path of a folder")
            return
        p = Path(raw).expanduser()
        if (p / "colibri.json").exists():
            self.state = WizardState(step="verify", kind="container", label=p.name, container_dir=str(p))
            self._start()
        elif (p / "config.json").exists():
            from core.downloader import repo_from_cache_path
            repo = repo_from_cache_path(p)           # a cache snapshot's folder is a commit hash
            self.state = WizardState(step="where", kind="folder", repo=repo or "", label=repo or p.name,
                                     download_dir=str(p))
            self._where(f"{p} will be converted into a colibrì container in a folder here.")
        elif not p.is_dir():
            self._error(f"{p}: no such folder")
        else:
            self._error(f"{p}: neither a Hugging Face model (config.json) nor a colibrì container (colibri.json)")

    @on(Button.Pressed, "#demo")
    def _use_demo(self) -> None:
        from models import default_model
        demo = default_model()
        if demo is None:
            self._error("this install has no demo model")
            return
        self.state = WizardState(step="verify", kind="demo", label="demo model", container_dir=str(demo))
        self._start()

    # --- step 2: where -------------------------------------------------------------------------
    def _where(self, what: str) -> None:
        self._error("")
        self.query_one("#where-what", Static).update(Text(what))
        base = self.query_one("#base", Input)
        base.value = self.state.base_dir or str(default_base_dir())
        self._update_space(base.value)
        self._go("where")
        base.focus()

    @on(Input.Changed, "#base")
    def _base_changed(self, event: Input.Changed) -> None:
        self._update_space(event.value)

    def _update_space(self, raw: str) -> bool:
        from models.catalog import free_disk
        line = self.query_one("#space", Static)
        if not raw.strip():
            line.update("type a folder")
            return False
        try:
            free = free_disk(raw) / 1e9
        except OSError as e:
            line.update(Text(f"cannot use this folder: {e.strerror or e}"))
            return False
        need = self.state.need_gb
        if need and need > free:
            line.update(Text(f"{free:.1f} GB free here, about {need:.1f} GB needed: choose another disk",
                             style="red"))
            return False
        line.update(Text(f"{free:.1f} GB free here" + (f", about {need:.1f} GB needed" if need else ""),
                         style="green" if need else ""))
        return True

    @on(Button.Pressed, "#back")
    def _back(self) -> None:
        self.state = WizardState()
        self._error("")
        self._go("choose")

    @on(Button.Pressed, "#start")
    @on(Input.Submitted, "#base")
    def _start_from_where(self) -> None:
        raw = self.query_one("#base", Input).value.strip()
        if not self._update_space(raw):
            self._error("not enough free space in that folder (or it cannot be used)")
            return
        base = Path(raw).expanduser().resolve()
        st = self.state
        st.base_dir = str(base)
        if st.kind == "hub":
            st.download_dir = str(base / (_slug(st.repo) + "-hf"))
            st.container_dir = str(base / _slug(st.repo))
            st.step = "download"
        else:
            st.container_dir = str(base / _slug(st.repo or st.label))
            st.step = "convert"
        self._start()

    # --- steps 3-5: the work -------------------------------------------------------------------
    def _show_work(self, paused: bool) -> None:
        self._go(self.state.step if self.state.step in ("download", "convert", "verify") else "verify")
        self.query_one("#cancel", Button).display = not paused
        self.query_one("#resume", Button).display = paused
        self.query_one("#restart", Button).display = paused
        st = self.state
        src = (st.repo if st.kind == "hub" else st.download_dir or st.container_dir) or st.repo
        head = src if st.label in (src, Path(src).name) else f"{st.label} · {src}"
        self.query_one("#stage", Static).update(Text(head + (f" → {st.container_dir}"
                                                     if st.kind in ("hub", "folder") else "")))
        if not paused:
            for bar in ("#file-bar", "#total-bar", "#convert-bar"):
                self.query_one(bar, ProgressBar).update(total=1, progress=0)
            self.query_one("#convert-line", Static).update("convert: after the download" if st.kind == "hub"
                                                           else "convert")
            self.query_one("#verify-line", Static).update("")
        for wid, show in (("#file-line", st.kind == "hub"), ("#file-bar", st.kind == "hub"),
                          ("#total-line", st.kind == "hub"), ("#total-bar", st.kind == "hub"),
                          ("#convert-line", st.kind in ("hub", "folder")),
                          ("#convert-bar", st.kind in ("hub", "folder"))):
            self.query_one(wid).display = show

    def _paint_paused(self) -> None:
        """A paused setup shows how far it got (determinate bars), never an animated '--%'."""
        st = self.state
        bars = {b: self.query_one(b, ProgressBar) for b in ("#file-bar", "#total-bar", "#convert-bar")}
        for bar in bars.values():
            bar.update(total=1, progress=0)
        if st.kind == "hub":
            done, total = _downloaded_so_far(st.download_dir)
            if st.step != "download":
                done = total = max(total, 1)
            bars["#total-bar"].update(total=max(1, total), progress=done)
            self.query_one("#total-line", Static).update(Text(
                f"downloaded {human_bytes(done)} of {human_bytes(total)}" if total else "download: not started"))
            self.query_one("#file-line", Static).update("")
        converted = st.step == "verify"
        if converted:
            bars["#convert-bar"].update(total=1, progress=1)
        self.query_one("#convert-line", Static).update(
            "converted" if converted else "convert: continues from its last finished shard"
            if st.step == "convert" else "convert: after the download")

    def _start(self) -> None:
        if self.running:
            return
        self.state.error = ""
        self._save()
        self._error("")
        self.cancel_event = threading.Event()
        self.running = True
        self._show_work(paused=False)
        self.query_one("#cancel", Button).focus()
        self._run(self.state, self.cancel_event)

    @on(Button.Pressed, "#resume")
    def _resume(self) -> None:
        self._start()

    @on(Button.Pressed, "#restart")
    def _restart(self) -> None:
        clear_state()
        self.state = WizardState()
        self._error("")
        self._go("choose")

    @on(Button.Pressed, "#cancel")
    def _cancel(self) -> None:
        if self.running:
            self.cancel_event.set()
            self.query_one("#verify-line", Static).update("cancelling …")

    def action_close(self) -> None:
        if self._finished is not None:        # asked about the download: closing keeps it
            self._keep_source()
            return
        self.cancel_event.set()
        self.dismiss(None)

    def on_unmount(self) -> None:
        self.cancel_event.set()       # the app is closing: stop the worker at its next check
        if self._finished is not None:                # closed while asking about the download
            _close_engine(self._finished[1])
            self._finished = None

    def _set(self, **kw) -> None:
        with self._lock:
            self._progress.update(kw)

    def _paint(self) -> None:
        with self._lock:
            p, self._progress = self._progress, {}
        if not p:
            return
        if "file" in p:
            self.query_one("#file-line", Static).update(Text(p["file"]))
            self.query_one("#file-bar", ProgressBar).update(total=max(1, p["file_total"]), progress=p["file_done"])
        if "total" in p:
            self.query_one("#total-line", Static).update(Text(p["total"]))
            self.query_one("#total-bar", ProgressBar).update(total=max(1, p["total_bytes"]), progress=p["done"])
        if "convert" in p:
            self.query_one("#convert-line", Static).update(Text(p["convert"]))
            self.query_one("#convert-bar", ProgressBar).update(total=max(1, p["convert_total"]),
                                                              progress=p["convert_done"])
        if "verify" in p:
            self.query_one("#verify-line", Static).update(Text(p["verify"]))
        if "step" in p:
            self.query_one("#step-title", Label).update(f"Set up a model · {TITLES[p['step']]}")

    @work(thread=True, exclusive=True, group="wizard")
    def _run(self, st: WizardState, cancel: threading.Event) -> None:
        from core.downloader import DownloadCancelled, NoSuchRepo
        from core.errors import ColiError
        engine = None
        log.info("setup of %s (%s) from step %s", st.label, st.kind, st.step)
        try:
            if st.step == "download":
                self._download(st, cancel)
                st.step = "convert"
                self._save()
            if st.step == "convert":
                self._convert(st, cancel)
                st.step = "verify"
                self._save()
            if st.step == "verify":
                engine = self._verify(st, cancel)
            if not self._post(self._succeeded, st, engine) and engine is not None:
                _close_engine(engine)            # the app closed meanwhile
        except (DownloadCancelled, _Cancelled):
            self._stopped_in_thread(st, f"cancelled at {st.step}: Resume continues from there")
        except NoSuchRepo as e:               # a mistyped id: nothing to resume, back to the choice
            log.info("%s", e)
            if not self._post(self._no_such_repo, st, str(e)):
                clear_state()
        except ColiError as e:
            self._stopped_in_thread(st, str(e).splitlines()[0] if str(e) else f"{st.step} failed")
        except Exception as e:            # a bug: still one line (the traceback goes to the log)
            log.exception("setup failed at %s", st.step)
            self._stopped_in_thread(st, f"{st.step} failed: {e.__class__.__name__}: {e}")

    def _post(self, fn, *args) -> bool:
        """Run ``fn`` on the UI thread; False when the app has gone (closing)."""
        try:
            self.app.call_from_thread(fn, *args)
            return True
        except Exception:
            return False

    def _no_such_repo(self, st: WizardState, error: str) -> None:
        self.running = False
        clear_state()
        self.state = WizardState()
        if not self.is_attached:
            return
        self._go("choose")
        self._error(error)
        repo = self.query_one("#repo", Input)
        repo.value = st.repo
        repo.focus()

    def _stopped_in_thread(self, st: WizardState, error: str) -> None:
        log.info("setup stopped at %s: %s", st.step, error)
        if not self._post(self._stopped, st, error):
            st.error = error                     # the app closed: still remember where we were
            self._save()

    def _download(self, st: WizardState, cancel: threading.Event) -> None:
        from core.downloader import download
        from models import validate_config
        self._set(step="download", verify="")
        last, start = [0.0], [None, 0.0]            # start: (bytes, time) when fetching began

        def progress(p) -> None:
            now = time.monotonic()
            if start[0] is None or p.skipped:
                start[0], start[1] = p.done, now     # speed counts only bytes fetched in this run
            if now - last[0] < 0.05 and p.file_done < p.file_total:
                return
            last[0] = now
            fetched, secs = p.done - start[0], now - start[1]
            speed = f" · {human_bytes(fetched / secs)}/s" if fetched > 0 and secs > 0.5 else ""
            self._set(file=f"{p.file} · {human_bytes(p.file_done)} of {human_bytes(p.file_total)}"
                           + (" (already here)" if p.skipped else ""),
                      file_done=p.file_done, file_total=p.file_total,
                      total=f"file {p.file_index + 1} of {p.file_count} · {human_bytes(p.done)} of "
                            f"{human_bytes(p.total)}{speed}", done=p.done, total_bytes=p.total)
        download(st.repo, st.download_dir, progress=progress, cancel=cancel, endpoint=self.endpoint,
                 validate_config=validate_config, retries=DOWNLOAD_RETRIES)

    def _convert(self, st: WizardState, cancel: threading.Event) -> None:
        from core.converter import convert
        from models import validate_config
        self._set(step="convert", convert="converting …", convert_done=0, convert_total=1)

        def progress(p) -> None:
            if cancel.is_set():
                raise _Cancelled()
            self._set(convert=f"{p.shard} ({p.shard_index + 1} of {p.shard_count}) · "
                              f"{human_bytes(p.done_bytes)} of {human_bytes(p.total_bytes)}",
                      convert_done=p.done_bytes, convert_total=p.total_bytes)
        convert(st.download_dir, st.container_dir, bits=BITS, validate_config=validate_config, progress=progress)
        self._set(convert="converted", convert_done=1, convert_total=1)

    def _verify(self, st: WizardState, cancel: threading.Event):
        from core.events import Done, Token
        from core.sampling import SamplingParams
        from models import open_model
        from core.errors import ColiError
        self._set(step="verify", verify="checking the shards' checksums …")
        note = self._check_shards(st, cancel)
        self._set(verify=(note + " · " if note else "") + "opening the model …")
        opts = self.app._open_options() if hasattr(self.app, "_open_options") else {}
        engine = open_model(st.container_dir, **opts)
        try:
            if cancel.is_set():
                raise _Cancelled()
            self._set(verify="a short test generation …")
            prompt = [{"role": "user", "content": "Hello"}] if engine.tokenizer is not None else [1, 2, 3]
            n, reason = 0, None
            for ev in engine.generate(prompt, SamplingParams(greedy=True), max_new_tokens=VERIFY_TOKENS):
                if isinstance(ev, Token):
                    n += 1
                elif isinstance(ev, Done):
                    reason = ev.reason
            if reason is None or (n == 0 and reason not in ("eos", "stop")):
                raise ColiError(f"{st.container_dir}: the test generation produced nothing ({reason})")
            self._set(verify=(note + " · " if note else "shards intact ✓ · ") +
                      f"the model answers ({n} test tokens) ✓")
            return engine
        except BaseException:
            _close_engine(engine)
            raise

    def _check_shards(self, st: WizardState, cancel: threading.Event) -> str:
        """Re-hash every shard against the checksums recorded at conversion (core.integrity):
        a damaged shard stops the setup, naming it; a container converted before checksums
        existed goes on, with the returned note (also a toast, as the wizard closes soon)."""
        from core.errors import ColiError
        from core.integrity import verify
        from .safetext import one_line             # shard names come from the manifest: untrusted
        last = [0.0]

        def progress(done: int, total: int, shard: str) -> None:
            now = time.monotonic()
            if now - last[0] >= 0.05 or done >= total:
                last[0] = now
                pct = f" ({done / total:.0%})" if total else ""
                self._set(verify=f"checking {one_line(shard)} · {human_bytes(done)} of "
                                 f"{human_bytes(total)}{pct}")
        try:
            result = verify(st.container_dir, progress=progress, cancel=cancel)
        except ColiError:
            if cancel.is_set():
                raise _Cancelled() from None
            raise
        if result.damaged:
            names = one_line("; ".join(result.damaged[:4])) + (f"; and {len(result.damaged) - 4} more"
                                                     if len(result.damaged) > 4 else "")
            fix = ("Reinstall colibrì to get an intact demo model" if st.kind == "demo" else
                   "Convert the model again into a new folder (Start over, or coli convert SOURCE "
                   "NEW_FOLDER); the damaged one is kept")
            raise ColiError(f"{st.container_dir} is damaged: {names}. {fix}")
        if result.unrecorded:
            note = (f"{st.label}: no checksums recorded (converted by an older colibrì), so its "
                    f"shards were not checked; converting it again records them")
            self._post(lambda: self.app.notify(note, severity="warning", timeout=15))
            return "no checksums recorded: shards not checked"
        return ""

    def _stopped(self, st: WizardState, error: str) -> None:
        self.running = False
        st.error = error
        self._save()
        if not self.is_attached:
            return
        self._show_work(paused=True)
        self.query_one("#verify-line", Static).update("")
        self._error(error)
        self.query_one("#resume", Button).focus()

    def _succeeded(self, st: WizardState, engine) -> None:
        self.running = False
        app = self.app
        settings = getattr(app, "settings", None)
        if settings is not None and st.kind != "demo":
            settings.model = st.container_dir
            try:
                settings_mod.save(settings)
            except OSError as e:
                app.notify(f"settings not saved: {e}", severity="error")
        elif settings is not None:
            settings.model = ""
        clear_state()
        if st.kind != "demo":
            from .cli_models import remember
            remember(st.container_dir)               # `coli list` knows it
        log.info("setup of %s done: %s", st.label, st.container_dir)
        size = _download_size(st)
        if size and self.is_attached:               # the download is not needed any more: ask
            self._finished = (st, engine)
            self.query_one("#cancel", Button).display = False
            self.query_one("#source-question", Static).update(Text(
                f"{st.label} is converted. The download in {st.download_dir} ({human_bytes(size)}) is "
                f"not needed to chat: delete it?"))
            self._show_source_question(True)
            self.query_one("#keep-source", Button).focus()
            return
        self._finish(st, engine)

    def _show_source_question(self, show: bool) -> None:
        self.query_one("#source-question").display = show
        self.query_one("#source-buttons").display = show

    @on(Button.Pressed, "#keep-source")
    def _keep_source(self) -> None:
        if self._finished is not None:
            (st, engine), self._finished = self._finished, None
            self._finish(st, engine)

    @on(Button.Pressed, "#delete-source")
    def _delete_source(self) -> None:
        if self._finished is None:
            return
        (st, engine), self._finished = self._finished, None
        import shutil
        app = self.app
        try:
            shutil.rmtree(st.download_dir)
            log.info("deleted the download %s", st.download_dir)
            note = f"deleted {st.download_dir}"
        except OSError as e:
            note = f"could not delete {st.download_dir}: {e.strerror or e}"
        self._finish(st, engine)
        app.notify(note)

    def _finish(self, st: WizardState, engine) -> None:
        app = self.app
        if hasattr(app, "model_path"):
            app.model_path = None if st.kind != "demo" else st.container_dir
        if self.is_attached:
            self.dismiss(st.container_dir)
        if engine is not None and hasattr(app, "_engine_loaded"):
            app._engine_loaded(engine)
        elif engine is not None:
            _close_engine(engine)
        app.notify(f"{st.label} is ready")


def _close_engine(engine) -> None:
    for closer in (getattr(getattr(engine, "store", None), "close", None),
                   getattr(getattr(engine, "container", None), "close", None)):
        try:
            if closer is not None:
                closer()
        except Exception:
            pass


def _downloaded_so_far(download_dir: str) -> tuple[int, int]:
    """(bytes on disk, bytes in all) of an unfinished download, from its state file (no network)."""
    from core.downloader import DownloadPlan, RemoteFile, read_state, remaining_bytes
    state = read_state(download_dir) if download_dir else None
    try:
        plan = DownloadPlan(state["repo"], state["revision"], [RemoteFile(**f) for f in state["files"]])
        return plan.total_bytes - remaining_bytes(download_dir, plan), plan.total_bytes
    except (TypeError, KeyError, OSError):
        return 0, 0


def _download_size(st: WizardState) -> int:
    """Bytes of the wizard's own download folder once converted (0: nothing of ours to delete). A
    folder the user picked, or the Hugging Face cache, is not the wizard's to offer."""
    from core.downloader import STATE
    d = Path(st.download_dir) if st.kind == "hub" and st.download_dir else None
    if d is None or not (d / STATE).is_file() or d.resolve() == Path(st.container_dir).resolve():
        return 0
    from .cli_models import dir_size
    return dir_size(d)

