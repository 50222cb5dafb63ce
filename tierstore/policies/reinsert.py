"""Reinsertion: which blocks of an NVMe region being evicted are copied forward.

Region eviction frees a whole reclaim unit at a time (CacheLib Navy; FDP wants
it). Blocks in use or pinned are always kept by the index. A reinsertion
policy may also keep evictable blocks that are likely to be hit again, paying
for it in host write amplification (the copy-forward bytes are counted as
``gc_bytes_written``). Navy's ``HitsReinsertionPolicy``
(``cachelib/navy/block_cache/HitsReinsertionPolicy.h``) keeps an item whose hit
count reached a threshold; :class:`HitsReinsertion` is that rule.

A policy is pure: ``f(entry, now_s) -> bool``, it moves nothing.
"""

from __future__ import annotations

from ..errors import ConfigError
from .base import EntryInfo


class HitsReinsertion:
    """Keep a block that was hit at least ``min_hits`` times.

    Parameters
    ----------
    min_hits : int
        Hits since the block was stored (>= 1).
    """

    def __init__(self, min_hits: int = 1) -> None:
        if min_hits < 1:
            raise ConfigError(f"min_hits={min_hits}: must be >= 1")
        self.min_hits = int(min_hits)

    def __call__(self, entry: EntryInfo, now_s: float) -> bool:
        return entry.hits >= self.min_hits


class ClockReinsertion:
    """Keep a block hit since its NVMe copy was last written (a reference bit).

    With FIFO region eviction this is the CLOCK / second-chance approximation
    of LRU (F. J. Corbato, "A paging experiment with the Multics system",
    MIT Project MAC report MAC-M-384, 1968; the FIFO-reinsertion that S3-FIFO's
    main queue uses, Yang et al., SOSP 2023): a block reused while it sat on
    flash gets another round, one that was not is dropped. Unlike
    :class:`HitsReinsertion`, a block hit once long ago is not kept forever.
    Copy-forward bytes are host write amplification (``gc_bytes_written``).

    Reads ``entry.last_access_s`` and ``entry.nvme_written_s`` (clock seconds).
    """

    def __call__(self, entry: EntryInfo, now_s: float) -> bool:
        return entry.last_access_s > entry.nvme_written_s


class PredictedReinsertion:
    """Keep a block whose predicted reuse probability is at least ``threshold``
    (:meth:`tierstore.policies.lifetime.PrefixLifetimePredictor.reuse_probability`)."""

    def __init__(self, threshold: float = 0.5) -> None:
        from .lifetime import PrefixLifetimePredictor

        if not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"threshold={threshold}: must be in [0, 1]")
        self.threshold = float(threshold)
        self._predict = PrefixLifetimePredictor().reuse_probability

    def __call__(self, entry: EntryInfo, now_s: float) -> bool:
        return self._predict(entry) >= self.threshold


def make_reinsert(name):
    """A reinsertion policy by name (:data:`tierstore.policies.registry.REINSERT`; ``"none"`` or
    ``None``: keep only blocks in use), or a callable ``f(entry, now_s) -> bool`` used as is.

    Raises
    ------
    ConfigError
        For an unknown name; the message lists the accepted ones.
    """
    if callable(name):
        return name
    if name is None:
        return None
    from .registry import REINSERT

    return REINSERT.make(name)
