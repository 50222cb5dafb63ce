"""Restart repair for invalidations recorded by daemons before the store logged them.

Older daemons kept their own invalidation log (``state_dir/invalidations.jsonl``,
``scope -> NVMe write seq``); the NVMe tier now records invalidations itself
(:meth:`tierstore.io.segments.SegmentStorage.invalidate_namespace`). This module
applies the old log once at start-up, so blocks invalidated before an upgrade
are never served.
"""

from __future__ import annotations


def repair_after_restart(store, tombstones: dict[bytes, int]) -> int:
    """Drop recovered blocks of a scope written before its logged invalidation.

    Parameters
    ----------
    store : tierstore.api.KVStore
        Freshly opened over the recovered NVMe tier.
    tombstones : dict
        ``scope digest -> NVMe seq at invalidation``.

    Returns
    -------
    int
        Blocks dropped because of a tombstone.
    """
    if store.nvme is None or not tombstones:
        return 0
    keys, nss, seqs = store.nvme.scan()
    stale = [
        k
        for k, ns, seq in zip(keys, nss, seqs.tolist())
        if (tomb := tombstones.get(ns)) is not None and seq < tomb
    ]
    return store.remove(stale) if stale else 0
