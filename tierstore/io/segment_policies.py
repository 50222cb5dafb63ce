"""Segment policies: the order in which segment eviction considers sealed segments.

A policy is a small class with one method, ``order(sealed, stats)``: given the
ids of the sealed segments (ascending) and the per-segment counters
(:class:`SegmentStats`), it returns those ids in the order eviction tries them.
Every policy sorts with a *stable* argsort, so segments with equal keys are
tried in ascending segment id. :data:`SEGMENT_POLICY` is the registry the
``region_policy`` configuration key names (:mod:`tierstore.registry`); its
family string is that key, so an unknown name is refused with
``"region_policy='x': accepted values are [...]"``. A new policy (a clock or
FIFO variant, issue 26) is one more class registered here; the
:class:`~tierstore.io.segment_manager.SegmentManager` never branches on a name.

:class:`GreedyCompaction` is not a choice of the configuration: it is the
order of a store with no listener (a plain store that must not lose an
acknowledged block): only segments with dead blocks, fewest live first.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np

from ..registry import Registry

__all__ = [
    "SegmentStats",
    "SegmentPolicy",
    "LruSegments",
    "FifoSegments",
    "MinLiveSegments",
    "GreedyCompaction",
    "SEGMENT_POLICY",
]


class SegmentStats(NamedTuple):
    """Per-segment counters a policy orders by: int64 arrays of ``n_segments``, indexed by segment id.

    Attributes
    ----------
    live : np.ndarray
        Blocks whose current copy lies in the segment.
    written : np.ndarray
        Blocks written into the segment since it was opened (``written - live`` are dead).
    touched : np.ndarray
        Value of the manager's tick counter at the last write into or hit on the segment.
    sealed_at : np.ndarray
        The write sequence number when the segment was sealed.
    """

    live: np.ndarray
    written: np.ndarray
    touched: np.ndarray
    sealed_at: np.ndarray


class SegmentPolicy(Protocol):
    """Orders sealed segments for eviction."""

    def order(self, sealed: np.ndarray, stats: SegmentStats) -> np.ndarray:
        """``sealed`` (int64 segment ids, ascending) in eviction order, ties in ascending id."""
        ...


class LruSegments:
    """Least recently written or hit first (Navy's region LRU; ``region_policy: lru``)."""

    def order(self, sealed: np.ndarray, stats: SegmentStats) -> np.ndarray:
        return sealed[np.argsort(stats.touched[sealed], kind="stable")]


class FifoSegments:
    """Oldest sealed first, so a reclaim unit's data dies together (``region_policy: fifo``)."""

    def order(self, sealed: np.ndarray, stats: SegmentStats) -> np.ndarray:
        return sealed[np.argsort(stats.sealed_at[sealed], kind="stable")]


class MinLiveSegments:
    """Fewest live blocks first: greedy garbage collection (``region_policy: min_live``)."""

    def order(self, sealed: np.ndarray, stats: SegmentStats) -> np.ndarray:
        return sealed[np.argsort(stats.live[sealed], kind="stable")]


class GreedyCompaction:
    """A store without a listener: only segments with dead blocks, fewest live first."""

    def order(self, sealed: np.ndarray, stats: SegmentStats) -> np.ndarray:
        sealed = sealed[stats.live[sealed] < stats.written[sealed]]
        return sealed[np.argsort(stats.live[sealed], kind="stable")]


#: ``region_policy`` name -> policy class (registration order is the order messages list).
SEGMENT_POLICY: Registry[SegmentPolicy] = Registry("region_policy")
SEGMENT_POLICY.register("lru", LruSegments)
SEGMENT_POLICY.register("fifo", FifoSegments)
SEGMENT_POLICY.register("min_live", MinLiveSegments)
