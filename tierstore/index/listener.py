"""The block index as the NVMe region manager's listener (:class:`~tierstore.tiers.storage.RegionListener`).

The segment store owns NVMe space and evicts whole regions. Before it drops a region it asks
:meth:`NvmeListener.on_reclaim` which of the region's blocks to keep (copy forward): those in use,
pinned, being read or written, and those the reinsertion policy predicts will be reused. Then it
says what left (:meth:`NvmeListener.on_dropped`). With ``eviction_granularity: block`` it asks
:meth:`NvmeListener.pick_victims` for single blocks, in the order of the index's NVMe policy. At start-up
:meth:`NvmeListener.adopt` indexes
what a persistent NVMe tier recovered. It runs under the index lock it is given
(``BlockIndex._lock``) and has none of its own; ``build.assemble`` attaches it.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from ..contract import Tier
from ..metrics import Metrics
from ..policies.base import EvictionPolicy
from ..tiers.storage import RegionListener
from .introspect import EventLog
from .rows import DOOMED, ON_NVME, EntryView, IndexRoom, RowTable


class NvmeListener(IndexRoom, RegionListener):
    """What the region manager asks and tells the index.

    Parameters
    ----------
    rows, lock, clock
        As :class:`~tierstore.index.rows.IndexRoom`.
    reinsert : callable or None
        ``f(entry, now_s) -> bool``: keep an evictable block when its region is evicted.
    metrics : Metrics
        The index's counters (``evictions_nvme``).
    events : EventLog
    forget_if_empty : callable
        ``f(row, key)``: drops a row with no copy left (the completion room's).
    policy : EvictionPolicy or None
        The order of the NVMe-resident blocks (block mode); ``None``: region mode.
    """

    def __init__(self, rows: RowTable, lock: threading.RLock, clock: Callable[[], float],
                 reinsert: Callable | None, metrics: Metrics, events: EventLog,
                 forget_if_empty: Callable[[int, bytes], None], policy: EvictionPolicy | None = None) -> None:
        super().__init__(rows, lock, clock)
        self.policy = policy
        self.reinsert = reinsert
        self.metrics = metrics
        self.events = events
        self._forget_if_empty = forget_if_empty

    def on_hits(self, keys: Sequence[bytes], rows: Sequence[int], now: float) -> None:
        """Block mode: ``keys`` (at ``rows``) were hit on some tier; those with an NVMe copy move
        up the NVMe policy's order (one flat LRU over the NVMe-resident blocks). Under the lock."""
        on = [j for j, r in enumerate(rows) if self.rows.flags[r] & ON_NVME]
        if on and self.policy is not None:
            kn = [keys[j] for j in on]
            self.policy.on_access_many(kn, lambda j: EntryView(self.rows, rows[on[j]], kn[j]), now)

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
            self._forget_nvme(keys)

    def pick_victims(self, n: int) -> list[bytes]:
        """Up to ``n`` unprotected NVMe blocks in the NVMe policy's order (block mode; none in region
        mode). Their NVMe copies are forgotten now, so no new load plans a read of them; a load
        already holding one protects it (it is never picked)."""
        if self.policy is None or n <= 0:
            return []
        now = self._clock()
        with self._lock:
            rt = self.rows

            def protected(key: bytes) -> bool:
                r = rt.table.get(key)
                return r < 0 or rt.protected(r, now)
            keys = self.policy.evict(n, protected, now)
            while not keys and n > 1:  # policies are all-or-nothing: take what there is
                n //= 2
                keys = self.policy.evict(n, protected, now)
            self._forget_nvme(keys)
            return keys

    def _forget_nvme(self, keys: list[bytes]) -> None:
        rt = self.rows
        rows = rt.table.get_many(keys).tolist()
        n = 0
        for k, r in zip(keys, rows):
            if r < 0 or not rt.flags[r] & ON_NVME:
                continue
            rt.flags[r] &= 0xFF ^ ON_NVME
            if self.policy is not None:
                self.policy.on_remove(k)
            n += 1
            self.events.add("removed", k, Tier.NVME)
            self._forget_if_empty(r, k)
        self.metrics.add({"evictions_nvme": n})

    def adopt(self, keys: Sequence[bytes], nss: Sequence[bytes], write_seqs: Sequence[int] | None = None) -> int:
        """Index blocks a persistent NVMe tier recovered at start-up (the NVMe policy gets them oldest
        write first, so a restarted LRU starts as FIFO). Returns blocks adopted."""
        now = self._clock()
        with self._lock:
            if self.policy is not None and write_seqs is not None:
                order = sorted(range(len(keys)), key=lambda i: int(write_seqs[i]))
                keys, nss = [keys[i] for i in order], [nss[i] for i in order]
            n = self.rows.adopt(keys, nss, now)
            if self.policy is not None:
                rt = self.rows
                for k in keys:
                    r = rt.table.get(k)
                    if r >= 0 and rt.flags[r] & ON_NVME:
                        self.policy.on_insert(rt.view(r, k), now)
            return n
