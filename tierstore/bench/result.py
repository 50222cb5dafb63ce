"""The result model every benchmark runner returns.

A runner turns one job's typed options into a :class:`JobResult`. Per
direction it reports bytes, operations, run time and the raw per-operation
completion latencies (``clat_ns``); :mod:`tierstore.bench.output` derives
every fio statistic (percentiles, buckets, bandwidth and IOPS samples) from
them. :class:`DirectionRecorder` is the helper that collects those from the
runner's hot loop, thread-safely.

KV runners fill :attr:`JobResult.kv` and :attr:`JobResult.device` with flat
dicts whose keys carry their units (``_bytes``, ``_ns``, ``_s``) and
:attr:`JobResult.timeseries` with equally long lists keyed by ``t_s``,
``waf``, ``hbm_bytes``, ``host_bytes``, ``nvme_bytes`` (what ``--plot`` draws).
"""

from __future__ import annotations

import dataclasses
import itertools
import resource
import threading
import time
from typing import Any

import numpy as np

__all__ = [
    "DirectionResult",
    "JobResult",
    "DirectionRecorder",
    "CpuUsage",
    "SAMPLE_INTERVAL_S",
    "merge_directions",
    "merge_results",
]

#: fio's default bandwidth / IOPS sampling period (``bw_avg_time=500``, ``iops_avg_time=500``).
SAMPLE_INTERVAL_S = 0.5


def _empty_ns() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclasses.dataclass
class DirectionResult:
    """Statistics of one direction (read or write) of one job.

    Attributes
    ----------
    io_bytes : int
        Bytes transferred.
    ops : int
        Operations completed.
    runtime_s : float
        Wall time this direction was active, in seconds.
    clat_ns : numpy.ndarray
        Per-operation completion latency in ns (int64), one entry per op.
    slat_ns : numpy.ndarray
        Per-operation submission latency in ns; empty for synchronous engines
        (fio reports ``N=0`` then, too).
    iops_samples : list of float
        IOPS measured in each sampling interval (fio: every 500 ms), for
        ``iops_min/max/mean/stddev``.
    bw_samples_bytes_s : list of float
        Bandwidth in B/s measured in each sampling interval.
    short_ios : int
        Operations that transferred fewer bytes than asked.
    drop_ios : int
        Operations dropped (not completed).
    """

    io_bytes: int = 0
    ops: int = 0
    runtime_s: float = 0.0
    clat_ns: np.ndarray = dataclasses.field(default_factory=_empty_ns)
    slat_ns: np.ndarray = dataclasses.field(default_factory=_empty_ns)
    iops_samples: list[float] = dataclasses.field(default_factory=list)
    bw_samples_bytes_s: list[float] = dataclasses.field(default_factory=list)
    short_ios: int = 0
    drop_ios: int = 0


@dataclasses.dataclass
class JobResult:
    """Everything one job measured.

    Attributes
    ----------
    jobname : str
        The job's name.
    options : dict
        The typed job options the runner received.
    read, write : DirectionResult
        Per-direction statistics (an empty one for an unused direction).
    kv : dict
        KV-cache statistics, keys with units: at least ``lookup_hit_ratio``,
        ``useful_hit_ratio``, ``saved_prefill_tokens``, ``ideal_hit_ratio``,
        per-tier bytes (``hbm_bytes``, ``host_bytes``, ``nvme_bytes``) and
        ``load_lat_ns`` (a numpy array or list of per-load latencies in ns;
        the output turns it into fio-style percentiles). Empty for plain I/O jobs.
    device : dict
        Device / FTL statistics: ``hbmw_bytes`` (host bytes written),
        ``mbmw_bytes`` (media bytes written), ``mbe_bytes`` (media bytes erased),
        ``waf`` and ``ruh_bytes`` (``{ruh index: bytes}``). Empty when no device.
    timeseries : dict of str to list
        Equally long lists sampled over the run: ``t_s`` and any of ``waf``,
        ``hbm_bytes``, ``host_bytes``, ``nvme_bytes``.
    usr_cpu, sys_cpu : float
        User / system CPU time as a percentage of ``runtime_s`` (fio's meaning).
    runtime_s : float
        Wall time of the job in seconds.
    error : int
        0, or the errno of the first error (fio's ``error``; the normal output's
        ``err=``). A job with an error makes ``tierstore bench`` exit 1.
    error_message : str
        What failed, for the error line on stderr (fio's ``fio: pid=..., err=...,
        error=...``); empty without an error.
    ctx, majf, minf : int
        Context switches, major and minor page faults during the job.
    iodepth_level : dict, optional
        fio's ``IO depths`` distribution ``{"1": pct, ..., ">=64": pct}``;
        ``None`` derives 100% at the job's ``iodepth``.
    groupid : int
        fio's reporting group.
    """

    jobname: str
    options: dict[str, Any]
    read: DirectionResult = dataclasses.field(default_factory=DirectionResult)
    write: DirectionResult = dataclasses.field(default_factory=DirectionResult)
    kv: dict[str, Any] = dataclasses.field(default_factory=dict)
    device: dict[str, Any] = dataclasses.field(default_factory=dict)
    timeseries: dict[str, list] = dataclasses.field(default_factory=dict)
    usr_cpu: float = 0.0
    sys_cpu: float = 0.0
    runtime_s: float = 0.0
    error: int = 0
    error_message: str = ""
    ctx: int = 0
    majf: int = 0
    minf: int = 0
    iodepth_level: dict[str, float] | None = None
    groupid: int = 0


def _sum_samples(series: list[list[float]]) -> list[float]:
    """Element-wise sum of sample series that started together (a shorter one adds 0 after its end)."""
    return [sum(vals) for vals in itertools.zip_longest(*series, fillvalue=0.0)] if series else []


def merge_directions(parts: list[DirectionResult]) -> DirectionResult:
    """One direction of several jobs that ran at once, as fio's ``group_reporting`` sums them.

    Bytes, operations, short and dropped I/Os add up; the run time is the longest; the latencies
    are pooled; the IOPS and bandwidth samples (taken from each job's start) add up interval by
    interval.
    """
    used = [p for p in parts if p.ops]
    if not used:
        return DirectionResult()
    return DirectionResult(
        io_bytes=sum(p.io_bytes for p in used),
        ops=sum(p.ops for p in used),
        runtime_s=max(p.runtime_s for p in used),
        clat_ns=np.concatenate([p.clat_ns for p in used]),
        slat_ns=np.concatenate([p.slat_ns for p in used])
        if all(p.slat_ns.size for p in used)
        else _empty_ns(),
        iops_samples=_sum_samples([p.iops_samples for p in used]),
        bw_samples_bytes_s=_sum_samples([p.bw_samples_bytes_s for p in used]),
        short_ios=sum(p.short_ios for p in used),
        drop_ios=sum(p.drop_ios for p in used),
    )


def merge_results(results: list[JobResult]) -> JobResult:
    """Several jobs of one reporting group as one entry (fio's ``group_reporting``).

    The entry has the first job's name and the last job's options (as fio) and every job's I/O merged
    (:func:`merge_directions`); ``numjobs`` is the sum (fio's ``jobs=N``). The
    CPU figures are the largest member's: every job measures this whole process
    (``getrusage(RUSAGE_SELF)``), so they overlap rather than add. ``kv`` and
    ``device`` are per store and per file and are not merged (the CLI refuses
    to merge KV jobs): the entry's ``device`` says so when a member had one.
    The first error of a member is the entry's.

    Parameters
    ----------
    results : list of JobResult
        The members, in job order (at least one).

    Returns
    -------
    JobResult
    """
    first = results[0]
    if len(results) == 1:
        return first
    failed = [r for r in results if r.error]
    # fio shows the last member's options with the first member's name
    options = {**results[-1].options, "numjobs": sum(int(r.options.get("numjobs", 1)) for r in results)}
    device = {}
    if any(r.device for r in results):
        device = {
            "device": "not merged by group_reporting (one FTL model per job file); run without "
            "group_reporting to see each job's"
        }
    return JobResult(
        jobname=first.jobname,
        options=options,
        read=merge_directions([r.read for r in results]),
        write=merge_directions([r.write for r in results]),
        device=device,
        usr_cpu=max(r.usr_cpu for r in results),
        sys_cpu=max(r.sys_cpu for r in results),
        runtime_s=max(r.runtime_s for r in results),
        error=failed[0].error if failed else 0,
        error_message=failed[0].error_message if failed else "",
        ctx=max(r.ctx for r in results),
        majf=max(r.majf for r in results),
        minf=max(r.minf for r in results),
        groupid=first.groupid,
    )


class DirectionRecorder:
    """Thread-safe collector of one direction's completions.

    Call :meth:`record` once per completed operation from any thread (or
    :meth:`record_many` with a thread's whole log), then :meth:`result` once at
    the end. Completions before ``start_ns`` are not counted (fio's ``ramp_time``).

    Parameters
    ----------
    start_ns : int
        ``time.perf_counter_ns()`` when measuring starts (after ramp).
    sample_interval_s : float
        Period of the bandwidth / IOPS samples.
    """

    def __init__(self, start_ns: int, sample_interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self._lock = threading.Lock()
        self._start_ns = start_ns
        self._interval_ns = int(sample_interval_s * 1e9)
        self._lat: list[int] = []
        self._done: list[int] = []
        self._ops: list[int] = []
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._bytes = 0
        self._short = 0

    def record(self, nbytes: int, lat_ns: int, done_ns: int, short: bool = False, ops: int = 1) -> None:
        """Count one completed call.

        Parameters
        ----------
        nbytes : int
            Bytes it transferred.
        lat_ns : int
            Its completion latency in ns.
        done_ns : int
            ``time.perf_counter_ns()`` at completion.
        short : bool
            Whether it transferred fewer bytes than asked.
        ops : int
            I/Os it counts as (a KV call of 8 blocks is 8 block I/Os with one latency).
        """
        if done_ns < self._start_ns:
            return
        with self._lock:
            self._lat.append(lat_ns)
            self._done.append(done_ns)
            self._ops.append(ops)
            self._bytes += nbytes
            self._short += int(short)

    def record_many(
        self, lat_ns: np.ndarray, done_ns: np.ndarray, nbytes: np.ndarray, full_bytes: int
    ) -> None:
        """Count many completed I/Os of ``full_bytes`` each at once (one per entry).

        Parameters
        ----------
        lat_ns, done_ns, nbytes : numpy.ndarray
            int64, one entry per I/O: completion latency (ns), ``perf_counter_ns`` at
            completion, bytes transferred.
        full_bytes : int
            Bytes each I/O asked for; fewer is a short I/O.
        """
        keep = np.asarray(done_ns) >= self._start_ns
        lat = np.array(lat_ns, dtype=np.int64)[keep]
        done = np.array(done_ns, dtype=np.int64)[keep]
        moved = np.asarray(nbytes, dtype=np.int64)[keep]
        with self._lock:
            self._chunks.append((lat, done, np.ones(lat.size, dtype=np.int64)))
            self._bytes += int(moved.sum())
            self._short += int(np.count_nonzero(moved < full_bytes))

    def result(self, end_ns: int) -> DirectionResult:
        """Summarise everything recorded up to ``end_ns``.

        Parameters
        ----------
        end_ns : int
            ``time.perf_counter_ns()`` when measuring stopped.

        Returns
        -------
        DirectionResult
            ``ops`` counts I/Os (a call's ``ops``); ``clat_ns`` has one latency per call.
        """
        with self._lock:
            parts = [
                (
                    np.asarray(self._lat, dtype=np.int64),
                    np.asarray(self._done, dtype=np.int64),
                    np.asarray(self._ops, dtype=np.int64),
                ),
                *self._chunks,
            ]
            nbytes, short = self._bytes, self._short
        lat = np.concatenate([p[0] for p in parts])
        done = np.concatenate([p[1] for p in parts])
        weights = np.concatenate([p[2] for p in parts])
        ops = int(weights.sum())
        runtime_ns = max(end_ns - self._start_ns, 1)
        iops_samples: list[float] = []
        bw_samples: list[float] = []
        if lat.size:
            n_full = runtime_ns // self._interval_ns
            if n_full >= 1:
                idx = (done - self._start_ns) // self._interval_ns
                inside = idx < n_full
                counts = np.bincount(idx[inside], weights=weights[inside], minlength=n_full).astype(float)
                per_op_bytes = nbytes / ops if ops else 0.0
                iops_samples = list(counts / (self._interval_ns / 1e9))
                bw_samples = [c * per_op_bytes for c in iops_samples]
            else:  # shorter than one interval: a single sample over the whole run
                iops_samples = [ops / (runtime_ns / 1e9)]
                bw_samples = [nbytes / (runtime_ns / 1e9)]
        return DirectionResult(
            io_bytes=nbytes,
            ops=ops,
            runtime_s=runtime_ns / 1e9 if lat.size else 0.0,
            clat_ns=lat,
            iops_samples=iops_samples,
            bw_samples_bytes_s=bw_samples,
            short_ios=short,
        )


class CpuUsage:
    """Measures this process's CPU use over a job, as fio's ``cpu`` line.

    Examples
    --------
    >>> cpu = CpuUsage()
    >>> usage = cpu.stop()
    >>> sorted(usage)
    ['ctx', 'majf', 'minf', 'runtime_s', 'sys_cpu', 'usr_cpu']
    """

    def __init__(self) -> None:
        self._t0_s = time.perf_counter()
        self._r0 = resource.getrusage(resource.RUSAGE_SELF)

    def stop(self) -> dict[str, float]:
        """Return ``usr_cpu``/``sys_cpu`` (percent of wall time), ``ctx``, ``majf``, ``minf``,
        ``runtime_s``."""
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        wall_s = max(time.perf_counter() - self._t0_s, 1e-9)
        r0 = self._r0
        return {
            "usr_cpu": 100.0 * (r1.ru_utime - r0.ru_utime) / wall_s,
            "sys_cpu": 100.0 * (r1.ru_stime - r0.ru_stime) / wall_s,
            "ctx": (r1.ru_nvcsw - r0.ru_nvcsw) + (r1.ru_nivcsw - r0.ru_nivcsw),
            "majf": r1.ru_majflt - r0.ru_majflt,
            "minf": r1.ru_minflt - r0.ru_minflt,
            "runtime_s": wall_s,
        }
