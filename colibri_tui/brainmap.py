"""The Brain map: layers (rows) × experts (columns). Colour = tier, brightness = routing heat,
experts routed for the current token flash. Each character cell carries two rows (upper half
block: foreground, lower half: background); a left gutter numbers the layers.

Large models are aggregated: a cell stands for ``lz`` consecutive layers × ``ez`` consecutive
experts (uniform groups, the last ones may be smaller), coloured by its dominant tier (most
experts; a tie goes to the faster tier) and lit by its summed heat. At the "fit" zoom level the
whole model fits the widget (GLM-5's 76 × 256 in the 120×40 tier panel: 3 layers × 7 experts a
cell); each zoom-in halves both group sizes down to one layer × one expert, and the map scrolls
(keys, mouse wheel, scrollbars). The cursor (arrow keys, or a click) names the cell's layers,
experts, tiers and heat. Hash-routed layers (their experts follow from the token id, known before
the pass: none is predicted) carry a ``#`` in the gutter and say so. Pure Python on plain dicts,
no numpy."""
from __future__ import annotations

import math
from functools import lru_cache

from rich.color import Color
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

# tier -> (r, g, b) at full heat
TIER_RGB = {"disk": (70, 110, 200), "ram": (60, 200, 90), "pinned": (230, 150, 40), "vram": (200, 80, 220)}
TIER_RANK = {"disk": 0, "ram": 1, "pinned": 2, "vram": 3}
TIER_NAMES = sorted(TIER_RANK, key=TIER_RANK.get)
TIER_LABEL = {"disk": "disk", "ram": "RAM", "pinned": "pinned", "vram": "VRAM"}
FLASH_RGB = (255, 255, 255)
EMPTY_RGB = (20, 20, 24)
CURSOR_RGB = (255, 40, 40)        # the selected cell: a colour no tier uses
HASH_MARK, HASH_RGB = "#", (120, 200, 230)   # a hash-routed layer's row (gutter): experts from the token
MAX_STRETCH = 4                   # a small grid's cells grow to at most 4 columns / 4 half rows


def bins(n: int, slots: int) -> list[list[int]]:
    """Split range(n) into ``min(n, slots)`` contiguous, near-equal groups (in order)."""
    k = max(1, min(n, slots))
    return [list(range(i * n // k, (i + 1) * n // k)) for i in range(k)]


def group_size(n: int, slots: int) -> int:
    """The smallest uniform group size that puts n items into at most ``slots`` groups."""
    return max(1, -(-n // max(1, slots)))


def zoom_levels(fit_l: int, fit_e: int) -> list[tuple[int, int]]:
    """(layers, experts) per cell from the fit level down to 1 × 1, halving both each step."""
    out = [(max(1, fit_l), max(1, fit_e))]
    while out[-1] != (1, 1):
        lz, ez = out[-1]
        out.append((-(-lz // 2), -(-ez // 2)))
    return out


def fmt_heat(v: float) -> str:
    return str(int(round(v))) if abs(v - round(v)) < 1e-9 or v >= 100 else f"{v:.1f}"


@lru_cache(maxsize=4096)
def half_block(fg: tuple[int, int, int], bg: tuple[int, int, int] | None) -> Style:
    """The style of one cell (upper half fg, lower half bg): built once per colour pair, not once
    per cell and repaint (the map repaints with every tier panel update while a reply streams)."""
    return Style(color=Color.from_rgb(*fg), bgcolor=None if bg is None else Color.from_rgb(*bg))


def span(lo: int, hi: int, one: str, many: str) -> str:
    return f"{one} {lo}" if lo == hi else f"{many} {lo}–{hi}"


class Grid:
    """Uniform cells of ``lz`` layers × ``ez`` experts: for each the count of experts per tier,
    the dominant tier, the summed heat (raw and log-scaled to [0, 1] against the hottest cell)
    and whether an expert in it was routed for the current token."""

    def __init__(self, layers: int, experts: int, lz: int = 1, ez: int = 1,
                 placement: dict | None = None, heat: dict | None = None, routed: dict | None = None,
                 hashed: frozenset = frozenset()):
        self.n_layers, self.n_experts = layers, experts
        self.hashed = hashed          # hash-routed layers
        self.lz, self.ez = max(1, lz), max(1, ez)
        self.rows = -(-layers // self.lz) if layers else 0
        self.cols = -(-experts // self.ez) if experts else 0
        R, C, lz, ez = self.rows, self.cols, self.lz, self.ez
        self.counts = [[[0, 0, 0, 0] for _ in range(C)] for _ in range(R)]
        for l, tiers in (placement or {}).items():
            if 0 <= l < layers:
                row = self.counts[l // lz]
                for e, t in tiers.items():
                    if 0 <= e < experts:
                        row[e // ez][TIER_RANK.get(t, 1)] += 1
        self.tier = [["disk"] * C for _ in range(R)]
        for r in range(R):
            n_l = min(layers, (r + 1) * lz) - r * lz
            for c in range(C):
                cnt = self.counts[r][c]
                size = n_l * (min(experts, (c + 1) * ez) - c * ez)
                cnt[0] = max(0, size - sum(cnt[1:]))        # not listed: on disk
                best = max(range(4), key=lambda t: (cnt[t], t))
                self.tier[r][c] = TIER_NAMES[best]
        self.heat_sum = [[0.0] * C for _ in range(R)]
        for (l, e), v in (heat or {}).items():
            if 0 <= l < layers and 0 <= e < experts and v > 0:
                self.heat_sum[l // lz][e // ez] += float(v)
        top = max((v for row in self.heat_sum for v in row), default=0.0)
        scale = math.log1p(top) if top > 0 else 1.0
        self.heat = [[math.log1p(v) / scale if top > 0 else 0.0 for v in row] for row in self.heat_sum]
        self.routed_n = [[0] * C for _ in range(R)]     # experts routed for the current token
        for l, es in (routed or {}).items():
            if 0 <= l < layers:
                for e in set(es):
                    if 0 <= e < experts:
                        self.routed_n[l // lz][e // ez] += 1
        self.flash = [[n > 0 for n in row] for row in self.routed_n]

    def layer_range(self, r: int) -> tuple[int, int]:
        return r * self.lz, min(self.n_layers, (r + 1) * self.lz) - 1

    def hashed_in(self, r: int) -> int:
        """How many of row r's layers are hash-routed."""
        l0, l1 = self.layer_range(r)
        return sum(1 for l in range(l0, l1 + 1) if l in self.hashed)

    def expert_range(self, c: int) -> tuple[int, int]:
        return c * self.ez, min(self.n_experts, (c + 1) * self.ez) - 1

    def rgb(self, r: int, c: int) -> tuple[int, int, int]:
        base = TIER_RGB[self.tier[r][c]]
        if self.flash[r][c]:          # routed now: the tier's colour, lit up towards white
            # fully once per layer of the cell: an aggregate cell with one routed expert among
            # many only glows, so the tiers stay readable while a big model routes
            k = 0.7 * min(1.0, self.routed_n[r][c] / self.lz)
            return tuple(int(base[i] + (FLASH_RGB[i] - base[i]) * k) for i in range(3))
        k = 0.3 + 0.7 * self.heat[r][c]            # never fully dark: the tier stays readable
        return tuple(int(EMPTY_RGB[i] + (base[i] - EMPTY_RGB[i]) * k) for i in range(3))

    def describe(self, r: int, c: int) -> str:
        """The cell in words (plain text): its layers, experts, tiers and heat."""
        l0, l1 = self.layer_range(r)
        e0, e1 = self.expert_range(c)
        cnt = self.counts[r][c]
        size = sum(cnt)
        where = span(l0, l1, "layer", "layers") + " × " + span(e0, e1, "expert", "experts")
        dom = self.tier[r][c]
        if size == 1:
            tiers = TIER_LABEL[dom]
        else:
            rest = [f"{TIER_LABEL[t]} {cnt[TIER_RANK[t]]}" for t in reversed(TIER_NAMES)
                    if t != dom and cnt[TIER_RANK[t]]]
            tiers = " · ".join([f"{TIER_LABEL[dom]} {cnt[TIER_RANK[dom]]} of {size}"] + rest)
        n = self.routed_n[r][c]
        now = "" if not n else " · routed now" if size == 1 else f" · {n} routed now"
        tail = f" · heat {fmt_heat(self.heat_sum[r][c])}{now}"
        h = self.hashed_in(r)
        if h:            # their experts come from the token id: known, never predicted
            where += " · hash-routed" if h == l1 - l0 + 1 else f" · {h} hash-routed"
        return f"{where}\n{tiers}{tail}"


def legend(hashed: bool = False) -> Text:
    """The colours; ``hashed``: the model has hash-routed layers (the gutter's mark)."""
    t = Text()
    for name, label in (("disk", "disk"), ("ram", "RAM"), ("pinned", "pinned")):
        t.append("■", style=Style(color=Color.from_rgb(*TIER_RGB[name])))
        t.append(f" {label}  ")
    t.append("■", style=Style(color=Color.from_rgb(*FLASH_RGB)))
    t.append(" routed now\n")
    if hashed:
        t.append(HASH_MARK, style=Style(color=Color.from_rgb(*HASH_RGB)))
        t.append(" hash-routed layer: experts from the token\n")
    t.append("rows layers · cols experts · bright=hot", style="dim")
    return t


class BrainMap(ScrollView, can_focus=True):
    """Layers × experts. ``update_data`` is cheap to call; cells are built at render time."""

    DEFAULT_CSS = """
    BrainMap { height: 1fr; min-height: 4; scrollbar-size-vertical: 1; scrollbar-size-horizontal: 1; }
    """
    BINDINGS = [
        Binding("up", "move(-1, 0)", "Cell", show=True, group=Binding.Group("Cell", compact=True)),
        Binding("down", "move(1, 0)", "Cell", show=True, group=Binding.Group("Cell", compact=True)),
        Binding("left", "move(0, -1)", "Cell", show=True, group=Binding.Group("Cell", compact=True)),
        Binding("right", "move(0, 1)", "Cell", show=True, group=Binding.Group("Cell", compact=True)),
        Binding("pageup", "page(-1)", "Page up", show=False),
        Binding("pagedown", "page(1)", "Page down", show=False),
        Binding("home", "move(-100000, -100000)", "First cell", show=False),
        Binding("end", "move(100000, 100000)", "Last cell", show=False),
        Binding("plus,equals_sign", "zoom(1)", "Zoom", show=True, group=Binding.Group("Zoom", compact=True)),
        Binding("minus", "zoom(-1)", "Zoom", show=True, group=Binding.Group("Zoom", compact=True)),
    ]

    class Changed(Message):
        """The selection, zoom, shape or data changed: ``info()`` has new words."""

        def __init__(self, brain_map: "BrainMap") -> None:
            super().__init__()
            self.brain_map = brain_map

        @property
        def control(self) -> "BrainMap":
            return self.brain_map

    def __init__(self, layers: int = 0, experts: int = 0, **kw):
        super().__init__(**kw)
        self.n_layers, self.n_experts = layers, experts
        self.hashed: frozenset = frozenset()
        self.placement: dict = {}
        self.heat_map: dict = {}
        self.routed: dict = {}
        self.zoom = 0                 # index into zoom_levels(); 0 = the whole model fits
        self.cursor = (0, 0)          # (row, column) of cells at the current zoom
        self.selected = False         # the cursor shows (and info names it) once a cell is chosen
        self._grid: Grid | None = None
        self._grid_key = None

    # --- data ----------------------------------------------------------------------------------
    def set_shape(self, layers: int, experts: int, hashed=()) -> None:
        """``hashed``: the hash-routed layers (the engine's known_layers)."""
        self.n_layers, self.n_experts, self.hashed = layers, experts, frozenset(hashed)
        self.zoom, self.cursor, self.selected = 0, (0, 0), False
        self._changed()

    def update_data(self, placement: dict | None = None, heat: dict | None = None,
                    routed: dict | None = None) -> None:
        if placement is not None:
            self.placement = placement
        if heat is not None:
            self.heat_map = heat
        if routed is not None:
            self.routed = routed
        self._grid_key = None
        self._changed(layout=False)

    # --- geometry ------------------------------------------------------------------------------
    def gutter_width(self) -> int:
        return len(str(max(0, self.n_layers - 1))) + 1

    def levels(self) -> list[tuple[int, int]]:
        w, h = self.size.width, self.size.height       # scrollbars included: no feedback loop
        body = max(1, w - self.gutter_width())
        return zoom_levels(group_size(self.n_layers, 2 * max(1, h)), group_size(self.n_experts, body))

    def cell_factor(self) -> tuple[int, int]:
        """(lz, ez) at the current zoom level."""
        lv = self.levels()
        self.zoom = max(0, min(self.zoom, len(lv) - 1))
        return lv[self.zoom]

    def grid(self) -> Grid | None:
        if not (self.n_layers and self.n_experts and self.size.width > 0 and self.size.height > 0):
            return None
        lz, ez = self.cell_factor()
        key = (lz, ez, self.n_layers, self.n_experts)
        if self._grid is None or self._grid_key != key:
            self._grid = Grid(self.n_layers, self.n_experts, lz, ez, self.placement, self.heat_map, self.routed,
                              self.hashed)
            self._grid_key = key
        return self._grid

    def stretch(self, g: Grid) -> tuple[int, int]:
        """(columns per cell, half rows per cell): small grids grow to fill the widget."""
        body = max(1, self.size.width - self.gutter_width())
        cw = max(1, min(MAX_STRETCH, body // g.cols))
        ry = max(1, min(MAX_STRETCH, (2 * self.size.height) // g.rows))
        return cw, ry

    def _update_virtual_size(self) -> None:
        g = self.grid()
        if g is None:
            self.virtual_size = Size(0, 0)
            return
        cw, ry = self.stretch(g)
        size = Size(self.gutter_width() + g.cols * cw, -(-(g.rows * ry) // 2))
        if size != self.virtual_size:
            self.virtual_size = size

    def on_resize(self, event: events.Resize) -> None:
        self._update_virtual_size()
        self._clamp_cursor()
        self.post_message(self.Changed(self))

    def _changed(self, layout: bool = True) -> None:
        if layout:
            self._grid_key = None
        self._update_virtual_size()
        self._clamp_cursor()
        self.refresh()
        self.post_message(self.Changed(self))

    def _clamp_cursor(self) -> None:
        g = self.grid()
        if g is not None:
            r, c = self.cursor
            self.cursor = (max(0, min(r, g.rows - 1)), max(0, min(c, g.cols - 1)))

    # --- words ---------------------------------------------------------------------------------
    def info(self) -> str:
        """What the status line under the map says (plain text)."""
        g = self.grid()
        if g is None:
            return ""
        if self.selected:
            return g.describe(*self.cursor)
        if g.lz == 1 and g.ez == 1:
            return "click a cell to inspect it"
        cell = ("1 layer" if g.lz == 1 else f"{g.lz} layers") + " × " + ("1 expert" if g.ez == 1 else f"{g.ez} experts")
        return f"cell = {cell}\nclick to inspect · +/- zoom"

    # --- keys and mouse ------------------------------------------------------------------------
    def _select(self, r: int, c: int) -> None:
        self.cursor, self.selected = (r, c), True
        self._clamp_cursor()
        self._scroll_to_cursor()
        self.refresh()
        self.post_message(self.Changed(self))

    def _scroll_to_cursor(self) -> None:
        g = self.grid()
        if g is None:
            return
        cw, ry = self.stretch(g)
        r, c = self.cursor
        y0, y1 = (r * ry) // 2, ((r + 1) * ry - 1) // 2
        view = self.scrollable_content_region.size
        body = max(1, view.width - self.gutter_width())
        sx, sy = self.scroll_offset
        x = c * cw
        if x < sx:
            sx = x
        elif x + cw > sx + body:
            sx = x + cw - body
        if y0 < sy:
            sy = y0
        elif y1 >= sy + view.height:
            sy = y1 - view.height + 1
        self.scroll_to(sx, sy, animate=False, immediate=True)

    def action_move(self, dr: int, dc: int) -> None:
        r, c = self.cursor
        self._select(r + dr, c + dc) if self.selected else self._select(r, c)

    def action_page(self, direction: int) -> None:
        g = self.grid()
        if g is None:
            return
        _, ry = self.stretch(g)
        step = max(1, (2 * self.scrollable_content_region.height) // ry)
        self._select(self.cursor[0] + direction * step, self.cursor[1])

    def action_zoom(self, step: int) -> None:
        g = self.grid()
        if g is None:
            return
        l0, e0 = g.layer_range(self.cursor[0])[0], g.expert_range(self.cursor[1])[0]
        new = max(0, min(self.zoom + step, len(self.levels()) - 1))
        if new == self.zoom:
            return
        self.zoom = new
        lz, ez = self.cell_factor()
        self._grid_key = None
        self._update_virtual_size()
        self.cursor = (l0 // lz, e0 // ez)        # the same layer and expert stay under the cursor
        self._clamp_cursor()
        self.refresh()
        self.call_after_refresh(self._scroll_to_cursor)
        self._scroll_to_cursor()
        self.post_message(self.Changed(self))

    def cell_at(self, x: int, y: int) -> tuple[int, int, int] | None:
        """(top row, bottom row, column) of the cells under widget offset (x, y), or None."""
        g = self.grid()
        gw = self.gutter_width()
        if g is None or x < gw:
            return None
        cw, ry = self.stretch(g)
        sx, sy = self.scroll_offset
        c = (x - gw + sx) // cw
        top, bot = (2 * (y + sy)) // ry, (2 * (y + sy) + 1) // ry
        if c >= g.cols or top >= g.rows:
            return None
        return top, min(bot, g.rows - 1), c

    def on_click(self, event: events.Click) -> None:
        offset = event.get_content_offset(self)
        hit = self.cell_at(offset.x, offset.y) if offset is not None else None
        if hit is None:
            return
        top, bot, c = hit
        # a character cell holds two rows of cells: a second click on it picks the lower one
        r = bot if self.selected and self.cursor == (top, c) and bot != top else top
        self._select(r, c)

    def on_focus(self, event: events.Focus) -> None:
        if not self.selected:
            self.selected = True
            self._scroll_to_cursor()
            self.refresh()
            self.post_message(self.Changed(self))

    # --- drawing -------------------------------------------------------------------------------
    def render_line(self, y: int) -> Strip:
        g = self.grid()
        view = self.scrollable_content_region.size
        w = max(0, view.width)
        base = self.rich_style              # blanks and the gutter take the panel's colours
        if g is None or w == 0:
            return Strip.blank(w, base)
        cw, ry = self.stretch(g)
        sx, sy = self.scroll_offset
        vy = y + sy
        top, bot = (2 * vy) // ry, (2 * vy + 1) // ry
        if top >= g.rows:
            return Strip.blank(w, base)
        gw = self.gutter_width()
        cr, cc = self.cursor if self.selected else (-1, -1)
        label = str(g.layer_range(top)[0]) if (2 * vy) % ry == 0 else ""
        if cr not in (top, bot) and (g.hashed_in(top) or (bot < g.rows and g.hashed_in(bot))):
            mark = Segment(HASH_MARK, Style(color=Color.from_rgb(*HASH_RGB)))
        else:
            mark = Segment("▸" if cr in (top, bot) else " ", Style(color="rgb(255,40,40)"))
        segs = [Segment(label.rjust(gw - 1)[: gw - 1], Style(dim=True)), mark]
        body = max(0, w - gw)
        for x in range(sx, sx + body):
            c = x // cw
            if c >= g.cols:
                segs.append(Segment(" " * (sx + body - x)))
                break
            fg = CURSOR_RGB if (top, c) == (cr, cc) else g.rgb(top, c)
            bg = None if bot >= g.rows else CURSOR_RGB if (bot, c) == (cr, cc) else g.rgb(bot, c)
            segs.append(Segment("▀", half_block(fg, bg)))
        return Strip(segs).adjust_cell_length(w).apply_style(base).simplify()
