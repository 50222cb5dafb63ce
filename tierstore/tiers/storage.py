"""The storage interfaces: key -> block bytes, under the NVMe tier and beside it (the remote tier).

The index, the mover and the API reach flash only through :class:`BlockStorage`, and the shared
remote tier only through :class:`RemoteBlockTier`; they call these methods and never probe for
them. A backend stores whole blocks of exactly ``block_bytes`` bytes under 32-byte keys and reports
per-block outcomes as :class:`~tierstore.errors.Status` values. It never raises for an expected
outcome (no space, a miss, a failed or corrupt read); it raises
:class:`~tierstore.errors.TierStoreError` subclasses only for misuse.

Rules every backend keeps (the index relies on them):

* ``put`` is all-or-nothing *per block*: a block whose status is not ``OK`` left no trace, and a
  block whose status is ``OK`` is readable until it is deleted or evicted.
* ``get`` writes into the caller's destination only bytes that passed the backend's integrity
  check; a block that fails returns ``IO_ERROR`` or ``MISS`` and must never be counted as loaded.
  A miss is always better than wrong KV.
* A backend owns its space (one owner per resource): when full, it evicts on its own terms and
  reports what left through the :class:`RegionListener`: ``on_reclaim(keys)`` asks which to keep,
  ``on_dropped(keys)`` tells what left.
* ``placements[i]`` is an opaque ``int | None`` stream tag (the FDP layer gives it meaning: a
  placement identifier). Backends without placement ignore it.

The NVMe backend is the log-structured segment store of :mod:`tierstore.io.segments`; the remote
backend is :class:`tierstore.remote.mooncake.MooncakeTier`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from ..errors import LayoutError, Status

__all__ = ["RegionListener", "StoredBlocks", "BlockStorage", "RemoteBlockTier"]


class RegionListener(Protocol):
    """What the block index hears from the region manager (Navy's
    ``BlockCache::onRegionReclaim`` / ``onRegionCleanup``)."""

    def on_reclaim(self, keys: list[bytes]) -> Sequence[bool]:
        """Which of a victim segment's live ``keys`` to keep (copy forward)."""

    def on_dropped(self, keys: list[bytes]) -> None:
        """``keys`` left the NVMe tier (evicted with their segment, or found corrupt)."""

    def pick_victims(self, n: int) -> list[bytes]:
        """Up to ``n`` blocks to evict now, in the NVMe eviction policy's order (a store with
        ``eviction_granularity: block``); the index forgets their NVMe copies before returning."""


class StoredBlocks(NamedTuple):
    """Every block a :class:`BlockStorage` holds (what a restarted index adopts).

    Attributes
    ----------
    keys : list of bytes
        32-byte block keys.
    ns_digests : list of bytes
        32-byte namespace digest of each key (``bytes(32)`` where the backend records none).
    write_seqs : numpy.ndarray
        ``int64`` write sequence number of each key (larger = later; 0 where writes are unordered).
    """

    keys: list[bytes]
    ns_digests: list[bytes]
    write_seqs: np.ndarray


def _one_fragment_each(
    keys: Sequence[bytes], tensors: Sequence[torch.Tensor], noun: str
) -> list[list[torch.Tensor]]:
    """``[[t] for t in tensors]``: whole blocks as one fragment each.

    Raises
    ------
    LayoutError
        When ``keys`` and ``tensors`` differ in number (``noun`` names the tensors in the message).
    """
    if len(keys) != len(tensors):
        raise LayoutError(f"{len(keys)} keys but {len(tensors)} {noun}")
    return [[t] for t in tensors]


class BlockStorage(abc.ABC):
    """Abstract key -> block storage (SGLang's L3 "storage": hash -> bytes); the NVMe tier's seam.

    A backend implements the abstract methods; every other method has a default that is correct
    (if slower or weaker) for any backend, stated in its docstring.

    Attributes
    ----------
    block_bytes : int
        Size of every stored block in bytes.
    """

    block_bytes: int
    #: ``"region"`` or ``"block"``: whether the backend asks its listener for single victims
    #: (:meth:`RegionListener.pick_victims`); the index then keeps an NVMe eviction order.
    eviction_granularity: str = "region"

    @abc.abstractmethod
    def capacity_blocks(self) -> int:
        """Blocks the backend can hold when empty."""

    def free_blocks(self) -> int:
        """Blocks that a ``put`` can take now without evicting anything (informational; default 0)."""
        return 0

    def set_listener(self, listener: RegionListener | None) -> None:
        """Attach the block index. Default: kept and never called (a backend that never evicts)."""
        self._listener = listener

    @abc.abstractmethod
    def put_fragments(
        self,
        keys: Sequence[bytes],
        fragments_per_block: Sequence[Any],
        placements: Sequence[int | None] | None = None,
        ns_digests: Sequence[bytes] | None = None,
    ) -> list[Status]:
        """Store blocks given as fragments, without a contiguous copy.

        Parameters
        ----------
        keys : sequence of bytes
            32-byte block hashes.
        fragments_per_block : sequence
            Per block, a list of tensors (any dtype or shape, contiguous or not) whose byte sizes sum
            to ``block_bytes``, or a source :class:`~tierstore.io.pages.FragmentPlan`.
        placements : sequence of int or None, optional
            Opaque placement tag per block.
        ns_digests : sequence of bytes, optional
            32-byte namespace digest per block (recorded where the backend persists blocks).

        Returns
        -------
        list of Status
            ``OK``, ``EXISTS`` (already stored), ``NO_SPACE`` or ``IO_ERROR`` per block.
        """

    @abc.abstractmethod
    def get_fragments(
        self,
        keys: Sequence[bytes],
        dest_fragments_per_block: Sequence[Any],
        gate: Callable[[list[int]], Any] | None = None,
    ) -> list[Status]:
        """Load blocks into destination fragments.

        Parameters
        ----------
        keys : sequence of bytes
            As :meth:`put_fragments`.
        dest_fragments_per_block : sequence
            Per block, writable tensors whose byte sizes sum to ``block_bytes``, or a destination
            :class:`~tierstore.io.pages.FragmentPlan`.
        gate : callable, optional
            ``gate(indices)`` returns a context manager entered around each copy into the
            destinations of the blocks at ``indices``; it yields ``False`` when the caller gave up
            (a deadline passed): those blocks are then ``MISS`` and their destinations untouched.

        Returns
        -------
        list of Status
            ``OK`` (bytes verified and copied), ``MISS`` or ``IO_ERROR`` per block.
        """

    def put(
        self,
        keys: Sequence[bytes],
        blocks: Sequence[torch.Tensor],
        placements: Sequence[int | None] | None = None,
        ns_digests: Sequence[bytes] | None = None,
    ) -> list[Status]:
        """Store whole blocks: each a contiguous 1-D ``uint8`` tensor of ``block_bytes``.

        Default: :meth:`put_fragments` with one fragment per block. Statuses as there.

        Raises
        ------
        LayoutError
            When the numbers of keys and blocks differ, or a block is not a 1-D ``uint8`` tensor.
        """
        fragments_per_block = _one_fragment_each(keys, blocks, "blocks")
        for b in blocks:
            if not isinstance(b, torch.Tensor) or b.dtype != torch.uint8 or b.dim() != 1:
                raise LayoutError("each block must be a 1-D uint8 tensor")
        return self.put_fragments(keys, fragments_per_block, placements, ns_digests)

    def get(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor]) -> list[Status]:
        """Read whole blocks into ``dests`` (each a contiguous ``uint8`` tensor of ``block_bytes``).

        Default: :meth:`get_fragments` with one fragment per block. Statuses as there;
        :class:`~tierstore.errors.LayoutError` as :meth:`put` (keys and destinations differ in number).
        """
        return self.get_fragments(keys, _one_fragment_each(keys, dests, "destinations"))

    @abc.abstractmethod
    def delete(self, keys: Iterable[bytes]) -> None:
        """Forget blocks; unknown keys are ignored. Space may be reclaimed later."""

    @abc.abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored."""

    def touch(self, keys: Sequence[bytes]) -> None:  # noqa: B027 (optional hook)
        """Record a hit on ``keys`` (region recency: Navy's ``RegionManager::touch``). Default: nothing."""

    @abc.abstractmethod
    def scan(self) -> StoredBlocks:
        """Every stored block with its namespace and write order (what a restarted index adopts).

        Persistent backends return what their on-disk records hold, so a restarted index gets each
        block's namespace back.
        """

    def keys(self) -> list[bytes]:
        """Keys currently stored (default: from :meth:`scan`)."""
        return list(self.scan().keys)

    def entries(self) -> dict[bytes, tuple[bytes, int]]:
        """``key -> (namespace digest, write sequence number)`` of every stored block (default: from
        :meth:`scan`)."""
        got = self.scan()
        return {k: (ns, int(seq)) for k, ns, seq in zip(got.keys, got.ns_digests, got.write_seqs.tolist())}

    def invalidate_namespace(self, ns_digest: bytes) -> int:
        """Drop every block of namespace ``ns_digest``; returns the blocks dropped.

        A persistent backend makes this durable (after a restart nothing of the namespace is served
        again: :meth:`tierstore.io.segments.SegmentStorage.invalidate_namespace`). Default: deletes
        the namespace's keys found by :meth:`scan`, which is durable only where ``delete`` is.

        Raises
        ------
        LayoutError
            If ``ns_digest`` is not 32 bytes.
        """
        ns_digest = bytes(ns_digest)
        if len(ns_digest) != 32:
            raise LayoutError("ns_digest must be 32 bytes")
        got = self.scan()
        keys = [k for k, ns in zip(got.keys, got.ns_digests) if ns == ns_digest]
        self.delete(keys)
        return len(keys)

    def compact(self) -> bool:
        """Free space now (evict or compact one region); ``True`` if some was freed. Default: ``False``."""
        return False

    def write_seq(self) -> int:
        """Sequence number the next write will get (default 0: writes are unordered)."""
        return 0

    def stats(self) -> dict[str, Any]:
        """Backend counters (bytes written/read, host write amplification, ...); default ``{}``."""
        return {}

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Flush and release resources (default: nothing to release)."""

    def __len__(self) -> int:
        """Blocks stored (default: from :meth:`scan`)."""
        return len(self.scan().keys)


class RemoteBlockTier(abc.ABC):
    """A shared tier beside NVMe (the cluster's memory): the interface the core uses.

    Narrower than :class:`BlockStorage`, because the tier is shared and remote: blocks may vanish at
    any time (evicted by the cluster, their holder died), so there is no listener, no ``scan``, no
    namespaces (the key carries the namespace) and no capacity; publication is asynchronous. Per
    method, where the two differ:

    ========================= ========================================== ==============================
    remote                    Status semantics                           local counterpart
    ========================= ========================================== ==============================
    ``exists_prefix(keys)``   leading keys present; 0 when degraded      ``contains`` per key
    ``get_into(keys, dests)`` ``OK`` verified / ``MISS`` / ``IO_ERROR``  ``get`` (same statuses)
    ``put(keys, blocks)``     ``OK`` queued (not yet durable),           ``put`` (``OK``: stored)
                              ``EXISTS`` published recently,
                              ``REJECTED`` dropped (queue full, ...)
    ``remove(keys)``          best effort, in the background            ``delete``
    ========================= ========================================== ==============================

    ``REJECTED`` is the one status the local interface does not return. Every method returns within
    about the tier's call timeout and never raises for an expected outcome.

    Attributes
    ----------
    block_bytes : int
        Size of every block in bytes.
    """

    block_bytes: int

    @abc.abstractmethod
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the tier holds now (0 when the tier is unreachable)."""

    def contains(self, key: bytes) -> bool:
        """Whether the tier holds ``key`` (default: :meth:`exists_prefix` of one key)."""
        return self.exists_prefix([key]) == 1

    @abc.abstractmethod
    def get_into(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor]) -> list[Status]:
        """Load blocks into ``dests`` (contiguous CPU tensors of ``block_bytes``); a destination
        outside a :meth:`register_memory` region is written only with verified bytes.
        Returns ``OK``, ``MISS`` or ``IO_ERROR`` per block."""

    def put(
        self,
        keys: Sequence[bytes],
        blocks: Sequence[torch.Tensor],
        ns_digests: Sequence[bytes] | None = None,
        *,
        copy: bool = False,
        recent: bool = True,
    ) -> list[Status]:
        """Queue blocks for publication (asynchronous; returns after at most a memory copy).

        ``ns_digests``: accepted for :meth:`BlockStorage.put`'s shape and ignored (the key carries
        the namespace). ``copy``: copy even from a registered region (the owner reuses it at once).
        ``recent``: a key published recently is ``EXISTS``. Returns ``OK`` (queued), ``EXISTS`` or
        ``REJECTED``. Runs :meth:`_put` with these defaults applied.
        """
        return self._put(keys, blocks, copy, recent)

    @abc.abstractmethod
    def _put(
        self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor], copy: bool, recent: bool
    ) -> list[Status]:
        """:meth:`put`'s work, every option given: what an implementation provides."""

    @abc.abstractmethod
    def remove(self, keys: Sequence[bytes]) -> None:
        """Remove blocks from the tier in the background (best effort; unknown keys ignored)."""

    @abc.abstractmethod
    def register_memory(
        self,
        tensor: torch.Tensor,
        on_hold: Callable[[int, int], None],
        on_release: Callable[[int, int], None],
    ) -> object:
        """Register memory (the host tier's pool) for zero-copy loads and publishes; the tier calls
        ``on_hold(offset, nbytes)`` while it may still touch a range and ``on_release`` after."""

    def set_load_observer(self, fn: Callable[[int, float], None] | None) -> None:  # noqa: B027 (optional hook)
        """Call ``fn(blocks, seconds)`` after each load that delivered blocks (the cost model prices
        remote loads from these). Default: never called (the declared figures stay)."""

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued block has been published or dropped; ``False`` if some are
        still queued after ``timeout_s``. Default: ``True`` (nothing is queued)."""
        return True

    @property
    @abc.abstractmethod
    def state(self) -> str:
        """``connecting``, ``ok``, ``degraded`` or ``closed``."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters and state."""

    @abc.abstractmethod
    def close(self) -> None:
        """Publish what is queued (bounded wait), stop and release; idempotent."""
