"""Write-through (durable) stores and restart repair for the daemon.

:func:`durable_store` is the daemon's put path when ``puts.durable`` is on:
:meth:`~tierstore.manager.TierManager.store_write_through` writes each block to
the NVMe tier first (:class:`~tierstore.io.SegmentStorage` acknowledges only
after O_DIRECT writes and fdatasync), then indexes it with an NVMe copy and
caches it in the fastest memory tier with room.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..errors import Status
from ..manager import TierManager


def durable_store(m: TierManager, ns: bytes, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
                  lifetime: str | None = None, first_position: int = 0) -> list[Status]:
    """Store blocks write-through to NVMe; see :meth:`TierManager.store_write_through`."""
    return m.store_write_through(ns, keys, blocks, lifetime, first_position)


def recovered_locations(m: TierManager) -> dict[bytes, tuple[bytes, int]]:
    """``key -> (namespace digest, write seq)`` of every block the NVMe backend holds."""
    return m.nvme.entries() if m.nvme is not None else {}


def nvme_next_seq(m: TierManager) -> int:
    """The sequence number the NVMe backend gives its next write (0 if unordered)."""
    return m.nvme.write_seq() if m.nvme is not None else 0


def repair_after_restart(m: TierManager, tombstones: dict[bytes, int]) -> int:
    """Drop recovered entries that were invalidated before the restart.

    Parameters
    ----------
    m : TierManager
        Freshly constructed over the recovered NVMe backend (its entries carry
        their namespace digests from the on-disk headers).
    tombstones : dict
        ``scope digest -> NVMe seq at invalidation``: blocks of that scope written
        with a smaller seq were invalidated before the restart (SegmentStorage
        deletes are volatile, so the daemon logs them).

    Returns
    -------
    int
        Entries dropped because of a tombstone.
    """
    stale = [k for k, (ns, seq) in recovered_locations(m).items()
             if (tomb := tombstones.get(ns)) is not None and seq < tomb]
    return m.remove(stale)
