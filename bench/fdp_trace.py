#!/usr/bin/env python
"""Issue 4: the Mooncake conversation trace through the tier manager onto the FDP model.

For every (utilisation, RU size) point three placements are replayed through
the real :class:`~tierstore.manager.TierManager` (HBM -> host -> NVMe), whose
NVMe tier is a :class:`~tierstore.io.segments.SegmentStorage` (segment = RU)
on the simulated FDP device (:mod:`tierstore.wiring`, ``mode="sim"``):

* ``none``   -- no placement: every write untagged (default handle);
* ``class``  -- lifetime-class placement: ``classify(entry, now_s)`` (engine
  hint, else observed hits; :func:`tierstore.manager.default_classify`) ->
  RUH -> PID from the device's RUH Status;
* ``oracle`` -- a first pass (``none``, same point) records, per NVMe write of
  a key, when that copy was deleted/evicted; the second pass places each write
  by its bucketed true remaining lifetime (terciles of the first pass's
  lifetimes -> SHORT/MEDIUM/LONG handles).  The second pass evolves a little
  differently from the first, so the oracle is exact only for the first pass.

Scaling: the trace's 512-token blocks are stored as ``--block-bytes`` (default
32 KiB, the replay default; 2048x smaller than Llama-3.1-8B's 64 MiB).  The
device's user capacity is 30 % of the trace's unique full-block bytes rounded
to a multiple of 240 x 64 KiB, so RU = device/240, /60, /15 are whole 64 KiB
multiples (a 16 GiB RU on a ~960 GiB SSD is 1/60).  The NVMe tier holds
``utilisation x device`` (whole RUs); HBM and host are 2 % and 8 % of unique
bytes, as in the default replay.

End-to-end WA = MBMW (NAND bytes the model wrote: headers, padding, host
copy-forward and device GC included) / bytes the tier manager wrote to NVMe.

Usage::

    python bench/fdp_trace.py --json fdp_trace.json             # full sweep
    python bench/fdp_trace.py --limit 600 --quick               # CI smoke (~20 s)
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from typing import Iterable, Sequence

import numpy as np

from tierstore.fdp.lifetime import LifetimeClass
from tierstore.replay import ReplayConfig, run_replay, unique_full_blocks
from tierstore.tiers.storage import BlockStorage
from tierstore.trace import read_mooncake
from tierstore.wiring import StoreConfig, build_store

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_TRACE = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "traces",
                                              "mooncake_conversation_trace.jsonl"))
DEVICE_FRACTION = 0.30     # device user capacity / unique trace bytes
RU_GRAIN = 240 * (64 << 10)


class RecordingStorage(BlockStorage):
    """Delegating NVMe tier that records, per key, the times of its writes and deletes.

    Parameters
    ----------
    inner : BlockStorage
    clock : callable
        Trace clock (seconds).
    """

    def __init__(self, inner: BlockStorage, clock) -> None:
        self.inner = inner
        self.clock = clock
        self.block_bytes = inner.block_bytes
        self.writes: dict[bytes, list[float]] = {}
        self.deaths: dict[bytes, list[float]] = {}

    def capacity_blocks(self) -> int:
        return self.inner.capacity_blocks()

    def free_blocks(self) -> int:
        return self.inner.free_blocks()

    def put(self, keys, blocks, placements=None, ns_digests=None):
        st = self.inner.put(keys, blocks, placements, ns_digests)
        now = self.clock()
        for k, s in zip(keys, st):
            if s.name == "OK":
                self.writes.setdefault(bytes(k), []).append(now)
        return st

    def get(self, keys, dests):
        return self.inner.get(keys, dests)

    def delete(self, keys: Iterable[bytes]) -> None:
        keys = [bytes(k) for k in keys]
        now = self.clock()
        for k in keys:
            if self.inner.contains(k):
                self.deaths.setdefault(k, []).append(now)
        self.inner.delete(keys)

    def contains(self, key: bytes) -> bool:
        return self.inner.contains(key)

    def keys(self) -> list[bytes]:
        return self.inner.keys()

    def stats(self) -> dict:
        return self.inner.stats()

    def close(self) -> None:
        self.inner.close()

    def lifetimes(self) -> dict[bytes, list[float]]:
        """Per key, the death time of each recorded write (``inf``: alive at the end)."""
        out = {}
        for k, ws in self.writes.items():
            ds = self.deaths.get(k, [])
            out[k] = [ds[i] if i < len(ds) else float("inf") for i in range(len(ws))]
        return out


class OracleClassifier:
    """Class from the true remaining lifetime recorded by a first pass.

    Parameters
    ----------
    deaths : dict
        Key -> death time (s) of its 1st, 2nd, ... NVMe write in the first pass.
    bounds_s : (float, float)
        Remaining-lifetime bounds: below the first -> SHORT, below the second -> MEDIUM, else LONG.
    """

    def __init__(self, deaths: dict[bytes, list[float]], bounds_s: Sequence[float]) -> None:
        self.deaths = deaths
        self.bounds_s = tuple(bounds_s)
        self._seen: dict[bytes, int] = {}
        self.unknown = 0

    def __call__(self, entry, now_s: float) -> LifetimeClass:
        i = self._seen.get(entry.key, 0)
        self._seen[entry.key] = i + 1
        ds = self.deaths.get(entry.key)
        if not ds:
            self.unknown += 1
            return LifetimeClass.SHORT
        d = ds[min(i, len(ds) - 1)]
        rem = d - now_s
        if rem < self.bounds_s[0]:
            return LifetimeClass.SHORT
        if rem < self.bounds_s[1]:
            return LifetimeClass.MEDIUM
        return LifetimeClass.LONG


def run_point(args: dict) -> dict:
    """Replay one (placement, utilisation, RU) point; returns a result row."""
    util, ru, dev, mode = args["util"], args["ru"], args["device_bytes"], args["mode"]
    box: list = []
    classifier = "hint"
    dataplacement = "none" if mode == "none" else "fdp"
    if mode == "oracle":
        classifier = OracleClassifier(args["deaths"], args["bounds_s"])

    def factory(layout, hbm_bytes, host_bytes, nvme_path, nvme_bytes, clock):
        w = build_store(StoreConfig(layout=layout, hbm_bytes=hbm_bytes, host_bytes=host_bytes, mode="sim",
                                    device_bytes=dev, utilization=util, ru_size_bytes=ru,
                                    dataplacement=dataplacement, classifier=classifier, clock=clock,
                                    op_fraction=args["op"], isolation=args["isolation"], gc=args["gc"],
                                    manager_options={"eviction": args.get("eviction", "lru"),
                                                     "nvme_group_choice": args["group_choice"]}))
        if args.get("record"):
            rec = RecordingStorage(w.store.manager.nvme, clock)
            w.store.manager.nvme = rec
            box.append(rec)
        w.store.wiring = w
        return w.store

    cfg = ReplayConfig(trace=args["trace"], limit=args["limit"], block_bytes=args["block_bytes"],
                       sample_every=10 ** 9)
    t0 = time.perf_counter()
    rep = run_replay(cfg, store_factory=factory)
    wall = time.perf_counter() - t0
    d = rep.device
    row = {"placement": mode, "eviction": args.get("eviction", "lru"), "utilization": round(d["utilization"], 4), "ru_size_bytes": ru,
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
           "nvme_hits": rep.kv["hit_blocks_nvme"], "dropped_blocks": rep.kv["dropped_blocks"]}
    if mode == "oracle":
        row["oracle_unknown_writes"] = classifier.unknown
    if box:
        row["_rec"] = (box[0].writes, box[0].lifetimes())
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
    ap.add_argument("--group-choice", default="coldest", choices=("first", "coldest"),
                    help="NVMe region eviction: group of the first LRU victim, or the coldest of the "
                         "first victims' groups (ManagerConfig.nvme_group_choice)")
    ap.add_argument("--quick", action="store_true", help="smoke: utilisation 0.9, RU 1/60 only")
    ap.add_argument("--baseline-evictions", default="s3fifo,cost",
                    help="further eviction policies run without placement at the sweep point "
                         "(the 'best no-placement policy' reference)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
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
            "op": a.op, "isolation": a.isolation, "gc": a.gc, "group_choice": a.group_choice}
    jobs = []
    for u, f in points:
        args = {**base, "util": u, "ru": dev // f}
        jobs.append(("class", args))
        jobs.append(("pair", args))
        if (u, f) == (a.sweep_util, a.base_ru_fraction):
            for ev in filter(None, a.baseline_evictions.split(",")):
                jobs.append(("none", {**args, "eviction": ev}))
    print(f"trace {a.trace}: {len(reqs)} requests, unique bytes {uniq_bytes}, block {a.block_bytes} B; "
          f"device {dev} B; {len(points)} points x 3 placements", file=sys.stderr)
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
                             ["none", "class", "oracle"].index(r["placement"]), r["eviction"]))
    print_table(rows)
    print(f"total {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": {**base, "device_fraction_of_unique": DEVICE_FRACTION,
                                  "requests": len(reqs), "unique_bytes": uniq_bytes}, "rows": rows}, f, indent=1)
    return 0


def _bounds(writes: dict, deaths: dict) -> tuple:
    """Tercile bounds (s) of the finite first-pass lifetimes (death - write time)."""
    life = [d - w for k, ws in writes.items() for w, d in zip(ws, deaths[k]) if np.isfinite(d)]
    if not life:
        return (60.0, 600.0)
    q = np.quantile(np.asarray(life), [1 / 3, 2 / 3])
    return (float(q[0]), float(q[1]))


def _run_job(job) -> list[dict]:
    kind, args = job
    if kind in ("class", "none"):
        return [run_point({**args, "mode": kind})]
    a = run_point({**args, "mode": "none", "record": True})
    writes, deaths = a.pop("_rec")
    bounds = _bounds(writes, deaths)
    c = run_point({**args, "mode": "oracle", "deaths": deaths, "bounds_s": bounds})
    c["oracle_bounds_s"] = list(bounds)
    return [a, c]


def print_table(rows: list[dict]) -> None:
    """Markdown table of the rows."""
    best_none: dict = {}
    for r in rows:
        if r["placement"] == "none":
            key = (r["ru_size_bytes"], r["utilization"])
            best_none[key] = max(best_none.get(key, 0), r["saved_prefill_tokens"])
    print("| RU (of device) | utilisation | placement | eviction | saved prefill tokens | vs best none | "
          "hit ratio | end-to-end WA | device WAF | host WA | format overhead | replay s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ref = best_none.get((r["ru_size_bytes"], r["utilization"]))
        rel = f"{100 * (r['saved_prefill_tokens'] / ref - 1):+.2f}%" if ref else "-"
        print(f"| {r['ru_fraction']} ({r['ru_size_bytes'] / 2**20:.1f} MiB) | {r['utilization']:.2f} | "
              f"{r['placement']} | {r['eviction']} | {r['saved_prefill_tokens']:,} | {rel} | {r['hit_ratio']:.4f} | "
              f"{r['e2e_wa']:.4f} | {r['device_waf']:.4f} | {r['host_wa']:.4f} | {r['format_overhead']:.4f} | "
              f"{r['replay_wall_s']} |")


if __name__ == "__main__":
    sys.exit(main())
