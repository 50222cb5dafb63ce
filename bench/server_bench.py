"""Loopback benchmark of the tierstore daemon next to a trivial aiohttp baseline.

Runs, in one invocation:

* the real daemon (``python -m tierstore.cli serve``) from a generated YAML:
  llama-3.1-8b layout (2 MiB blocks), host tier, NVMe tier as a file under
  ``--dir``, puts acknowledged durably (``--ack durable``, write-through: O_DIRECT + fdatasync)
  or from the host tier (``--ack memory``, write-back), two tenants' worth of auth checks;
* a baseline server of the same framework (aiohttp) that keeps bodies in a
  dict and serves them back (``--baseline`` handler below).

Two client threads each run ``--ops`` puts and then ``--ops`` gets per batch
size (2, 8, 16 MiB by default), ``--runs`` times. Puts use fresh keys (no
dedupe shortcut); gets read back the batches just put (host-tier hits).
Each run is a (baseline, tierstore) pair run back to back; odd runs swap the
order (ABBA, as ``bench/io_bench.py``), so neither side always runs on a
machine warmed or disturbed by the other. Reported: aggregate throughput
(GB/s = 1e9 B/s) and per-request p50/p99 latency, as the median over runs with
the min..max spread.

``--dir`` may be reused: the files this script wrote there before (the
daemon's config, log, state and NVMe tier, the baseline's port file) are
removed first, so a stale port or a recovered tier never leaks into a run.

    python bench/server_bench.py --dir /tmp/tsbench --runs 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import torch
import yaml

from tierstore import Namespace
from tierstore.client import RemoteKVStore
from tierstore.errors import Status

#: This file's directory (the baseline server's subprocess imports this module from there) and the
#: checkout (the daemon runs its ``tierstore``, which may not be the installed one).
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

TOKEN = "bench-token-0123456789abcdef"
MiB = 1 << 20


def baseline_server(port_file: str) -> None:
    """A trivial aiohttp app serving bytes from a dict (the framework's own cost)."""
    from aiohttp import web

    store: dict[str, bytes] = {}

    async def put(request):
        store[request.match_info["key"]] = await request.read()
        return web.json_response({"ok": True})

    async def get(request):
        return web.Response(body=store[request.match_info["key"]], content_type="application/octet-stream")

    async def main():
        app = web.Application(client_max_size=1 << 30)
        app.add_routes([web.put("/b/{key}", put), web.get("/b/{key}", get)])
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        tmp = f"{port_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:  # written whole, then renamed: a reader never sees a partial port
            f.write(str(site._server.sockets[0].getsockname()[1]))
        os.replace(tmp, port_file)
        await asyncio.Event().wait()

    asyncio.run(main())


#: ``--ack`` choices: what a put's answer waits for (``puts.durable`` of the daemon's config).
ACKS = {"durable": True, "memory": False}


def start_daemon(
    work: str, host_bytes: str, nvme_bytes: str, root: str = ROOT, durable: bool = True
) -> tuple[subprocess.Popen, int, str]:
    """Start ``tierstore serve`` of the checkout ``root`` (its ``PYTHONPATH``) on a generated config in
    ``work``; returns the process, its port and its log's path.

    ``durable`` is the config's ``puts.durable``: ``True`` answers a put once its blocks are
    written (O_DIRECT) and fdatasync'ed on the NVMe tier; ``False`` (write-back) once they are
    copied into the host tier, as the baseline answers once the body is in its dict (blocks
    reach NVMe only when demoted).
    """
    cfg = {
        "puts": {"durable": durable},
        "state_dir": os.path.join(work, "state"),
        "listen": {"host": "127.0.0.1", "port": 0},
        "log": {"level": "WARNING", "access_log": False},
        "layout": {"preset": "llama-3.1-8b"},
        "tiers": {
            "host": {"capacity_bytes": host_bytes},
            "nvme": {
                "path": os.path.join(work, "nvme"),
                "capacity_bytes": nvme_bytes,
                "segment_size_bytes": "64MiB",
                "extent_size_bytes": "16MiB",
            },
        },
        "tenants": [{"name": "bench", "tokens": [TOKEN]}, {"name": "other", "tokens": ["other-" + TOKEN]}],
        "limits": {"max_request_bytes": "40MiB", "worker_threads": 4},
    }
    path = os.path.join(work, "daemon.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    log = os.path.join(work, "daemon.log")
    env = dict(os.environ, PYTHONPATH=root)
    with open(log, "wb") as err:
        # WARNING level hides the "listening" line: pass INFO just for the startup record
        cfg["log"]["level"] = "INFO"
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        p = subprocess.Popen(
            [sys.executable, "-m", "tierstore.cli", "serve", "--config", path],
            stderr=err,
            stdout=subprocess.DEVNULL,
            env=env,
        )
    for _ in range(600):
        with open(log) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if rec.get("event") == "listening":
                    return p, rec["port"], log
        if p.poll() is not None:
            raise RuntimeError(open(log).read())
        time.sleep(0.1)
    raise RuntimeError("daemon did not start")


class BaselineClient:
    """aiohttp client on a background loop (the same plumbing RemoteKVStore uses)."""

    def __init__(self, url: str) -> None:
        import aiohttp

        self.url = url
        self.loop = asyncio.new_event_loop()
        self.t = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.t.start()

        async def mk():
            return aiohttp.ClientSession()

        self.s = asyncio.run_coroutine_threadsafe(mk(), self.loop).result()

    def put(self, key: str, data: memoryview) -> None:
        async def go():
            async with self.s.put(f"{self.url}/b/{key}", data=data) as r:
                await r.read()

        asyncio.run_coroutine_threadsafe(go(), self.loop).result()

    def get(self, key: str) -> int:
        async def go():
            async with self.s.get(f"{self.url}/b/{key}") as r:
                return len(await r.read())

        return asyncio.run_coroutine_threadsafe(go(), self.loop).result()

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.s.close(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)


def run_phase(n_clients: int, fn) -> tuple[float, list[float]]:
    """Run ``fn(client_index, lat_list)`` in threads; returns (wall seconds, latencies in s)."""
    lats: list[list[float]] = [[] for _ in range(n_clients)]
    ths = [threading.Thread(target=fn, args=(i, lats[i])) for i in range(n_clients)]
    t0 = time.perf_counter()
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    return time.perf_counter() - t0, [x for lat in lats for x in lat]


def bench_tierstore(url: str, sizes_mib: list[int], ops: int, n_clients: int, run: int) -> dict:
    clients = [RemoteKVStore(url, TOKEN) for _ in range(n_clients)]
    B = clients[0].block_bytes
    out = {}
    for mib in sizes_mib:
        nblk = max(1, mib * MiB // B)
        data = torch.from_numpy(np.random.default_rng(mib).integers(0, 256, (nblk, B), dtype=np.uint8))
        ns = Namespace(model=f"bench-{run}-{mib}")
        keysets = [[[os.urandom(32) for _ in range(nblk)] for _ in range(ops)] for _ in range(n_clients)]

        def put(i, lat):
            for keys in keysets[i]:
                t = time.perf_counter()
                st = clients[i].store_keys(ns, keys, data)
                lat.append(time.perf_counter() - t)
                if any(s is not Status.OK for s in st):
                    raise RuntimeError(f"put failed: {st}")

        dests = [[torch.empty(B, dtype=torch.uint8) for _ in range(nblk)] for _ in range(n_clients)]

        def get(i, lat):  # into preallocated buffers, as an engine loads into its KV cache
            for keys in keysets[i]:
                t = time.perf_counter()
                st, _ = clients[i].load(keys, dests=dests[i], ns=ns)
                lat.append(time.perf_counter() - t)
                if any(s is not Status.OK for s in st):
                    raise RuntimeError(f"get failed: {st}")

        nbytes = n_clients * ops * nblk * B
        for op, fn in (("put", put), ("get", get)):
            wall, lat = run_phase(n_clients, fn)
            out[(mib, op)] = (nbytes / wall, np.percentile(lat, 50), np.percentile(lat, 99))
        # verify one batch byte-exact (outside the timed phases)
        st, outs = clients[0].load(keysets[0][0], ns=ns)
        if not all(torch.equal(clients[0].layout.as_bytes(o), data[j]) for j, o in enumerate(outs)):
            raise RuntimeError("bytes differ")
        clients[0].invalidate(ns)
    for c in clients:
        c.close()
    return out


def bench_baseline(
    url: str, sizes_mib: list[int], ops: int, n_clients: int, run: int, block_bytes: int
) -> dict:
    clients = [BaselineClient(url) for _ in range(n_clients)]
    out = {}
    for mib in sizes_mib:
        nblk = max(1, mib * MiB // block_bytes)
        payload = memoryview(np.random.default_rng(mib).integers(0, 256, nblk * block_bytes, dtype=np.uint8))
        keys = [[f"{run}-{mib}-{i}-{j}" for j in range(ops)] for i in range(n_clients)]

        def put(i, lat):
            for k in keys[i]:
                t = time.perf_counter()
                clients[i].put(k, payload)
                lat.append(time.perf_counter() - t)

        def get(i, lat):
            for k in keys[i]:
                t = time.perf_counter()
                clients[i].get(k)
                lat.append(time.perf_counter() - t)

        nbytes = n_clients * ops * nblk * block_bytes
        for op, fn in (("put", put), ("get", get)):
            wall, lat = run_phase(n_clients, fn)
            out[(mib, op)] = (nbytes / wall, np.percentile(lat, 50), np.percentile(lat, 99))
    for c in clients:
        c.close()
    return out


#: What this script writes into ``--dir`` (and removes there before a run).
WORK_FILES = ("daemon.yaml", "daemon.log", "baseline.port", "state", "nvme")


def clean_work_dir(work: str) -> list[str]:
    """Remove what an earlier run of this script left in ``work``; returns the names removed."""
    removed = []
    for name in WORK_FILES:
        path = os.path.join(work, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
        else:
            continue
        removed.append(name)
    return removed


def wait_for_port(port_file: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> int:
    """The port the baseline server wrote (a fresh file: :func:`clean_work_dir` removed any old one).

    Raises
    ------
    RuntimeError
        If the baseline exits or writes nothing within ``timeout_s``.
    """
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        if os.path.exists(port_file):
            with open(port_file) as f:
                text = f.read().strip()
            if text:
                return int(text)
        if proc.poll() is not None:
            raise RuntimeError(f"the baseline server exited with status {proc.returncode} before listening")
        time.sleep(0.05)
    raise RuntimeError(f"the baseline server wrote no port to {port_file} within {timeout_s:.0f} s")


def measure(
    work: str,
    sizes: list[int],
    ops: int,
    n_clients: int,
    run_ids,
    host_bytes: str,
    nvme_bytes: str,
    root: str = ROOT,
    durable: bool = True,
) -> tuple[dict, list[str]]:
    """The daemon of the checkout ``root`` and the aiohttp baseline, both started in ``work``, one
    (baseline, tierstore) pair per run in ``run_ids``, ABBA: an odd run id runs tierstore first.

    Returns
    -------
    tuple of (dict, list of str)
        ``{"tierstore": [...], "baseline": [...]}``, a dict a run mapping ``(batch MiB, "put" | "get")``
        to ``(bytes/s, p50 s, p99 s)``; and each run's order. Both servers are stopped on return.
    """
    port_file = os.path.join(work, "baseline.port")
    daemon = base = None
    order: list[str] = []
    res: dict = {"tierstore": [], "baseline": []}
    try:
        daemon, port, _log = start_daemon(work, host_bytes, nvme_bytes, root, durable)
        base = subprocess.Popen(
            [
                sys.executable,
                "-c",
                f"import server_bench; server_bench.baseline_server({os.path.abspath(port_file)!r})",
            ],
            cwd=HERE,
        )
        bport = wait_for_port(port_file, base)
        block_bytes = 2 * MiB

        def run_baseline(r: int) -> None:
            res["baseline"].append(
                bench_baseline(f"http://127.0.0.1:{bport}", sizes, ops, n_clients, r, block_bytes)
            )

        def run_tierstore(r: int) -> None:
            res["tierstore"].append(bench_tierstore(f"http://127.0.0.1:{port}", sizes, ops, n_clients, r))

        for r in run_ids:  # ABBA: odd runs run tierstore before its baseline
            pair = (run_tierstore, run_baseline) if r % 2 else (run_baseline, run_tierstore)
            order.append("tierstore,baseline" if r % 2 else "baseline,tierstore")
            print(f"run {r + 1}: {order[-1]}", file=sys.stderr)
            for step in pair:
                step(r)
    finally:
        for proc, wait_s in ((daemon, 60), (base, 10)):
            if proc is not None:
                proc.terminate()
                proc.wait(wait_s)
    return res, order


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default=None, help="work directory (NVMe file lives here); default: a temp dir")
    ap.add_argument("--sizes-mib", default="2,8,16")
    ap.add_argument("--ops", type=int, default=12, help="requests per client per phase")
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--host-bytes", default="1GiB")
    ap.add_argument("--nvme-bytes", default="6GiB")
    ap.add_argument("--json", default=None, help="also write raw results here")
    ap.add_argument(
        "--ack",
        choices=sorted(ACKS),
        default="durable",
        help="durable: a put is answered once on NVMe (O_DIRECT + fdatasync); memory: once in the "
        "host tier (puts.durable: false, write-back), as the baseline answers from its dict",
    )
    ap.add_argument(
        "--root",
        default=ROOT,
        help="checkout whose tierstore the daemon runs (default: this one; e.g. a worktree of main "
        "for a before/after comparison)",
    )
    args = ap.parse_args(argv)
    sizes = [int(x) for x in args.sizes_mib.split(",")]
    work = args.dir or tempfile.mkdtemp(prefix="tsbench-")
    os.makedirs(work, exist_ok=True)
    removed = clean_work_dir(work)
    if removed:
        print(f"{work}: removed {', '.join(removed)} of an earlier run", file=sys.stderr)
    load = [os.getloadavg()]
    t_start = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    res, order = measure(
        work,
        sizes,
        args.ops,
        args.clients,
        range(args.runs),
        args.host_bytes,
        args.nvme_bytes,
        os.path.abspath(args.root),
        ACKS[args.ack],
    )
    load.append(os.getloadavg())

    def med(name, key, idx):
        xs = [run[key][idx] for run in res[name]]
        return statistics.median(xs), min(xs), max(xs)

    print(
        f"\n{args.clients} clients, {args.ops} requests/client/phase, {args.runs} runs in ABBA order; "
        f"puts acknowledged: {args.ack}; daemon checkout {os.path.abspath(args.root)}; "
        f"load average {load[0][0]:.2f} -> {load[1][0]:.2f}; "
        "median (min..max); GB/s = 1e9 B/s; latency per request; ratio: of the medians; per run: "
        "median (min..max) of the runs' ratios\n"
    )
    print(
        "| op | batch | tierstore GB/s | baseline GB/s | ratio | per run | tierstore p50 / p99 ms | "
        "baseline p50 / p99 ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    raw = []
    for op in ("put", "get"):
        for mib in sizes:
            t, b = med("tierstore", (mib, op), 0), med("baseline", (mib, op), 0)
            tp50, tp99 = med("tierstore", (mib, op), 1)[0], med("tierstore", (mib, op), 2)[0]
            bp50, bp99 = med("baseline", (mib, op), 1)[0], med("baseline", (mib, op), 2)[0]
            per_run = [x[(mib, op)][0] / y[(mib, op)][0] for x, y in zip(res["tierstore"], res["baseline"])]
            print(
                f"| {op} | {mib} MiB | {t[0] / 1e9:.2f} ({t[1] / 1e9:.2f}..{t[2] / 1e9:.2f}) | "
                f"{b[0] / 1e9:.2f} ({b[1] / 1e9:.2f}..{b[2] / 1e9:.2f}) | {t[0] / b[0]:.2f} | "
                f"{statistics.median(per_run):.2f} ({min(per_run):.2f}..{max(per_run):.2f}) | "
                f"{tp50 * 1e3:.1f} / {tp99 * 1e3:.1f} | {bp50 * 1e3:.1f} / {bp99 * 1e3:.1f} |"
            )
            raw.append(
                {
                    "op": op,
                    "batch_mib": mib,
                    "tierstore_Bps": [x[(mib, op)][0] for x in res["tierstore"]],
                    "baseline_Bps": [x[(mib, op)][0] for x in res["baseline"]],
                    "per_run_ratio": per_run,
                    "tierstore_p50_s": [x[(mib, op)][1] for x in res["tierstore"]],
                    "baseline_p50_s": [x[(mib, op)][1] for x in res["baseline"]],
                }
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "order": order,
                    "ack": args.ack,
                    "root": os.path.abspath(args.root),
                    "start_utc": t_start,
                    "loadavg_start_end": load,
                    "results": raw,
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
