"""Plain fio-like I/O jobs: ``rw=read|write|randread|randwrite``.

Each job runs ``numjobs * iodepth`` threads, each keeping one request in
flight at a time from its own page-aligned buffer through a
:mod:`tierstore.io` engine (``open_engine(ioengine, ...)``; O_DIRECT), i.e.
``engine.write(offset, buf, placement).get()``. That keeps ``iodepth``
requests in flight per clone. ``ioengine=memory`` needs no file and no
device. ``direct=0`` uses buffered ``os.preadv``/``os.pwritev`` on the file
instead (the engines are O_DIRECT only). The ``numjobs`` clones are reported
as one job (fio's ``group_reporting``).

Where the bytes go (``device=``, the same three choices as the KV jobs):

* ``file`` (default): the job's file, ``directory``/``filename`` (fio's
  ``jobname.0.0``; a temporary directory when neither is set), through
  ``ioengine``. Completed writes are also fed to an FTL model
  (:class:`tierstore.fdp.ftl.FTLModel`) as an I/O observer, so write jobs
  report HBMW/MBMW/MBE and WAF over time; that is a *model*, not the device
  under this file system. The model's logical capacity is ``size /
  utilization`` (the job's file covers ``utilization`` of the modelled device).
* ``sim``: the FTL model *is* the device: the data stays in memory (memory
  engine); ``ioengine``/``directory``/``filename`` are not used (a line says so).
* ``/dev/ngXnY``: a real FDP namespace (the default ``filename``); placed
  writes by NVMe passthrough. Not verified on hardware.

Writes are tagged with a placement ID when ``dataplacement=fdp``: ``plids``
are indices into the device's RUH Status list, as fio's (``plids=0,1,2`` on a
namespace whose RUH Status lists 0x0, 0x4000, 0x1 writes those three PIDs), and
an index beyond the list is refused before anything is written. On the model
(``device=file``/``sim``) the list is the model's: 8 RUHs in one reclaim group
(PIDs 0..7). The entries are picked per ``plid_select`` (``roundrobin`` per
write, ``random``, or ``lifetime``: one per clone).

Files: before writing anything the job checks that its file fits the free
space of its file system (statvfs) and refuses otherwise; a read job lays its
file out first (fio's ``Laying out IO file`` line). Files the job created are
removed when it ends, also after Ctrl-C or SIGTERM, unless ``unlink=0``.

Failures: any failure of a worker (an I/O error, a bug) stops the job; the
result carries fio's ``error`` (the errno; ``EIO`` when there is none) and the
statistics up to then, and ``tierstore bench`` exits 1.

Completion latency of every operation is measured with
:func:`time.perf_counter_ns` from submission to completion.
"""
from __future__ import annotations

import errno
import os
import stat
import tempfile
import threading
import time
from typing import Any, Callable

import numpy as np
import torch

from ..errors import ConfigError, TierStoreError
from ..io.engine import alloc_aligned
from .jobfile import resolve_path
from .registry import current_progress, info, register_runner, stop_requested
from .result import CpuUsage, DirectionRecorder, DirectionResult, JobResult

__all__ = ["run_io_job", "IO_RW"]

#: The workloads this module runs.
IO_RW = ("read", "write", "randread", "randwrite")
_DIRECT_ALIGN_BYTES = 4096
_PROGRESS_POLL_S = 0.1
_DEVICE_SAMPLE_S = 0.25
_GC_SPARE_RUS = 5
#: RUHs of the FTL model a plain job writes to (the RUH Status ``plids`` index), as ``device=sim``'s default.
_MODEL_RUHS = 8


def _free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still allocate on the file system of ``path`` (statvfs(3))."""
    st = os.statvfs(os.path.dirname(os.path.abspath(path)) or ".")
    return st.f_bavail * st.f_frsize


def _check_space(options: dict[str, Any], path: str, size_bytes: int) -> None:
    """Refuse a job whose file would not fit the free space of its file system.

    fio finds out while laying the file out (``No space left on device on laying
    out file, stopping``), after filling the disk; this checks first, from
    statvfs, and writes nothing.

    Raises
    ------
    NoSpaceForJob
        When the bytes still to allocate exceed the free space.
    """
    have = os.path.getsize(path) if os.path.exists(path) else 0
    need = max(0, size_bytes - have)
    free = _free_bytes(path)
    if need > free:
        raise NoSpaceForJob(f"size={options['size']} bytes: the file {path} needs {need} more "
                            f"bytes ({need / 2**30:.1f} GiB) but its file system has {free} bytes "
                            f"({free / 2**30:.1f} GiB) free; nothing was written. Choose a smaller size= "
                            "or another directory=")


def _layout(name: str, path: str, size_bytes: int) -> None:
    """Write the file out to ``size_bytes`` (fio's layout step) so reads hit real blocks.

    Prints fio's ``Laying out IO file`` line first; stops early (leaving a
    partial file for the caller to remove) when a stop is requested.
    """
    have = os.path.getsize(path) if os.path.exists(path) else 0
    if have >= size_bytes:
        return
    info(f"{name}: Laying out IO file (1 file / {size_bytes >> 20}MiB)")
    chunk = np.random.default_rng(0).integers(0, 256, size=1 << 20, dtype=np.uint8).tobytes()
    with open(path, "r+b" if have else "wb") as fh:
        fh.seek(have)
        left = size_bytes - have
        while left > 0 and not stop_requested():
            n = min(left, len(chunk))
            fh.write(chunk[:n])
            left -= n
        fh.flush()
        os.fsync(fh.fileno())


def _bytes_view(buf: Any) -> memoryview:
    """A writable byte view of a CPU ``uint8`` tensor (``os.preadv``/``os.pwritev`` take buffers, not tensors)."""
    if isinstance(buf, torch.Tensor):
        return memoryview(buf.numpy()).cast("B")
    return memoryview(buf).cast("B")


class _BufferedTarget:
    """``direct=0``: buffered positional I/O on a file (page cache; the :mod:`tierstore.io`
    engines are O_DIRECT only). ``observer`` (the FTL model) sees every completed write."""

    observer: Any = None

    def __init__(self, path: str) -> None:
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise ConfigError(f"filename={path!r}: cannot open: {exc.strerror}") from None

    def read(self, buf: Any, offset: int) -> int:
        return os.preadv(self.fd, [_bytes_view(buf)], offset)

    def write(self, buf: Any, offset: int, placement: int | None) -> int:
        n = os.pwritev(self.fd, [_bytes_view(buf)], offset)
        if self.observer is not None and n:
            self.observer.on_write(offset, n, placement)
        return n

    def close(self) -> None:
        os.close(self.fd)


def _is_nvme_generic(path: str) -> bool:
    """``/dev/ngXnY``: an NVMe generic character device (I/O passthrough only)."""
    return os.path.basename(path).startswith("ng") and os.path.exists(path) and \
        stat.S_ISCHR(os.stat(path).st_mode)


class _PassthroughTarget:
    """``/dev/ngXnY``: placed writes by NVMe passthrough (``IORING_OP_URING_CMD``), reads on the
    matching ``/dev/nvmeXnY`` (:class:`tierstore.fdp.device.PassthroughEngine`). Not verified on hardware."""

    def __init__(self, path: str, size_bytes: int, options: dict[str, Any]) -> None:
        from ..fdp.device import PassthroughEngine, discover_namespace
        ns = discover_namespace(path)      # the discovery the library and the daemon use
        placed = options["dataplacement"] == "fdp"
        if placed:
            ns.require_fdp()
        if size_bytes > ns.size_bytes:
            raise ConfigError(f"size={size_bytes}: the namespace {path} has {ns.size_bytes} bytes")
        #: the namespace's PIDs; plids index it (checked before any write)
        self.pid_table = ns.pid_table if ns.info.fdp_enabled else None
        self.pids = self.pid_table.pids_at(options["plids"]) if placed else []
        self.engine = PassthroughEngine(ns.char_dev, size_bytes, ns.nsid, ns.lba_bytes, pid_table=self.pid_table,
                                        max_transfer_bytes=ns.max_transfer_bytes)

    def read(self, buf: Any, offset: int) -> int:
        return self.engine.read(offset, buf).get()

    def write(self, buf: Any, offset: int, placement: int | None) -> int:
        return self.engine.write(offset, buf, placement).get()

    def close(self) -> None:
        self.engine.close()


class _EngineTarget:
    """A :mod:`tierstore.io` engine; each call waits for its own future."""

    def __init__(self, kind: str, path: str | None, size_bytes: int, iodepth: int) -> None:
        from ..io import open_engine
        try:
            self.engine = open_engine(kind, path, size_bytes, iodepth=iodepth)
        except OSError as exc:
            if isinstance(exc, TierStoreError):   # e.g. IoUringUnavailable: its message says why
                raise
            hint = " (the filesystem may refuse O_DIRECT, e.g. tmpfs: try direct=0)" if exc.errno == errno.EINVAL else ""
            raise ConfigError(f"filename={path!r}: cannot open with ioengine={kind}: {exc.strerror}{hint}") from None

    def read(self, buf: Any, offset: int) -> int:
        return self.engine.read(offset, buf).get()

    def write(self, buf: Any, offset: int, placement: int | None) -> int:
        return self.engine.write(offset, buf, placement).get()

    def close(self) -> None:
        self.engine.close()


class _LockedObserver:
    """Serialises engine completions (from many threads) into the FTL model."""

    def __init__(self, ftl: Any) -> None:
        self.ftl = ftl
        self.lock = threading.Lock()

    def on_write(self, offset_bytes: int, nbytes: int, placement: int | None) -> None:
        with self.lock:
            self.ftl.on_write(offset_bytes, nbytes, placement)

    def on_trim(self, offset_bytes: int, nbytes: int) -> None:
        with self.lock:
            self.ftl.on_trim(offset_bytes, nbytes)

    def stats(self) -> dict[str, Any]:
        with self.lock:
            return self.ftl.stats()


def _make_ftl(options: dict[str, Any], span_bytes: int) -> tuple[Any, dict[str, Any]]:
    """The FTL model standing in for ``device=sim`` and the geometry it was given."""
    from ..fdp.ftl import FTLModel
    page_bytes = min(64 << 10, 1 << (min(options["bs"], 64 << 10).bit_length() - 1))
    capacity = -(-int(span_bytes / max(options["utilization"], 0.01)) // page_bytes) * page_bytes
    num_ruh = _MODEL_RUHS
    op = max(options["op"], 0.01)
    # The spare capacity must hold every stream's open RU plus GC's free RUs
    # (gc_free_ru_min=3) and one more; shrink the RU on small spans so it does.
    ru_fit = int(capacity * op / (num_ruh + _GC_SPARE_RUS)) // page_bytes * page_bytes
    ru = max(page_bytes, min(options["ru_size"], ru_fit))
    capacity = -(-capacity // ru) * ru
    ftl = FTLModel(capacity, ru, op, num_ruh=num_ruh, page_bytes=page_bytes)
    return ftl, {"capacity_bytes": capacity, "ru_size_bytes": ru, "page_bytes": page_bytes,
                 "op": op}


def _validate(options: dict[str, Any]) -> None:
    bs, size = options["bs"], options["size"]
    if size < bs:
        raise ConfigError(f"size={size}: must be at least bs={bs}")
    if options["ioengine"] != "memory" and options["direct"] and bs % _DIRECT_ALIGN_BYTES:
        raise ConfigError(f"bs={bs}: with direct=1 it must be a multiple of {_DIRECT_ALIGN_BYTES}")
    if options["ioengine"] == "memory" and bs % _DIRECT_ALIGN_BYTES:
        raise ConfigError(f"bs={bs}: ioengine=memory keeps O_DIRECT rules; use a multiple of {_DIRECT_ALIGN_BYTES}")
    if options["time_based"] and not options["runtime"]:
        raise ConfigError("time_based=1: needs runtime > 0")
    if not options["direct"] and options["ioengine"] != "posix":
        raise ConfigError(f"direct=0: only ioengine=posix supports buffered I/O, not {options['ioengine']!r}")
    if options["dataplacement"] == "fdp" and not options["plids"]:
        raise ConfigError("dataplacement=fdp: needs plids, e.g. plids=0,1,2")


def _placement_picker(options: dict[str, Any], plids: list[int]
                      ) -> Callable[[int, int, np.random.Generator], int | None]:
    """Per write, the PID: ``plids`` are the PIDs the job's plids index (fio's ``dp_fill_dspec_data``)."""
    if options["dataplacement"] != "fdp":
        return lambda clone, seq, rng: None
    select = options["plid_select"]
    if select == "random":
        return lambda clone, seq, rng: plids[int(rng.integers(0, len(plids)))]
    if select == "lifetime":  # one stream per clone: data of a clone lives and dies together
        return lambda clone, seq, rng: plids[clone % len(plids)]
    return lambda clone, seq, rng: plids[seq % len(plids)]


def _device_mode(options: dict[str, Any]) -> str:
    """``file``, ``sim`` or ``device`` from ``device=`` (see :mod:`tierstore.bench.jobfile`)."""
    dev = options["device"]
    return dev if dev in ("file", "sim") else "device"


def _resolve_target(options: dict[str, Any]) -> tuple[str, str | None]:
    """``(ioengine, path)`` of a plain job: ``device=sim`` keeps the bytes in memory (the FTL
    model is the device), ``device=/dev/ngXnY`` is the default ``filename``."""
    explicit = options.get("_explicit", frozenset())
    mode = _device_mode(options)
    engine = options["ioengine"]
    if mode == "sim":
        ignored = [f"{k}={options[k]}" for k in ("ioengine", "directory", "filename")
                   if k in explicit and options[k] and not (k == "ioengine" and options[k] == "memory")]
        if ignored:
            info(f"{options['name']}: device=sim keeps the data in memory (the FTL model is the device); "
                 f"{', '.join(ignored)} not used (device=file writes a file)")
        return "memory", None
    if engine == "memory":
        return "memory", None
    if mode == "device" and not options["filename"]:
        return engine, options["device"]
    return engine, resolve_path(options, f"{options['name']}.0.0") or None


def run_io_job(options: dict[str, Any]) -> JobResult:
    """Run one plain I/O job (``rw`` in :data:`IO_RW`).

    Parameters
    ----------
    options : dict
        Typed job options (:data:`tierstore.bench.jobfile.SCHEMA`). Uses ``rw``,
        ``bs``, ``size``, ``iodepth``, ``numjobs``, ``runtime``, ``time_based``,
        ``ramp_time``, ``ioengine``, ``direct``, ``directory``, ``filename``,
        ``unlink``, ``dataplacement``, ``plids``, ``plid_select``, ``device``,
        ``ru_size``, ``op``, ``utilization`` and ``seed``.

    Returns
    -------
    JobResult
        One direction filled (read or write) with per-op completion latencies;
        for writes also ``device`` (the FTL model's figures) and ``timeseries``.
        A failed I/O (or any failure of a worker) ends the job: ``error`` is
        its errno (``EIO`` for a failure that has none) and ``error_message``
        says what failed; the statistics cover the I/Os done until then.

    Raises
    ------
    ConfigError
        For options this runner cannot honour, or a file it cannot open.
    NoSpaceForJob
        When the job's file would not fit its file system (checked before writing).
    """
    _validate(options)
    rw, bs = options["rw"], options["bs"]
    iodepth, numjobs = options["iodepth"], options["numjobs"]
    is_write = rw in ("write", "randwrite")
    is_random = rw.startswith("rand")
    span_blocks = options["size"] // bs
    span_bytes = span_blocks * bs
    engine_kind, path = _resolve_target(options)
    if not options["direct"] and engine_kind == "memory":
        raise ConfigError("direct=0: buffered I/O needs a file (device=file, ioengine=posix)")

    tmpdir = None
    created = False
    target: Any = None
    try:
        if engine_kind != "memory":
            if not path:
                tmpdir = tempfile.TemporaryDirectory(prefix="tierstore-bench-")
                path = os.path.join(tmpdir.name, f"{options['name']}.0.0")
            if path.startswith("/dev/"):
                # never create or fill a regular file under /dev: only existing block/char devices
                try:
                    st_mode = os.stat(path).st_mode
                except FileNotFoundError:
                    raise ConfigError(f"filename={path!r}: no such device (this job needs a real NVMe "
                                      "namespace; the development host has none)") from None
                if not (stat.S_ISBLK(st_mode) or stat.S_ISCHR(st_mode)):
                    raise ConfigError(f"filename={path!r}: not a block or character device")
            else:
                _check_space(options, path, span_bytes)
                created = not os.path.exists(path)
                if not is_write:
                    _layout(options["name"], path, span_bytes)
        if path is not None and _is_nvme_generic(path):
            target = _PassthroughTarget(path, span_bytes, options)
        elif options["direct"] or engine_kind == "memory":
            target = _EngineTarget(engine_kind, path, span_bytes, iodepth * numjobs)
        else:
            target = _BufferedTarget(path)
        return _run(options, target, span_blocks, span_bytes, is_write, is_random, engine_kind, path)
    finally:
        if target is not None:
            target.close()
        if created and options.get("unlink", True) and path is not None:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        if tmpdir is not None:
            tmpdir.cleanup()


def _run(options: dict[str, Any], target: Any, span_blocks: int, span_bytes: int, is_write: bool,
         is_random: bool, engine_kind: str, path: str | None) -> JobResult:
    bs = options["bs"]
    iodepth, numjobs = options["iodepth"], options["numjobs"]
    observer = None
    device_geometry: dict[str, Any] = {}
    if is_write and _device_mode(options) in ("file", "sim"):
        ftl, device_geometry = _make_ftl(options, span_bytes)
        observer = _LockedObserver(ftl)
        if isinstance(target, _EngineTarget):
            target.engine.add_observer(observer)
        elif isinstance(target, _BufferedTarget):
            target.observer = observer
    pids: list[int] = []
    if is_write and options["dataplacement"] == "fdp":
        if isinstance(target, _PassthroughTarget):
            pids = target.pids
        elif observer is not None:   # the model's RUH Status, through the same PID table as a device's
            from ..fdp.simdevice import SimFdpDevice
            pids = SimFdpDevice(observer.ftl).pid_table().pids_at(options["plids"])
        else:
            raise ConfigError(f"dataplacement=fdp: {path} is not an NVMe generic character device; placed "
                              "writes need /dev/ngXnY (the posix and uring engines cannot place writes)")
    pick_placement = _placement_picker(options, pids)

    ramp_ns = int(options["ramp_time"] * 1e9)
    runtime_ns = int(options["runtime"] * 1e9)
    limit_bytes = None if options["time_based"] else span_bytes * numjobs
    cpu = CpuUsage()
    t0_ns = time.perf_counter_ns()
    recorder = DirectionRecorder(start_ns=t0_ns + ramp_ns)
    deadline_ns = t0_ns + ramp_ns + runtime_ns if runtime_ns else None
    lock = threading.Lock()
    state = {"issued_bytes": 0, "seq": 0, "cursors": [0] * numjobs}
    errors: list[tuple[BaseException, int]] = []
    finished_ns: list[int] = []
    stop = threading.Event()

    def next_offset(clone: int, rng: np.random.Generator) -> tuple[int, int] | None:
        with lock:
            if limit_bytes is not None and state["issued_bytes"] >= limit_bytes:
                return None
            state["issued_bytes"] += bs
            state["seq"] += 1
            if is_random:
                return int(rng.integers(0, span_blocks)) * bs, state["seq"]
            block = state["cursors"][clone]
            state["cursors"][clone] = (block + 1) % span_blocks
            return block * bs, state["seq"]

    def worker(clone: int, lane: int) -> None:
        rng = np.random.default_rng([options["seed"], clone, lane])
        keep, buf = alloc_aligned(bs)
        offset = -1
        if is_write:
            buf.copy_(torch.from_numpy(rng.integers(0, 256, size=bs, dtype=np.uint8)))
        try:
            while not stop.is_set():
                nxt = next_offset(clone, rng)
                if nxt is None:
                    return
                offset, seq = nxt
                if is_write:
                    placement = pick_placement(clone, seq, rng)
                    start = time.perf_counter_ns()
                    n = target.write(buf, offset, placement)
                else:
                    start = time.perf_counter_ns()
                    n = target.read(buf, offset)
                done = time.perf_counter_ns()
                recorder.record(n, done - start, done, short=n < bs)
                if deadline_ns is not None and done >= deadline_ns:
                    return
        except Exception as exc:  # any failure ends the job with err= set (fio: td_verror)
            with lock:
                errors.append((exc, offset))
            stop.set()
        finally:
            finished_ns.append(time.perf_counter_ns())
            del buf
            keep.close()

    threads = [threading.Thread(target=worker, args=(c, d), name=f"{options['name']}-{c}.{d}", daemon=True)
               for c in range(numjobs) for d in range(iodepth)]
    progress = current_progress()
    progress.io_dir = "w" if is_write else "r"
    if deadline_ns is not None:
        progress.start(total=(ramp_ns + runtime_ns) / 1e9, unit="s")
    else:
        progress.start(total=float(limit_bytes), unit="B")
    series: dict[str, list] = {"t_s": [], "waf": [], "hbmw_bytes": [], "mbmw_bytes": []}

    def sample_device() -> None:
        if observer is None:
            return
        st = observer.stats()
        if st["hbmw_bytes"]:
            series["t_s"].append((time.perf_counter_ns() - t0_ns) / 1e9)
            series["waf"].append(st["waf"])
            series["hbmw_bytes"].append(st["hbmw_bytes"])
            series["mbmw_bytes"].append(st["mbmw_bytes"])

    next_sample_ns = t0_ns
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(_PROGRESS_POLL_S)
                if stop_requested():  # Ctrl-C / SIGTERM: end the run, report what was done
                    stop.set()
                progress.io_bytes = state["issued_bytes"]
                if deadline_ns is not None:
                    progress.update((time.perf_counter_ns() - t0_ns) / 1e9)
                else:
                    progress.update(float(state["issued_bytes"]))
                if time.perf_counter_ns() >= next_sample_ns:
                    sample_device()
                    next_sample_ns += int(_DEVICE_SAMPLE_S * 1e9)
    finally:
        stop.set()
        for t in threads:
            t.join()
        end_ns = max(finished_ns) if finished_ns else time.perf_counter_ns()
        usage = cpu.stop()
        sample_device()
    measured = recorder.result(end_ns)
    empty = DirectionResult()
    device: dict[str, Any] = {}
    timeseries: dict[str, list] = {}
    if observer is not None:
        st = observer.stats()
        where = "memory engine" if engine_kind == "memory" else f"{engine_kind} on {path}"
        what = ("sim (FTL model as the device)" if _device_mode(options) == "sim" else
                f"file ({where}); WAF from an FTL model observing the writes (a model, not this file "
                "system's device)")
        device = {"device": what, **device_geometry, "hbmw_bytes": st["hbmw_bytes"],
                  "mbmw_bytes": st["mbmw_bytes"], "mbe_bytes": st["mbe_bytes"], "waf": st["waf"],
                  "gc_runs": st["gc_runs"],
                  "ruh_host_bytes": {str(i): b for i, b in enumerate(st["ruh_host_bytes"]) if b},
                  "ruh_gc_bytes": {str(i): b for i, b in enumerate(st["ruh_gc_bytes"]) if b}}
        timeseries = series
    error, message = 0, ""
    if errors:
        exc, offset = errors[0]
        error = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EIO
        what = "write" if is_write else "read"
        message = (f"{type(exc).__name__}: {exc} ({what} offset={offset}, buflen={bs}"
                   f"{'' if len(errors) == 1 else f'; {len(errors)} workers failed'})")
    return JobResult(jobname=options["name"], options=options,
                     read=empty if is_write else measured, write=measured if is_write else empty,
                     device=device, timeseries=timeseries, error=error, error_message=message,
                     usr_cpu=usage["usr_cpu"], sys_cpu=usage["sys_cpu"], runtime_s=(end_ns - t0_ns - ramp_ns) / 1e9,
                     ctx=int(usage["ctx"]), majf=int(usage["majf"]), minf=int(usage["minf"]))


class NoSpaceForJob(TierStoreError):
    """A job's file would not fit the free space of its file system (checked before writing)."""


register_runner(IO_RW, run_io_job)
