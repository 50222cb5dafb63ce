"""The node service through its client next to the embedded store (issue 24, N9).

Part 1, throughput: 2 MiB blocks (llama-3.1-8b, 16 tokens a block) stored and loaded back through
``NodeKVStore`` (the service runs as its own process, ``tierstore serve --node``) and through an
embedded ``KVStore`` built from the same tiers (host DRAM, an NVMe file under ``--dir``, write-back).
A run stores ``--blocks`` fresh blocks in one call, loads them back into ready buffers in one call
(host hits), checks the bytes and invalidates them. Runs come in pairs, odd pairs in the other
order (ABBA); reported: the median GB/s (1e9 B/s) of ``--runs`` pairs with min..max, and the
ratio node/embedded of the medians.

Part 2, lookup round trip: ``--clients`` client processes (spawned), each with its own
``NodeKVStore``, look up a ``--prefix-blocks`` prefix that is resident (precomputed keys:
``lookup_keys``, so the round trip is measured, not the hashing), ``--lookups`` times each at
once; reported: p50 and p99 over every lookup, in microseconds.

    python bench/node_bench.py --dir /tmp/nodebench --runs 5
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time

import numpy as np
import torch
import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
NS = b"b" * 32


def _layout():
    from tierstore.config import LayoutConfig

    return LayoutConfig(preset="llama-3.1-8b", tokens_per_block=16).build()  # 2 MiB blocks


def _tiers(d: str, host_bytes: int) -> dict:
    return {
        "hbm": {"capacity_bytes": 0},
        "host": {"capacity_bytes": host_bytes},
        "nvme": {"path": os.path.join(d, "nvme"), "capacity_bytes": "2GiB", "segment_size_bytes": "64MiB"},
    }


def start_service(d: str, host_bytes: int, sock: str) -> subprocess.Popen:
    """``tierstore serve --node`` on a generated config; waits until it answers."""
    cfg = {
        "state_dir": os.path.join(d, "state"),
        "log": {"level": "WARNING", "access_log": False},
        "layout": {"preset": "llama-3.1-8b", "tokens_per_block": 16},
        "tiers": _tiers(d, host_bytes),
        "puts": {"durable": False},
        "tenants": [{"name": "bench", "tokens": ["bench-token-0123456789"]}],
        "node": {"socket": sock, "staging_blocks": 64, "max_keys": 4096, "tenant": "bench"},
    }
    path = os.path.join(d, "node.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    with open(os.path.join(d, "node.log"), "wb") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tierstore.cli", "serve", "--node", "--config", path],
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT),
        )
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"the node service exited {proc.returncode}; see {d}/node.log")
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(sock)
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("the node service did not start")


def one_run(store, data: torch.Tensor, dests: list, base: int) -> tuple[float, float]:
    """Store ``data`` as fresh blocks, load them back into ``dests``; (store GB/s, load GB/s)."""
    from tierstore.errors import Status

    n, bb = data.shape
    toks = list(range(base, base + n * 16))
    t0 = time.perf_counter()
    st = store.store(NS, toks, data)
    t1 = time.perf_counter()
    keys = store.keys_for(NS, toks)
    t2 = time.perf_counter()
    got, _ = store.load(keys, dests)
    t3 = time.perf_counter()
    if st != [Status.OK] * n or got != [Status.OK] * n:
        raise SystemExit(f"not all OK: store {set(st)}, load {set(got)}")
    if not all(np.array_equal(d.numpy(), r.numpy()) for d, r in zip(dests, data)):  # numpy: one thread
        raise SystemExit("wrong bytes loaded")
    store.invalidate(NS)
    return n * bb / (t1 - t0) / 1e9, n * bb / (t3 - t2) / 1e9


def lookup_client(url: str, keys: list, lookups: int, start) -> list[float]:
    """One client process: ``lookups`` lookups of ``keys``; latencies in seconds."""
    from tierstore.node.client import NodeKVStore

    c = NodeKVStore(url, _layout())
    c.lookup_keys(keys[:1])  # connect and map before timing
    start.wait()
    out = []
    for _ in range(lookups):
        t0 = time.perf_counter()
        r = c.lookup_keys(keys)
        out.append(time.perf_counter() - t0)
        if r.matched_blocks != len(keys):
            raise SystemExit(f"lookup matched {r.matched_blocks} of {len(keys)}")
    c.close()
    return out


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "runs": xs}


def throughput(args, url: str) -> dict:
    from tierstore.api import KVStore
    from tierstore.node.client import NodeKVStore

    lay = _layout()
    bb = lay.bytes_per_block
    emb_dir = os.path.join(args.dir, "embedded")
    os.makedirs(emb_dir, exist_ok=True)
    embedded = KVStore.from_config({"tiers": _tiers(emb_dir, args.host_bytes)}, lay)
    node = NodeKVStore(url, lay, timeout_s=60)
    rng = np.random.default_rng(1)
    data = torch.from_numpy(rng.integers(0, 256, (args.blocks, bb), dtype=np.uint8))
    dests = [torch.empty(bb, dtype=torch.uint8) for _ in range(args.blocks)]
    res: dict = {"node": {"store": [], "load": []}, "embedded": {"store": [], "load": []}, "order": []}
    base = 0
    one_run(embedded, data, dests, 10**8)  # warm both (first touch of pages, connection)
    one_run(node, data, dests, 10**8)
    for i in range(args.runs):
        order = (
            [("embedded", embedded), ("node", node)]
            if i % 2 == 0
            else [("node", node), ("embedded", embedded)]
        )
        res["order"].append([o[0] for o in order])
        for name, store in order:
            base += args.blocks * 16
            s, ld = one_run(store, data, dests, base)
            res[name]["store"].append(s)
            res[name]["load"].append(ld)
    node.close()
    embedded.close()
    out = {k: {op: _spread(v) for op, v in res[k].items()} for k in ("node", "embedded")}
    out["order"] = res["order"]
    out["ratio_node_over_embedded"] = {
        op: out["node"][op]["median"] / out["embedded"][op]["median"] for op in ("store", "load")
    }
    return out


def lookups(args, url: str) -> dict:
    from tierstore.node.client import NodeKVStore

    lay = _layout()
    c = NodeKVStore(url, lay, timeout_s=60)
    toks = list(range(7_000_000, 7_000_000 + args.prefix_blocks * 16))
    data = torch.zeros(args.prefix_blocks, lay.bytes_per_block, dtype=torch.uint8)
    c.store(NS, toks, data)
    keys = c.keys_for(NS, toks)
    ctx = multiprocessing.get_context("spawn")
    start = ctx.Manager().Event()
    with ctx.Pool(args.clients) as pool:
        jobs = [
            pool.apply_async(lookup_client, (url, keys, args.lookups, start)) for _ in range(args.clients)
        ]
        time.sleep(5)  # the clients import, connect and wait
        start.set()
        lat = np.concatenate([np.asarray(j.get()) for j in jobs]) * 1e6
    c.invalidate(NS)
    c.close()
    return {
        "clients": args.clients,
        "prefix_blocks": args.prefix_blocks,
        "lookups": int(lat.size),
        "p50_us": float(np.percentile(lat, 50)),
        "p99_us": float(np.percentile(lat, 99)),
        "mean_us": float(lat.mean()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/tierstore-nodebench")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--blocks", type=int, default=32, help="2 MiB blocks per store and load call")
    ap.add_argument("--host-bytes", type=int, default=512 << 20)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--prefix-blocks", type=int, default=64)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    for name in ("nvme", "node.yaml", "node.log", "node.sock", "state", "embedded"):  # what this script wrote
        p = os.path.join(args.dir, name)
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.remove(p)
    os.makedirs(args.dir, exist_ok=True)
    sock = os.path.join(args.dir, "node.sock")
    proc = start_service(args.dir, args.host_bytes, sock)
    try:
        out = {
            "load_average_before": os.getloadavg(),
            "throughput": throughput(args, "unix://" + sock),
            "lookup": lookups(args, "unix://" + sock),
            "load_average_after": os.getloadavg(),
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    t, lk = out["throughput"], out["lookup"]
    for op in ("store", "load"):
        n, e = t["node"][op], t["embedded"][op]
        print(
            f"{op}: node {n['median']:.2f} GB/s ({n['min']:.2f}..{n['max']:.2f}), embedded {e['median']:.2f} "
            f"GB/s ({e['min']:.2f}..{e['max']:.2f}), ratio {t['ratio_node_over_embedded'][op]:.2f}"
        )
    print(
        f"lookup of {lk['prefix_blocks']} blocks, {lk['clients']} clients: p50 {lk['p50_us']:.0f} us, "
        f"p99 {lk['p99_us']:.0f} us ({lk['lookups']} lookups)"
    )
    print(f"load average before {out['load_average_before']}, after {out['load_average_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
