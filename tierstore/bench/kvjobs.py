"""KV-cache workloads through the real tier manager.

``rw=kvtrace`` replays a Mooncake JSONL trace (:mod:`tierstore.replay`): the
``read`` direction is the loads of prefix hits (one op per request that loaded
blocks; latency = the whole load call), the ``write`` direction is the stores
of missed blocks (one op per request that stored). The ``kv`` section carries
hit ratios, saved prefill tokens and per-tier bytes; the ``device`` section the
NVMe backend's counters (and, with ``device=sim``, the FTL model's HBMW/MBMW/WAF).
"""
from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from ..replay import ReplayConfig, run_replay
from .registry import current_progress, register_runner
from .result import CpuUsage, DirectionResult, JobResult

__all__ = ["run_kvtrace"]


def _direction(lat_ns: np.ndarray, nbytes: int, wall_s: float) -> DirectionResult:
    return DirectionResult(io_bytes=int(nbytes), ops=int(lat_ns.size), runtime_s=max(wall_s, 1e-9),
                           clat_ns=lat_ns.astype(np.int64))


def replay_config(options: dict[str, Any]) -> ReplayConfig:
    """Map bench options onto a :class:`~tierstore.replay.ReplayConfig`."""
    explicit = options.get("_explicit", frozenset())
    return ReplayConfig(
        trace=options["trace"] or None,
        limit=options["number_ios"] or None,
        block_bytes=options["trace_block_size"],
        hbm_bytes=options["hbm_size"] if "hbm_size" in explicit else None,
        host_bytes=options["host_size"] if "host_size" in explicit else None,
        nvme_bytes=options["nvme_size"] if "nvme_size" in explicit else None,
        directory=options["directory"] or None,
        nvme_backend=options.get("nvme_backend", "segment"),
        eviction=options["eviction"],
        time_scale=1.0 / options["time_scale"] if options["time_scale"] > 0 else 1.0,
    )


def run_kvtrace(options: dict[str, Any]) -> JobResult:
    """Runner of ``rw=kvtrace``: replay a trace and report fio-style figures."""
    cfg = replay_config(options)
    progress = current_progress()
    started = []

    def prog(done: int, total: int) -> None:
        if not started:
            progress.start(total=total, unit="req")
            started.append(True)
        progress.update(done)

    cpu = CpuUsage()
    rep = run_replay(cfg, progress=prog)
    usage = cpu.stop()
    kv = dict(rep.kv)
    device = {f"nvme_{k}": v for k, v in rep.store_stats.items() if isinstance(v, (int, float))}
    return JobResult(
        jobname=options.get("name") or "kvtrace",
        options=options,
        read=_direction(rep.load_lat_ns, rep.load_bytes, rep.load_wall_s),
        write=_direction(rep.store_lat_ns, rep.store_bytes, rep.store_wall_s),
        kv=kv, device=device, timeseries=rep.timeseries,
        usr_cpu=usage["usr_cpu"], sys_cpu=usage["sys_cpu"], runtime_s=rep.runtime_s,
        ctx=usage.get("ctx", 0), majf=usage.get("majf", 0), minf=usage.get("minf", 0),
    )


register_runner(["kvtrace"], run_kvtrace)
