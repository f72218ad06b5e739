"""The Brain map at GLM-5's size (76 MoE layers × 256 experts = 19,456 experts) in the real app,
driven by Pilot with a synthetic engine state (plain dicts, as the engine's snapshot() gives
them): cells aggregate experts, +/- zoom, the map scrolls, the cursor (keys or a click) names the
cell's layers, experts, tiers and heat, and 80×24 still works. The 120×40 picture is a snapshot
in tests/test_snapshots.py (test_brain_map_glm5_120x40)."""
from __future__ import annotations

import asyncio
import functools

import pytest

from tests.conftest import tiny_app_container, wait_for

pytest.importorskip("textual")

L, E = 76, 256
wait_for = functools.partial(wait_for, timeout=10.0)


def glm5_state() -> tuple[dict, dict, dict]:
    """placement {layer: {expert: tier}} (experts not listed are on disk), heat {(layer, expert):
    routing count}, routed {layer: [experts routed for the current token]} — 8 of 256 per layer."""
    placement = {}
    for l in range(L):
        tiers = {}
        for e in range(E):
            if e < 16 and l < 24:
                tiers[e] = "pinned"                 # a hot pinned block, top left
            elif (e * 37 + l * 11) % 100 < 20 + (l % 4) * 15:
                tiers[e] = "ram"
        placement[l] = tiers
    heat = {(l, e): float((e * 7 + l * 13) % 97 + (400 if e < 16 else 0) + (150 if 120 <= e < 136 else 0))
            for l in range(L) for e in range(E) if (e + l) % 3}
    routed = {l: sorted({(l * 5 + k * 31) % E for k in range(8)}) for l in range(L)}
    return placement, heat, routed


STATS = {"new_tokens": 40, "prompt_tokens": 12, "ttft_s": 1.25, "decode_tok_s": 3.4, "prefill_tok_s": 20.0,
         "hit_rate": 0.81, "hits": 2430, "misses": 570, "bytes_read": 61_000_000_000,
         "prefetch_recall": 0.62, "prefetch_used": 300, "prefetch_issued": 480, "peak_rss_bytes": 96_000_000_000,
         "attention_s": 1.5, "experts_s": 6.0, "disk_wait_s": 4.0, "lm_head_s": 0.3}


def push_glm5(panel) -> tuple[dict, dict, dict]:
    """Show GLM-5's shape and the synthetic state in a TierPanel, as the app does for a model."""
    placement, heat, routed = glm5_state()
    panel.set_model(L, E, ram_budget=90 * 10**9)
    panel.push(stats=STATS, rate=3.4, placement=placement, heat=heat, routed=routed, slot_bytes=19_000_000)
    return placement, heat, routed


def expected(state, layers: range, experts: range) -> tuple[dict, float, int]:
    """Straight from the dicts: tier counts, summed heat and how many are routed now, for a block."""
    placement, heat, routed = state
    counts: dict = {}
    for l in layers:
        for e in experts:
            t = placement.get(l, {}).get(e, "disk")
            counts[t] = counts.get(t, 0) + 1
    total = sum(heat.get((l, e), 0.0) for l in layers for e in experts)
    hot = sum(e in experts for l in layers for e in set(routed.get(l, [])))
    return counts, total, hot


def check_info(bm, state) -> str:
    """The words under the map name the cursor's layers, experts, dominant tier and heat."""
    from colibri_tui.brainmap import TIER_LABEL, TIER_RANK, fmt_heat, span
    g = bm.grid()
    r, c = bm.cursor
    l0, l1 = g.layer_range(r)
    e0, e1 = g.expert_range(c)
    counts, total, hot = expected(state, range(l0, l1 + 1), range(e0, e1 + 1))
    dom = max(counts, key=lambda t: (counts[t], TIER_RANK[t]))
    info = str(bm.screen.query_one("#brain-info").render())
    assert info.startswith(span(l0, l1, "layer", "layers") + " × " + span(e0, e1, "expert", "experts") + "\n")
    n = sum(counts.values())
    assert (f"{TIER_LABEL[dom]} {counts[dom]} of {n}" if n > 1 else TIER_LABEL[dom]) in info
    assert f"heat {fmt_heat(total)}" in info and ("routed now" in info) == (hot > 0)
    if n > 1 and hot:
        assert f"{hot} routed now" in info
    return info


def lines(bm) -> list:
    return [bm.render_line(y) for y in range(bm.scrollable_content_region.height)]


def plain(bm) -> list[str]:
    return [s.text for s in lines(bm)]


def cursor_cells(bm) -> list[tuple[int, int, str]]:
    """(x, y, 'top'|'bottom') of every half cell drawn in the cursor's colour."""
    from rich.color import Color

    from colibri_tui.brainmap import CURSOR_RGB
    red = Color.from_rgb(*CURSOR_RGB)
    out = []
    for y, strip in enumerate(lines(bm)):
        x = 0
        for seg in strip:
            for _ in range(len(seg.text)):
                if seg.text.strip("▀") == "" and seg.style is not None:
                    if seg.style.color == red:
                        out.append((x, y, "top"))
                    if seg.style.bgcolor == red:
                        out.append((x, y, "bottom"))
                x += 1
    return out


@pytest.fixture(scope="module")
def container(tmp_path_factory):
    return tiny_app_container(tmp_path_factory.mktemp("brainmap"), "tiny-moe")


def make_app(container):
    from colibri_tui.app import ColiApp
    from colibri_tui.settings import Settings
    return ColiApp(model_path=container, settings=Settings(), engine_options={"cap": 3, "threads": 1})


async def opened(pilot):
    app = pilot.app
    await wait_for(pilot, lambda: app.engine is not None and not app.loading)
    await pilot.pause()
    state = push_glm5(app.tier_panel)
    await pilot.pause()
    return app.tier_panel.brain, state


def test_glm5_fits_the_120x40_panel_in_aggregate_cells(container, dirs):
    async def run():
        async with make_app(container).run_test(size=(120, 40)) as pilot:
            bm, state = await opened(pilot)
            g = bm.grid()
            lz, ez = bm.cell_factor()
            assert bm.zoom == 0 and (g.lz, g.ez) == (lz, ez) and lz > 1 and ez > 1
            # every layer and expert is on screen: nothing to scroll
            cw, ry = bm.stretch(g)
            assert g.rows * lz >= L > (g.rows - 1) * lz and g.cols * ez >= E > (g.cols - 1) * ez
            assert -(-g.rows * ry // 2) <= bm.size.height and bm.gutter_width() + g.cols * cw <= bm.size.width
            assert bm.virtual_size.height <= bm.size.height and bm.max_scroll_y == 0 and bm.max_scroll_x == 0
            assert all(s.cell_length == bm.size.width for s in lines(bm))
            text = plain(bm)
            assert text[0].startswith(" 0 ") and f"{(g.rows - 1) // 2 * 2 * lz:>2}" in text[(g.rows - 1) // 2][:3]
            info = str(bm.screen.query_one("#brain-info").render())
            assert info == f"cell = {lz} layers × {ez} experts\nclick to inspect · +/- zoom"     # nothing selected yet
            assert cursor_cells(bm) == []
            # the summed heat and dominant tier of a cell, checked against the dicts
            for r, c in ((0, 0), (g.rows - 1, g.cols - 1), (5, 18)):
                l0, l1 = g.layer_range(r)
                e0, e1 = g.expert_range(c)
                counts, total, hot = expected(state, range(l0, l1 + 1), range(e0, e1 + 1))
                assert abs(g.heat_sum[r][c] - total) < 1e-6 and g.routed_n[r][c] == hot
                assert counts.get(g.tier[r][c], 0) == max(counts.values())
            assert g.tier[0][0] == "pinned" and g.expert_range(g.cols - 1)[1] == E - 1
            assert g.layer_range(g.rows - 1)[1] == L - 1
    asyncio.run(run())


def test_keyboard_cursor_names_the_cell_and_footer_shows_the_keys(container, dirs):
    from colibri_tui.brainmap import span

    async def run():
        async with make_app(container).run_test(size=(120, 40)) as pilot:
            bm, state = await opened(pilot)
            bm.focus()
            await pilot.pause()
            assert bm.selected and bm.cursor == (0, 0)
            info = check_info(bm, state)
            assert info.startswith("layers 0–2 × experts 0–6\npinned 21 of 21")
            gw = bm.gutter_width()
            assert cursor_cells(bm) == [(gw, 0, "top")]
            await pilot.press("down", "right", "right")
            assert bm.cursor == (1, 2)
            check_info(bm, state)
            assert cursor_cells(bm) == [(gw + 2, 0, "bottom")]            # two cells share a character row
            assert plain(bm)[0][gw - 1] == "▸"
            await pilot.press("end")
            g = bm.grid()
            assert bm.cursor == (g.rows - 1, g.cols - 1)
            l0, l1 = g.layer_range(g.rows - 1)
            assert l1 == L - 1 and check_info(bm, state).startswith(span(l0, l1, "layer", "layers") + " × ")
            await pilot.press("home")
            assert bm.cursor == (0, 0)
            # the footer lists the map's keys while it has the focus
            footer = " ".join(str(w.render()) for w in app_footer_keys(pilot.app))
            assert "Cell" in footer and "Zoom" in footer
    asyncio.run(run())


def app_footer_keys(app):
    from textual.widgets import Footer
    return list(app.screen.query_one(Footer).query("FooterKey, FooterLabel"))


def test_zoom_and_scroll_change_what_is_shown(container, dirs):
    from textual import events

    async def run():
        async with make_app(container).run_test(size=(120, 40)) as pilot:
            bm, state = await opened(pilot)
            bm.focus()
            await pilot.pause()
            fit = plain(bm)
            lz0, ez0 = bm.cell_factor()
            await pilot.press("down", "down", "right", "right", "right")         # layers 6–8, experts 21–27
            l_first, e_first = bm.grid().layer_range(bm.cursor[0])[0], bm.grid().expert_range(bm.cursor[1])[0]
            await pilot.press("plus")
            lz1, ez1 = bm.cell_factor()
            assert bm.zoom == 1 and (lz1, ez1) == (-(-lz0 // 2), -(-ez0 // 2))
            g = bm.grid()
            l0, l1 = g.layer_range(bm.cursor[0])
            e0, e1 = g.expert_range(bm.cursor[1])
            assert l0 <= l_first <= l1 and e0 <= e_first <= e1                    # zoomed at the cursor
            check_info(bm, state)
            assert plain(bm) != fit and bm.max_scroll_y > 0 and bm.max_scroll_x > 0
            while bm.cell_factor() != (1, 1):
                await pilot.press("plus")
            await pilot.press("plus")                                             # already 1 × 1: stays
            assert bm.cell_factor() == (1, 1) and bm.grid().rows == L and bm.grid().cols == E
            info = check_info(bm, state)
            assert info.startswith(f"layer {bm.cursor[0]} × expert {bm.cursor[1]}\n")
            # the cursor leads the view: far down and right, the map scrolls
            await pilot.press("pagedown", "pagedown", *["right"] * 60)
            await pilot.pause()
            assert bm.scroll_offset.y > 0 and bm.scroll_offset.x > 0
            r, c = bm.cursor
            top = plain(bm)[0]
            assert int(top[:bm.gutter_width() - 1]) == 2 * bm.scroll_offset.y     # the gutter follows
            check_info(bm, state)
            sx, sy = bm.scroll_offset
            assert cursor_cells(bm) == [(bm.gutter_width() + c - sx, r // 2 - sy, "bottom" if r % 2 else "top")]
            # the mouse wheel scrolls the layers too
            before_y, before = bm.scroll_offset.y, plain(bm)
            await pilot._post_mouse_events([events.MouseScrollUp], bm, offset=(10, 2))
            await pilot.pause()
            assert bm.scroll_offset.y < before_y and plain(bm) != before
            await pilot._post_mouse_events([events.MouseScrollDown], bm, offset=(10, 2))
            await pilot._post_mouse_events([events.MouseScrollDown], bm, offset=(10, 2))
            await pilot.pause()
            assert bm.scroll_offset.y > before_y - 1
            # and back out: the whole model again
            for _ in range(5):
                await pilot.press("minus")
            assert bm.zoom == 0 and bm.cell_factor() == (lz0, ez0) and bm.scroll_offset == (0, 0)
    asyncio.run(run())


def test_click_selects_a_cell(container, dirs):
    async def run():
        async with make_app(container).run_test(size=(120, 40)) as pilot:
            bm, state = await opened(pilot)
            gw = bm.gutter_width()
            g = bm.grid()
            assert await pilot.click(bm, offset=(gw + 10, 4))
            assert app_focused(pilot) is bm and bm.selected
            assert bm.cursor == (8, 10)                                  # the upper of the two rows
            info = check_info(bm, state)
            l0, l1 = g.layer_range(8)
            e0, e1 = g.expert_range(10)
            assert info.startswith(f"layers {l0}–{l1} × experts {e0}–{e1}\n")
            await pilot.click(bm, offset=(gw + 10, 4))                   # again: the lower one
            assert bm.cursor == (9, 10)
            check_info(bm, state)
            await pilot.click(bm, offset=(gw + 11, 4))                   # another column: upper again
            assert bm.cursor == (8, 11)
            await pilot.click(bm, offset=(0, 4))                         # the gutter selects nothing
            assert bm.cursor == (8, 11)
    asyncio.run(run())


def app_focused(pilot):
    return pilot.app.focused


def test_glm5_at_80x24_and_resizing(container, dirs):
    async def run():
        async with make_app(container).run_test(size=(80, 24)) as pilot:
            bm, state = await opened(pilot)
            await pilot.press("f2")                                      # the tier panel over the chat
            await pilot.pause()
            assert bm.size.width > 0 and bm.size.height > 0
            assert all(s.cell_length == bm.scrollable_content_region.width for s in lines(bm))
            bm.focus()
            await pilot.press("plus", "down", "right", "pagedown", "end", "plus", "plus", "minus", "home")
            check_info(bm, state)
            assert all(s.cell_length == bm.scrollable_content_region.width for s in lines(bm))
            for size in ((60, 16), (100, 30), (140, 45), (80, 24)):
                await pilot.resize_terminal(*size)
                await pilot.pause()
                lines(bm)
                if bm.size.height and bm.size.width:
                    check_info(bm, state)
            pilot.app.export_screenshot()                                # the screen still renders
    asyncio.run(run())


def test_small_model_has_one_level_and_stretched_cells():
    """The demo-sized models (3 layers × 8 experts): no aggregation, no zoom, wide cells."""
    from textual.app import App

    from colibri_tui.brainmap import BrainMap
    from colibri_tui.tierpanel import TierPanel

    class MapApp(App):
        def compose(self):
            yield TierPanel()

    async def run():
        app = MapApp()
        async with app.run_test(size=(60, 40)) as pilot:
            panel = app.query_one(TierPanel)
            panel.set_model(3, 8)
            panel.push(placement={0: {1: "ram", 2: "pinned"}}, heat={(0, 1): 5.0, (2, 7): 2.5}, routed={1: [3]})
            await pilot.pause()
            bm = app.query_one(BrainMap)
            assert bm.levels() == [(1, 1)] and bm.stretch(bm.grid()) == (4, 4)
            assert str(panel.query_one("#brain-info").render()) == "click a cell to inspect it"
            await pilot.press("plus")
            assert bm.zoom == 0
            await pilot.click(bm, offset=(bm.gutter_width() + 4 * 2, 1))       # expert 2 of layer 0
            assert bm.cursor == (0, 2)
            assert str(panel.query_one("#brain-info").render()) == "layer 0 × expert 2\npinned · heat 0"
            await pilot.press("down", "down", "right", "right", "right", "right", "right")
            assert str(panel.query_one("#brain-info").render()) == "layer 2 × expert 7\ndisk · heat 2.5"
            await pilot.press("up", "left", "left", "left", "left")
            assert str(panel.query_one("#brain-info").render()) == "layer 1 × expert 3\ndisk · heat 0 · routed now"
            text = plain(bm)
            # each layer is two character rows tall, numbered on its first; ▸ marks the cursor's
            assert [t[:2] for t in text[:6]] == ["0 ", "  ", "1▸", " ▸", "2 ", "  "]
            assert text[0][2:] == "▀" * 32 + " " * (bm.size.width - 34)
    asyncio.run(run())


def test_hash_routed_layers_are_marked_and_named():
    """DeepSeek V4's first layers route by token id (their experts are known from the token, not
    predicted): their rows carry # in the gutter, the cell says "hash-routed", the legend explains
    the mark; a model without such layers shows none of it."""
    from textual.app import App

    from colibri_tui.brainmap import BrainMap
    from colibri_tui.tierpanel import TierPanel

    class MapApp(App):
        def compose(self):
            yield TierPanel()

    async def run():
        app = MapApp()
        async with app.run_test(size=(60, 40)) as pilot:
            panel = app.query_one(TierPanel)
            panel.set_model(4, 8, hashed=[0, 1])
            panel.push(placement={0: {1: "ram"}}, heat={(0, 1): 5.0}, routed={0: [1]})
            await pilot.pause()
            bm = app.query_one(BrainMap)
            assert [t[:2] for t in plain(bm)[:8]] == ["0#", " #", "1#", " #", "2 ", "  ", "3 ", "  "]
            assert "# hash-routed layer: experts from the token" in str(panel.query_one("#brain-legend").render())
            await pilot.click(bm, offset=(bm.gutter_width() + 4, 1))       # expert 1 of layer 0
            assert str(panel.query_one("#brain-info").render()) == \
                "layer 0 × expert 1 · hash-routed\nRAM · heat 5 · routed now"
            await pilot.press("down", "down")
            assert str(panel.query_one("#brain-info").render()) == "layer 2 × expert 1\ndisk · heat 0"
            assert [t[:2] for t in plain(bm)[:2]] == ["0#", " #"]          # the cursor left: the mark is back
            panel.set_model(4, 8)
            await pilot.pause()
            assert "#" not in "".join(t[:2] for t in plain(bm)) and "hash" not in str(
                panel.query_one("#brain-legend").render())
    asyncio.run(run())


def test_the_app_marks_dsv4_hash_layers(tmp_path, dirs):
    """The real app on a DeepSeek V4 container (dsv4-a: layers 0 and 1 hash-routed): the engine
    says which (plain ints: the UI imports no numpy) and the map marks them."""
    import shutil
    from pathlib import Path

    from core.converter import convert
    from models import validate_config
    from tests.conftest import tokenizer_files
    src = tmp_path / "src"
    shutil.copytree(Path(__file__).resolve().parent / "oracle" / "fixtures" / "dsv4-a" / "model", src)
    tokenizer_files(src, 300)
    out = convert(src, tmp_path / "dsv4", bits=16, validate_config=validate_config)

    async def run():
        async with make_app(out).run_test(size=(120, 40)) as pilot:
            app = pilot.app
            await wait_for(pilot, lambda: app.engine is not None and not app.loading)
            await pilot.pause()
            assert app.engine.known_layers == [0, 1] and all(type(i) is int for i in app.engine.known_layers)
            bm = app.tier_panel.brain
            assert bm.hashed == {0, 1}
            gutter = [t[:2] for t in plain(bm)]
            assert all(g.endswith("#") for g in gutter[:4]) and not any("#" in g for g in gutter[4:8])
    asyncio.run(run())
