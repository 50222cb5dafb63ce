"""KV-cache workloads through the real tier manager.

``rw=kvtrace`` replays a Mooncake JSONL trace (:mod:`tierstore.replay`): the
``read`` direction is the loads of prefix hits, the ``write`` direction is the
stores of missed blocks. One I/O is one KV block (``bs`` = ``trace_block_size``; the job's ``bs=`` is
not used), so IOPS are blocks per second; the latencies are per call (one load or store call per request
that loaded or stored, of however many blocks). The
normal report leads with one verdict line (:func:`verdict`, also ``kv.verdict``
in the JSON). The ``kv`` section carries
hit ratios, saved prefill tokens and per-tier bytes; the ``device`` section the
NVMe backend's counters and the FDP figures (HBMW/MBMW/MBE, WAF, per-RUH bytes,
end-to-end WA); the WAF time series goes to the JSON (``device.waf_timeseries``)
and the plots, not the normal text.

Continued in ``docs/BENCH.md`` (``tierstore/bench/kvjobs.py``).
"""

from __future__ import annotations

import errno
import os
import tempfile
from typing import Any

import numpy as np

from ..config import StoreConfig
from ..errors import ConfigError
from ..replay import ReplayConfig, run_replay
from .jobfile import engine_kind, resolve_path
from .registry import (
    JobInterrupted,
    current_progress,
    info,
    register_runner,
    remove_private_dir,
    stop_requested,
    warn,
)
from .result import CpuUsage, DirectionResult, JobResult

__all__ = ["run_kvtrace", "nvme_options", "store_config", "nvme_file", "no_space_report", "verdict"]


def _direction(lat_ns: np.ndarray, nbytes: int, wall_s: float, block_bytes: int) -> DirectionResult:
    """One direction of a replay: one I/O per KV block moved (IOPS are blocks/s), one latency per call."""
    return DirectionResult(
        io_bytes=int(nbytes),
        ops=int(nbytes) // block_bytes,
        runtime_s=max(wall_s, 1e-9),
        clat_ns=lat_ns.astype(np.int64),
    )


def verdict(kv: dict[str, Any]) -> str:
    """The one line a replay's report leads with: the hit ratio against the trace's ideal, and the
    prefill it saved.

    The hit ratio is ``useful_hit_ratio`` (blocks loaded / prompt blocks looked up: what an engine
    skips computing); the ideal is ``ideal_hit_ratio``, the share of the trace's full prompt blocks
    whose hash was seen before (a cache of infinite capacity, :func:`tierstore.trace.ideal_hit_ratio`).
    """
    hit, ideal = float(kv.get("useful_hit_ratio", 0.0)), float(kv.get("ideal_hit_ratio", 0.0))
    of_ideal = f", {hit / ideal:.0%} of it" if ideal > 0 else ""
    matched = float(kv.get("lookup_hit_ratio", hit))
    extra = f"; {matched:.1%} matched, the rest not worth loading or failed" if matched > hit + 5e-4 else ""
    tokens, prompt = int(kv.get("saved_prefill_tokens", 0)), int(kv.get("prompt_tokens", 0))
    share = f" of {prompt:,} prompt tokens ({tokens / prompt:.1%})" if prompt else ""
    return (
        f"hit ratio {hit:.1%} of {int(kv.get('lookup_blocks', 0)):,} prompt blocks vs {ideal:.1%} with an "
        "infinite "
        f"cache (the trace's ideal{of_ideal}){extra}; saved {tokens:,} prefill tokens{share}"
    )


def replay_config(options: dict[str, Any], nvme_path: str | None = None) -> ReplayConfig:
    """Map bench options onto a :class:`~tierstore.replay.ReplayConfig`; ``nvme_path``
    is the tier's file with ``device=file`` (:func:`nvme_file`)."""
    explicit = options.get("_explicit", frozenset())
    return ReplayConfig(
        trace=options["trace"] or None,
        limit=options["number_ios"] or None,
        block_bytes=options["trace_block_size"],
        hbm_bytes=options["hbm_size"] if "hbm_size" in explicit else None,
        host_bytes=options["host_size"] if "host_size" in explicit else None,
        nvme_bytes=options["nvme_size"] if "nvme_size" in explicit else None,
        directory=options["directory"] or None,
        eviction=options["eviction"],
        time_scale=1.0 / options["time_scale"] if options["time_scale"] > 0 else 1.0,
        policies={"admission": options.get("admission", "none") or "none"},
        nvme_options=nvme_options(options, nvme_path),
    )


def nvme_file(options: dict[str, Any], directory: str) -> str:
    """The NVMe tier's file of a ``device=file`` KV job, by the plain jobs' rule
    (:func:`~tierstore.bench.jobfile.resolve_path`, fio's): ``filename`` (a relative one under the
    job's ``directory=``, else the working directory), else ``directory=/jobname.0.0``, else
    ``directory/jobname.0.0`` (``directory``: the job's private temporary directory).

    Raises
    ------
    ConfigError
        When the file already exists (a KV job starts from an empty tier; it
        never reuses or overwrites a file it did not create).
    """
    default = f"{options.get('name') or options['rw']}.0.0"
    path = resolve_path(options, default) or os.path.join(directory, default)
    if os.path.isdir(path):
        raise ConfigError(f"filename={path!r}: is a directory; the NVMe tier of device=file is a file")
    if os.path.exists(path):
        raise ConfigError(
            f"filename={path!r}: exists, and this job did not create it; a KV job's NVMe tier "
            "is always a new file (it never reuses or overwrites one, whatever format= says): "
            "choose another filename= or directory=. Nothing was written"
        )
    return path


def nvme_options(options: dict[str, Any], nvme_path: str | None = None) -> dict:
    """The NVMe tier's device, FTL model and placement from bench options:
    :class:`~tierstore.config.NvmeTierConfig` fields without the capacity (see module doc).

    ``nvme_path`` is the tier's file for ``device=file`` (:func:`nvme_file`).

    Raises
    ------
    ConfigError
        ``device=file`` with an ``ioengine`` that cannot hold a file tier.
    """
    explicit = options.get("_explicit", frozenset())
    dev_opt = str(options.get("device", "file"))
    fdp = {
        "enabled": options.get("dataplacement", "none") == "fdp",
        "plids": list(options.get("plids", ()) or ()),
    }
    model = {"op_fraction": options.get("op", 0.07), "utilization": float(options.get("utilization", 0.9))}
    if "ru_size" in explicit:
        model["ru_size_bytes"] = options["ru_size"]
    if dev_opt == "sim":
        ignored = [
            f"{k}={options[k]}"
            for k in ("ioengine", "directory", "filename")
            if k in explicit and options.get(k)
        ]
        if ignored:
            info(
                f"{options.get('name') or options['rw']}: device=sim keeps the NVMe tier in memory (the FTL "
                "model "
                f"is the device); {', '.join(ignored)} not used (device=file puts it in a file)"
            )
        if "device_size" in explicit:
            model["device_bytes"] = options["device_size"]
        return {"device": "sim", "engine": "memory", "model": model, "fdp": fdp}
    fmt_ok = bool(options.get("format", False))  # tierstore.io.label: formatting is an explicit choice
    if dev_opt != "file":
        return {"device": "fdp", "path": dev_opt, "fdp": fdp, "format": fmt_ok}
    eng = engine_kind(options.get("ioengine", "posix"))  # fio's names too: io_uring, libaio, psync, ...
    if eng not in ("posix", "uring", "auto"):
        raise ConfigError(
            f"ioengine={options.get('ioengine')}: device=file puts the NVMe tier in a file through "
            "posix, uring or auto (or fio's io_uring, libaio, psync, sync, pvsync, pvsync2, posixaio); "
            "use device=sim for a tier in memory"
        )
    out = {
        "device": "file",
        "engine": eng,
        "model": {k: v for k, v in model.items() if k != "utilization"},
        "fdp": fdp,
        "format": fmt_ok,
    }
    if nvme_path is not None:
        out["path"] = nvme_path
    if "ru_size" in explicit:
        out["segment_size_bytes"] = options["ru_size"]
    return out


def store_config(
    options: dict[str, Any],
    hbm_bytes: int,
    host_bytes: int,
    nvme_bytes: int,
    nvme_path: str | None,
    promotion: str = "top",
) -> StoreConfig:
    """The whole typed store config of a KV job (tiers sized by the caller)."""
    nvme = None
    if nvme_bytes:
        nvme = {"capacity_bytes": nvme_bytes, **nvme_options(options, nvme_path)}
    return StoreConfig.from_dict(
        {
            "tiers": {
                "hbm": {"capacity_bytes": hbm_bytes},
                "host": {"capacity_bytes": host_bytes},
                "nvme": nvme,
            },
            "policies": {
                "eviction": options["eviction"],
                "promotion": promotion,
                "admission": options.get("admission", "none") or "none",
            },
        },
        "bench store config",
    )


def no_space_report(stats: dict, nvme_path: str | None) -> tuple[dict, int, str]:
    """Blocks refused for lack of space, from :meth:`KVStore.stats` counters.

    Returns
    -------
    (dict, int, str)
        ``kv`` entries (``store_no_space_blocks``, ``demoted_no_space_blocks``,
        ``nvme_allocation_failures``), fio's ``error`` (ENOSPC when a segment
        could not be allocated, i.e. the file system was full; else 0) and the
        error message.
    """
    refused = int(stats.get("store_no_space", 0))
    demoted = int(stats.get("nvme_put_no_space", 0))
    backend = stats.get("nvme_backend") or {}
    alloc = int(backend.get("preallocate_errors", 0)) if isinstance(backend, dict) else 0
    kv = {
        "store_no_space_blocks": refused,
        "demoted_no_space_blocks": demoted,
        "nvme_allocation_failures": alloc,
    }
    if not alloc:
        return kv, 0, ""
    where = f" of {os.path.dirname(os.path.abspath(nvme_path))}" if nvme_path else ""
    return (
        kv,
        errno.ENOSPC,
        (
            f"the file system{where} ran out of space: {alloc} segment allocations failed; "
            f"{refused} stores and {demoted} demoted blocks were refused (NO_SPACE)"
        ),
    )


def run_kvtrace(options: dict[str, Any]) -> JobResult:
    """Runner of ``rw=kvtrace``: replay a trace and report fio-style figures.

    Without ``directory`` the NVMe tier's file (and the replay's scratch files) go to a private
    temporary directory, removed when the job ends however it ends, so runs at once never meet.

    Raises
    ------
    JobInterrupted
        After Ctrl-C/SIGTERM: the replay stops within 50 requests (it reports
        no partial statistics).
    """
    if "bs" in options.get("_explicit", ()):
        warn(
            f"bs={options['bs']}: not used by rw=kvtrace (each request moves the trace's blocks, "
            f"trace_block_size={options['trace_block_size']} B each)"
        )
    for key, why in (
        ("runtime", "the trace is replayed whole, or its first number_ios= requests"),
        ("size", "the tiers' sizes are hbm_size=, host_size= and nvme_size="),
    ):
        if key in options.get("_explicit", ()):
            warn(f"{key}={options[key]}: not used by rw=kvtrace; {why}")
    own_dir = None if options.get("directory") else tempfile.mkdtemp(prefix="tierstore-kv-")
    try:
        return _run_kvtrace(options, own_dir)
    finally:  # also after a failure, a stop request or a second Ctrl-C
        if own_dir is not None:
            remove_private_dir(options, own_dir)


def _trace_kv(rep, block_bytes: int, nvme: bool, files: list[str]) -> tuple[dict, int, str]:
    """``(kv section, error, error message)`` of a trace replay's result: the replay's counters, why
    matched blocks were not loaded, the NVMe tier's free-space report, the verdict and the I/O unit;
    wrong KV is fio's verify failure (EILSEQ)."""
    kv = dict(rep.kv)
    skipped = int(kv.get("hit_blocks", 0)) - int(kv.get("useful_blocks", 0))
    failed = int(kv.get("useful_blocks", 0)) - int(kv.get("loaded_blocks", 0))
    reasons = []
    if skipped > 0:
        reasons.append(
            f"{skipped} matched blocks were not loaded because the cost model judged recomputing them "
            "faster than loading them (the replay loads the useful prefix, as an engine does)"
        )
    if failed > 0:
        reasons.append(
            f"{failed} blocks failed to load (I/O error, or evicted before the load) and count as misses"
        )
    if reasons:
        kv["not_loaded_reason"] = "; ".join(reasons)
    error, message = 0, ""
    if nvme:
        space, error, message = no_space_report(rep.final_stats, files[0] if files else None)
        kv.update(space)
    kv["verdict"] = verdict(kv)
    kv["io_unit"] = (
        f"rw=kvtrace: one I/O is one trace block of {block_bytes} B (trace_block_size), the bs "
        "shown; each load/store call moves a request's blocks; the job's bs= is not used"
    )
    if kv.get("wrong_kv_blocks"):  # as fio's verify failure: EILSEQ, before any other error
        error, message = (
            errno.EILSEQ,
            (
                f"{kv['wrong_kv_blocks']} loaded blocks did not hold the bytes stored "
                "under their key (wrong KV)"
            ),
        )
    return kv, error, message


def _trace_device(rep) -> dict:
    """The device section of a trace replay's result: the device's counters, the NVMe tier's
    (``nvme_*``), bytes per PID and the WAF time series."""
    device = dict(rep.device) if rep.device else {}
    device.update({f"nvme_{k}": v for k, v in rep.store_stats.items() if isinstance(v, (int, float))})
    engine = rep.store_stats.get("engine") or (rep.store_stats.get("nvme_backend") or {}).get("engine") or {}
    if engine.get("bytes_by_placement"):  # bytes the store sent per PID ("none": no placement directive)
        device["bytes_by_pid"] = {str(k): int(v) for k, v in engine["bytes_by_placement"].items()}
    if "waf" in rep.timeseries:  # in the JSON (fio's output has no timeseries section) and the plots
        device["waf_timeseries"] = {"t_s": list(rep.timeseries["t_s"]), "waf": list(rep.timeseries["waf"])}
    return device


def _run_kvtrace(options: dict[str, Any], own_dir: str | None) -> JobResult:
    files: list[str] = []
    nvme_path = None
    if options.get("device", "file") == "file":
        nvme_path = nvme_file(options, own_dir or options["directory"])
        files.append(nvme_path)
    cfg = replay_config(options if own_dir is None else {**options, "directory": own_dir}, nvme_path)
    progress = current_progress()
    started = []

    def prog(done: int, total: int) -> None:
        if stop_requested():
            raise JobInterrupted(
                f"rw=kvtrace stopped after {done} of {total} requests; the replay reports "
                "statistics only for a whole run"
            )
        if not started:
            progress.start(total=total, unit="req")
            started.append(True)
        progress.update(done)

    box: list = []

    def on_open(store) -> None:  # a tier larger than the free space: build_store warns (one line)
        box.append(store)

    def on_sample(store, sample: dict) -> None:
        if store.ftl is not None:
            d = store.device_stats()
            sample["waf"] = d.get("waf", float("nan"))
            sample["e2e_wa"] = d.get("e2e_wa", float("nan"))

    cpu = CpuUsage()
    try:
        rep = run_replay(cfg, progress=prog, on_sample=on_sample, on_open=on_open)
    finally:
        if options.get("unlink", True):
            for path in files:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
    usage = cpu.stop()
    kv, error, message = _trace_kv(rep, cfg.block_bytes, bool(box and box[0].nvme is not None), files)
    device = _trace_device(rep)
    return JobResult(
        jobname=options.get("name") or "kvtrace",
        options={**options, "bs": cfg.block_bytes},  # one KV I/O = one trace block
        read=_direction(rep.load_lat_ns, rep.load_bytes, rep.load_wall_s, cfg.block_bytes),
        write=_direction(rep.store_lat_ns, rep.store_bytes, rep.store_wall_s, cfg.block_bytes),
        kv=kv,
        device=device,
        timeseries=rep.timeseries,
        error=error,
        error_message=message,
        usr_cpu=usage["usr_cpu"],
        sys_cpu=usage["sys_cpu"],
        runtime_s=rep.runtime_s,
        ctx=usage.get("ctx", 0),
        majf=usage.get("majf", 0),
        minf=usage.get("minf", 0),
    )


register_runner(["kvtrace"], run_kvtrace)
