"""The in-guest half of the FDP VM tests: run the product against the emulated FDP namespace, record.

Started by ``tests/fdp/test_vm.py`` through ``../shared/tools/fdp-vm/run`` (one guest boot per
emulator configuration), as ``python tests/fdp/vm_checks.py --out DIR --nruh N --nrg N ...``. It
asserts nothing: every phase records what the *device* reported (FDP log pages and RUH Status read
through nvme-cli, before and after) next to what tierstore reports, into ``DIR/results.json``, and
the host-side tests assert on that. A phase that raises records its traceback and the rest run.

Python under TCG is slow (tens of seconds to import torch), so everything runs in this one
process: the bench CLI in-process (``tierstore.bench.cli.main``), the library through
``build_store``, and the daemon in processes forked from a *zygote* that was forked right after
the imports (no torch op ran in it, so no OpenMP pool is inherited), so that ``kill -9`` and the
restart are real process deaths and starts.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import io
import json
import os
import signal
import struct
import subprocess
import sys
import time
import traceback

DEV = "/dev/ng0n1"
BLK = "/dev/nvme0n1"
CTRL = "/dev/nvme0"
R: dict = {"timings_s": {}, "errors": {}}
T0 = time.monotonic()
#: The phases a guest runs unless ``--phases`` names fewer (tests/fdp/test_vm.py reads this too).
PHASES = (
    "discovery",
    "imports",
    "invalid_pid",
    "ruh_update",
    "kvtrace",
    "stats_cli",
    "daemon",
    "plids_vs_fio",
)


def _mark(name: str, t: float) -> None:
    R["timings_s"][name] = round(time.monotonic() - t, 2)


def phase(name: str):
    def deco(fn):
        def run(*a, **k):
            t = time.monotonic()
            print(f"[{t - T0:7.1f} s] {name} ...", flush=True)
            try:
                R[name] = fn(*a, **k)
            except BaseException:  # noqa: BLE001 - recorded for the host-side test
                R["errors"][name] = traceback.format_exc()
            _mark(name, t)
            print(
                f"[{time.monotonic() - T0:7.1f} s] {name} done in {R['timings_s'][name]} s"
                f"{' (raised)' if name in R['errors'] else ''}",
                flush=True,
            )
            _save()

        return run

    return deco


def _save() -> None:
    R["timings_s"]["total"] = round(time.monotonic() - T0, 2)
    tmp = os.path.join(ARGS.out, "results.json.tmp")
    with open(tmp, "w") as f:
        json.dump(R, f, indent=1, default=str)
    os.replace(tmp, os.path.join(ARGS.out, "results.json"))


def sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(args), capture_output=True)
    if check and p.returncode:
        raise RuntimeError(f"{' '.join(args)}: exit {p.returncode}: {p.stderr.decode(errors='replace')}")
    return p


# ----------------------------------------------------------------- device state
def dev_state() -> dict:
    """What the device reports: FDP Statistics (22h) and RUH Status (I/O Management Receive)."""
    from tierstore.fdp.nvme_cli import NvmeCli

    cli = NvmeCli()
    st = cli.stats(CTRL, 1).as_dict()
    ruhs = cli.ruh_status(DEV, 1, 64)
    return {"stats": st, "ruamw": {str(d.pid): d.ruamw_blocks for d in ruhs.descs}}


def written_per_pid(before: dict, after: dict, lba: int) -> dict:
    """Bytes the device says each PID's handle took, from RUAMW (valid while its RU did not switch)."""
    return {
        p: (before["ruamw"][p] - after["ruamw"][p]) * lba
        for p in after["ruamw"]
        if before["ruamw"][p] != after["ruamw"][p]
    }


def discard_all() -> None:
    """A fresh namespace for the next store: zero it (BLKZEROOUT, which the kernel sends as
    NVMe Write Zeroes), then deallocate it (BLKDISCARD).

    Deallocate alone is advisory: the fdp-vm tool's ``-drive`` has QEMU's default
    ``discard=ignore``, so deallocated blocks kept the previous phase's segment headers and the
    next store's recovery found them ("holds blocks of 262144 bytes"). Write Zeroes goes on the
    default handle and may count in HBMW: every phase reads the device's counters after this."""
    fd = os.open(BLK, os.O_WRONLY)
    try:
        size = os.lseek(fd, 0, os.SEEK_END)
        fcntl.ioctl(fd, 0x127F, struct.pack("QQ", 0, size))  # BLKZEROOUT = _IO(0x12, 127)
        fcntl.ioctl(fd, 0x1277, struct.pack("QQ", 0, size))  # BLKDISCARD = _IO(0x12, 119)
    finally:
        os.close(fd)


def capture(fn, *args) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = fn(*args)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
    return rc, out.getvalue(), err.getvalue()


# ----------------------------------------------------------------- zygote
class Zygote:
    """A process forked before any torch op; it forks daemons on request and reaps them."""

    def __init__(self) -> None:
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            os.close(w1)
            os.close(r2)
            self._serve(os.fdopen(r1, "r"), os.fdopen(w2, "w"))
            os._exit(0)
        os.close(r1)
        os.close(w2)
        self.tx, self.rx = os.fdopen(w1, "w"), os.fdopen(r2, "r")

    @staticmethod
    def _serve(rx, tx) -> None:
        for line in rx:
            msg = json.loads(line)
            if msg["cmd"] == "daemon":
                pid = os.fork()
                if pid == 0:
                    fd = os.open(msg["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                    os.dup2(fd, 1)
                    os.dup2(fd, 2)
                    from tierstore.server.daemon import main

                    try:
                        rc = main(["--config", msg["config"]])
                    except BaseException:  # noqa: BLE001 (the daemon child: traceback to its log, rc 99)
                        traceback.print_exc()
                        rc = 99
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(int(rc or 0))
                tx.write(json.dumps({"pid": pid}) + "\n")
            elif msg["cmd"] == "wait":
                _, status = os.waitpid(msg["pid"], 0)
                tx.write(
                    json.dumps(
                        {
                            "status": status,
                            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
                            "exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
                        }
                    )
                    + "\n"
                )
            elif msg["cmd"] == "quit":
                return
            tx.flush()

    def ask(self, **msg) -> dict:
        self.tx.write(json.dumps(msg) + "\n")
        self.tx.flush()
        return json.loads(self.rx.readline())


# ----------------------------------------------------------------- phases
@phase("discovery")
def discovery() -> dict:
    """Our discovery (`tierstore fdp discover` / `stats`) and the raw log pages read independently."""
    from tierstore.fdp import admin
    from tierstore.fdp import logpages as lp

    rc, text, err = capture(
        admin.main, ["discover", DEV, "--output-format=json"]
    )  # one discovery (slow here)
    out = {"discover_json_rc": rc, "discover_err": err, "report": json.loads(text) if rc == 0 else {}}
    out["discover_text"] = capture(admin._print_discover, out["report"])[1] if rc == 0 else ""
    raw = {}
    for lid, n in ((0x20, 4096), (0x21, 4096), (0x22, 64), (0x23, 4096)):
        raw[lid] = sh(
            "nvme",
            "get-log",
            CTRL,
            "-i",
            hex(lid),
            "-l",
            str(n),
            "-S",
            "1",
            "-b",
            *(["-s", "1"] if lid == 0x23 else []),
        ).stdout
    cfg = lp.parse_fdp_configs(raw[0x20])
    c = cfg.configs[0]
    out["raw"] = {
        "numfdpc": cfg.numfdpc,
        "nrg": c.nrg,
        "nruh": c.nruh,
        "runs_bytes": c.runs_bytes,
        "rgif": c.rgif,
        "maxpids": c.maxpids,
        "ruht": [r.ruht for r in c.ruhs],
        "valid": c.valid,
        "ruha": list(lp.parse_ruh_usage(raw[0x21]).ruha),
        "stats": lp.parse_fdp_stats(raw[0x22]).as_dict(),
        "host_events": lp.parse_fdp_events(raw[0x23]).n,
    }
    out["fdp_status_cli_bytes"] = len(sh("nvme", "fdp", "status", DEV, "-b").stdout)
    js = json.loads(sh("nvme", "fdp", "status", DEV, "-o", "json").stdout)
    out["fdp_status_cli_json_pids"] = [int(x["pid"]) for x in js["ruhss"]]
    return out


@phase("imports")
def heavy_imports() -> dict:
    t = time.monotonic()
    import torch

    _mark("import_torch", t)
    import tierstore.api
    import tierstore.bench.cli
    import tierstore.bench.iojobs
    import tierstore.bench.kvjobs
    import tierstore.client
    import tierstore.server.daemon
    import tierstore.server.service  # noqa: F401

    return {"torch": torch.__version__}


@phase("invalid_pid")
def invalid_pid(zyg: Zygote) -> dict:
    """A PID the device does not list, asked for by configuration, is refused before any write."""
    from tierstore import build_store
    from tierstore.errors import ConfigError
    from tierstore.fdp.device import PassthroughEngine, discover_namespace
    from tierstore.io.engine import alloc_aligned
    from tierstore.layout import get_layout

    out: dict = {}
    before = dev_state()
    try:
        build_store(
            {
                "tiers": {
                    "nvme": {
                        "device": "fdp",
                        "path": DEV,
                        "capacity_bytes": "64MiB",
                        "format": True,
                        "fdp": {"enabled": True, "long_pid": 0x77, "medium_pid": 2, "short_pid": 3},
                    }
                }
            },
            get_layout("tiny"),
        )
        out["store"] = "accepted"
    except ConfigError as e:
        out["store"] = f"ConfigError: {e}"
    from tierstore.bench.cli import main as bench

    rc, _, err = capture(
        bench,
        [
            "--name=bad",
            "--rw=write",
            f"--filename={DEV}",
            f"--device={DEV}",
            "--format=1",
            "--dataplacement=fdp",
            f"--plids=0,{ARGS.nruh * ARGS.nrg + 1}",
            "--bs=4k",
            "--size=16k",
            "--output-format=json",
        ],
    )
    out["bench_rc"], out["bench_err"] = rc, err[-2000:]
    ns = discover_namespace(DEV)
    eng = PassthroughEngine(DEV, 1 << 20, ns.nsid, ns.lba_bytes, pid_table=ns.pid_table)
    keep, buf = alloc_aligned(4096)
    try:
        eng.write(0, buf, 0x77).get()
        out["engine"] = "accepted"
    except ConfigError as e:
        out["engine"] = f"ConfigError: {e}"
    finally:
        eng.close()
        keep.close()
    cfg = _daemon_config("bad", {"long_pid": 0x77, "medium_pid": 2, "short_pid": 3})
    pid = zyg.ask(cmd="daemon", config=cfg, log=os.path.join(ARGS.out, "daemon-bad.log"))["pid"]
    out["daemon_exit"] = zyg.ask(cmd="wait", pid=pid)
    with open(os.path.join(ARGS.out, "daemon-bad.log")) as f:
        out["daemon_log"] = f.read()[-3000:]
    after = dev_state()
    out["before"], out["after"] = before, after
    return out


def dmesg_tail(n: int = 40) -> str:
    """The guest kernel's last ``n`` log lines (an NVMe timeout, abort or reset is said only there)."""
    p = sh("dmesg", check=False)
    return "\n".join(p.stdout.decode(errors="replace").splitlines()[-n:])


@phase("ruh_update")
def ruh_update() -> dict:
    """Blocks of the three classes through the library; RUH Update on segment open; the FTL model
    (fed the same writes and updates) against the device's MBMW - HBMW.

    Run again, once, when the first run's only fault is writes the *host* saw fail (the engine's
    ``write_errors``; every non-ok block ``io_error``): under TCG on a loaded 2-core host a
    passthrough write failed host-side in CI (stop 37) after the device had taken its bytes, so
    HBMW exceeded the engine's count. That attempt is kept (``failed_attempts``, with the guest's
    kernel log) for the host-side tests, which accept only that kind of failure before the rerun."""
    import logging

    said: list[str] = []
    catch = logging.Handler(logging.WARNING)
    catch.emit = lambda rec: said.append(f"{rec.levelname} {rec.name}: {rec.getMessage()}")  # type: ignore[method-assign]
    logging.getLogger().addHandler(catch)
    try:
        first = _ruh_update_once()
    finally:
        logging.getLogger().removeHandler(catch)
    first["warnings"] = said[-20:]
    bad = [s for st in first["statuses"].values() for s in st if s != "ok"]
    if not bad or first["engine"]["write_errors"] == 0 or set(bad) != {"io_error"}:
        return first
    first["dmesg"] = dmesg_tail()
    out = _ruh_update_once()
    out["failed_attempts"] = [first]
    return out


def _ruh_update_once() -> dict:
    import torch

    from tierstore import Namespace, build_store
    from tierstore.layout import KVLayout

    discard_all()
    layout = KVLayout(2, 2, 16, torch.float32, 512, "fdp-vm-256k")  # 256 KiB blocks
    before = dev_state()
    store = build_store(
        {
            "tiers": {
                "hbm": {"capacity_bytes": 0},
                "host": {"capacity_bytes": 0},
                "nvme": {
                    "device": "fdp",
                    "path": DEV,
                    "capacity_bytes": "256MiB",
                    "format": True,
                    "fdp": {"enabled": True},
                    "model": {"page_bytes": 4096, "op_fraction": 0.5},
                },
            }
        },
        layout,
    )
    n_per_class = ARGS.ruh_update_blocks
    sent = {}
    try:
        base = 0
        for cls in ("system", "conversation", "query"):
            ns = Namespace(model=f"ruh-update-{cls}")
            for part in range(2):  # two puts per class: the second opens a new segment
                nb = n_per_class // 2
                toks = list(range(base, base + nb * layout.tokens_per_block))
                base += len(toks)
                kv = torch.zeros((nb,) + tuple(layout.block_shape), dtype=layout.dtype)
                sent[f"{cls}/{part}"] = [s.value for s in store.store(ns, toks, kv, lifetime=cls)]
        eng = store.nvme.engine
        estats = eng.stats()
        model = store.ftl.stats()
        pol = store.placement
        out = {
            "placement": {c.name: p for c, p in pol.class_pid.items()},
            "default_pid": pol.default_pid,
            "engine": {
                k: estats[k]
                for k in (
                    "bytes_written",
                    "write_ops",
                    "write_errors",
                    "ruh_updates_sent",
                    "ruh_updates_skipped",
                    "ruh_update_unwritten_bytes",
                )
            },
            "bytes_by_placement": {str(k): v for k, v in estats["bytes_by_placement"].items()},
            "model": {
                k: model[k] for k in ("hbmw_bytes", "mbmw_bytes", "ruh_updates", "ruh_update_unwritten_bytes")
            },
            "statuses": sent,
            "segment_size_bytes": store.nvme.segment_size_bytes,
            "block_bytes": layout.bytes_per_block,
        }
    finally:
        store.close()
    out["before"], out["after"] = before, dev_state()
    return out


def make_trace(path: str, n: int = 10, qlen: int = 4, clen: int = 3) -> None:
    """A short Mooncake-format trace with all three lifetime classes: two system prompts used in
    turn (each goes cold in host DRAM after being hit: LONG), conversations sent twice in a row
    (hit while still in host DRAM: MEDIUM), single queries (never reused: SHORT)."""
    rows, nid, t = [], [100], 0

    def new(k):
        r = list(range(nid[0], nid[0] + k))
        nid[0] += k
        return r

    for i in range(n):
        conv = new(clen)
        sysp = [0, 1] if i % 2 == 0 else [2, 3]
        for ids in (sysp + conv, sysp + conv + new(1), sysp + new(qlen), sysp + new(qlen)):
            rows.append(
                {"timestamp": t, "input_length": 512 * len(ids), "output_length": 10, "hash_ids": ids}
            )
            t += 1000
    with open(path, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


@phase("kvtrace")
def kvtrace() -> dict:
    """`tierstore bench --rw=kvtrace --device=/dev/ng0n1 --dataplacement=fdp` on a short trace."""
    from tierstore.bench.cli import main as bench
    from tierstore.fdp import admin

    discard_all()
    trace = os.path.join(ARGS.out, "trace.jsonl")
    make_trace(trace)
    res = os.path.join(ARGS.out, "kvtrace.json")
    argv = [
        "--rw=kvtrace",
        f"--device={DEV}",
        "--dataplacement=fdp",
        f"--trace={trace}",
        "--trace_block_size=16k",
        "--hbm_size=0",
        "--host_size=128k",
        "--nvme_size=128m",
        "--format=1",
        "--output-format=json",
        f"--output={res}",
    ]
    if ARGS.kv_plids:
        argv.append(f"--plids={ARGS.kv_plids}")
    before = dev_state()
    rc, out_text, err = capture(bench, argv)
    after = dev_state()
    out = {"argv": argv, "rc": rc, "stderr": err[-3000:], "before": before, "after": after}
    if rc != 0 or not os.path.exists(res):
        raise RuntimeError(
            f"tierstore bench {' '.join(argv)}: exit {rc}\nstdout: {out_text[-2000:]}\nstderr: {err[-3000:]}"
        )
    with open(res) as f:
        job = json.load(f)["jobs"][0]
    out["device"] = {k: v for k, v in job["device"].items() if not k.startswith("waf_timeseries")}
    out["kv"] = {k: v for k, v in job["kv"].items() if isinstance(v, (int, float, str))}
    plids = [int(x) for x in ARGS.kv_plids.split(",")] if ARGS.kv_plids else []
    out["placement"] = admin.discover_report(DEV, plids=plids)["placement"]
    rc, text, _ = capture(admin.main, ["stats", DEV, "--baseline", os.path.join(ARGS.out, "baseline.json")])
    out["stats_text_no_baseline"] = text
    return out


@phase("stats_cli")
def stats_cli() -> dict:
    """`tierstore fdp stats` with a baseline saved before a known write."""
    from tierstore.fdp import admin

    base = os.path.join(ARGS.out, "baseline.json")
    rc0, save_text, _ = capture(admin.main, ["stats", DEV, "--baseline", base, "--save-baseline"])
    data = os.path.join(ARGS.out, "data1m")
    with open(data, "wb") as f:
        f.write(os.urandom(1 << 20))
    # 1 MiB with PID 1 through nvme-cli, at the end of the namespace, in 128 KiB commands: one
    # command may carry at most MDTS bytes (QEMU's default MDTS 7 = 512 KiB at 4 KiB pages; a
    # 1 MiB `nvme write` fails with EINVAL), and the LBA size is the namespace's own
    from tierstore.fdp.discovery import discover_namespace

    lba = discover_namespace(DEV).lba_bytes
    chunk = 128 << 10
    first = (ARGS.size_bytes - (1 << 20)) // lba
    for i in range((1 << 20) // chunk):
        part = os.path.join(ARGS.out, "data128k")
        with open(data, "rb") as src, open(part, "wb") as dst:
            src.seek(i * chunk)
            dst.write(src.read(chunk))
        sh(
            "nvme",
            "write",
            DEV,
            "-s",
            str(first + i * chunk // lba),
            "-c",
            str(chunk // lba - 1),
            "-z",
            str(chunk),
            "-d",
            part,
            "-T",
            "2",
            "-S",
            "1",
        )
    rc1, text, err = capture(admin.main, ["stats", DEV, "--baseline", base])
    rc2, js, _ = capture(admin.main, ["stats", DEV, "--baseline", base, "--output-format=json"])
    return {
        "save_rc": rc0,
        "save_text": save_text,
        "rc": rc1,
        "text": text,
        "err": err,
        "json_rc": rc2,
        "json": json.loads(js) if rc2 == 0 else js,
    }


def _daemon_config(name: str, fdp_extra: dict | None = None) -> str:
    import yaml

    state = os.path.join(ARGS.out, f"state-{name}")
    os.makedirs(state, exist_ok=True)
    cfg = {
        "listen": {"host": "127.0.0.1", "port": 18470},
        "log": {"level": "INFO", "access_log": False},
        "state_dir": state,
        "layout": {"preset": "tiny", "tokens_per_block": 64},
        "tiers": {
            "hbm": {"capacity_bytes": 0},
            "host": {"capacity_bytes": "1MiB"},
            "nvme": {
                "device": "fdp",
                "path": DEV,
                "capacity_bytes": "128MiB",
                "format": True,
                "fdp": {"enabled": True, **(fdp_extra or {})},
            },
        },
        "puts": {"durable": True},
        "tenants": [{"name": "t", "tokens": ["fdp-vm-token-0123456789"]}],
        "limits": {"worker_threads": 2},
    }
    path = os.path.join(ARGS.out, f"daemon-{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _wait_ready(url: str, pid_alive, timeout_s: float) -> float:
    import urllib.request

    t = time.monotonic()
    while time.monotonic() - t < timeout_s:
        if not pid_alive():
            raise RuntimeError("the daemon exited during start-up")
        try:
            with urllib.request.urlopen(url + "/readyz", timeout=5) as r:
                if r.status == 200:
                    return time.monotonic() - t
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"daemon not ready after {timeout_s} s")


@phase("daemon")
def daemon(zyg: Zygote) -> dict:
    """The daemon on /dev/ng0n1 with fdp.enabled: puts per class; kill -9; restart; acknowledged puts back."""
    import torch

    from tierstore import Namespace
    from tierstore.client import RemoteKVStore
    from tierstore.errors import Status
    from tierstore.io import format as fmt

    discard_all()
    cfg = _daemon_config("ok")
    url = "http://127.0.0.1:18470"
    token = "fdp-vm-token-0123456789"
    out: dict = {"log": os.path.join(ARGS.out, "daemon-ok.log")}
    before = dev_state()
    pid = zyg.ask(cmd="daemon", config=cfg, log=out["log"])["pid"]

    def alive(p):
        return lambda: os.path.exists(f"/proc/{p}") and open(f"/proc/{p}/stat").read().split()[2] != "Z"

    out["start_s"] = _wait_ready(url, alive(pid), 600)
    acked, expect = [], {}
    with RemoteKVStore(url, token) as c:
        bb = c.block_bytes
        for cls, nblocks, nputs in (("system", 2, 2), ("conversation", 4, 3), ("query", 6, 4)):
            for r in range(nputs):
                ns = Namespace(model=f"daemon-{cls}")
                toks = [
                    hash((cls, r)) % 1_000_000 * 1000 + i for i in range(c.layout.tokens_per_block * nblocks)
                ]
                keys = c.keys_for(ns, toks)
                blocks = torch.stack(
                    [torch.frombuffer(bytearray(k * (bb // len(k))), dtype=torch.uint8) for k in keys]
                )
                st = c.store(ns, toks, blocks, lifetime=cls)
                if all(s is Status.OK for s in st):
                    acked.append((cls, ns, toks, keys))
                    expect[cls] = expect.get(cls, 0) + fmt.extent_bytes_for(len(keys), bb)
    mid = dev_state()
    os.kill(pid, signal.SIGKILL)
    out["killed"] = zyg.ask(cmd="wait", pid=pid)
    pid2 = zyg.ask(cmd="daemon", config=cfg, log=out["log"])["pid"]
    out["restart_s"] = _wait_ready(url, alive(pid2), 600)
    ok = bad = 0
    with RemoteKVStore(url, token) as c:
        bb = c.block_bytes
        for _cls, ns, _toks, keys in acked:
            st, outs = c.load(keys, ns=ns)
            for s, k, o in zip(st, keys, outs):
                good = s is Status.OK and bytes(c.layout.as_bytes(o).numpy()) == k * (bb // len(k))
                ok += good
                bad += not good
    os.kill(pid2, signal.SIGTERM)
    out["stopped"] = zyg.ask(cmd="wait", pid=pid2)
    with open(out["log"]) as f:
        lines = [json.loads(x) for x in f if x.startswith("{")]
    out["recovered"] = [x for x in lines if x.get("event") == "recovered"]
    out.update(
        before=before,
        after_puts=mid,
        after=dev_state(),
        acked_puts=len(acked),
        acked_blocks=sum(len(a[3]) for a in acked),
        loaded_ok=ok,
        loaded_bad=bad,
        expected_extent_bytes=expect,
    )
    return out


@phase("plids_vs_fio")
def plids_vs_fio() -> dict:
    """Plain job with plids= against real fio with the same plids: the PIDs the device saw."""
    from tierstore.bench.cli import main as bench

    out: dict = {"plids": ARGS.fio_plids}
    lba = 512
    before = dev_state()
    rc, _, err = capture(
        bench,
        [
            "--name=plids",
            "--rw=write",
            f"--filename={DEV}",
            f"--device={DEV}",
            "--format=1",
            "--dataplacement=fdp",
            f"--plids={ARGS.fio_plids}",
            "--bs=4k",
            "--size=24k",
            "--iodepth=1",
            "--output-format=json",
            f"--output={os.path.join(ARGS.out, 'plain.json')}",
        ],
    )
    mid = dev_state()
    out["ours"] = {"rc": rc, "stderr": err[-2000:], "pid_bytes": written_per_pid(before, mid, lba)}
    if not ARGS.fio:
        out["fio"] = {"skipped": "no fio with FDP support (fio >= 3.34) was given"}
        return out
    p = subprocess.run(
        [
            ARGS.fio,
            "--name=fio-plids",
            f"--filename={DEV}",
            "--ioengine=io_uring_cmd",
            "--cmd_type=nvme",
            "--rw=write",
            "--bs=4k",
            "--size=24k",
            "--offset=64m",
            "--iodepth=1",
            "--dataplacement=fdp",
            f"--plids={ARGS.fio_plids}",
            "--output-format=json",
        ],
        capture_output=True,
    )
    after = dev_state()
    out["fio"] = {
        "rc": p.returncode,
        "stderr": p.stderr.decode(errors="replace")[-2000:],
        "version": sh(ARGS.fio, "--version").stdout.decode().strip(),
        "pid_bytes": written_per_pid(mid, after, lba),
    }
    return out


def main() -> int:
    global ARGS
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--nruh", type=int, required=True)
    ap.add_argument("--nrg", type=int, required=True)
    ap.add_argument("--runs-bytes", type=int, required=True)
    ap.add_argument("--size-bytes", type=int, required=True)
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--kv-plids", default="")
    ap.add_argument("--fio-plids", default="0,1,2")
    ap.add_argument("--fio", default="")
    ap.add_argument("--ruh-update-blocks", type=int, default=48)
    ARGS = ap.parse_args()
    import faulthandler
    import logging

    # A real crash still prints every thread's stack. No periodic dump_traceback_later: it reads
    # other threads' frames without the GIL, and under a loaded host (phases over its period) it
    # crashed the guest with SIGSEGV in the daemon phase.
    faulthandler.enable()
    # tierstore's warnings and errors (e.g. why a put failed) go to driver.log
    logging.basicConfig(
        level=logging.WARNING, stream=sys.stderr, format="[guest log] %(levelname)s %(name)s: %(message)s"
    )
    print(f"[{time.monotonic() - T0:7.1f} s] started", flush=True)
    R["config"] = {
        "nruh": ARGS.nruh,
        "nrg": ARGS.nrg,
        "runs_bytes": ARGS.runs_bytes,
        "size_bytes": ARGS.size_bytes,
        "phases": ARGS.phases,
    }
    phases = ARGS.phases.split(",")
    if "discovery" in phases:
        discovery()
    zyg = None
    if any(p not in ("discovery",) for p in phases):
        heavy_imports()
        zyg = Zygote()
    for name in phases:
        if name in ("discovery", "imports"):
            continue
        fn = globals()[name]
        fn(zyg) if name in ("invalid_pid", "daemon") else fn()
    if zyg is not None:
        zyg.tx.write(json.dumps({"cmd": "quit"}) + "\n")
        zyg.tx.flush()
        os.waitpid(zyg.pid, 0)
    _save()
    return 0


ARGS: argparse.Namespace
if __name__ == "__main__":
    sys.exit(main())
