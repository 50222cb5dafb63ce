#!/usr/bin/env python
"""Offline references for any trace and capacity: one flat LRU cache and Belady's MIN.

The command line of :mod:`tierstore.bench.references` (what each reference is, and its source, is
there): the hit ratio of one flat LRU cache, of Belady's MIN and of an infinite cache, all of the
same total blocks, under tierstore's exact-hit rule.

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
import sys
from collections.abc import Sequence

from tierstore.bench.references import chain_keys, references, replay_capacity_blocks
from tierstore.trace import read_mooncake
from tierstore.units import parse_size


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
        caps.append(
            replay_capacity_blocks(
                bb,
                *(
                    parse_size(x or 0, n)
                    for x, n in (
                        (a.hbm_size, "hbm_size"),
                        (a.host_size, "host_size"),
                        (a.nvme_size, "nvme_size"),
                    )
                ),
            )
        )
    if not caps:
        caps = [int(uniq * 0.1), int(uniq * 0.4)]
    rows = [references(reqs, c, ks) for c in caps]
    print(
        f"trace {a.trace or 'packaged excerpt'}: {len(reqs)} requests, {uniq} unique full blocks "
        "(offline references, full-block prefix rule)"
    )
    print("| capacity blocks | of unique | flat LRU | Belady MIN | infinite |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['capacity_blocks']:,} | {r['capacity_fraction']:.3f} | {r['flat_lru']:.4f} | "
            f"{r['belady']:.4f} | {r['infinite']:.4f} |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"trace": a.trace, "requests": len(reqs), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
