#!/usr/bin/env python3
"""Validate the FTL model and show what FDP placement buys, on the model.

Three experiments (all numbers are measured by running the model; nothing is
hard-coded):

1. ``lambert`` -- greedy GC under uniform random single-page writes vs the
   analytic WA of Desnoyers (SYSTOR 2012) / Xiang & Kurkoski (arXiv:1110.4245),
   ``WA = 1/(1-X)``, ``X = -W0(-a e^-a)/a``, ``a = 1 + OP``, over a range of OP.
   The analytic model assumes many pages per block: 256 pages per RU here.
2. ``noisy`` -- two RUHs; RUH 0 "quiet" (10 % of writes), RUH 1 "noisy" (90 %),
   each uniform random over its own 45 % of the LBA space.  Per-RUH WAF under
   Initially vs Persistently Isolated RUHs (TP4146).
3. ``kv`` -- a KV-cache-like replay: 2-4 MiB blocks at 90 % utilisation, three
   lifetime classes (SHORT/MEDIUM/LONG) with TTL eviction + TRIM; WAF with no
   placement vs placement by lifetime class, and the replay time.

Usage::

    python bench/fdp_validate.py [--quick] [--json out.json] [--only lambert,noisy,kv]
"""

from __future__ import annotations

import argparse
import heapq
import json
import time

import numpy as np

from tierstore.fdp.ftl import FTLModel
from tierstore.fdp.lifetime import LifetimeClass
from tierstore.fdp.passthrough import select_write_path
from tierstore.fdp.simdevice import SimFdpDevice
from tierstore.fdp.waf import WafWindow, analytic_greedy_waf

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


def lambert(ops: list[float], logical_pages: int, gcs: list[str], seed: int = 1) -> list[dict]:
    rows = []
    for op in ops:
        for gc in gcs:
            t0 = time.perf_counter()
            m = FTLModel(logical_pages * 4 * KiB, 256 * 4 * KiB, op, num_ruh=1, page_bytes=4 * KiB, gc=gc)
            rng = np.random.default_rng(seed)
            u = m.logical_pages
            m.write_pages(np.arange(u))
            batch = 4096
            for _ in range(3 * u // batch):  # warm up to steady state
                m.write_pages(rng.integers(0, u, batch))
            w = WafWindow(m)
            w.start()
            for _ in range(3 * u // batch):  # measurement window
                m.write_pages(rng.integers(0, u, batch))
            w.stop()
            m.check_invariants()
            ref = analytic_greedy_waf(op)
            rows.append(
                {
                    "op": op,
                    "gc": gc,
                    "num_ru": m.num_ru,
                    "pages_per_ru": m.ru_pages,
                    "model_waf": w.waf,
                    "analytic_waf": ref,
                    "error_pct": 100 * (w.waf - ref) / ref,
                    "time_s": time.perf_counter() - t0,
                }
            )
    return rows


def noisy(logical_pages: int, seed: int = 3) -> list[dict]:
    rows = []
    for isolation in ("initial", "persistent"):
        for gc in ("greedy", "cost_benefit"):
            m = FTLModel(
                logical_pages * 4 * KiB,
                256 * 4 * KiB,
                0.14,
                num_ruh=2,
                isolation=isolation,
                gc=gc,
                page_bytes=4 * KiB,
            )
            rng = np.random.default_rng(seed)
            half = int(m.logical_pages * 0.45)
            m.write_pages(np.arange(half), 0)
            m.write_pages(np.arange(half, 2 * half), 1)

            def step() -> None:
                if rng.random() < 0.1:
                    m.write_pages(rng.integers(0, half, 2048), 0)
                else:
                    m.write_pages(rng.integers(half, 2 * half, 2048), 1)

            for _ in range(4 * m.logical_pages // 2048):
                step()
            s0 = m.stats()
            w = WafWindow(m)
            w.start()
            for _ in range(4 * m.logical_pages // 2048):
                step()
            w.stop()
            s1 = m.stats()
            h = np.subtract(s1["ruh_host_bytes"], s0["ruh_host_bytes"])
            g = np.subtract(s1["ruh_gc_bytes"], s0["ruh_gc_bytes"])
            rows.append(
                {
                    "isolation": isolation,
                    "gc": gc,
                    "waf": w.waf,
                    "quiet_ruh_waf": float((h[0] + g[0]) / h[0]),
                    "noisy_ruh_waf": float((h[1] + g[1]) / h[1]),
                }
            )
    return rows


# Lifetime mix of the KV replay: (class, share of writes, mean TTL in units of "slot count" writes,
# i.e. how many times the device's slots could be rewritten before the entry expires).  The TTLs
# are exponential; the class shares and TTL ratios are illustrative (single-query KV dies ~10x
# sooner than conversation context, system prefixes ~100x later), not measured from a trace.
KV_MIX = [
    (LifetimeClass.SHORT, 0.60, 0.25),
    (LifetimeClass.MEDIUM, 0.30, 2.5),
    (LifetimeClass.LONG, 0.10, 250.0),
]


def kv(n_writes: int, capacity_bytes: int, placed: bool, isolation: str, op: float, seed: int = 0) -> dict:
    """TTL-evicted KV blocks, 2-4 MiB, slots of 4 MiB, kept at 90 % of capacity; eviction = TRIM."""
    m = FTLModel(capacity_bytes, 64 * MiB, op, num_ruh=4, isolation=isolation, page_bytes=64 * KiB)
    dev = SimFdpDevice(m)
    policy = dev.placement_policy()
    rng = np.random.default_rng(seed)
    slot_bytes = 4 * MiB
    n_slots = capacity_bytes // slot_bytes
    target = int(0.9 * n_slots)
    free = list(rng.permutation(n_slots))
    live: list[tuple[float, int]] = []  # (expiry, slot)
    classes = rng.choice(len(KV_MIX), size=n_writes, p=[s for _, s, _ in KV_MIX])
    sizes = rng.integers(32, 65, size=n_writes) * 64 * KiB
    ttl = np.array([KV_MIX[c][2] for c in classes]) * n_slots * rng.exponential(1.0, size=n_writes)
    w = WafWindow(dev)
    t0 = time.perf_counter()
    for i in range(n_writes):
        while live and (live[0][0] <= i or len(live) >= target):
            _, s = heapq.heappop(live)
            dev.on_trim(s * slot_bytes, slot_bytes)
            free.append(s)
        j = int(rng.integers(len(free)))
        free[j], free[-1] = free[-1], free[j]
        s = free.pop()
        pid = policy.placement_for(KV_MIX[classes[i]][0]) if placed else None
        dev.on_write(s * slot_bytes, int(sizes[i]), pid)
        heapq.heappush(live, (i + ttl[i], s))
        if i == n_writes // 2:
            w.start()
    w.stop()
    st = m.stats()
    return {
        "placed": placed,
        "isolation": isolation,
        "op": op,
        "writes": n_writes,
        "written_gib": st["hbmw_bytes"] / GiB,
        "waf": w.waf,
        "ruh_waf": st["ruh_waf"],
        "replay_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller runs (for a smoke test)")
    ap.add_argument("--json", help="write all results to this JSON file")
    ap.add_argument("--only", default="lambert,noisy,kv")
    ap.add_argument("--kv-writes", type=int, default=300_000)
    ap.add_argument("--kv-capacity-gib", type=int, default=256)
    args = ap.parse_args()
    only = set(args.only.split(","))
    out: dict = {"write_path": select_write_path().status}
    print(f"write path on this host: {out['write_path']}")

    if "lambert" in only:
        pages = 2**16 if args.quick else 2**18
        rows = lambert([0.07, 0.14, 0.28, 0.5], pages, ["greedy", "cost_benefit"])
        out["lambert"] = rows
        print(
            f"\n## Greedy GC vs analytic (uniform random 4 KiB writes, {pages} logical pages, 256 pages/RU)"
        )
        print("| OP | GC | model WA | analytic WA | error % |\n|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['op']:.2f} | {r['gc']} | {r['model_waf']:.3f} | {r['analytic_waf']:.3f} | "
                f"{r['error_pct']:+.2f} |"
            )

    if "noisy" in only:
        rows = noisy(2**15 if args.quick else 2**17)
        out["noisy"] = rows
        print("\n## Noisy RUH (OP 14 %; RUH0 quiet 10 % of writes, RUH1 noisy 90 %)")
        print("| isolation | GC | device WAF | quiet RUH WAF | noisy RUH WAF |\n|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['isolation']} | {r['gc']} | {r['waf']:.3f} | {r['quiet_ruh_waf']:.3f} | "
                f"{r['noisy_ruh_waf']:.3f} |"
            )

    if "kv" in only:
        n = 30_000 if args.quick else args.kv_writes
        cap = (32 if args.quick else args.kv_capacity_gib) * GiB
        rows = [
            kv(n, cap, False, "initial", 0.07),
            kv(n, cap, True, "initial", 0.07),
            kv(n, cap, True, "persistent", 0.07),
        ]
        out["kv"] = rows
        print(
            f"\n## KV replay: {n} writes of 2-4 MiB, {cap // GiB} GiB at 90 % utilisation, OP 7 %, "
            "64 MiB RUs, 64 KiB pages (WAF over the second half)"
        )
        print("| placement | isolation | WAF | written GiB | replay s |\n|---|---|---|---|---|")
        for r in rows:
            print(
                f"| {'by lifetime class' if r['placed'] else 'none'} | {r['isolation']} | {r['waf']:.3f} "
                f"| {r['written_gib']:.0f} | {r['replay_s']:.1f} |"
            )

    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
