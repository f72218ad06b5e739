"""The Brain map: layers (rows) × experts (columns). Colour = tier, brightness = routing heat,
experts routed for the current token flash. Large grids are binned to the widget's size; each
character cell carries two rows (upper half block: foreground, lower half: background)."""
from __future__ import annotations

import math

from rich.color import Color
from rich.segment import Segment
from rich.style import Style
from rich.text import Text
from textual.strip import Strip
from textual.widget import Widget

# tier -> (r, g, b) at full heat
TIER_RGB = {"disk": (70, 110, 200), "ram": (60, 200, 90), "pinned": (230, 150, 40), "vram": (200, 80, 220)}
TIER_RANK = {"disk": 0, "ram": 1, "pinned": 2, "vram": 3}
FLASH_RGB = (255, 255, 255)
EMPTY_RGB = (20, 20, 24)


def bins(n: int, slots: int) -> list[list[int]]:
    """Split range(n) into ``min(n, slots)`` contiguous, near-equal groups (in order)."""
    k = max(1, min(n, slots))
    return [list(range(i * n // k, (i + 1) * n // k)) for i in range(k)]


def _index(n: int, k: int) -> list[int]:
    """item -> bin for ``bins(n, k)``."""
    k = max(1, min(n, k))
    out = [0] * n
    for b in range(k):
        for i in range(b * n // k, (b + 1) * n // k):
            out[i] = b
    return out


class Grid:
    """Binned cells: for each (row bin, column bin) the dominant tier, peak heat in [0, 1] and
    whether an expert in it was routed for the current token. Pure Python, no numpy."""

    def __init__(self, layers: int, experts: int, rows: int, cols: int,
                 placement: dict | None = None, heat: dict | None = None, routed: dict | None = None):
        self.n_layers, self.n_experts = layers, experts
        self.rows, self.cols = max(1, min(layers, rows)), max(1, min(experts, cols))
        ri, ci = _index(layers, self.rows), _index(experts, self.cols)
        R, C = self.rows, self.cols
        counts = [[[0, 0, 0, 0] for _ in range(C)] for _ in range(R)]
        for l, tiers in (placement or {}).items():
            if 0 <= l < layers:
                row = counts[ri[l]]
                for e, t in tiers.items():
                    if 0 <= e < experts:
                        row[ci[e]][TIER_RANK.get(t, 1)] += 1
        size = [[len(range(r * layers // R, (r + 1) * layers // R)) * len(range(c * experts // C, (c + 1) * experts // C))
                 for c in range(C)] for r in range(R)]
        self.tier = [["disk"] * C for _ in range(R)]
        names = sorted(TIER_RANK, key=TIER_RANK.get)
        for r in range(R):
            for c in range(C):
                cnt = counts[r][c]
                cnt[0] = max(0, size[r][c] - sum(cnt[1:]))
                best = max(range(4), key=lambda t: (cnt[t], t))
                self.tier[r][c] = names[best]
        peak = [[0.0] * C for _ in range(R)]
        for (l, e), v in (heat or {}).items():
            if 0 <= l < layers and 0 <= e < experts and v > peak[ri[l]][ci[e]]:
                peak[ri[l]][ci[e]] = float(v)
        top = max((v for row in peak for v in row), default=0.0)
        scale = math.log1p(top) if top > 0 else 1.0
        self.heat = [[math.log1p(v) / scale if top > 0 else 0.0 for v in row] for row in peak]
        self.flash = [[False] * C for _ in range(R)]
        for l, es in (routed or {}).items():
            if 0 <= l < layers:
                for e in es:
                    if 0 <= e < experts:
                        self.flash[ri[l]][ci[e]] = True

    def rgb(self, r: int, c: int) -> tuple[int, int, int]:
        base = TIER_RGB[self.tier[r][c]]
        if self.flash[r][c]:          # routed now: the tier's colour, lit up towards white
            return tuple(int(base[i] + (FLASH_RGB[i] - base[i]) * 0.7) for i in range(3))
        k = 0.3 + 0.7 * self.heat[r][c]            # never fully dark: the tier stays readable
        return tuple(int(EMPTY_RGB[i] + (base[i] - EMPTY_RGB[i]) * k) for i in range(3))


def legend() -> Text:
    t = Text()
    for name, label in (("disk", "disk"), ("ram", "RAM"), ("pinned", "pinned")):
        t.append("■", style=Style(color=Color.from_rgb(*TIER_RGB[name])))
        t.append(f" {label}  ")
    t.append("■", style=Style(color=Color.from_rgb(*FLASH_RGB)))
    t.append(" routed now\n")
    t.append("rows layers · cols experts · bright=hot", style="dim")
    return t


class BrainMap(Widget):
    """Layers × experts. ``update_data`` is cheap to call; binning happens at render time."""

    DEFAULT_CSS = """
    BrainMap { height: 1fr; min-height: 4; }
    """

    def __init__(self, layers: int = 0, experts: int = 0, **kw):
        super().__init__(**kw)
        self.n_layers, self.n_experts = layers, experts
        self.placement: dict = {}
        self.heat_map: dict = {}
        self.routed: dict = {}
        self._grid: Grid | None = None
        self._grid_key = None

    def set_shape(self, layers: int, experts: int) -> None:
        self.n_layers, self.n_experts = layers, experts
        self._grid_key = None
        self.refresh()

    def update_data(self, placement: dict | None = None, heat: dict | None = None,
                    routed: dict | None = None) -> None:
        if placement is not None:
            self.placement = placement
        if heat is not None:
            self.heat_map = heat
        if routed is not None:
            self.routed = routed
        self._grid_key = None
        self.refresh()

    def grid(self) -> Grid | None:
        w, h = self.size.width, self.size.height
        if not (self.n_layers and self.n_experts and w > 0 and h > 0):
            return None
        # each expert column bin gets the same width; 2 layer rows per character row
        cols = min(self.n_experts, w)
        rows = min(self.n_layers, 2 * h)
        key = (w, h, rows, cols)
        if self._grid is None or self._grid_key != key:
            self._grid = Grid(self.n_layers, self.n_experts, rows, cols, self.placement, self.heat_map, self.routed)
            self._grid_key = key
        return self._grid

    def render_line(self, y: int) -> Strip:
        g = self.grid()
        w = self.size.width
        if g is None:
            return Strip.blank(w)
        cw = max(1, min(4, w // g.cols))                       # widen cells when the grid is small
        ry = max(1, min(4, (2 * self.size.height) // g.rows))  # and make them taller
        top, bot = (2 * y) // ry, (2 * y + 1) // ry
        if top >= g.rows:
            return Strip.blank(w)
        segs = []
        for c in range(g.cols):
            fg = Color.from_rgb(*g.rgb(top, c))
            if bot < g.rows:
                bg = Color.from_rgb(*g.rgb(bot, c))
                segs.append(Segment("▀" * cw, Style(color=fg, bgcolor=bg)))
            else:
                segs.append(Segment("▀" * cw, Style(color=fg)))
        used = cw * g.cols
        if used < w:
            segs.append(Segment(" " * (w - used)))
        return Strip(segs, w)
