#!/usr/bin/env python3
"""Issue 26 item 3, last step: bytes per reclaim unit handle on the emulated FDP SSD against the FTL model.

One workload and utilisation of ``bench/frontier_store.py``, per configuration (``d-hint`` by default):

1. on this host, the replay onto the FTL model (``frontier_store.run_one``, ``device: sim``):
   the model's host bytes per handle (``ruh_host_bytes``), saved prefill, e2e WA;
2. in a guest of ``../shared/tools/fdp-vm/run`` (QEMU's FDP emulation, booted through
   ``tests/fdp/vm_guest.sh`` with ``tests/fdp/vmenv.py``'s Python image), the same replay through
   the real device path (``device: fdp`` on ``/dev/ng0n1``: passthrough writes tagged with the
   PID, RUH Update on segment open) with the segment size of step 1. The device's bytes per
   handle come from RUH Status (RUAMW, read through I/O Management Receive right before every
   RUH Update and at the end: each RU took ``RUAMW at its start - RUAMW at its end`` logical
   blocks); the RU nominal size is at least twice the segment, so no RU fills between two reads
   (checked: the device's per-handle sum must equal the engine's bytes per PID and the FDP
   Statistics HBMW delta). FDP Statistics (22h), RUH Usage (21h) and host events (23h) are read
   through nvme-cli (``tierstore fdp stats``). No FTL model observes the guest's writes: its RUs
   (the device's RUNS, two segments) each closed half-written by a RUH Update fill the model.

QEMU's emulation models **no garbage collection**: MBMW exceeds HBMW only by the unwritten tails
of RUs switched by RUH Update, so its WAF is the host's and says nothing about an SSD's GC; the
per-handle bytes are what it can check: that each byte lands on the handle tierstore tagged.

    python bench/fdp_vm_handles.py --workload excerpt --configs d-hint,c --json R/handles.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def _frontier_store():
    """``bench/frontier_store.py`` as a module (the bench scripts are not a package)."""
    if "frontier_store" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "frontier_store", os.path.join(HERE, "frontier_store.py")
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["frontier_store"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["frontier_store"]


F = _frontier_store()

DEV = "/dev/ng0n1"


class HandleTally:
    """Bytes each PID's handle took, from RUAMW: per RU, RUAMW at its start minus at its end.

    ``start``: PID -> RUAMW (logical blocks) when counting starts; :meth:`switch` records the
    RUAMW read right before a RUH Update of that PID (its next RU starts at ``runs_bytes``);
    :meth:`finish` the RUAMW at the end."""

    def __init__(self, start: dict[int, int], runs_bytes: int, lba_bytes: int) -> None:
        self.lba_bytes, self.runs_blocks = lba_bytes, runs_bytes // lba_bytes
        self.ru_start = dict(start)
        self.bytes: dict[int, int] = dict.fromkeys(start, 0)
        self.updates: dict[int, int] = dict.fromkeys(start, 0)
        self.unwritten_bytes = 0

    def switch(self, pid: int, ruamw_blocks: int) -> None:
        self.bytes[pid] += (self.ru_start[pid] - ruamw_blocks) * self.lba_bytes
        self.unwritten_bytes += ruamw_blocks * self.lba_bytes
        self.ru_start[pid] = self.runs_blocks
        self.updates[pid] += 1

    def finish(self, end: dict[int, int]) -> None:
        for pid, r in end.items():
            self.bytes[pid] += (self.ru_start[pid] - r) * self.lba_bytes
            self.ru_start[pid] = r


def _ruamw(cli, ns) -> dict[int, int]:
    return {d.pid: d.ruamw_blocks for d in cli.ruh_status(ns.char_dev, ns.nsid, 64).descs}


def guest_one(wl, name: str, util: float, seg: int, out_dir: str, cli, ns) -> dict:
    """One configuration through ``device: fdp`` on the emulated namespace (module doc, step 2)."""
    from tierstore.fdp import admin

    runs, lba = ns.info.config.runs_bytes, ns.lba_bytes
    tally = HandleTally(_ruamw(cli, ns), runs, lba)
    before = cli.stats(ns.ctrl_dev, ns.endgid).as_dict()
    held: dict = {}

    def hook(store) -> None:
        eng = store.nvme.engine
        send = eng._writer.ruh_update  # the command itself: PassthroughEngine sends it under its RUH lock

        def ruh_update(pids):
            now = {d.pid: d.ruamw_blocks for d in eng.ruh_status().descs}
            for p in pids:
                tally.switch(p, now[p])
            return send(pids)

        eng._writer.ruh_update = ruh_update
        held["store"] = store

    device = {
        "device": "fdp",
        "path": ns.char_dev,
        "format": True,
        "segment_size_bytes": seg,
        "journal_path": os.path.join(out_dir, f"journal-{name}"),
    }
    row, _ = F.run_one(wl, name, util, "initial", device=device, on_open_also=hook)
    tally.finish(_ruamw(cli, ns))
    after = cli.stats(ns.ctrl_dev, ns.endgid).as_dict()
    eng = held["store"].nvme.engine.stats()
    events = cli.events(ns.ctrl_dev, ns.endgid, host_events=True)
    ev_pids: dict[str, int] = {}
    for e in events.events:
        ev_pids[str(e.pid)] = ev_pids.get(str(e.pid), 0) + 1
    report = admin.stats_report(ns.char_dev, ns.endgid, baseline=os.path.join(out_dir, "no-baseline.json"))
    return {
        "row": row,
        "device_bytes_per_pid": {str(p): b for p, b in tally.bytes.items() if b},
        "ruh_updates_per_pid": {str(p): n for p, n in tally.updates.items() if n},
        "device_unwritten_tails_bytes": tally.unwritten_bytes,
        "hbmw_delta_bytes": after["hbmw_bytes"] - before["hbmw_bytes"],
        "mbmw_delta_bytes": after["mbmw_bytes"] - before["mbmw_bytes"],
        "mbe_delta_bytes": after["mbe_bytes"] - before["mbe_bytes"],
        "engine_bytes_per_pid": {str(k): v for k, v in eng.get("bytes_by_placement", {}).items()},
        "engine_ruh": {
            k: eng.get(k) for k in ("ruh_updates_sent", "ruh_updates_skipped", "ruh_update_unwritten_bytes")
        },
        "host_events": {"n": events.n, "per_pid": ev_pids},
        "ruh_usage": report["ruh_usage"],
    }


def guest(a) -> int:
    """``--guest``: every configuration of ``a.configs`` on the emulated namespace, into OUT/guest.json."""
    from tests.fdp.vm_checks import discard_all
    from tierstore.fdp.discovery import discover_namespace
    from tierstore.fdp.nvme_cli import NvmeCli

    cli = NvmeCli()
    ns = discover_namespace(DEV)
    wl = F.load_workload(a.workload, a.trace, a.limit, 32 << 10, a.agent_trace)
    res: dict = {
        "namespace": {
            "size_bytes": ns.size_bytes,
            "lba_bytes": ns.lba_bytes,
            "runs_bytes": ns.info.config.runs_bytes,
            "nruh": ns.info.config.nruh,
        },
        "runs": {},
    }
    path = os.path.join(a.out, "guest.json")
    for i, name in enumerate(a.configs.split(",")):
        if i:
            discard_all()  # the next store must not find the last one's label (a labelled tier is reopened)
        t = time.monotonic()
        try:
            res["runs"][name] = guest_one(wl, name, a.util, a.segment_bytes, a.out, cli, ns)
        except Exception as exc:  # noqa: BLE001 - recorded for the host side; the next one still runs
            import traceback

            res["runs"][name] = {"error": f"{exc!r}", "traceback": traceback.format_exc()[-4000:]}
        res["runs"][name]["guest_wall_s"] = round(time.monotonic() - t, 1)
        with open(path, "w") as f:
            json.dump(res, f, indent=1, default=str)
        print(f"{name}: {time.monotonic() - t:.0f} s", flush=True)
    return 0


def boot(a, seg: int, tier: int, out: str) -> tuple[int, str, float]:
    """Run ``--guest`` in the fdp-vm guest: RU nominal size >= 2 segments (whole MiB), a namespace
    of the tier plus one RU."""
    from tests.fdp import vmenv

    tool = a.tool or vmenv.TOOL
    if not os.access(tool, os.X_OK):
        raise SystemExit(f"no fdp-vm tool at {tool} (../shared/tools/fdp-vm beside the checkout, or --tool)")
    mib = 1 << 20
    runs = -(-2 * seg // mib) * mib
    size = (-(-tier // runs) + 1) * runs
    vmenv.compile_for_guest(HERE)
    img = vmenv.python_image()
    py = vmenv.guest_python() if img else os.path.join(REPO, ".venv", "bin", "python")
    args = [
        "--workload",
        a.workload,
        "--util",
        str(a.util),
        "--configs",
        a.configs,
        "--segment-bytes",
        str(seg),
    ]
    for k in ("trace", "limit", "agent_trace"):
        if getattr(a, k) is not None:
            args += [f"--{k.replace('_', '-')}", str(getattr(a, k))]
    cmd = [tool, "--nruh", str(a.nruh), "--ru-size", str(runs), "--size", str(size), "--memory", "3G"]
    cmd += ["--rwdir", out, "--", "bash", os.path.join(REPO, "tests", "fdp", "vm_guest.sh"), py, img or "-"]
    cmd += [REPO, out, "bench/fdp_vm_handles.py", "--guest", *args]
    t = time.monotonic()
    rc, tail, _ = vmenv.boot(cmd, out, a.timeout_s)
    return rc, tail[-3000:], time.monotonic() - t


def device_cell(dev: int, engine: int, runs_bytes: int) -> str:
    """The device's bytes for one handle: the RUAMW tally, or, where the engine sent more and the
    difference is whole RUs (RUs that filled with no RUH Update, which RUAMW cannot see), both."""
    extra = engine - dev
    if extra > 0 and runs_bytes and extra % runs_bytes == 0:
        return f"{engine:,} ({extra // runs_bytes} whole RUs + {dev:,} by RUAMW)"
    return f"{dev:,}"


def table(res: dict) -> list[str]:
    """Markdown: per configuration and handle, device bytes against the model's (module doc).
    Untagged writes (engine key ``none``) are the default handle's (PID 0): a write without a
    placement directive goes to placement handle 0."""
    out = [
        "| config | PID (handle) | lifetime class(es) | device bytes (RUH Status) | engine bytes (tagged) "
        "| FTL model (`device: sim`, same replay) | RUH Updates sent | host events |",
        "|---|---|---|---|---|---|---|---|",
    ]
    runs = res.get("namespace", {}).get("runs_bytes", 0)
    for name, r in res["configs"].items():
        g, s = r.get("guest", {}), r["sim"]
        if "device_bytes_per_pid" not in g:
            out.append(f"| `{name}` | - | - | guest failed: {g.get('error', 'no result')} | | | | |")
            continue
        cls = {}
        for c, p in g["row"]["class_pid"].items():
            cls.setdefault(str(p), []).append(c)
        engine = dict(g["engine_bytes_per_pid"])
        untagged = engine.pop("none", 0)
        engine["0"] = engine.get("0", 0) + untagged
        pids = sorted(set(g["device_bytes_per_pid"]) | set(engine) | set(s["ruh_bytes"] or {}), key=int)
        for p in pids:
            dev, eng = g["device_bytes_per_pid"].get(p, 0), engine.get(p, 0)
            sim = (s["ruh_bytes"] or {}).get(p, 0)
            upd, ev = g["ruh_updates_per_pid"].get(p, 0), g["host_events"]["per_pid"].get(p, 0)
            eng_s = f"{eng:,}" + (f" ({untagged:,} untagged)" if p == "0" and untagged else "")
            out.append(
                f"| `{name}` | {p} | {', '.join(cls.get(p, [])) or '-'} | {device_cell(dev, eng, runs)} "
                f"| {eng_s} | {sim:,} | {upd} | {ev} |"
            )
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="excerpt")
    ap.add_argument("--trace", default=None)
    ap.add_argument("--agent-trace", default=None)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--configs", default="d-hint")
    ap.add_argument("--util", type=float, default=0.9)
    ap.add_argument("--nruh", type=int, default=8)
    ap.add_argument("--json", default=None, help="write the result here (host side)")
    ap.add_argument(
        "--tool", default=None, help="the fdp-vm run script (default: ../shared/tools/fdp-vm/run)"
    )
    ap.add_argument("--timeout-s", type=float, default=3000)
    ap.add_argument("--guest", action="store_true", help="inside the fdp-vm guest (started by the host side)")
    ap.add_argument("--out", default=None, help="guest: the writable output directory")
    ap.add_argument("--segment-bytes", type=int, default=None, help="guest: the sim run's segment size")
    a = ap.parse_args(argv)
    if a.guest:
        return guest(a)
    wl = F.load_workload(a.workload, a.trace, a.limit, 32 << 10, a.agent_trace)
    res: dict = {
        "workload": a.workload,
        "util": a.util,
        "what": "emulated FDP SSD (QEMU hw/nvme, fdp-vm: no GC, so its WA is the host's) vs the FTL model",
        "configs": {},
        "loadavg_start": round(os.getloadavg()[0], 2),
    }
    for name in a.configs.split(","):
        row, _ = F.run_one(wl, name, a.util, "initial")
        res["configs"][name] = {"sim": row}
    segs = {r["sim"]["segment_size_bytes"] for r in res["configs"].values()}
    if len(segs) != 1:
        raise SystemExit(f"the configurations have different segment sizes {segs}: run them one at a time")
    seg = segs.pop()
    tier = wl.nvme_bytes // seg * seg
    out = tempfile.mkdtemp(prefix="fdp-vm-handles-")
    os.chmod(out, 0o777)
    rc, tail, wall = boot(a, seg, tier, out)
    res["vm"] = {"rc": rc, "wall_s": round(wall, 1), "tool_output_tail": tail}
    path = os.path.join(out, "guest.json")
    if os.path.exists(path):
        with open(path) as f:
            g = json.load(f)
        res["namespace"] = g["namespace"]
        for name, r in g["runs"].items():
            res["configs"][name]["guest"] = r
    log = os.path.join(out, "driver.log")
    if os.path.exists(log):
        with open(log, errors="replace") as f:
            res["vm"]["driver_log_tail"] = f.read()[-3000:]
    res["loadavg_end"] = round(os.getloadavg()[0], 2)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1, default=str)
    print("\n".join(table(res)))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
