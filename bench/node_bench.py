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
once; reported: p50 and p99 over every lookup, in microseconds; the same with one client; the
embedded store's ``lookup_keys`` of the prefix (in-process: the index's share of a round trip);
and a floor: the same ``Lookup``/``LookupReply`` frames ping-ponged over a bare UNIX socket
(``FrameSocket`` and msgspec, a thread per connection in a process of its own, no store).

``--base TREE`` runs the whole measurement alternately on this tree and on ``TREE`` (a checkout
of the other commit, each in fresh subprocesses with ``PYTHONPATH`` set to it), ``--runs``
rounds, ABBA; ``--busy N`` repeats every round with ``N`` processes spinning on the CPUs.

    python bench/node_bench.py --dir /tmp/nodebench --runs 5
    python bench/node_bench.py --dir /tmp/nodebench --runs 5 --base /tmp/base --busy 2 --json OUT
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


def start_service(d: str, host_bytes: int, sock: str, root: str = ROOT) -> subprocess.Popen:
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
            cwd=root,
            env=dict(os.environ, PYTHONPATH=root),
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


def _latency(lat_s) -> dict:
    lat = np.asarray(lat_s) * 1e6
    return {
        "lookups": int(lat.size),
        "p50_us": float(np.percentile(lat, 50)),
        "p99_us": float(np.percentile(lat, 99)),
        "mean_us": float(lat.mean()),
    }


class _Go:
    """A start signal that is already given (one client: this process)."""

    def wait(self) -> None:
        pass


def _at_once(target, args: tuple, clients: int) -> list[float]:
    """``clients`` spawned processes run ``target(*args, start)`` at once (one client: this
    process runs it); their latencies."""
    if clients == 1:
        return list(target(*args, _Go()))
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ctx.Pool(clients) as pool:
        start, ready = manager.Event(), manager.Semaphore(0)
        jobs = [pool.apply_async(_ready_then, (target, args, start, ready)) for _ in range(clients)]
        for _ in range(clients):  # every client imported, connected and waits
            ready.acquire()
        start.set()
        return list(np.concatenate([np.asarray(j.get()) for j in jobs]))


class _Announce:
    """``start`` for a client: its first ``wait`` tells the driver the client is ready."""

    def __init__(self, start, ready) -> None:
        self.start, self.ready = start, ready

    def wait(self) -> None:
        self.ready.release()
        self.start.wait()


def _ready_then(target, args: tuple, start, ready) -> list[float]:
    return target(*args, _Announce(start, ready))


def lookups(args, url: str) -> dict:
    from tierstore.node.client import NodeKVStore

    lay = _layout()
    c = NodeKVStore(url, lay, timeout_s=60)
    toks = list(range(7_000_000, 7_000_000 + args.prefix_blocks * 16))
    data = torch.zeros(args.prefix_blocks, lay.bytes_per_block, dtype=torch.uint8)
    c.store(NS, toks, data)
    keys = c.keys_for(NS, toks)
    out = {"clients": args.clients, "prefix_blocks": args.prefix_blocks}
    out.update(_latency(_at_once(lookup_client, (url, keys, args.lookups), args.clients)))
    out["one_client"] = _latency(_at_once(lookup_client, (url, keys, args.lookups), 1))
    c.invalidate(NS)
    c.close()
    return out


def embedded_lookup(args) -> dict:
    """``KVStore.lookup_keys`` of a resident prefix in this process: the index's own time."""
    from tierstore.api import KVStore

    lay = _layout()
    d = os.path.join(args.dir, "embedded")
    os.makedirs(d, exist_ok=True)
    store = KVStore.from_config({"tiers": _tiers(d, args.host_bytes)}, lay)
    toks = list(range(7_000_000, 7_000_000 + args.prefix_blocks * 16))
    store.store(NS, toks, torch.zeros(args.prefix_blocks, lay.bytes_per_block, dtype=torch.uint8))
    keys = store.keys_for(NS, toks)
    lat = []
    for _ in range(args.lookups):
        t0 = time.perf_counter()
        store.lookup_keys(keys)
        lat.append(time.perf_counter() - t0)
    store.invalidate(NS)
    store.close()
    return _latency(lat)


def ping_server(path: str) -> None:
    """The floor's server: answer every ``Lookup`` frame with a 64-block ``LookupReply``."""
    import threading

    from tierstore.node import protocol as P

    def serve(conn: socket.socket) -> None:
        fs = P.FrameSocket(conn, P.REQUEST_DECODER)
        if hasattr(fs, "set_timeout"):  # the tree's own way of bounding calls
            fs.set_timeout(60.0)
        else:
            conn.settimeout(60.0)
        while (m := fs.recv()) is not None:
            n = len(m.keys) // 32
            fs.send(
                P.LookupReply(m.rid, matched=n, useful=n, tiers=bytes(n), load_s=bytes(4 * n), reason=None)
            )

    ls = socket.socket(socket.AF_UNIX)
    ls.bind(path)
    ls.listen(16)
    while True:
        conn, _ = ls.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()


def ping_client(path: str, keys: list, n: int, start) -> list[float]:
    from tierstore.node import protocol as P

    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    fs = P.FrameSocket(s, P.REPLY_DECODER)
    raw, out = b"".join(keys), []
    start.wait()
    for i in range(n):
        t0 = time.perf_counter()
        if hasattr(fs, "set_timeout"):  # as the tree's client does per call
            fs.set_timeout(60.0)
        else:
            s.settimeout(60.0)
        fs.send(P.Lookup(i, ns=bytes(32), keys=raw, hold=None, pin_s=None))
        fs.recv()
        out.append(time.perf_counter() - t0)
    s.close()
    return out


def floor(args) -> dict:
    """Round trips of bare ``Lookup`` frames (see the module docstring), 1 and ``--clients``."""
    path = os.path.join(args.dir, "ping.sock")
    if os.path.exists(path):
        os.remove(path)
    srv = multiprocessing.get_context("spawn").Process(target=ping_server, args=(path,), daemon=True)
    srv.start()
    try:
        while not os.path.exists(path):
            time.sleep(0.05)
        keys = [bytes([i]) * 32 for i in range(args.prefix_blocks)]
        return {
            "one_client": _latency(_at_once(ping_client, (path, keys, args.lookups), 1)),
            "clients": _latency(_at_once(ping_client, (path, keys, args.lookups), args.clients)),
        }
    finally:
        srv.kill()
        srv.join()


def measure(args, root: str = ROOT) -> dict:
    """One tree's measurement (the service started from ``root``): throughput, lookups, floors."""
    for name in ("nvme", "node.yaml", "node.log", "node.sock", "state", "embedded"):  # what this script wrote
        p = os.path.join(args.dir, name)
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.remove(p)
    os.makedirs(args.dir, exist_ok=True)
    sock = os.path.join(args.dir, "node.sock")
    proc = start_service(args.dir, args.host_bytes, sock, root)
    try:
        out = {
            "load_average_before": os.getloadavg(),
            "throughput": throughput(args, "unix://" + sock),
            "lookup": lookups(args, "unix://" + sock),
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    shutil.rmtree(os.path.join(args.dir, "embedded"), ignore_errors=True)
    out["embedded_lookup"] = embedded_lookup(args)
    out["floor"] = floor(args)
    out["load_average_after"] = os.getloadavg()
    return out


def _figures(m: dict) -> dict:
    """The figures of one measurement the tables show."""
    t, lk = m["throughput"], m["lookup"]
    return {
        "store_node_GBps": t["node"]["store"]["median"],
        "store_embedded_GBps": t["embedded"]["store"]["median"],
        "store_ratio": t["ratio_node_over_embedded"]["store"],
        "load_node_GBps": t["node"]["load"]["median"],
        "load_embedded_GBps": t["embedded"]["load"]["median"],
        "load_ratio": t["ratio_node_over_embedded"]["load"],
        "lookup_p50_us": lk["p50_us"],
        "lookup_p99_us": lk["p99_us"],
        "lookup_1client_p50_us": lk["one_client"]["p50_us"],
        "lookup_1client_p99_us": lk["one_client"]["p99_us"],
        "embedded_lookup_p50_us": m["embedded_lookup"]["p50_us"],
        "floor_1client_p50_us": m["floor"]["one_client"]["p50_us"],
        "floor_p50_us": m["floor"]["clients"]["p50_us"],
        "floor_p99_us": m["floor"]["clients"]["p99_us"],
        "load_average_1m": (m["load_average_before"][0] + m["load_average_after"][0]) / 2,
    }


def run_tree(args, tree: str) -> dict:
    """:func:`measure` in a fresh process on ``tree`` (its own package and service)."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        "--dir",
        args.dir,
        "--runs",
        str(args.runs_per_round),
    ]
    cmd += [
        "--blocks",
        str(args.blocks),
        "--host-bytes",
        str(args.host_bytes),
        "--clients",
        str(args.clients),
    ]
    cmd += ["--prefix-blocks", str(args.prefix_blocks), "--lookups", str(args.lookups)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tree, env=dict(os.environ, PYTHONPATH=tree))
    if r.returncode != 0:
        raise SystemExit(f"the measurement on {tree} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def compare(args) -> dict:
    """ABBA rounds of this tree ("new") and ``--base`` ("base"), quiet and with ``--busy``."""
    trees = {"new": ROOT, "base": os.path.abspath(args.base)}
    modes = ["quiet", "busy"] if args.busy else ["quiet"]
    raw: dict = {mode: {name: [] for name in trees} for mode in modes}
    for mode in modes:
        for i in range(args.runs):
            order = ["new", "base"] if i % 2 == 0 else ["base", "new"]
            for name in order:
                from tierstore.bench.busy import competitors  # here: a --base tree may lack it

                with competitors(args.busy if mode == "busy" else 0):
                    raw[mode][name].append(run_tree(args, trees[name]))
                print(f"{mode} round {i + 1} {name}: {_figures(raw[mode][name][-1])}", flush=True)
                if args.json:  # what is done so far survives a stopped run
                    with open(args.json, "w") as f:
                        json.dump({"trees": trees, "busy_processes": args.busy, "raw": raw}, f)
    table = {
        mode: {
            name: {k: _spread([_figures(m)[k] for m in runs]) for k in _figures(runs[0])}
            for name, runs in by_tree.items()
        }
        for mode, by_tree in raw.items()
    }
    return {"trees": trees, "busy_processes": args.busy, "summary": table, "raw": raw}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/tierstore-nodebench")
    ap.add_argument("--runs", type=int, default=5, help="pairs (one tree) or ABBA rounds (--base)")
    ap.add_argument("--runs-per-round", type=int, default=3, help="with --base: store/load pairs per round")
    ap.add_argument("--blocks", type=int, default=32, help="2 MiB blocks per store and load call")
    ap.add_argument("--host-bytes", type=int, default=512 << 20)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--prefix-blocks", type=int, default=64)
    ap.add_argument("--lookups", type=int, default=2000)
    ap.add_argument("--base", default=None, help="a checkout of the commit to compare with (ABBA)")
    ap.add_argument("--busy", type=int, default=0, help="with --base: also measure with N spinning processes")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(measure(args, os.getcwd())))
        return
    if args.base:
        out = compare(args)
        for mode, by_tree in out["summary"].items():
            for k in by_tree["new"]:
                n, b = by_tree["new"][k], by_tree["base"][k]
                print(
                    f"{mode:5s} {k:24s} new {n['median']:9.2f} ({n['min']:.2f}..{n['max']:.2f})  "
                    f"base {b['median']:9.2f} ({b['min']:.2f}..{b['max']:.2f})"
                )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1)
        return
    out = measure(args)
    t, lk = out["throughput"], out["lookup"]
    for op in ("store", "load"):
        n, e = t["node"][op], t["embedded"][op]
        print(
            f"{op}: node {n['median']:.2f} GB/s ({n['min']:.2f}..{n['max']:.2f}), embedded {e['median']:.2f} "
            f"GB/s ({e['min']:.2f}..{e['max']:.2f}), ratio {t['ratio_node_over_embedded'][op]:.2f}"
        )
    print(
        f"lookup of {lk['prefix_blocks']} blocks, {lk['clients']} clients: p50 {lk['p50_us']:.0f} us, "
        f"p99 {lk['p99_us']:.0f} us ({lk['lookups']} lookups); "
        f"one client p50 {lk['one_client']['p50_us']:.0f} us"
    )
    print(
        f"floor (bare socket) {out['floor']}; "
        f"embedded lookup_keys p50 {out['embedded_lookup']['p50_us']:.0f} us"
    )
    print(f"load average before {out['load_average_before']}, after {out['load_average_after']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
