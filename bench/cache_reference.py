#!/usr/bin/env python
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

The functions live in :mod:`tierstore.bench.references` (importable without
path tricks); this script is their command line and re-exports them.

Usage::

    python bench/cache_reference.py --trace /work/shared/traces/mooncake_conversation_trace.jsonl \\
        --hbm-size 28m --host-size 112m --nvme-size 420m --block-bytes 32k
    python bench/cache_reference.py --trace T.jsonl --fractions 0.05,0.1,0.4   # of the unique bytes
    python bench/cache_reference.py --trace T.jsonl --capacity-blocks 17920 --json ref.json

``--hbm-size/--host-size/--nvme-size`` take the same values as ``tierstore bench
--rw=kvtrace`` (so the block count is the replay's: each tier rounded down to
whole blocks); ``--fractions`` takes fractions of the trace's unique full-block
bytes (the replay's default sizing, 2 % + 8 % + 30 % = 40 %).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Sequence

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tierstore.bench.references import (  # noqa: E402,F401  (re-exported for bench/policy_grid.py and older callers)
    belady_hit_ratio, chain_keys, distance, flat_lru_hit_ratio, references, replay_capacity_blocks)
from tierstore.trace import read_mooncake  # noqa: E402
from tierstore.units import parse_size  # noqa: E402

__all__ = ["chain_keys", "flat_lru_hit_ratio", "belady_hit_ratio", "references", "replay_capacity_blocks",
           "distance", "main"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=None, help="Mooncake-format JSONL (default: the packaged excerpt)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--block-bytes", default="32k", help="bytes per 512-token block (as --trace_block_size)")
    ap.add_argument("--hbm-size", default=None)
    ap.add_argument("--host-size", default=None)
    ap.add_argument("--nvme-size", default=None)
    ap.add_argument("--fractions", default=None, help="comma-separated fractions of the unique bytes")
    ap.add_argument("--capacity-blocks", default=None, help="comma-separated block counts")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    reqs = read_mooncake(a.trace, a.limit)
    ks = chain_keys(reqs)
    uniq = len({k for r in ks for k in r})
    bb = parse_size(a.block_bytes, "block_bytes")
    caps: list[int] = []
    if a.capacity_blocks:
        caps += [int(x) for x in a.capacity_blocks.split(",")]
    if a.fractions:
        # as the replay sizes default tiers: each fraction of the unique bytes, whole blocks
        caps += [int(uniq * float(f)) for f in a.fractions.split(",")]
    if a.hbm_size or a.host_size or a.nvme_size:
        caps.append(replay_capacity_blocks(bb, *(parse_size(x or 0, n) for x, n in
                                                 ((a.hbm_size, "hbm_size"), (a.host_size, "host_size"),
                                                  (a.nvme_size, "nvme_size")))))
    if not caps:
        caps = [int(uniq * 0.1), int(uniq * 0.4)]
    rows = [references(reqs, c, ks) for c in caps]
    print(f"trace {a.trace or 'packaged excerpt'}: {len(reqs)} requests, {uniq} unique full blocks "
          "(offline references, full-block prefix rule)")
    print("| capacity blocks | of unique | flat LRU | Belady MIN | infinite |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['capacity_blocks']:,} | {r['capacity_fraction']:.3f} | {r['flat_lru']:.4f} | "
              f"{r['belady']:.4f} | {r['infinite']:.4f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"trace": a.trace, "requests": len(reqs), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
