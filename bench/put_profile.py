"""Where one daemon put's time goes: perf_counter spans, client and server, sequential puts.

Starts ``tierstore serve`` (the config of :func:`server_bench.start_daemon`) in a subprocess
whose store, service and aiohttp calls are wrapped with timers (``--serve-profiled``, this
file), sends ``--ops`` sequential puts of ``--mib`` MiB from one :class:`RemoteKVStore`, then
stops the daemon, which writes its spans; prints per span the median ms per put (p10..p90) and
calls per put. Spans nest (``put_blocks`` holds ``body_read``, ``executor``...), so they do not
add up; the client's total minus the server's ``put_blocks`` is HTTP framing, the loopback
socket and the client's loop hops.

    python bench/put_profile.py --dir /tmp/tsprof --ops 64 [--write-back]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
SPANS: dict[str, list] = collections.defaultdict(list)
_LOCK = threading.Lock()


def _wrap(owner, name: str, label: str | None = None) -> None:
    """Time every call of ``owner.name`` (sync or async) into ``SPANS[label]``."""
    import inspect

    fn = getattr(owner, name)
    label = label or name
    if inspect.iscoroutinefunction(fn):

        async def awrapped(*a, **k):
            t = time.perf_counter()
            try:
                return await fn(*a, **k)
            finally:
                with _LOCK:
                    SPANS[label].append(time.perf_counter() - t)
                    SPANS["@" + label].append((t, time.perf_counter()))  # CLOCK_MONOTONIC: one clock

        setattr(owner, name, awrapped)
    else:

        def wrapped(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                with _LOCK:
                    SPANS[label].append(time.perf_counter() - t)

        setattr(owner, name, wrapped)


def serve_profiled(config: str, out: str) -> int:
    """Run the daemon with timers; write ``SPANS`` to ``out`` at exit."""
    from aiohttp import streams

    from tierstore.index.core import BlockIndex
    from tierstore.io import batch, engine, segment_writes
    from tierstore.io import format as fmt
    from tierstore.movers import execute, memory, nvme
    from tierstore.server import daemon, service, tenancy

    _wrap(service.Service, "put_blocks", "srv.put_blocks (handler)")
    _wrap(service.Service, "_put_body", "srv._put_body")
    _wrap(service.Service, "_parse", "srv.manifest parse")
    _wrap(service.Service, "_scoped", "srv.scoped (tenancy)")
    _wrap(service.Service, "_run_on", "srv.executor round trip")
    _wrap(tenancy.Tenancy, "reserve", "srv.tenancy.reserve")
    _wrap(streams.StreamReader, "readany", "srv.body readany (per chunk)")
    _wrap(BlockIndex, "prepare_store", "store.index.prepare_store")
    _wrap(BlockIndex, "complete_store", "store.index.complete_store")
    _wrap(execute.Movers, "run_store", "store.movers.run_store")
    _wrap(nvme.NvmeHandler, "write", "store.nvme.write (gather+crc+write+sync)")
    _wrap(batch.ExtentPipeline, "write_extents", "store.nvme.write_extents (gather+crc+write)")
    _wrap(segment_writes.SegmentWriter, "_settle", "store.nvme.settle (fdatasync+commit)")
    _wrap(engine.IOEngine, "sync", "store.nvme.fdatasync")
    _wrap(engine.IOFuture, "get", "store.nvme.write wait (IOFuture.get)")
    _wrap(engine.IOEngine, "write", "store.nvme.write submit")
    _wrap(fmt, "payload_crc", "store.nvme.crc32c (per block)")
    _wrap(batch.ExtentPipeline, "gather_blocks", "store.nvme.gather into staging")
    _wrap(memory.MemoryHandler, "gather", "store.host copy (memory.gather)")
    _wrap(service.web, "json_response", "srv.json_response")

    def dump(*_):
        with open(out, "w") as f:
            json.dump(SPANS, f)

    import atexit

    atexit.register(dump)
    return daemon.main(["--config", config])


def main(argv=None) -> int:
    sys.path.insert(0, HERE)
    import numpy as np
    import torch
    import yaml
    from server_bench import TOKEN, clean_work_dir, start_daemon

    from tierstore import Namespace, client_wire
    from tierstore.client import RemoteKVStore

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True)
    ap.add_argument("--ops", type=int, default=64)
    ap.add_argument("--mib", type=int, default=2)
    ap.add_argument("--write-back", action="store_true", help="puts.durable: false (acknowledged cached)")
    ap.add_argument("--engine", default="auto", help="tiers.nvme.engine (auto, uring, posix)")
    ap.add_argument("--host-bytes", default="1GiB")
    ap.add_argument("--nvme-bytes", default="6GiB")
    ap.add_argument("--root", default=ROOT, help="checkout whose tierstore the daemon runs")
    args = ap.parse_args(argv)
    os.makedirs(args.dir, exist_ok=True)
    clean_work_dir(args.dir)
    # the bench's daemon, started once to write its config, then restarted with timers
    p, _port, _log = start_daemon(args.dir, args.host_bytes, args.nvme_bytes)
    p.terminate()
    p.wait(60)
    cfg_path = os.path.join(args.dir, "daemon.yaml")
    cfg = yaml.safe_load(open(cfg_path))
    cfg["puts"] = {"durable": not args.write_back}
    cfg["tiers"]["nvme"]["engine"] = args.engine
    cfg["log"]["level"] = "INFO"
    yaml.safe_dump(cfg, open(cfg_path, "w"))
    spans_out = os.path.join(args.dir, "spans.json")
    log = os.path.join(args.dir, "daemon.log")
    with open(log, "wb") as err:
        d = subprocess.Popen(
            [sys.executable, __file__, "--serve-profiled", cfg_path, spans_out],
            stderr=err,
            env=dict(os.environ, PYTHONPATH=os.path.abspath(args.root)),
        )
    port = None
    for _ in range(600):
        for line in open(log):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("event") == "listening":
                port = rec["port"]
        if port:
            break
        time.sleep(0.1)
    cli: dict[str, list[float]] = collections.defaultdict(list)
    marks: list[tuple[float, float]] = []
    try:
        c = RemoteKVStore(f"http://127.0.0.1:{port}", TOKEN)
        orig = client_wire.DaemonConnection.send

        async def send(self, *a, **k):
            t = time.perf_counter()
            try:
                return await orig(self, *a, **k)
            finally:
                cli["client.wire.send (loop thread)"].append(time.perf_counter() - t)
                marks.append((t, time.perf_counter()))

        client_wire.DaemonConnection.send = send
        B = c.block_bytes
        nblk = max(1, args.mib * (1 << 20) // B)
        data = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (nblk, B), dtype=np.uint8))
        ns = Namespace(model="profile")
        for i in range(args.ops + 4):
            keys = [os.urandom(32) for _ in range(nblk)]
            t = time.perf_counter()
            st = c.store_keys(ns, keys, data)
            if i >= 4:  # the first puts warm up buffers and connections
                cli["client.store_keys (total)"].append(time.perf_counter() - t)
            assert all(s.value == "ok" for s in st), st
        c.close()
    finally:
        d.send_signal(signal.SIGTERM)
        d.wait(60)
    spans = json.load(open(spans_out))
    n = args.ops + 4
    print(
        f"{args.ops} sequential {args.mib} MiB puts ({'write-back' if args.write_back else 'durable'}), "
        f"daemon checkout {os.path.abspath(args.root)}"
    )
    print("| span | ms per call p50 (p10..p90) | calls per put |")
    print("|---|---|---|")
    srv = spans.pop("@srv.put_blocks (handler)")[-args.ops :]
    cli["client send -> server handler start"] = [s[0] - c[0] for c, s in zip(marks[-args.ops :], srv)]
    cli["server handler end -> client send end"] = [c[1] - s[1] for c, s in zip(marks[-args.ops :], srv)]
    spans = {k: v for k, v in spans.items() if not k.startswith("@")}
    for name, xs in list(cli.items()) + sorted(spans.items()):
        xs = sorted(xs[-(len(xs) * args.ops // n) or None :]) if name.startswith(("srv", "store")) else xs
        q = statistics.quantiles(xs, n=10) if len(xs) > 1 else [xs[0]] * 9
        print(
            f"| {name} | {statistics.median(xs) * 1e3:.3f} ({q[0] * 1e3:.3f}..{q[-1] * 1e3:.3f}) | "
            f"{len(spans.get(name, xs)) / n:.1f} |"
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--serve-profiled":
        sys.exit(serve_profiled(sys.argv[2], sys.argv[3]))
    sys.exit(main())
