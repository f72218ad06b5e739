"""Where colibrì keeps its files, and the app log.

``log_path()`` is what ``coli --help`` and the About/F1 screen name; ``setup_logging()`` (called
once by ``coli``'s entry point) makes Python's logging write there, rotating, so a user can send
the file with a bug report. ``COLI_LOG_DIR`` moves the log (tests), as ``COLI_CONFIG_DIR`` and
``COLI_DATA_DIR`` move the config and the data (``colibri_tui.settings``).
"""
from __future__ import annotations

import logging
import os
from logging.handlers import RotatingFileHandler
from pathlib import Path

from .settings import APP_NAME, config_path, data_dir

__all__ = ["config_path", "data_dir", "log_dir", "log_path", "setup_logging"]

LOG_FILE = "colibri.log"
LOG_MAX_BYTES = 1 << 20          # then colibri.log.1 .. .3: a few MB at most, whatever runs
LOG_BACKUPS = 3
LOG_FORMAT = "%(asctime)s %(process)d %(name)s %(levelname)s %(message)s"


def log_dir() -> Path:
    env = os.environ.get("COLI_LOG_DIR")
    if env:
        return Path(env)
    from platformdirs import user_log_dir
    return Path(user_log_dir(APP_NAME, appauthor=False))   # as installers/launcher.py


def log_path() -> Path:
    return log_dir() / LOG_FILE


def setup_logging(level: int = logging.INFO) -> Path | None:
    """Send the ``colibri`` loggers to the rotating log file; None when it cannot be written
    (a read-only home must not stop the app). Idempotent."""
    root = logging.getLogger("colibri")
    path = log_path()
    for h in list(root.handlers):
        if isinstance(h, RotatingFileHandler):
            if Path(h.baseFilename) == path.absolute():
                return path
            root.removeHandler(h)            # the log moved (COLI_LOG_DIR): one file at a time
            h.close()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handler = RotatingFileHandler(path, maxBytes=LOG_MAX_BYTES, backupCount=LOG_BACKUPS,
                                      encoding="utf-8", delay=True)
    except OSError:
        return None
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    root.propagate = False           # never onto the terminal: stderr keeps its one-line errors
    return path


def logger(name: str) -> logging.Logger:
    """A child of the app's logger (``colibri.NAME``)."""
    return logging.getLogger(f"colibri.{name}")
