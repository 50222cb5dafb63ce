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
from collections import OrderedDict
from collections.abc import Hashable
from typing import Protocol

from ..errors import ConfigError


class LifetimeClass(enum.IntEnum):
    """Expected lifetime of an entry on flash (ordered: SHORT < MEDIUM < LONG)."""

    SHORT = 0
    MEDIUM = 1
    LONG = 2


#: Engine hints accepted by :func:`class_from_hint`.
HINTS = {
    "system": LifetimeClass.LONG,
    "system_prompt": LifetimeClass.LONG,
    "tool": LifetimeClass.LONG,
    "long": LifetimeClass.LONG,
    "conversation": LifetimeClass.MEDIUM,
    "medium": LifetimeClass.MEDIUM,
    "query": LifetimeClass.SHORT,
    "single_query": LifetimeClass.SHORT,
    "short": LifetimeClass.SHORT,
}
# Accepted spellings: case-insensitive; spaces and dashes count as underscores
# ("system prompt", "single-query").


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
        return HINTS[str(hint).strip().lower().replace(" ", "_").replace("-", "_")]
    except KeyError:
        raise ConfigError(f"lifetime hint {hint!r}: accepted values are {sorted(HINTS)}") from None


class LifetimeClassifier(Protocol):
    """Assigns a :class:`LifetimeClass` to an entry; the placement layer only sees the class.

    Implementations may learn from :meth:`observe` (called on every store and
    every reuse of ``key``).  A later issue adds better predictors behind this
    interface.
    """

    def observe(self, key: Hashable, now_s: float) -> None:  # pragma: no cover - protocol
        """Record that ``key`` was stored or reused at time ``now_s`` (seconds, any monotonic clock)."""
        ...

    def classify(
        self, key: Hashable, hint: str | LifetimeClass | None = None, now_s: float | None = None
    ) -> LifetimeClass:  # pragma: no cover - protocol
        """Class for ``key``; an engine ``hint`` wins when given."""
        ...


class ReuseHistory:
    """Bounded LRU record of when keys were stored and reused.

    ``records[key] = [first_seen_s, last_seen_s, reuses]``; the oldest key is
    dropped past ``max_keys``.
    """

    def __init__(self, max_keys: int) -> None:
        self.max_keys = int(max_keys)
        self.records: OrderedDict[Hashable, list[float]] = OrderedDict()

    def observe(self, key: Hashable, now_s: float) -> None:
        """Record a store or reuse of ``key`` at ``now_s`` seconds."""
        rec = self.records.get(key)
        if rec is None:
            self.records[key] = [float(now_s), float(now_s), 0.0]
            if len(self.records) > self.max_keys:
                self.records.popitem(last=False)
        else:
            rec[1] = float(now_s)
            rec[2] += 1
            self.records.move_to_end(key)


class ReuseLifetimeClassifier:
    """Default classifier: engine hint if given, else observed reuse.

    Without a hint, an entry's class comes from how often and how regularly it
    has been reused (reuse = an :meth:`observe` after the first):

    * ``reuses >= long_min_reuses`` and mean reuse interval ``<= long_max_interval_s``
      -> LONG (shared prefixes: system prompts and tool definitions are hit by many
      requests);
    * ``reuses >= 1`` and last reuse within ``medium_max_idle_s`` -> MEDIUM
      (conversation context that comes back turn after turn);
    * otherwise SHORT (single-query KV).

    The thresholds are engineering defaults, not measured values: a turn gap of
    minutes (``medium_max_idle_s = 600``) and "reused at least 3 times, about
    once per 10 minutes or more often" for LONG.  State is bounded by
    ``max_keys`` (least recently observed keys are forgotten).

    Parameters
    ----------
    long_min_reuses : int
    long_max_interval_s : float
    medium_max_idle_s : float
    max_keys : int
    """

    def __init__(
        self,
        long_min_reuses: int = 3,
        long_max_interval_s: float = 600.0,
        medium_max_idle_s: float = 600.0,
        max_keys: int = 1 << 20,
    ) -> None:
        if long_min_reuses < 1 or long_max_interval_s <= 0 or medium_max_idle_s <= 0 or max_keys < 1:
            raise ConfigError(
                "ReuseLifetimeClassifier: thresholds must be positive "
                f"(got {long_min_reuses}, {long_max_interval_s}, {medium_max_idle_s}, {max_keys})"
            )
        self.long_min_reuses = int(long_min_reuses)
        self.long_max_interval_s = float(long_max_interval_s)
        self.medium_max_idle_s = float(medium_max_idle_s)
        self.max_keys = int(max_keys)
        self._history = ReuseHistory(self.max_keys)
        self._seen = self._history.records

    def observe(self, key: Hashable, now_s: float) -> None:
        """Record a store or reuse of ``key`` at ``now_s`` seconds."""
        self._history.observe(key, now_s)

    def reuse_stats(self, key: Hashable) -> tuple[int, float]:
        """``(reuses, mean_interval_s)``; ``(0, inf)`` for an unseen or never-reused key."""
        rec = self._seen.get(key)
        if rec is None or rec[2] == 0:
            return 0, float("inf")
        return int(rec[2]), (rec[1] - rec[0]) / rec[2]

    def classify(
        self, key: Hashable, hint: str | LifetimeClass | None = None, now_s: float | None = None
    ) -> LifetimeClass:
        """Engine hint if given; else LONG / MEDIUM / SHORT from reuse (see class doc)."""
        cls = class_from_hint(hint)
        if cls is not None:
            return cls
        reuses, interval_s = self.reuse_stats(key)
        if reuses >= self.long_min_reuses and interval_s <= self.long_max_interval_s:
            return LifetimeClass.LONG
        if reuses >= 1:
            rec = self._seen[key]
            idle_s = 0.0 if now_s is None else float(now_s) - rec[1]
            if idle_s <= self.medium_max_idle_s:
                return LifetimeClass.MEDIUM
        return LifetimeClass.SHORT
