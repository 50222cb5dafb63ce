#!/usr/bin/env python
"""A shared FDP SSD: tierstore's NVMe tier beside other writers on one simulated device (issue 18, goal 3).

One :class:`~tierstore.fdp.ftl.FTLModel` (an FDP SSD; **simulated, not an
SSD**) is cut into LBA ranges, one per tenant, each RU-aligned:

* ``tierstore`` -- a real store (block index, memory tiers, the segment
  store) replaying the Mooncake conversation trace;
* ``agent`` -- a second tierstore instance replaying the agent workload
  (:mod:`bench.agent_workload`; another turnover); ``--no-agent`` leaves it out;
* ``bighash`` -- a small-object cache like CacheLib's BigHash: every insert
  rewrites one random 4 KiB bucket page of its range in place (after one
  sequential fill), ``--bighash-ratio`` bytes per byte tierstore writes.

The two stores are replayed together in trace-time order
(:class:`tierstore.replay.ReplaySession`), each through its own
:class:`~tierstore.io.segments.SegmentStorage` (segment = RU) on a memory
engine whose writes and trims an observer forwards to the shared model at the
tenant's offset -- with a RUH Update when a segment opens if the tenant has
placement (what :class:`tierstore.fdp.device.RuhUpdateShim` does for one
tenant). Placements (``--modes``):

* ``none``          -- no placement: every write on the default handle (a conventional SSD);
* ``tenant``        -- one RUH per tenant;
* ``tenant+class``  -- per tenant, one RUH per lifetime class (tierstore's
  classifier -> explicit PIDs, :class:`~tierstore.config.FdpConfig`); BigHash one RUH;

each under Initially Isolated and Persistently Isolated handles
(``--isolations``). Reported per run: device WAF, per-RUH host and GC bytes,
each tenant's own WA (``(host + GC bytes of its pages) / host bytes``,
:meth:`FTLModel.set_tenants`), and tierstore's end-to-end WA (NAND bytes
attributed to its range -- device GC, segment headers, padding and host
copy-forward -- per byte its index wrote to NVMe).

Usage::

    python bench/shared_ssd.py --json shared_ssd.json                         # full runs
    python bench/shared_ssd.py --limit 1500 --agent-sessions 150 --modes none,tenant   # smoke
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Sequence

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from tierstore.fdp.ftl import FTLModel  # noqa: E402
from tierstore.io.memory import MemoryEngine  # noqa: E402
from tierstore.io.null import NullEngine  # noqa: E402
from tierstore.io.segments import SegmentStorage  # noqa: E402
from tierstore.replay import ReplayConfig, ReplaySession, unique_full_blocks  # noqa: E402
from tierstore.trace import read_mooncake  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
MOONCAKE = os.path.normpath(os.path.join(HERE, "..", "..", "shared", "traces", "mooncake_conversation_trace.jsonl"))
PAGE_BYTES = 4096
MODES = ("none", "tenant", "tenant+class")

#: Handles: tenant -> (LONG, MEDIUM, SHORT) PIDs per mode (the model has 8 RUHs, handle 0 is the default).
PIDS = {"tenant": {"tierstore": (1, 1, 1), "agent": (2, 2, 2), "bighash": 3},
        "tenant+class": {"tierstore": (1, 2, 3), "agent": (4, 5, 6), "bighash": 7}}


class TenantPort:
    """I/O observer: a tenant's engine writes land in its range of the shared model.

    Parameters
    ----------
    ftl : FTLModel
    base_bytes : int
        The tenant's first byte on the device (RU-aligned).
    segment_bytes : int
        The tenant's segment size (= RU): a write at a segment start opens a fresh RU.
    ruh_update : bool
        Send a RUH Update for the write's handle when a segment opens (placed tenants).
    """

    def __init__(self, ftl: FTLModel, base_bytes: int, segment_bytes: int, ruh_update: bool) -> None:
        self.ftl, self.base, self.seg, self.ruh_update = ftl, int(base_bytes), int(segment_bytes), ruh_update
        self.host_bytes = 0

    def on_write(self, offset_bytes: int, nbytes: int, placement) -> None:
        if self.ruh_update and offset_bytes % self.seg == 0:
            self.ftl.ruh_update(placement)
        self.host_bytes += int(nbytes)
        self.ftl.on_write(self.base + offset_bytes, nbytes, placement)

    def on_trim(self, offset_bytes: int, nbytes: int) -> None:
        self.ftl.on_trim(self.base + offset_bytes, nbytes)


class BigHash:
    """Random in-place 4 KiB bucket overwrites in ``[base, base + size)`` (CacheLib BigHash's write pattern).

    Parameters
    ----------
    ftl : FTLModel
    base_bytes, size_bytes : int
    pid : int or None
    seed : int
    """

    def __init__(self, ftl: FTLModel, base_bytes: int, size_bytes: int, pid, seed: int = 0) -> None:
        self.ftl, self.base, self.pages, self.pid = ftl, base_bytes // PAGE_BYTES, size_bytes // PAGE_BYTES, pid
        self.rng = np.random.default_rng(seed)
        self.host_bytes = 0
        self._debt = 0.0

    def fill(self) -> None:
        """Write every bucket once (a warm small-object cache)."""
        lpns = np.arange(self.base, self.base + self.pages, dtype=np.int64)
        for a in range(0, lpns.size, 4096):
            self.ftl.write_pages(lpns[a:a + 4096], self.pid)
        self.host_bytes += self.pages * PAGE_BYTES

    def write(self, nbytes: float) -> None:
        """Overwrite about ``nbytes`` of random buckets (fractions carry over)."""
        self._debt += nbytes / PAGE_BYTES
        n = int(self._debt)
        if n <= 0:
            return
        self._debt -= n
        self.ftl.write_pages(self.base + self.rng.integers(0, self.pages, n, dtype=np.int64), self.pid)
        self.host_bytes += n * PAGE_BYTES


def _store_session(trace: str, limit, block_bytes: int, nvme_bytes: int, ftl: FTLModel, base: int, ru: int,
                   mode: str, tenant: str, policies: dict, region_policy: str | None, engine: str):
    """A :class:`ReplaySession` whose NVMe tier is the tenant's range of the shared device."""
    eng = MemoryEngine(nvme_bytes) if engine == "memory" else NullEngine(nvme_bytes)
    placed = mode != "none"
    port = TenantPort(ftl, base, ru, ruh_update=placed)
    eng.add_observer(port)
    kw = {} if region_policy is None else {"region_policy": region_policy}
    seg = SegmentStorage(None, nvme_bytes, block_bytes, segment_size_bytes=ru, engine=eng, owns_engine=True, **kw)
    fdp = {"enabled": False}
    if placed:
        lo, me, sh = PIDS[mode][tenant]
        fdp = {"enabled": True, "long_pid": lo, "medium_pid": me, "short_pid": sh, "default_pid": sh}
    pol = dict(policies)
    ev = pol.pop("eviction", "lru")
    cfg = ReplayConfig(trace=trace, limit=limit, block_bytes=block_bytes, nvme_bytes=nvme_bytes, sample_every=10 ** 9,
                       eviction=ev, policies=pol, nvme_options={"device": "sim", "engine": "memory", "fdp": fdp},
                       runtime={"nvme": seg})
    return ReplaySession(cfg), port


def run(args: dict) -> dict:
    """One shared-device run (module doc); returns its row."""
    t0 = time.perf_counter()
    bb = args["block_bytes"]
    moon = read_mooncake(args["trace"], args["limit"])
    agent_path = args.get("agent_trace")
    agent = read_mooncake(agent_path) if agent_path else []
    # sizes: each store's NVMe tier is nvme_fraction of its trace's unique bytes; BigHash fills the rest up to
    # the utilisation; RU = device / 60
    a_bytes = int(unique_full_blocks(moon) * args["nvme_fraction"]) * bb
    b_bytes = int(unique_full_blocks(agent) * args["nvme_fraction"]) * bb if agent else 0
    share_tier = (a_bytes + b_bytes) / (args["utilization"] * (1 - args["bighash_share"]))
    device = int(share_tier)
    ru = max(64 * PAGE_BYTES, device // 60 // PAGE_BYTES * PAGE_BYTES)
    device = -(-device // ru) * ru
    a_bytes, b_bytes = a_bytes // ru * ru, -(-b_bytes // ru) * ru if b_bytes else 0
    c_bytes = int(args["utilization"] * device) - a_bytes - b_bytes
    c_bytes = max(0, c_bytes // ru * ru)
    ftl = FTLModel(device, ru, args["op"], num_ruh=8, isolation=args["isolation"], gc="greedy", page_bytes=PAGE_BYTES)
    ranges = [("tierstore", 0, a_bytes)]
    if b_bytes:
        ranges.append(("agent", a_bytes, a_bytes + b_bytes))
    if c_bytes:
        ranges.append(("bighash", a_bytes + b_bytes, a_bytes + b_bytes + c_bytes))
    ftl.set_tenants(ranges)
    mode = args["mode"]
    pol, region = args.get("policies", {}), args.get("region_policy")
    sa, pa = _store_session(args["trace"], args["limit"], bb, a_bytes, ftl, 0, ru, mode, "tierstore", pol, region,
                            args["engine"])
    sessions = [("tierstore", sa, pa)]
    if b_bytes:
        sb, pb = _store_session(agent_path, None, bb, b_bytes, ftl, a_bytes, ru, mode, "agent", pol, region,
                                args["engine"])
        sessions.append(("agent", sb, pb))
    big = None
    if c_bytes:
        big = BigHash(ftl, a_bytes + b_bytes, c_bytes, None if mode == "none" else PIDS[mode]["bighash"])
        big.fill()
    written = 0
    try:
        while True:
            live = [(s.next_time_s, name, s, p) for name, s, p in sessions if s.report is None]
            if not live:
                break
            _, name, s, p = min(live, key=lambda x: x[0])
            if not s.step():
                continue
            if big is not None:
                now = sum(pp.host_bytes for _, _, pp in sessions)
                big.write((now - written) * args["bighash_ratio"])
                written = now
        reports = {name: s.report for name, s, _ in sessions}
        stats = {name: s.store.stats() for name, s, _ in sessions}
    finally:
        for _, s, _ in sessions:
            s.close()
    ftl.check_invariants()
    st = ftl.stats()
    ten = st["tenants"]
    row = {"mode": mode, "isolation": args["isolation"], "utilization": round((a_bytes + b_bytes + c_bytes) / device, 4),
           "device_bytes": device, "ru_bytes": ru, "tenant_bytes": {n: hi - lo for n, lo, hi in ranges},
           "bighash_ratio": args["bighash_ratio"], "device_waf": st["waf"],
           "ruh_host_bytes": st["ruh_host_bytes"], "ruh_gc_bytes": st["ruh_gc_bytes"],
           "tenant_wa": {n: v["wa"] for n, v in ten.items() if n != "other"},
           "tenant_gc_bytes": {n: v["gc_bytes"] for n, v in ten.items() if n != "other"},
           "wall_s": round(time.perf_counter() - t0, 1)}
    for name, rep in reports.items():
        tier_bytes = rep.kv["nvme_write_bytes"]
        nand = ten[name]["host_bytes"] + ten[name]["gc_bytes"]
        row[f"{name}_e2e_wa"] = nand / tier_bytes if tier_bytes else float("nan")
        row[f"{name}_hit_ratio"] = rep.kv["lookup_hit_ratio"]
        row[f"{name}_saved_prefill_tokens"] = rep.kv["saved_prefill_tokens"]
        row[f"{name}_host_wa"] = float(rep.store_stats.get("host_write_amplification", 1.0))
        row[f"{name}_wrong_kv_blocks"] = rep.kv["wrong_kv_blocks"]
    return row


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=MOONCAKE)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--agent-sessions", type=int, default=1000, help="0: no second tierstore instance")
    ap.add_argument("--block-bytes", type=int, default=32 << 10)
    ap.add_argument("--nvme-fraction", type=float, default=0.30, help="each store's NVMe tier, of its unique bytes")
    ap.add_argument("--bighash-share", type=float, default=0.2, help="BigHash's share of the used space")
    ap.add_argument("--bighash-ratio", default="1.0", help="BigHash bytes per tierstore byte (comma list)")
    ap.add_argument("--utilization", type=float, default=0.95)
    ap.add_argument("--op", type=float, default=0.07)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--isolations", default="initial,persistent")
    ap.add_argument("--policies", default="{}", help="PoliciesConfig fields (JSON); default: the store defaults")
    ap.add_argument("--region-policy", default=None)
    ap.add_argument("--engine", default="memory", choices=("memory", "null"))
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    agent_path = None
    if a.agent_sessions:
        from agent_workload import AgentWorkload
        agent_path = os.path.join(os.path.dirname(os.path.abspath(a.json or "x")) or ".",
                                  f"agent_{a.agent_sessions}.jsonl")
        AgentWorkload(sessions=a.agent_sessions, seed=0).write(agent_path)
    base = {"trace": a.trace, "limit": a.limit, "agent_trace": agent_path, "block_bytes": a.block_bytes,
            "nvme_fraction": a.nvme_fraction, "bighash_share": a.bighash_share, "utilization": a.utilization,
            "op": a.op, "policies": json.loads(a.policies), "region_policy": a.region_policy, "engine": a.engine}
    jobs = []
    for ratio in (float(x) for x in a.bighash_ratio.split(",")):
        for mode in a.modes.split(","):
            isos = ["initial"] if mode == "none" else a.isolations.split(",")
            for iso in isos:
                jobs.append({**base, "mode": mode, "isolation": iso, "bighash_ratio": ratio})
    with ProcessPoolExecutor(a.jobs) as ex:
        rows = list(ex.map(run, jobs))
    print("simulated device (FTL model), not an SSD")
    print("| mode | isolation | BigHash B/B | device WAF | tierstore WA (device) | tierstore e2e WA | agent WA | "
          "BigHash WA | GC bytes per RUH (MiB) | tierstore hit ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        tw = r["tenant_wa"]
        gc = ", ".join(f"{i}:{b / 2**20:.0f}" for i, b in enumerate(r["ruh_gc_bytes"]) if b)
        print(f"| {r['mode']} | {r['isolation']} | {r['bighash_ratio']} | {r['device_waf']:.3f} | "
              f"{tw.get('tierstore', float('nan')):.3f} | {r['tierstore_e2e_wa']:.3f} | {tw.get('agent', float('nan')):.3f} | "
              f"{tw.get('bighash', float('nan')):.3f} | {gc or '-'} | {r['tierstore_hit_ratio']:.4f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "simulated": "FTL model, not an SSD", "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
