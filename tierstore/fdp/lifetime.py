"""Lifetime classes: how long an entry is expected to stay live on flash.

FDP (NVMe TP4146) gains when data that dies together is written together.
KV-cache entries fall into three classes by expected lifetime (cf. RocksDB's
``WriteLifeTimeHint`` SHORT/MEDIUM/LONG/EXTREME, which Linux maps to
``F_SET_RW_HINT``):

* :attr:`LifetimeClass.LONG`   -- system/tool prefixes: hours to days.
* :attr:`LifetimeClass.MEDIUM` -- conversation context: minutes.
* :attr:`LifetimeClass.SHORT`  -- single-query KV: seconds.

The placement policy (:mod:`tierstore.fdp.placement`) maps a class to a
reclaim unit handle (RUH) and its placement identifier (PID).
"""
from __future__ import annotations

import enum

from ..errors import ConfigError


class LifetimeClass(enum.IntEnum):
    """Expected lifetime of an entry on flash (ordered: SHORT < MEDIUM < LONG)."""

    SHORT = 0
    MEDIUM = 1
    LONG = 2


#: Engine hints accepted by :func:`class_from_hint`.
HINTS = {
    "system": LifetimeClass.LONG, "system_prompt": LifetimeClass.LONG, "tool": LifetimeClass.LONG,
    "long": LifetimeClass.LONG,
    "conversation": LifetimeClass.MEDIUM, "medium": LifetimeClass.MEDIUM,
    "query": LifetimeClass.SHORT, "single_query": LifetimeClass.SHORT, "short": LifetimeClass.SHORT,
}


def class_from_hint(hint: str | LifetimeClass | None) -> LifetimeClass | None:
    """Map an engine hint (``"system"``, ``"conversation"``, ``"query"``, ...) to a class.

    Returns ``None`` for ``None``.

    Raises
    ------
    ConfigError
        For an unknown hint; the message lists the accepted ones.
    """
    if hint is None or isinstance(hint, LifetimeClass):
        return hint
    try:
        return HINTS[str(hint).lower()]
    except KeyError:
        raise ConfigError(f"lifetime hint {hint!r}: accepted values are {sorted(HINTS)}") from None
