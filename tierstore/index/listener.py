"""The block index as the NVMe region manager's listener (:class:`~tierstore.tiers.storage.RegionListener`).

The segment store owns NVMe space and evicts whole regions. Before it drops a region it asks
:meth:`NvmeListener.on_reclaim` which of the region's blocks to keep (copy forward): those in use,
pinned, being read or written, and those the reinsertion policy predicts will be reused. Then it
says what left (:meth:`NvmeListener.on_dropped`). At start-up :meth:`NvmeListener.adopt` indexes
what a persistent NVMe tier recovered. It runs under the index lock it is given
(``BlockIndex._lock``) and has none of its own; ``build.assemble`` attaches it.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from ..contract import Tier
from ..metrics import Metrics
from ..tiers.storage import RegionListener
from .introspect import EventLog
from .rows import DOOMED, ON_NVME, RowTable


class NvmeListener(RegionListener):
    """What the region manager asks and tells the index.

    Parameters
    ----------
    rows : RowTable
    lock : threading.RLock
        The index lock (``BlockIndex._lock``).
    clock : callable
        Seconds, monotonic (the index's clock).
    reinsert : callable or None
        ``f(entry, now_s) -> bool``: keep an evictable block when its region is evicted.
    metrics : Metrics
        The index's counters (``evictions_nvme``).
    events : EventLog
    forget_if_empty : callable
        ``f(row, key)``: drops a row with no copy left (the completion room's).
    """

    def __init__(self, rows: RowTable, lock: threading.RLock, clock: Callable[[], float],
                 reinsert: Callable | None, metrics: Metrics, events: EventLog,
                 forget_if_empty: Callable[[int, bytes], None]) -> None:
        self.rows = rows
        self._lock = lock
        self._clock = clock
        self.reinsert = reinsert
        self.metrics = metrics
        self.events = events
        self._forget_if_empty = forget_if_empty

    def on_reclaim(self, keys: list[bytes]) -> list[bool]:
        """Which blocks of an NVMe region being evicted to keep (copy forward):
        those in use, pinned, being read or written, and those the reinsertion
        policy predicts will be reused. Changes nothing else than the NVMe write
        time of the blocks the policy keeps (they are copied forward now)."""
        now = self._clock()
        reinsert = self.reinsert
        with self._lock:
            rt = self.rows
            rows = rt.table.get_many(keys).tolist()
            out = []
            for k, r in zip(keys, rows):
                if r < 0:
                    out.append(False)
                    continue
                keep = rt.protected(r, now) and not rt.flags[r] & DOOMED
                if not keep and reinsert is not None:
                    keep = bool(reinsert(rt.view(r, k), now))
                    if keep:  # copied forward now: its reference bit restarts
                        rt.nvme_at[r] = now
                out.append(keep)
            return out

    def on_dropped(self, keys: list[bytes]) -> None:
        """Blocks left the NVMe tier (region evicted or corrupt)."""
        with self._lock:
            rt = self.rows
            rows = rt.table.get_many(keys).tolist()
            n = 0
            for k, r in zip(keys, rows):
                if r < 0 or not rt.flags[r] & ON_NVME:
                    continue
                rt.flags[r] &= 0xFF ^ ON_NVME
                n += 1
                self.events.add("removed", k, Tier.NVME)
                self._forget_if_empty(r, k)
            self.metrics.add({"evictions_nvme": n})

    def adopt(self, keys: Sequence[bytes], nss: Sequence[bytes]) -> int:
        """Index blocks a persistent NVMe tier recovered at start-up. Returns blocks adopted."""
        now = self._clock()
        with self._lock:
            return self.rows.adopt(keys, nss, now)
