"""Plain fio-like I/O jobs: ``rw=read|write|randread|randwrite``.

Each job runs ``numjobs * iodepth`` threads, each issuing one synchronous
``os.preadv``/``os.pwritev`` at a time from its own page-aligned ``mmap``
buffer, on a file opened with ``O_DIRECT`` (``direct=1``, the default). That
keeps ``iodepth`` requests in flight per clone, like fio's ``psync`` engine
run with ``iodepth`` threads. ``ioengine=memory`` does the same against an
in-memory buffer (no file, no device). The ``numjobs`` clones are reported
as one job (fio's ``group_reporting``).

Completion latency of every operation is measured with
:func:`time.perf_counter_ns` around the system call.
"""
from __future__ import annotations

import mmap
import os
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np

from ..errors import ConfigError
from .jobfile import resolve_path
from .registry import current_progress, register_runner
from .result import CpuUsage, DirectionRecorder, DirectionResult, JobResult

__all__ = ["run_io_job", "IO_RW"]

#: The workloads this module runs.
IO_RW = ("read", "write", "randread", "randwrite")
_DIRECT_ALIGN_BYTES = 4096
_PROGRESS_POLL_S = 0.1


class _FileTarget:
    """A file or block device opened for positional I/O."""

    def __init__(self, path: str, size_bytes: int, direct: bool, create: bool, fill: bool) -> None:
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        if fill:
            self._layout(path, size_bytes)
        if direct:
            flags |= getattr(os, "O_DIRECT", 0)
        try:
            self.fd = os.open(path, flags, 0o644)
        except OSError as exc:
            hint = " (the filesystem may not support O_DIRECT; try direct=0)" if direct else ""
            raise ConfigError(f"filename={path!r}: cannot open: {exc.strerror}{hint}") from None

    @staticmethod
    def _layout(path: str, size_bytes: int) -> None:
        """Write the file out to ``size_bytes`` (fio's layout step) so reads hit real blocks."""
        have = os.path.getsize(path) if os.path.exists(path) else 0
        if have >= size_bytes:
            return
        chunk = np.random.default_rng(0).integers(0, 256, size=1 << 20, dtype=np.uint8).tobytes()
        with open(path, "r+b" if have else "wb") as fh:
            fh.seek(have)
            left = size_bytes - have
            while left > 0:
                n = min(left, len(chunk))
                fh.write(chunk[:n])
                left -= n
            fh.flush()
            os.fsync(fh.fileno())

    def read(self, buf: mmap.mmap, offset: int) -> int:
        return os.preadv(self.fd, [buf], offset)

    def write(self, buf: mmap.mmap, offset: int) -> int:
        return os.pwritev(self.fd, [buf], offset)

    def close(self) -> None:
        os.close(self.fd)


class _MemoryTarget:
    """``ioengine=memory``: copies to and from an anonymous mapping."""

    def __init__(self, size_bytes: int) -> None:
        self._mem = mmap.mmap(-1, size_bytes)
        self._view = memoryview(self._mem)

    def read(self, buf: mmap.mmap, offset: int) -> int:
        n = len(buf)
        buf[:n] = self._view[offset:offset + n]
        return n

    def write(self, buf: mmap.mmap, offset: int) -> int:
        n = len(buf)
        self._view[offset:offset + n] = buf
        return n

    def close(self) -> None:
        self._view.release()
        self._mem.close()


def _validate(options: dict[str, Any]) -> None:
    bs, size = options["bs"], options["size"]
    if size < bs:
        raise ConfigError(f"size={size}: must be at least bs={bs}")
    if options["direct"] and options["ioengine"] != "memory" and bs % _DIRECT_ALIGN_BYTES:
        raise ConfigError(f"bs={bs}: with direct=1 it must be a multiple of {_DIRECT_ALIGN_BYTES}")
    if options["time_based"] and not options["runtime"]:
        raise ConfigError("time_based=1: needs runtime > 0")
    if options["ioengine"] not in ("posix", "memory"):
        raise ConfigError(f"ioengine={options['ioengine']!r}: the plain rw={options['rw']} runner supports "
                          "['posix', 'memory'] until tierstore.io's engines are wired in")


def run_io_job(options: dict[str, Any]) -> JobResult:
    """Run one plain I/O job (``rw`` in :data:`IO_RW`).

    Parameters
    ----------
    options : dict
        Typed job options (:data:`tierstore.bench.jobfile.SCHEMA`). Uses ``rw``,
        ``bs``, ``size``, ``iodepth``, ``numjobs``, ``runtime``, ``time_based``,
        ``ramp_time``, ``ioengine`` (posix or memory), ``direct``, ``directory``,
        ``filename`` and ``seed``.

    Returns
    -------
    JobResult
        One direction filled (read or write), with per-op completion latencies.

    Raises
    ------
    ConfigError
        For options this runner cannot honour, or a file it cannot open.
    """
    _validate(options)
    rw, bs, size = options["rw"], options["bs"], options["size"]
    iodepth, numjobs = options["iodepth"], options["numjobs"]
    is_write = rw in ("write", "randwrite")
    is_random = rw.startswith("rand")
    span_blocks = size // bs

    tmpdir = None
    if options["ioengine"] == "memory":
        target: Any = _MemoryTarget(span_blocks * bs)
    else:
        path = resolve_path(options, f"{options['name']}.0.0")
        if not path:
            tmpdir = tempfile.TemporaryDirectory(prefix="tierstore-bench-")
            path = os.path.join(tmpdir.name, f"{options['name']}.0.0")
        is_dev = path.startswith("/dev/")
        target = _FileTarget(path, span_blocks * bs, options["direct"], create=not is_dev,
                             fill=not is_dev and not is_write)

    ramp_ns = int(options["ramp_time"] * 1e9)
    runtime_ns = int(options["runtime"] * 1e9)
    limit_bytes = None if options["time_based"] else span_blocks * bs * numjobs
    cpu = CpuUsage()
    t0_ns = time.perf_counter_ns()
    recorder = DirectionRecorder(start_ns=t0_ns + ramp_ns)
    deadline_ns = t0_ns + ramp_ns + runtime_ns if runtime_ns else None
    lock = threading.Lock()
    state = {"issued_bytes": 0, "cursors": [0] * numjobs}
    errors: list[BaseException] = []
    finished_ns: list[int] = []
    stop = threading.Event()
    op: Callable[[mmap.mmap, int], int] = target.write if is_write else target.read

    def next_offset(clone: int, rng: np.random.Generator) -> int | None:
        with lock:
            if limit_bytes is not None and state["issued_bytes"] >= limit_bytes:
                return None
            state["issued_bytes"] += bs
            if is_random:
                return int(rng.integers(0, span_blocks)) * bs
            block = state["cursors"][clone]
            state["cursors"][clone] = (block + 1) % span_blocks
            return block * bs

    def worker(clone: int, lane: int) -> None:
        rng = np.random.default_rng([options["seed"], clone, lane])
        buf = mmap.mmap(-1, bs)
        if is_write:
            buf[:] = rng.integers(0, 256, size=bs, dtype=np.uint8).tobytes()
        try:
            while not stop.is_set():
                offset = next_offset(clone, rng)
                if offset is None:
                    return
                start = time.perf_counter_ns()
                n = op(buf, offset)
                done = time.perf_counter_ns()
                recorder.record(n, done - start, done, short=n < bs)
                if deadline_ns is not None and done >= deadline_ns:
                    return
        except OSError as exc:
            errors.append(exc)
            stop.set()
        finally:
            finished_ns.append(time.perf_counter_ns())
            buf.close()

    threads = [threading.Thread(target=worker, args=(c, d), name=f"{options['name']}-{c}.{d}", daemon=True)
               for c in range(numjobs) for d in range(iodepth)]
    progress = current_progress()
    if deadline_ns is not None:
        progress.start(total=(ramp_ns + runtime_ns) / 1e9, unit="s")
    else:
        progress.start(total=float(limit_bytes), unit="B")
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(_PROGRESS_POLL_S)
                if deadline_ns is not None:
                    progress.update((time.perf_counter_ns() - t0_ns) / 1e9)
                else:
                    progress.update(float(state["issued_bytes"]))
    finally:
        stop.set()
        for t in threads:
            t.join()
        end_ns = max(finished_ns) if finished_ns else time.perf_counter_ns()
        usage = cpu.stop()
        target.close()
        if tmpdir is not None:
            tmpdir.cleanup()
    if errors:
        exc = errors[0]
        raise ConfigError(f"rw={rw}: I/O failed: {exc}") from exc
    measured = recorder.result(end_ns)
    empty = DirectionResult()
    return JobResult(jobname=options["name"], options=options,
                     read=empty if is_write else measured, write=measured if is_write else empty,
                     usr_cpu=usage["usr_cpu"], sys_cpu=usage["sys_cpu"], runtime_s=(end_ns - t0_ns - ramp_ns) / 1e9,
                     ctx=int(usage["ctx"]), majf=int(usage["majf"]), minf=int(usage["minf"]))


register_runner(IO_RW, run_io_job)
