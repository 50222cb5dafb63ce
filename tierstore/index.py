"""The block index: it decides, it never moves bytes.

Three tiers, fastest first: ``HBM`` (L1, a device block pool), ``HOST`` (L2,
a pinned host block pool) and ``NVME`` (L3, the segment store). An *entry* is
one full block of KV, keyed by its 32-byte chained prefix hash
(:mod:`tierstore.identity`); it may have copies in several tiers.

Decide, then move (vLLM ``v1/kv_offload/abstract.py``'s ``OffloadingManager``)
--------------------------------------------------------------------------------
Every operation that moves bytes has two phases. ``prepare_*`` runs under the
index lock and returns a *plan*: which block goes to which slot of which tier,
which victims leave, which are demoted and with which lifetime class. The
:class:`~tierstore.mover.Mover` executes the plan **without** the index lock.
``complete_*`` applies the outcome under the lock. A lookup therefore never
waits for a copy or an I/O of another request, and the placement of a block
(its tier and, on NVMe, its lifetime class) is decided in exactly one place:
:meth:`BlockIndex.prepare_store` (with :meth:`_reserve` for its victims).

* ``prepare_store`` -> :class:`StorePlan`: per new block its target (a memory
  slot or NVMe), victims to drop (they have a lower copy) or demote (to the next
  memory tier, or to NVMe when the admission policy lets them), and the NVMe
  writes with their lifetime class. ``complete_store(plan, nvme_statuses)``.
* ``prepare_load`` -> :class:`LoadPlan`: per key its source (tier and slot);
  each source is held (``readers``) so it is never a victim meanwhile.
  ``complete_load(plan, statuses)`` releases them, drops copies that failed
  their checksum, and may return a :class:`PromotePlan`.
* A prepare that is never completed leaks nothing once :meth:`abort` is called
  with its plan (the request scope of :class:`tierstore.api.KVStore` does this).

Write policy: ``write_back`` (stores land in the fastest memory tier with
room; victims are demoted on eviction) or ``write_through`` (every store is
written to NVMe, durable when acknowledged, and cached in memory when room
is free). One configured policy, one code path.

Ownership and states
--------------------
*Residency* is separate from *request references*: ``ref_count`` counts
requests that looked the block up with a ``request_id`` and have not released
it. ``ACTIVE`` (referenced), ``PINNED`` (an unexpired lease) or
``EVICTABLE``. A block that is ACTIVE, PINNED, being read, being stored or
being evicted is never chosen as a victim, and the NVMe region manager is told
to copy it forward rather than drop it (:meth:`on_reclaim`).

NVMe space is owned by the segment store (:class:`~tierstore.io.segments.SegmentStorage`):
it evicts whole regions and tells the index what left (:meth:`on_dropped`).

Memory: one row per block in numpy arrays (about 45 bytes) plus the
:class:`~tierstore.keytable.KeyTable` (about 46 bytes), no Python object per block.

Exact-hit rule: only full blocks are stored and matched; a partial tail is
recomputed and counted in ``partial_tail_tokens``.
"""
from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from typing import Callable, Iterable, Sequence

import numpy as np

# The contract types live in tierstore.contract; they stay importable from here.
from .contract import (MEMORY_TIERS, BlockState, Demotion, Lease, LoadPlan,  # noqa: F401
                       LookupResult, Medium, PromotePlan, StorePlan, Tier)
from .errors import ConfigError, InvariantError, QuotaExceeded, Status
from .fdp.lifetime import LifetimeClass, class_from_hint
from .keytable import KeyTable
from .metrics import Metrics
from .policies.base import EvictionPolicy, make_policy
from .policies.cost import CostModel
from .policies.lifetime import default_classify
from .tiers.memory import SlotAllocator

_TIER_OF_INT = tuple(Tier)
_TIERS = {int(t): t for t in Tier}
_LABELS = {int(t): t.name.lower() for t in Tier}
_HIT_COUNTER = {int(t): f"hit_blocks_{t.name.lower()}" for t in Tier}
_STORE_COUNTER = {t: f"store_bytes_{t.name.lower()}" for t in Tier}


# --- row flags
_PENDING = 1          # a store of this key is in flight: not visible yet
_EVICT_HBM = 2        # its HBM copy is being evicted: not readable
_EVICT_HOST = 4       # its host copy is being evicted: not readable
_DOOMED = 8           # removed while in use: freed when the last user goes
_ON_NVME = 16         # has a copy on the NVMe tier
_NVME_WRITING = 32    # a demotion write to NVMe is in flight
_IN_HBM = 64          # holds an HBM slot (``_slot[HBM][row] >= 0``)
_IN_HOST = 128        # holds a host slot (``_slot[HOST][row] >= 0``)
_EVICT = {Tier.HBM: _EVICT_HBM, Tier.HOST: _EVICT_HOST}
_IN = {Tier.HBM: _IN_HBM, Tier.HOST: _IN_HOST}
_NO_HINT = -1


def _top_of_flags(f: int) -> int:
    """Fastest readable tier (0 HBM, 1 host, 2 NVMe) of a row with flags ``f``, or -1."""
    if f & (_PENDING | _DOOMED):
        return -1
    if f & _IN_HBM and not f & _EVICT_HBM:
        return 0
    if f & _IN_HOST and not f & _EVICT_HOST:
        return 1
    return 2 if f & _ON_NVME else -1


#: ``flags -> fastest readable tier`` for every flag byte: one gather finds the
#: tops of a whole chain (:meth:`BlockIndex._tops`).
_TOP = np.array([_top_of_flags(f) for f in range(256)], dtype=np.int64)
_TOP_TIER = [None if t < 0 else Tier(t) for t in _TOP.tolist()]


@dataclasses.dataclass
class IndexConfig:
    """Typed configuration of a :class:`BlockIndex`.

    Parameters
    ----------
    block_bytes : int
        Bytes per block (every tier's slot size).
    tokens_per_block : int
        Tokens per block.
    hbm_blocks, host_blocks : int
        Slots of the memory tiers (0 disables a tier).
    nvme : bool
        Whether an NVMe tier exists.
    nvme_blocks : int
        Capacity hint of the NVMe tier, in blocks (sizes the row arrays).
    promotion : {"top", "one", "none"}
        On a hit from a lower tier: copy to the fastest memory tier, one tier
        up, or not at all. A promotion never triggers an NVMe write: it only
        takes a free slot or evicts a block that has a lower copy.
    eviction : str
        Eviction policy of the memory tiers (:func:`tierstore.policies.make_policy`).
    evict_batch_blocks : int
        Victims taken per eviction round (>= 1): batches demotions to NVMe.
    write_policy : {"write_back", "write_through"}
        See the module doc.
    verify_tokens : bool
        Keep token ids and compare them on lookup (defence against collisions).
    pin_quota_bytes : int
        Per-namespace cap on bytes held by pin leases.
    default_lease_s : float
        Pin lease when none is given.
    admit_to_nvme : callable or None
        ``f(entry) -> bool``; ``False`` keeps a demoted block off flash.
    classify : callable or None
        ``f(entry, now_s) -> LifetimeClass`` when a block is written to NVMe
        (:func:`tierstore.policies.lifetime.make_classifier`).
    reinsert : callable or None
        ``f(entry, now_s) -> bool``: keep (copy forward) an evictable block when
        its NVMe region is evicted. ``None``: only blocks in use are kept.
    clock : callable
        Seconds, monotonic. Tests pass a fake clock.
    remote_victims : bool
        List victims that would be lost in ``StorePlan.lost`` (the shared
        remote tier's ``publish: evict`` mode, :mod:`tierstore.remote`).
    cost : CostModel
        Load-versus-recompute model for useful hits.
    """

    block_bytes: int
    tokens_per_block: int
    hbm_blocks: int = 0
    host_blocks: int = 0
    nvme: bool = False
    nvme_blocks: int = 0
    promotion: str = "top"
    eviction: str = "lru"
    evict_batch_blocks: int = 8
    write_policy: str = "write_back"
    verify_tokens: bool = False
    pin_quota_bytes: int = 1 << 62
    default_lease_s: float = 60.0
    admit_to_nvme: Callable | None = None
    classify: Callable | None = None
    reinsert: Callable | None = None
    clock: Callable[[], float] = time.monotonic
    remote_victims: bool = False
    cost: CostModel = dataclasses.field(default_factory=CostModel)

    def __post_init__(self) -> None:
        if self.promotion not in ("top", "one", "none"):
            raise ConfigError(f"promotion={self.promotion!r}: accepted values are ['none', 'one', 'top']")
        if self.write_policy not in ("write_back", "write_through"):
            raise ConfigError(f"write_policy={self.write_policy!r}: accepted values are "
                              "['write_back', 'write_through']")
        if self.write_policy == "write_through" and not self.nvme:
            raise ConfigError("write_policy='write_through' needs an NVMe tier")
        if self.evict_batch_blocks < 1:
            raise ConfigError(f"evict_batch_blocks={self.evict_batch_blocks}: must be >= 1")
        for f in ("hbm_blocks", "host_blocks", "nvme_blocks"):
            if getattr(self, f) < 0:
                raise ConfigError(f"{f}={getattr(self, f)}: must be >= 0")
        if self.hbm_blocks == 0 and self.host_blocks == 0 and not self.nvme:
            raise ConfigError("every tier is disabled: give a memory tier capacity or an NVMe tier")


class EntryView:
    """What policies may read about one block (:class:`tierstore.policies.base.EntryInfo`).

    A view over the index's arrays, made on demand; not kept by the index.
    """

    __slots__ = ("_ix", "row", "key")

    def __init__(self, ix: "BlockIndex", row: int, key: bytes) -> None:
        self._ix = ix
        self.row = row
        self.key = key

    @property
    def size_bytes(self) -> int:
        return self._ix.config.block_bytes

    @property
    def hits(self) -> int:
        return int(self._ix._hits[self.row])

    @property
    def last_access_s(self) -> float:
        return float(self._ix._last[self.row])

    @property
    def created_s(self) -> float:
        return float(self._ix._created[self.row])

    @property
    def position(self) -> int:
        return int(self._ix._pos[self.row])

    @property
    def ns(self) -> bytes:
        return self._ix._ns_list[int(self._ix._ns[self.row])]

    @property
    def lifetime(self) -> LifetimeClass | None:
        h = int(self._ix._hint[self.row])
        return None if h == _NO_HINT else LifetimeClass(h)

    @property
    def ref_count(self) -> int:
        return int(self._ix._refs[self.row])

    @property
    def nvme_written_s(self) -> float:
        """When its NVMe copy was last written (stored, demoted or copied forward),
        clock seconds; 0.0 if it never was (a reinsertion policy's reference bit:
        ``last_access_s > nvme_written_s`` means hit since written)."""
        return float(self._ix._nvme_at[self.row])


class BlockIndex:
    """Block index, refcounts, pins, states, victim choice and placement decisions.

    Thread-safe: every method takes the index lock, and none holds it across a
    copy or an I/O. See the module doc for the two-phase contract.

    Parameters
    ----------
    config : IndexConfig
    """

    #: Bound on the remembered admission-rejected keys (32 B each).
    REJECTED_KEYS_MAX = 1 << 18
    #: Coldest blocks of the last memory tier a promotion looks at for a victim
    #: that has an NVMe copy (leaves without a write); none among them: no slot.
    CHEAP_SCAN_BLOCKS = 64

    def __init__(self, config: IndexConfig) -> None:
        self.config = config
        c = config
        self.block_bytes = c.block_bytes
        self.tokens_per_block = c.tokens_per_block
        self.tiers: list[Tier] = [t for t, n in ((Tier.HBM, c.hbm_blocks), (Tier.HOST, c.host_blocks)) if n] + \
            ([Tier.NVME] if c.nvme else [])
        self._alloc: dict[Tier, SlotAllocator] = {}
        if c.hbm_blocks:
            self._alloc[Tier.HBM] = SlotAllocator(c.hbm_blocks)
        if c.host_blocks:
            self._alloc[Tier.HOST] = SlotAllocator(c.host_blocks)
        self.policies: dict[Tier, EvictionPolicy] = {t: make_policy(c.eviction) for t in self._alloc}
        rows = max(1024, c.hbm_blocks + c.host_blocks + c.nvme_blocks + 64)
        self._table = KeyTable(rows)
        cap = self._table.capacity_rows
        # one spare element at the end, always 0: ``_flags[-1]`` is the flags of
        # an absent key (row -1), so chains are classified without masking
        self._flags = np.zeros(cap + 1, dtype=np.uint8)
        self._slot = {Tier.HBM: np.full(cap, -1, dtype=np.int32), Tier.HOST: np.full(cap, -1, dtype=np.int32)}
        self._ns = np.zeros(cap, dtype=np.int32)
        self._pos = np.zeros(cap, dtype=np.int32)
        self._hits = np.zeros(cap, dtype=np.int32)
        self._created = np.zeros(cap, dtype=np.float64)
        self._last = np.zeros(cap, dtype=np.float64)
        self._refs = np.zeros(cap, dtype=np.int32)
        self._readers = np.zeros(cap, dtype=np.int32)
        self._pin_until = np.zeros(cap, dtype=np.float64)
        self._hint = np.full(cap, _NO_HINT, dtype=np.int8)
        self._nvme_class = np.full(cap, _NO_HINT, dtype=np.int8)
        self._nvme_at = np.zeros(cap, dtype=np.float64)   # when the NVMe copy was last written
        self._ns_list: list[bytes] = [bytes(32)]
        self._ns_ids: dict[bytes, int] = {bytes(32): 0}
        self._tokens: dict[int, np.ndarray] = {}
        self._doomed: set[int] = set()
        self._requests: dict[object, list[int]] = {}
        self._leases: dict[int, Lease] = {}
        self._row_pins: dict[int, dict[int, float]] = {}
        self._pinned_bytes: dict[bytes, int] = {}
        self._lease_ids = itertools.count(1)
        self._lock = threading.RLock()
        self._idle = threading.Condition(self._lock)
        self._pending_plans = 0
        self._clean_wanted = 0
        self._reading: dict[int, threading.Event] = {}  # row -> its NVMe read in flight (delay hits)
        self.metrics = Metrics()
        self.record_events = False
        self._events: list[tuple] = []
        self.classify = c.classify or default_classify
        self._rejected: dict[bytes, None] = {}

    # ================================================================ helpers
    def _now(self) -> float:
        return self.config.clock()

    def _event(self, kind: str, key: bytes, tier: Tier | None = None) -> None:
        if self.record_events:
            self._events.append((kind, key, None if tier is None else tier.label))

    def take_events(self) -> list[tuple]:
        """Drain recorded events ``(kind, key, tier label)`` (``record_events`` must be on)."""
        with self._lock:
            out, self._events = self._events, []
            return out

    def _intern(self, ns: bytes) -> int:
        nid = self._ns_ids.get(ns)
        if nid is None:
            nid = self._ns_ids[ns] = len(self._ns_list)
            self._ns_list.append(ns)
        return nid

    def _grow(self) -> None:
        cap = self._table.capacity_rows
        old = self._flags
        self._flags = np.zeros(cap + 1, dtype=np.uint8)
        self._flags[:old.size - 1] = old[:-1]
        for name in ("_ns", "_pos", "_hits", "_created", "_last", "_refs", "_readers",
                     "_pin_until", "_hint", "_nvme_class", "_nvme_at"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=old.dtype)
            new[:old.size] = old
            if name in ("_hint", "_nvme_class"):
                new[old.size:] = _NO_HINT
            setattr(self, name, new)
        for t in MEMORY_TIERS:
            old = self._slot[t]
            new = np.full(cap, -1, dtype=np.int32)
            new[:old.size] = old
            self._slot[t] = new

    def _new_row(self, key: bytes, nid: int, pos: int, hint: int, now: float) -> int:
        row, _ = self._table.add(key)
        if row >= self._flags.size - 1:
            self._grow()
        self._flags[row] = _PENDING
        self._slot[Tier.HBM][row] = -1
        self._slot[Tier.HOST][row] = -1
        self._ns[row] = nid
        self._pos[row] = pos
        self._hits[row] = 0
        self._created[row] = now
        self._last[row] = now
        self._refs[row] = 0
        self._readers[row] = 0
        self._pin_until[row] = 0.0
        self._hint[row] = hint
        self._nvme_class[row] = _NO_HINT
        return row

    def _new_rows(self, keys: Sequence[bytes], nid: int, positions: np.ndarray, hint: int, now: float) -> np.ndarray:
        """:meth:`_new_row` for many absent, distinct keys: one batch insert, the state vectorised."""
        rows = self._table.add_absent(keys)
        if rows.size and int(rows.max()) >= self._flags.size - 1:
            self._grow()
        self._flags[rows] = _PENDING
        self._slot[Tier.HBM][rows] = -1
        self._slot[Tier.HOST][rows] = -1
        self._ns[rows] = nid
        self._pos[rows] = positions
        self._hits[rows] = 0
        self._created[rows] = now
        self._last[rows] = now
        self._refs[rows] = 0
        self._readers[rows] = 0
        self._pin_until[rows] = 0.0
        self._hint[rows] = hint
        self._nvme_class[rows] = _NO_HINT
        return rows

    def _view(self, row: int, key: bytes | None = None) -> EntryView:
        return EntryView(self, row, key if key is not None else self._table.key_of(row))

    def _readable(self, row: int, tier: Tier) -> bool:
        f = int(self._flags[row])
        if tier == Tier.NVME:
            return bool(f & _ON_NVME)
        return bool(f & _IN[tier]) and not f & _EVICT[tier]

    def _top(self, row: int) -> Tier | None:
        """Fastest readable copy of a visible row (``None`` for row -1)."""
        return _TOP_TIER[self._flags[row]]

    def _set_slot(self, row: int, tier: Tier, slot: int) -> None:
        self._slot[tier][row] = slot
        if slot >= 0:
            self._flags[row] |= _IN[tier]
        else:
            self._flags[row] &= 0xFF ^ _IN[tier]

    def _pinned(self, row: int, now: float) -> bool:
        return self._pin_until[row] > now

    def _protected_row(self, row: int, now: float) -> bool:
        f = int(self._flags[row])
        return (self._refs[row] > 0 or self._readers[row] > 0 or self._pin_until[row] > now
                or bool(f & (_PENDING | _DOOMED | _EVICT_HBM | _EVICT_HOST | _NVME_WRITING)))

    def _protector(self, extra: set | None, now: float) -> Callable[[bytes], bool]:
        get = self._table.get

        def prot(key: bytes) -> bool:
            if extra is not None and key in extra:
                return True
            row = get(key)
            return row < 0 or self._protected_row(row, now)
        return prot

    def _lower_memory(self, tier: Tier) -> Tier | None:
        if tier == Tier.HBM and Tier.HOST in self._alloc:
            return Tier.HOST
        return None

    def _has_lower_copy(self, row: int, tier: Tier) -> bool:
        f = int(self._flags[row])
        if tier == Tier.HBM and self._slot[Tier.HOST][row] >= 0 and not f & _EVICT_HOST:
            return True
        return bool(f & _ON_NVME)

    def _nvme_lifetime(self, row: int, key: bytes, now: float) -> LifetimeClass:
        """The one place a block's lifetime class (hence its FDP placement) is decided."""
        c = self.classify(self._view(row, key), now)
        self._nvme_class[row] = int(c)
        return c

    # ================================================================ queries
    def probe(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys resident. Takes no reference, touches no recency, counts no hit."""
        with self._lock:
            tops = self._tops(self._table.get_many(keys))
            miss = (tops < 0).nonzero()[0]
            return int(miss[0]) if miss.size else len(tops)

    def resident(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether a readable copy exists. Touches nothing."""
        with self._lock:
            return (self._tops(self._table.get_many(keys)) >= 0).tolist()

    def lookup(self, keys: Sequence[bytes], tokens: Sequence[np.ndarray] | None = None,
               request_id: object = None, num_prompt_tokens: int | None = None) -> LookupResult:
        """Longest resident prefix of ``keys``.

        Parameters
        ----------
        keys : sequence of bytes
            Chained hashes of the prompt's full blocks.
        tokens : sequence of numpy.ndarray, optional
            Token ids per block; compared with stored ids when ``verify_tokens`` is on.
        request_id : hashable, optional
            Each matched block gets a request reference (ACTIVE) until :meth:`release`.
        num_prompt_tokens : int, optional
            The prompt length, for the partial-tail metric.

        Returns
        -------
        LookupResult
        """
        now = self._now()
        n = len(keys)
        T = self.tokens_per_block
        with self._lock:
            rows = self._table.get_many(keys)
            tops = self._tops(rows)
            bad = (tops < 0).nonzero()[0]
            m = int(bad[0]) if bad.size else n
            if self.config.verify_tokens and tokens is not None:
                for i in range(m):
                    r = int(rows[i])
                    if r in self._tokens and not np.array_equal(self._tokens[r],
                                                                np.asarray(tokens[i], dtype=np.int64)):
                        self.metrics.inc("verify_mismatch")
                        m = i
                        break
            if m < n and self._rejected and keys[m] in self._rejected:
                lost = 0
                for k2 in keys[m:]:
                    if k2 not in self._rejected:
                        break
                    lost += 1
                self.metrics.add({"admission_lost_lookups": 1, "admission_lost_blocks": lost})
            c = {"lookups": 1, "lookup_blocks": n}
            reason = None
            if m:
                mr = rows[:m] if m < n else rows
                mt = tops[:m] if m < n else tops
                self._hits[mr] += 1
                self._last[mr] = now
                lr = mr.tolist()
                lt = mt.tolist()
                counts = np.bincount(mt, minlength=3).tolist()
                for t in MEMORY_TIERS:
                    if counts[t]:
                        if counts[t] == m:
                            kt, rt = keys if m == n else keys[:m], lr
                        else:
                            sel = [j for j, tt in enumerate(lt) if tt == t]
                            kt, rt = [keys[j] for j in sel], [lr[j] for j in sel]
                        self.policies[t].on_access_many(kt, lambda j, kt=kt, rt=rt: EntryView(self, rt[j], kt[j]), now)
                if request_id is not None:
                    self._refs[mr] += 1
                    self._requests.setdefault(request_id, []).extend(lr)
                tiers = list(map(_TIER_OF_INT.__getitem__, lt))
                cost = self.config.cost
                present = [t for t in range(3) if counts[t]]
                if len(present) == 1:  # one load call per tier: its latency is paid once
                    load_s = cost.tier_load_s(_LABELS[present[0]], self.block_bytes, m)
                else:
                    load_s = cost.chain_load_s([_LABELS[t] for t in lt], self.block_bytes)
                useful = cost.useful_prefix(load_s, T)
                if useful < m:
                    reason = cost.not_useful_reason([_LABELS[t] for t in lt], load_s, useful, self.block_bytes, T)
                c["lookup_hits"] = 1
                c["hit_blocks"] = m
                c["matched_tokens"] = m * T
                for t in range(3):
                    if counts[t]:
                        c[_HIT_COUNTER[t]] = counts[t]
                mkeys = list(keys[:m])
            else:
                tiers, load_s, useful, mkeys = [], [], 0, []
            c["useful_blocks"] = useful
            if num_prompt_tokens is not None:
                c["prompt_tokens"] = num_prompt_tokens
                c["partial_tail_tokens"] = num_prompt_tokens - n * T
            self.metrics.add(c)
        return LookupResult(mkeys, tiers, load_s, useful, n, T, request_id, reason)

    def _tops(self, rows: np.ndarray) -> np.ndarray:
        """Per row (``-1`` = absent): the fastest readable tier (0 HBM, 1 host,
        2 NVMe), or -1 when the row is absent, pending, doomed or has no
        readable copy. One gather of the flags and one of a 256-entry table
        (row -1 reads the spare, always-zero flags element)."""
        return _TOP[self._flags[rows]]

    # ================================================================ store
    def prepare_store(self, ns: bytes, keys: Sequence[bytes], lifetime: LifetimeClass | str | None = None,
                      first_position: int = 0, tokens: Sequence[np.ndarray] | None = None) -> StorePlan:
        """Decide where each new block goes (phase one of a store).

        Parameters
        ----------
        ns : bytes
            32-byte namespace digest.
        keys : sequence of bytes
            Chained block keys, in chain order.
        lifetime : LifetimeClass or str, optional
            Engine hint (``"system"``, ``"conversation"``, ``"query"``).
        first_position : int
            Chain position of ``keys[0]``.
        tokens : sequence of numpy.ndarray, optional
            Token ids per block (kept with ``verify_tokens``).

        Returns
        -------
        StorePlan
            Keys already stored or in flight are ``EXISTS``; a block that fits
            nowhere is ``NO_SPACE``, and so is every later block of the chain
            (they would be unreachable).
        """
        hint = class_from_hint(lifetime)
        hint_i = _NO_HINT if hint is None else int(hint)
        now = self._now()
        n = len(keys)
        plan = StorePlan(list(keys), [None] * n, [-1] * n, ns=ns)
        with self._lock:
            nid = self._intern(ns)
            rows = self._table.get_many(keys)
            # doomed rows are detached from the key table: a row found is live
            have = (rows >= 0).nonzero()[0].tolist()
            for i in have:
                plan.statuses[i] = Status.EXISTS
            if len(have) == n:
                todo: list[int] = []
            elif not have:
                todo = list(range(n))
            else:
                todo = (rows < 0).nonzero()[0].tolist()
            tk = keys if len(todo) == n else [keys[i] for i in todo]
            if len(set(tk)) < len(tk):
                seen: set = set()  # a key given twice in one call: its later copies exist already
                uniq = []
                for i in todo:
                    if keys[i] in seen:
                        plan.statuses[i] = Status.EXISTS
                    else:
                        seen.add(keys[i])
                        uniq.append(i)
                todo = uniq
                tk = [keys[i] for i in todo]
            if todo:
                new = self._new_rows(tk, nid, np.asarray(todo, dtype=np.int64) + first_position, hint_i, now).tolist()
                if len(todo) == n:
                    plan.rows = new
                else:
                    for i, r in zip(todo, new):
                        plan.rows[i] = r
                if self.config.verify_tokens and tokens is not None:
                    for i, r in zip(todo, new):
                        self._tokens[r] = np.asarray(tokens[i], dtype=np.int64).copy()
                if self.config.write_policy == "write_through":
                    self._place_write_through(plan, todo, now)
                else:
                    self._place_write_back(plan, todo, now)
            self._pending_plans += 1
            if n - len(todo):
                self.metrics.inc("store_exists", sum(1 for s in plan.statuses if s is Status.EXISTS))
        return plan

    def _place_write_back(self, plan: StorePlan, todo: list[int], now: float) -> None:
        left = todo
        for t in self.tiers:
            if not left:
                break
            if t == Tier.NVME:
                for i in left:
                    plan.nvme_new.append((i, self._nvme_lifetime(plan.rows[i], plan.keys[i], now)))
                left = []
                break
            slots = self._reserve(t, len(left), plan, None, now)
            plan.memory.extend(zip(left, itertools.repeat(t), slots))
            left = left[len(slots):]
        if left:  # fits nowhere: this block and the rest of the chain
            self._refuse(plan, left)

    def _place_write_through(self, plan: StorePlan, todo: list[int], now: float) -> None:
        for i in todo:
            plan.nvme_new.append((i, self._nvme_lifetime(plan.rows[i], plan.keys[i], now)))
        left = todo
        for t in MEMORY_TIERS:  # cache a copy where room is free or cheap (victims with a lower copy)
            if t not in self._alloc or not left:
                continue
            slots = self._reserve(t, len(left), plan, None, now, cheap_only=True)
            plan.memory.extend(zip(left, itertools.repeat(t), slots))
            left = left[len(slots):]

    def _refuse(self, plan: StorePlan, idx: list[int]) -> None:
        first = min(idx)
        for i in range(first, len(plan.keys)):
            if plan.statuses[i] is None:
                plan.statuses[i] = Status.NO_SPACE
                if plan.rows[i] >= 0:
                    self._drop_new_row(plan.rows[i])
                    plan.rows[i] = -1
        plan.memory = [m for m in plan.memory if plan.statuses[m[0]] is None]
        plan.nvme_new = [m for m in plan.nvme_new if plan.statuses[m[0]] is None]
        self.metrics.inc("store_no_space", len(plan.keys) - first - sum(
            1 for s in plan.statuses[first:] if s is Status.EXISTS))

    def _drop_new_row(self, row: int) -> None:
        self._tokens.pop(row, None)
        self._table.remove_row(row)
        self._flags[row] = 0

    def _reserve(self, tier: Tier, n: int, plan: StorePlan, protect: set | None, now: float,
                 cheap_only: bool = False) -> list[int]:
        """Up to ``n`` slots of memory tier ``tier`` for ``plan``: free ones, then
        victims' (:meth:`_victimize`; a batch of ``evict_batch_blocks`` at least,
        so demotions to NVMe go out together). ``protect``: keys never to take
        as victims; ``None`` is the plan's own keys (and victims chosen so far)."""
        slots = self._alloc[tier].take(n)
        need = n - len(slots)
        if need <= 0:
            return slots
        if protect is None:
            if plan.protect is None:
                plan.protect = set(plan.keys)
            protect = plan.protect
        vrows = self._victimize(tier, need, plan, protect, now, cheap_only,
                                batch=1 if cheap_only else self.config.evict_batch_blocks)
        given = [int(self._slot[tier][r]) for r in vrows[:need]]
        plan.given.update((tier, s) for s in given)
        return slots + given

    def _victimize(self, tier: Tier, n: int, plan: StorePlan, protect: set, now: float,
                   cheap_only: bool = False, batch: int = 1) -> list[int]:
        """Choose ``n`` (up to ``max(n, batch)``) victims in ``tier`` and decide each
        one's fate: dropped when it has a lower copy, else demoted to the next
        memory tier (recursively making room there) or to NVMe (if admitted),
        else lost. Every victim's slot is freed (or given on) when ``plan``
        completes. Returns the victims' rows (fewer than ``n`` when fewer are
        evictable)."""
        policy = self.policies[tier]
        prot = self._protector(protect, now)
        lower = self._lower_memory(tier)
        scan = None
        if cheap_only and lower is None:  # no NVMe writes: only victims with a lower copy
            prot = lambda k, p=prot: p(k) or not self._has_lower_copy(self._table.get(k), tier)  # noqa: E731
            scan = self.CHEAP_SCAN_BLOCKS  # among the coldest few (a full scan per promotion was O(tier))
        want = max(n, batch)
        victims = policy.evict(want, prot, now, max_scan=scan) if want > n else []
        if not victims:
            victims = policy.evict(n, prot, now, max_scan=scan)
        if not victims:  # fewer than n evictable: take them one at a time (partial)
            taken: set = set()
            one = lambda k: prot(k) or k in taken  # noqa: E731
            while len(victims) < n:
                v = policy.evict(1, one, now, max_scan=None if scan is None else scan + len(taken))
                if not v:
                    break
                taken.add(v[0])
                victims.append(v[0])
        if not victims:
            return []
        vrows = [self._table.get(k) for k in victims]
        demote: list[tuple[int, bytes]] = []
        for k, r in zip(victims, vrows):
            self._flags[r] |= _EVICT[tier]
            protect.add(k)
            if not self._has_lower_copy(r, tier):
                demote.append((r, k))
        if demote and lower is not None:
            dst = self._reserve(lower, len(demote), plan, protect, now, cheap_only)
            for (r, k), s in zip(demote, dst):
                plan.copies.append(Demotion(r, k, tier, int(self._slot[tier][r]), lower, s))
            demote = demote[len(dst):]
            if cheap_only and demote:  # these would need NVMe writes: they stay where they are
                back = {r for r, _ in demote}
                for r, k in demote:
                    self._flags[r] &= 0xFF ^ _EVICT[tier]
                    protect.discard(k)
                vrows = [r for r in vrows if r not in back]
                demote = []
        self.metrics.inc(f"evictions_{tier.label}", len(vrows))
        for r in vrows:
            plan.frees.append((r, tier, int(self._slot[tier][r])))
        if demote and Tier.NVME in self.tiers:
            admit = self.config.admit_to_nvme
            for r, k in demote:
                if admit is not None and not admit(self._view(r, k)):
                    self._rejected[k] = None
                    self.metrics.add({"admission_rejected_blocks": 1,
                                      "admission_rejected_bytes": self.block_bytes})
                    if self.config.remote_victims:
                        plan.lost.append((k, tier, int(self._slot[tier][r])))
                    continue
                self._flags[r] |= _NVME_WRITING
                plan.nvme_demote.append(Demotion(r, k, tier, int(self._slot[tier][r]), Tier.NVME, -1,
                                                 self._nvme_lifetime(r, k, now), self._ns_list[int(self._ns[r])]))
            while len(self._rejected) > self.REJECTED_KEYS_MAX:
                self._rejected.pop(next(iter(self._rejected)))
        elif demote and self.config.remote_victims:
            plan.lost.extend((k, tier, int(self._slot[tier][r])) for r, k in demote)
        return vrows

    def prepare_evict(self, tier: Tier, n: int) -> StorePlan | None:
        """Plan the eviction of ``n`` unprotected blocks of memory tier ``tier``
        now (demoted like any victim; all or nothing). ``None`` if ``n`` such
        blocks do not exist. Execute it like a store plan."""
        if tier not in self._alloc or n <= 0:
            return None
        with self._lock:
            plan = StorePlan([], [], [])
            if not self._victimize(tier, n, plan, set(), self._now()):
                return None
            self._pending_plans += 1
            return plan

    def complete_store(self, plan: StorePlan, nvme_statuses: dict[int, Status] | None = None,
                       demote_statuses: dict[int, Status] | None = None, failed: bool = False) -> list[Status]:
        """Apply a store's outcome (phase two).

        Parameters
        ----------
        plan : StorePlan
        nvme_statuses : dict, optional
            ``i -> Status`` of each ``plan.nvme_new`` write.
        demote_statuses : dict, optional
            ``row -> Status`` of each ``plan.nvme_demote`` write.
        failed : bool
            The mover raised. The new blocks are forgotten. What happened to the
            victims depends on how far the mover got (``plan.moved``): before
            its NVMe batch, nothing happened and they keep their copies; after
            it, their NVMe writes count (``plan.demote_statuses``) and they
            leave their tier, since later copies may have overwritten their
            slots; their copies down into memory count only if the mover
            finished them. A miss, never wrong KV.

        Returns
        -------
        list of Status
            Per key: ``OK``, ``EXISTS``, ``NO_SPACE`` or ``IO_ERROR``.
        """
        nvme_statuses = nvme_statuses or {}
        demote_statuses = demote_statuses or {}
        now = self._now()
        with self._lock:
            if plan.done:
                raise InvariantError("complete_store called twice for one plan")
            plan.done = True
            self._pending_plans -= 1
            if failed:
                if plan.moved == StorePlan.NOTHING_DONE:
                    self._undo_store(plan)
                else:
                    c = {"store_failed_midway": 1}
                    self._apply_victims(plan, now, c, plan.demote_statuses,
                                        copies_done=plan.moved >= StorePlan.COPIES_DONE)
                    self._forget_new(plan)
                    self.metrics.add(c)
                self._idle.notify_all()
                return [s if s is not None else Status.IO_ERROR for s in plan.statuses]
            c: dict = {}
            self._apply_victims(plan, now, c, demote_statuses)
            # 4. the new blocks
            self._complete_new(plan, dict(nvme_statuses), now, c)
            self.metrics.add(c)
            self._idle.notify_all()
            return list(plan.statuses)

    def _complete_new(self, plan: StorePlan, nv: dict, now: float, c: dict) -> None:
        """Make a plan's new blocks visible (or forget them): the common case
        vectorised, failures and doomed rows one by one."""
        pending = plan.pending
        if not pending:
            return
        failed_from = min((i for i in pending if i in nv and nv[i] not in (Status.OK, Status.EXISTS)),
                          default=None) if nv else None
        prows = [plan.rows[i] for i in pending]
        if failed_from is None and not (self._flags[prows] & _DOOMED).any():
            good = pending
        else:
            good = self._complete_failed(plan, pending, nv, failed_from, c)
            if not good:
                return
        in_good = None if len(good) == len(pending) else set(good)
        bb = self.block_bytes
        in_mem: set | None = set() if nv else None
        for t in MEMORY_TIERS:
            sel = [(i, s_) for i, tt, s_ in plan.memory if tt == t and (in_good is None or i in in_good)]
            if not sel:
                continue
            rows = [plan.rows[i] for i, _ in sel]
            self._slot[t][rows] = [s_ for _, s_ in sel]
            self._flags[rows] |= _IN[t]
            kt = [plan.keys[i] for i, _ in sel]
            self.policies[t].on_insert_many(kt, lambda j, kt=kt, rows=rows: EntryView(self, rows[j], kt[j]), now)
            if in_mem is not None:
                in_mem.update(i for i, _ in sel)
            c[_STORE_COUNTER[t]] = c.get(_STORE_COUNTER[t], 0) + len(sel) * bb
        rows_good = [plan.rows[i] for i in good]
        self._flags[rows_good] &= 0xFF ^ _PENDING
        if nv:
            on_nvme = [i for i in good if i in nv]
            if on_nvme:
                self._flags[[plan.rows[i] for i in on_nvme]] |= _ON_NVME
                self._nvme_at[[plan.rows[i] for i in on_nvme]] = now
                c["nvme_write_bytes"] = c.get("nvme_write_bytes", 0) + len(on_nvme) * bb
                only = sum(1 for i in on_nvme if i not in in_mem)
                if only:
                    c["store_bytes_nvme"] = c.get("store_bytes_nvme", 0) + only * bb
        if self._rejected:
            for i in good:
                self._rejected.pop(plan.keys[i], None)
        if self.record_events:
            mem = {i: t for i, t, _ in plan.memory}
            for i in good:
                self._event("stored", plan.keys[i], mem.get(i, Tier.NVME))
        st = plan.statuses
        for i in good:
            st[i] = Status.OK
        c["store_ok"] = c.get("store_ok", 0) + len(good)

    def _complete_failed(self, plan: StorePlan, pending: list[int], nv: dict, failed_from: int | None,
                         c: dict) -> list[int]:
        """:meth:`_complete_new` when a write failed or a row was doomed meanwhile:
        forget the failed blocks (and the rest of the chain after the first
        failure), free doomed rows. Returns the indices still to make visible."""
        mem = {i: (t, s) for i, t, s in plan.memory}
        good: list[int] = []
        for i in pending:
            r = plan.rows[i]
            doomed = bool(self._flags[r] & _DOOMED)
            ok = failed_from is None or i < failed_from
            if i in nv and nv[i] not in (Status.OK, Status.EXISTS):
                plan.statuses[i] = nv[i]
                ok = False
            elif not ok:
                plan.statuses[i] = Status.NO_SPACE
            if ok and not doomed:
                good.append(i)
                continue
            if i in mem:
                t, s_ = mem[i]
                self._alloc[t].give(s_)
            if doomed:
                plan.statuses[i] = plan.statuses[i] or Status.OK
                self._doomed.discard(r)
                self._release_row(r)
            else:
                self._drop_new_row(r)
            name = "store_failed" if not ok else "store_doomed"
            c[name] = c.get(name, 0) + 1
        return good

    def _apply_victims(self, plan: StorePlan, now: float, c: dict, demote_statuses: dict | None = None,
                       copies_done: bool = True) -> None:
        """Record what happened to a plan's victims (under the lock): written to
        NVMe (by ``demote_statuses``), copied down into memory (if
        ``copies_done``; else their destination slots are freed), and gone
        from the tier they were evicted from."""
        demote_statuses = demote_statuses or {}
        # 1. victims written to NVMe
        for d in plan.nvme_demote:
            self._flags[d.row] &= 0xFF ^ _NVME_WRITING
            st = demote_statuses.get(d.row, Status.IO_ERROR)
            if st in (Status.OK, Status.EXISTS):
                self._flags[d.row] |= _ON_NVME
                self._nvme_at[d.row] = now
                c[f"demotions_{d.src.label}_nvme"] = c.get(f"demotions_{d.src.label}_nvme", 0) + 1
                c["nvme_write_bytes"] = c.get("nvme_write_bytes", 0) + self.block_bytes
                self._event("demoted", d.key, Tier.NVME)
            else:
                c[f"nvme_put_{st.value}"] = c.get(f"nvme_put_{st.value}", 0) + 1
        # 2. victims copied down into memory
        for d in (plan.copies if copies_done else ()):
            self._set_slot(d.row, d.dst, d.dst_slot)
            self.policies[d.dst].on_insert(self._view(d.row, d.key), now)
            c[f"demotions_{d.src.label}_{d.dst.label}"] = c.get(f"demotions_{d.src.label}_{d.dst.label}", 0) + 1
            self._event("demoted", d.key, d.dst)
        if not copies_done:  # each destination was a free slot or a victim's (given): free it
            for d in plan.copies:
                self._alloc[d.dst].give(d.dst_slot)
        # 3. victims leave their tier
        given = plan.given
        for r, t, s in plan.frees:
            self._flags[r] &= 0xFF ^ _EVICT[t]
            key = self._table.key_of(r)
            self.policies[t].on_remove(key)
            if self._slot[t][r] == s:
                self._set_slot(r, t, -1)
            if (t, s) not in given:
                self._alloc[t].give(s)
            self._event("removed", key, t)
            self._forget_if_empty(r, key)

    def _forget_new(self, plan: StorePlan) -> None:
        """A failed plan's new blocks: their memory slots (fresh or a victim's) go
        back to the free lists, their rows are dropped."""
        mem = {i: (t, s) for i, t, s in plan.memory}
        for i in plan.pending:
            if i in mem:
                t, s = mem[i]
                self._alloc[t].give(s)
            r = plan.rows[i]
            if r >= 0:
                if self._flags[r] & _DOOMED:
                    self._doomed.discard(r)
                    self._release_row(r)
                else:
                    self._drop_new_row(r)
            plan.statuses[i] = Status.IO_ERROR

    def _undo_store(self, plan: StorePlan) -> None:
        """The mover failed before anything was applied: release the plan's reservations."""
        given = plan.given
        for d in plan.nvme_demote:
            self._flags[d.row] &= 0xFF ^ _NVME_WRITING
        for r, t, s in plan.frees:
            self._flags[r] &= 0xFF ^ _EVICT[t]
        mem = {i: (t, s) for i, t, s in plan.memory}
        for d in plan.copies:
            if (d.dst, d.dst_slot) not in given:
                self._alloc[d.dst].give(d.dst_slot)
        for i in plan.pending:
            if i in mem:
                t, s = mem[i]
                if (t, s) not in given:
                    self._alloc[t].give(s)
            r = plan.rows[i]
            if r >= 0:
                if self._flags[r] & _DOOMED:
                    self._doomed.discard(r)
                    self._release_row(r)
                else:
                    self._drop_new_row(r)
            plan.statuses[i] = Status.IO_ERROR

    def abort_store(self, plan: StorePlan) -> None:
        """Release a prepared store that will not be executed (nothing leaks)."""
        if not plan.done:
            self.complete_store(plan, failed=True)

    def _forget_if_empty(self, row: int, key: bytes) -> None:
        """Drop the row when no copy is left (and nobody uses it)."""
        f = int(self._flags[row])
        if f & (_PENDING | _NVME_WRITING):
            return
        if self._slot[Tier.HBM][row] >= 0 or self._slot[Tier.HOST][row] >= 0 or f & _ON_NVME:
            return
        self.metrics.inc("dropped_blocks")
        self._event("dropped", key)
        if self._refs[row] > 0 or self._readers[row] > 0:
            self._doom(row, key)
            return
        self._tokens.pop(row, None)
        self._table.remove(key)
        self._flags[row] = 0

    def _doom(self, row: int, key: bytes) -> None:
        """Hide ``row`` now; its memory is freed when its last user goes."""
        if self._flags[row] & _DOOMED:
            return
        self._flags[row] |= _DOOMED
        self._table.detach(key)
        self._doomed.add(row)

    def _release_row(self, row: int) -> None:
        """Free a doomed row's memory slots and the row itself."""
        for t in MEMORY_TIERS:
            s = int(self._slot[t][row])
            if s >= 0 and not self._flags[row] & _EVICT[t]:
                self._alloc[t].give(s)
                self._set_slot(row, t, -1)
        self._tokens.pop(row, None)
        self._flags[row] = 0
        self._table.release_row(row)

    def _maybe_free_doomed(self, row: int) -> None:
        if (row in self._doomed and self._refs[row] == 0 and self._readers[row] == 0
                and not self._flags[row] & (_PENDING | _NVME_WRITING | _EVICT_HBM | _EVICT_HOST)):
            self._doomed.discard(row)
            self._release_row(row)
            self._idle.notify_all()

    # ================================================================ load
    def prepare_load(self, keys: Sequence[bytes]) -> LoadPlan:
        """Choose each key's source copy and hold it (phase one of a load).

        ``sources[i]`` is ``(tier, slot)``; ``None`` for a key not resident.
        Each held row is never a victim until :meth:`complete_load`.
        """
        with self._lock:
            rows = self._table.get_many(keys).tolist()
            plan = LoadPlan(list(keys), rows, [])
            for i, r in enumerate(rows):
                t = self._top(r) if r >= 0 else None
                if t is None:
                    plan.sources.append(None)
                    rows[i] = -1
                    continue
                self._readers[r] += 1
                plan.sources.append((t, int(self._slot[t][r]) if t != Tier.NVME else -1))
                if t == Tier.NVME:
                    ev = self._reading.get(r)
                    if ev is not None:
                        plan.waits.append(ev)
                    else:
                        self._reading[r] = threading.Event()
                        plan.leads.append(r)
            self._pending_plans += 1
            return plan

    def abort_load(self, plan: LoadPlan) -> None:
        """Release a prepared load that moved nothing (no metrics are counted)."""
        with self._lock:
            if plan.done:
                raise InvariantError("load plan completed twice")
            plan.done = True
            self._pending_plans -= 1
            for r, src in zip(plan.rows, plan.sources):
                if src is not None:
                    self._readers[r] -= 1
                    self._maybe_free_doomed(r)
            self._end_reads(plan)
            self._idle.notify_all()

    def _end_reads(self, plan: LoadPlan) -> None:
        for r in plan.leads:
            ev = self._reading.pop(r, None)
            if ev is not None:
                ev.set()

    def complete_load(self, plan: LoadPlan, statuses: Sequence[Status], promote: bool = True,
                      nvme_s: float | None = None) -> PromotePlan | None:
        """Release a load's holds and record its outcome (phase two).

        Parameters
        ----------
        plan : LoadPlan
        statuses : sequence of Status
            Per key, what the mover delivered (``OK``, ``MISS``, ``IO_ERROR``).
        promote : bool
            Whether to plan copies of loaded blocks into a faster memory tier.
        nvme_s : float, optional
            Seconds the NVMe part took (feeds the cost model's bandwidth).

        Returns
        -------
        PromotePlan or None
            Copies the mover makes from the loaded bytes, then passes to
            :meth:`complete_promote`.
        """
        now = self._now()
        with self._lock:
            if plan.done:
                raise InvariantError("complete_load called twice for one plan")
            plan.done = True
            self._pending_plans -= 1
            c: dict = {}
            lead = 0
            for s in statuses:
                if s is not Status.OK:
                    break
                lead += 1
            nvme_ok = 0
            promos: list = []
            for i, (r, src, st) in enumerate(zip(plan.rows, plan.sources, statuses)):
                if src is None:
                    continue
                self._readers[r] -= 1
                if self._readers[r] < 0:
                    raise InvariantError("readers went negative")
                t = src[0]
                c[f"load_bytes_{t.label}"] = c.get(f"load_bytes_{t.label}", 0) + self.block_bytes
                if st is Status.OK:
                    if t == Tier.NVME:
                        nvme_ok += 1
                    if promote and t != Tier.HBM and not self._flags[r] & _DOOMED:
                        promos.append((i, r, t))
                elif st is Status.IO_ERROR:
                    c["io_errors"] = c.get("io_errors", 0) + 1
                    if t == Tier.NVME and self._flags[r] & _ON_NVME:
                        self._flags[r] &= 0xFF ^ _ON_NVME  # never serve it again
                        self._forget_if_empty(r, plan.keys[i])
                self._maybe_free_doomed(r)
            # Metrics count the leading run only: that is what the engine uses.
            c["loaded_blocks"] = lead
            c["reused_tokens"] = lead * self.tokens_per_block
            c["nvme_read_bytes"] = nvme_ok * self.block_bytes
            self.metrics.add(c)
            if nvme_s is not None and nvme_ok:
                self.config.cost.observe_load("nvme", nvme_ok * self.block_bytes, nvme_s, nvme_ok)
            self._idle.notify_all()
            promo = None
            if promos and self.config.promotion != "none":
                promo = self._plan_promotions(promos, now)
            if promo is None:
                self._end_reads(plan)
            else:  # followers wait until the promoted copies are in place
                promo.leads = plan.leads
            return promo

    def _plan_promotions(self, promos: list, now: float) -> PromotePlan | None:
        """Reserve faster slots for just-loaded blocks. A promotion never writes
        to NVMe: it takes a free slot, or a victim's that has a lower copy or
        fits in the next memory tier (that copy is part of the plan)."""
        plan = PromotePlan([])
        protect = {self._table.key_of(r) for _, r, _ in promos}
        full: set = set()  # tiers where no slot was found: later blocks of this call skip them
        for i, r, src in promos:
            upper = [t for t in self._alloc if t < src and self._slot[t][r] < 0]
            if not upper:
                continue
            dst = upper[0] if self.config.promotion == "top" else upper[-1]
            got = [] if dst in full else self._reserve(dst, 1, plan.victims, protect, now, cheap_only=True)
            if not got:
                # every candidate victim is dirty (lives only in memory): ask for a
                # background clean so that later promotions find clean victims. The
                # search is not repeated for the rest of this load (under the lock,
                # each one scans the tier's policy order: it was O(tier) per block)
                full.add(dst)
                self._clean_wanted += 1
                continue
            self._readers[r] += 1  # held until the copy lands
            plan.items.append((i, r, dst, got[0]))
        if not plan.items and not plan.victims.frees:
            return None
        self._pending_plans += 1
        return plan

    def prepare_prefetch(self, keys: Sequence[bytes], target: Tier) -> PromotePlan | None:
        """Plan copies of resident blocks up to memory tier ``target`` (a prefetch).

        Blocks already in ``target`` or faster are skipped; a slot is taken
        only if free or held by a block with a lower copy (no cascade). The
        sources are held until :meth:`complete_promote`.

        Raises
        ------
        ConfigError
            If ``target`` is not an enabled memory tier.
        """
        if target not in self._alloc:
            raise ConfigError(f"prefetch target {Tier(target).label!r}: accepted values are "
                              f"{[t.label for t in self._alloc]} (enabled memory tiers)")
        now = self._now()
        with self._lock:
            rows = self._table.get_many(keys).tolist()
            plan = PromotePlan([], keys=list(keys))
            protect = set(keys)
            for i, r in enumerate(rows):
                top = self._top(r) if r >= 0 else None
                if top is None or top <= target or self._slot[target][r] >= 0:
                    continue
                got = self._reserve(target, 1, plan.victims, protect, now, cheap_only=True)
                if not got:
                    break
                self._readers[r] += 1
                plan.items.append((i, r, target, got[0]))
                plan.sources.append((top, int(self._slot[top][r]) if top != Tier.NVME else -1))
            if not plan.items and not plan.victims.frees:
                return None
            self._pending_plans += 1
            return plan

    def complete_promote(self, plan: PromotePlan, ok: Sequence[bool]) -> None:
        """Apply promotions: ``ok[j]`` says whether item ``j``'s copy landed
        (the victims' copies down, executed first, always did)."""
        now = self._now()
        with self._lock:
            if plan.done:
                raise InvariantError("complete_promote called twice for one plan")
            plan.done = True
            self._pending_plans -= 1
            c: dict = {}
            self._apply_victims(plan.victims, now, c, copies_done=plan.victims.moved >= StorePlan.COPIES_DONE)
            self._end_reads(plan)
            for (i, r, t, s), good in zip(plan.items, ok):
                self._readers[r] -= 1
                if good and not self._flags[r] & _DOOMED and self._slot[t][r] < 0:
                    self._set_slot(r, t, s)
                    key = self._table.key_of(r)
                    self.policies[t].on_insert(self._view(r, key), now)
                    src = "host" if self._slot[Tier.HOST][r] >= 0 and t == Tier.HBM else "nvme"
                    c[f"promotions_{src}_{t.label}"] = c.get(f"promotions_{src}_{t.label}", 0) + 1
                    self._event("promoted", key, t)
                else:
                    self._alloc[t].give(s)
                self._maybe_free_doomed(r)
            self.metrics.add(c)
            self._idle.notify_all()

    # ================================================================ NVMe listener
    def on_reclaim(self, keys: list[bytes]) -> list[bool]:
        """Which blocks of an NVMe region being evicted to keep (copy forward):
        those in use, pinned, being read or written, and those the reinsertion
        policy predicts will be reused. Changes nothing else than the NVMe write
        time of the blocks the policy keeps (they are copied forward now)."""
        now = self._now()
        reinsert = self.config.reinsert
        with self._lock:
            rows = self._table.get_many(keys).tolist()
            out = []
            for k, r in zip(keys, rows):
                if r < 0:
                    out.append(False)
                    continue
                keep = self._protected_row(r, now) and not self._flags[r] & _DOOMED
                if not keep and reinsert is not None:
                    keep = bool(reinsert(self._view(r, k), now))
                    if keep:  # copied forward now: its reference bit restarts
                        self._nvme_at[r] = now
                out.append(keep)
            return out

    def on_dropped(self, keys: list[bytes]) -> None:
        """Blocks left the NVMe tier (region evicted or corrupt)."""
        with self._lock:
            rows = self._table.get_many(keys).tolist()
            n = 0
            for k, r in zip(keys, rows):
                if r < 0 or not self._flags[r] & _ON_NVME:
                    continue
                self._flags[r] &= 0xFF ^ _ON_NVME
                n += 1
                self._event("removed", k, Tier.NVME)
                self._forget_if_empty(r, k)
            self.metrics.add({"evictions_nvme": n})

    def adopt_nvme(self, keys: Sequence[bytes], nss: Sequence[bytes]) -> int:
        """Index blocks a persistent NVMe tier recovered at start-up. Returns blocks adopted."""
        now = self._now()
        with self._lock:
            n = 0
            for k, ns in zip(keys, nss):
                row, new = self._table.add(k)
                if not new:
                    continue
                if row >= self._flags.size - 1:
                    self._grow()
                self._flags[row] = _ON_NVME
                self._nvme_at[row] = now
                self._slot[Tier.HBM][row] = -1
                self._slot[Tier.HOST][row] = -1
                self._ns[row] = self._intern(ns)
                self._pos[row] = -1
                self._hits[row] = 0
                self._created[row] = now
                self._last[row] = now
                self._refs[row] = 0
                self._readers[row] = 0
                self._pin_until[row] = 0.0
                self._hint[row] = _NO_HINT
                self._nvme_class[row] = _NO_HINT
                n += 1
            return n

    # ================================================================ flush (clean shutdown)
    def take_clean_requests(self) -> int:
        """Blocks the index would like cleaned (written to NVMe) in the background, and reset."""
        with self._lock:
            n, self._clean_wanted = self._clean_wanted, 0
            return n

    def prepare_flush(self, max_blocks: int, coldest_first: bool = False) -> StorePlan | None:
        """Plan NVMe writes of up to ``max_blocks`` blocks that live only in memory.

        Used at a clean shutdown so that a restart finds them, and in the
        background to keep clean victims for promotions (``coldest_first``:
        least recently used first). Returns ``None`` when nothing is left to write.
        Each block is read from a readable memory copy (host first); a block whose
        only memory copy is a victim of a store in flight is skipped.
        """
        if Tier.NVME not in self.tiers:
            return None
        now = self._now()
        with self._lock:
            rows = self._table.rows()
            if not rows.size:
                return None
            f = self._flags[rows]
            # only a readable copy is a source: a copy being evicted (_EVICT_*) belongs to a store
            # plan in flight, which hands its slot on (to a new block, or to a victim moving down)
            # and overwrites it without the lock; gathered from there, another block's bytes would
            # be written to NVMe under this key, with a valid checksum. Such a row is skipped: its
            # plan decides its fate (moved down, written to NVMe, or dropped and counted).
            mem = (((self._slot[Tier.HBM][rows] >= 0) & ((f & _EVICT_HBM) == 0))
                   | ((self._slot[Tier.HOST][rows] >= 0) & ((f & _EVICT_HOST) == 0)))
            rows = rows[mem & ((f & (_ON_NVME | _PENDING | _DOOMED | _NVME_WRITING)) == 0)]
            if coldest_first:
                rows = rows[np.argsort(self._last[rows], kind="stable")]
            rows = rows[:max_blocks]
            if not rows.size:
                return None
            plan = StorePlan([], [], [])
            for r in rows.tolist():
                key = self._table.key_of(r)
                t = Tier.HOST if self._readable(r, Tier.HOST) else Tier.HBM
                self._flags[r] |= _NVME_WRITING
                self._readers[r] += 1
                plan.nvme_demote.append(Demotion(r, key, t, int(self._slot[t][r]), Tier.NVME, -1,
                                                 self._nvme_lifetime(r, key, now), self._ns_list[int(self._ns[r])]))
            self._pending_plans += 1
            return plan

    def complete_flush(self, plan: StorePlan, demote_statuses: dict[int, Status]) -> int:
        """Apply a flush; returns blocks now on NVMe."""
        with self._lock:
            plan.done = True
            self._pending_plans -= 1
            n = 0
            for d in plan.nvme_demote:
                self._flags[d.row] &= 0xFF ^ _NVME_WRITING
                self._readers[d.row] -= 1
                if demote_statuses.get(d.row) in (Status.OK, Status.EXISTS):
                    self._flags[d.row] |= _ON_NVME
                    self._nvme_at[d.row] = self._now()
                    n += 1
                self._maybe_free_doomed(d.row)
            self.metrics.add({"flushed_blocks": n, "nvme_write_bytes": n * self.block_bytes})
            self._idle.notify_all()
            return n

    # ================================================================ references
    def release(self, request_id: object) -> int:
        """Drop every reference ``request_id`` holds. Unknown ids are a no-op."""
        with self._lock:
            rows = self._requests.pop(request_id, [])
            for r in rows:
                self._refs[r] -= 1
                if self._refs[r] < 0:
                    raise InvariantError("ref_count went negative")
                self._maybe_free_doomed(r)
            return len(rows)

    def cancel(self, request_id: object) -> int:
        """Abort a request: like :meth:`release`, counted as an abort."""
        self.metrics.inc("aborted_requests")
        return self.release(request_id)

    # ================================================================ pins
    def pin(self, ns: bytes, keys: Sequence[bytes], lease_s: float | None = None) -> Lease:
        """Hold resident blocks until the lease expires or :meth:`unpin`.

        Raises
        ------
        QuotaExceeded
            If the pin would exceed the namespace quota (nothing is pinned then).
        ConfigError
            For a non-positive lease.
        """
        lease_s = self.config.default_lease_s if lease_s is None else lease_s
        if lease_s <= 0:
            raise ConfigError(f"lease_s={lease_s}: must be > 0")
        with self._lock:
            self._expire_pins()
            rows = [r for r in self._table.get_many(keys).tolist() if r >= 0 and self._top(r) is not None]
            nbytes = len(rows) * self.block_bytes
            used = self._pinned_bytes.get(ns, 0)
            if used + nbytes > self.config.pin_quota_bytes:
                raise QuotaExceeded(f"pin of {nbytes} B would exceed the namespace quota "
                                    f"({used} of {self.config.pin_quota_bytes} B in use)")
            lid = next(self._lease_ids)
            exp = self._now() + lease_s
            for r in rows:
                self._row_pins.setdefault(r, {})[lid] = exp
                self._pin_until[r] = max(self._pin_until[r], exp)
            lease = Lease(lid, ns, self._table.keys_of(rows), exp, nbytes)
            self._leases[lid] = lease
            self._pinned_bytes[ns] = used + nbytes
            self.metrics.inc("pins")
            return lease

    def unpin(self, lease_id: int) -> bool:
        """End a lease early. Returns False for an unknown or expired lease."""
        with self._lock:
            return self._end_lease(lease_id)

    @property
    def leases(self) -> dict[int, Lease]:
        """Live leases by id (a copy)."""
        with self._lock:
            self._expire_pins()
            return dict(self._leases)

    def _end_lease(self, lease_id: int) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        for r in self._table.get_many(lease.keys).tolist():
            if r < 0:
                continue
            pins = self._row_pins.get(r)
            if pins is None:
                continue
            pins.pop(lease_id, None)
            if pins:
                self._pin_until[r] = max(pins.values())
            else:
                del self._row_pins[r]
                self._pin_until[r] = 0.0
        self._pinned_bytes[lease.ns] -= lease.bytes
        if self._pinned_bytes[lease.ns] < 0:
            raise InvariantError("pinned bytes went negative")
        return True

    def _expire_pins(self) -> None:
        now = self._now()
        for lid in [lid for lid, lease in self._leases.items() if lease.expiry_s <= now]:
            self._end_lease(lid)
            self.metrics.inc("pin_expired")

    # ================================================================ removal
    def invalidate(self, ns: bytes) -> int:
        """Hide every block of namespace ``ns`` now; in-use blocks are freed on
        release and in-flight stores of it are discarded when they complete.
        Waits until those stores are done, so that the caller's durable
        invalidation record follows them. Returns the blocks removed."""
        with self._lock:
            nid = self._ns_ids.get(ns)
            if nid is None:
                return 0
            rows = self._table.rows()
            rows = rows[self._ns[rows] == nid]
            keys = self._table.keys_of(rows.tolist())
            pending = []
            for r, k in zip(rows.tolist(), keys):
                if self._flags[r] & _PENDING:
                    self._flags[r] |= _DOOMED
                    self._table.detach(k)
                    self._doomed.add(r)
                    pending.append(r)
                else:
                    self._remove_row(r, k)
            for lid in [lid for lid, lease in self._leases.items() if lease.ns == ns]:
                self._end_lease(lid)
            while any(self._flags[r] & _PENDING and r in self._doomed for r in pending):
                self._idle.wait()
            return len(keys)

    def remove(self, keys: Iterable[bytes]) -> int:
        """Remove blocks by key (in-use blocks are hidden now and freed on release).

        Returns the number that were resident.
        """
        with self._lock:
            n = 0
            for k in keys:
                r = self._table.get(k)
                if r >= 0 and not self._flags[r] & _PENDING:
                    self._remove_row(r, k)
                    n += 1
            return n

    def clear(self) -> int:
        """Remove every block (in-use blocks are doomed and freed on release)."""
        with self._lock:
            rows = self._table.rows()
            keys = self._table.keys_of(rows.tolist())
            n = 0
            for r, k in zip(rows.tolist(), keys):
                if not self._flags[r] & _PENDING:
                    self._remove_row(r, k)
                    n += 1
            for lid in list(self._leases):
                self._end_lease(lid)
            return n

    def _remove_row(self, row: int, key: bytes) -> None:
        for t in MEMORY_TIERS:
            if self._slot[t][row] >= 0 and not self._flags[row] & _EVICT[t]:
                self.policies[t].on_remove(key)
        self._flags[row] &= 0xFF ^ _ON_NVME
        self._event("invalidated", key)
        if (self._refs[row] > 0 or self._readers[row] > 0
                or self._flags[row] & (_EVICT_HBM | _EVICT_HOST | _NVME_WRITING)):
            self._doom(row, key)
            return
        for t in MEMORY_TIERS:
            s = int(self._slot[t][row])
            if s >= 0:
                self._alloc[t].give(s)
                self._set_slot(row, t, -1)
        self._tokens.pop(row, None)
        self._table.remove(key)
        self._flags[row] = 0

    # ================================================================ introspection
    def state_of(self, key: bytes) -> BlockState | None:
        """Ownership state of a visible block, or ``None`` if not resident."""
        with self._lock:
            r = self._table.get(key)
            if r < 0 or self._top(r) is None:
                return None
            if self._refs[r] > 0:
                return BlockState.ACTIVE
            if self._pinned(r, self._now()):
                return BlockState.PINNED
            return BlockState.EVICTABLE

    def tiers_of(self, key: bytes) -> list[Tier]:
        """Tiers holding a readable copy of ``key`` (empty if not resident)."""
        with self._lock:
            r = self._table.get(key)
            if r < 0 or self._flags[r] & (_PENDING | _DOOMED):
                return []
            return [t for t in self.tiers if self._readable(r, t)]

    def references(self) -> dict[object, int]:
        """``request_id -> blocks referenced`` of every open request."""
        with self._lock:
            return {rid: len(rows) for rid, rows in self._requests.items()}

    def block_info(self, key: bytes) -> dict | None:
        """A visible block's index record as a dict, or ``None``."""
        with self._lock:
            r = self._table.get(key)
            if r < 0 or self._flags[r] & (_PENDING | _DOOMED):
                return None
            v = self._view(r, key)
            nc = int(self._nvme_class[r])
            return {"tiers": [t for t in self.tiers if self._readable(r, t)], "ref_count": v.ref_count,
                    "pinned": self._pinned(r, self._now()), "hits": v.hits, "position": v.position,
                    "created_s": v.created_s, "last_access_s": v.last_access_s, "namespace": v.ns,
                    "lifetime": v.lifetime, "nvme_lifetime": None if nc == _NO_HINT else LifetimeClass(nc)}

    def memory_slot(self, key: bytes, tier: Tier) -> int:
        """Slot of ``key`` in a memory tier, or -1."""
        with self._lock:
            r = self._table.get(key)
            return -1 if r < 0 else int(self._slot[tier][r])

    def __len__(self) -> int:
        return len(self._table)

    def resident_blocks(self) -> dict[str, int]:
        """Blocks with a copy in each tier."""
        with self._lock:
            out = {t.label: 0 for t in Tier}
            for t, a in self._alloc.items():
                out[t.label] = a.used
            rows = self._table.rows()
            out["nvme"] = int(((self._flags[rows] & _ON_NVME) != 0).sum())
            return out

    def bytes_per_tier(self) -> dict[str, int]:
        """Resident bytes per tier."""
        return {k: v * self.block_bytes for k, v in self.resident_blocks().items()}

    def namespaces(self) -> dict[bytes, int]:
        """Visible blocks per namespace digest."""
        with self._lock:
            rows = self._table.rows()
            ok = (self._flags[rows] & (_PENDING | _DOOMED)) == 0
            ids, counts = np.unique(self._ns[rows[ok]], return_counts=True)
            return {self._ns_list[int(i)]: int(c) for i, c in zip(ids, counts)}

    def keys_of_namespace(self, ns: bytes) -> list[bytes]:
        """Visible keys of namespace ``ns``."""
        with self._lock:
            nid = self._ns_ids.get(ns)
            if nid is None:
                return []
            rows = self._table.rows()
            rows = rows[(self._ns[rows] == nid) & ((self._flags[rows] & (_PENDING | _DOOMED)) == 0)]
            return self._table.keys_of(rows.tolist())

    def nbytes(self) -> int:
        """Bytes of per-block metadata (key table and row arrays)."""
        arrays = [self._flags, self._ns, self._pos, self._hits, self._created, self._last, self._refs,
                  self._readers, self._pin_until, self._hint, self._nvme_class, self._nvme_at, *self._slot.values()]
        return self._table.nbytes + sum(a.nbytes for a in arrays)

    def in_flight(self) -> int:
        """Prepared plans not yet completed."""
        with self._lock:
            return self._pending_plans

    def check_invariants(self, quiescent: bool = False) -> None:
        """Verify that slots, policies, references and flags agree.

        Parameters
        ----------
        quiescent : bool
            Also require that no plan is in flight and nothing is held:
            no readers, no pending or evicting rows, no doomed rows.

        Raises
        ------
        InvariantError
        """
        with self._lock:
            rows = self._table.rows()
            live = np.concatenate([rows, np.asarray(sorted(self._doomed), dtype=np.int64)])
            for t, alloc in self._alloc.items():
                sl = self._slot[t][live]
                held = sl[sl >= 0]
                if len(set(held.tolist())) != held.size:
                    raise InvariantError(f"{t.label}: two rows share a slot")
                if quiescent and held.size != alloc.used:
                    raise InvariantError(f"{t.label}: {alloc.used} slots used, {held.size} held by rows")
                if alloc.used < held.size:
                    raise InvariantError(f"{t.label}: {held.size} slots held, only {alloc.used} allocated")
                n = int(((self._slot[t][rows] >= 0) & ((self._flags[rows] & _PENDING) == 0)).sum())
                if quiescent and len(self.policies[t]) != n:
                    raise InvariantError(f"{t.label}: policy tracks {len(self.policies[t])}, {n} resident")
            for t in MEMORY_TIERS:
                if ((self._slot[t][live] >= 0) != ((self._flags[live] & _IN[t]) != 0)).any():
                    raise InvariantError(f"{t.label}: slot and residency flag disagree")
            if self._flags[-1]:
                raise InvariantError("the spare flags element (absent rows) was written")
            if (self._refs[live] < 0).any() or (self._readers[live] < 0).any():
                raise InvariantError("negative reference or reader count")
            counts: dict[int, int] = {}
            for lst in self._requests.values():
                for r in lst:
                    counts[r] = counts.get(r, 0) + 1
            for r in live.tolist():
                if counts.get(r, 0) != int(self._refs[r]):
                    raise InvariantError(f"row {r}: ref_count {int(self._refs[r])} != {counts.get(r, 0)} references")
            for r in rows.tolist():
                if self._flags[r] & _DOOMED:
                    raise InvariantError(f"row {r} is doomed but still indexed")
            if quiescent:
                if self._pending_plans:
                    raise InvariantError(f"{self._pending_plans} plans in flight")
                busy = self._flags[rows] & (_PENDING | _EVICT_HBM | _EVICT_HOST | _NVME_WRITING)
                if busy.any() or (self._readers[rows] > 0).any():
                    raise InvariantError("rows still held by plans")
                if self._doomed and not any(self._refs[r] > 0 for r in self._doomed):
                    raise InvariantError(f"{len(self._doomed)} doomed rows with no user left")
