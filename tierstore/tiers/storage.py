"""The L3 seam: key -> bytes block storage under the NVMe tier.

The tier manager talks to flash only through :class:`BlockStorage`. A backend
stores whole blocks of exactly ``block_bytes`` bytes under 32-byte keys and
reports per-block outcomes as :class:`~tierstore.errors.Status` values. It never
raises for an expected outcome (no space, a miss, a failed or corrupt read);
it raises :class:`~tierstore.errors.TierStoreError` subclasses only for misuse.

Rules every backend keeps (the manager relies on them):

* ``put`` is all-or-nothing *per block*: a block whose status is not ``OK`` left
  no trace, and a block whose status is ``OK`` is readable until ``delete``.
* ``get`` writes into the caller's destination only bytes that passed the
  backend's integrity check; a block that fails returns ``IO_ERROR`` or ``MISS``
  and must never be counted as loaded. A miss is always better than wrong KV.
* ``placements[i]`` is an opaque ``int | None`` stream tag (the FDP layer gives
  it meaning: a placement identifier). Backends without placement ignore it.

Two backends exist: :class:`tierstore.tiers.nvme.SlotFileStorage` (fixed slots
in one O_DIRECT file, the simple path), and the log-structured segment store of
:mod:`tierstore.io` (batched extents, manifest, crash recovery).
"""
from __future__ import annotations

import abc
from typing import Iterable, Sequence

import torch

from ..errors import Status


class BlockStorage(abc.ABC):
    """Abstract key -> block storage (SGLang's L3 "storage": hash -> bytes).

    Attributes
    ----------
    block_bytes : int
        Size of every stored block in bytes.
    """

    block_bytes: int

    @abc.abstractmethod
    def capacity_blocks(self) -> int:
        """Blocks the backend can hold when empty."""

    @abc.abstractmethod
    def free_blocks(self) -> int:
        """Blocks that a ``put`` can take now without deleting anything."""

    @abc.abstractmethod
    def put(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
            placements: Sequence[int | None] | None = None,
            ns_digests: Sequence[bytes] | None = None) -> list[Status]:
        """Store blocks.

        Parameters
        ----------
        keys : sequence of bytes
            32-byte block hashes.
        blocks : sequence of torch.Tensor
            Each a contiguous 1-D ``uint8`` CPU (or CUDA, where the backend
            supports it) tensor of ``block_bytes`` bytes.
        placements : sequence of int or None, optional
            Opaque placement tag per block.
        ns_digests : sequence of bytes, optional
            32-byte namespace digest per block, recorded in on-disk headers.

        Returns
        -------
        list of Status
            ``OK``, ``EXISTS`` or ``NO_SPACE``/``IO_ERROR`` per block.
        """

    @abc.abstractmethod
    def get(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor]) -> list[Status]:
        """Read blocks into ``dests`` (each a contiguous ``uint8`` tensor of
        ``block_bytes``). Returns ``OK``, ``MISS`` or ``IO_ERROR`` per block."""

    @abc.abstractmethod
    def delete(self, keys: Iterable[bytes]) -> None:
        """Forget blocks; unknown keys are ignored. Space may be reclaimed later."""

    @abc.abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored."""

    def reclaim_group(self, key: bytes) -> list[bytes] | None:
        """Keys that share ``key``'s unit of space reclaim (a log segment / reclaim
        unit), or ``None`` when space is reclaimed per block. The manager evicts
        whole groups so flash space is freed a reclaim unit at a time (CacheLib
        Navy's region eviction)."""
        return None

    def keys(self) -> list[bytes]:
        """Keys currently stored (used to rebuild the index after a restart)."""
        return []

    def entries(self) -> dict[bytes, tuple[bytes, int]]:
        """``key -> (namespace digest, write sequence number)`` of every stored block.

        Persistent backends return what their on-disk headers record, so a
        restarted manager gets each block's namespace back. The sequence number
        orders writes (larger = later); 0 where the backend keeps no order.
        """
        return {k: (bytes(32), 0) for k in self.keys()}

    def write_seq(self) -> int:
        """Sequence number the next write will get (0 where writes are unordered)."""
        return 0

    def stats(self) -> dict:
        """Backend counters (bytes written/read, host write amplification, ...)."""
        return {}

    def close(self) -> None:
        """Flush and release resources."""
