"""The tier manager: block index, refcounts, pins, eviction, demotion and promotion.

Three tiers, fastest first: ``HBM`` (L1, a device block pool), ``HOST`` (L2, a
pinned host block pool) and ``NVME`` (L3, a :class:`~tierstore.tiers.storage.BlockStorage`).
An *entry* is one full block of KV, keyed by its 32-byte chained prefix hash
(:mod:`tierstore.identity`). An entry may have copies in several tiers; a
promotion copies upward and keeps the lower copy, so a later demotion of a block
that still has its NVMe copy writes nothing to flash.

Ownership and states
--------------------
*Residency* (the entry exists in >= 1 tier) is separate from *request
references*. ``ref_count`` counts requests that looked the block up with a
``request_id`` and have not released it. From these the state follows:

* ``ACTIVE``    -- ``ref_count > 0``: a request uses it.
* ``PINNED``    -- an unexpired pin lease holds it (and it is not ACTIVE).
* ``EVICTABLE`` -- neither.

A block that is ACTIVE, PINNED, or has I/O in flight is never chosen as a
victim in any tier. Existence probes (:meth:`TierManager.probe`) take no reference and do
not touch recency, so they never keep blocks from being evicted.

Eviction and demotion
---------------------
When a tier is full, its :class:`~tierstore.policies.base.EvictionPolicy` picks
victims (all or nothing). A victim that already has a copy in a lower tier just
drops this copy; otherwise it is demoted to the next tier (HBM -> host -> NVMe),
recursively making room there. Victims are taken in batches of
``evict_batch_blocks`` so NVMe writes go out as large batches. A block that no
lower tier can take leaves the cache (``dropped_blocks``).

Stores and lookups
------------------
A store that is already stored or in flight is idempotent (``Status.EXISTS``);
one duplicate never fails the rest of a batch. A store that finds no space
returns ``Status.NO_SPACE`` for that block and every later block of the same
chain (they would be unreachable), and never raises. A lookup walks the chain and
stops at the first miss. Concurrent loads of the same cold NVMe block share one
read (delay-hit merge).

Exact-hit rule: only full blocks are stored and matched; tokens of a partial tail
are recomputed and counted in ``partial_tail_tokens``.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import itertools
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Iterable, Sequence

import numpy as np
import torch

from .errors import ConfigError, InvariantError, LayoutError, QuotaExceeded, Status
from .fdp.lifetime import LifetimeClass, class_from_hint
from .layout import KVLayout
from .metrics import Metrics
from .policies.base import EvictionPolicy, make_policy
from .policies.cost import CostModel
from .tiers.memory import BlockPool, cuda_available
from .tiers.storage import BlockStorage


class Tier(enum.IntEnum):
    """Tiers, fastest first."""

    HBM = 0
    HOST = 1
    NVME = 2

    @property
    def label(self) -> str:
        """Lower-case name used in metrics and the cost model."""
        return self.name.lower()


class BlockState(enum.Enum):
    """Derived ownership state of an entry."""

    ACTIVE = "active"
    PINNED = "pinned"
    EVICTABLE = "evictable"


@dataclasses.dataclass(eq=False)
class Entry:
    """One cached block. Internal to the manager; policies read the documented fields."""

    key: bytes
    ns: bytes
    position: int
    size_bytes: int
    slots: dict  # Tier -> slot index (memory tiers) or -1 (NVMe, keyed by hash)
    created_s: float
    last_access_s: float
    hits: int = 0
    ref_count: int = 0
    pins: dict = dataclasses.field(default_factory=dict)  # lease id -> expiry (s)
    io_inflight: int = 0
    lifetime: LifetimeClass | None = None
    tokens: np.ndarray | None = None
    load_future: Future | None = None
    doomed: bool = False  # invalidated while in use; freed on last release
    nvme_class: LifetimeClass | None = None  # class used when last written to NVMe

    def state(self, now_s: float) -> BlockState:
        if self.ref_count > 0:
            return BlockState.ACTIVE
        if any(exp > now_s for exp in self.pins.values()):
            return BlockState.PINNED
        return BlockState.EVICTABLE

    @property
    def top_tier(self) -> Tier:
        return min(self.slots)


@dataclasses.dataclass
class Lease:
    """A pin lease: blocks held resident until ``expiry_s`` or :meth:`TierManager.unpin`."""

    lease_id: int
    ns: bytes
    keys: list
    expiry_s: float
    bytes: int


@dataclasses.dataclass
class LookupResult:
    """Outcome of :meth:`TierManager.lookup`.

    Attributes
    ----------
    keys : list of bytes
        The matched leading keys (a prefix of the keys asked for).
    tiers : list of Tier
        Tier each matched block would be loaded from (its fastest copy).
    load_s : list of float
        Estimated seconds to load each matched block (cost model).
    useful_blocks : int
        Leading blocks worth loading (loading them beats recomputing).
    requested_blocks : int
        Full blocks asked for.
    tokens_per_block : int
        Block size in tokens.
    request_id : object or None
        The request holding references on the matched blocks, if any.
    """

    keys: list
    tiers: list
    load_s: list
    useful_blocks: int
    requested_blocks: int
    tokens_per_block: int
    request_id: object = None

    @property
    def matched_blocks(self) -> int:
        return len(self.keys)

    @property
    def matched_tokens(self) -> int:
        return len(self.keys) * self.tokens_per_block

    @property
    def useful_tokens(self) -> int:
        return self.useful_blocks * self.tokens_per_block

    @property
    def useful_keys(self) -> list:
        return self.keys[:self.useful_blocks]


@dataclasses.dataclass
class ManagerConfig:
    """Typed configuration of a :class:`TierManager`.

    Parameters
    ----------
    layout : KVLayout
        KV geometry; ``layout.bytes_per_block`` is every tier's slot size.
    hbm_bytes, host_bytes : int
        Capacities of the memory tiers (rounded down to whole blocks; 0 disables).
    device : str
        ``"auto"`` (cuda when present, else cpu stand-in), ``"cpu"`` or ``"cuda"``.
    promotion : str
        On a hit from a lower tier: ``"top"`` (copy to the fastest enabled tier),
        ``"one"`` (one tier up) or ``"none"``.
    eviction : str
        Eviction policy name per tier (see :func:`tierstore.policies.make_policy`).
    evict_batch_blocks : int
        Victims taken per eviction round (>= 1): batches demotions to NVMe.
    verify_tokens : bool
        Store token ids and compare them on lookup (defence against collisions).
    pin_quota_bytes : int
        Per-namespace cap on bytes held by pin leases.
    default_lease_s : float
        Pin lease when none is given.
    admit_to_nvme : callable or None
        ``f(entry) -> bool``; ``False`` keeps a demoted block off flash (it is dropped).
    placement_of : callable or None
        ``f(LifetimeClass) -> int | None``: the opaque placement tag passed to the
        NVMe backend (the FDP layer maps classes to PIDs).
    classify : callable or None
        ``f(entry, now_s) -> LifetimeClass`` used when a block is written to NVMe.
    nvme_group_choice : {"first", "coldest"}
        Region eviction on a segmented NVMe backend: ``"first"`` evicts the
        reclaim group of the policy's first victim; ``"coldest"`` looks at the
        groups of the policy's first ``nvme_group_candidates`` victims and evicts
        the group whose most recently used block is the oldest (a segment is
        kept while any of its blocks is hot).
    nvme_group_candidates : int
        Victims inspected per choice with ``nvme_group_choice="coldest"`` (>= 1).
    clock : callable
        Seconds, monotonic. Tests pass a fake clock.
    """

    layout: KVLayout
    hbm_bytes: int = 0
    host_bytes: int = 0
    device: str = "auto"
    promotion: str = "top"
    eviction: str = "lru"
    evict_batch_blocks: int = 8
    verify_tokens: bool = False
    pin_quota_bytes: int = 1 << 62
    default_lease_s: float = 60.0
    admit_to_nvme: Callable | None = None
    placement_of: Callable | None = None
    classify: Callable | None = None
    nvme_group_choice: str = "first"
    nvme_group_candidates: int = 64
    clock: Callable[[], float] = time.monotonic
    cost: CostModel = dataclasses.field(default_factory=CostModel)

    def __post_init__(self) -> None:
        if self.promotion not in ("top", "one", "none"):
            raise ConfigError(f"promotion={self.promotion!r}: accepted values are ['none', 'one', 'top']")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"device={self.device!r}: accepted values are ['auto', 'cpu', 'cuda']")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device='cuda' but CUDA is not available (torch.cuda.is_available() is "
                              "False); use device='auto' to fall back to host memory")
        if self.evict_batch_blocks < 1:
            raise ConfigError(f"evict_batch_blocks={self.evict_batch_blocks}: must be >= 1")
        if self.nvme_group_choice not in ("first", "coldest"):
            raise ConfigError(f"nvme_group_choice={self.nvme_group_choice!r}: accepted values are "
                              "['coldest', 'first']")
        if self.nvme_group_candidates < 1:
            raise ConfigError(f"nvme_group_candidates={self.nvme_group_candidates}: must be >= 1")
        for f in ("hbm_bytes", "host_bytes"):
            if getattr(self, f) < 0:
                raise ConfigError(f"{f}={getattr(self, f)}: must be >= 0")


def default_classify(entry: Entry, now_s: float) -> LifetimeClass:
    """Engine hint if given; else observed reuse: a block hit >= 2 times is
    LONG-lived (shared prefix), hit once MEDIUM (conversation), never SHORT."""
    if entry.lifetime is not None:
        return entry.lifetime
    if entry.hits >= 2:
        return LifetimeClass.LONG
    if entry.hits == 1:
        return LifetimeClass.MEDIUM
    return LifetimeClass.SHORT


class TierManager:
    """Block index and movement across HBM, host and NVMe.

    Thread-safe: metadata changes happen under one lock; NVMe reads run outside
    it, protected by the entry's ``io_inflight`` count.

    Parameters
    ----------
    config : ManagerConfig
        Capacities, policies and hooks.
    nvme : BlockStorage or None
        The L3 backend; ``None`` disables the NVMe tier. Its ``block_bytes`` must
        equal ``config.layout.bytes_per_block``.

    Raises
    ------
    LayoutError
        If the NVMe backend's block size differs from the layout's.
    """

    #: Bound on the remembered admission-rejected keys (32 B each).
    REJECTED_KEYS_MAX = 1 << 18

    def __init__(self, config: ManagerConfig, nvme: BlockStorage | None = None) -> None:
        self.config = config
        self.layout = config.layout
        self.block_bytes = config.layout.bytes_per_block
        self.tokens_per_block = config.layout.tokens_per_block
        dev = config.device
        if dev == "auto":
            dev = "cuda" if cuda_available() else "cpu"
        self.hbm_device = torch.device(dev)
        self.pools: dict[Tier, BlockPool] = {}
        nh = config.hbm_bytes // self.block_bytes
        nc = config.host_bytes // self.block_bytes
        if nh:
            self.pools[Tier.HBM] = BlockPool("hbm", nh, self.block_bytes, self.hbm_device)
        if nc:
            self.pools[Tier.HOST] = BlockPool("host", nc, self.block_bytes, "cpu",
                                              pin_memory=cuda_available())
        if nvme is not None and nvme.block_bytes != self.block_bytes:
            raise LayoutError(f"NVMe backend block_bytes={nvme.block_bytes} != layout {self.block_bytes}")
        self.nvme = nvme
        # the backend frees space by reclaim unit: evict whole groups (see _evict_groups)
        self._nvme_groups = nvme is not None and type(nvme).reclaim_group is not BlockStorage.reclaim_group
        self.tiers: list[Tier] = sorted(list(self.pools) + ([Tier.NVME] if nvme is not None else []))
        self.policies: dict[Tier, EvictionPolicy] = {t: make_policy(config.eviction) for t in self.tiers}
        self.index: dict[bytes, Entry] = {}
        self.doomed: dict[int, Entry] = {}  # id(entry) -> entry invalidated while still in use
        self.requests: dict[object, list[Entry]] = {}
        self.leases: dict[int, Lease] = {}
        self.pinned_bytes: dict[bytes, int] = {}
        self._lease_ids = itertools.count(1)
        self._lock = threading.RLock()
        self.metrics = Metrics()
        self.events: list[tuple] = []
        self.record_events = False
        self.classify = config.classify or default_classify
        # keys that admission kept off flash (bounded FIFO), for the lost-hit counters
        self._rejected: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self._prefetcher: ThreadPoolExecutor | None = None
        if nvme is not None:
            self._adopt_nvme_keys()

    # ------------------------------------------------------------------ helpers
    def _now(self) -> float:
        return self.config.clock()

    def _event(self, kind: str, key: bytes, tier: Tier | None = None) -> None:
        if self.record_events:
            self.events.append((kind, key, None if tier is None else tier.label))

    def _adopt_nvme_keys(self) -> None:
        """Rebuild index entries for blocks a persistent backend recovered."""
        now = self._now()
        for key, (ns, _seq) in self.nvme.entries().items():
            e = Entry(key=key, ns=ns, position=-1, size_bytes=self.block_bytes,
                      slots={Tier.NVME: -1}, created_s=now, last_access_s=now)
            self.index[key] = e
            self.policies[Tier.NVME].on_insert(e, now)

    def _protected(self, extra: set | None = None) -> Callable[[bytes], bool]:
        now = self._now()

        def prot(key: bytes) -> bool:
            if extra is not None and key in extra:
                return True
            e = self.index.get(key)
            if e is None:
                return True
            return e.io_inflight > 0 or e.state(now) is not BlockState.EVICTABLE
        return prot

    def _lower(self, tier: Tier) -> Tier | None:
        for t in self.tiers:
            if t > tier:
                return t
        return None

    def _free_count(self, tier: Tier) -> int:
        if tier == Tier.NVME:
            return self.nvme.free_blocks()
        return self.pools[tier].free_blocks

    def _drop_copy(self, e: Entry, tier: Tier) -> None:
        """Remove ``e``'s copy in ``tier`` (and the entry, if it was the last copy)."""
        slot = e.slots.pop(tier)
        self.policies[tier].on_remove(e.key)
        if tier == Tier.NVME:
            self.nvme.delete([e.key])
        else:
            self.pools[tier].free(slot)
        self._event("removed", e.key, tier)
        if not e.slots:
            self.index.pop(e.key, None)
            self.metrics.inc("dropped_blocks")
            self._event("dropped", e.key)

    def _make_room(self, tier: Tier, n: int, protect: set | None) -> bool:
        """Ensure ``n`` free blocks in ``tier``, evicting/demoting a batch of victims."""
        free = self._free_count(tier)
        if free >= n:
            return True
        need = n - free
        policy = self.policies[tier]
        prot = self._protected(protect)
        if tier == Tier.NVME and self._nvme_groups and self._evict_groups(n, prot):
            return True
        batch = max(need, self.config.evict_batch_blocks)
        victims = policy.evict(batch, prot, self._now()) if batch > need else []
        if not victims:
            victims = policy.evict(need, prot, self._now())
        if not victims:
            return False
        self.metrics.inc(f"evictions_{tier.label}", len(victims))
        self._demote([self.index[k] for k in victims], tier, protect)
        return self._free_count(tier) >= n

    def _evict_groups(self, n: int, prot: Callable[[bytes], bool]) -> bool:
        """Region eviction on NVMe: take the policy's first victim and evict every
        unprotected block of its reclaim group (segment), so whole reclaim units
        become free. Returns True once ``n`` blocks are free."""
        policy = self.policies[Tier.NVME]
        tried: set = set()
        while self.nvme.free_blocks() < n:
            skip = lambda k: prot(k) or k in tried  # noqa: E731
            cand = policy.evict(1, skip, self._now())
            if not cand:
                return False
            group = self.nvme.reclaim_group(cand[0])
            if group is None:  # open segment, or per-block reclaim: plain eviction
                group = cand
            if self.config.nvme_group_choice == "coldest":
                cand, group = self._coldest_group(policy, skip, cand, group)
            tried.add(cand[0])
            victims = [self.index[k] for k in group if k in self.index and not prot(k)]
            if not victims:
                continue
            tried.update(e.key for e in victims)
            self.metrics.inc("evictions_nvme", len(victims))
            self.metrics.inc("evicted_groups_nvme")
            for e in victims:
                self._drop_copy(e, Tier.NVME)
        return True

    def _retry_no_space(self, entries: list[Entry], blocks: list, placements: list, st: list) -> list:
        """Retry NVMe puts that found no space, after evicting a reclaim group.

        ``free_blocks()`` does not know placement streams: room in one stream's
        open segment does not help a put to another stream, which then needs a
        free segment.  On a segmented backend, evict one whole group (a segment)
        and retry, a few times at most.
        """
        failed = [i for i, s in enumerate(st) if s is Status.NO_SPACE]
        tries = 0
        while failed and self._nvme_groups and tries < 4:
            tries += 1
            prot = self._protected({e.key for e in entries})
            if not self._evict_groups(self.nvme.free_blocks() + 1, prot):
                break
            self.metrics.inc("nvme_put_retries", len(failed))
            again = self.nvme.put([entries[i].key for i in failed], [blocks[i] for i in failed],
                                  [placements[i] for i in failed],
                                  [entries[i].ns or bytes(32) for i in failed])
            for i, s in zip(failed, again):
                st[i] = s
            failed = [i for i in failed if st[i] is Status.NO_SPACE]
        return st

    def _coldest_group(self, policy: EvictionPolicy, skip: Callable[[bytes], bool], first: list,
                       first_group: list) -> tuple[list, list]:
        """Among the groups of the policy's first victims, the one whose newest access is oldest."""
        k = self.config.nvme_group_candidates
        cands = policy.evict(k, skip, self._now()) if k > 1 else []
        if not cands:
            return first, first_group
        best, best_group, best_t = first, first_group, None
        seen: set = set()
        for c in cands:
            if c in seen:
                continue
            g = self.nvme.reclaim_group(c) or [c]
            seen.update(g)
            t = max((self.index[x].last_access_s for x in g if x in self.index), default=float("-inf"))
            if best_t is None or t < best_t:
                best, best_group, best_t = [c], g, t
        return best, best_group

    def _demote(self, victims: list[Entry], tier: Tier, protect: set | None) -> None:
        """Move ``victims`` out of ``tier``: to the next tier if they have no lower copy."""
        lower = self._lower(tier)
        to_move = [e for e in victims if lower is not None and not any(t > tier for t in e.slots)]
        if lower == Tier.NVME and self.config.admit_to_nvme is not None:
            admitted = [e for e in to_move if self.config.admit_to_nvme(e)]
            self.metrics.inc("admission_rejected_blocks", len(to_move) - len(admitted))
            self.metrics.inc("admission_rejected_bytes", (len(to_move) - len(admitted)) * self.block_bytes)
            kept = {id(e) for e in admitted}
            for e in to_move:
                if id(e) not in kept:
                    self._rejected[e.key] = None
            while len(self._rejected) > self.REJECTED_KEYS_MAX:
                self._rejected.popitem(last=False)
            to_move = admitted
        if to_move:
            prot = set(protect or ()) | {e.key for e in victims}
            self._make_room(lower, len(to_move), prot)
            room = self._free_count(lower)
            moving = to_move[:room]
            self._copy_down(moving, tier, lower)
        for e in victims:
            self._drop_copy(e, tier)

    def _copy_down(self, entries: list[Entry], src: Tier, dst: Tier) -> None:
        if not entries:
            return
        if dst == Tier.NVME:
            now = self._now()
            classes = [self.classify(e, now) for e in entries]
            for e, c in zip(entries, classes):
                e.nvme_class = c
            place = self.config.placement_of
            placements = [place(c) if place else None for c in classes]
            blocks = [self.pools[src].view(e.slots[src]) for e in entries]
            if blocks and blocks[0].device.type != "cpu":
                blocks = [b.cpu() for b in blocks]
            st = self.nvme.put([e.key for e in entries], blocks, placements, [e.ns or bytes(32) for e in entries])
            st = self._retry_no_space(entries, blocks, placements, list(st))
            for e, s in zip(entries, st):
                if s in (Status.OK, Status.EXISTS):
                    e.slots[Tier.NVME] = -1
                    self.policies[Tier.NVME].on_insert(e, now)
                    self.metrics.inc(f"demotions_{src.label}_nvme")
                    self.metrics.inc("nvme_write_bytes", self.block_bytes)
                    self._event("demoted", e.key, Tier.NVME)
                else:
                    self.metrics.inc(f"nvme_put_{s.value}")
            return
        pool = self.pools[dst]
        now = self._now()
        for e in entries:
            slot = pool.allocate()
            if slot is None:
                break
            pool.view(slot).copy_(self.pools[src].view(e.slots[src]), non_blocking=False)
            e.slots[dst] = slot
            self.policies[dst].on_insert(e, now)
            self.metrics.inc(f"demotions_{src.label}_{dst.label}")
            self._event("demoted", e.key, dst)

    # ------------------------------------------------------------------ store
    def store(self, ns: bytes, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
              tokens: Sequence[np.ndarray] | None = None, lifetime: LifetimeClass | str | None = None,
              first_position: int = 0) -> list[Status]:
        """Store full blocks of one prefix chain.

        Parameters
        ----------
        ns : bytes
            32-byte namespace digest.
        keys : sequence of bytes
            Chained block hashes, in chain order.
        blocks : sequence of torch.Tensor
            One per key: a contiguous ``uint8`` tensor of ``bytes_per_block`` bytes,
            or a typed block of shape ``layout.block_shape`` and ``layout.dtype``.
        tokens : sequence of numpy.ndarray, optional
            Token ids of each block (int64, shape ``(tokens_per_block,)``), kept
            for verification when ``verify_tokens`` is on.
        lifetime : LifetimeClass or str, optional
            Engine hint for FDP placement (``"system"``, ``"conversation"``, ``"query"``).
        first_position : int
            Chain position of ``keys[0]``.

        Returns
        -------
        list of Status
            ``OK``, ``EXISTS`` (idempotent duplicate) or ``NO_SPACE`` per block.

        Raises
        ------
        LayoutError
            If a block has the wrong size or dtype (nothing is stored then).
        """
        if len(keys) != len(blocks):
            raise LayoutError(f"{len(keys)} keys but {len(blocks)} blocks")
        raw = [self.layout.as_bytes(b) for b in blocks]  # validates all before storing any
        hint = class_from_hint(lifetime)
        out: list[Status] = []
        with self._lock:
            protect: set = set()
            failed = False
            for i, (key, data) in enumerate(zip(keys, raw)):
                e = self.index.get(key)
                if e is not None:
                    out.append(Status.EXISTS)
                    protect.add(key)
                    self.metrics.inc("store_exists")
                    continue
                if failed:
                    out.append(Status.NO_SPACE)
                    self.metrics.inc("store_no_space")
                    continue
                tier = self._place_new(protect)
                if tier is None:
                    failed = True
                    out.append(Status.NO_SPACE)
                    self.metrics.inc("store_no_space")
                    continue
                now = self._now()
                e = Entry(key=key, ns=ns, position=first_position + i, size_bytes=self.block_bytes,
                          slots={}, created_s=now, last_access_s=now, lifetime=hint)
                if self.config.verify_tokens and tokens is not None:
                    e.tokens = np.asarray(tokens[i], dtype=np.int64).copy()
                if tier == Tier.NVME:
                    e.nvme_class = self.classify(e, now)
                    place = self.config.placement_of
                    st = self.nvme.put([key], [data.cpu()], [place(e.nvme_class) if place else None], [ns])[0]
                    if st not in (Status.OK, Status.EXISTS):
                        failed = True
                        out.append(Status.NO_SPACE)
                        self.metrics.inc("store_no_space")
                        continue
                    e.slots[Tier.NVME] = -1
                    self.metrics.inc("nvme_write_bytes", self.block_bytes)
                else:
                    slot = self.pools[tier].allocate()
                    self.pools[tier].view(slot).copy_(data)
                    e.slots[tier] = slot
                self.index[key] = e
                self._rejected.pop(key, None)
                self.policies[tier].on_insert(e, now)
                protect.add(key)
                out.append(Status.OK)
                self.metrics.inc("store_ok")
                self.metrics.inc(f"store_bytes_{tier.label}", self.block_bytes)
                self._event("stored", key, tier)
        return out

    def store_write_through(self, ns: bytes, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
                            lifetime: LifetimeClass | str | None = None, first_position: int = 0) -> list[Status]:
        """Store blocks durably: write each to the NVMe tier first, then index it and
        cache it in the fastest memory tier with room.

        A block is acknowledged (``OK``/``EXISTS``) only once the NVMe backend
        acknowledged its write (``SegmentStorage``: O_DIRECT + fdatasync). A later
        eviction of the cached copy writes nothing, since a lower copy exists.

        Parameters
        ----------
        ns : bytes
            32-byte namespace (scope) digest.
        keys : sequence of bytes
            Block keys.
        blocks : sequence of torch.Tensor
            1-D contiguous CPU ``uint8`` tensors of ``bytes_per_block`` each.
        lifetime : LifetimeClass or str, optional
            Placement hint.
        first_position : int
            Chain position of ``keys[0]``.

        Returns
        -------
        list of Status
            ``OK`` (newly durable), ``EXISTS`` (already on NVMe), ``NO_SPACE`` or
            ``IO_ERROR`` per block.

        Raises
        ------
        InvariantError
            If the manager has no NVMe tier.
        """
        if self.nvme is None:
            raise InvariantError("store_write_through needs an NVMe tier")
        if len(keys) != len(blocks):
            raise LayoutError(f"{len(keys)} keys but {len(blocks)} blocks")
        n = len(keys)
        out: list[Status | None] = [None] * n
        hint = class_from_hint(lifetime)
        with self._lock:
            todo = [i for i, k in enumerate(keys)
                    if not (k in self.index and Tier.NVME in self.index[k].slots)]
            for i in set(range(n)) - set(todo):
                out[i] = Status.EXISTS
            if todo:  # evict NVMe victims now, protecting this batch
                self._make_room(Tier.NVME, len(todo), set(keys))
        st: list[Status] = []
        if todo:
            place = self.config.placement_of
            pid = place(hint) if (place is not None and hint is not None) else None
            try:
                st = self.nvme.put([keys[i] for i in todo], [blocks[i] for i in todo], [pid] * len(todo),
                                   [ns] * len(todo))
            except OSError:
                st = [Status.IO_ERROR] * len(todo)
        mem_tiers = [t for t in self.tiers if t != Tier.NVME]
        with self._lock:
            now = self._now()
            for i, s in zip(todo, st):
                k = keys[i]
                if s not in (Status.OK, Status.EXISTS):
                    out[i] = s
                    self.metrics.inc(f"store_{s.value}")
                    continue
                e = self.index.get(k)
                if e is not None:
                    if Tier.NVME not in e.slots:
                        e.slots[Tier.NVME] = -1
                        self.policies[Tier.NVME].on_insert(e, now)
                        self.metrics.inc("nvme_write_bytes", self.block_bytes)
                    out[i] = Status.EXISTS
                    self.metrics.inc("store_exists")
                    continue
                e = Entry(key=k, ns=ns, position=first_position + i, size_bytes=self.block_bytes, slots={},
                          created_s=now, last_access_s=now, lifetime=hint, nvme_class=hint)
                for t in mem_tiers:
                    if self._make_room(t, 1, {k}):
                        slot = self.pools[t].allocate()
                        if slot is not None:
                            self.pools[t].view(slot).copy_(blocks[i])
                            e.slots[t] = slot
                            self.policies[t].on_insert(e, now)
                            break
                e.slots[Tier.NVME] = -1
                self.policies[Tier.NVME].on_insert(e, now)
                self.index[k] = e
                out[i] = Status.OK
                self.metrics.inc("store_ok")
                self.metrics.inc("store_bytes_nvme", self.block_bytes)
                self.metrics.inc("nvme_write_bytes", self.block_bytes)
        return [s if s is not None else Status.IO_ERROR for s in out]

    def _place_new(self, protect: set) -> Tier | None:
        for t in self.tiers:
            if self._make_room(t, 1, protect):
                return t
        return None

    # ------------------------------------------------------------------ lookup
    def probe(self, keys: Sequence[bytes]) -> int:
        """Number of leading keys resident. Takes no reference and does not touch recency."""
        with self._lock:
            n = 0
            for k in keys:
                e = self.index.get(k)
                if e is None:
                    break
                n += 1
            return n

    def lookup(self, keys: Sequence[bytes], tokens: Sequence[np.ndarray] | None = None,
               request_id: object = None, num_prompt_tokens: int | None = None) -> LookupResult:
        """Longest resident prefix of ``keys``.

        Parameters
        ----------
        keys : sequence of bytes
            Chained hashes of the prompt's full blocks.
        tokens : sequence of numpy.ndarray, optional
            Token ids per block; compared with stored ids when ``verify_tokens`` is on.
            A mismatch ends the match (counted in ``verify_mismatch``).
        request_id : hashable, optional
            When given, each matched block gets a request reference (ACTIVE) until
            :meth:`release` (or :meth:`cancel`) for this id. Always release: leaked
            references keep blocks from ever being evicted.
        num_prompt_tokens : int, optional
            The prompt length, for the partial-tail metric.

        Returns
        -------
        LookupResult
        """
        now = self._now()
        with self._lock:
            matched: list[Entry] = []
            for i, k in enumerate(keys):
                e = self.index.get(k)
                if e is None:
                    if k in self._rejected:
                        # a hit admission cost: this block was kept off flash and dropped
                        lost = 0
                        for k2 in keys[i:]:
                            if k2 not in self._rejected or k2 in self.index:
                                break
                            lost += 1
                        self.metrics.inc("admission_lost_lookups")
                        self.metrics.inc("admission_lost_blocks", lost)
                    break
                if self.config.verify_tokens and tokens is not None and e.tokens is not None:
                    if not np.array_equal(e.tokens, np.asarray(tokens[i], dtype=np.int64)):
                        self.metrics.inc("verify_mismatch")
                        break
                matched.append(e)
            tiers = [e.top_tier for e in matched]
            load_s = [self.config.cost.load_s(t.label, self.block_bytes) for t in tiers]
            useful = self.config.cost.useful_blocks([t.label for t in tiers], self.block_bytes,
                                                    self.tokens_per_block)
            for e in matched:
                e.hits += 1
                e.last_access_s = now
                self.policies[e.top_tier].on_access(e, now)
            if request_id is not None and matched:
                refs = self.requests.setdefault(request_id, [])
                for e in matched:
                    e.ref_count += 1
                    refs.append(e)
            m = self.metrics
            m.inc("lookups")
            m.inc("lookup_blocks", len(keys))
            if matched:
                m.inc("lookup_hits")
                m.inc("hit_blocks", len(matched))
                m.inc("matched_tokens", len(matched) * self.tokens_per_block)
                for t in tiers:
                    m.inc(f"hit_blocks_{t.label}")
            m.inc("useful_blocks", useful)
            if num_prompt_tokens is not None:
                m.inc("prompt_tokens", num_prompt_tokens)
                m.inc("partial_tail_tokens", num_prompt_tokens - len(keys) * self.tokens_per_block)
        return LookupResult([e.key for e in matched], tiers, load_s, useful, len(keys),
                            self.tokens_per_block, request_id)

    # ------------------------------------------------------------------ load
    def load(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor] | None = None,
             promote: bool = True) -> tuple[list[Status], list[torch.Tensor | None]]:
        """Copy blocks to the caller.

        Parameters
        ----------
        keys : sequence of bytes
            Keys to load (normally ``LookupResult.useful_keys``).
        dests : sequence of torch.Tensor, optional
            Caller-provided destinations: each a contiguous ``uint8`` tensor of
            ``bytes_per_block`` bytes (or a typed block of the layout's shape and
            dtype), on any device. When omitted, new CPU ``uint8`` tensors are returned.
        promote : bool
            Copy NVMe/host hits upward according to ``config.promotion``.

        Returns
        -------
        statuses : list of Status
            ``OK`` per loaded block; ``MISS`` (evicted meanwhile) or ``IO_ERROR``
            (failed or corrupt read, the block is dropped from the cache). Use the
            leading run of ``OK``: a failed block is never reported as loaded.
        tensors : list of torch.Tensor or None
            The destination of each ``OK`` block, else ``None``.
        """
        t0 = time.perf_counter_ns()
        n = len(keys)
        statuses: list[Status] = [Status.MISS] * n
        outs: list[torch.Tensor | None] = [None] * n
        if dests is not None and len(dests) != n:
            raise LayoutError(f"{n} keys but {len(dests)} destinations")
        dst_raw = [self.layout.as_bytes(d) if d.dtype != torch.uint8 else d.reshape(-1) for d in dests] \
            if dests is not None else [torch.empty(self.block_bytes, dtype=torch.uint8) for _ in range(n)]
        nvme_jobs: list[tuple[int, Entry, Future, bool]] = []
        tiers_used: list[Tier] = []
        with self._lock:
            for i, k in enumerate(keys):
                e = self.index.get(k)
                if e is None:
                    continue
                top = e.top_tier
                tiers_used.append(top)
                if top != Tier.NVME:
                    dst_raw[i].copy_(self.pools[top].view(e.slots[top]))
                    statuses[i] = Status.OK
                    outs[i] = dests[i] if dests is not None else dst_raw[i]
                    if promote and top == Tier.HOST:
                        self._promote(e, Tier.HOST)
                    continue
                e.io_inflight += 1
                if e.load_future is not None:
                    nvme_jobs.append((i, e, e.load_future, False))
                    self.metrics.inc("merged_loads")
                else:
                    e.load_future = Future()
                    nvme_jobs.append((i, e, e.load_future, True))
        # NVMe reads outside the lock; leaders read, followers wait (delay-hit merge)
        leaders = [(i, e, f) for i, e, f, lead in nvme_jobs if lead]
        if leaders:
            bufs = [dst_raw[i] if dst_raw[i].device.type == "cpu" and dst_raw[i].is_contiguous()
                    else torch.empty(self.block_bytes, dtype=torch.uint8) for i, _, _ in leaders]
            t_io = time.perf_counter()
            try:
                st = self.nvme.get([e.key for _, e, _ in leaders], bufs)
            except OSError:
                st = [Status.IO_ERROR] * len(leaders)
            dt = time.perf_counter() - t_io
            ok_bytes = sum(self.block_bytes for s in st if s == Status.OK)
            self.config.cost.observe_load("nvme", ok_bytes, dt)
            self.metrics.inc("nvme_read_bytes", ok_bytes)
            for (i, e, f), s, b in zip(leaders, st, bufs):
                f.set_result((s, b))
        for i, e, f, lead in nvme_jobs:
            s, b = f.result()
            if s == Status.OK:
                if b.data_ptr() != dst_raw[i].data_ptr():
                    dst_raw[i].copy_(b)
                statuses[i] = Status.OK
                outs[i] = dests[i] if dests is not None else dst_raw[i]
            else:
                statuses[i] = s
        with self._lock:
            for i, e, f, lead in nvme_jobs:
                e.io_inflight -= 1
                if e.io_inflight < 0:
                    raise InvariantError("io_inflight went negative")
                if lead:
                    e.load_future = None
                    s, b = f.result()
                    if s != Status.OK:
                        self.metrics.inc("io_errors")
                        if Tier.NVME in e.slots and not e.doomed:
                            self._drop_copy(e, Tier.NVME)  # never serve it again
                    elif promote:
                        self._promote(e, Tier.NVME, b)
                if e.doomed and e.ref_count == 0 and e.io_inflight == 0:
                    self._free_doomed(e)
            loaded = sum(1 for s in statuses if s == Status.OK)
            self.metrics.inc("loaded_blocks", loaded)
            self.metrics.inc("reused_tokens", loaded * self.tokens_per_block)
            for t in tiers_used:
                self.metrics.inc(f"load_bytes_{t.label}", self.block_bytes)
        if n:
            dt_ns = time.perf_counter_ns() - t0
            worst = max(tiers_used) if tiers_used else Tier.HBM
            self.metrics.record_load_ns(worst.label, dt_ns)
        return statuses, outs

    def _promote(self, e: Entry, src: Tier, data: torch.Tensor | None = None) -> None:
        """Copy ``e`` upward from ``src`` (keeping the lower copy)."""
        mode = self.config.promotion
        if mode == "none" or e.key not in self.index:
            return
        upper = [t for t in self.tiers if t < src and t not in e.slots]
        if not upper:
            return
        dst = upper[0] if mode == "top" else upper[-1]
        self._promote_to(e, src, dst, data)

    def _promote_to(self, e: Entry, src: Tier, dst: Tier, data: torch.Tensor | None = None) -> bool:
        """Copy ``e`` from ``src`` into memory tier ``dst`` (keeping the source copy)."""
        if not self._make_room(dst, 1, {e.key}):
            return False
        slot = self.pools[dst].allocate()
        if slot is None:
            return False
        src_view = data if data is not None else self.pools[src].view(e.slots[src])
        self.pools[dst].view(slot).copy_(src_view)
        e.slots[dst] = slot
        self.policies[dst].on_insert(e, self._now())
        self.metrics.inc(f"promotions_{src.label}_{dst.label}")
        self._event("promoted", e.key, dst)
        return True

    # ------------------------------------------------------------------ prefetch
    def prefetch(self, keys: Sequence[bytes], target_tier: Tier = Tier.HOST) -> Future:
        """Bring resident blocks up to ``target_tier`` in the background.

        A block already in ``target_tier`` or a faster tier, or not resident, is
        skipped. NVMe reads run outside the manager lock on a single worker
        thread, the block held by its ``io_inflight`` count (never a victim
        meanwhile), so lookups, loads and stores of other requests proceed.
        Prefetch takes no request reference and does not count as a hit; the
        promoted copy enters ``target_tier``'s policy as a new insert, and may
        be evicted again by later pressure (pin the prefix to hold it).

        Parameters
        ----------
        keys : sequence of bytes
            Block keys, normally a prompt's chain (missing keys are skipped).
        target_tier : Tier
            A memory tier (``Tier.HBM`` or ``Tier.HOST``) that is enabled.

        Returns
        -------
        concurrent.futures.Future
            Resolves to the number of blocks brought up.

        Raises
        ------
        ConfigError
            If ``target_tier`` is not an enabled memory tier.
        """
        target_tier = Tier(target_tier)
        if target_tier not in self.pools:
            raise ConfigError(f"prefetch target {target_tier.label!r}: accepted values are "
                              f"{[t.label for t in self.pools]} (enabled memory tiers)")
        keys = list(keys)
        with self._lock:
            if self._prefetcher is None:
                self._prefetcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierstore-prefetch")
            return self._prefetcher.submit(self._prefetch_now, keys, target_tier)

    def _prefetch_now(self, keys: list[bytes], target: Tier) -> int:
        moved = 0
        nvme_jobs: list[Entry] = []
        with self._lock:
            for k in keys:
                e = self.index.get(k)
                if e is None or e.top_tier <= target:
                    continue
                if e.top_tier != Tier.NVME:
                    moved += self._promote_to(e, e.top_tier, target)
                    continue
                e.io_inflight += 1
                nvme_jobs.append(e)
        if not nvme_jobs:
            self.metrics.inc("prefetched_blocks", moved)
            return moved
        bufs = [torch.empty(self.block_bytes, dtype=torch.uint8) for _ in nvme_jobs]
        t_io = time.perf_counter()
        try:
            st = self.nvme.get([e.key for e in nvme_jobs], bufs)
        except OSError:
            st = [Status.IO_ERROR] * len(nvme_jobs)
        dt = time.perf_counter() - t_io
        with self._lock:
            ok_bytes = sum(self.block_bytes for s in st if s == Status.OK)
            self.config.cost.observe_load("nvme", ok_bytes, dt)
            self.metrics.inc("nvme_read_bytes", ok_bytes)
            for e, s, b in zip(nvme_jobs, st, bufs):
                e.io_inflight -= 1
                if e.io_inflight < 0:
                    raise InvariantError("io_inflight went negative")
                live = not e.doomed and self.index.get(e.key) is e
                if s != Status.OK:
                    self.metrics.inc("io_errors")
                    if live and Tier.NVME in e.slots and e.io_inflight == 0:
                        self._drop_copy(e, Tier.NVME)  # never serve it again
                elif live and target not in e.slots and e.top_tier > target:
                    moved += self._promote_to(e, Tier.NVME, target, b)
                if e.doomed and e.ref_count == 0 and e.io_inflight == 0:
                    self._free_doomed(e)
            self.metrics.inc("prefetched_blocks", moved)
        return moved

    # ------------------------------------------------------------------ references
    def release(self, request_id: object) -> int:
        """Drop every reference ``request_id`` holds. Unknown ids are a no-op.

        Returns the number of references dropped.
        """
        with self._lock:
            refs = self.requests.pop(request_id, [])
            for e in refs:
                e.ref_count -= 1
                if e.ref_count < 0:
                    raise InvariantError(f"ref_count of {e.key.hex()[:12]} went negative")
                if e.doomed and e.ref_count == 0 and e.io_inflight == 0:
                    self._free_doomed(e)
            return len(refs)

    def cancel(self, request_id: object) -> int:
        """Abort a request: like :meth:`release`, counted as an abort."""
        self.metrics.inc("aborted_requests")
        return self.release(request_id)

    # ------------------------------------------------------------------ pins
    def pin(self, ns: bytes, keys: Sequence[bytes], lease_s: float | None = None) -> Lease:
        """Hold resident blocks until the lease expires or :meth:`unpin`.

        Only blocks resident now are pinned. Pinned bytes count against the
        namespace's ``pin_quota_bytes``.

        Raises
        ------
        QuotaExceeded
            If the pin would exceed the namespace quota (nothing is pinned then).
        """
        lease_s = self.config.default_lease_s if lease_s is None else lease_s
        if lease_s <= 0:
            raise ConfigError(f"lease_s={lease_s}: must be > 0")
        with self._lock:
            self._expire_pins()
            entries = [self.index[k] for k in keys if k in self.index]
            nbytes = len(entries) * self.block_bytes
            used = self.pinned_bytes.get(ns, 0)
            if used + nbytes > self.config.pin_quota_bytes:
                raise QuotaExceeded(f"pin of {nbytes} B would exceed the namespace quota "
                                    f"({used} of {self.config.pin_quota_bytes} B in use)")
            lid = next(self._lease_ids)
            exp = self._now() + lease_s
            for e in entries:
                e.pins[lid] = exp
            self.leases[lid] = Lease(lid, ns, [e.key for e in entries], exp, nbytes)
            self.pinned_bytes[ns] = used + nbytes
            self.metrics.inc("pins")
            return self.leases[lid]

    def unpin(self, lease_id: int) -> bool:
        """End a lease early. Returns False for an unknown or expired lease."""
        with self._lock:
            return self._end_lease(lease_id)

    def _end_lease(self, lease_id: int) -> bool:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return False
        for k in lease.keys:
            e = self.index.get(k)
            if e is not None:
                e.pins.pop(lease_id, None)
        for e in self.doomed.values():
            e.pins.pop(lease_id, None)
        self.pinned_bytes[lease.ns] -= lease.bytes
        if self.pinned_bytes[lease.ns] < 0:
            raise InvariantError("pinned bytes went negative")
        return True

    def _expire_pins(self) -> None:
        now = self._now()
        for lid in [lid for lid, l in self.leases.items() if l.expiry_s <= now]:
            self._end_lease(lid)
            self.metrics.inc("pin_expired")

    # ------------------------------------------------------------------ removal
    def invalidate(self, ns: bytes) -> int:
        """Remove every block of namespace ``ns``. Blocks in use are hidden from
        lookups at once and freed when their last reference goes.

        Returns the number of blocks removed or doomed.
        """
        with self._lock:
            victims = [e for e in self.index.values() if e.ns == ns]
            for e in victims:
                self._remove_entry(e)
            for lid in [lid for lid, l in self.leases.items() if l.ns == ns]:
                self._end_lease(lid)
            return len(victims)

    def clear(self) -> int:
        """Remove every block (in-use blocks are doomed and freed on release)."""
        with self._lock:
            victims = list(self.index.values())
            for e in victims:
                self._remove_entry(e)
            for lid in list(self.leases):
                self._end_lease(lid)
            return len(victims)

    def _remove_entry(self, e: Entry) -> None:
        self.index.pop(e.key, None)
        for t in e.slots:  # hidden from policies at once: the key may be stored again
            self.policies[t].on_remove(e.key)
        if Tier.NVME in e.slots and e.io_inflight == 0:
            del e.slots[Tier.NVME]
            self.nvme.delete([e.key])
        if e.ref_count > 0 or e.io_inflight > 0:
            e.doomed = True
            self.doomed[id(e)] = e
            return
        self._free_doomed(e)

    def _free_doomed(self, e: Entry) -> None:
        self.doomed.pop(id(e), None)
        for t in list(e.slots):
            slot = e.slots.pop(t)
            if t == Tier.NVME:
                live = self.index.get(e.key)  # the same key may have been stored again meanwhile
                if live is None or Tier.NVME not in live.slots:
                    self.nvme.delete([e.key])
            else:
                self.pools[t].free(slot)
        self._event("invalidated", e.key)

    def remove(self, keys: Iterable[bytes]) -> int:
        """Remove blocks by key (in-use blocks are hidden now and freed on release).

        Returns the number of keys that were resident.
        """
        with self._lock:
            n = 0
            for k in keys:
                e = self.index.get(k)
                if e is not None:
                    self._remove_entry(e)
                    n += 1
            return n

    def evict(self, tier: Tier, n: int) -> int:
        """Evict (demote) up to ``n`` unprotected blocks from ``tier`` now.

        Returns the number evicted (0 if ``n`` unprotected blocks do not exist).
        """
        with self._lock:
            if tier not in self.tiers:
                return 0
            victims = self.policies[tier].evict(n, self._protected(), self._now())
            if victims:
                self.metrics.inc(f"evictions_{tier.label}", len(victims))
                self._demote([self.index[k] for k in victims], tier, None)
            return len(victims)

    # ------------------------------------------------------------------ introspection
    def state_of(self, key: bytes) -> BlockState | None:
        """Ownership state of a block, or ``None`` if not resident."""
        with self._lock:
            e = self.index.get(key) or next((d for d in self.doomed.values() if d.key == key), None)
            return None if e is None else e.state(self._now())

    def tiers_of(self, key: bytes) -> list[Tier]:
        """Tiers holding a copy of ``key`` (empty if not resident)."""
        with self._lock:
            e = self.index.get(key)
            return sorted(e.slots) if e else []

    def bytes_per_tier(self) -> dict[str, int]:
        """Resident bytes per tier."""
        with self._lock:
            out = {t.label: 0 for t in Tier}
            for t, p in self.pools.items():
                out[t.label] = p.used_blocks * self.block_bytes
            if self.nvme is not None:
                out["nvme"] = sum(1 for e in self.index.values() if Tier.NVME in e.slots) * self.block_bytes
            return out

    def check_invariants(self) -> None:
        """Verify pools, policies and refcounts agree. Raises InvariantError."""
        with self._lock:
            for t, pool in self.pools.items():
                live = [e for e in list(self.index.values()) + list(self.doomed.values()) if t in e.slots]
                if pool.used_blocks != len(live):
                    raise InvariantError(f"{t.label}: {pool.used_blocks} slots used, {len(live)} entries")
                if len({e.slots[t] for e in live}) != len(live):
                    raise InvariantError(f"{t.label}: two entries share a slot")
            for t in self.tiers:
                n = sum(1 for e in self.index.values() if t in e.slots)
                if len(self.policies[t]) != n:
                    raise InvariantError(f"{t.label}: policy tracks {len(self.policies[t])}, {n} resident")
            for e in list(self.index.values()) + list(self.doomed.values()):
                if e.ref_count < 0 or e.io_inflight < 0:
                    raise InvariantError(f"negative count on {e.key.hex()[:12]}")
            refs: dict[int, int] = {}
            for lst in self.requests.values():
                for e in lst:
                    refs[id(e)] = refs.get(id(e), 0) + 1
            for e in list(self.index.values()) + list(self.doomed.values()):
                if refs.get(id(e), 0) != e.ref_count:
                    raise InvariantError(f"ref_count {e.ref_count} != {refs.get(id(e), 0)} references")

    def close(self) -> None:
        """Finish pending prefetches and close the NVMe backend."""
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True)
            self._prefetcher = None
        if self.nvme is not None:
            self.nvme.close()
