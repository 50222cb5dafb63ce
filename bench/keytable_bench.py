#!/usr/bin/env python3
"""The key table's longest single call: what a lookup waits for behind the index lock.

The block index calls :class:`tierstore.keytable.KeyTable` under its lock: ``add_absent`` for a
store's new keys (``RowTable.new_rows``) and ``remove`` per dropped key (``on_dropped``, a batch
under one hold). A call that lays out the whole slot array holds the lock for a time that grows
with the table. Per table size (keys), two phases, each call timed (wall and thread CPU):

* ``fill``: ``add_absent`` of 64 fresh keys at a time into ``KeyTable(capacity)`` up to ``keys``;
  ``capacity`` is ``keys`` (``--sized``, what ``BlockIndex`` does: rows allocated up front) or
  1024 (``--grow``: rows and slots grow as keys come).
* ``churn``: ``keys / 64`` rounds of an eviction and a store at a full table: ``remove`` of the 64
  oldest keys (timed as one batch, as ``on_dropped`` holds the lock over its keys) then
  ``add_absent`` of 64 fresh ones. Tombstones pile up, so the slot array is laid out again
  (base) or rehashed (incremental) every few thousand rounds.
* ``lookup_get`` / ``lookup_get_many``: after the fill, up to ``LOOKUP_CALLS`` calls of 64
  present keys: 64 scalar ``get`` in one timed call, or one ``get_many`` (what a lookup of a
  64-block chain costs in the table, the table's own lock included where it has one).

Per call kind: the maximum and p99.9 over the calls of one run; a run is one child process per
tree; ``--base TREE`` runs another checkout side by side, ABBA (new base base new ...), and the
table gives per-tree medians over runs with min-max. Keys are random 32-byte strings (the
index's keys are SHA-256 digests: uniform). No thread or environment setting is changed.

Run::

    python bench/keytable_bench.py --keys 1k,10k,100k,1m --runs 5 --base /tmp/base --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve()
BATCH = 64
#: Timed lookup calls of ``BATCH`` present keys each (``lookup_*``).
LOOKUP_CALLS = 4000


def _count(s: str) -> int:
    s = s.strip().lower()
    mult = {"k": 1000, "m": 1000_000}.get(s[-1], 1)
    return int(float(s.rstrip("km")) * mult)


def _timed(fn, walls: list, cpus: list) -> None:
    c0, w0 = time.thread_time_ns(), time.perf_counter_ns()
    fn()
    walls.append(time.perf_counter_ns() - w0)
    cpus.append(time.thread_time_ns() - c0)


def _stats(ns: list) -> dict:
    s = sorted(ns)
    p999 = s[min(len(s) - 1, int(len(s) * 0.999))]
    return {"max_ms": s[-1] / 1e6, "p999_ms": p999 / 1e6, "mean_us": sum(s) / len(s) / 1e3, "calls": len(s)}


def child(n: int, sized: bool) -> dict:
    """One run at ``n`` keys in this process (the tierstore on ``sys.path``)."""
    from tierstore.keytable import KeyTable

    raw = os.urandom(32 * 2 * n)  # key i is raw[32 i : 32 i + 32]; no list of 2n keys (a gen-2
    # collection would walk it, a pause that is the benchmark's, not the table's)

    def keys(a: int, b: int) -> list:
        return [raw[j : j + 32] for j in range(32 * a, 32 * b, 32)]

    t = KeyTable(n if sized else 1024)
    out: dict = {}
    walls: list = []
    cpus: list = []
    for i in range(0, n, BATCH):
        batch = keys(i, min(n, i + BATCH))
        _timed(lambda b=batch: t.add_absent(b), walls, cpus)
    out["fill_add"] = {"wall": _stats(walls), "cpu": _stats(cpus)}
    for kind, look in (("lookup_get", lambda b: [t.get(k) for k in b]), ("lookup_get_many", t.get_many)):
        lw: list = []
        lc: list = []
        for i in range(0, min(n, BATCH * LOOKUP_CALLS) - BATCH + 1, BATCH):
            batch = keys(i, i + BATCH)
            _timed(lambda b=batch, f=look: f(b), lw, lc)
        out[kind] = {"wall": _stats(lw), "cpu": _stats(lc)}
    aw: list = []
    ac: list = []
    rw: list = []
    rc: list = []
    remove = t.remove
    old = new = []
    for i in range(0, n - BATCH + 1, BATCH):
        old = keys(i, i + BATCH)
        _timed(lambda o=old: [remove(k) for k in o], rw, rc)
        new = keys(n + i, n + i + BATCH)
        _timed(lambda b=new: t.add_absent(b), aw, ac)
    out["churn_add"] = {"wall": _stats(aw), "cpu": _stats(ac)}
    out["churn_remove"] = {"wall": _stats(rw), "cpu": _stats(rc)}
    assert len(t) == n and t.get_many(new).min() >= 0 and t.get_many(old).max() == -1
    out["full_rebuilds"] = getattr(t, "full_rebuilds", None)
    out["rehash_slots"] = getattr(t, "rehash_slots", None)
    out["slot_bytes_per_key"] = (t.nbytes - 33 * t.capacity_rows) / n
    return out


def _spawn(tree: str, n: int, sized: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=tree)
    args = [sys.executable, str(HERE), "--child", str(n), "--sized" if sized else "--grow"]
    r = subprocess.run(args, env=env, capture_output=True, text=True, check=True, cwd=tree)
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keys", default="1k,10k,100k,1m")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--base", help="another checkout, run side by side (ABBA)")
    ap.add_argument("--grow", action="store_true", help="start at 1024 rows (default: sized to the keys)")
    ap.add_argument("--sized", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, not a.grow)))
        return
    trees = {"new": str(HERE.parent.parent)}
    if a.base:
        trees["base"] = str(pathlib.Path(a.base).resolve())
    order = list(trees)
    results: dict = {}
    for n in map(_count, a.keys.split(",")):
        runs: dict = {t: [] for t in trees}
        for r in range(a.runs):
            seq = order if r % 2 == 0 else order[::-1]  # ABBA
            for name in seq:
                res = _spawn(trees[name], n, not a.grow)
                res["loadavg_1m"] = os.getloadavg()[0]
                runs[name].append(res)
        results[n] = runs
        for kind in ("fill_add", "churn_add", "churn_remove", "lookup_get", "lookup_get_many"):
            for name in trees:

                def med(clock: str, stat: str, rs=runs[name], kind=kind) -> str:
                    v = [x[kind][clock][stat] for x in rs]
                    return f"{statistics.median(v):.3f} [{min(v):.3f}-{max(v):.3f}]"

                load = statistics.median(x["loadavg_1m"] for x in runs[name])
                print(
                    f"{n:>8} {kind:13} {name:5} cpu ms max {med('cpu', 'max_ms')} "
                    f"p99.9 {med('cpu', 'p999_ms')} mean us {med('cpu', 'mean_us')} | "
                    f"wall ms max {med('wall', 'max_ms')} p99.9 {med('wall', 'p999_ms')} | load {load:.1f}",
                    flush=True,
                )
    if a.json:
        meta = {"argv": sys.argv, "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        pathlib.Path(a.json).write_text(json.dumps({"meta": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
