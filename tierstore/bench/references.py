"""Offline references for any trace and capacity: one flat LRU cache and Belady's MIN.

Every capacity experiment reports its distance to two references of the *same
total blocks* (all tiers together), computed offline from the trace alone,
under tierstore's exact-hit rule (only full 512-token blocks are stored, and a
request hits only the longest leading run of its blocks that is resident):

* ``flat_lru`` -- one LRU cache of ``capacity_blocks``. Per request: count the
  resident leading run (the hits), then touch every full block of the request
  in chain order (a hit moves to the MRU end, a miss is inserted there, the LRU
  end is evicted when full). This is what a single-tier cache that admits every
  block does.
* ``belady`` -- Belady's MIN (L. A. Belady, "A study of replacement algorithms
  for a virtual-storage computer", IBM Systems Journal 5(2), 1966) with bypass:
  on a miss the block is inserted only if its next use comes before that of
  some resident block, and the resident block used furthest in the future is
  evicted (a block never used again first; ties: the deepest chain position,
  since losing a leading block breaks the chain behind it). Optimal for a
  demand cache with per-block hits; under the prefix rule it is the usual
  offline bound, not a proof of optimality.
* ``infinite`` -- no capacity limit (:func:`tierstore.trace.ideal_hit_ratio`).

Blocks are identified by their prefix chain (a block id at position ``i``
after the same ``i`` ids), exactly the chained keys the replay stores.

The command line is ``bench/cache_reference.py``; the offline simulator
``bench/frontier_sim.py`` and the policy grid use these functions.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence

from ..trace import TraceRequest, ideal_hit_ratio

__all__ = [
    "chain_keys",
    "flat_lru_hit_ratio",
    "belady_hit_ratio",
    "references",
    "replay_capacity_blocks",
    "distance",
]

_NEVER = float("inf")


def chain_keys(requests: Sequence[TraceRequest]) -> list[list[int]]:
    """Per request, one integer per full block naming its prefix chain (equal
    ints = equal chained keys of the replay)."""
    ids: dict[tuple[int, int], int] = {}
    out = []
    for r in requests:
        prev = -1
        ks = []
        for h in r.hash_ids[: r.full_blocks()]:
            k = ids.get((prev, h))
            if k is None:
                k = ids[(prev, h)] = len(ids)
            ks.append(k)
            prev = k
        out.append(ks)
    return out


def _hits(keys: list[int], resident) -> int:
    n = 0
    for k in keys:
        if k not in resident:
            break
        n += 1
    return n


def flat_lru_hit_ratio(keys_per_request: list[list[int]], capacity_blocks: int) -> float:
    """Block hit ratio of one flat LRU cache of ``capacity_blocks`` (module doc)."""
    lru: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for ks in keys_per_request:
        hit += _hits(ks, lru)
        total += len(ks)
        for k in ks:
            if k in lru:
                lru.move_to_end(k)
            else:
                lru[k] = None
                if len(lru) > capacity_blocks:
                    lru.popitem(last=False)
    return hit / total if total else 0.0


def belady_hit_ratio(keys_per_request: list[list[int]], capacity_blocks: int) -> float:
    """Block hit ratio of Belady's MIN with bypass at ``capacity_blocks`` (module doc)."""
    # next use (request index) of each occurrence, computed backwards
    nxt_of: list[list[float]] = [None] * len(keys_per_request)  # type: ignore[list-item]
    last: dict[int, float] = {}
    for i in range(len(keys_per_request) - 1, -1, -1):
        ks = keys_per_request[i]
        nxt_of[i] = [last.get(k, _NEVER) for k in ks]
        for k in ks:
            last[k] = i
    resident: dict[int, tuple[float, int]] = {}  # key -> (next use, position)
    heap: list[tuple[float, int, int]] = []  # max-heap by (next use, position): (-next, -pos, key)
    hit = total = 0
    for i, ks in enumerate(keys_per_request):
        hit += _hits(ks, resident)
        total += len(ks)
        for pos, (k, nu) in enumerate(zip(ks, nxt_of[i])):
            if k in resident:
                resident[k] = (nu, pos)
                heapq.heappush(heap, (-nu, -pos, k))
                continue
            if nu == _NEVER:
                continue  # bypass: never used again
            if len(resident) >= capacity_blocks:
                # furthest resident (lazy deletion of stale heap entries)
                while heap:
                    fnu, fpos, fk = heap[0]
                    if resident.get(fk) == (-fnu, -fpos):
                        break
                    heapq.heappop(heap)
                if not heap or (-heap[0][0], -heap[0][1]) <= (nu, pos):
                    continue  # bypass: used later than everything resident
                _, _, fk = heapq.heappop(heap)
                del resident[fk]
            resident[k] = (nu, pos)
            heapq.heappush(heap, (-nu, -pos, k))
        if len(heap) > 4 * max(capacity_blocks, 1024):  # compact stale entries
            heap = [(-v[0], -v[1], k) for k, v in resident.items()]
            heapq.heapify(heap)
    return hit / total if total else 0.0


def replay_capacity_blocks(block_bytes: int, hbm_bytes: int, host_bytes: int, nvme_bytes: int) -> int:
    """Total blocks of the three tiers as the replay sizes them (each rounded down to whole blocks)."""
    return hbm_bytes // block_bytes + host_bytes // block_bytes + nvme_bytes // block_bytes


def references(
    requests: Sequence[TraceRequest], capacity_blocks: int, keys_per_request: list[list[int]] | None = None
) -> dict:
    """The three references at ``capacity_blocks``.

    Returns
    -------
    dict
        ``capacity_blocks``, ``unique_blocks``, ``capacity_fraction`` (of the
        unique full blocks), ``lookup_blocks`` (full blocks looked up, the
        denominator of every ratio: hits = ratio x lookup_blocks), ``flat_lru``,
        ``belady``, ``infinite`` (block hit ratios under the full-block prefix
        rule).
    """
    ks = keys_per_request if keys_per_request is not None else chain_keys(requests)
    uniq = len({k for r in ks for k in r})
    return {
        "capacity_blocks": int(capacity_blocks),
        "unique_blocks": uniq,
        "lookup_blocks": sum(len(r) for r in ks),
        "capacity_fraction": capacity_blocks / max(1, uniq),
        "flat_lru": flat_lru_hit_ratio(ks, capacity_blocks),
        "belady": belady_hit_ratio(ks, capacity_blocks),
        "infinite": ideal_hit_ratio(list(requests)),
    }


def distance(hit_ratio: float, ref: dict) -> dict:
    """Where ``hit_ratio`` lies between the references: ``vs_flat_lru`` (difference),
    ``vs_belady`` (difference) and ``gap_closed`` = (hit - LRU) / (Belady - LRU)
    (1.0: Belady reached; 0.0: no better than flat LRU; negative: below it)."""
    span = ref["belady"] - ref["flat_lru"]
    return {
        "vs_flat_lru": hit_ratio - ref["flat_lru"],
        "vs_belady": hit_ratio - ref["belady"],
        "gap_closed": (hit_ratio - ref["flat_lru"]) / span if span > 0 else float("nan"),
    }
