"""Moved to :mod:`cudampi.rankenv` (the ground floor); this name stays only until
launch/rank.py imports it from there (issue 17, after issue 16's changes to rank.py land)."""

from __future__ import annotations

from cudampi.rankenv import RankEnv, parse_tasks_per_node, rank_env

__all__ = ["RankEnv", "parse_tasks_per_node", "rank_env"]
