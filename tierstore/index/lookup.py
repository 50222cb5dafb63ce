"""The block index's lookup path: the longest resident prefix, the hits it records, its usefulness.

:class:`Lookups` is a room of :class:`~tierstore.index.core.BlockIndex`: it runs under the index
lock (``BlockIndex._lock``) and has none of its own. A lookup finds the leading run of readable
blocks (their stored token ids compared with ``verify_tokens``), records the hits (recency, the
eviction policies' ``on_access_many``, block mode's NVMe order, request references), counts a
miss that admission caused, and prices the matched prefix with the cost model: one load call per
tier (:meth:`~tierstore.policies.cost.CostModel.tier_load_s`) or a chain over several
(:meth:`~tierstore.policies.cost.CostModel.chain_load_s`), and the useful prefix, where loading
beats recomputing (:meth:`~tierstore.policies.cost.CostModel.useful_prefix`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import numpy as np

from ..contract import MEMORY_TIERS, LookupResult, Tier
from ..metrics import Metrics
from ..policies.cost import CostModel
from .listener import NvmeListener
from .pins import Pins
from .placement import Placement
from .rows import IndexRoom, RowTable

__all__ = ["Lookups"]

_TIER_OF_INT = tuple(Tier)
_LABELS = {int(t): t.name.lower() for t in Tier}
_HIT_COUNTER = {int(t): f"hit_blocks_{t.name.lower()}" for t in Tier}


class Lookups(IndexRoom):
    """Answers :meth:`BlockIndex.lookup <tierstore.index.core.BlockIndex.lookup>` (module doc).

    Parameters
    ----------
    rows, lock, clock
        As :class:`~tierstore.index.rows.IndexRoom`.
    placement : Placement
        Its memory tiers' eviction policies and the keys admission kept off NVMe (``rejected``).
    pins : Pins
        Where a lookup's request references are held.
    listener : NvmeListener
        Block mode's NVMe eviction order (``listener.policy``), refreshed by every hit.
    metrics : Metrics
        The index's counters (``verify_mismatch``, ``admission_lost_*``).
    cost : CostModel
        Load-versus-recompute model for useful hits.
    verify_tokens : bool
        Compare the stored token ids of each matched block with the caller's.
    tokens_per_block : int
    """

    def __init__(
        self,
        rows: RowTable,
        lock: threading.RLock,
        clock: Callable[[], float],
        placement: Placement,
        pins: Pins,
        listener: NvmeListener,
        metrics: Metrics,
        cost: CostModel,
        verify_tokens: bool,
        tokens_per_block: int,
    ) -> None:
        super().__init__(rows, lock, clock)
        self.placement = placement
        self.policies = placement.policies
        self.pins = pins
        self.listener = listener
        self.metrics = metrics
        self.cost = cost
        self.verify_tokens = bool(verify_tokens)
        self.tokens_per_block = int(tokens_per_block)
        self.block_bytes = rows.block_bytes

    def lookup(
        self,
        keys: Sequence[bytes],
        tokens: Sequence[np.ndarray] | None,
        request_id: object,
        num_prompt_tokens: int | None,
        now: float,
    ) -> LookupResult:
        """:meth:`BlockIndex.lookup <tierstore.index.core.BlockIndex.lookup>` at ``now``, under the
        index lock."""
        n = len(keys)
        T = self.tokens_per_block
        rows = self.rows.table.get_many(keys)
        tops = self.rows.tops(rows).tolist()  # a list: the scans below are C calls, no numpy's per-call cost
        m = self._match(rows, tops, tokens)
        if m < n and self.placement.rejected:
            self._count_rejected(keys, m)
        c = {"lookups": 1, "lookup_blocks": n}
        if m:
            tiers, load_s, useful, reason = self._record_hits(keys, rows, tops, m, request_id, now, c)
            mkeys = keys[:m] if type(keys) is list else list(keys[:m])  # a list's slice is a copy already
        else:
            tiers, load_s, useful, reason, mkeys = [], [], 0, None, []
        c["useful_blocks"] = useful
        if num_prompt_tokens is not None:
            c["prompt_tokens"] = num_prompt_tokens
            c["partial_tail_tokens"] = num_prompt_tokens - n * T
        self.metrics.add(c)
        return LookupResult(mkeys, tiers, load_s, useful, n, T, request_id, reason)

    def _match(self, rows: np.ndarray, tops: list[int], tokens: Sequence[np.ndarray] | None) -> int:
        """Length of the leading run of readable rows (``tops[i] >= 0``; with ``verify_tokens``,
        whose stored token ids equal ``tokens``)."""
        m = tops.index(-1) if -1 in tops else len(tops)  # tops are -1 (unreadable) or a tier
        if self.verify_tokens and tokens is not None:
            stored = self.rows.tokens
            for i in range(m):
                r = int(rows[i])
                if r in stored and not np.array_equal(stored[r], np.asarray(tokens[i], dtype=np.int64)):
                    self.metrics.inc("verify_mismatch")
                    return i
        return m

    def _count_rejected(self, keys: Sequence[bytes], m: int) -> None:
        """If the first miss ``keys[m]`` was kept off NVMe by admission, count the run of such keys."""
        rejected = self.placement.rejected
        if keys[m] not in rejected:
            return
        lost = 0
        for k2 in keys[m:]:
            if k2 not in rejected:
                break
            lost += 1
        self.metrics.add({"admission_lost_lookups": 1, "admission_lost_blocks": lost})

    def _record_hits(
        self,
        keys: Sequence[bytes],
        rows: np.ndarray,
        tops: list[int],
        m: int,
        request_id: object,
        now: float,
        c: dict,
    ) -> tuple[list, list[float], int, str | None]:
        """The ``m`` matched blocks were hit: recency, policies, request references, counters into
        ``c``. Returns ``(tiers, load_s, useful, reason)`` of :class:`LookupResult`."""
        n, T, bb = len(keys), self.tokens_per_block, self.block_bytes
        mr = rows[:m] if m < n else rows
        lt = tops[:m] if m < n else tops
        self.rows.count_hits(mr)
        self.rows.stamp("last", mr, now)
        lr = mr.tolist()
        t0 = lt[0]
        if lt.count(t0) == m:  # every block from one tier (the common case): no split by tier
            counts = {t0: m}
        else:
            counts = {t: k for t, k in enumerate(np.bincount(lt, minlength=3).tolist()) if k}
        for t in MEMORY_TIERS:
            k = counts.get(t, 0)
            if k:
                if k == m:
                    kt, rt = keys if m == n else keys[:m], lr
                else:
                    sel = [j for j, tt in enumerate(lt) if tt == t]
                    kt, rt = [keys[j] for j in sel], [lr[j] for j in sel]
                self.policies[t].on_access_many(kt, self.rows.views(rt, kt), now)
        if self.listener.policy is not None:  # block mode: a hit on any tier refreshes the NVMe copy
            self.listener.on_hits(keys, lr, now)
        if request_id is not None:
            self.rows.count_up("refs", mr)
            self.pins.reference(request_id, lr)
        cost = self.cost
        if len(counts) == 1:  # one load call per tier: its latency is paid once
            load_s = cost.tier_load_s(_LABELS[t0], bb, m)
        else:
            load_s = cost.chain_load_s([_LABELS[t] for t in lt], bb)
        useful = cost.useful_prefix(load_s, T)
        reason = None
        if useful < m:
            reason = cost.not_useful_reason([_LABELS[t] for t in lt], load_s, useful, bb, T)
        c["lookup_hits"] = 1
        c["hit_blocks"] = m
        c["matched_tokens"] = m * T
        for ti, k in counts.items():  # ascending tiers
            c[_HIT_COUNTER[ti]] = k
        if len(counts) == 1:
            return [_TIER_OF_INT[t0]] * m, load_s, useful, reason
        return list(map(_TIER_OF_INT.__getitem__, lt)), load_s, useful, reason
