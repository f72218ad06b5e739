"""The live tier panel: speed, hits, bytes, RAM, where time goes, prefetch — and the Brain map.
Fed by the engine's Stats events (as plain dicts); never touches the engine itself."""
from __future__ import annotations

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Label, Sparkline, Static

from .brainmap import BrainMap, legend

SPLIT = (("attention_s", "attn", "#5fafff"), ("experts_s", "experts", "#5fd75f"),
         ("disk_wait_s", "disk", "#d75f5f"), ("lm_head_s", "head", "#d7af5f"))


def human_bytes(n: float) -> str:
    n = float(n or 0)
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def bar(frac: float, width: int, color: str = "#5fd75f") -> Text:
    frac = min(1.0, max(0.0, frac))
    full = int(round(frac * width))
    t = Text("█" * full, style=color)
    t.append("░" * (width - full), style="#444444")
    return t


def split_bar(d: dict, width: int) -> Text:
    vals = [max(0.0, float(d.get(k) or 0.0)) for k, _, _ in SPLIT]
    total = sum(vals)
    t = Text()
    if total <= 0:
        return Text("░" * width, style="#444444")
    used = 0
    for i, ((_, _, color), v) in enumerate(zip(SPLIT, vals)):
        n = width - used if i == len(SPLIT) - 1 else int(round(v / total * width))
        n = max(0, min(n, width - used))
        t.append("█" * n, style=color)
        used += n
    return t


class _Null:
    def write(self, s):
        return len(s)

    def flush(self):
        pass


class TierPanel(Vertical):
    DEFAULT_CSS = """
    TierPanel { width: 44; border-left: tall $primary 40%; padding: 0 1; }
    TierPanel.-hidden { display: none; }
    TierPanel .title { text-style: bold; color: $accent; }
    TierPanel #speed-title { width: 1fr; }     /* fixed: its updates (every push) need no layout */
    TierPanel #speed { height: 3; }
    TierPanel #tier-stats { height: auto; }
    TierPanel #brain-legend { height: auto; }
    TierPanel #brain-info { height: 2; color: $text-muted; }   /* fixed: the map's size never follows it */
    """

    def __init__(self, **kw):
        super().__init__(**kw)
        self.rates: list[float] = []
        self.last: dict = {}
        self.per_token_bytes: float | None = None
        self._base: tuple[int, int] | None = None     # (tokens, bytes) at the first decode stats
        self.ram_used: int | None = None
        self.ram_budget: int | None = None
        self.server: dict | None = None     # the app's server (EmbeddedServer.info()), None: off
        self._lines = -1                    # lines of the stats table as last shown

    def compose(self) -> ComposeResult:
        yield Label("tok/s", classes="title", id="speed-title")
        yield Sparkline([], id="speed", summary_function=max)
        yield Static(self._table(), id="tier-stats")
        yield Label("Brain map · layers × experts", classes="title", id="brain-title")
        yield BrainMap(id="brain")
        yield Static("", id="brain-info", markup=False)
        yield Static(legend(), id="brain-legend")

    @property
    def brain(self) -> BrainMap:
        return self.query_one(BrainMap)

    def on_brain_map_changed(self, event: BrainMap.Changed) -> None:
        # the words under the map: the selected cell, or how many experts a cell holds
        self.query_one("#brain-info", Static).update(Text(event.brain_map.info()), layout=False)   # fixed size

    def set_model(self, layers: int, experts: int, ram_budget: int | None = None, hashed=()) -> None:
        """``hashed``: the hash-routed layers (marked on the map, named in the legend)."""
        if bool(hashed) != bool(self.brain.hashed):       # the legend names the mark while it shows
            self.query_one("#brain-legend", Static).update(legend(bool(hashed)))
        self.brain.set_shape(layers, experts, hashed)
        self.query_one("#brain-title", Label).update(f"Brain map · {layers} layers × {experts} experts")
        self.ram_budget = ram_budget
        self.refresh_stats()

    def reset(self) -> None:
        """A new reply: the speed history starts again; the last reply's stats stay until the
        new one's first arrive (a table that shrank to one line and grew back lays the screen out
        twice more as the reply starts)."""
        self.rates = []
        self.query_one(Sparkline).data = []
        self._base = None

    def push(self, stats: dict | None = None, rate: float | None = None, placement: dict | None = None,
             heat: dict | None = None, routed: dict | None = None, slot_bytes: int | None = None) -> None:
        """One batch from the generation worker."""
        if rate is not None:
            self.rates = (self.rates + [rate])[-120:]
            self.query_one(Sparkline).data = list(self.rates)
        if stats:
            n, b = stats.get("new_tokens", 0), stats.get("bytes_read", 0)
            # decode only: bytes read since the first token, per token after it (prefill excluded)
            if self._base is None or n < self._base[0]:
                self._base = (n, b)                 # (the last reply's per-token figure until then)
            if n > self._base[0]:
                self.per_token_bytes = (b - self._base[1]) / (n - self._base[0])
            self.last = dict(stats)
            if stats.get("ram_bytes"):
                self.ram_budget = stats["ram_bytes"]
        if placement is not None and slot_bytes:
            self.ram_used = slot_bytes * sum(len(v) for v in placement.values())
        if placement is not None or heat is not None or routed is not None:
            self.brain.update_data(placement, heat, routed)
        self.refresh_stats()

    def set_server(self, info: dict | None) -> None:
        """The app's server line: its address, requests served, the queue (None: not serving)."""
        if info != self.server:
            self.server = info
            self.refresh_stats()

    def server_line(self) -> str:
        s = self.server
        if not s:
            return ""
        busy = " · decoding" if s.get("decoding") else ""
        return (f"{s['url']}{' (key)' if s.get('keyed') else ''}\n{s['served']} served · queue "
                f"{s['waiting']}/{s['max_queue']}{busy}")

    def page_cache_line(self) -> str:
        """The OS page cache acting as a tier, measured over the reply: the share of the bytes the
        store read that never reached the disk (core.pagecache), when it is TIER_SHARE or more;
        "" otherwise (before a reply, nothing read, or the disk served them). coli plan projects it."""
        from core.pagecache import TIER_SHARE
        d = self.last
        share = d.get("page_cache_share") if d else None
        if share is None or not d.get("bytes_read") or share < TIER_SHARE:
            return ""
        return f"OS tier · {share:.0%} of reads"

    def refresh_stats(self) -> None:
        # Its height is set, not measured: with height auto every layout of the screen (one a
        # streamed batch) rendered the table once more to measure it, ~15 % of a batch's paint.
        # A layout only when the table gains or loses a line.
        table = self._table()
        lines = table.row_count + self.server_line().count("\n")
        stats = self.query_one("#tier-stats", Static)
        if lines != self._lines:
            stats.styles.height = lines
        stats.update(table, layout=lines != self._lines)
        self._lines = lines
        if self.rates:
            self.query_one("#speed-title", Label).update(
                f"tok/s  now {self.rates[-1]:.1f} · peak {max(self.rates):.1f}", layout=False)

    def plain(self, width: int = 41) -> str:
        """The stats as plain text (tests, logs)."""
        from rich.console import Console
        c = Console(width=width, record=True, file=_Null(), color_system=None)
        c.print(self._table())
        return c.export_text()

    def _table(self) -> Table:
        d = self.last
        t = Table.grid(padding=(0, 1))
        t.add_column(style="dim", no_wrap=True, min_width=9)
        t.add_column(no_wrap=True, overflow="ellipsis")
        if self.server:
            t.add_row("server", Text(self.server_line(), style="#5fafff"))
        if not d:
            t.add_row("", Text("no reply yet", style="dim"))
        else:
            t.add_row("1st token", f"{d.get('ttft_s', 0):.2f} s")
            t.add_row("tokens", f"{d.get('prompt_tokens', 0)} in · {d.get('new_tokens', 0)} out")
            t.add_row("speed", f"{d.get('decode_tok_s', 0):.1f} tok/s · prefill {d.get('prefill_tok_s', 0):.0f}")
            hits, misses = d.get("hits", 0), d.get("misses", 0)
            t.add_row("hit rate", f"RAM {d.get('hit_rate', 1.0):.1%} · disk {misses} of {hits + misses}")
            if self.per_token_bytes is not None:
                t.add_row("read/tok", human_bytes(self.per_token_bytes))
            t.add_row("read", human_bytes(d.get("bytes_read", 0)))
            rec = d.get("prefetch_recall")
            used, issued = d.get("prefetch_used", 0), d.get("prefetch_issued", 0)
            t.add_row("prefetch", (f"recall {rec:.0%}" if rec is not None else "recall –") + f" · used {used}/{issued}")
        budget = self.ram_budget
        if budget:
            used = self.ram_used or 0
            line = bar(used / budget if budget else 0, 10)
            line.append(f" {human_bytes(used)} / {human_bytes(budget)}")
            t.add_row("RAM tier", line)
        cache = self.page_cache_line()
        if cache:
            t.add_row("pg cache", Text(cache, style="#d7af5f"))
        if d:
            t.add_row("peak RSS", human_bytes(d.get("peak_rss_bytes", 0)))
            t.add_row("time", split_bar(d, 22))
            total = sum(max(0.0, float(d.get(k) or 0.0)) for k, _, _ in SPLIT) or 1.0
            for pair in (SPLIT[:2], SPLIT[2:]):
                legend_line = Text()
                for k, label, color in pair:
                    legend_line.append("■", style=color)
                    legend_line.append(f" {label} {100 * float(d.get(k) or 0) / total:.0f}%  ")
                t.add_row("", legend_line)
        return t
