"""Soak of the node service under chaos (issue 24): leaks, wrong bytes, lost blocks, RSS and FDs.

The service runs as its own process (``tierstore serve --node``, write-through puts: every
acknowledged block is on NVMe) with its NVMe tier on a small loop-mounted ext4 (when run as root
and ``mount -o loop`` works; else a plain directory, and ENOSPC is not exercised: the report
says so). ``--clients`` client processes (this script with ``--client``, one ``NodeKVStore``
each; a shared control file pauses and stops them and holds their counters) walk the Mooncake
conversation trace (``hash_ids`` → one 16-token block per id, so requests share exactly the
prefixes the trace shares; namespace = first id mod ``--namespaces``), each request: lookup
under a request id, sometimes a pin, load of the useful prefix, byte check, release/unpin, store
of the rest; now and then a load by keys without lookup, and an invalidation of a random
namespace. A block's bytes are a function of its key, so every ``OK`` load is checked byte-exact.

A chaos thread, meanwhile: kill -9 of one client every ``--kill-every-s`` (restarted); once, the
NVMe file system filled to ENOSPC for ``--enospc-hold-s`` (a filler file, then removed); once,
kill -9 of the service and a restart. Around that restart the clients are paused and a probe
client loads every key of the trace excerpt (per-key status, bytes checked) before the kill and
after the restart: blocks resident before and not after are lost; all memory-only blocks
(the service's own count: blocks without an NVMe copy) are lost by a kill -9 and counted apart;
the rest are acknowledged-then-lost. Blocks resident after but not before (resurrected) count too.

A sampler reads the service's ``VmRSS`` and open FDs (``/proc/PID``) every ``--sample-s``;
per service incarnation, after ``--warmup-s``, flat means max/min ≤ ``--flat-ratio`` (FDs:
those not of sessions, and at most two per possible session). Times count from when every
client made its first request. At the end
the clients stop (``Bye``) and the probe waits for the service to hold nothing (tickets,
quarantined/staging slots, references, leases, host slots not accounted for by blocks): leaked.
Then the service is stopped (SIGTERM) and its NVMe tier reopened embedded: ``check_invariants``.

    nice -n 10 python bench/node_soak.py --duration-s 1800 --json OUT.json
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
#: the full conversation trace beside the checkout (``../shared/traces``), else the packaged excerpt
TRACE_CANDIDATES = [
    os.path.join(up, "shared", "traces", "mooncake_conversation_trace.jsonl")
    for up in (os.path.dirname(ROOT), os.path.dirname(os.path.dirname(ROOT)))
]
LAYOUT = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 64, "dtype": "fp16", "tokens_per_block": 16}
TPB = 16
#: per-client counters in the control block, in this order
COUNTERS = (
    "requests",
    "lookups",
    "loads",
    "loaded_blocks",
    "verified_blocks",
    "wrong_blocks",
    "wrong_bytes",
    "stores",
    "stored_ok",
    "store_exists",
    "store_no_space",
    "store_rejected",
    "store_io_error",
    "pins",
    "pinned_blocks",
    "invalidations",
    "invalidations_refused",
    "errors",
)
C = {n: i for i, n in enumerate(COUNTERS)}


class Control:
    """The soak's control block, a file in ``--dir`` that the driver and every client map
    (``MAP_SHARED``): ``pause``, ``stop``, each client's ``idle`` flag and counters. Each field
    has one writer (a client's row: that client; a killed client's replacement continues it)."""

    def __init__(self, path: str, clients: int, create: bool = False) -> None:
        n = 2 + clients + clients * len(COUNTERS)
        if create:
            np.zeros(n, np.int64).tofile(path)
        self.a = np.memmap(path, dtype=np.int64, mode="r+", shape=(n,))
        self.clients = clients

    def flag(self, i: int, value: bool | None = None) -> bool:
        """Read (or set) flag ``i``: 0 pause, 1 stop, ``2 + k`` client k idle."""
        if value is not None:
            self.a[i] = int(value)
        return bool(self.a[i])

    def row(self, k: int) -> np.ndarray:
        base = 2 + self.clients + k * len(COUNTERS)
        return self.a[base : base + len(COUNTERS)]

    def totals(self) -> dict:
        rows = np.stack([np.array(self.row(k)) for k in range(self.clients)])
        return {name: int(rows[:, C[name]].sum()) for name in COUNTERS}


def layout():
    from tierstore.config import LayoutConfig

    return LayoutConfig(**LAYOUT).build()


def ns_bytes(i: int) -> bytes:
    return f"soak-namespace-{i:04d}".encode().ljust(32, b".")


def tokens_of(hash_ids) -> list[int]:
    """One 16-token block per trace hash id (equal ids at equal positions: equal blocks)."""
    return [h * TPB + t for h in hash_ids for t in range(TPB)]


def block_bytes(key: bytes, bb: int) -> np.ndarray:
    """The bytes of the block stored under ``key`` (a function of the key: loads are checkable)."""
    return np.frombuffer(np.random.default_rng(int.from_bytes(key[:16], "little")).bytes(bb), np.uint8)


def default_trace() -> str | None:
    """The full trace if it is beside the checkout, else ``None`` (the packaged excerpt)."""
    return next((p for p in TRACE_CANDIDATES if os.path.exists(p)), None)


def trace_requests(path: str | None, limit: int, max_blocks: int, namespaces: int) -> list[tuple[int, tuple]]:
    """``(namespace index, hash ids)`` of the trace's first ``limit`` requests, ``max_blocks`` ids each."""
    from tierstore.trace import read_mooncake

    out = []
    for r in read_mooncake(path, limit=limit):
        ids = r.hash_ids[:max_blocks]
        if ids:
            out.append((ids[0] % namespaces, tuple(ids)))
    return out


# -- the client processes --------------------------------------------------------------------------


class _Client:
    """One client process's loop (see the module docstring)."""

    def __init__(self, idx: int, d: str, seed: int) -> None:
        from tierstore.node.client import NodeKVStore

        with open(os.path.join(d, "soak_args.json")) as f:
            a = json.load(f)
        self.lay = layout()
        self.bb = self.lay.bytes_per_block
        self.c = NodeKVStore(a["url"], self.lay, timeout_s=10.0, retry_s=0.2)
        self.idx = idx
        self.reqs = trace_requests(a["trace"], a["trace_requests"], a["max_blocks"], a["namespaces"])
        self.ctl = Control(os.path.join(d, "control.bin"), a["clients"])
        self.cnt = self.ctl.row(idx)
        self.rng = random.Random(seed)
        self.namespaces = a["namespaces"]
        self.errors_log = os.path.join(d, "client_errors.log")

    def inc(self, name: str, n: int = 1) -> None:
        self.cnt[C[name]] += n

    def check(self, keys, statuses, out) -> None:
        from tierstore.errors import Status

        for k, s, t in zip(keys, statuses, out):
            if s is not Status.OK:
                continue
            self.inc("loaded_blocks")
            got = t.numpy().reshape(-1).view(np.uint8)
            bad = int(np.count_nonzero(got != block_bytes(k, self.bb)))
            self.inc("verified_blocks")
            if bad:
                self.inc("wrong_blocks")
                self.inc("wrong_bytes", bad)

    def one(self, ns_idx: int, ids) -> None:
        import torch

        ns, toks = ns_bytes(ns_idx), tokens_of(ids)
        keys = self.c.keys_for(ns, toks)
        rid = ("soak", self.rng.random())
        hit = self.c.lookup(ns, toks, request_id=rid)
        self.inc("lookups")
        lease = None
        if hit.matched_blocks and self.rng.random() < 0.2:
            lease = self.c.pin(ns, toks[: hit.matched_blocks * TPB], lease_s=30)
            self.inc("pins")
            self.inc("pinned_blocks", len(lease.keys))
        if hit.useful_blocks:
            st, out = self.c.load(hit)
            self.inc("loads")
            self.check(hit.useful_keys, st, out)
        self.c.release(rid)
        if lease is not None:
            self.c.unpin(lease)
        m = hit.matched_blocks
        if m < len(keys):
            data = torch.from_numpy(np.stack([block_bytes(k, self.bb) for k in keys[m:]]))
            st = self.c.store(ns, toks, data, start_block=m)
            self.inc("stores")
            for s in st:
                self.inc("stored_ok" if s.value == "ok" else f"store_{s.value}")

    def extra(self) -> None:
        """Now and then: a load by keys without a lookup, or an invalidation."""
        x = self.rng.random()
        if x < 0.05:
            ns_idx, ids = self.rng.choice(self.reqs)
            keys = self.c.keys_for(ns_bytes(ns_idx), tokens_of(ids))
            st, out = self.c.load(keys)
            self.inc("loads")
            self.check(keys, st, out)
        elif x < 0.051:
            ns_idx = self.rng.randrange(self.namespaces)
            n = self.c.invalidate(ns_bytes(ns_idx))
            self.inc("invalidations")
            with open(os.path.join(os.path.dirname(self.errors_log), "invalidations.log"), "a") as f:
                f.write(f"{time.time():.3f} {ns_idx} {n}\n")

    def run(self) -> None:
        from tierstore.errors import StoreClosedError

        pos = self.rng.randrange(len(self.reqs))
        ctl, idle, parent = self.ctl, 2 + self.idx, os.getppid()
        while not ctl.flag(1) and os.getppid() == parent:  # the driver stops us, or died
            if ctl.flag(0):
                ctl.flag(idle, True)
                while ctl.flag(0) and not ctl.flag(1) and os.getppid() == parent:
                    time.sleep(0.02)
                ctl.flag(idle, False)
                continue
            ns_idx, ids = self.reqs[pos % len(self.reqs)]
            pos += 1
            self.inc("requests")
            try:
                self.one(ns_idx, ids)
                self.extra()
            except StoreClosedError:  # an invalidation while the service is down: refused, said
                self.inc("invalidations_refused")
            except Exception as e:  # noqa: BLE001  counted and written down; the client goes on
                self.inc("errors")
                with open(self.errors_log, "a") as f:
                    f.write(f"client {self.idx} pid {os.getpid()}: {e!r}\n")
        self.c.close()


def client_main(argv: list[str]) -> None:
    """``node_soak.py --client IDX DIR SEED``: one client process of the soak in ``DIR``."""
    _Client(int(argv[0]), argv[1], int(argv[2])).run()


# -- the service -----------------------------------------------------------------------------------


class ServiceError(RuntimeError):
    """The node service did not start (or not in time)."""


def write_config(d: str, nvme_dir: str, args) -> str:
    import yaml

    cfg = {
        "state_dir": os.path.join(d, "state"),
        "log": {"level": "WARNING", "access_log": False},
        "layout": LAYOUT,
        "tiers": {
            "hbm": {"capacity_bytes": 0},
            "host": {"capacity_bytes": args.host_bytes},
            "nvme": {
                "path": os.path.join(nvme_dir, "nvme"),
                "capacity_bytes": args.nvme_bytes,
                "segment_size_bytes": "1MiB",
                "extent_size_bytes": "256KiB",
            },
        },
        "puts": {"durable": True},
        "tenants": [{"name": "soak", "tokens": ["soak-token-0123456789"]}],
        "node": {
            "socket": os.path.join(d, "node.sock"),
            "staging_blocks": 64,
            "lease_s": 20,
            "tenant": "soak",
        },
    }
    path = os.path.join(d, "node.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def start_service(cfg_path: str, sock: str, log: str) -> subprocess.Popen:
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tierstore.cli", "serve", "--node", "--config", cfg_path],
            stdout=subprocess.DEVNULL,
            stderr=err,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT),
        )
    t_end = time.monotonic() + 120
    while time.monotonic() < t_end:
        if proc.poll() is not None:
            raise ServiceError(f"the node service exited {proc.returncode}; see {log}")
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(sock)
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise ServiceError("the node service did not start")


def proc_sample(pid: int) -> dict | None:
    """``VmRSS`` (KiB → bytes) and open FDs of ``pid`` (sockets and pidfds apart), or ``None``."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
        fds = os.listdir(f"/proc/{pid}/fd")
        links = []
        for fd in fds:
            with contextlib.suppress(OSError):
                links.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
    except OSError:
        return None
    kb = {
        ln.split(":")[0]: int(ln.split()[1])
        for ln in status.splitlines()
        if ln.startswith(("VmRSS", "RssAnon"))
    }
    sockets = sum(x.startswith("socket:") for x in links)
    pidfds = sum("pidfd" in x for x in links)
    return {
        "rss_bytes": kb.get("VmRSS", 0) * 1024,
        "rss_anon_bytes": kb.get("RssAnon", 0) * 1024,
        "fds": len(fds),
        "fds_sessions": sockets + pidfds,
    }


# -- the NVMe file system --------------------------------------------------------------------------


def _loopfs():
    """``tests/io/loopfs.py`` (the tests' loop-mount helper), loaded by its path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "tierstore_tests_loopfs", os.path.join(ROOT, "tests", "io", "loopfs.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class NvmeFs:
    """The NVMe tier's directory: a loop-mounted ext4 of ``size_bytes`` when possible (root,
    ``mkfs.ext4``, ``unshare``, ``mount -o loop``: ``tests/io/loopfs.py``, mounted in a private
    mount namespace, so it cannot outlive this process), else a plain directory under ``d``;
    :meth:`fill` and :meth:`unfill` take and give back all its free space."""

    def __init__(self, d: str, size_bytes: int) -> None:
        loopfs = _loopfs()
        self._stack = contextlib.ExitStack()
        self.mounted = False
        self.why_not = loopfs.unavailable_reason() or ""
        if not self.why_not:
            try:
                self.dir = str(self._stack.enter_context(loopfs.loop_ext4(size_bytes)))
                self.mounted = True
            except (loopfs.MountUnavailable, OSError, subprocess.CalledProcessError) as e:
                self.why_not = str(e)
        if not self.mounted:
            self.dir = os.path.join(d, "nvmefs")
            os.makedirs(self.dir, exist_ok=True)

    def fill(self) -> int:
        """Write a filler file until ENOSPC; its size in bytes."""
        path, n = os.path.join(self.dir, "filler"), 0
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            for chunk in (1 << 20, 4096):
                buf = b"\xa5" * chunk
                while True:
                    try:
                        n += os.write(fd, buf)
                    except OSError as e:
                        if e.errno != errno.ENOSPC:
                            raise
                        break
            os.fsync(fd)
        finally:
            os.close(fd)
        return n

    def free_bytes(self) -> int:
        st = os.statvfs(self.dir)
        return st.f_bavail * st.f_frsize

    def unfill(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(self.dir, "filler"))

    def close(self) -> None:
        self._stack.close()
        self.mounted = False


# -- the soak --------------------------------------------------------------------------------------


class Soak:
    """The service, the clients, the sampler and the chaos of one run (see the module docstring)."""

    def __init__(self, args) -> None:
        self.args = args
        self.d = args.dir
        self.t0 = time.monotonic()
        self.fs = NvmeFs(self.d, args.fs_bytes)
        self.cfg_path = write_config(self.d, self.fs.dir, args)
        self.sock = os.path.join(self.d, "node.sock")
        self.url = "unix://" + self.sock
        self.log = os.path.join(self.d, "node.log")
        self.reqs = trace_requests(args.trace, args.trace_requests, args.max_blocks, args.namespaces)
        self.ctl = Control(os.path.join(self.d, "control.bin"), args.clients, create=True)
        self.halt = threading.Event()  # the driver's threads end
        with open(os.path.join(self.d, "soak_args.json"), "w") as f:
            json.dump(dict(vars(args), url=self.url), f)
        self.clients: list = [None] * args.clients
        self.samples: list[dict] = []
        self.events: list[dict] = []
        self.incarnation = 0
        self.lay = layout()
        self.bb = self.lay.bytes_per_block
        self.probe = None
        self.proc: subprocess.Popen | None = None
        self._seed = 1000
        self.fatal = ""

    def now(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    # ---------------------------------------------------------------- parts
    def start_client(self, i: int) -> None:
        self._seed += 1
        self.ctl.flag(2 + i, False)
        with open(os.path.join(self.d, f"client{i}.log"), "ab") as err:
            self.clients[i] = subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), "--client", str(i), self.d, str(self._seed)],
                stdout=subprocess.DEVNULL,
                stderr=err,
                cwd=ROOT,
                env=dict(os.environ, PYTHONPATH=ROOT),
            )

    def start_service(self) -> None:
        self.proc = start_service(self.cfg_path, self.sock, self.log)
        self.incarnation += 1
        self.events.append(
            {
                "t_s": self.now(),
                "event": "service_started",
                "pid": self.proc.pid,
                "incarnation": self.incarnation,
            }
        )

    def sampler(self) -> None:
        while not self.halt.is_set():
            p = self.proc
            s = proc_sample(p.pid) if p is not None and p.poll() is None else None
            if s is not None:
                s.update(t_s=self.now(), incarnation=self.incarnation)
                self.samples.append(s)
            self.halt.wait(self.args.sample_s)

    def totals(self) -> dict:
        return self.ctl.totals()

    def wait_started(self, timeout_s: float = 300.0) -> None:
        """Wait until every client made its first request (spawning and importing take a while on
        a busy machine); the soak's clock starts then."""
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            if all(self.ctl.row(k)[C["requests"]] for k in range(self.args.clients)):
                break
            time.sleep(0.1)
        self.events.append({"t_s": self.now(), "event": "clients_started"})
        shift = time.monotonic() - self.t0
        self.t0 += shift  # times in the report count from here
        for e in self.events:
            e["t_s"] = round(e["t_s"] - shift, 2)

    def wait_idle(self, timeout_s: float = 120.0) -> bool:
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            if all(
                self.ctl.flag(2 + k) or self.clients[k].poll() is not None for k in range(self.args.clients)
            ):
                return True
            time.sleep(0.05)
        return False

    def stats(self) -> dict:
        return self.probe.stats()

    def universe(self) -> list[bytes]:
        """Every key of the trace excerpt (and each one's namespace index in ``key_ns``)."""
        self.key_ns: dict[bytes, int] = {}
        for ns_idx, ids in self.reqs:
            for k in self.probe.keys_for(ns_bytes(ns_idx), tokens_of(ids)):
                self.key_ns[k] = ns_idx
        return list(self.key_ns)

    def invalidated(self) -> dict[int, float]:
        """Namespace index → wall time of its last invalidation the clients wrote down."""
        out: dict[int, float] = {}
        with contextlib.suppress(FileNotFoundError), open(os.path.join(self.d, "invalidations.log")) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 3:
                    out[int(parts[1])] = float(parts[0])
        return out

    def residency(self, keys: list[bytes]) -> tuple[set, int, int]:
        """Keys whose load is ``OK`` (each checked byte-exact); (resident, wrong blocks, wrong bytes)."""
        from tierstore.errors import Status

        resident, wrong_blocks, wrong_bytes = set(), 0, 0
        for a in range(0, len(keys), 32):
            chunk = keys[a : a + 32]
            st, out = self.probe.load(chunk)
            for k, s, t in zip(chunk, st, out):
                if s is Status.OK:
                    resident.add(k)
                    bad = int(
                        np.count_nonzero(t.numpy().reshape(-1).view(np.uint8) != block_bytes(k, self.bb))
                    )
                    wrong_blocks += bad > 0
                    wrong_bytes += bad
        return resident, wrong_blocks, wrong_bytes

    # ---------------------------------------------------------------- chaos
    def kill_client(self, i: int) -> None:
        p = self.clients[i]
        if p.poll() is None:
            os.kill(p.pid, signal.SIGKILL)
        p.wait()
        self.events.append({"t_s": self.now(), "event": "client_killed", "client": i, "pid": p.pid})
        self.start_client(i)

    def enospc(self) -> None:
        if not self.fs.mounted:
            self.events.append({"t_s": self.now(), "event": "enospc_skipped", "why": self.fs.why_not})
            return
        before, c0 = self.stats().get("nvme_backend", {}), self.totals()
        free0 = self.fs.free_bytes()
        filled = self.fs.fill()
        t_fill = self.now()
        t_end = time.monotonic() + self.args.enospc_hold_s
        while time.monotonic() < t_end:  # what the tier frees (a trimmed segment) is taken at once
            filled += self.fs.fill()
            time.sleep(0.02)
        during, c1 = self.stats().get("nvme_backend", {}), self.totals()
        self.fs.unfill()
        keys = ("put_no_space", "preallocate_errors", "put_io_error", "put_blocks_ok")
        self.events.append(
            {
                "t_s": t_fill,
                "event": "enospc",
                "free_bytes_before": free0,
                "filler_bytes": filled,
                "hold_s": self.args.enospc_hold_s,
                "nvme_during": {k: during.get(k, 0) - before.get(k, 0) for k in keys},
                "engine_write_errors_during": during.get("engine", {}).get("write_errors", 0)
                - before.get("engine", {}).get("write_errors", 0),
                "client_stores_during": {k: c1[k] - c0[k] for k in COUNTERS if k.startswith("store")},
                "put_blocks_ok_at_unfill": during.get("put_blocks_ok", 0),
            }
        )

    def restart_service(self) -> None:
        """Pause the clients, probe, kill -9 the service, let the clients run against nothing,
        pause, restart, probe again (see the module docstring)."""
        self.ctl.flag(0, True)
        idle = self.wait_idle()
        st = self.stats()
        nvme_blocks = st.get("bytes_per_tier", {}).get("nvme", 0) // self.bb
        memory_only = int(st.get("blocks", 0)) - nvme_blocks
        before, wb, wbytes = self.residency(self.universe_keys)
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        t_kill, t_wall = self.now(), time.time()
        self.ctl.flag(0, False)
        c0 = self.totals()
        time.sleep(self.args.down_s)  # the clients get misses and refusals meanwhile
        self.ctl.flag(0, True)
        self.wait_idle()
        c1 = self.totals()
        self.start_service()
        t_end = time.monotonic() + 30
        while self.stats().get("client", {}).get("connected") is not True and time.monotonic() < t_end:
            time.sleep(0.2)
        after, wa, wabytes = self.residency(self.universe_keys)
        self.ctl.flag(0, False)
        lost = before - after
        back = after - before
        inval = self.invalidated()
        st_after = self.stats().get("nvme_backend", {})
        self.events.append(
            {
                "t_s": t_kill,
                "event": "service_killed",
                "clients_idle": idle,
                "blocks_before": len(before),
                "service_blocks_before": int(st.get("blocks", 0)),
                "memory_only_before": memory_only,
                "blocks_after": len(after),
                "lost": len(lost),
                "acknowledged_then_lost": max(0, len(lost) - memory_only),
                "resurrected": len(back),
                "resurrected_of_invalidated_namespaces": sum(self.key_ns[k] in inval for k in back),
                "resurrected_by_namespace": {
                    str(n): sum(self.key_ns[k] == n for k in back)
                    for n in sorted({self.key_ns[k] for k in back})
                },
                "invalidated_namespaces": {str(k): round(v - t_wall, 3) for k, v in inval.items()},
                "lost_keys": [{"key": k.hex()[:16], "namespace": self.key_ns[k]} for k in sorted(lost)[:20]],
                "recovery": {k: v for k, v in st_after.items() if k.startswith("recover")},
                "clients_while_down": {k: c1[k] - c0[k] for k in COUNTERS if c1[k] != c0[k]},
                "probe_wrong_blocks": wb + wa,
                "probe_wrong_bytes": wbytes + wabytes,
            }
        )

    def schedule(self) -> list[tuple[float, str, int]]:
        a = self.args
        ev = [
            (t, "kill", k % a.clients)
            for k, t in enumerate(np.arange(a.kill_every_s, a.duration_s, a.kill_every_s))
        ]
        ev += [(a.enospc_at_s, "enospc", 0), (a.restart_at_s, "restart", 0)]
        return sorted(ev)

    def chaos(self) -> None:
        for t, what, i in self.schedule():
            if self.halt.wait(max(0.0, t - (time.monotonic() - self.t0))):
                return
            try:
                {"kill": lambda: self.kill_client(i), "enospc": self.enospc, "restart": self.restart_service}[
                    what
                ]()
            except Exception as e:  # noqa: BLE001  said in the report; the soak goes on
                self.events.append({"t_s": self.now(), "event": f"{what}_failed", "error": repr(e)})
                if self.proc is None or self.proc.poll() is not None:  # no service: nothing to soak
                    self.fatal = repr(e)
                    return

    # ---------------------------------------------------------------- the run
    def run(self) -> dict:
        from tierstore.node.client import NodeKVStore

        self.start_service()
        self.probe = NodeKVStore(self.url, self.lay, timeout_s=30.0, retry_s=0.2)
        self.universe_keys = self.universe()
        load0 = os.getloadavg()
        threads = [threading.Thread(target=f, daemon=True) for f in (self.sampler, self.chaos)]
        try:
            for i in range(self.args.clients):
                self.start_client(i)
            self.wait_started()
            for t in threads:
                t.start()
            while self.now() < self.args.duration_s and not self.fatal:
                time.sleep(0.5)
            if self.fatal:
                raise ServiceError(f"the soak stopped at {self.now()} s: {self.fatal}; see {self.log}")
            self.halt.set()
            threads[1].join()
            self.ctl.flag(1, True)  # the clients stop, say Bye and exit
            for p in self.clients:
                try:
                    p.wait(60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            totals_at_end = self.totals()
            end = self.finish()
        finally:
            self.halt.set()
            self.ctl.flag(1, True)
            for p in self.clients:
                if p is not None and p.poll() is None:
                    p.kill()
                    p.wait()
            if self.probe is not None:
                self.probe.close()
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        end["recovered"] = self.reopen(end.pop("final_resident"))
        return {
            "load_average_before": load0,
            "load_average_after": os.getloadavg(),
            "trace": self.args.trace or "packaged excerpt",
            "universe_blocks": len(self.universe_keys),
            "clients": totals_at_end,
            "client_errors": client_errors(self.d),
            "events": self.events,
            "end": end,
            "flatness": flatness(self.samples, self.events, self.args),
            "samples": thin(self.samples, 120),
        }

    def finish(self) -> dict:
        """After the clients ended: wait until the service holds nothing; what it still holds."""
        t_end = time.monotonic() + 90
        while True:
            st = self.stats()
            n = st.get("node", {})
            held = {
                "open_tickets": n.get("open_tickets", -1),
                "quarantined_slots": n.get("quarantined_slots", -1),
                "staging_slots_held": n.get("staging_slots", 0) - n.get("staging_free", 0),
                "references": n.get("references", -1),
                "leases": n.get("leases", -1),
                "host_slots_unaccounted": n.get("host_slots", 0)
                - n.get("host_free", 0)
                - st.get("bytes_per_tier", {}).get("host", 0) // self.bb,
                "other_sessions": st.get("session", {}).get("sessions", 0) - 1,
            }
            if not any(held.values()) or time.monotonic() > t_end:
                break
            time.sleep(1.0)
        resident, wb, wbytes = self.residency(self.universe_keys)
        st_after = self.stats()
        self.probe.close()
        self.probe = None
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(120)
        return {
            "held": held,
            "leaked": sum(held.values()),
            "service_blocks": int(st.get("blocks", 0)),
            "nvme_backend": {k: v for k, v in st.get("nvme_backend", {}).items() if not isinstance(v, dict)},
            "final_resident": resident,
            "final_resident_blocks": len(resident),
            "service_blocks_after_probe": int(st_after.get("blocks", 0)),
            "memory_only_at_stop": int(st_after.get("blocks", 0))
            - st_after.get("bytes_per_tier", {}).get("nvme", 0) // self.bb,
            "final_probe_wrong_blocks": wb,
            "final_probe_wrong_bytes": wbytes,
            "service_exit_status": rc,
        }

    def reopen(self, final_resident: set) -> dict:
        """The stopped service's NVMe tier opened embedded: its invariants, what it kept."""
        import yaml

        from tierstore.api import KVStore
        from tierstore.server.tenancy import owner_key_scope, storage_key

        with open(self.cfg_path) as f:
            tiers = yaml.safe_load(f)["tiers"]
        store = KVStore.from_config({"tiers": tiers}, self.lay)
        # the service keeps a session's blocks under its tenant's storage keys (server/tenancy.py)
        scope = owner_key_scope("soak", self.lay.fingerprint())
        try:
            store.check_invariants(quiescent=True)
            kept = {k for k in final_resident if store.exists([storage_key(scope, k)]) == 1}
            return {
                "invariants": "ok",
                "kept_blocks": len(kept),
                "lost_on_clean_stop": len(final_resident - kept),
                "lost_namespaces": sorted({self.key_ns[k] for k in final_resident - kept}),
                "recovery": {
                    k: v for k, v in store.stats().get("nvme_backend", {}).items() if k.startswith("recover")
                },
            }
        finally:
            store.close()


def flatness(samples: list[dict], events: list[dict], args) -> dict:
    """Per service incarnation, the samples from ``warmup_s`` after its start (judged when they
    span at least ``warmup_s``): max/min of RSS and of the FDs that are not sessions' (each
    session is a socket and a pidfd, and sessions come and go with the clients), and the most
    session FDs (at most the listener and two per session: clients, the probe, one replacement).
    One FD more or less than the rest is flat too (a file such as the invalidation log open at
    the moment of a sample: 10 % of the service's ~9 other FDs is less than one)."""
    starts = {e["incarnation"]: max(0.0, e["t_s"]) for e in events if e["event"] == "service_started"}
    out = {}
    for inc, t0 in starts.items():
        xs = [dict(s, fds_other=s["fds"] - s["fds_sessions"]) for s in samples if s["incarnation"] == inc]
        xs = [s for s in xs if s["t_s"] >= t0 + args.warmup_s]
        r = {"samples": len(xs), "judged": len(xs) >= 3 and xs[-1]["t_s"] - xs[0]["t_s"] >= args.warmup_s}
        if not xs:
            out[str(inc)] = r
            continue
        r.update(from_t_s=xs[0]["t_s"], to_t_s=xs[-1]["t_s"])
        for k in ("rss_bytes", "rss_anon_bytes", "fds", "fds_other", "fds_sessions"):
            v = [s[k] for s in xs]
            r[k] = {"min": min(v), "max": max(v), "ratio": max(v) / max(min(v), 1)}
        fo = r["fds_other"]
        r["flat"] = (
            r["rss_bytes"]["ratio"] <= args.flat_ratio
            and (fo["ratio"] <= args.flat_ratio or fo["max"] - fo["min"] <= 1)
            and r["fds_sessions"]["max"] <= 1 + 2 * (args.clients + 2)
        )
        out[str(inc)] = r
    return out


def client_errors(d: str, n: int = 20) -> dict:
    """How many errors the clients wrote down, and the first ``n``."""
    try:
        with open(os.path.join(d, "client_errors.log")) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        lines = []
    return {"count": len(lines), "first": lines[:n]}


def thin(samples: list[dict], n: int) -> list[dict]:
    step = max(1, len(samples) // n)
    return samples[::step]


def verdict(res: dict) -> dict:
    """The pass conditions of issue 24's soak, each with its figure."""
    restart = [e for e in res["events"] if e["event"] == "service_killed"]
    wrong = res["clients"]["wrong_bytes"] + res["end"]["final_probe_wrong_bytes"]
    wrong += sum(e["probe_wrong_bytes"] for e in restart)
    lost = sum(e["acknowledged_then_lost"] for e in restart)
    judged = [f for f in res["flatness"].values() if f.get("judged")]
    return {
        "wrong_bytes": wrong,
        "leaked": res["end"]["leaked"],
        "acknowledged_then_lost": lost,
        "memory_only_lost": sum(min(e["lost"], e["memory_only_before"]) for e in restart),
        "resurrected": sum(e["resurrected"] for e in restart),
        "service_restarted": bool(restart),
        "enospc_exercised": any(e["event"] == "enospc" for e in res["events"]),
        "client_errors": res["client_errors"]["count"],
        "clients_killed": sum(e["event"] == "client_killed" for e in res["events"]),
        "chaos_failures": [e for e in res["events"] if e["event"].endswith("_failed")],
        "flat": bool(judged) and all(f["flat"] for f in judged),
        "invariants_after_reopen": res["end"]["recovered"]["invariants"],
        "lost_on_clean_stop": res["end"]["recovered"]["lost_on_clean_stop"],
    }


def passed(v: dict) -> bool:
    return (
        v["wrong_bytes"] == 0
        and v["leaked"] == 0
        and v["acknowledged_then_lost"] == 0
        and v["resurrected"] == 0
        and v["client_errors"] == 0
        and v["service_restarted"]
        and not v["chaos_failures"]
        and v["flat"]
        and v["invariants_after_reopen"] == "ok"
        and v["lost_on_clean_stop"] == 0
    )


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="/tmp/tierstore-nodesoak")
    ap.add_argument("--duration-s", type=float, default=1800.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--kill-every-s", type=float, default=60.0, help="kill -9 of one client this often")
    ap.add_argument("--enospc-at-s", type=float, default=None, help="default: 0.15 of the duration")
    ap.add_argument("--enospc-hold-s", type=float, default=None, help="default: 0.02 of the duration, >= 5 s")
    ap.add_argument("--restart-at-s", type=float, default=None, help="default: 0.3 of the duration")
    ap.add_argument("--down-s", type=float, default=3.0, help="the service stays down this long")
    ap.add_argument("--warmup-s", type=float, default=None, help="default: 0.1 of the duration, >= 10 s")
    ap.add_argument("--sample-s", type=float, default=None, help="default: duration / 300, >= 0.5 s")
    ap.add_argument("--flat-ratio", type=float, default=1.10)
    ap.add_argument("--trace", default=default_trace(), help="default: ../shared/traces, else the excerpt")
    ap.add_argument("--trace-requests", type=int, default=2000)
    ap.add_argument("--max-blocks", type=int, default=16, help="blocks a request at most")
    ap.add_argument("--namespaces", type=int, default=8)
    ap.add_argument("--host-bytes", type=int, default=2 << 20)
    ap.add_argument("--nvme-bytes", type=int, default=32 << 20)
    ap.add_argument("--fs-bytes", type=int, default=64 << 20, help="the loop-mounted ext4's size")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    dur = a.duration_s
    a.enospc_at_s = 0.15 * dur if a.enospc_at_s is None else a.enospc_at_s
    a.enospc_hold_s = max(5.0, 0.02 * dur) if a.enospc_hold_s is None else a.enospc_hold_s
    a.restart_at_s = 0.3 * dur if a.restart_at_s is None else a.restart_at_s
    a.warmup_s = max(10.0, 0.1 * dur) if a.warmup_s is None else a.warmup_s
    a.sample_s = max(0.5, dur / 300) if a.sample_s is None else a.sample_s
    return a


def soak(argv=None) -> dict:
    """One soak run; the JSON-able result with its ``verdict`` and ``passed``."""
    args = parse_args(argv)
    for name in (
        "nvmefs",
        "node.yaml",
        "node.log",
        "node.sock",
        "state",
        "client_errors.log",
        "invalidations.log",
        "control.bin",
        "soak_args.json",
        *(f"client{i}.log" for i in range(64)),
    ):
        p = os.path.join(args.dir, name)
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.exists(p):
            os.remove(p)
    os.makedirs(args.dir, exist_ok=True)
    soak = Soak(args)
    try:
        res = soak.run()
    finally:
        soak.fs.close()
    res["args"] = {k: v for k, v in vars(args).items() if k != "json"}
    res["verdict"] = verdict(res)
    res["passed"] = passed(res["verdict"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    return res


def main() -> None:
    if sys.argv[1:2] == ["--client"]:
        client_main(sys.argv[2:])
        return
    res = soak()
    print(json.dumps({k: res[k] for k in ("verdict", "passed", "clients")}, indent=1, default=str))
    for inc, f in res["flatness"].items():
        if f.get("judged"):
            print(
                f"service {inc}: {f['samples']} samples {f['from_t_s']}..{f['to_t_s']} s, RSS "
                f"{f['rss_bytes']['min'] / 2**20:.1f}..{f['rss_bytes']['max'] / 2**20:.1f} MiB, FDs "
                f"{f['fds']['min']}..{f['fds']['max']}"
            )
    print(f"load average before {res['load_average_before']}, after {res['load_average_after']}")
    sys.exit(0 if res["passed"] else 1)


if __name__ == "__main__":
    main()
