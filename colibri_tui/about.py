"""The About/F1 screen's text: the version, the model, and where every file of the app lives
(the log a bug report needs first)."""
from __future__ import annotations


def about_text(model: str | None) -> str:
    from .cli import _version
    from .paths import config_path, data_dir, log_path
    from .settings import export_dir
    rows = [("version", f"colibri {_version()}"), ("model", model or "none (Ctrl+P → Set up a model)"),
            ("log", str(log_path())), ("config", str(config_path())),
            ("data", f"{data_dir()} (chats, models, routing histories)"), ("exports", str(export_dir()))]
    width = max(len(k) for k, _ in rows)
    return ("\n".join(f"{k:<{width}}  {v}" for k, v in rows) +
            "\n\nKeys: Enter sends, Esc stops a reply, Ctrl+P all commands, F2 tier panel, F3 chats, "
            "F4 chat settings, F5 settings, F6 rename, F7 export, F8 delete, Ctrl+PgUp/PgDn previous/"
            "next chat, Ctrl+Q quits.\nWhen something goes wrong, the log above says what happened.")
