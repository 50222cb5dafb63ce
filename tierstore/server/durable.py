"""Write-through (durable) stores and restart repair for the daemon.

:func:`durable_store` is the daemon's put path when ``puts.durable`` is on: each
block is first written to the NVMe tier (:class:`~tierstore.io.SegmentStorage`
acknowledges only after O_DIRECT writes and fdatasync), then indexed with an
NVMe copy and cached in the fastest memory tier with room. Evicting the cached
copy later writes nothing (a lower copy exists).

This reaches into :class:`~tierstore.manager.TierManager` internals (its lock,
index, pools and policies) in the same way as ``TierManager.store`` does. It
lives here so the daemon does not change the shared manager; it would fit
better as a ``TierManager.store(..., write_through=True)`` option.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..errors import InvariantError, Status
from ..fdp.lifetime import class_from_hint
from ..manager import Entry, Tier, TierManager


def durable_store(m: TierManager, ns: bytes, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
                  lifetime: str | None = None, first_position: int = 0) -> list[Status]:
    """Store blocks write-through to NVMe.

    Parameters
    ----------
    m : TierManager
        A manager with an NVMe tier.
    ns : bytes
        32-byte namespace (scope) digest.
    keys : sequence of bytes
        Block keys.
    blocks : sequence of torch.Tensor
        1-D contiguous CPU ``uint8`` tensors of ``m.block_bytes`` each.
    lifetime : str, optional
        Placement hint (``"system"``, ``"conversation"``, ``"query"``).
    first_position : int
        Chain position of ``keys[0]``.

    Returns
    -------
    list of Status
        ``OK`` (newly durable), ``EXISTS`` (already durable), ``NO_SPACE`` or
        ``IO_ERROR`` per block. Only ``OK``/``EXISTS`` blocks are acknowledged.

    Raises
    ------
    InvariantError
        If the manager has no NVMe tier.
    """
    if m.nvme is None:
        raise InvariantError("durable_store needs an NVMe tier")
    n = len(keys)
    out: list[Status | None] = [None] * n
    hint = class_from_hint(lifetime)
    todo: list[int] = []
    with m._lock:
        for i, k in enumerate(keys):
            e = m.index.get(k)
            if e is not None and Tier.NVME in e.slots:
                out[i] = Status.EXISTS
            else:
                todo.append(i)
        if todo:
            # evict NVMe victims now (protect this batch); the backend reports NO_SPACE per block otherwise
            m._make_room(Tier.NVME, len(todo), set(keys))
    if todo:
        place = m.config.placement_of
        pid = place(hint) if (place is not None and hint is not None) else None
        try:
            st = m.nvme.put([keys[i] for i in todo], [blocks[i] for i in todo], [pid] * len(todo),
                            [ns] * len(todo))
        except OSError:
            st = [Status.IO_ERROR] * len(todo)
    else:
        st = []
    mem_tiers = [t for t in m.tiers if t != Tier.NVME]
    with m._lock:
        now = m._now()
        for i, s in zip(todo, st):
            k = keys[i]
            if s not in (Status.OK, Status.EXISTS):
                out[i] = s
                m.metrics.inc(f"store_{s.value}")
                continue
            e = m.index.get(k)
            if e is None:
                e = Entry(key=k, ns=ns, position=first_position + i, size_bytes=m.block_bytes, slots={},
                          created_s=now, last_access_s=now, lifetime=hint)
                e.nvme_class = hint
                for t in mem_tiers:
                    if not m._make_room(t, 1, {k}):
                        continue
                    slot = m.pools[t].allocate()
                    if slot is None:
                        continue
                    m.pools[t].view(slot).copy_(blocks[i])
                    e.slots[t] = slot
                    m.policies[t].on_insert(e, now)
                    break
                e.slots[Tier.NVME] = -1
                m.policies[Tier.NVME].on_insert(e, now)
                m.index[k] = e
                out[i] = Status.OK
                m.metrics.inc("store_ok")
                m.metrics.inc("store_bytes_nvme", m.block_bytes)
                m.metrics.inc("nvme_write_bytes", m.block_bytes)
            else:
                if Tier.NVME not in e.slots:
                    e.slots[Tier.NVME] = -1
                    m.policies[Tier.NVME].on_insert(e, now)
                    m.metrics.inc("nvme_write_bytes", m.block_bytes)
                out[i] = Status.EXISTS
                m.metrics.inc("store_exists")
    return [s if s is not None else Status.IO_ERROR for s in out]


def recovered_locations(m: TierManager) -> dict[bytes, tuple[bytes, int]]:
    """``key -> (namespace digest, extent seq)`` of every block the NVMe backend recovered.

    Reads :class:`~tierstore.io.SegmentStorage`'s index (the on-disk entries
    carry the namespace digest; ``TierManager._adopt_nvme_keys`` does not keep
    it). Empty for other backends.
    """
    idx = getattr(m.nvme, "_index", None)
    lock = getattr(m.nvme, "_lock", None)
    if idx is None or lock is None:
        return {}
    with lock:
        return {k: (loc.ns, loc.seq) for k, loc in idx.items()}


def nvme_next_seq(m: TierManager) -> int:
    """The sequence number the NVMe backend gives its next extent (0 if unknown)."""
    return int(getattr(m.nvme, "_next_seq", 0))


def repair_after_restart(m: TierManager, tombstones: dict[bytes, int]) -> int:
    """Give recovered entries their namespace back and drop invalidated ones.

    Parameters
    ----------
    m : TierManager
        Freshly constructed over the recovered NVMe backend.
    tombstones : dict
        ``scope digest -> NVMe seq at invalidation``: blocks of that scope written
        in an extent with a smaller seq were invalidated before the restart
        (SegmentStorage deletes are volatile, so the daemon logs them).

    Returns
    -------
    int
        Entries dropped because of a tombstone.
    """
    locs = recovered_locations(m)
    dropped = 0
    with m._lock:
        for k, (ns, seq) in locs.items():
            e = m.index.get(k)
            if e is None:
                continue
            if e.ns == b"":
                e.ns = ns
            tomb = tombstones.get(ns)
            if tomb is not None and seq < tomb:
                m._remove_entry(e)
                dropped += 1
    return dropped
