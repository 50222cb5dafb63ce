#!/usr/bin/env python
"""Remote tier benchmark: tierstore's MooncakeTier vs Mooncake's own client.

One command starts a ``mooncake_master`` on 127.0.0.1 and a *holder* process
that contributes the only DRAM segment; the benchmark process runs two pure
clients (no segment) side by side: Mooncake's own ``MooncakeDistributedStore``
and a :class:`tierstore.remote.MooncakeTier`. Every object therefore crosses
the Transfer Engine's TCP transport on loopback, as between two machines.

Per object size (2 MiB and 16 MiB by default) and repetition:

* **put** (A B C C B A: raw, tier staged, tier zero-copy), ``--total`` bytes
  each: raw = ``batch_put_from`` from a registered buffer, ``--batch`` objects
  per call (the fastest way Mooncake offers); tier staged =
  ``MooncakeTier.put`` of plain block tensors (copied into the registered
  publish queue, header + CRC-32C computed, ``batch_put_from`` of ``--batch``
  objects per call); tier zero-copy = ``put`` of blocks inside a region
  registered with ``register_memory`` (CRC-32C computed, header into a slot,
  ``batch_put_from_multi_buffers`` reads the payload in place). Timed until
  ``flush`` returns, i.e. until every block is published.
* **get** (A B C C B A: raw, tier staged, tier zero-copy): raw =
  ``batch_get_into`` into a registered buffer; tier staged =
  ``MooncakeTier.get_into`` into plain tensors (fetch into registered staging,
  check header and CRC-32C, copy out); tier zero-copy = ``get_into`` into a
  region registered with ``register_memory`` (``batch_get_into_multi_buffers``:
  header into a slot, payload straight into the destination, then the CRC check).
  Every load is compared with the source after the timed part.

GB/s counts block payload bytes. The benchmark process's CPU time per GB
(user + system, all threads, ``getrusage``) is reported beside it: on a
machine whose cores are the bottleneck (loopback TCP copies on both ends), the
tier's extra passes over the bytes (CRC-32C, and the staging copy) show there. Each figure is the median of
``--reps`` repetitions x 2 measurements, with min and max; a ratio is tier / raw computed
per repetition (mean of that repetition's two measurements of each), reported
as median [min, max].

Usage::

    . .venv/bin/activate   # with pip install '.[cluster]'
    python bench/remote_bench.py --sizes 2m,16m --total 256m --reps 5 --json bench/results/remote.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import torch

from tierstore.errors import Status
from tierstore.remote import MooncakeTier, ObjectNamer, RemoteConfig
from tierstore.remote.local_master import LocalMaster
from tierstore.remote.mooncake import load_mooncake_store
from tierstore.units import parse_size

HOLDER = """
import os, sys
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", sys.argv[1], int(sys.argv[3]), 16 << 20, "tcp", "", sys.argv[2])
print(rc, flush=True)
sys.stdin.read()
s.close()
"""


def _cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "runs": values}


class Bench:
    def __init__(self, args, master: LocalMaster) -> None:
        self.args = args
        self.master = master
        store_cls = load_mooncake_store()
        self.raw = store_cls()
        rc = self.raw.setup("127.0.0.1", master.metadata, 0, 16 << 20, "tcp", "", master.address)
        if rc != 0:
            raise SystemExit(f"raw client setup returned {rc}")
        total = args.total
        self.src = torch.randint(0, 256, (total,), dtype=torch.uint8)
        self.raw_src = torch.zeros(total, dtype=torch.uint8)
        self.raw_dst = torch.zeros(total, dtype=torch.uint8)
        self.raw_src.copy_(self.src)
        for t in (self.raw_src, self.raw_dst):
            if self.raw.register_buffer(t.data_ptr(), t.numel()) != 0:
                raise SystemExit("register_buffer failed")
        self.staged_dst = torch.zeros(total, dtype=torch.uint8)
        self.zc_dst = torch.zeros(total, dtype=torch.uint8)
        self.zc_src = self.src.clone()  # registered with the tier: zero-copy publish
        self.seq = 0

    def names(self, prefix: str, n: int) -> list[str]:
        self.seq += 1
        return [f"bench/{prefix}/{self.seq}/{i}" for i in range(n)]

    def keys(self, n: int) -> list[bytes]:
        self.seq += 1
        return [self.seq.to_bytes(16, "little") + i.to_bytes(16, "little") for i in range(n)]

    # --- raw Mooncake client
    def _start(self) -> float:
        self._cpu0 = _cpu_s()
        return time.perf_counter()

    def _cpu_per_gb(self, nbytes: int) -> float:
        """Benchmark-process CPU seconds (all threads, user + system) per GB of the run just timed."""
        return (_cpu_s() - self._cpu0) / (nbytes / 1e9)

    def raw_put(self, bb: int, names: list[str]) -> tuple[float, float]:
        b = self.args.batch
        base = self.raw_src.data_ptr()
        t0 = self._start()
        for a in range(0, len(names), b):
            chunk = names[a : a + b]
            rcs = self.raw.batch_put_from(
                chunk, [base + (a + i) * bb for i in range(len(chunk))], [bb] * len(chunk)
            )
            if any(rc != 0 for rc in rcs):
                raise SystemExit(f"raw batch_put_from: {set(rcs)}")
        return gbps(len(names) * bb, time.perf_counter() - t0), self._cpu_per_gb(len(names) * bb)

    def raw_get(self, bb: int, names: list[str]) -> tuple[float, float]:
        b = self.args.batch
        base = self.raw_dst.data_ptr()
        self.raw_dst.zero_()
        t0 = self._start()
        for a in range(0, len(names), b):
            chunk = names[a : a + b]
            rcs = self.raw.batch_get_into(
                chunk, [base + (a + i) * bb for i in range(len(chunk))], [bb] * len(chunk)
            )
            if any(rc != bb for rc in rcs):
                raise SystemExit(f"raw batch_get_into: {set(rcs)}")
        r = gbps(len(names) * bb, time.perf_counter() - t0), self._cpu_per_gb(len(names) * bb)
        n = len(names) * bb
        if not torch.equal(self.raw_dst[:n], self.src[:n]):
            raise SystemExit("raw get returned wrong bytes")
        return r

    # --- tierstore
    def tier_put(
        self, tier: MooncakeTier, bb: int, keys: list[bytes], src: torch.Tensor
    ) -> tuple[float, float]:
        blocks = [src[i * bb : (i + 1) * bb] for i in range(len(keys))]
        t0 = self._start()
        st = tier.put(keys, blocks)
        if not tier.flush(600):
            raise SystemExit("tier flush timed out")
        dt = time.perf_counter() - t0
        cpu = self._cpu_per_gb(len(keys) * bb)
        s = tier.stats()
        if any(x is not Status.OK for x in st) or s["put_failed"] or s["put_no_space"]:
            raise SystemExit(f"tier put: {set(st)} {s}")
        return gbps(len(keys) * bb, dt), cpu

    def tier_get(
        self, tier: MooncakeTier, bb: int, keys: list[bytes], dst: torch.Tensor
    ) -> tuple[float, float]:
        dst.zero_()
        dests = [dst[i * bb : (i + 1) * bb] for i in range(len(keys))]
        t0 = self._start()
        st = tier.get_into(keys, dests)
        dt = time.perf_counter() - t0
        cpu = self._cpu_per_gb(len(keys) * bb)
        if any(x is not Status.OK for x in st):
            raise SystemExit(f"tier get: {[x.value for x in st][:8]} {tier.stats()}")
        n = len(keys) * bb
        if not torch.equal(dst[:n], self.src[:n]):
            raise SystemExit("tier get returned wrong bytes")
        return gbps(n, dt), cpu

    def remove(self, names: list[str]) -> None:
        for a in range(0, len(names), 256):
            self.raw.batch_remove(names[a : a + 256], True)

    def run_size(self, bb: int) -> dict:
        a = self.args
        n = a.total // bb
        tier = MooncakeTier(
            RemoteConfig(
                master=self.master.address,
                metadata=self.master.metadata,
                segment_bytes=0,
                local_buffer_bytes=a.batch * (bb + 64),
                publish_queue_blocks=n,
                timeout_s=60.0,
                max_batch_blocks=a.batch,
                cluster="bench",
            ),
            bb,
        )
        if not tier.wait_ok(30):
            raise SystemExit(f"tier not connected: {tier.stats()}")
        tier.register_memory(self.zc_dst, lambda o, k: None, lambda o, k: None)
        tier.register_memory(self.zc_src, lambda o, k: None, lambda o, k: None)
        namer = ObjectNamer("bench")
        res = {
            "put": {"raw": [], "tier_staged": [], "tier_zero_copy": []},
            "get": {"raw": [], "tier_staged": [], "tier_zero_copy": []},
            "ratio_put_staged": [],
            "ratio_put_zero_copy": [],
            "ratio_get_staged": [],
            "ratio_get_zero_copy": [],
        }
        cpu = {op: {"raw": [], "tier_staged": [], "tier_zero_copy": []} for op in ("put", "get")}
        # warm-up: fault in the holder's segment pages and open the TCP connections
        w_names, w_keys = self.names("warm", n), self.keys(n)
        self.raw_put(bb, w_names)
        self.tier_put(tier, bb, w_keys, self.src)
        self.raw_get(bb, w_names)
        self.tier_get(tier, bb, w_keys, self.staged_dst)
        self.remove(w_names + [namer(k) for k in w_keys])
        for rep in range(a.reps):
            r1, r2 = self.names("raw", n), self.names("raw", n)
            k1, k2, k3, k4 = self.keys(n), self.keys(n), self.keys(n), self.keys(n)
            p = [
                self.raw_put(bb, r1),
                self.tier_put(tier, bb, k1, self.src),
                self.tier_put(tier, bb, k2, self.zc_src),
                self.tier_put(tier, bb, k3, self.zc_src),
                self.tier_put(tier, bb, k4, self.src),
                self.raw_put(bb, r2),
            ]
            g = [
                self.raw_get(bb, r1),
                self.tier_get(tier, bb, k1, self.staged_dst),
                self.tier_get(tier, bb, k2, self.zc_dst),
                self.tier_get(tier, bb, k3, self.zc_dst),
                self.tier_get(tier, bb, k4, self.staged_dst),
                self.raw_get(bb, r2),
            ]
            self.remove(r1 + r2 + [namer(k) for k in k1 + k2 + k3 + k4])
            for name, lst, i, j in (("raw", p, 0, 5), ("tier_staged", p, 1, 4), ("tier_zero_copy", p, 2, 3)):
                res["put"][name] += [lst[i][0], lst[j][0]]
                cpu["put"][name] += [lst[i][1], lst[j][1]]
            for name, lst, i, j in (("raw", g, 0, 5), ("tier_staged", g, 1, 4), ("tier_zero_copy", g, 2, 3)):
                res["get"][name] += [lst[i][0], lst[j][0]]
                cpu["get"][name] += [lst[i][1], lst[j][1]]
            p, g = [x[0] for x in p], [x[0] for x in g]
            raw_p, raw_g = (p[0] + p[5]) / 2, (g[0] + g[5]) / 2
            res["ratio_put_staged"].append((p[1] + p[4]) / 2 / raw_p)
            res["ratio_put_zero_copy"].append((p[2] + p[3]) / 2 / raw_p)
            res["ratio_get_staged"].append((g[1] + g[4]) / 2 / raw_g)
            res["ratio_get_zero_copy"].append((g[2] + g[3]) / 2 / raw_g)
            print(
                f"  {bb >> 20} MiB rep {rep}: put raw {p[0]:.2f}/{p[5]:.2f} staged {p[1]:.2f}/{p[4]:.2f} "
                f"zc {p[2]:.2f}/{p[3]:.2f}  get raw {g[0]:.2f}/{g[5]:.2f} staged {g[1]:.2f}/{g[4]:.2f} "
                f"zc {g[2]:.2f}/{g[3]:.2f} GB/s",
                flush=True,
            )
        stats = tier.stats()
        tier.close()
        out = {
            "object_bytes": bb,
            "objects_per_run": n,
            "put": {k: summary(v) for k, v in res["put"].items()},
            "get": {k: summary(v) for k, v in res["get"].items()},
            "ratio_put_staged": summary(res["ratio_put_staged"]),
            "ratio_put_zero_copy": summary(res["ratio_put_zero_copy"]),
            "ratio_get_staged": summary(res["ratio_get_staged"]),
            "ratio_get_zero_copy": summary(res["ratio_get_zero_copy"]),
            "client_cpu_s_per_gb": {op: {k: summary(v) for k, v in d.items()} for op, d in cpu.items()},
            "tier_stats": {k: v for k, v in stats.items() if isinstance(v, (int, float, str))},
        }
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2m,16m", help="object sizes, comma-separated (k/m/g, base 1024)")
    ap.add_argument("--total", default="256m", help="bytes per measured run")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--batch", type=int, default=16, help="objects per Mooncake batch call (both sides)")
    ap.add_argument("--json", help="write results here")
    a = ap.parse_args()
    a.total = parse_size(a.total)
    sizes = [parse_size(s) for s in a.sizes.split(",")]
    with tempfile.TemporaryDirectory(prefix="remote-bench-") as d:
        master = LocalMaster(d, metadata="p2p", lease_ms=10000).start()  # Mooncake's default lease
        seg = 6 * a.total + 4 * max(sizes) + (64 << 20)  # six object sets live at once per repetition
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLDER, master.metadata, master.address, str(seg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(os.path.join(d, "holder.log"), "w"),
            text=True,
        )
        try:
            if holder.stdout.readline().strip() != "0":
                raise SystemExit("holder setup failed")
            bench = Bench(a, master)
            results = {
                "when": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "host": {
                    "cpu": _cpu(),
                    "cores": os.cpu_count(),
                    "python": platform.python_version(),
                    "mooncake": _mooncake_version(),
                },
                "transport": "tcp over loopback: pure clients, segment in a separate holder process",
                "total_bytes_per_run": a.total,
                "batch": a.batch,
                "reps": a.reps,
                "loadavg_1min_start": os.getloadavg()[0],
                "sizes": {},
            }
            for bb in sizes:
                results["sizes"][str(bb)] = bench.run_size(bb)
            results["loadavg_1min_end"] = os.getloadavg()[0]
            bench.raw.close()
        finally:
            holder.stdin.close()
            holder.wait(30)
            master.kill()
    print()
    print("client CPU s per GB (benchmark process, all threads), median:")
    for bb, r in results["sizes"].items():
        c = r["client_cpu_s_per_gb"]
        print(
            f"  {int(bb) >> 20:>3} MiB "
            + "  ".join(
                f"{op} "
                + " ".join(f"{k}={c[op][k]['median']:.2f}" for k in ("raw", "tier_staged", "tier_zero_copy"))
                for op in ("put", "get")
            )
        )
    print()
    print(f"{'size':>6} {'op':>4} {'raw GB/s':>18} {'tier GB/s':>18} {'tier/raw':>20}")
    for bb, r in results["sizes"].items():
        mib = int(bb) >> 20
        _row(mib, "put", r["put"]["raw"], r["put"]["tier_staged"], r["ratio_put_staged"], " (staged)")
        _row(
            mib, "put", r["put"]["raw"], r["put"]["tier_zero_copy"], r["ratio_put_zero_copy"], " (zero-copy)"
        )
        _row(mib, "get", r["get"]["raw"], r["get"]["tier_staged"], r["ratio_get_staged"], " (staged)")
        _row(
            mib, "get", r["get"]["raw"], r["get"]["tier_zero_copy"], r["ratio_get_zero_copy"], " (zero-copy)"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


def _fmt(s: dict) -> str:
    return f"{s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}]"


def _row(mib: int, op: str, raw: dict, tier: dict, ratio: dict, note: str) -> None:
    print(f"{mib:>4}Mi {op:>4} {_fmt(raw):>18} {_fmt(tier):>18} {_fmt(ratio):>20}{note}")


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _mooncake_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("mooncake-transfer-engine-non-cuda")
    except PackageNotFoundError:
        return "unknown"


if __name__ == "__main__":
    main()
