#!/usr/bin/env python3
"""Region against per-block eviction on the NVMe tier, through the real store (issue 26 item 1).

Replays a trace (default: the packaged excerpt) with :func:`tierstore.replay.run_replay` onto
``device: sim`` (the FTL model of :mod:`tierstore.fdp.ftl`, **not an SSD**) once per
configuration of :data:`CONFIGS` and prints, per configuration: saved prefill tokens, NVMe hit
blocks, the bytes the index asked NVMe to keep, the bytes the tier wrote (user + GC
copy-forward), the bytes it deallocated, block evictions, GC-evicted blocks, segments reset,
and the FTL model's device WAF and end-to-end WA. Every figure is a deterministic count (trace
time, no timing), so the host's load does not change it.

Usage (from a checkout; ``PYTHONPATH`` naming it when another tierstore is installed)::

    python bench/block_eviction_replay.py [--limit N] [--trace T.jsonl] [--util 0.9] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from tierstore.replay import ReplayConfig, run_replay

#: ``name -> (what, ReplayConfig overrides)``; every one on ``device: sim`` at ``--util``.
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "region": ("region lru (today's default)", {}),
    "block": (
        "per-block lru, live 0.9, GC keeps blocks hit since written (clock)",
        {"policies": {"reinsert": "clock"}, "nvme": {"eviction_granularity": "block"}},
    ),
    "block-fdp": (
        "per-block lru as 'block', FDP placement by class (hint), RUH Update",
        {
            "policies": {"reinsert": "clock", "classifier": "hint"},
            "nvme": {"eviction_granularity": "block", "fdp": {"enabled": True}},
        },
    ),
}


def run(name: str, trace: str | None, limit: int | None, util: float) -> dict:
    """One configuration's counts (module doc)."""
    what, over = CONFIGS[name]
    nv = {"device": "sim", "engine": "memory", "model": {"utilization": util}, **over.get("nvme", {})}
    t0 = time.perf_counter()
    rep = run_replay(
        ReplayConfig(trace=trace, limit=limit, nvme_options=nv, policies=over.get("policies", {}))
    )
    kv, d = rep.kv, rep.device
    nb = rep.final_stats.get("nvme_backend", {})
    return {
        "config": name,
        "what": what,
        "util": util,
        "requests": kv["requests"],
        "saved_prefill_tokens": kv["saved_prefill_tokens"],
        "hit_blocks_nvme": kv["hit_blocks_nvme"],
        "nvme_write_bytes": kv["nvme_write_bytes"],
        "user_bytes_written": nb.get("user_bytes_written"),
        "gc_bytes_written": nb.get("gc_bytes_written"),
        "trimmed_bytes": nb.get("trimmed_bytes", 0),
        "block_evictions": nb.get("block_evictions", 0),
        "gc_evicted_blocks": nb.get("gc_evicted_blocks", 0),
        "region_evicted_blocks": nb.get("region_evicted_blocks"),
        "segments_reset": nb.get("segments_reset"),
        "live_budget_blocks": nb.get("live_budget_blocks"),
        "device_waf_ftl_model": d.get("waf"),
        "e2e_wa_ftl_model": d.get("e2e_wa"),
        "wrong_kv_blocks": kv["wrong_kv_blocks"],
        "wall_s": round(time.perf_counter() - t0, 1),
        "loadavg": os.getloadavg(),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=None, help="Mooncake JSONL trace (default: the packaged excerpt)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--util", type=float, default=0.9, help="the tier's share of the modelled device")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rows = [run(n, a.trace, a.limit, a.util) for n in a.configs.split(",")]
    print("(FTL model, not an SSD)")
    print(
        "| config | saved prefill tokens | NVMe hit blocks | NVMe bytes kept | tier bytes written (user + "
        "GC) | "
        "trimmed bytes | block evictions | GC evicted | device WAF (FTL model) | e2e WA (FTL model) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['config']} | {r['saved_prefill_tokens']:,} | {r['hit_blocks_nvme']:,} | "
            f"{r['nvme_write_bytes']:,} | "
            f"{r['user_bytes_written'] + r['gc_bytes_written']:,} | {r['trimmed_bytes']:,} | "
            f"{r['block_evictions']:,} "
            f"| {r['gc_evicted_blocks']:,} | {r['device_waf_ftl_model']:.4f} | {r['e2e_wa_ftl_model']:.4f} |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"simulated": "FTL model, not an SSD", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
