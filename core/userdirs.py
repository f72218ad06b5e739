"""The user's data directory (platformdirs), which ``COLI_DATA_DIR`` moves (tests, portable
installs): chats, the routing histories of models installed with the program, downloads."""
from __future__ import annotations

import os
from pathlib import Path

APP_NAME = "colibri"


def data_dir() -> Path:
    env = os.environ.get("COLI_DATA_DIR")
    if env:
        return Path(env)
    from platformdirs import user_data_dir
    return Path(user_data_dir(APP_NAME, appauthor=False))
