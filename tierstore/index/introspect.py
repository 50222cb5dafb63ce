"""What the block index can tell about itself: block states, residency, namespaces, events, invariants.

:class:`Introspection` answers the read-only questions (a block's state, tiers and record,
resident blocks and bytes per tier, namespaces and their keys) and checks the invariants the
tests and ``KVStore.check()`` rely on (slots, policies, references and flags agree).
:class:`EventLog` records what happened to blocks when a test asks for it. Both run under the
index lock they are given (``BlockIndex._lock``) and have none of their own.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np

from ..contract import MEMORY_TIERS, BlockState, Tier
from ..errors import InvariantError
from ..fdp.lifetime import LifetimeClass
from ..policies.base import EvictionPolicy
from ..tiers.memory import SlotAllocator
from .pins import Pins
from .rows import DOOMED, EVICT_HBM, EVICT_HOST, IN, NO_HINT, NVME_WRITING, ON_NVME, PENDING, IndexRoom


class EventLog:
    """Events ``(kind, key, tier label)`` of blocks (stored, demoted, promoted, removed,
    dropped, invalidated), recorded only while :attr:`on`; the index appends under its lock."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self.on = False
        self._events: list[tuple] = []

    def add(self, kind: str, key: bytes, tier: Tier | None = None) -> None:
        if self.on:
            self._events.append((kind, key, None if tier is None else tier.label))

    def take(self) -> list[tuple]:
        """Drain recorded events ``(kind, key, tier label)``."""
        with self._lock:
            out, self._events = self._events, []
            return out


@dataclasses.dataclass(eq=False, repr=False)
class Introspection(IndexRoom):
    """Read-only questions about the index, and its invariants.

    Parameters
    ----------
    rows, lock, clock
        As :class:`~tierstore.index.rows.IndexRoom`.
    tiers : list of Tier
        The enabled tiers, fastest first.
    alloc : dict
        ``Tier -> SlotAllocator`` of the memory tiers.
    policies : dict
        ``Tier -> EvictionPolicy`` of the memory tiers.
    pins : Pins
        References and leases.
    """

    tiers: list[Tier]
    alloc: dict[Tier, SlotAllocator]
    policies: dict[Tier, EvictionPolicy]
    pins: Pins
    nvme_policy: EvictionPolicy | None = None

    def state_of(self, key: bytes) -> BlockState | None:
        """Ownership state of a visible block, or ``None`` if not resident."""
        with self._lock:
            r = self.rows.table.get(key)
            if r < 0 or self.rows.top(r) is None:
                return None
            if self.rows.refs[r] > 0:
                return BlockState.ACTIVE
            if self.rows.pinned(r, self._clock()):
                return BlockState.PINNED
            return BlockState.EVICTABLE

    def tiers_of(self, key: bytes) -> list[Tier]:
        """Tiers holding a readable copy of ``key`` (empty if not resident)."""
        with self._lock:
            r = self.rows.table.get(key)
            if r < 0 or self.rows.flags[r] & (PENDING | DOOMED):
                return []
            return [t for t in self.tiers if self.rows.readable(r, t)]

    def references(self) -> dict[object, int]:
        """``request_id -> blocks referenced`` of every open request."""
        with self._lock:
            return {rid: len(rows) for rid, rows in self.pins.requests.items()}

    def block_info(self, key: bytes) -> dict | None:
        """A visible block's index record as a dict, or ``None``."""
        with self._lock:
            r = self.rows.table.get(key)
            if r < 0 or self.rows.flags[r] & (PENDING | DOOMED):
                return None
            v = self.rows.view(r, key)
            nc = int(self.rows.nvme_class[r])
            return {
                "tiers": [t for t in self.tiers if self.rows.readable(r, t)],
                "ref_count": v.ref_count,
                "pinned": self.rows.pinned(r, self._clock()),
                "hits": v.hits,
                "position": v.position,
                "created_s": v.created_s,
                "last_access_s": v.last_access_s,
                "namespace": v.ns,
                "lifetime": v.lifetime,
                "nvme_lifetime": None if nc == NO_HINT else LifetimeClass(nc),
            }

    def memory_slot(self, key: bytes, tier: Tier) -> int:
        """Slot of ``key`` in a memory tier, or -1."""
        with self._lock:
            r = self.rows.table.get(key)
            return -1 if r < 0 else int(self.rows.slot[tier][r])

    def resident_blocks(self) -> dict[str, int]:
        """Blocks with a copy in each tier.

        The NVMe count is a pass over every row's flags (10M rows: ~10 ms), so it runs after the
        index lock is released, on the flags array read under it (a row that is neither indexed
        nor doomed has flags 0; an array the table replaces when it grows stays valid): lookups
        never wait for it, and numpy releases the GIL over arrays this long. Calls that overlap
        a store may count its blocks or not.
        """
        with self._lock:
            out = {t.label: 0 for t in Tier}
            for t, a in self.alloc.items():
                out[t.label] = a.used
            flags = self.rows.flags
        out["nvme"] = int(np.count_nonzero((flags & (ON_NVME | DOOMED)) == ON_NVME))
        return out

    def bytes_per_tier(self) -> dict[str, int]:
        """Resident bytes per tier."""
        return {k: v * self.rows.block_bytes for k, v in self.resident_blocks().items()}

    def namespaces(self) -> dict[bytes, int]:
        """Visible blocks per namespace digest."""
        with self._lock:
            rows = self.rows.table.held_rows()
            ok = (self.rows.flags[rows] & (PENDING | DOOMED)) == 0
            ids, counts = np.unique(self.rows.ns[rows[ok]], return_counts=True)
            return {self.rows.namespaces.digests[int(i)]: int(c) for i, c in zip(ids, counts)}

    def keys_of_namespace(self, ns: bytes) -> list[bytes]:
        """Visible keys of namespace ``ns``."""
        with self._lock:
            nid = self.rows.namespaces.ids.get(ns)
            if nid is None:
                return []
            rows = self.rows.table.held_rows()
            rows = rows[(self.rows.ns[rows] == nid) & ((self.rows.flags[rows] & (PENDING | DOOMED)) == 0)]
            return self.rows.table.keys_of(rows.tolist())

    def check_invariants(self, quiescent: bool = False, pending_plans: int = 0) -> None:
        """Verify that slots, policies, references and flags agree.

        Parameters
        ----------
        quiescent : bool
            Also require that no plan is in flight and nothing is held:
            no readers, no pending or evicting rows, no doomed rows.
        pending_plans : int
            Prepared plans not yet completed (the index's count).

        Raises
        ------
        InvariantError
        """
        with self._lock:
            rows = self.rows.table.held_rows()
            live = np.concatenate([rows, np.asarray(sorted(self.rows.doomed), dtype=np.int64)])
            for t, alloc in self.alloc.items():
                sl = self.rows.slot[t][live]
                held = sl[sl >= 0]
                if len(set(held.tolist())) != held.size:
                    raise InvariantError(f"{t.label}: two rows share a slot")
                if quiescent and held.size != alloc.used:
                    raise InvariantError(f"{t.label}: {alloc.used} slots used, {held.size} held by rows")
                if alloc.used < held.size:
                    raise InvariantError(f"{t.label}: {held.size} slots held, only {alloc.used} allocated")
                n = int(((self.rows.slot[t][rows] >= 0) & ((self.rows.flags[rows] & PENDING) == 0)).sum())
                if quiescent and len(self.policies[t]) != n:
                    raise InvariantError(f"{t.label}: policy tracks {len(self.policies[t])}, {n} resident")
            nvp = self.nvme_policy
            n_nvme = int(((self.rows.flags[rows] & ON_NVME) != 0).sum())
            if nvp is not None and len(nvp) != n_nvme:
                raise InvariantError(f"nvme: policy tracks {len(nvp)}, {n_nvme} rows on NVMe")
            for t in MEMORY_TIERS:
                if ((self.rows.slot[t][live] >= 0) != ((self.rows.flags[live] & IN[t]) != 0)).any():
                    raise InvariantError(f"{t.label}: slot and residency flag disagree")
            if self.rows.flags[-1]:
                raise InvariantError("the spare flags element (absent rows) was written")
            free = np.ones(self.rows.flags.size, dtype=bool)
            free[live] = False
            if self.rows.flags[free].any():  # resident_blocks counts NVMe copies over every row's flags
                raise InvariantError("a row that is neither indexed nor doomed has flags set")
            if (self.rows.refs[live] < 0).any() or (self.rows.readers[live] < 0).any():
                raise InvariantError("negative reference or reader count")
            counts: dict[int, int] = {}
            for lst in self.pins.requests.values():
                for r in lst:
                    counts[r] = counts.get(r, 0) + 1
            for r in live.tolist():
                if counts.get(r, 0) != int(self.rows.refs[r]):
                    raise InvariantError(
                        f"row {r}: ref_count {int(self.rows.refs[r])} != {counts.get(r, 0)} references"
                    )
            for r in rows.tolist():
                if self.rows.flags[r] & DOOMED:
                    raise InvariantError(f"row {r} is doomed but still indexed")
            if quiescent:
                if pending_plans:
                    raise InvariantError(f"{pending_plans} plans in flight")
                busy = self.rows.flags[rows] & (PENDING | EVICT_HBM | EVICT_HOST | NVME_WRITING)
                if busy.any() or (self.rows.readers[rows] > 0).any():
                    raise InvariantError("rows still held by plans")
                if self.rows.doomed and not any(self.rows.refs[r] > 0 for r in self.rows.doomed):
                    raise InvariantError(f"{len(self.rows.doomed)} doomed rows with no user left")
