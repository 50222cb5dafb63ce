#!/usr/bin/env python
"""The Mooncake trace through the real store onto the FDP model (issues 4 and 18).

For every (utilisation, RU size) point and every configured policy set, the
placements are replayed through the real block index and segment store (HBM
stand-in -> host -> NVMe, built by :func:`tierstore.build.build_store` from a
:class:`~tierstore.config.StoreConfig` with ``tiers.nvme.device: sim``: a
:class:`~tierstore.io.segments.SegmentStorage`, segment = RU, on
:class:`~tierstore.fdp.simdevice.SimFdpDevice` over
:class:`~tierstore.fdp.ftl.FTLModel`). **Every WAF/WA figure is simulated.**

* ``none``   -- no placement: every write untagged (default handle);
* ``class``  -- lifetime-class placement: the index's classifier
  (``policies.classifier``, or ``--classifier``) -> RUH -> PID from the
  device's RUH Status; a RUH Update when a segment opens;
* ``oracle`` -- a first pass (``none``, same point) records, per NVMe write of
  a key, when that copy left NVMe (:class:`tierstore.bench.lifetimes.LifetimeRecorder`);
  the second pass places each write by its bucketed true remaining lifetime
  (terciles of the first pass's lifetimes -> SHORT/MEDIUM/LONG handles).  The
  second pass evolves a little differently, so the oracle is exact only for the
  first pass.

Every row also gives the lifetime-class prediction accuracy against the true
death times of that replay.

Scaling: the trace's 512-token blocks are stored as ``--block-bytes`` (default
32 KiB, the replay default; 2048x smaller than Llama-3.1-8B's 64 MiB).  The
device's user capacity is 30 % of the trace's unique full-block bytes rounded
to a multiple of 240 x 64 KiB, so RU = device/240, /60, /15 are whole 64 KiB
multiples (a 16 GiB RU on a ~960 GiB SSD is 1/60).  The NVMe tier holds
``utilisation x device`` (whole RUs); HBM and host are 2 % and 8 % of unique
bytes, as in the default replay.

End-to-end WA = MBMW (NAND bytes the model wrote: headers, padding, host
copy-forward and device GC included) / bytes the index wrote to NVMe.

Usage::

    python bench/fdp_trace.py --json fdp_trace.json                       # full sweep
    python bench/fdp_trace.py --limit 600 --quick                         # smoke (~1 min)
    python bench/fdp_trace.py --utilizations 0.9 --ru-fractions 60 --configs default,lru
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Sequence

from tierstore.bench.lifetimes import LifetimeRecorder, OracleClassifier, tercile_bounds
from tierstore.replay import ReplayConfig, run_replay, unique_full_blocks
from tierstore.trace import read_mooncake


HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TRACE = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "traces",
                                              "mooncake_conversation_trace.jsonl"))
DEVICE_FRACTION = 0.30     # device user capacity / unique trace bytes
RU_GRAIN = 240 * (64 << 10)


def run_point(args: dict) -> dict:
    """Replay one (placement, utilisation, RU) point; returns a result row.

    The store is built from a :class:`~tierstore.config.StoreConfig` (``device:
    sim``: :class:`~tierstore.fdp.simdevice.SimFdpDevice` over an
    :class:`~tierstore.fdp.ftl.FTLModel`, memory engine, or ``engine: null``
    with ``--no-data``); the classifier is recorded by
    :class:`~tierstore.bench.lifetimes.LifetimeRecorder`, which also finds every NVMe
    copy's true death time in the event stream.
    """
    util, ru, dev, mode = args["util"], args["ru"], args["device_bytes"], args["mode"]
    classifier = args.get("classifier", "hint")
    if mode == "oracle":
        classifier = OracleClassifier(args["deaths"], args["bounds_s"])
    rec = LifetimeRecorder(classifier)
    nvme_opts = {"device": "sim", "engine": args.get("engine", "memory"),
                 "model": {"device_bytes": dev, "utilization": util, "ru_size_bytes": ru, "op_fraction": args["op"],
                           "isolation": args["isolation"], "gc": args["gc"],
                           **({"page_bytes": args["page_bytes"]} if args.get("page_bytes") else {})},
                 "fdp": {"enabled": mode != "none"}}
    if args.get("region_policy"):
        nvme_opts["region_policy"] = args["region_policy"]
    pol = dict(args.get("policies") or {})
    cfg = ReplayConfig(trace=args["trace"], limit=args["limit"], block_bytes=args["block_bytes"],
                       nvme_bytes=0, eviction=args.get("eviction", "lru"), sample_every=1, policies=pol,
                       nvme_options=nvme_opts, runtime={"classify": rec},
                       keep_data=not args.get("no_data", False))
    t0 = time.perf_counter()
    rep = run_replay(cfg, on_open=rec.on_open, on_sample=rec.on_sample)
    wall = time.perf_counter() - t0
    d = rep.device
    life = rec.summary()
    row = {"placement": mode, "config": args.get("config", "default"), "eviction": args.get("eviction", "lru"),
           "policies": pol,
           "classifier": classifier if isinstance(classifier, str) else type(classifier).__name__,
           "utilization": round(d["utilization"], 4), "ru_size_bytes": ru,
           "ru_fraction": f"1/{round(dev / ru)}", "device_bytes": dev, "nvme_bytes": d["nvme_bytes"],
           "saved_prefill_tokens": rep.kv["saved_prefill_tokens"], "hit_ratio": rep.kv["lookup_hit_ratio"],
           "ideal_hit_ratio": rep.kv["ideal_hit_ratio"], "wrong_kv_blocks": rep.kv["wrong_kv_blocks"],
           "e2e_wa": d["e2e_wa"], "device_waf": d["waf"],
           "host_wa": d["host_write_amplification"],
           "format_overhead": d["engine_write_bytes"] / max(1, d["host_user_bytes"] + d["host_gc_bytes"]),
           "tier_write_bytes": d["tier_write_bytes"], "mbmw_bytes": d["mbmw_bytes"],
           "hbmw_bytes": d["hbmw_bytes"], "mbe_bytes": d["mbe_bytes"], "ruh_bytes": d.get("ruh_bytes", {}),
           "ruh_gc_bytes": d.get("ruh_gc_bytes", {}), "device_gc_runs": d.get("gc_runs"),
           "ruh_updates": d.get("ruh_updates", 0), "replay_wall_s": round(wall, 1),
           "nvme_hits": rep.kv["hit_blocks_nvme"], "dropped_blocks": rep.kv["dropped_blocks"],
           "lifetime_accuracy": life.get("accuracy"), "lifetime_chance": life.get("chance"),
           "lifetime_spearman": life.get("spearman"), "lifetime_confusion": life.get("confusion")}
    if mode == "oracle":
        row["oracle_unknown_writes"] = classifier.unknown
    if args.get("record"):
        row["_rec"] = rec
    return row


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=DEFAULT_TRACE, help="Mooncake JSONL (empty: the packaged excerpt)")
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--block-bytes", type=int, default=32 << 10)
    ap.add_argument("--utilizations", default="0.5,0.9,1.0")
    ap.add_argument("--ru-fractions", default="240,60,15", help="RU = device / N (swept at --sweep-util)")
    ap.add_argument("--base-ru-fraction", type=int, default=60, help="RU = device / N at every utilisation")
    ap.add_argument("--sweep-util", type=float, default=0.9)
    ap.add_argument("--op", type=float, default=0.07)
    ap.add_argument("--isolation", default="initial")
    ap.add_argument("--gc", default="greedy")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--configs", default="default",
                    help="policy sets (bench/policy_grid.py POLICY_SETS names, or JSON) replayed at every point")
    ap.add_argument("--placements", default="none,class,oracle", help="none, class (lifetime-class PIDs), "
                    "oracle (a first 'none' pass records the true death times; the second places by them)")
    ap.add_argument("--classifier", default="hint", help="classifier of the class placement")
    ap.add_argument("--baseline-configs", default="lru,s3fifo,cost",
                    help="further policy sets run without placement at the sweep point only "
                         "(the 'best no-placement' reference)")
    ap.add_argument("--engine", default="memory", choices=("memory", "null"),
                    help="null: account extents, keep no data (loads from NVMe then miss; for real block sizes)")
    ap.add_argument("--no-data", action="store_true",
                    help="the accounting mode (tiers.keep_data: false, engine: null): real extent headers and "
                         "padding, no payload bytes; NVMe hits count as hits (for 64 MiB blocks)")
    ap.add_argument("--page-bytes", type=int, default=None,
                    help="the FTL model's mapping unit (default: the sim device's 4 KiB)")
    ap.add_argument("--quick", action="store_true", help="smoke: utilisation 0.9, RU 1/60 only")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    from policy_grid import policy_set
    a.trace = a.trace or None  # empty: the packaged 1,000-request excerpt
    reqs = read_mooncake(a.trace, a.limit)
    uniq_bytes = unique_full_blocks(reqs) * a.block_bytes
    dev = max(1, int(uniq_bytes * DEVICE_FRACTION) // RU_GRAIN) * RU_GRAIN
    utils = [float(x) for x in a.utilizations.split(",")]
    points = [(u, a.base_ru_fraction) for u in utils]
    points += [(a.sweep_util, f) for f in (int(x) for x in a.ru_fractions.split(",")) if f != a.base_ru_fraction]
    if a.quick:
        points = [(a.sweep_util, a.base_ru_fraction)]
    base = {"trace": a.trace, "limit": a.limit, "block_bytes": a.block_bytes, "device_bytes": dev,
            "op": a.op, "isolation": a.isolation, "gc": a.gc, "engine": "null" if a.no_data else a.engine,
            "no_data": a.no_data, "page_bytes": a.page_bytes}
    placements = a.placements.split(",")

    def conf(name):
        pol, nv = policy_set(name)
        return {"config": name, "eviction": pol.pop("eviction", "lru"), "policies": pol,
                "region_policy": nv.get("region_policy")}
    jobs = []
    for u, f in points:
        args = {**base, "util": u, "ru": dev // f}
        for name in filter(None, a.configs.split(";" if "{" in a.configs else ",")):
            c = {**args, **conf(name)}
            if "class" in placements:
                jobs.append(("class", {**c, "classifier": a.classifier}))
            if "oracle" in placements:
                jobs.append(("pair", c))
            elif "none" in placements:
                jobs.append(("none", c))
        if (u, f) == (a.sweep_util, a.base_ru_fraction):
            for name in filter(None, a.baseline_configs.split(",")):
                jobs.append(("none", {**args, **conf(name)}))
    print(f"trace {a.trace}: {len(reqs)} requests, unique bytes {uniq_bytes}, block {a.block_bytes} B; "
          f"device {dev} B; {len(points)} points, {len(jobs)} jobs", file=sys.stderr)
    t0 = time.perf_counter()
    if a.procs > 1:
        with mp.get_context("fork").Pool(a.procs) as pool:
            results = pool.map(_run_job, jobs)
    else:
        results = [_run_job(j) for j in jobs]
    rows = []
    for r in results:
        rows.extend(r)
    rows.sort(key=lambda r: (r["ru_size_bytes"], r["utilization"],
                             ["none", "class", "oracle"].index(r["placement"]), r["config"]))
    print_table(rows)
    print(f"total {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": {**base, "device_fraction_of_unique": DEVICE_FRACTION,
                                  "requests": len(reqs), "unique_bytes": uniq_bytes,
                                  "simulated": "every WAF/WA figure is from the FTL model, not an SSD"},
                       "rows": rows}, f, indent=1)
    return 0


def _run_job(job) -> list[dict]:
    kind, args = job
    if kind in ("class", "none"):
        return [run_point({**args, "mode": kind})]
    a = run_point({**args, "mode": "none", "record": True})
    rec = a.pop("_rec")
    life, died, _ = rec.lifetimes()
    bounds = tercile_bounds(life[died]) if died.sum() >= 3 else (60.0, 600.0)
    c = run_point({**args, "mode": "oracle", "deaths": rec.deaths(), "bounds_s": bounds})
    c["oracle_bounds_s"] = list(bounds)
    return [a, c]


def print_table(rows: list[dict]) -> None:
    """Markdown table of the rows (simulated: every WA figure is the FTL model's)."""
    best_none: dict = {}
    for r in rows:
        if r["placement"] == "none" and r["e2e_wa"] <= 1.02:
            key = (r["ru_size_bytes"], r["utilization"])
            best_none[key] = max(best_none.get(key, 0), r["saved_prefill_tokens"])
    print("| RU (of device) | utilisation | placement | config | saved prefill tokens | vs best none (WA<=1.02) | "
          "hit ratio | end-to-end WA | device WAF | host WA | format overhead | lifetime acc. | replay s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = best_none.get((r["ru_size_bytes"], r["utilization"]))
        rel = f"{100 * (r['saved_prefill_tokens'] / ref - 1):+.2f}%" if ref else "-"
        acc = r.get("lifetime_accuracy")
        print(f"| {r['ru_fraction']} ({r['ru_size_bytes'] / 2**20:.1f} MiB) | {r['utilization']:.2f} | "
              f"{r['placement']} | {r['config']} | {r['saved_prefill_tokens']:,} | {rel} | {r['hit_ratio']:.4f} | "
              f"{r['e2e_wa']:.4f} | {r['device_waf']:.4f} | {r['host_wa']:.4f} | {r['format_overhead']:.4f} | "
              f"{'-' if acc is None else f'{acc:.3f}'} | {r['replay_wall_s']} |")


if __name__ == "__main__":
    sys.exit(main())
