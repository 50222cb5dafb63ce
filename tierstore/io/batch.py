"""Gather fragmented KV into large aligned staging extents, and scatter back.

An engine's KV block is many small *fragments* (Llama-3.1-8B, 16 tokens:
32 layers x {K, V} x 32 KiB). One I/O per fragment wastes the device; this
module copies fragments into a page-aligned *staging extent* (16 MiB default)
and writes it with a few large I/Os, and reads extents into staging and copies
each fragment out (one ``copy_`` per fragment, no other copies).

Double buffering: :class:`ExtentPipeline` owns two staging buffers; while the
I/O of one is in flight, the next extent is gathered into the other (writes),
or the previous extent is scattered while the next is read (loads).

Staging memory: page-aligned ``mmap`` memory wrapped with ``torch.frombuffer``
on CPU (satisfies O_DIRECT, open(2)); when CUDA is available, pinned host
memory (``torch.empty(..., pin_memory=True)``, 4 KiB-aligned by the CUDA host
allocator) so device-to-host copies are DMA.

Engine-memory views (fragments, plans, page pools) live in
:mod:`tierstore.io.pages`; this module owns the staging memory and the
double-buffered extent loops.
"""

from __future__ import annotations

import functools
import mmap
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from ..errors import ConfigError, InvariantError, LayoutError
from .copies import Copier, one_omp_thread
from .engine import IOEngine, IOFuture, alloc_aligned
from .pages import FragmentPlan, _merged_runs, align_up, fragment_nbytes, gather_fragments, scatter_fragments

#: Default staging extent size (16 MiB): large enough to reach device bandwidth
#: with a handful of 1 MiB I/Os in flight (vLLM saw TTFT gains growing transfer
#: units from 8-72 KB to 0.5-2.5 MB).
DEFAULT_EXTENT_BYTES = 16 << 20


def default_copy_threads() -> int:
    """CPUs for copies and checksums next to I/O: all but one, at least 1, at most 4.

    One CPU is left to the kernel's I/O path (io_uring workers, completions,
    the virtio or NVMe driver), as storage engines that poll or copy next to
    I/O usually do. On this 2-vCPU VM it makes no measurable difference: 6
    ABBA runs against fio gave 0.87x (1 thread) and 0.88x (2 threads) of fio's
    write bandwidth, 0.86x and 0.92x of its read, with per-run spreads of
    0.5x-1.7x from the virtio disk.
    """
    return max(1, min(4, (os.cpu_count() or 1) - 1))


def alloc_staging(nbytes: int) -> tuple[Any, torch.Tensor]:
    """Aligned staging buffer: pinned on CUDA hosts, mmap-backed otherwise."""
    if torch.cuda.is_available():
        t = torch.empty(align_up(nbytes, mmap.PAGESIZE), dtype=torch.uint8, pin_memory=True)
        if t.data_ptr() % mmap.PAGESIZE == 0:
            return t, t
    return alloc_aligned(nbytes)


class ExtentPipeline:
    """Two staging buffers of ``extent_bytes`` and the double-buffered loops.

    Parameters
    ----------
    engine : IOEngine
        Device to move extents to/from.
    extent_bytes : int
        Staging buffer size (multiple of the engine's block size; 16 MiB default).

    Raises
    ------
    ConfigError
        If ``extent_bytes`` is not a positive multiple of the block size.
    """

    def __init__(
        self, engine: IOEngine, extent_bytes: int = DEFAULT_EXTENT_BYTES, copy_threads: int | None = None
    ):
        bs = engine.block_size_bytes
        if extent_bytes <= 0 or extent_bytes % bs:
            raise ConfigError(f"extent_bytes={extent_bytes}: must be a positive multiple of {bs}")
        self.engine = engine
        self.extent_bytes = int(extent_bytes)
        self._bufs = [alloc_staging(self.extent_bytes) for _ in range(2)]
        self.staging = [t for _, t in self._bufs]
        #: Threads that copy (torch intra-op threads) and checksum (Python
        #: threads; crc32c releases the GIL) while I/O is in flight.
        self.copy_threads = int(copy_threads or default_copy_threads())
        if self.copy_threads < 1:
            raise ConfigError(f"copy_threads={copy_threads}: must be >= 1")
        #: Runs the copies and checksums: pieces claimed by the caller and ``copy_threads - 1``
        #: helpers, each on one OpenMP thread (see :mod:`tierstore.io.copies`).
        self._copier = Copier(threads=self.copy_threads)

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """``[fn(x) for x in items]``, on the copy threads when there are several (the caller
        included; a helper that is not running when the call starts takes nothing)."""
        items = list(items)
        if self.copy_threads < 2 or len(items) < 2:
            with one_omp_thread():
                return [fn(x) for x in items]
        out: list[Any] = [None] * len(items)
        # A few contiguous chunks per thread: few hand-offs (a thread wake-up costs tens of
        # microseconds, a 2 MiB block's CRC ~400), and a late helper leaves little to wait for.
        k = min(len(items), 4 * self.copy_threads)
        bounds = [len(items) * i // k for i in range(k + 1)]

        def chunk(a: int, b: int) -> Callable[[], None]:
            def run() -> None:
                for i in range(a, b):
                    out[i] = fn(items[i])

            return run

        self._copier.run([chunk(bounds[i], bounds[i + 1]) for i in range(k)], split=True)
        return out

    def gather_blocks(
        self, plans: Sequence[FragmentPlan], staging: torch.Tensor, offsets: Sequence[int]
    ) -> list[int]:
        """Gather each planned block into ``staging`` at its offset; return bytes per block.

        The copies (runs of blocks cut into pieces of ~2 MiB) are claimed by the
        calling thread and the pipeline's other ``copy_threads - 1`` copy threads,
        each copying on one OpenMP thread (:class:`~tierstore.io.copies.Copier`):
        torch's OpenMP team would wait at its barrier for a thread that a busy
        host descheduled.

        Consecutive blocks whose strided views step by a constant address
        offset, at consecutive staging offsets (blocks ``b, b+1, ...`` of one
        page pool), are moved as one copy of a view with one more dimension:
        for a ``(layers, 2, blocks, ...)`` pool the pool side is then written in
        runs of ``k`` fragments instead of one (measured: scatter 8.3 -> 9.9
        GB/s against a 9.7 GB/s memcpy).

        Raises
        ------
        LayoutError
            If a block does not fit in ``staging``.
        """
        return self._move_blocks(plans, staging, offsets, destination=False)

    def scatter_blocks(
        self, staging: torch.Tensor, offsets: Sequence[int], plans: Sequence[FragmentPlan]
    ) -> list[int]:
        """Scatter ``staging`` at each offset into its planned destination block
        (see :meth:`gather_blocks`); return bytes per block.

        Raises
        ------
        LayoutError
            If a block reads past the end of ``staging``.
        """
        return self._move_blocks(plans, staging, offsets, destination=True)

    def _move_blocks(
        self, plans: Sequence[FragmentPlan], staging: torch.Tensor, offsets: Sequence[int], destination: bool
    ) -> list[int]:
        """Gather ``plans`` into ``staging`` (``destination=False``) or scatter ``staging`` into them."""
        pieces: list[Callable[[], Any]] = []
        total = 0
        chunk = self._copier.chunk_bytes
        for i, j, view in _merged_runs(plans, offsets, destination=destination):
            if view is None:
                p, off = plans[i], offsets[i]
                pieces.append(functools.partial(p.scatter if destination else p.gather, staging, off))
                total += p.nbytes
                continue
            n = view.numel()
            if offsets[i] + n > staging.numel():
                raise LayoutError(
                    f"scatter reads past staging of {staging.numel()} bytes"
                    if destination
                    else f"gather overflows staging of {staging.numel()} bytes"
                )
            run = staging[offsets[i] : offsets[i] + n].view(view.shape)
            step = max(1, chunk // max(1, n // (j - i)))  # blocks per piece
            for a in range(0, j - i, step):
                d, src = (
                    (view[a : a + step], run[a : a + step])
                    if destination
                    else (run[a : a + step], view[a : a + step])
                )
                pieces.append(functools.partial(torch.Tensor.copy_, d, src))
            total += n
        self._copier.run(pieces, total)
        return [p.nbytes for p in plans]

    def close(self) -> None:
        """Stop the copy threads."""
        self._copier.close()

    def write_extents(
        self, jobs: Iterable[tuple[int, Callable[[torch.Tensor], int], int | None]]
    ) -> list[BaseException | int]:
        """Fill and write extents with gather/I-O overlap.

        ``jobs`` yields ``(device_offset, fill, placement)``; ``fill(staging)``
        gathers into the staging tensor and returns the byte length to write
        (it is padded up to the block size with zeros by this method).
        Returns, per job, the bytes written or the ``OSError`` raised.
        """
        bs = self.engine.block_size_bytes
        results: list[BaseException | int] = []
        inflight: list[tuple[int, IOFuture] | None] = [None, None]
        i = 0

        def finish(slot: int) -> None:
            entry = inflight[slot]
            if entry is None:
                return
            idx, fut = entry
            try:
                results[idx] = fut.get()
            except OSError as exc:
                results[idx] = exc
            inflight[slot] = None

        try:
            for offset, fill, placement in jobs:
                slot = i % 2
                finish(slot)  # the buffer we are about to refill must be free
                buf = self.staging[slot]
                n = fill(buf)
                if n > self.extent_bytes:
                    raise LayoutError(f"extent of {n} bytes exceeds staging of {self.extent_bytes}")
                padded = align_up(n, bs)
                if padded > n:
                    buf[n:padded].zero_()
                results.append(0)
                try:
                    fut = self.engine.write(offset, buf[:padded], placement)
                except OSError as exc:
                    results[i] = exc
                else:
                    inflight[slot] = (i, fut)
                i += 1
        finally:  # also on an exception from a fill: no write outlives this call
            finish(0)
            finish(1)
        return results

    def read_extents(
        self,
        jobs: Sequence[tuple[int, int]],
        consume: Callable[[int, torch.Tensor | None, BaseException | None], None],
    ) -> None:
        """Read ``(device_offset, nbytes)`` runs; call ``consume(i, view, err)``
        for each in order while the next run is already being read."""
        inflight: list[tuple[int, IOFuture | None, BaseException | None, int] | None] = [None, None]

        def submit(i: int) -> None:
            off, n = jobs[i]
            slot = i % 2
            try:
                fut = self.engine.read(off, self.staging[slot][:n])
                inflight[slot] = (i, fut, None, n)
            except OSError as exc:
                inflight[slot] = (i, None, exc, n)

        if not jobs:
            return
        submit(0)
        for i in range(len(jobs)):
            if i + 1 < len(jobs):
                submit(i + 1)
            entry = inflight[i % 2]
            if entry is None:  # submit(i) filled it
                raise InvariantError(f"read {i} of {len(jobs)} was never submitted")
            _, fut, err, n = entry
            if fut is not None:
                try:
                    fut.get()
                except OSError as exc:
                    err = exc
            inflight[i % 2] = None
            consume(i, None if err is not None else self.staging[i % 2][:n], err)


def _extent_groups(
    pipe: ExtentPipeline, offset: int, fragments: Sequence[Any]
) -> tuple[list[tuple[int, int, list[Any]]], int]:
    """``fragments`` back to back from ``offset`` in extents of at most ``pipe.extent_bytes``:
    ``([(position, bytes, fragments of the extent)], end)``, each extent starting where the one
    before ended, aligned up to the engine's block size.

    Raises
    ------
    LayoutError
        A fragment larger than one extent.
    """
    groups = []
    group: list[Any] = []
    size = 0
    pos = offset
    for f in list(fragments) + [None]:
        n = 0 if f is None else fragment_nbytes(f)
        if f is None or size + n > pipe.extent_bytes:
            if group:
                groups.append((pos, size, group))
                pos += align_up(size, pipe.engine.block_size_bytes)
            group, size = [], 0
        if f is not None:
            if n > pipe.extent_bytes:
                raise LayoutError(f"fragment of {n} bytes exceeds extent_bytes={pipe.extent_bytes}")
            group.append(f)
            size += n
    return groups, pos


def write_fragments_raw(
    pipe: ExtentPipeline, offset: int, fragments: Sequence[Any], placement: int | None = None
) -> int:
    """Write fragments back to back from ``offset`` in extents of
    ``pipe.extent_bytes`` (raw, no headers). Returns padded bytes written.

    Raises the first ``OSError`` seen; :class:`LayoutError` for a fragment larger than
    an extent (nothing written).
    """
    groups, end = _extent_groups(pipe, offset, fragments)
    jobs = [
        (pos, (lambda g: lambda buf: gather_fragments(g, buf, 0))(group), placement)
        for pos, _, group in groups
    ]
    for r in pipe.write_extents(jobs):
        if isinstance(r, BaseException):
            raise r
    return end - offset


def read_fragments_raw(pipe: ExtentPipeline, offset: int, fragments: Sequence[Any]) -> int:
    """Inverse of :func:`write_fragments_raw`: fill ``fragments`` from ``offset``."""
    bs = pipe.engine.block_size_bytes
    groups, end = _extent_groups(pipe, offset, fragments)
    jobs = [(pos, align_up(size, bs)) for pos, size, _ in groups]

    def consume(i: int, view, err) -> None:
        if err is not None:
            raise err
        scatter_fragments(view, 0, groups[i][2])

    pipe.read_extents(jobs, consume)
    return end - offset
