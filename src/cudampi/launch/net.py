"""Moved to :mod:`cudampi.net` (the ground floor); this name stays only until launch/cli.py and
launch/rank.py import it from there (issue 17, after issue 16's changes to them land)."""

from __future__ import annotations

from cudampi.net import Interface, interfaces, is_local, local_names, route_interface

__all__ = ["Interface", "interfaces", "is_local", "local_names", "route_interface"]
