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

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from ..contract import Tier
from ..metrics import Metrics
from ..policies.base import EvictionPolicy
from ..tiers.storage import RegionListener
from .introspect import EventLog
from .rows import BUSY, DOOMED, ON_NVME, EntryView, IndexRoom

#: Keys a region callback handles per hold of the index lock (a region of 64 B blocks holds ~16k;
#: dropping them in one hold kept lookups waiting 55-77 ms, issue 25 item 4).
CHUNK_KEYS = 256


@dataclasses.dataclass(eq=False, repr=False)
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

    reinsert: Callable | None
    metrics: Metrics
    events: EventLog
    _forget_if_empty: Callable[[int, bytes], None]
    policy: EvictionPolicy | None = None

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
        time of the blocks the policy keeps (they are copied forward now).

        The index lock is taken per :data:`CHUNK_KEYS` keys, so a lookup waits for one chunk, not
        for a whole region; each answer is the block's state when its chunk was examined."""
        now = self._clock()
        out: list[bool] = []
        for a in range(0, len(keys), CHUNK_KEYS):
            with self._lock:
                out.extend(self._keep(keys[a : a + CHUNK_KEYS], now))
        return out

    def _keep(self, keys: list[bytes], now: float) -> list[bool]:
        """:meth:`on_reclaim` of one chunk, under the lock: the protection test of
        :meth:`RowTable.protected <tierstore.index.rows.RowTable.protected>` over the chunk's rows
        at once; the reinsertion policy is asked per block, for the unprotected ones only."""
        rt = self.rows
        rows = rt.table.get_many(keys)
        found = rows >= 0
        r = rows[found]
        f = rt.flags[r]
        keep = np.zeros(len(keys), dtype=bool)
        keep[found] = (
            (rt.refs[r] > 0) | (rt.readers[r] > 0) | (rt.pin_until[r] > rt.pin_now(now)) | ((f & BUSY) != 0)
        ) & ((f & DOOMED) == 0)
        if self.reinsert is not None:
            for j in np.flatnonzero(found & ~keep).tolist():
                row = int(rows[j])
                if self.reinsert(rt.view(row, keys[j]), now):
                    keep[j] = True
                    rt.stamp("nvme_at", row, now)  # copied forward now: its reference bit restarts
        return keep.tolist()

    def on_dropped(self, keys: list[bytes]) -> None:
        """Blocks left the NVMe tier (region evicted or corrupt); the index lock is taken per
        :data:`CHUNK_KEYS` keys (a lookup in between may still plan a read of a later chunk's
        block: the NVMe tier answers it with a miss)."""
        for a in range(0, len(keys), CHUNK_KEYS):
            with self._lock:
                self._forget_nvme(keys[a : a + CHUNK_KEYS])

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
        rows = rt.table.get_many(keys)
        idx = np.flatnonzero(rt.flags[rows] & ON_NVME)  # row -1 reads the spare flags element (0)
        gone = rows[idx]
        rt.flags[gone] &= 0xFF ^ ON_NVME
        for j, r in zip(idx.tolist(), gone.tolist()):
            k = keys[j]
            if self.policy is not None:
                self.policy.on_remove(k)
            self.events.add("removed", k, Tier.NVME)
            self._forget_if_empty(r, k)
        self.metrics.add({"evictions_nvme": int(idx.size)})

    def adopt(
        self, keys: Sequence[bytes], nss: Sequence[bytes], write_seqs: Sequence[int] | None = None
    ) -> int:
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
