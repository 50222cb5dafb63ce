"""Lifetime prediction for FDP placement from what a store can see.

A block written to flash should go to the reclaim unit of blocks that will die
(be evicted or invalidated) at about the same time (FDP, NVMe TP4146; the
gain is fewer valid pages to relocate at GC). The store sees, per block:

* an **engine hint** (``"system"``, ``"conversation"``, ``"query"``) -- wins when given;
* its **position in the prefix chain** -- leading blocks are shared by many
  requests (system prompt, tool definitions) and live long;
* its **observed reuse** -- hit count and mean reuse interval;
* its **namespace** -- per-namespace reuse rates (a tenant whose blocks are
  rarely reused writes short-lived data).

:class:`PrefixLifetimePredictor` combines them with fixed, documented rules
(thresholds are engineering defaults; the bench measures the accuracy against
true death times, see ``bench/README_policies.md``):

1. hint -> its class;
2. ``hits >= long_min_hits`` with mean reuse interval ``<= long_max_interval_s``,
   or ``position < shared_prefix_blocks`` with ``hits >= 1`` -> LONG;
3. ``hits >= 1`` -> MEDIUM;
4. never reused: MEDIUM if the namespace's observed reuse rate (reused /
   written blocks, Laplace-smoothed) is ``>= medium_ns_reuse``, else SHORT.

It satisfies both the manager's ``classify(entry, now_s)`` hook (call the
object) and the FDP layer's :class:`tierstore.fdp.lifetime.LifetimeClassifier`
protocol (``observe``/``classify`` by key).
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np

from ..errors import ConfigError
from ..fdp.lifetime import LifetimeClass, ReuseHistory, class_from_hint
from .base import EntryInfo


class PrefixLifetimePredictor:
    """Predict a block's flash lifetime class (see module doc for the rules).

    Parameters
    ----------
    shared_prefix_blocks : int
        Chain positions below this count as a shared prefix.
    long_min_hits : int
        Hits that make a block LONG when reuse is regular enough.
    long_max_interval_s : float
        Largest mean reuse interval (seconds) for LONG by hits.
    medium_ns_reuse : float
        Namespace reuse rate above which never-reused blocks are MEDIUM.
    max_keys : int
        Bound on per-key state for the key-based protocol.
    """

    def __init__(
        self,
        shared_prefix_blocks: int = 2,
        long_min_hits: int = 2,
        long_max_interval_s: float = 600.0,
        medium_ns_reuse: float = 0.5,
        max_keys: int = 1 << 20,
    ) -> None:
        if shared_prefix_blocks < 0 or long_min_hits < 1 or long_max_interval_s <= 0 or max_keys < 1:
            raise ConfigError("PrefixLifetimePredictor: thresholds must be positive")
        self.shared_prefix_blocks = int(shared_prefix_blocks)
        self.long_min_hits = int(long_min_hits)
        self.long_max_interval_s = float(long_max_interval_s)
        self.medium_ns_reuse = float(medium_ns_reuse)
        self.max_keys = int(max_keys)
        self._ns: dict[bytes, list[int]] = {}  # ns -> [blocks classified, of which reused]
        self._history = ReuseHistory(self.max_keys)
        self._seen = self._history.records  # key -> [first_s, last_s, reuses]

    # ---------------------------------------------------------- manager hook
    def __call__(self, entry: EntryInfo, now_s: float) -> LifetimeClass:
        """Class of a manager entry being written to NVMe."""
        ns = getattr(entry, "ns", b"")
        rec = self._ns.setdefault(ns, [0, 0])
        rec[0] += 1
        rec[1] += entry.hits > 0
        hint = getattr(entry, "lifetime", None)
        interval_s = (entry.last_access_s - entry.created_s) / entry.hits if entry.hits else float("inf")
        return self._rules(hint, int(getattr(entry, "position", -1)), entry.hits, interval_s, ns)

    def _rules(self, hint, position: int, hits: int, interval_s: float, ns: bytes) -> LifetimeClass:
        cls = class_from_hint(hint)
        if cls is not None:
            return cls
        if hits >= self.long_min_hits and interval_s <= self.long_max_interval_s:
            return LifetimeClass.LONG
        if 0 <= position < self.shared_prefix_blocks and hits >= 1:
            return LifetimeClass.LONG
        if hits >= 1:
            return LifetimeClass.MEDIUM
        written, reused = self._ns.get(ns, (0, 0))
        if (reused + 1) / (written + 2) >= self.medium_ns_reuse:  # Laplace's rule of succession
            return LifetimeClass.MEDIUM
        return LifetimeClass.SHORT

    def reuse_probability(self, entry: EntryInfo) -> float:
        """Laplace estimate of reuse: ``(hits + 1) / (hits + 2)`` for a shared-prefix
        position, ``hits / (hits + 1)`` elsewhere (a never-hit tail block scores 0)."""
        h = entry.hits
        if 0 <= int(getattr(entry, "position", -1)) < self.shared_prefix_blocks:
            return (h + 1) / (h + 2)
        return h / (h + 1)

    # ---------------------------------------------------------- fdp protocol
    def observe(self, key: Hashable, now_s: float) -> None:
        """Record a store or reuse of ``key`` at ``now_s`` seconds."""
        self._history.observe(key, now_s)

    def classify(
        self, key: Hashable, hint: str | LifetimeClass | None = None, now_s: float | None = None
    ) -> LifetimeClass:
        """Class of a key from :meth:`observe` history (no position or namespace known)."""
        rec = self._seen.get(key)
        hits = 0 if rec is None else int(rec[2])
        interval_s = (rec[1] - rec[0]) / hits if rec is not None and hits else float("inf")
        return self._rules(hint, -1, hits, interval_s, b"\x00")


def default_classify(entry: EntryInfo, now_s: float) -> LifetimeClass:
    """Engine hint if given; else observed reuse: a block hit >= 2 times is
    LONG-lived (shared prefix), hit once MEDIUM (conversation), never SHORT."""
    if entry.lifetime is not None:
        return entry.lifetime
    if entry.hits >= 2:
        return LifetimeClass.LONG
    if entry.hits == 1:
        return LifetimeClass.MEDIUM
    return LifetimeClass.SHORT


def default_classify_many(hint: np.ndarray, hits: np.ndarray) -> np.ndarray:
    """:func:`default_classify` of many blocks at once, from their row arrays.

    Parameters
    ----------
    hint : numpy.ndarray
        Engine hint per block (``int8``, a :class:`LifetimeClass` value or -1 for none).
    hits : numpy.ndarray
        Lookup hits per block (integer), same length.

    Returns
    -------
    numpy.ndarray
        ``int64`` :class:`LifetimeClass` values, the same as ``default_classify`` gives per block.
    """
    by_hits = np.where(
        hits >= 2,
        int(LifetimeClass.LONG),
        np.where(hits == 1, int(LifetimeClass.MEDIUM), int(LifetimeClass.SHORT)),
    )
    return np.where(hint >= 0, hint.astype(np.int64), by_hits).astype(np.int64)


class ReuseEntryClassifier:
    """Classify a block from the reuse the index observed on it.

    Engine hint first; else, with ``hits`` lookups that matched the block since
    it was stored and ``interval_s = (last_access_s - created_s) / hits``:

    * ``hits >= long_min_hits`` and ``interval_s <= long_max_interval_s`` -> LONG;
    * ``hits >= 1`` and idle ``now_s - last_access_s <= medium_max_idle_s`` -> MEDIUM;
    * otherwise SHORT.

    Thresholds are engineering defaults, not fitted to a trace.
    """

    def __init__(
        self, long_min_hits: int = 3, long_max_interval_s: float = 600.0, medium_max_idle_s: float = 600.0
    ) -> None:
        if long_min_hits < 1 or long_max_interval_s <= 0 or medium_max_idle_s <= 0:
            raise ConfigError("ReuseEntryClassifier: thresholds must be positive")
        self.long_min_hits = int(long_min_hits)
        self.long_max_interval_s = float(long_max_interval_s)
        self.medium_max_idle_s = float(medium_max_idle_s)

    def __call__(self, entry: EntryInfo, now_s: float) -> LifetimeClass:
        if entry.lifetime is not None:
            return entry.lifetime
        if entry.hits >= self.long_min_hits:
            if (entry.last_access_s - entry.created_s) / entry.hits <= self.long_max_interval_s:
                return LifetimeClass.LONG
        if entry.hits >= 1 and now_s - entry.last_access_s <= self.medium_max_idle_s:
            return LifetimeClass.MEDIUM
        return LifetimeClass.SHORT


class DemotionClassifier:
    """Classify a block by the reuse observed on it when it is demoted to NVMe (per-block eviction).

    Under per-block LRU a block dies when it falls off the NVMe LRU, unless a hit refreshes it; what
    the store knows at demotion is its hits in the memory tiers, its age (``now_s - created_s``) and
    its chain position. Engine hint first; else

    * ``hits >= 1`` and ``position < shared_prefix_blocks`` -> LONG (a shared prefix, reused);
    * ``hits >= 1``, or an age below the running median of the ages at demotion -> MEDIUM
      (a block pushed out of memory young, i.e. in a burst, outlives the NVMe LRU's drain time);
    * otherwise SHORT.

    The median is kept online over the last ``window`` demotions (a ring of ages; no trace is fitted).

    Parameters
    ----------
    shared_prefix_blocks : int
        Chain positions below this count as a shared prefix.
    window : int
        Demotions the age median is taken over (>= 1).
    """

    def __init__(self, shared_prefix_blocks: int = 4, window: int = 1024) -> None:
        if shared_prefix_blocks < 0 or window < 1:
            raise ConfigError("DemotionClassifier: shared_prefix_blocks >= 0 and window >= 1")
        self.shared_prefix_blocks = int(shared_prefix_blocks)
        self._ages = np.zeros(int(window))
        self._n = 0

    def __call__(self, entry: EntryInfo, now_s: float) -> LifetimeClass:
        if entry.lifetime is not None:
            return entry.lifetime
        age_s = max(0.0, now_s - entry.created_s)
        filled = min(self._n, self._ages.size)
        young = filled > 0 and age_s < float(np.median(self._ages[:filled]))
        self._ages[self._n % self._ages.size] = age_s
        self._n += 1
        if entry.hits >= 1 and 0 <= int(getattr(entry, "position", -1)) < self.shared_prefix_blocks:
            return LifetimeClass.LONG
        if entry.hits >= 1 or young:
            return LifetimeClass.MEDIUM
        return LifetimeClass.SHORT


def make_classifier(spec):
    """The one lifetime classifier of a store: ``f(entry, now_s) -> LifetimeClass``.

    Parameters
    ----------
    spec : {"hint", "reuse", "prefix", "demotion"} or callable or None
        A name of :data:`tierstore.policies.registry.CLASSIFIER`.
        ``None``/``"hint"``: :func:`default_classify`; ``"reuse"``:
        :class:`ReuseEntryClassifier`; ``"prefix"``:
        :class:`PrefixLifetimePredictor`; ``"demotion"``:
        :class:`DemotionClassifier`; a callable is used as is.

    Raises
    ------
    ConfigError
        For an unknown name.
    """
    if spec is None:
        return default_classify
    if callable(spec):
        return spec
    from .registry import CLASSIFIER

    if spec not in CLASSIFIER:
        raise ConfigError(
            f"classifier={spec!r}: accepted values are {CLASSIFIER.names()} or a callable f(entry, now_s)"
        )
    return CLASSIFIER.make(spec)


def true_class(lifetime_s: float, short_max_s: float, medium_max_s: float) -> LifetimeClass:
    """Class of a measured flash lifetime: SHORT below ``short_max_s``, MEDIUM below
    ``medium_max_s``, else LONG."""
    if lifetime_s < short_max_s:
        return LifetimeClass.SHORT
    if lifetime_s < medium_max_s:
        return LifetimeClass.MEDIUM
    return LifetimeClass.LONG
