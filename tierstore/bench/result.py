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
import resource
import threading
import time
from typing import Any

import numpy as np

__all__ = ["DirectionResult", "JobResult", "DirectionRecorder", "CpuUsage", "SAMPLE_INTERVAL_S"]

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


class DirectionRecorder:
    """Thread-safe collector of one direction's completions.

    Call :meth:`record` once per completed operation from any thread, then
    :meth:`result` once at the end. Completions before ``ramp_end_ns`` are
    not counted (fio's ``ramp_time``).

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
        self._bytes = 0
        self._short = 0

    def record(self, nbytes: int, lat_ns: int, done_ns: int, short: bool = False) -> None:
        """Count one completed operation.

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
        """
        if done_ns < self._start_ns:
            return
        with self._lock:
            self._lat.append(lat_ns)
            self._done.append(done_ns)
            self._bytes += nbytes
            self._short += int(short)

    def result(self, end_ns: int) -> DirectionResult:
        """Summarise everything recorded up to ``end_ns``.

        Parameters
        ----------
        end_ns : int
            ``time.perf_counter_ns()`` when measuring stopped.

        Returns
        -------
        DirectionResult
        """
        with self._lock:
            lat = np.asarray(self._lat, dtype=np.int64)
            done = np.asarray(self._done, dtype=np.int64)
            nbytes, short = self._bytes, self._short
        runtime_ns = max(end_ns - self._start_ns, 1)
        iops_samples: list[float] = []
        bw_samples: list[float] = []
        if lat.size:
            n_full = runtime_ns // self._interval_ns
            if n_full >= 1:
                idx = (done - self._start_ns) // self._interval_ns
                idx = idx[idx < n_full]
                counts = np.bincount(idx, minlength=n_full).astype(float)
                per_op_bytes = nbytes / lat.size
                iops_samples = list(counts / (self._interval_ns / 1e9))
                bw_samples = [c * per_op_bytes for c in iops_samples]
            else:  # shorter than one interval: a single sample over the whole run
                iops_samples = [lat.size / (runtime_ns / 1e9)]
                bw_samples = [nbytes / (runtime_ns / 1e9)]
        return DirectionResult(io_bytes=nbytes, ops=int(lat.size), runtime_s=runtime_ns / 1e9 if lat.size else 0.0,
                               clat_ns=lat, iops_samples=iops_samples, bw_samples_bytes_s=bw_samples,
                               short_ios=short)


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
        """Return ``usr_cpu``/``sys_cpu`` (percent of wall time), ``ctx``, ``majf``, ``minf``, ``runtime_s``."""
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
