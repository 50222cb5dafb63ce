"""Plain fio-like I/O jobs: ``rw=read|write|randread|randwrite|randrw|rw``.

How the I/O is issued (``ioengine=``, mapped by :func:`tierstore.bench.jobfile.engine_kind`):

* ``uring`` (and fio's ``io_uring``, ``libaio``; ``auto`` where io_uring works): one thread per
  clone (``numjobs``) drives its own io_uring (:class:`tierstore.io.ring.Ring`) as fio's io_uring
  engine does: it fills up to ``iodepth`` read/write SQEs, publishes them with one
  ``io_uring_enter`` that also waits for ``iodepth // 4`` completions (at least one), reaps every
  completion posted, and refills: in C without the GIL (``tierstore.io._ringloop``, built at install
  where a C compiler is), else in Python; the job's first line says which.
* ``posix`` (and fio's ``posixaio``): ``iodepth`` threads per clone, each doing one
  ``os.preadv``/``os.pwritev`` at a time on the O_DIRECT file (the GIL is released inside the
  call), which keeps ``iodepth`` I/Os in flight.
* fio's synchronous ``psync``, ``sync``, ``pvsync``, ``pvsync2``: one such thread per clone;
  ``iodepth`` does not apply (as in fio), ``IO depths`` reports 1.
* ``memory``, ``kvikio`` and an NVMe generic device (``/dev/ngXnY``): ``iodepth`` threads per
  clone, each calling the :mod:`tierstore.io` engine and waiting for its future.

The file is opened through :func:`tierstore.io.open_engine` (O_DIRECT, an exclusive lock, grown
to ``size``); the loops above use its descriptor. ``direct=0`` uses buffered
``os.preadv``/``os.pwritev`` on the file instead (posix-family engines only). The ``numjobs``
clones are reported as one job.

``rw=randrw`` and ``rw=rw`` (fio's ``readwrite``) mix reads and writes: each I/O is a read with
probability ``rwmixread`` percent (or ``100 - rwmixwrite`` when only that is given), drawn from the
job's ``seed``; ``randrw`` picks random offsets, ``rw`` walks the file in order. Both directions
are reported.

Where the bytes go (``device=``, the same three choices as the KV jobs):

* ``file`` (default): the job's file, ``directory``/``filename`` (fio's ``jobname.0.0``; clone N
  ``jobname.N.0`` without ``filename``; a temporary directory when neither is set), through
  ``ioengine``. Completed writes are also fed to an FTL model (:class:`tierstore.fdp.ftl.FTLModel`) --
  after the run, in completion order, so the model costs the I/O loops nothing -- and write jobs
  report HBMW/MBMW/MBE and WAF over time; that is a *model*, not the device under this file system.
  The model's logical capacity is ``size / utilization`` (the job's file covers ``utilization``
  of the modelled device).
* ``sim``: the FTL model *is* the device: the data stays in memory (memory engine);
  ``ioengine``/``directory``/``filename`` are not used (a line says so).
* ``/dev/ngXnY``: a real FDP namespace (the default ``filename``); placed writes by NVMe
  passthrough. Not verified on hardware.

Writes are tagged with a placement ID when ``dataplacement=fdp``: ``plids`` are indices into the
device's RUH Status list, as fio's (``plids=0,1,2`` on a namespace whose RUH Status lists 0x0,
0x4000, 0x1 writes those three PIDs), and an index beyond the list is refused before anything is
written. On the model (``device=file``/``sim``) the list is the model's: 8 RUHs in one reclaim
group (PIDs 0..7). The entries are picked per ``plid_select`` (``roundrobin`` per write,
``random``, or ``lifetime``: one per clone).

Files: before writing anything the job checks that its file fits the free space of its file
system (statvfs) and refuses otherwise; a job that reads lays its file out first (fio's
``Laying out IO file`` line). Files the job created are removed when it ends, also after Ctrl-C
or SIGTERM, unless ``unlink=0``.

Failures: any failure of a worker (an I/O error, a bug) stops the job; the result carries fio's
``error`` (the errno; ``EIO`` when there is none) and the statistics up to then, and
``tierstore bench`` exits 1.

Completion latency is measured with :func:`time.perf_counter_ns`: for the synchronous loops
around each call; for io_uring from just before the ``io_uring_enter`` that submitted the I/O
to just after the ``io_uring_enter`` whose wait ended and the reap that found its completion
(fio's clat spans submission to reap the same way).
"""

from __future__ import annotations

import array
import errno
import mmap
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ..errors import ConfigError, ForeignDataError, TierStoreError
from ..io.engine import alloc_aligned, buffer_address
from ..io.ring import (
    IORING_OP_READ,
    IORING_OP_WRITE,
    SLOT_STATE_COLS,
    TURN_LOG_COLS,
    IoUringError,
    Ring,
    native_turn,
    run_fixed_turns,
)
from ..units import format_bytes
from .jobfile import SYNC_IOENGINES, engine_kind, resolve_path
from .registry import current_progress, info, register_runner, remove_private_dir, stop_requested
from .result import CpuUsage, DirectionRecorder, JobResult

__all__ = ["run_io_job", "IO_RW", "NoSpaceForJob"]

#: The workloads this module runs.
IO_RW = ("read", "write", "randread", "randwrite", "randrw", "rw")
_DIRECT_ALIGN_BYTES = 4096
_PROGRESS_POLL_S = 0.1
_DEVICE_SAMPLE_S = 0.25
_GC_SPARE_RUS = 5
#: RUHs of the FTL model a plain job writes to (the RUH Status ``plids`` index), as ``device=sim``'s default.
_MODEL_RUHS = 8
#: Offsets and directions drawn per call of the random generator (numpy draws in bulk, Python reads lists).
_DRAW_CHUNK = 4096
#: I/Os a synchronous thread reserves per visit to the job's shared budget (fewer lock round trips).
_SYNC_TAKE = 16
#: A plain job's io_uring loop waits for ``iodepth // 4`` completions (at least 1; fewer when fewer are in
#: flight) before it refills: the queue stays between 3/4 of ``iodepth`` and full, and one turn's Python
#: cost is shared by several I/Os (measured against 1, 4 and 8 at depth 16: bench/README_io.md).
_REAP_DEPTH_DIVISOR = 4
#: Completed writes a synchronous thread hands to the FTL model at once.
_OBSERVE_BATCH = 64
#: Completions the C turn (:func:`_native_turns`) waits for per ``io_uring_enter``: 1, fio's default
#: ``iodepth_batch_complete_min``. The Python turn waits for ``iodepth // 4`` to share its per-turn cost; the
#: C turn's is too small to matter, and a queue refilled after every completion stays full. Measured
#: (bench/README_io.md, 2026-12-03): wait 1 against 4, ABBA, load 14-17 with a spin loop, faster in 8 of 8
#: pairs (randrw median 19.3k vs 15.7k IOPS, randread 24.8k vs 17.7k), CPU per I/O the same.
_NATIVE_REAP_MIN = 1
#: The C turn comes back to Python at least this often (to see a stop request), ns.
_NATIVE_RETURN_NS = 50_000_000
#: I/Os a C turn reserves per call from a job with an I/O budget (not time-based): clones share the
#: budget about evenly, and one call's Python (~30 us) is spread over this many I/Os.
_NATIVE_BUDGET_TAKE = 256
_NO_OFFSETS = np.empty(0, dtype=np.int64)
# run_fixed_turns' reasons (tierstore.io.ring.TurnResult)
_TURN_DONE, _TURN_FAILED, _TURN_ENTER_FAILED = 1, 2, 3


def _free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still allocate on the file system of ``path`` (statvfs(3))."""
    st = os.statvfs(os.path.dirname(os.path.abspath(path)) or ".")
    return st.f_bavail * st.f_frsize


def _check_space(options: dict[str, Any], paths: Sequence[str], size_bytes: int) -> None:
    """Refuse a job whose files (one, or one per clone: fio's ``jobname.N.0``) of ``size_bytes``
    each would not fit the free space of their file system.

    fio finds out while laying the file out (``No space left on device on laying
    out file, stopping``), after filling the disk; this checks first, from
    statvfs, and writes nothing.

    Raises
    ------
    NoSpaceForJob
        When the bytes still to allocate exceed the free space.
    """
    need = sum(max(0, size_bytes - (os.path.getsize(p) if os.path.exists(p) else 0)) for p in paths)
    free = _free_bytes(paths[0])
    what = f"the file {paths[0]}" if len(paths) == 1 else f"the {len(paths)} files {paths[0]} .. {paths[-1]}"
    if need > free:
        raise NoSpaceForJob(
            f"size={options['size']} bytes: {what} needs {need} more "
            f"bytes ({format_bytes(need)}) but its file system has {free} bytes "
            f"({format_bytes(free)}) free; nothing was written. Choose a smaller size= "
            "or another directory="
        )


#: Extended attribute that marks a file a plain job created (and kept, ``unlink=0``): a later job
#: may write over it without ``format=1``. A Linux ``user.`` attribute (xattr(7)).
_OWN_XATTR = "user.tierstore.bench"


def _mark_own(path: str) -> None:
    """Mark a file a job created (or wrote as its own) as tierstore's (see :data:`_OWN_XATTR`):
    the mark holds the file's size and mtime, so a file copied over it later (``cp`` keeps the
    target's xattrs) is not taken for the job's own. A file system without user xattrs
    (ENOTSUP) leaves it unmarked, so a later write job asks for ``format=1``."""
    st = os.stat(path)
    try:
        os.setxattr(path, _OWN_XATTR, f"{st.st_size}:{st.st_mtime_ns}".encode())
    except OSError as e:
        if e.errno not in (errno.ENOTSUP, errno.EPERM):
            raise


def _is_own(path: str) -> bool:
    """The mark of :func:`_mark_own` is there and the file is as the job left it."""
    try:
        st = os.stat(path)
        return os.getxattr(path, _OWN_XATTR) == f"{st.st_size}:{st.st_mtime_ns}".encode()
    except OSError:
        return False


def _size_from_file(options: dict[str, Any], path: str | None) -> dict[str, Any]:
    """fio's rule: without ``size=``, a job on an existing regular file uses the file's size
    (whole ``bs`` blocks), so reading a file never extends it.

    Raises
    ------
    ConfigError
        For a read job (``rw=read``/``randread``, no ``format=1``) on a non-empty file smaller
        than one block: it has no whole block to read, and the default ``size=`` would extend
        a file the user only asked to read.
    """
    if "size" in options.get("_explicit", frozenset()) or not path or not os.path.isfile(path):
        return options
    n = os.path.getsize(path)
    bs = options["bs"]
    if n >= bs:
        return {**options, "size": n - n % bs}
    if 0 < n and options["rw"] in ("read", "randread") and not options.get("format"):
        raise ConfigError(
            f"filename={path!r}: the file holds {n} bytes, less than one block of bs={bs}, so "
            f"rw={options['rw']} has nothing to read (without size= a job reads an existing file's "
            "whole blocks); to lay the file out to a size first, give size= and format=1. Nothing was written"
        )
    return options


def _check_overwrite(options: dict[str, Any], path: str, device: bool, writes: bool) -> None:
    """Refuse to write over data tierstore did not write (house rule: a user's data is sacred).

    A job that writes (or lays out, i.e. extends) an existing non-empty file that no
    tierstore job created, or that writes to a device, needs ``format=1``, as the NVMe
    tier of a KV job does (:mod:`tierstore.io.label`). fio writes such targets without
    asking; mkfs asks. Reads of an existing file change nothing and are always allowed.

    Raises
    ------
    ForeignDataError
        Before anything is written; the message names the target and the opt-in.
    """
    if options.get("format") or not writes:
        return
    if device:
        what = "a device"
    else:
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            return
        if size == 0 or _is_own(path):
            return
        what = f"an existing {size}-byte file that no tierstore job created"
    act = (
        "would write over what it holds"
        if options["rw"] not in ("read", "randread")
        else f"would extend it to size={options['size']} bytes (fio's layout writes the rest)"
    )
    raise ForeignDataError(
        f"filename={path!r}: {what}; job {options['name']!r} (rw={options['rw']}) {act}. tierstore bench "
        "writes over data it did not write only when told to: --format=1 (format=1 in a job file; fio writes "
        "without asking). Nothing was written"
    )


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
    """A writable byte view of a CPU ``uint8`` tensor or an ``mmap`` (``os.preadv`` takes buffers, not
    tensors)."""
    if isinstance(buf, torch.Tensor):
        return memoryview(buf.numpy()).cast("B")
    return memoryview(buf).cast("B")


class _FdTarget:
    """The job's file as a descriptor the job's own loops drive: ``os.preadv``/``os.pwritev`` from the
    calling thread (:meth:`read`, :meth:`write`), or the io_uring loop when :attr:`kind` is ``uring``.

    ``direct=1``: the descriptor of a :mod:`tierstore.io` file engine (O_DIRECT, locked, sized) of
    ``kind`` (``posix``, ``uring``: io_uring or :class:`~tierstore.io.ring.IoUringUnavailable` saying
    why not, ``auto``: uring where it works), which stays open and owns the descriptor until
    :meth:`close`. ``direct=0``: a buffered descriptor of the file (page cache). The job's loops feed
    completed writes to the FTL model themselves.
    """

    def __init__(self, path: str, direct: bool, kind: str, size_bytes: int) -> None:
        self.engine: Any = None
        if direct:
            self.engine = _open_engine(kind, path, size_bytes, 1)
            self.fd = self.engine.fd
            self.kind = self.engine.kind  # auto: what it chose
        else:
            try:
                self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            except OSError as exc:
                raise ConfigError(f"filename={path!r}: cannot open: {exc.strerror}") from None
            self.kind = "posix"

    @staticmethod
    def prepare(buf: Any) -> memoryview:
        return _bytes_view(buf)

    def read(self, view: memoryview, offset: int) -> int:
        return os.preadv(self.fd, [view], offset)

    def write(self, view: memoryview, offset: int, placement: int | None) -> int:
        return os.pwritev(self.fd, [view], offset)

    def of(self, clone: int) -> _FdTarget:
        """The target of clone ``clone``: this one (the clones share it)."""
        return self

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        else:
            os.close(self.fd)


class _CloneFiles:
    """A file per clone (fio's ``jobname.N.0`` without ``filename=``): clone ``c`` does its I/O on
    ``targets[c]``; the FTL model sees the files one after the other (clone ``c``'s at ``c * size``)."""

    def __init__(self, targets: list[_FdTarget]) -> None:
        self.targets = targets
        self.kind = targets[0].kind

    def of(self, clone: int) -> _FdTarget:
        return self.targets[clone]

    def close(self) -> None:
        for t in self.targets:
            t.close()


def _open_engine(kind: str, path: str | None, size_bytes: int, iodepth: int) -> Any:
    from ..io import open_engine

    try:
        return open_engine(kind, path, size_bytes, iodepth=iodepth)
    except OSError as exc:
        if isinstance(exc, TierStoreError):  # e.g. IoUringUnavailable: its message says why
            raise
        hint = (
            " (the filesystem may refuse O_DIRECT, e.g. tmpfs: try direct=0)"
            if exc.errno == errno.EINVAL
            else ""
        )
        raise ConfigError(
            f"filename={path!r}: cannot open with ioengine={kind}: {exc.strerror}{hint}"
        ) from None


def _is_nvme_generic(path: str) -> bool:
    """``/dev/ngXnY``: an NVMe generic character device (I/O passthrough only)."""
    return (
        os.path.basename(path).startswith("ng")
        and os.path.exists(path)
        and stat.S_ISCHR(os.stat(path).st_mode)
    )


class _FutureTarget:
    """A target over an engine whose calls return futures (``.get()``); each call waits for its own.
    Subclasses set :attr:`engine`."""

    engine: Any

    @staticmethod
    def prepare(buf: Any) -> Any:
        return buf

    def read(self, buf: Any, offset: int) -> int:
        return self.engine.read(offset, buf).get()

    def write(self, buf: Any, offset: int, placement: int | None) -> int:
        return self.engine.write(offset, buf, placement).get()

    def of(self, clone: int) -> _FutureTarget:
        """The target of clone ``clone``: this one (the clones share it)."""
        return self

    def close(self) -> None:
        self.engine.close()


class _PassthroughTarget(_FutureTarget):
    """``/dev/ngXnY``: placed writes by NVMe passthrough (``IORING_OP_URING_CMD``), reads on the
    matching ``/dev/nvmeXnY`` (:class:`tierstore.fdp.device.PassthroughEngine`). Not verified on hardware."""

    def __init__(self, path: str, size_bytes: int, options: dict[str, Any]) -> None:
        from ..fdp.device import PassthroughEngine, discover_namespace

        ns = discover_namespace(path)  # the discovery the library and the daemon use
        placed = options["dataplacement"] == "fdp"
        if placed:
            ns.require_fdp()
        if size_bytes > ns.size_bytes:
            raise ConfigError(f"size={size_bytes}: the namespace {path} has {ns.size_bytes} bytes")
        #: the namespace's PIDs; plids index it (checked before any write)
        self.pid_table = ns.pid_table if ns.info.fdp_enabled else None
        self.pids = self.pid_table.pids_at(options["plids"]) if placed else []
        self.engine = PassthroughEngine(
            ns.char_dev,
            size_bytes,
            ns.nsid,
            ns.lba_bytes,
            pid_table=self.pid_table,
            max_transfer_bytes=ns.max_transfer_bytes,
        )


class _EngineTarget(_FutureTarget):
    """A :mod:`tierstore.io` engine; each call waits for its own future."""

    def __init__(self, kind: str, path: str | None, size_bytes: int, iodepth: int) -> None:
        self.engine = _open_engine(kind, path, size_bytes, iodepth)


class _LockedObserver:
    """Serialises completed writes (from many threads) into the FTL model, one call per batch."""

    def __init__(self, ftl: Any) -> None:
        self.ftl = ftl
        self.lock = threading.Lock()

    def on_write(self, offset_bytes: int, nbytes: int, placement: int | None) -> None:
        with self.lock:
            self.ftl.on_write(offset_bytes, nbytes, placement)

    def on_trim(self, offset_bytes: int, nbytes: int) -> None:
        with self.lock:
            self.ftl.on_trim(offset_bytes, nbytes)

    def on_writes(
        self, offsets: Sequence[int], nbytes: Sequence[int], placements: Sequence[int | None]
    ) -> None:
        """Many completed writes: whole-page ones of one placement go to the model as one page array
        (:meth:`~tierstore.fdp.ftl.FTLModel.write_pages`), the others one by one (same accounting as
        :meth:`~tierstore.fdp.ftl.FTLModel.write`)."""
        pb = self.ftl.page_bytes
        groups: dict[int | None, list[int]] = {}
        odd: list[tuple[int, int, int | None]] = []
        for off, n, pid in zip(offsets, nbytes, placements):
            if n <= 0:
                continue
            if off % pb == 0 and n % pb == 0:
                groups.setdefault(pid, []).extend(range(off // pb, (off + n) // pb))
            else:
                odd.append((off, n, pid))
        with self.lock:
            for pid, lpns in groups.items():
                self.ftl.write_pages(np.asarray(lpns, dtype=np.int64), pid)
            for off, n, pid in odd:
                self.ftl.on_write(off, n, pid)

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
    return ftl, {"capacity_bytes": capacity, "ru_size_bytes": ru, "page_bytes": page_bytes, "op": op}


def _read_share(options: dict[str, Any]) -> float:
    """Probability that an I/O is a read: 1 or 0 for one-direction jobs, fio's ``rwmixread`` (or
    ``100 - rwmixwrite`` when only that was given) for ``randrw``/``rw``."""
    rw = options["rw"]
    if rw in ("read", "randread"):
        return 1.0
    if rw in ("write", "randwrite"):
        return 0.0
    explicit = options.get("_explicit", frozenset())
    if "rwmixwrite" in explicit and "rwmixread" not in explicit:
        return 1.0 - options["rwmixwrite"] / 100.0
    return options["rwmixread"] / 100.0


def _validate(options: dict[str, Any]) -> None:
    bs, size = options["bs"], options["size"]
    kind = engine_kind(options["ioengine"])
    if size < bs:
        raise ConfigError(f"size={size}: must be at least bs={bs}")
    if kind != "memory" and options["direct"] and bs % _DIRECT_ALIGN_BYTES:
        raise ConfigError(f"bs={bs}: with direct=1 it must be a multiple of {_DIRECT_ALIGN_BYTES}")
    if kind == "memory" and bs % _DIRECT_ALIGN_BYTES:
        raise ConfigError(
            f"bs={bs}: ioengine=memory keeps O_DIRECT rules; use a multiple of {_DIRECT_ALIGN_BYTES}"
        )
    if options["time_based"] and not options["runtime"]:
        raise ConfigError("time_based=1: needs runtime > 0")
    if not options["direct"] and kind != "posix":
        raise ConfigError(
            f"direct=0: buffered I/O runs on the posix-family engines (posix, psync, sync, pvsync, "
            f"pvsync2, posixaio), not ioengine={options['ioengine']}"
        )
    if options["dataplacement"] == "fdp" and not options["plids"]:
        raise ConfigError("dataplacement=fdp: needs plids, e.g. plids=0,1,2")


def _placement_picker(
    options: dict[str, Any], plids: list[int]
) -> Callable[[int, int, np.random.Generator], int] | None:
    """Per write, the PID: ``plids`` are the PIDs the job's plids index (fio's ``dp_fill_dspec_data``);
    ``None`` without ``dataplacement=fdp`` (no write is placed)."""
    if options["dataplacement"] != "fdp":
        return None
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
    engine = engine_kind(options["ioengine"])
    if mode == "sim":
        ignored = [
            f"{k}={options[k]}"
            for k in ("ioengine", "directory", "filename")
            if k in explicit and options[k] and not (k == "ioengine" and options[k] == "memory")
        ]
        if ignored:
            info(
                f"{options['name']}: device=sim keeps the data in memory (the FTL model is the device); "
                f"{', '.join(ignored)} not used (device=file writes a file)"
            )
        return "memory", None
    if engine == "memory":
        return "memory", None
    if mode == "device" and not options["filename"]:
        return engine, options["device"]
    return engine, resolve_path(options, f"{options['name']}.0.0") or None


def _prepare_targets(
    options: dict[str, Any], paths: list[str], read_share: float, span_bytes: int, created: list[bool]
) -> None:
    """Check a plain job's files (their room first, together) or device before any write and lay a
    read job's files out; ``created`` gets, file by file, whether the job creates it (it removes it
    at the end unless ``unlink=0``)."""
    if not paths[0].startswith("/dev/"):
        _check_space(options, paths, span_bytes)
    for p in paths:
        created.append(_prepare_target(options, p, read_share, span_bytes))


def _clone_paths(options: dict[str, Any], path: str, engine_kind_: str) -> list[str]:
    """The job's files: fio's one per clone (``jobname.N.0``, beside ``jobname.0.0``) when ``numjobs``
    clones drive descriptors without ``filename=``; else the one file (or device) they share."""
    fd_engine = engine_kind_ in ("posix", "uring", "auto") or not options["direct"]
    n = options["numjobs"]
    if n == 1 or options["filename"] or path.startswith("/dev/") or not fd_engine or _is_nvme_generic(path):
        return [path]
    return [os.path.join(os.path.dirname(path), f"{options['name']}.{c}.0") for c in range(n)]


def _open_target(
    options: dict[str, Any],
    engine_kind_: str,
    path: str | None,
    paths: list[str],
    span_bytes: int,
    lanes: int,
) -> Any:
    """The job's target: a namespace by passthrough, a descriptor per file (:class:`_CloneFiles` for
    several), or a :mod:`tierstore.io` engine."""
    if path is not None and _is_nvme_generic(path):
        return _PassthroughTarget(path, span_bytes, options)
    if engine_kind_ in ("posix", "uring", "auto") or not options["direct"]:
        targets: list[_FdTarget] = []
        try:
            for p in paths:
                targets.append(_FdTarget(p, options["direct"], engine_kind_, span_bytes))
        except BaseException:
            for t in targets:
                t.close()
            raise
        return targets[0] if len(targets) == 1 else _CloneFiles(targets)
    return _EngineTarget(engine_kind_, path, span_bytes, lanes * options["numjobs"])


def _leave_files(options: dict[str, Any], paths: list[str], created: list[bool], owned: list[bool]) -> None:
    """Remove the files the job created (unless ``unlink=0``); mark the others it wrote as its own."""
    for p, made, own in zip(paths, created, owned):
        if made and options.get("unlink", True):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass
        elif (own or made) and os.path.isfile(p):
            _mark_own(p)  # as the job leaves it: size and mtime


def _prepare_target(options: dict[str, Any], path: str, read_share: float, span_bytes: int) -> bool:
    """Check a plain job's file or device before any write (its room: :func:`_prepare_targets`) and
    lay a read job's file out; returns whether the job creates the file."""
    if path.startswith("/dev/"):
        # never create or fill a regular file under /dev: only existing block/char devices
        try:
            st_mode = os.stat(path).st_mode
        except FileNotFoundError:
            raise ConfigError(
                f"filename={path!r}: no such device; under /dev a job uses only existing block or "
                "character devices and creates no file (for a file, give a directory outside /dev; "
                "/dev/shm is tmpfs, which refuses direct=1 anyway)"
            ) from None
        if not (stat.S_ISBLK(st_mode) or stat.S_ISCHR(st_mode)):
            raise ConfigError(f"filename={path!r}: not a block or character device")
        _check_overwrite(options, path, True, read_share < 1)
        return False
    created = not os.path.exists(path)
    grows = read_share > 0 and not created and os.path.getsize(path) < span_bytes
    _check_overwrite(options, path, False, read_share < 1 or grows)
    if read_share > 0:
        _layout(options["name"], path, span_bytes)
    return created


def run_io_job(options: dict[str, Any]) -> JobResult:
    """Run one plain I/O job (``rw`` in :data:`IO_RW`).

    Parameters
    ----------
    options : dict
        Typed job options (:data:`tierstore.bench.jobfile.SCHEMA`). Uses ``rw``,
        ``bs``, ``size``, ``iodepth``, ``numjobs``, ``runtime``, ``time_based``,
        ``ramp_time``, ``ioengine``, ``direct``, ``directory``, ``filename``,
        ``unlink``, ``rwmixread``, ``rwmixwrite``, ``dataplacement``, ``plids``,
        ``plid_select``, ``device``, ``ru_size``, ``op``, ``utilization`` and ``seed``.

    Returns
    -------
    JobResult
        The read and/or write direction with per-op completion latencies; for
        writes also ``device`` (the FTL model's figures) and ``timeseries``.
        A failed I/O (or any failure of a worker) ends the job: ``error`` is
        its errno (``EIO`` for a failure that has none) and ``error_message``
        says what failed; the statistics cover the I/Os done until then.

    Raises
    ------
    ConfigError
        For options this runner cannot honour, or a file it cannot open.
    NoSpaceForJob
        When the job's file would not fit its file system (checked before writing).
    tierstore.io.ring.IoUringUnavailable
        ``ioengine=uring`` (or ``io_uring``/``libaio``) where this process cannot use io_uring.
    """
    _validate(options)
    bs = options["bs"]
    read_share = _read_share(options)
    engine_kind_, path = _resolve_target(options)
    options = _size_from_file(options, path)
    span_blocks = options["size"] // bs
    span_bytes = span_blocks * bs
    if not options["direct"] and engine_kind_ == "memory":
        raise ConfigError("direct=0: buffered I/O needs a file (device=file, ioengine=posix)")
    sync = options["ioengine"] in SYNC_IOENGINES
    lanes = 1 if sync else options["iodepth"]

    tmpdir: str | None = None
    paths: list[str] = []
    created: list[bool] = []
    owned: list[bool] = []
    target: Any = None
    try:
        if engine_kind_ != "memory":
            if not path:
                tmpdir = tempfile.mkdtemp(prefix="tierstore-bench-")
                path = os.path.join(tmpdir, f"{options['name']}.0.0")
            paths = _clone_paths(options, path, engine_kind_)
            owned = [os.path.isfile(p) and _is_own(p) for p in paths]
            _prepare_targets(options, paths, read_share, span_bytes, created)
        target = _open_target(options, engine_kind_, path, paths or [path], span_bytes, lanes)
        shown = path if len(paths) < 2 else f"{paths[0]} .. {paths[-1]} (a file per clone)"
        return _run(options, target, span_blocks, span_bytes, read_share, engine_kind_, shown, lanes)
    finally:
        if target is not None:
            target.close()
        _leave_files(options, paths, created, owned)
        if tmpdir is not None:
            remove_private_dir(options, tmpdir)  # kept with its file when unlink=0


class _Shared:
    """What the threads of one job share: the I/O budget, the sequential cursors, the stop flag and
    the failures. Each thread draws its own offsets and keeps its own log (no lock per I/O)."""

    def __init__(
        self, options: dict[str, Any], span_blocks: int, limit_ios: int | None, deadline_ns: int | None
    ) -> None:
        self.lock = threading.Lock()
        self.issued_ios = 0
        self.limit_ios = limit_ios
        self.span_blocks = span_blocks
        self.cursors = [0] * options["numjobs"]
        self.deadline_ns = deadline_ns
        self.stop = threading.Event()
        self.errors: list[tuple[BaseException, int, bool]] = []
        self.finished_ns: list[int] = []
        #: a file per clone (:class:`_CloneFiles`): each clone's own share of the budget, ``size`` as in
        #: fio (on a shared file any clone may take what is left)
        self.clone_left: list[int] | None = None

    def take(self, n: int, clone: int) -> int:
        """Reserve up to ``n`` I/Os of the job's budget for ``clone`` (all of them for a time-based job)."""
        if self.limit_ios is None:
            return n
        with self.lock:
            n = max(0, min(n, self.limit_ios - self.issued_ios))
            if self.clone_left is not None:
                n = min(n, self.clone_left[clone])
                self.clone_left[clone] -= n
            self.issued_ios += n
            return n

    def count(self, n: int) -> None:
        """Count ``n`` I/Os issued by a time-based job (the status line's bandwidth)."""
        if self.limit_ios is None:
            with self.lock:
                self.issued_ios += n

    def sequential(self, clone: int, n: int) -> list[int]:
        """The next ``n`` block numbers of clone ``clone``'s sequential walk (wrapping at the end)."""
        with self.lock:
            first = self.cursors[clone]
            self.cursors[clone] = (first + n) % self.span_blocks
        return [(first + i) % self.span_blocks for i in range(n)]

    def fail(self, exc: BaseException, offset: int, is_write: bool) -> None:
        with self.lock:
            self.errors.append((exc, offset, is_write))
        self.stop.set()


class _Draw:
    """Offsets and directions of one thread: random ones drawn in bulk from its own generator
    (``seed``, clone, lane), sequential ones from its clone's walk. The random stream does not depend on
    how many are taken at a time (what a chunk leaves is used first by the next), so the Python and the
    C turn of a ring issue the same offsets; placements (``plid_select=random``) draw from a generator
    of their own (:attr:`pick_rng`) for the same reason."""

    def __init__(
        self, shared: _Shared, options: dict[str, Any], clone: int, lane: int, read_share: float
    ) -> None:
        self.shared, self.clone, self.bs = shared, clone, options["bs"]
        self.rng = np.random.default_rng([options["seed"], clone, lane])
        self.pick_rng = np.random.default_rng([options["seed"], clone, lane, 1])
        self.random = options["rw"].startswith("rand")
        self.read_share = read_share
        self._offsets_np = np.empty(0, dtype=np.int64)  # drawn random offsets (bytes), used from _at on
        self._offsets: list[int] = []  # the same as a list (what the Python loops read)
        self._at = 0
        self._writes_np = np.empty(0, dtype=bool)
        self._writes: list[bool] = []
        self._wat = 0
        self._reads_only = [False] * _DRAW_CHUNK
        self._writes_only = [True] * _DRAW_CHUNK

    def next(self, n: int) -> tuple[list[int], list[bool]]:
        """``n`` offsets in bytes and, for each, whether it is a write (``n`` <= 4096)."""
        if self.random:
            offsets = self._take_offsets(n, False)
        else:
            bs = self.bs
            offsets = [b * bs for b in self.shared.sequential(self.clone, n)]
        if self.read_share >= 1.0:
            return offsets, self._reads_only[:n]
        if self.read_share <= 0.0:
            return offsets, self._writes_only[:n]
        if self._wat + n > len(self._writes):
            self._draw_writes()
        writes = self._writes[self._wat : self._wat + n]
        self._wat += n
        return offsets, writes

    def next_arrays(self, n: int) -> tuple[np.ndarray, np.ndarray | None]:
        """:meth:`next` as numpy arrays: offsets (int64, bytes) and writes (bool; ``None`` for a job of
        one direction), the same values :meth:`next` would give."""
        if self.random:
            offsets = self._take_offsets(n, True)
        else:
            offsets = np.array(self.shared.sequential(self.clone, n), dtype=np.int64) * self.bs
        if self.read_share >= 1.0 or self.read_share <= 0.0:
            return offsets, None
        if self._wat + n > len(self._writes_np):
            self._draw_writes()
        writes = self._writes_np[self._wat : self._wat + n]
        self._wat += n
        return offsets, writes

    def _take_offsets(self, n: int, as_array: bool) -> Any:
        """The next ``n`` drawn random offsets (bytes), drawing more first when fewer are left: a
        slice of ``_offsets_np`` (``as_array``) or of ``_offsets``, which hold the same values."""
        if self._at + n > len(self._offsets):
            self._draw_offsets()
        drawn = self._offsets_np if as_array else self._offsets
        got = drawn[self._at : self._at + n]
        self._at += n
        return got

    def _draw_offsets(self) -> None:
        fresh = self.rng.integers(0, self.shared.span_blocks, size=_DRAW_CHUNK) * self.bs
        self._offsets_np = np.concatenate([self._offsets_np[self._at :], fresh])
        self._offsets = self._offsets_np.tolist()
        self._at = 0

    def _draw_writes(self) -> None:
        self._writes_np = np.concatenate(
            [self._writes_np[self._wat :], self.rng.random(_DRAW_CHUNK) >= self.read_share]
        )
        self._writes = self._writes_np.tolist()
        self._wat = 0


class _Log:
    """One thread's completions per direction: latency (ns), completion time (ns), bytes moved; for
    writes also the offset and the PID (-1: none), which the FTL model hears after the run."""

    def __init__(self) -> None:
        self.lat = (array.array("q"), array.array("q"))  # read, write
        self.done = (array.array("q"), array.array("q"))
        self.nbytes = (array.array("q"), array.array("q"))
        self.write_offset = array.array("q")
        self.write_pid = array.array("q")
        #: where the thread's file starts in the FTL model's space (a file per clone: clone x size)
        self.base = 0

    def into(self, recorders: tuple[DirectionRecorder, DirectionRecorder], full_bytes: int) -> None:
        for d in (0, 1):
            if self.lat[d]:
                recorders[d].record_many(
                    np.frombuffer(self.lat[d], dtype=np.int64),
                    np.frombuffer(self.done[d], dtype=np.int64),
                    np.frombuffer(self.nbytes[d], dtype=np.int64),
                    full_bytes,
                )


def _feed_model(observer: _LockedObserver, logs: Sequence[_Log], t0_ns: int) -> dict[str, list]:
    """Hand every completed write of the job to the FTL model in completion order, after the run (so the
    model costs the I/O loops nothing), and sample its WAF every 0.25 s of completion time.

    Returns
    -------
    dict
        The time series: ``t_s``, ``waf``, ``hbmw_bytes``, ``mbmw_bytes``.
    """
    series: dict[str, list] = {"t_s": [], "waf": [], "hbmw_bytes": [], "mbmw_bytes": []}
    done = np.concatenate([np.frombuffer(log.done[1], dtype=np.int64) for log in logs])
    if not done.size:
        return series
    order = np.argsort(done, kind="stable")
    done = done[order]
    offsets = np.concatenate([np.frombuffer(log.write_offset, dtype=np.int64) + log.base for log in logs])
    offsets = offsets[order]
    nbytes = np.concatenate([np.frombuffer(log.nbytes[1], dtype=np.int64) for log in logs])[order]
    pids = np.concatenate([np.frombuffer(log.write_pid, dtype=np.int64) for log in logs])[order]
    step_ns = int(_DEVICE_SAMPLE_S * 1e9)
    next_ns = t0_ns + step_ns
    for a in range(0, done.size, _OBSERVE_BATCH):
        b = min(a + _OBSERVE_BATCH, done.size)
        observer.on_writes(
            offsets[a:b].tolist(), nbytes[a:b].tolist(), [None if p < 0 else p for p in pids[a:b].tolist()]
        )
        if done[b - 1] >= next_ns or b == done.size:
            st = observer.stats()
            series["t_s"].append((int(done[b - 1]) - t0_ns) / 1e9)
            series["waf"].append(st["waf"])
            series["hbmw_bytes"].append(st["hbmw_bytes"])
            series["mbmw_bytes"].append(st["mbmw_bytes"])
            next_ns = int(done[b - 1]) + step_ns
    return series


class _Lane(NamedTuple):
    """What one thread of a job works with: the job's shared state, the thread's draws and log, the
    block size in bytes, the placement picker (``None``: no placement) and whether its buffers are
    filled with random bytes first (a job that writes)."""

    shared: _Shared
    draw: _Draw
    log: _Log
    bs: int
    pick: Callable[[int, int, np.random.Generator], int] | None
    fill_random: bool


def _sync_lane(lane: _Lane, target: Any) -> None:
    """One thread, one I/O at a time: ``target.read``/``target.write`` and wait (posix, psync, the
    engines)."""
    shared, draw, log, bs, pick, fill_random = lane
    keep, buf = alloc_aligned(bs)
    offset, is_write = -1, False
    handle = None
    try:
        if fill_random:
            buf.copy_(torch.from_numpy(draw.rng.integers(0, 256, size=bs, dtype=np.uint8)))
        handle = target.prepare(buf)
        read, write = target.read, target.write
        clock = time.perf_counter_ns
        deadline = shared.deadline_ns
        stop = shared.stop
        lat_r, lat_w = log.lat
        done_r, done_w = log.done
        nb_r, nb_w = log.nbytes
        off_w, pid_w = log.write_offset, log.write_pid
        seq = 0
        while not stop.is_set():
            n = shared.take(_SYNC_TAKE, draw.clone)
            if not n:
                return
            shared.count(n)
            offsets, writes = draw.next(n)
            for offset, is_write in zip(offsets, writes):
                if is_write:
                    seq += 1
                    pid = pick(draw.clone, seq, draw.pick_rng) if pick is not None else None
                    start = clock()
                    got = write(handle, offset, pid)
                    done = clock()
                    lat_w.append(done - start)
                    done_w.append(done)
                    nb_w.append(got)
                    off_w.append(offset)
                    pid_w.append(-1 if pid is None else pid)
                else:
                    start = clock()
                    got = read(handle, offset)
                    done = clock()
                    lat_r.append(done - start)
                    done_r.append(done)
                    nb_r.append(got)
                if deadline is not None and done >= deadline:
                    return
                if stop.is_set():
                    return
    except Exception as exc:  # noqa: BLE001 (any failure ends the job with err= set; fio: td_verror)
        shared.fail(exc, offset, is_write)
    finally:
        shared.finished_ns.append(time.perf_counter_ns())
        handle = None
        del buf
        keep.close()


def _ring_clone(lane: _Lane, fd: int, depth: int) -> None:
    """One clone through its own io_uring, keeping between 3/4 of ``depth`` and ``depth`` I/Os in flight.

    SQE ``i`` is fixed to buffer slot ``i`` once (:meth:`~tierstore.io.ring.Ring.fix_rw_slots`). Each
    turn queues an I/O in every free slot (:meth:`~tierstore.io.ring.Ring.prep_fixed`: an offset, and
    an opcode for mixed jobs, per I/O), then one ``io_uring_enter`` submits them and waits until
    ``depth // 4`` (at least 1) I/Os are done (:meth:`~tierstore.io.ring.Ring.submit_reap_results`,
    fio's ``iodepth_batch_complete_min``), and every completion posted is freed and logged as
    columns. (Measured on the development VM, bench/README_io.md: waiting for 1 completion per turn,
    numpy records, and splitting a batch over several enters were each slower.) Where the C module
    ``tierstore.io._ringloop`` is built the same turns run in C (:func:`_native_turns`); this Python loop
    is the reference and the fallback.
    """
    shared, bs = lane.shared, lane.bs
    clone = None
    mem = mmap.mmap(-1, depth * bs, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # page-aligned
    try:
        if lane.fill_random:
            mem[:] = lane.draw.rng.integers(0, 256, size=depth * bs, dtype=np.uint8).tobytes()
        clone = _RingClone(lane, fd, depth, mem)
        if native_turn()[0]:
            _native_turns(clone, depth)
            return
        submit_reap, clock = clone.ring.submit_reap_results, time.perf_counter_ns
        reap_at_least = max(1, depth // _REAP_DEPTH_DIVISOR)
        while True:
            if clone.issuing and clone.free:
                clone.issue()
            if not clone.inflight:
                return
            cqes = submit_reap(min(clone.inflight, reap_at_least))  # one io_uring_enter
            clone.complete(cqes, clock())
    except Exception as exc:  # noqa: BLE001 (any failure ends the job with err= set; fio: td_verror)
        if clone is None:
            shared.fail(exc, -1, False)
        else:
            shared.fail(exc, clone.offset, clone.is_write)
            _drain(
                clone.ring, clone.inflight
            )  # the kernel must be done with the buffers before they are unmapped
    finally:
        shared.finished_ns.append(time.perf_counter_ns())
        if clone is not None:
            clone.ring.close()
        mem.close()


def _native_turns(clone: _RingClone, depth: int) -> None:
    """:func:`_ring_clone`'s turns in C (:func:`~tierstore.io.ring.run_fixed_turns`, the GIL released; each
    enter waits for ``_NATIVE_REAP_MIN`` completions, not ``depth // 4``): each call is given the clone's
    next pre-drawn I/Os (:func:`_native_chunk`) and returns when they are issued, every
    ``_NATIVE_RETURN_NS`` (to see a stop request), at the deadline (drained) or at the first failure, with
    the completions of its turns logged (:meth:`_RingClone.log_rows`)."""
    shared, ring = clone.shared, clone.ring
    state = np.zeros((depth, SLOT_STATE_COLS), dtype=np.int64)
    out = np.empty((max(_DRAW_CHUNK, _NATIVE_BUDGET_TAKE) + depth, len(TURN_LOG_COLS)), dtype=np.int64)
    wait_nr = _NATIVE_REAP_MIN
    deadline = shared.deadline_ns or 0
    offsets, opcodes, tags = _NO_OFFSETS, None, None
    while True:
        if clone.issuing and shared.stop.is_set():
            clone.issuing = False
        if clone.issuing and not len(offsets):
            offsets, opcodes, tags = _native_chunk(clone)
            clone.issuing = bool(len(offsets))
        if not clone.issuing:
            offsets, opcodes, tags = _NO_OFFSETS, None, None
        got = run_fixed_turns(
            ring,
            state,
            offsets,
            opcodes,
            tags,
            out,
            deadline_ns=deadline,
            return_ns=time.perf_counter_ns() + _NATIVE_RETURN_NS,
            wait_nr=wait_nr,
            drain=not clone.issuing,
        )
        offsets = offsets[got.issued :]
        opcodes = None if opcodes is None else opcodes[got.issued :]
        tags = None if tags is None else tags[got.issued :]
        clone.inflight = got.inflight
        clone.log_rows(out[: got.logged])
        if got.reason == _TURN_FAILED:
            clone.offset, clone.is_write = got.err_offset, got.err_opcode == IORING_OP_WRITE
            what = "write" if clone.is_write else "read"
            raise OSError(-got.err_res, f"io_uring {what}: {os.strerror(-got.err_res)}")
        if got.reason == _TURN_ENTER_FAILED:
            raise IoUringError(-got.err_res, f"io_uring_enter failed: {os.strerror(-got.err_res)}")
        if got.reason == _TURN_DONE:
            return


def _native_chunk(clone: _RingClone) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """The clone's next I/Os for the C turn, within the job's budget: offsets (int64, bytes), opcodes
    (uint8; ``None`` for one direction) and placement IDs as tags (int64, -1 for none; ``None`` without
    placement); empty offsets when the budget is spent."""
    shared, draw = clone.shared, clone.draw
    n = shared.take(_DRAW_CHUNK if shared.limit_ios is None else _NATIVE_BUDGET_TAKE, draw.clone)
    if not n:
        return _NO_OFFSETS, None, None
    shared.count(n)
    offsets, writes = draw.next_arrays(n)
    opcodes = None if writes is None else np.where(writes, IORING_OP_WRITE, IORING_OP_READ).astype(np.uint8)
    tags = None
    if clone.pick is not None and not clone.reads_only:
        at = np.arange(n) if writes is None else np.flatnonzero(writes)
        pids = []
        for _ in range(len(at)):  # per write, in issue order, as the Python turn
            clone.seq += 1
            pids.append(clone.pick(draw.clone, clone.seq, draw.pick_rng))
        tags = np.full(n, -1, dtype=np.int64)
        tags[at] = pids
    return offsets, opcodes, tags


class _RingClone:
    """What one :func:`_ring_clone` keeps between turns: its ring, the slots of ``mem`` (one ``bs``
    buffer each) with what is in flight in each, and the I/O a failure names (:attr:`offset`,
    :attr:`is_write`)."""

    def __init__(self, lane: _Lane, fd: int, depth: int, mem: mmap.mmap) -> None:
        self.shared, self.draw, self.log, self.bs, self.pick, _ = lane
        self.fd = fd
        draw, bs = self.draw, self.bs
        base = buffer_address(memoryview(mem))
        self.addrs = [base + i * bs for i in range(depth)]
        self.free = list(range(depth))
        self.slot_offset = [0] * depth
        self.slot_write = [False] * depth
        self.slot_pid = [-1] * depth
        self.slot_start = [0] * depth
        self.seq = 0
        self.issuing = True
        self.inflight = 0
        self.offset, self.is_write = -1, False
        self.reads_only, self.writes_only = draw.read_share >= 1.0, draw.read_share <= 0.0
        self.ring = Ring(depth)  # last: nothing to close when an earlier line fails
        first_op = IORING_OP_READ if self.reads_only or not self.writes_only else IORING_OP_WRITE
        try:
            self.ring.fix_rw_slots(first_op, fd, self.addrs, bs)
        except BaseException:
            self.ring.close()
            raise

    def issue(self) -> None:
        """Queue an I/O in every free slot, within the job's budget (one
        :meth:`~tierstore.io.ring.Ring.prep_fixed`); after a stop, the deadline or the budget's end
        nothing more is issued (:attr:`issuing`)."""
        shared = self.shared
        if shared.stop.is_set() or (
            shared.deadline_ns is not None and time.perf_counter_ns() >= shared.deadline_ns
        ):
            self.issuing = False
            return
        free = self.free
        n = shared.take(min(len(free), _DRAW_CHUNK), self.draw.clone)
        if not n:
            self.issuing = False
            return
        shared.count(n)
        offsets, writes = self.draw.next(n)
        slots = free[-n:]
        del free[-n:]
        start = time.perf_counter_ns()
        slot_start = self.slot_start
        opcodes = None
        if self.reads_only:  # the common case: one store per I/O
            for slot in slots:
                slot_start[slot] = start
        else:
            slot_offset, slot_write, slot_pid = self.slot_offset, self.slot_write, self.slot_pid
            draw, pick, placed, seq = self.draw, self.pick, self.pick is not None, self.seq
            offset, is_write = self.offset, self.is_write
            try:
                for slot, offset, is_write in zip(slots, offsets, writes):
                    slot_offset[slot] = offset
                    slot_write[slot] = is_write
                    slot_start[slot] = start
                    if placed and is_write:
                        seq += 1
                        slot_pid[slot] = pick(draw.clone, seq, draw.pick_rng)
            finally:
                self.seq, self.offset, self.is_write = seq, offset, is_write
            if not self.writes_only:
                opcodes = [IORING_OP_WRITE if w else IORING_OP_READ for w in writes]
        self.ring.prep_fixed(slots, offsets, opcodes)
        self.inflight += n

    def log_rows(self, rows: np.ndarray) -> None:
        """Log the completions the C turn reported (rows of :data:`~tierstore.io.ring.TURN_LOG_COLS`): as
        :meth:`complete` does, a column append per field and direction."""
        if not len(rows):
            return
        log, is_write = self.log, rows[:, 4] == IORING_OP_WRITE
        for d, sel in ((0, rows[~is_write]), (1, rows[is_write])):
            if not len(sel):
                continue
            log.lat[d].frombytes((sel[:, 1] - sel[:, 0]).tobytes())
            log.done[d].frombytes(sel[:, 1].tobytes())
            log.nbytes[d].frombytes(sel[:, 2].tobytes())
            if d:
                log.write_offset.frombytes(sel[:, 3].tobytes())
                log.write_pid.frombytes(
                    (sel[:, 5] if self.pick is not None else np.full(len(sel), -1, np.int64)).tobytes()
                )

    def complete(self, cqes: list, done: int) -> None:
        """Free the slots of one turn's completions (``(slot, res, flags)``) and log them at ``done`` (ns);
        a failed I/O raises :class:`OSError` and names itself in :attr:`offset` and :attr:`is_write`."""
        if not cqes:
            return
        self.inflight -= len(cqes)
        slots, results, _ = zip(*cqes)
        self.free.extend(slots)
        if min(results) < 0:
            slot, res = next((s, r) for s, r in zip(slots, results) if r < 0)
            self.offset, self.is_write = self.slot_offset[slot], self.slot_write[slot]
            if self.reads_only:
                self.offset = -1
            raise OSError(-res, f"io_uring {'write' if self.is_write else 'read'}: {os.strerror(-res)}")
        slot_start, log = self.slot_start, self.log
        if self.reads_only or self.writes_only:  # one direction: a column append per field
            d = (
                0 if self.reads_only else 1
            )  # array.fromlist: a C loop (extend goes through the iterator protocol)
            log.lat[d].fromlist([done - slot_start[s] for s in slots])
            log.done[d].fromlist([done] * len(slots))
            log.nbytes[d].fromlist(list(results))
            if d:
                slot_offset, slot_pid = self.slot_offset, self.slot_pid
                log.write_offset.fromlist([slot_offset[s] for s in slots])
                log.write_pid.fromlist([slot_pid[s] for s in slots])
            return
        slot_offset, slot_write, slot_pid = self.slot_offset, self.slot_write, self.slot_pid
        lat_r, lat_w = log.lat
        done_r, done_w = log.done
        nb_r, nb_w = log.nbytes
        off_w, pid_w = log.write_offset, log.write_pid
        for slot, res in zip(slots, results):
            if slot_write[slot]:
                lat_w.append(done - slot_start[slot])
                done_w.append(done)
                nb_w.append(res)
                off_w.append(slot_offset[slot])
                pid_w.append(slot_pid[slot])
            else:
                lat_r.append(done - slot_start[slot])
                done_r.append(done)
                nb_r.append(res)


def _drain(ring: Ring, inflight: int) -> None:
    """Wait for the I/Os still in flight after a failure (their completions are not counted)."""
    try:
        while inflight > 0:
            ring.submit(1)
            inflight -= len(ring.reap_results())
    except IoUringError:  # the ring itself failed: closing it cancels what is left
        return


#: fio's ``iodepth_level`` of a job that has one I/O in flight at a time.
_DEPTH_ONE = {k: (100.0 if k == "1" else 0.0) for k in ("1", "2", "4", "8", "16", "32", ">=64")}


def _start_progress(read_share: float, total: float, timed: bool) -> Any:
    """The run's progress display, started: over ``total`` seconds (a run with a runtime), else
    over ``total`` bytes."""
    progress = current_progress()
    progress.io_dir = "r" if read_share >= 1.0 else "w"
    progress.start(total=total, unit="s" if timed else "B")
    return progress


def _device_sampler(
    observer: _LockedObserver | None, t0_ns: int
) -> tuple[dict[str, list], Callable[[], None]]:
    """``(series, sample)``: ``sample()`` appends the FTL model's WAF and host/media bytes at the
    time since ``t0_ns`` to ``series`` (``None``: no model sampled during the run, as a file's
    writes reach the model only after it)."""
    series: dict[str, list] = {"t_s": [], "waf": [], "hbmw_bytes": [], "mbmw_bytes": []}

    def sample() -> None:
        if observer is None:
            return
        st = observer.stats()
        if st["hbmw_bytes"]:
            series["t_s"].append((time.perf_counter_ns() - t0_ns) / 1e9)
            series["waf"].append(st["waf"])
            series["hbmw_bytes"].append(st["hbmw_bytes"])
            series["mbmw_bytes"].append(st["mbmw_bytes"])

    return series, sample


def _model_for(
    options: dict[str, Any], target: Any, span_bytes: int, writes_any: bool
) -> tuple[_LockedObserver | None, dict[str, Any]]:
    """The FTL model that observes a writing job on ``device=file``/``sim`` (``None`` otherwise) and
    its geometry; a file per clone (:class:`_CloneFiles`) is modelled as the files one after the other."""
    if not (writes_any and _device_mode(options) in ("file", "sim")):
        return None, {}
    files = len(target.targets) if isinstance(target, _CloneFiles) else 1
    ftl, geometry = _make_ftl(options, span_bytes * files)
    observer = _LockedObserver(ftl)
    if isinstance(target, _EngineTarget):
        target.engine.add_observer(observer)  # the engine reports its writes itself
    return observer, geometry


def _run(
    options: dict[str, Any],
    target: Any,
    span_blocks: int,
    span_bytes: int,
    read_share: float,
    engine_kind_: str,
    path: str | None,
    lanes: int,
) -> JobResult:
    bs = options["bs"]
    writes_any = read_share < 1.0
    observer, device_geometry = _model_for(options, target, span_bytes, writes_any)
    pick_placement = _placement_picker(options, _placement_pids(options, target, observer, path, writes_any))
    self_observed = isinstance(target, _EngineTarget)
    first = target.of(0)
    ring = isinstance(first, _FdTarget) and first.kind == "uring"

    ramp_ns = int(options["ramp_time"] * 1e9)
    runtime_ns = int(options["runtime"] * 1e9)
    limit_ios = None if options["time_based"] else span_blocks * options["numjobs"]
    cpu = CpuUsage()
    t0_ns = time.perf_counter_ns()
    recorders = (DirectionRecorder(start_ns=t0_ns + ramp_ns), DirectionRecorder(start_ns=t0_ns + ramp_ns))
    deadline_ns = t0_ns + ramp_ns + runtime_ns if runtime_ns else None
    shared = _Shared(options, span_blocks, limit_ios, deadline_ns)
    if isinstance(target, _CloneFiles):
        shared.clone_left = [span_blocks] * options["numjobs"]
    if ring:
        _say_turn(options["name"])
    logs, threads = _threads(options, shared, target, ring, lanes, read_share, pick_placement)
    timed = deadline_ns is not None
    progress = _start_progress(
        read_share, (ramp_ns + runtime_ns) / 1e9 if timed else float(limit_ios * bs), timed
    )
    series, sample_device = _device_sampler(observer if self_observed else None, t0_ns)
    for t in threads:
        t.start()
    try:
        _watch(threads, shared, progress, bs, t0_ns, sample_device)
    finally:
        shared.stop.set()
        for t in threads:
            t.join()
        end_ns = max(shared.finished_ns) if shared.finished_ns else time.perf_counter_ns()
        usage = cpu.stop()
        sample_device()
    for log in logs:
        log.into(recorders, bs)
    if observer is not None and not self_observed:
        series = _feed_model(observer, logs, t0_ns)
    read, write = recorders[0].result(end_ns), recorders[1].result(end_ns)
    device: dict[str, Any] = {}
    timeseries: dict[str, list] = {}
    if observer is not None:
        device = _device_section(options, observer, device_geometry, target, engine_kind_, path)
        timeseries = series
    error, message = _job_error(shared, bs)
    # one I/O at a time per clone, whatever iodepth says (fio's sync engines)
    depth_level = dict(_DEPTH_ONE) if lanes == 1 and not ring else None
    return JobResult(
        jobname=options["name"],
        options=options,
        read=read,
        write=write,
        device=device,
        timeseries=timeseries,
        error=error,
        error_message=message,
        usr_cpu=usage["usr_cpu"],
        sys_cpu=usage["sys_cpu"],
        runtime_s=(end_ns - t0_ns - ramp_ns) / 1e9,
        ctx=int(usage["ctx"]),
        majf=int(usage["majf"]),
        minf=int(usage["minf"]),
        iodepth_level=depth_level,
    )


def _say_turn(name: str) -> None:
    """Say whether the job's io_uring turn runs in C (``tierstore.io._ringloop``) or in Python, and why."""
    native, why = native_turn()
    info(f"{name}: io_uring turn in " + ("C (tierstore.io._ringloop)" if native else f"Python ({why})"))


def _placement_pids(
    options: dict[str, Any], target: Any, observer: _LockedObserver | None, path: str | None, writes_any: bool
) -> list[int]:
    """The PIDs ``plids`` names with ``dataplacement=fdp`` (empty otherwise): the namespace's, or the FTL
    model's through the same PID table as a device's; a target that cannot place writes is refused."""
    if not (writes_any and options["dataplacement"] == "fdp"):
        return []
    if isinstance(target, _PassthroughTarget):
        return target.pids
    if observer is not None:  # the model's RUH Status, through the same PID table as a device's
        from ..fdp.simdevice import SimFdpDevice

        return SimFdpDevice(observer.ftl).pid_table().pids_at(options["plids"])
    raise ConfigError(
        f"dataplacement=fdp: {path} is not an NVMe generic character device; placed "
        "writes need /dev/ngXnY (the posix and uring engines cannot place writes)"
    )


def _threads(
    options: dict[str, Any],
    shared: _Shared,
    target: Any,
    ring: bool,
    lanes: int,
    read_share: float,
    pick: Callable[[int, int, np.random.Generator], int] | None,
) -> tuple[list[_Log], list[threading.Thread]]:
    """The job's threads (not started) and their logs: per clone (``numjobs``), one io_uring thread
    (:func:`_ring_clone`, ``ring``) or ``lanes`` synchronous ones (:func:`_sync_lane`), on the clone's
    target (``target.of(clone)``: its own file, fio's ``jobname.N.0``, or the one they share)."""
    bs, iodepth, writes_any = options["bs"], options["iodepth"], read_share < 1.0
    logs: list[_Log] = []
    threads = []
    for clone in range(options["numjobs"]):
        for lane in range(1 if ring else lanes):
            log = _Log()
            logs.append(log)
            draw = _Draw(shared, options, clone, lane, read_share)
            inputs = _Lane(shared, draw, log, bs, pick, writes_any)
            if isinstance(target, _CloneFiles):
                log.base = clone * shared.span_blocks * bs
            if ring:
                fn, args = _ring_clone, (inputs, target.of(clone).fd, iodepth)
            else:
                fn, args = _sync_lane, (inputs, target.of(clone))
            threads.append(
                threading.Thread(target=fn, args=args, name=f"{options['name']}-{clone}.{lane}", daemon=True)
            )
    return logs, threads


def _watch(
    threads: list[threading.Thread],
    shared: _Shared,
    progress: Any,
    bs: int,
    t0_ns: int,
    sample_device: Callable[[], None],
) -> None:
    """Wait for the started threads, updating the progress and sampling the device model; a stop
    request (Ctrl-C / SIGTERM) ends the run, which then reports what was done."""
    next_sample_ns = t0_ns
    for t in threads:
        while t.is_alive():
            t.join(_PROGRESS_POLL_S)
            if stop_requested():  # Ctrl-C / SIGTERM: end the run, report what was done
                shared.stop.set()
            progress.io_bytes = shared.issued_ios * bs
            if shared.deadline_ns is not None:
                progress.update((time.perf_counter_ns() - t0_ns) / 1e9)
            else:
                progress.update(float(shared.issued_ios * bs))
            if time.perf_counter_ns() >= next_sample_ns:
                sample_device()
                next_sample_ns += int(_DEVICE_SAMPLE_S * 1e9)


def _device_section(
    options: dict[str, Any],
    observer: _LockedObserver,
    geometry: dict[str, Any],
    target: Any,
    engine_kind_: str,
    path: str | None,
) -> dict[str, Any]:
    """The report's ``device`` section: the FTL model's figures and what it stands for."""
    st = observer.stats()
    where = (
        "memory engine" if engine_kind_ == "memory" else f"{getattr(target, 'kind', engine_kind_)} on {path}"
    )
    what = (
        "sim (FTL model as the device)"
        if _device_mode(options) == "sim"
        else f"file ({where}); WAF from an FTL model observing the writes (a model, not this file "
        "system's device)"
    )
    return {
        "device": what,
        **geometry,
        "hbmw_bytes": st["hbmw_bytes"],
        "mbmw_bytes": st["mbmw_bytes"],
        "mbe_bytes": st["mbe_bytes"],
        "waf": st["waf"],
        "gc_runs": st["gc_runs"],
        "ruh_host_bytes": {str(i): b for i, b in enumerate(st["ruh_host_bytes"]) if b},
        "ruh_gc_bytes": {str(i): b for i, b in enumerate(st["ruh_gc_bytes"]) if b},
    }


def _job_error(shared: _Shared, bs: int) -> tuple[int, str]:
    """fio's ``err=`` and message of the first failure of the job's threads (``0, ""`` without one)."""
    if not shared.errors:
        return 0, ""
    exc, offset, is_write = shared.errors[0]
    error = exc.errno if isinstance(exc, OSError) and exc.errno else errno.EIO
    what = "write" if is_write else "read"
    message = (
        f"{type(exc).__name__}: {exc} ({what} offset={offset}, buflen={bs}"
        f"{'' if len(shared.errors) == 1 else f'; {len(shared.errors)} workers failed'})"
    )
    return error, message


class NoSpaceForJob(TierStoreError):
    """A job's file would not fit the free space of its file system (checked before writing)."""


register_runner(IO_RW, run_io_job)
