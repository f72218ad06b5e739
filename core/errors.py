"""The one exception type that reaches users as a single clear line (never a traceback)."""


class ColiError(Exception):
    """A problem the user can act on; ``str(err)`` is the whole message."""
