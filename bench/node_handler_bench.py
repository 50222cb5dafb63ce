"""CPU time of the node service's request handlers, alone, in process (issue 24).

A steadier figure than ``node_bench.py``'s round trips on a shared host: the CPU seconds
(``time.thread_time``) one request costs the service, from the decoded request to the encoded
reply, without the socket, the wake-ups or the client. The pool is built as ``node_bench.py``'s
service builds it (``open_node_core`` of the same generated config: llama-3.1-8b, 2 MiB blocks,
512 MiB host tier, an NVMe file, write-back puts, one tenant), served by a ``NodeServer`` that
never listens: each request goes through ``NodeServer._answer`` (dispatch, tenancy, the store,
metrics) as a session thread runs it. Measured: ``Lookup`` of a resident 64-block prefix
(key-level, as ``lookup_keys``), then ``PrepareStore`` + ``CompleteStore`` of 32 fresh blocks
(the client's copy is not made: the slots keep what they held), each followed by an
``Invalidate`` (not timed), as ``node_bench.py``'s store runs. Reported: the median per request
type in microseconds, and, load-independent, the Python-level calls one request makes
(``cProfile``'s count over ``--profiled`` more requests of each type, as ``call_counts.py``).

``--base TREE`` runs it alternately in fresh processes on this tree and on ``TREE`` (a checkout
of the other commit, ``PYTHONPATH`` set to it), ``--rounds`` each, ABAB; reported per tree the
median over rounds of the per-round medians, with min..max.

    python bench/node_handler_bench.py --dir /tmp/nhb --lookups 2000 --stores 400
    python bench/node_handler_bench.py --dir /tmp/nhb --base /tmp/base --rounds 6 --json OUT
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import shutil
import socket
import statistics
import subprocess
import sys
import time

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
NS = b"b" * 32


def _config(d: str) -> str:
    """The generated config of ``node_bench.start_service`` (no socket is listened on)."""
    cfg = {
        "state_dir": os.path.join(d, "state"),
        "log": {"level": "WARNING", "access_log": False},
        "layout": {"preset": "llama-3.1-8b", "tokens_per_block": 16},
        "tiers": {
            "hbm": {"capacity_bytes": 0},
            "host": {"capacity_bytes": 512 << 20},
            "nvme": {
                "path": os.path.join(d, "nvme"),
                "capacity_bytes": "2GiB",
                "segment_size_bytes": "64MiB",
            },
        },
        "puts": {"durable": False},
        "tenants": [{"name": "bench", "tokens": ["bench-token-0123456789"]}],
        "node": {
            "socket": os.path.join(d, "node.sock"),
            "staging_blocks": 64,
            "max_keys": 4096,
            "tenant": "bench",
        },
    }
    path = os.path.join(d, "node.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def measure(args) -> dict:
    """One tree's medians (this process's ``tierstore``)."""
    from tierstore.identity import DigestCache, block_hashes
    from tierstore.node import protocol as P
    from tierstore.node import server as S
    from tierstore.server.config import load_config

    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    cfg = load_config(_config(args.dir))
    core = S.open_node_core(cfg)
    access, metrics, _ = S._tenancy_and_metrics(cfg, core)
    srv = S.NodeServer(core, cfg.node, access=access, metrics=metrics)
    a, b = socket.socketpair()
    s = S._Session(
        1, P.FrameSocket(a, P.REQUEST_DECODER), os.getpid(), None, uid=os.getuid(), gid=os.getgid()
    )
    s.welcomed, s.tenant = True, "bench"
    digest = DigestCache(scope=core.layout.fingerprint())(NS)
    enc = P.msgspec.msgpack.Encoder()

    def wire(msg):  # as the session thread receives it: encoded, decoded against the schema
        return P.REQUEST_DECODER.decode(enc.encode(msg))

    prof = {name: cProfile.Profile() for name in ("lookup", "prepare_store", "complete_store")}

    def answer(msg, name: str = "", profiled: bool = False):
        p = prof[name] if profiled else None
        t0 = time.thread_time_ns()
        if p is not None:
            p.enable()
        reply = srv._answer(s, msg)
        enc.encode(reply)
        if p is not None:
            p.disable()
        return reply, time.thread_time_ns() - t0

    def store(first: int, n: int, profiled: bool = False):
        keys = block_hashes(digest, list(range(first, first + n * 16)), 16)
        prepare = P.PrepareStore(1, ns=digest, keys=b"".join(keys), first_position=0, lifetime=0, wait=True)
        t, c1 = answer(wire(prepare), "prepare_store", profiled)
        complete = P.CompleteStore(2, plan_id=t.plan_id, ok=bytes([1]) * n)
        o, c2 = answer(wire(complete), "complete_store", profiled)
        if not isinstance(o, P.StoreOutcome) or set(o.statuses) != {0}:
            raise SystemExit(f"store not OK: {o}")
        return keys, c1, c2

    try:
        keys, _, _ = store(7_000_000, args.prefix_blocks)
        lookup = wire(P.Lookup(3, ns=bytes(32), keys=b"".join(keys), hold=None, pin_s=None))
        res: dict[str, list[int]] = {"lookup": [], "prepare_store": [], "complete_store": []}
        for _ in range(args.lookups):
            r, c = answer(lookup)
            if r.matched != args.prefix_blocks:
                raise SystemExit(f"lookup matched {r.matched}")
            res["lookup"].append(c)
        srv._answer(s, wire(P.Invalidate(4, ns=digest)))
        for i in range(args.stores + args.profiled):
            profiled = i >= args.stores  # the last ones count calls (cProfile), not time
            _, c1, c2 = store(10**8 + i * args.blocks * 16, args.blocks, profiled)
            if not profiled:
                res["prepare_store"].append(c1)
                res["complete_store"].append(c2)
            srv._answer(s, wire(P.Invalidate(5, ns=digest)))
        for _ in range(args.profiled):
            answer(lookup, "lookup", True)
    finally:
        core.close()
        a.close()
        b.close()
    out = {f"{k}_us": statistics.median(v) / 1e3 for k, v in res.items()}
    for name, p in prof.items():  # load-independent: the Python-level calls of one request
        out[f"{name}_calls"] = pstats.Stats(p).total_calls / args.profiled
    out["load_average_1m"] = os.getloadavg()[0]
    return out


def compare(args) -> dict:
    trees = {"new": os.path.dirname(HERE), "base": os.path.abspath(args.base)}
    raw: dict = {name: [] for name in trees}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--dir", args.dir]
    cmd += ["--lookups", str(args.lookups), "--stores", str(args.stores), "--blocks", str(args.blocks)]
    cmd += ["--profiled", str(args.profiled)]
    for i in range(args.rounds):
        for name in ("new", "base") if i % 2 == 0 else ("base", "new"):
            tree = trees[name]
            r = subprocess.run(
                cmd, capture_output=True, text=True, cwd=tree, env=dict(os.environ, PYTHONPATH=tree)
            )
            if r.returncode != 0:
                raise SystemExit(f"{name} failed:\n{r.stderr[-3000:]}")
            raw[name].append(json.loads(r.stdout.strip().splitlines()[-1]))
            print(f"round {i + 1} {name}: {raw[name][-1]}", flush=True)
    summary = {
        name: {
            k: {
                "median": statistics.median(x[k] for x in runs),
                "min": min(x[k] for x in runs),
                "max": max(x[k] for x in runs),
            }
            for k in runs[0]
        }
        for name, runs in raw.items()
    }
    return {"trees": trees, "summary": summary, "raw": raw}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/tierstore-node-handler-bench")
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--stores", type=int, default=400, help="PrepareStore/CompleteStore pairs")
    ap.add_argument("--blocks", type=int, default=32, help="2 MiB blocks per store")
    ap.add_argument("--prefix-blocks", type=int, default=64)
    ap.add_argument("--profiled", type=int, default=50, help="requests of each type whose calls are counted")
    ap.add_argument("--base", default=None, help="a checkout of the commit to compare with (ABAB)")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = compare(args) if args.base and not args.worker else measure(args)
    if args.worker:
        print(json.dumps(out))
        return
    if args.base:
        for k in out["summary"]["new"]:
            n, b = out["summary"]["new"][k], out["summary"]["base"][k]
            sn, sb = (" ".join(f"{x[q]:8.1f}" for q in ("median", "min", "max")) for x in (n, b))
            print(f"{k:22s} new (median min max) {sn}  base {sb}")
    else:
        print(json.dumps(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
