"""``tierstore fdp``: an operator's view of an FDP namespace, in the style of ``nvme fdp``, about our use.

``tierstore fdp discover DEVICE``
    FDP support and enablement, the active configuration (reclaim groups,
    RUHs and their types, RU nominal size, RGIF), the RUH Status list (the
    list fio-style ``plids`` index) and the PID tierstore would use per
    lifetime class (:func:`tierstore.fdp.device.discover_namespace`, the same
    discovery the library, the bench and the daemon use), and the NVMe tier's
    eviction mode the device gets by default, with why
    (:func:`tierstore.fdp.discovery.default_eviction`).
``tierstore fdp stats DEVICE [--save-baseline] [--baseline FILE]``
    HBMW, MBMW, MBE (FDP Statistics, log 22h) now and since a saved baseline,
    WAF = delta MBMW / delta HBMW over that window, and per-RUH usage from RUH
    Status (RUAMW: what the handle's current RU can still take) and the RUH
    Usage log (21h: host- or controller-specified).

``--output-format=json`` prints one JSON object instead of the text report.
The baseline is a small JSON file, by default
``$XDG_STATE_HOME/tierstore/fdp-<serial>-nsid<N>-eg<E>.json``
(``~/.local/state`` without ``XDG_STATE_HOME``); ``--save-baseline`` writes
the counters read now into it.

A device's counters are cumulative over its life (NVMe Base Specification 2.1,
FDP Statistics log page; TP4146), so WAF "since the baseline" is the WAF of
the work done since the operator saved it. On QEMU's emulation MBMW exceeds
HBMW only by the unwritten tails of RUs switched by RUH Update (it models no
garbage collection), so there WAF is no statement about an SSD.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from ..errors import TierStoreError
from . import logpages as lp
from .lifetime import LifetimeClass

__all__ = ["main", "discover_report", "stats_report", "default_baseline_path"]

_RUHA = {0: "unused", 1: "host specified", 2: "controller specified"}


def _ruht(cfg: lp.FdpConfig, ruhid: int) -> str:
    if 0 <= ruhid < len(cfg.ruhs):
        return lp.RUHT_NAMES.get(cfg.ruhs[ruhid].ruht, f"type {cfg.ruhs[ruhid].ruht:#x}")
    return "unknown"


def discover_report(dev: str, endgid: int = 1, plids: Sequence[int] = (), cli: Any = None) -> dict:
    """Everything ``tierstore fdp discover`` prints, as a JSON-ready dict.

    Raises
    ------
    ConfigError, NvmeCliError, CorruptData
        As :func:`tierstore.fdp.device.discover_namespace`, or ``plids`` outside RUH Status.
    """
    from .discovery import default_eviction, discover_namespace

    ns = discover_namespace(dev, endgid, cli)
    mode, why = default_eviction(bool(ns.info.fdp_enabled))
    out: dict[str, Any] = {
        "device": ns.char_dev,
        "block_device": ns.block_dev,
        "controller": ns.ctrl_dev,
        "serial": ns.serial,
        "nsid": ns.nsid,
        "size_bytes": ns.size_bytes,
        "lba_bytes": ns.lba_bytes,
        "max_transfer_bytes": ns.max_transfer_bytes,
        "endgid": endgid,
        "fdp_supported": bool(ns.info.fdp_supported),
        "fdp_enabled": bool(ns.info.fdp_enabled),
        "config_index": ns.info.config_index,
        "eviction_granularity": mode,
        "eviction_why": why,
    }
    if not ns.info.fdp_enabled:
        return out
    cfg = ns.info.config
    out["config"] = {
        "nrg": cfg.nrg,
        "nruh": cfg.nruh,
        "runs_bytes": cfg.runs_bytes,
        "rgif": cfg.rgif,
        "maxpids": cfg.maxpids + 1,
        "nnss": cfg.nnss,
        "erutl_s": cfg.erutl_s,
        "volatile_write_cache": cfg.volatile_write_cache,
        "valid": cfg.valid,
        "ruh_types": [_ruht(cfg, i) for i in range(cfg.nruh)],
    }
    tab = ns.pid_table
    out["ruh_status"] = [
        {
            "plid": i,
            "pid": d.pid,
            "reclaim_group": tab.split(d.pid)[0],
            "placement_handle": tab.split(d.pid)[1],
            "ruhid": d.ruhid,
            "type": _ruht(cfg, d.ruhid),
            "earutr_s": d.earutr_s,
            "ruamw_blocks": d.ruamw_blocks,
            "ruamw_bytes": d.ruamw_blocks * ns.lba_bytes,
        }
        for i, d in enumerate(ns.ruh_status.descs)
    ]
    pol = ns.placement(plids)
    where = {p: i for i, p in reversed(list(enumerate(tab.pids)))}
    rows = [("default", pol.default_pid)] + [
        (c.name.lower(), pol.class_pid[c])
        for c in (LifetimeClass.LONG, LifetimeClass.MEDIUM, LifetimeClass.SHORT)
    ]
    out["placement"] = {
        "plids": list(plids),
        "classes": [{"class": name, "pid": pid, "plid": where[pid]} for name, pid in rows],
    }
    return out


def default_baseline_path(serial: str, nsid: int, endgid: int) -> str:
    """``$XDG_STATE_HOME/tierstore/fdp-<serial>-nsid<N>-eg<E>.json`` (``~/.local/state`` by default)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in serial) or "unknown"
    return os.path.join(base, "tierstore", f"fdp-{safe}-nsid{nsid}-eg{endgid}.json")


def _compare_with_baseline(out: dict[str, Any], now: dict[str, int], path: str) -> None:
    """``out["baseline"]`` and ``out["since_baseline"]`` (the counters' growth since the baseline
    saved at ``path`` and its WAF), or ``out["baseline_error"]`` for an unreadable baseline or
    counters below it."""
    base = None
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as f:
                base = json.load(f)
            base = {k: int(base[k]) for k in ("hbmw_bytes", "mbmw_bytes", "mbe_bytes")} | {
                "time_s": float(base.get("time_s", 0.0))
            }
        except (OSError, ValueError, KeyError, TypeError) as exc:
            out["baseline_error"] = f"{path}: unreadable baseline ({exc})"
            base = None
    if base is not None:
        d = {k: now[k] - base[k] for k in ("hbmw_bytes", "mbmw_bytes", "mbe_bytes")}
        out["baseline"] = base
        if any(v < 0 for v in d.values()):
            out["baseline_error"] = (
                f"{path}: the device's counters are below the baseline's (another device, "
                "or its counters were reset); save a new one with --save-baseline"
            )
        else:
            out["since_baseline"] = d | {
                "waf": d["mbmw_bytes"] / d["hbmw_bytes"] if d["hbmw_bytes"] else None
            }


def _ruh_usage(ns: Any, cfg: Any, usage: Any) -> list[dict[str, Any]]:
    """One row per reclaim unit handle of the namespace's placement handles: its PID, reclaim
    group, handle, type, attributes, the bytes left in and written to its reclaim unit, and the
    lifetime class that uses it."""
    tab = ns.pid_table
    st = ns.ruh_status
    rows: list[dict[str, Any]] = []
    for d in st.descs:
        avail = d.ruamw_blocks * ns.lba_bytes
        rows.append(
            {
                "pid": d.pid,
                "reclaim_group": tab.split(d.pid)[0],
                "placement_handle": tab.split(d.pid)[1],
                "ruhid": d.ruhid,
                "type": _ruht(cfg, d.ruhid),
                "ruha": _RUHA.get(usage.ruha[d.ruhid], str(usage.ruha[d.ruhid]))
                if d.ruhid < usage.nruh
                else "unknown",
                "ruamw_blocks": d.ruamw_blocks,
                "ru_available_bytes": avail,
                "ru_written_bytes": max(0, cfg.runs_bytes - avail),
            }
        )
    pol = ns.placement()
    cls = {pol.default_pid: "default"}
    for c in (LifetimeClass.SHORT, LifetimeClass.MEDIUM, LifetimeClass.LONG):
        cls[pol.class_pid[c]] = c.name.lower()
    for row in rows:
        row["class"] = cls.get(row["pid"], "")
    return rows


def stats_report(
    dev: str, endgid: int = 1, baseline: str | None = None, save_baseline: bool = False, cli: Any = None
) -> dict:
    """Everything ``tierstore fdp stats`` prints, as a JSON-ready dict (module doc).

    Raises
    ------
    ConfigError, NvmeCliError, CorruptData
        As :func:`tierstore.fdp.device.discover_namespace`.
    """
    from .discovery import discover_namespace
    from .nvme_cli import NvmeCli

    cli = cli or NvmeCli()
    ns = discover_namespace(dev, endgid, cli)
    ns.require_fdp()
    cfg = ns.info.config
    now = cli.stats(ns.ctrl_dev, endgid).as_dict()
    usage = cli.usage(ns.ctrl_dev, endgid)
    path = baseline or default_baseline_path(ns.serial, ns.nsid, endgid)
    out: dict[str, Any] = {
        "device": ns.char_dev,
        "controller": ns.ctrl_dev,
        "serial": ns.serial,
        "nsid": ns.nsid,
        "endgid": endgid,
        "time_s": time.time(),
        "counters": now,
        "waf": now["mbmw_bytes"] / now["hbmw_bytes"] if now["hbmw_bytes"] else None,
        "baseline_path": path,
        "baseline": None,
        "since_baseline": None,
    }
    _compare_with_baseline(out, now, path)
    out["ruh_usage"] = _ruh_usage(ns, cfg, usage)
    out["runs_bytes"] = cfg.runs_bytes
    if save_baseline:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(now | {"time_s": out["time_s"], "device": ns.char_dev, "serial": ns.serial}, f)
        os.replace(tmp, path)
        out["baseline_saved"] = path
    return out


def _fmt_waf(v: float | None) -> str:
    return "-" if v is None else f"{v:.4f}"


def _print_discover(r: dict) -> None:
    mt = r["max_transfer_bytes"]
    print(
        f"{r['device']}: namespace {r['nsid']} of {r['controller']} (serial {r['serial']}), "
        f"{r['size_bytes']} bytes in {r['lba_bytes']}-byte blocks, max transfer "
        f"{'unknown' if mt is None else f'{mt} bytes'}"
    )
    if not r["fdp_supported"] or not r["fdp_enabled"]:
        print(
            "FDP: not supported (Identify Controller CTRATT bit 19 is 0)"
            if not r["fdp_supported"]
            else f"FDP: supported, NOT enabled on endurance group {r['endgid']}"
        )
        _print_eviction(r)
        return
    c = r["config"]
    print(f"FDP: supported, enabled on endurance group {r['endgid']}, configuration {r['config_index']}")
    print(f"  Number of Reclaim Groups: {c['nrg']}")
    print(f"  Number of Reclaim Unit Handles: {c['nruh']}")
    print(f"  Reclaim Unit Nominal Size: {c['runs_bytes']} bytes ({c['runs_bytes'] / 2**20:g} MiB)")
    print(f"  Reclaim Group Identifier Format (RGIF): {c['rgif']}; Max Placement Identifiers: {c['maxpids']}")
    print(
        f"  Volatile Write Cache: {'yes' if c['volatile_write_cache'] else 'no'}; "
        f"Estimated RU Time Limit: {c['erutl_s'] or 'not reported'}"
    )
    print("  Reclaim Unit Handle List:")
    for i, t in enumerate(c["ruh_types"]):
        print(f"    [{i}]: {t}")
    print(f"RUH Status ({len(r['ruh_status'])} entries; fio-style plids index this list):")
    print(
        f"  {'plid':>4}  {'PID':>6}  {'RG':>3}  {'PH':>3}  {'RUHID':>5}  {'RUAMW blocks':>12}  "
        f"{'RU available':>14}"
    )
    for s in r["ruh_status"]:
        print(
            f"  {s['plid']:>4}  {s['pid']:#06x}  {s['reclaim_group']:>3}  {s['placement_handle']:>3}  "
            f"{s['ruhid']:>5}  {s['ruamw_blocks']:>12}  {s['ruamw_bytes']:>14}"
        )
    p = r["placement"]
    how = (
        f"plids={','.join(map(str, p['plids']))}"
        if p["plids"]
        else "default table; fdp.plids / --plids override"
    )
    print(f"tierstore placement (lifetime class -> PID; {how}):")
    for row in p["classes"]:
        label = "default (untagged, metadata)" if row["class"] == "default" else row["class"]
        print(f"  {label:<28}  PID {row['pid']:#06x}  (plid {row['plid']})")
    _print_eviction(r)


def _print_eviction(r: dict) -> None:
    print(
        f"tierstore NVMe eviction on this device by default: {r['eviction_granularity']} "
        f"(tiers.nvme.eviction_granularity): {r['eviction_why']}"
    )


def _print_stats(r: dict) -> None:
    print(
        f"{r['device']}: namespace {r['nsid']} of {r['controller']} (serial {r['serial']}), "
        f"endurance group {r['endgid']}"
    )
    c, d = r["counters"], r["since_baseline"]
    if d is None:
        head = "since baseline"
        if r.get("baseline_error"):
            print(f"baseline: {r['baseline_error']}")
        else:
            print(
                f"baseline: none saved at {r['baseline_path']} (tierstore fdp stats {r['device']} "
                "--save-baseline)"
            )
    else:
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(r["baseline"]["time_s"]))
        head = f"since {when}"
        print(f"baseline: {r['baseline_path']}")
    print(f"  {'':<45} {'device total':>16} {head:>22}")
    for key, label in (
        ("hbmw_bytes", "Host Bytes with Metadata Written (HBMW)"),
        ("mbmw_bytes", "Media Bytes with Metadata Written (MBMW)"),
        ("mbe_bytes", "Media Bytes Erased (MBE)"),
    ):
        print(f"  {label:<45} {c[key]:>16} {'-' if d is None else d[key]:>22}")
    print(
        f"  {'WAF (MBMW / HBMW)':<45} {_fmt_waf(r['waf']):>16} {'-' if d is None else _fmt_waf(d['waf']):>22}"
    )
    print(f"RUH usage (RUH Status; RU written = RUNS {r['runs_bytes']} - RUAMW x LBA):")
    print(
        f"  {'PID':>6}  {'RG':>3}  {'PH':>3}  {'RUHID':>5}  {'RUHA':<15}  {'class':<7}  "
        f"{'RUAMW blocks':>12}  "
        f"{'RU written':>12}"
    )
    for u in r["ruh_usage"]:
        print(
            f"  {u['pid']:#06x}  {u['reclaim_group']:>3}  {u['placement_handle']:>3}  {u['ruhid']:>5}  "
            f"{u['ruha']:<15}  {u['class']:<7}  {u['ruamw_blocks']:>12}  {u['ru_written_bytes']:>12}"
        )
    if r.get("baseline_saved"):
        print(f"baseline saved: {r['baseline_saved']}")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tierstore fdp", description="FDP namespace discovery and statistics.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (
        ("discover", "FDP support, configuration, RUH Status and tierstore's PIDs per class"),
        ("stats", "HBMW/MBMW/MBE and WAF since a saved baseline, per-RUH usage"),
    ):
        p = sub.add_parser(name, help=help_)
        p.add_argument("device", help="the namespace: /dev/ngXnY (or /dev/nvmeXnY)")
        p.add_argument("--endgid", "-e", type=int, default=1, help="endurance group (default 1)")
        p.add_argument("--output-format", "-o", choices=("normal", "json"), default="normal")
        if name == "discover":
            p.add_argument(
                "--plids", default="", help="indices into RUH Status for long,medium,short (as fio's)"
            )
        else:
            p.add_argument("--baseline", help="baseline file (default: under $XDG_STATE_HOME/tierstore)")
            p.add_argument(
                "--save-baseline", action="store_true", help="save the counters read now as the baseline"
            )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``tierstore fdp ...``; returns the exit status (2 for bad usage, 1 for a device error)."""
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    try:
        if args.cmd == "discover":
            try:
                plids = [int(x) for x in args.plids.split(",") if x.strip()]
            except ValueError:
                print(
                    f"tierstore fdp discover: --plids={args.plids!r}: a comma-separated list of integers",
                    file=sys.stderr,
                )
                return 2
            rep = discover_report(args.device, args.endgid, plids)
            show = _print_discover
        else:
            rep = stats_report(args.device, args.endgid, args.baseline, args.save_baseline)
            show = _print_stats
    except (TierStoreError, OSError) as exc:
        print(f"tierstore fdp {args.cmd}: {exc}", file=sys.stderr)
        return 1
    if args.output_format == "json":
        print(json.dumps(rep, indent=2, sort_keys=True))
    else:
        show(rep)
    return 0
