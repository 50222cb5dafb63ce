"""The contract between the deciding and the moving side: tiers, media, plans and results.

The index decides and returns these plain data objects; the movers execute them, the API shapes
them into results, and the engine connectors and the daemon read them. They carry what a transfer
handler needs (key, tier, slot, lifetime class, namespace) and hold no locks, events or callables,
except two fields that are the index's scratch and leave the contract in issue 23's P4:
``LoadPlan.waits`` (events of other loads' NVMe reads, for the delay-hit merge) and
``StorePlan.protect``. The moving side writes only ``StorePlan.moved`` and
``StorePlan.demote_statuses`` (how far it got); everything else is decided by the index
(:mod:`tierstore.index`) and read-only afterwards.

A *medium* is where bytes live, as a transfer handler sees it (vLLM ``kv_offload``'s mediums):
``memory`` (HBM and host slots, engine buffers), ``nvme`` (the block storage), ``remote`` (the
shared tier). Every name here stays importable from :mod:`tierstore.index`.
"""

from __future__ import annotations

import dataclasses
import enum
import threading
import typing

from .errors import Status
from .fdp.lifetime import LifetimeClass

__all__ = [
    "Tier",
    "Medium",
    "MEMORY_TIERS",
    "BlockState",
    "LookupResult",
    "Lease",
    "Demotion",
    "StorePlan",
    "LoadPlan",
    "PromotePlan",
    "Status",
]


class Medium(enum.Enum):
    """Where a tier's bytes live, as a transfer handler sees it."""

    MEMORY = "memory"  # HBM and host slots (and engine buffers)
    NVME = "nvme"  # the block storage (tierstore.tiers.storage.BlockStorage)
    REMOTE = "remote"  # the shared remote tier


class Tier(enum.IntEnum):
    """Tiers, fastest first."""

    HBM = 0
    HOST = 1
    NVME = 2
    REMOTE = 3  # the shared remote tier: found by lookup, never indexed locally

    @property
    def label(self) -> str:
        """Lower-case name used in metrics and the cost model."""
        return self.name.lower()

    @property
    def medium(self) -> Medium:
        """The :class:`Medium` of this tier (``HBM`` and ``HOST``: memory)."""
        return _MEDIUM[self]


_MEDIUM = {
    Tier.HBM: Medium.MEMORY,
    Tier.HOST: Medium.MEMORY,
    Tier.NVME: Medium.NVME,
    Tier.REMOTE: Medium.REMOTE,
}
MEMORY_TIERS = (Tier.HBM, Tier.HOST)

#: :class:`~tierstore.api.KVStore`'s calls that read the index of a store in this process, and its
#: tier and device figures: what its clients of a store in another process
#: (``client.RemoteKVStore``, ``node.client.NodeKVStore``) do not offer (their ``NOT_OFFERED``)
LOCAL_INDEX_CALLS = (
    "block_info",
    "state_of",
    "references",
    "leases",
    "namespaces",
    "keys_of_namespace",
    "check_invariants",
    "record_events",
    "take_events",
)
LOCAL_FIGURES = (
    "bytes_per_tier",
    "capacity_bytes",
    "device_stats",
    "cost_model",
    "ftl",
    "placement",
    "tiers",
)


class BlockState(enum.Enum):
    """Derived ownership state of an entry."""

    ACTIVE = "active"
    PINNED = "pinned"
    EVICTABLE = "evictable"


@dataclasses.dataclass
class LookupResult:
    """Outcome of :meth:`~tierstore.index.BlockIndex.lookup`.

    Attributes
    ----------
    keys : list of bytes
        The matched leading keys (a prefix of the keys asked for).
    tiers : list of Tier
        Tier each matched block would be loaded from (its fastest copy).
    load_s : list of float
        Estimated seconds to load each matched block (cost model; a tier's
        first block also carries its load call's latency).
    useful_blocks : int
        Leading blocks worth loading (loading them beats recomputing).
    requested_blocks : int
        Full blocks asked for.
    tokens_per_block : int
        Block size in tokens.
    request_id : object or None
        The request holding references on the matched blocks, if any.
    not_useful_reason : str or None
        Why the matched blocks after ``useful_blocks`` are not worth loading
        (e.g. ``"load slower than recompute: est 3.1 ms vs recompute 1.6 ms per
        block (remote: declared ...)"``, :meth:`CostModel.not_useful_reason
        <tierstore.policies.cost.CostModel.not_useful_reason>`); ``None`` when
        ``useful_blocks == matched_blocks``.
    """

    keys: list[bytes]
    tiers: list[Tier]
    load_s: list[float]
    useful_blocks: int
    requested_blocks: int
    tokens_per_block: int
    request_id: object = None
    not_useful_reason: str | None = None

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
    def useful_keys(self) -> list[bytes]:
        return self.keys[: self.useful_blocks]


@dataclasses.dataclass
class Lease:
    """A pin lease: blocks held resident until ``expiry_s`` or :meth:`~tierstore.index.BlockIndex.unpin`."""

    lease_id: int
    ns: bytes
    keys: list[bytes]
    expiry_s: float
    bytes: int


@dataclasses.dataclass
class Demotion:
    """One victim moving down: from ``src`` slot to ``dst`` (a memory slot, or NVMe with ``slot=-1``)."""

    row: int
    key: bytes
    src: Tier
    src_slot: int
    dst: Tier
    dst_slot: int
    lifetime: LifetimeClass | None = None
    ns: bytes = b""


@dataclasses.dataclass(eq=False)
class StorePlan:
    """What :meth:`~tierstore.index.BlockIndex.prepare_store` decided; the mover executes it.

    Attributes
    ----------
    keys : list of bytes
        All keys asked for, in chain order.
    statuses : list of Status or None
        Decided already (``EXISTS``, ``NO_SPACE``) or ``None`` (to be written).
    rows : list of int
        Row of each key to write (``-1`` for decided ones).
    memory : list of (int, Tier, int)
        ``(i, tier, slot)``: key ``i``'s bytes go into that memory slot.
    nvme_new : list of (int, LifetimeClass)
        ``(i, class)``: key ``i``'s bytes are written to NVMe with that class.
    nvme_demote : list of Demotion
        Victims written from a memory slot to NVMe (before their slot is reused).
    copies : list of Demotion
        Memory-to-memory demotions, lowest tier first (execute in order).
    frees : list of (int, Tier, int)
        ``(row, tier, slot)`` copies to drop once the plan completes.
    lost : list of (bytes, Tier, int)
        ``(key, tier, slot)`` of victims that leave the last tier holding them
        (no lower memory copy, not written to NVMe). With
        ``IndexRuntime.remote_victims`` the mover offers them to the shared
        remote tier before their slot is reused; otherwise empty.
    given : set of (Tier, int)
        Victims' slots handed on (to a new block or a demoted victim) rather than freed.
    ns : bytes
        Namespace digest of the new keys.
    """

    keys: list[bytes]
    statuses: list[Status | None]
    rows: list[int]
    memory: list[tuple[int, Tier, int]] = dataclasses.field(default_factory=list)
    nvme_new: list[tuple[int, LifetimeClass | None]] = dataclasses.field(default_factory=list)
    nvme_demote: list[Demotion] = dataclasses.field(default_factory=list)
    copies: list[Demotion] = dataclasses.field(default_factory=list)
    frees: list[tuple[int, Tier, int]] = dataclasses.field(default_factory=list)
    lost: list[tuple[bytes, Tier, int]] = dataclasses.field(default_factory=list)
    ns: bytes = b""
    given: set[tuple[Tier, int]] = dataclasses.field(default_factory=set)
    done: bool = False
    protect: set[bytes] | None = None
    #: How far the mover got (set by the mover): nothing, the NVMe batch
    #: (``demote_statuses`` then holds its victims' statuses), or also the
    #: memory-to-memory demotions. A failure is undone accordingly.
    moved: int = 0
    demote_statuses: dict[int, Status] = dataclasses.field(default_factory=dict)
    #: The victims' outcome was applied before the plan completed (set by the index,
    #: :meth:`~tierstore.index.BlockIndex.complete_victims`: split execution).
    victims_done: bool = False

    NOTHING_DONE: typing.ClassVar[int] = 0
    NVME_DONE: typing.ClassVar[int] = 1
    COPIES_DONE: typing.ClassVar[int] = 2

    @property
    def pending(self) -> list[int]:
        """Indices of keys this plan writes."""
        return [i for i, s in enumerate(self.statuses) if s is None]


@dataclasses.dataclass(eq=False)
class LoadPlan:
    """What :meth:`~tierstore.index.BlockIndex.prepare_load` decided.

    ``sources[i]`` is ``(tier, slot)`` (``slot=-1`` for NVMe) or ``None`` (a miss).
    ``waits`` are NVMe reads of the same blocks by other loads, in flight now:
    the caller may :meth:`~tierstore.index.BlockIndex.abort_load`, wait for them and plan again
    (a delay hit: concurrent cold loads of one block share one read).
    """

    keys: list[bytes]
    rows: list[int]
    sources: list[tuple[Tier, int] | None]
    waits: list[threading.Event] = dataclasses.field(default_factory=list)
    leads: list[int] = dataclasses.field(default_factory=list)
    done: bool = False


@dataclasses.dataclass(eq=False)
class PromotePlan:
    """Copies into a faster memory tier: ``items[j] = (i, row, tier, slot)``.

    After a load the bytes come from the load's destinations; for a prefetch,
    ``keys[i]`` is read from ``sources[j]`` (``(tier, slot)``, ``slot=-1`` for NVMe).
    ``victims`` holds the slots' previous owners: their copies down into the
    next memory tier (``victims.copies``, done first) and their frees.
    """

    items: list[tuple[int, int, Tier, int]]
    victims: StorePlan = dataclasses.field(default_factory=lambda: StorePlan([], [], []))
    keys: list[bytes] = dataclasses.field(default_factory=list)
    sources: list[tuple[Tier, int]] = dataclasses.field(default_factory=list)
    leads: list[int] = dataclasses.field(default_factory=list)
    done: bool = False
