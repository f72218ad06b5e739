"""Building blocks two or more families share (DESIGN.md): routers so far; attention, MLPs and
the rest move here as the families that need other kinds arrive (issue 17)."""
