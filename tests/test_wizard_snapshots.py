"""The wizard's first step as an SVG snapshot at 80x24, the smallest terminal we promise (the
120x40 one is tests/test_snapshots.py::test_setup_wizard_first_step): the fit-check column
must still show whole. Same deterministic machine and catalog as that test.

    pytest tests/test_wizard_snapshots.py --snapshot-update    # accept the current rendering
"""
from __future__ import annotations

import pytest

from tests.conftest import wait_for

pytest.importorskip("textual")
pytest.importorskip("pytest_textual_snapshot")

from tests.test_snapshots import dirs, make_app, steady  # noqa: E402,F401  (dirs is a fixture)


def _fixed_machine(dirs, monkeypatch):
    from collections import namedtuple

    import psutil

    import models
    from colibri_tui import wizard
    from models import catalog
    from tests.test_snapshots import CATALOG, GB, MODELS_DIR
    monkeypatch.setattr(models, "default_model", lambda: None)
    toml = dirs / "catalog.toml"
    toml.write_text(CATALOG)
    monkeypatch.setattr(catalog, "CATALOG", toml)
    VM = namedtuple("VM", "total available")
    monkeypatch.setattr(psutil, "virtual_memory", lambda: VM(16 * GB, 12 * GB))
    monkeypatch.setattr(catalog, "free_disk", lambda directory: 1000 * GB)
    monkeypatch.setattr(wizard, "default_base_dir", lambda: MODELS_DIR)
    return wizard


def test_setup_wizard_first_step_80x24(dirs, monkeypatch, snap_compare):
    wizard = _fixed_machine(dirs, monkeypatch)

    async def run_before(pilot):
        app = pilot.app
        await wait_for(pilot, lambda: isinstance(app.screen, wizard.SetupWizard) and app.screen.is_mounted
                       and app.screen.query_one("#catalog").row_count == 3)
        table = app.screen.query_one("#catalog")
        assert [str(c.label) for c in table.columns.values()][-1] == "Here"
        await steady(pilot)

    assert snap_compare(make_app(setup_wizard=True), terminal_size=(80, 24), run_before=run_before)
