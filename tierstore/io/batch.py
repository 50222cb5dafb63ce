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
"""
from __future__ import annotations

import concurrent.futures as cf
import contextlib
import ctypes
import mmap
import operator
import os
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from .engine import IOEngine, IOFuture, alloc_aligned
from ..errors import ConfigError, LayoutError

#: Default staging extent size (16 MiB): large enough to reach device bandwidth
#: with a handful of 1 MiB I/Os in flight (vLLM saw TTFT gains growing transfer
#: units from 8-72 KB to 0.5-2.5 MB).
DEFAULT_EXTENT_BYTES = 16 << 20


def align_up(n: int, a: int) -> int:
    """Round ``n`` up to a multiple of ``a``."""
    return (n + a - 1) // a * a


def as_u8(fragment: Any) -> torch.Tensor:
    """A flat ``uint8`` tensor view of a fragment (tensor, ndarray or bytes-like).

    Non-contiguous tensors are returned as a contiguous copy (loads use
    :func:`scatter_fragments`, which handles them without this copy).
    """
    if isinstance(fragment, torch.Tensor):
        t = fragment if fragment.is_contiguous() else fragment.contiguous()
        if t.numel() == 0:
            return torch.empty(0, dtype=torch.uint8, device=t.device)
        return t.reshape(-1).view(torch.uint8)
    if isinstance(fragment, np.ndarray):
        return as_u8(torch.from_numpy(np.ascontiguousarray(fragment)))
    mv = memoryview(fragment).cast("B")
    if mv.nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(mv, dtype=torch.uint8)


def fragment_nbytes(fragment: Any) -> int:
    """Bytes of one fragment."""
    if isinstance(fragment, torch.Tensor):
        return fragment.numel() * fragment.element_size()
    if isinstance(fragment, np.ndarray):
        return fragment.nbytes
    return memoryview(fragment).nbytes


def _host_ptr(t: torch.Tensor) -> int | None:
    """Address of a contiguous host tensor, or None (CUDA / strided)."""
    if t.device.type == "cpu" and t.is_contiguous():
        return t.data_ptr()
    return None


_CPU = torch.device("cpu")
_DATA_PTR = torch.Tensor.data_ptr
_NBYTES = torch.Tensor.nbytes.__get__
_IS_CONTIGUOUS = torch.Tensor.is_contiguous


def _strided_u8(fragments: Sequence[Any], device: torch.device, min_stride: int) -> torch.Tensor | None:
    """One ``(k, nbytes)`` uint8 view covering all ``fragments``, or None.

    Applies when the fragments are contiguous tensors of equal byte size on
    ``device`` whose addresses step by a constant ``stride >= min_stride``
    bytes (e.g. ``pool[layer, kv, block]`` views of a paged KV pool): then one
    strided ``copy_`` moves them all, with no per-fragment dispatch.
    """
    k = len(fragments)
    f0, fl = fragments[0], fragments[-1]
    if (k < 2 or not isinstance(f0, torch.Tensor) or not isinstance(fl, torch.Tensor)
            or f0.device != device or fl.device != device):
        return None
    try:  # map over unbound methods: ~0.1 us per fragment and attribute
        ptrs = list(map(_DATA_PTR, fragments))
        sizes = list(map(_NBYTES, fragments))
    except TypeError:  # not all tensors
        return None
    p0, nb = ptrs[0], sizes[0]
    stride = ptrs[1] - p0
    if (nb == 0 or stride < max(min_stride, 1) or sizes.count(nb) != k
            or ptrs != list(range(p0, p0 + k * stride, stride))
            or not all(map(_IS_CONTIGUOUS, fragments))):
        return None
    if f0.untyped_storage().data_ptr() != fl.untyped_storage().data_ptr():
        return None
    try:
        u0 = f0 if f0.dtype == torch.uint8 else f0.view(torch.uint8)  # byte storage offset
        return u0.as_strided((k, nb), (stride, 1))
    except RuntimeError:  # span not inside one storage
        return None


class FragmentPlan:
    """One block's fragments, checked once, with the cheapest way to move them.

    Built by :func:`plan_fragments`. Checking an engine block's fragments
    (64 tensor views for Llama-3.1-8B) costs tens of microseconds of Python;
    a store or load plans every block once up front (which also validates its
    byte size before any I/O), then moves each block with one call.

    Attributes
    ----------
    fragments : list
        The fragments, in order.
    nbytes : int
        Their total size in bytes.
    strided : torch.Tensor or None
        A ``(k, fragment_bytes)`` uint8 view covering all fragments when they
        are equal-size contiguous views at a constant address stride (a
        block's ``pool[layer, kv, block]`` views); then one strided ``copy_``
        moves the whole block. For destinations the stride is at least the
        fragment size, so the view never aliases itself.
    """

    __slots__ = ("fragments", "nbytes", "strided", "dtype", "count", "destination")

    def __init__(self, fragments: Sequence[Any] | None, nbytes: int, strided: torch.Tensor | None,
                 dtype: torch.dtype | None = None, count: int | None = None, destination: bool = False):
        #: Planned for writing into (checked for overlap); only such plans may be scattered into.
        self.destination = destination
        self.fragments = fragments
        self.nbytes = nbytes
        self.strided = strided
        #: Element dtype of the fragments (None if mixed or not tensors).
        self.dtype = dtype
        #: Number of fragments.
        self.count = count if count is not None else (len(fragments) if fragments is not None else None)

    def gather(self, staging: torch.Tensor, offset: int) -> int:
        """Copy the fragments back to back into ``staging[offset:]``; return bytes.

        Raises
        ------
        LayoutError
            If they do not fit in ``staging``.
        """
        n = self.nbytes
        if offset + n > staging.numel():
            raise LayoutError(f"gather overflows staging of {staging.numel()} bytes")
        if self.strided is not None:
            staging[offset:offset + n].view(self.strided.shape).copy_(self.strided)
            return n
        return _gather_list(self.fragments, staging, offset)

    def scatter(self, staging: torch.Tensor, offset: int) -> int:
        """Copy ``staging[offset:offset + nbytes]`` into the fragments; return bytes.

        Raises
        ------
        LayoutError
            If ``staging`` ends before ``offset + nbytes``.
        """
        if not self.destination:
            raise LayoutError("this plan was made for reading; plan destinations with destination=True")
        n = self.nbytes
        if offset + n > staging.numel():
            raise LayoutError(f"scatter reads past staging of {staging.numel()} bytes")
        if self.strided is not None:
            self.strided.copy_(staging[offset:offset + n].view(self.strided.shape))
            return n
        return _scatter_list(staging, offset, self.fragments)


def plan_fragments(fragments: Sequence[Any] | FragmentPlan, *, destination: bool = False,
                   device: torch.device | str = _CPU) -> FragmentPlan:
    """Check a block's fragments once and choose how to copy them.

    Parameters
    ----------
    fragments : sequence or FragmentPlan
        Tensors of any dtype/shape (contiguous or not, CPU or CUDA), ndarrays
        or bytes-likes, in block order. A plan is returned as is.
    destination : bool
        The fragments will be written (:meth:`FragmentPlan.scatter`): a strided
        view then needs a stride of at least one fragment, so that fragments
        do not overlap.
    device : torch.device or str
        Device of the staging buffer (host memory: ``cpu``).

    Returns
    -------
    FragmentPlan
    """
    if isinstance(fragments, FragmentPlan):
        if destination and not fragments.destination:
            raise LayoutError("this plan was made for reading; plan destinations with destination=True "
                              "(e.g. KVPagePool.plans(ids, destination=True))")
        return fragments
    frags = fragments if isinstance(fragments, list) else list(fragments)
    strided = None
    if len(frags) > 1:
        f0 = frags[0]
        nb0 = f0.nbytes if isinstance(f0, torch.Tensor) else 0
        if nb0:
            dev = device if isinstance(device, torch.device) else torch.device(device)
            strided = _strided_u8(frags, dev, nb0 if destination else 0)
    nbytes = strided.numel() if strided is not None else sum(map(fragment_nbytes, frags))
    dtype = None
    if frags and isinstance(frags[0], torch.Tensor) and isinstance(frags[-1], torch.Tensor):
        dtype = frags[0].dtype if frags[0].dtype == frags[-1].dtype else None
    return FragmentPlan(frags, nbytes, strided, dtype, len(frags), destination)


class KVPagePool:
    """An engine's paged KV cache, addressed by block id: fragment plans without
    a per-fragment check.

    Engines keep KV in page pools and name blocks by id (vLLM's KV connectors
    get the per-layer ``kv_caches`` and the request's block ids; LMCache's GPU
    connectors the same). When the pool's fragments sit at affine addresses,
    ``base + layer * layer_stride + kv * kv_stride + block * block_stride``,
    checking the pool once replaces checking every fragment of every block
    (about 30 us of Python per 64-fragment block), and a block moves as one
    ``(num_layers, 2, fragment_bytes)`` strided copy.

    Parameters
    ----------
    layers : torch.Tensor or sequence of torch.Tensor
        Either one tensor of shape ``(num_layers, 2, num_blocks, *fragment_shape)``
        or one tensor per layer of shape ``(2, num_blocks, *fragment_shape)``
        (vLLM's FlashAttention layout), any dtype, on one device. Each
        ``[kv, block]`` fragment must be contiguous. Per-layer tensors that
        are not at a constant address stride (separate allocations) are
        still accepted: their blocks are planned fragment by fragment
        (:func:`plan_fragments`).

    Raises
    ------
    LayoutError
        Wrong rank, a K/V axis other than 2, mismatched per-layer shapes,
        dtypes or devices, or non-contiguous fragments.
    """

    def __init__(self, layers: torch.Tensor | Sequence[torch.Tensor]):
        per_layer = list(layers.unbind(0)) if isinstance(layers, torch.Tensor) else list(layers)
        if not per_layer or not all(isinstance(t, torch.Tensor) for t in per_layer):
            raise LayoutError("KVPagePool needs a tensor or a non-empty list of per-layer tensors")
        t0 = per_layer[0]
        if t0.dim() < 3 or t0.shape[0] != 2:
            raise LayoutError(f"per-layer KV must be (2, num_blocks, *fragment_shape), got {tuple(t0.shape)}")
        for i, t in enumerate(per_layer):
            if t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device or t.stride() != t0.stride():
                raise LayoutError(f"layer {i}: shape/dtype/device/strides differ from layer 0")
        if t0.shape[1] == 0:
            raise LayoutError("the pool has no blocks (num_blocks = 0)")
        frag = t0[0, 0]
        if not frag.is_contiguous():
            raise LayoutError("each [kv, block] fragment must be contiguous")
        self.layers = per_layer
        self.num_layers = len(per_layer)
        self.num_blocks = int(t0.shape[1])
        self.fragment_bytes = frag.nbytes
        self.block_bytes = 2 * self.num_layers * self.fragment_bytes
        self.device = t0.device
        es = t0.element_size()
        self._kv_stride = t0.stride(0) * es
        self._block_stride = t0.stride(1) * es
        ptrs = [t.data_ptr() for t in per_layer]
        layer_stride = ptrs[1] - ptrs[0] if len(ptrs) > 1 else 0
        affine = (ptrs == [ptrs[0] + i * layer_stride for i in range(len(ptrs))]
                  and all(t.untyped_storage().data_ptr() == t0.untyped_storage().data_ptr()
                          for t in per_layer))
        affine = affine and layer_stride >= 0  # as_strided takes no negative strides
        self._layer_stride = layer_stride
        self.dtype = t0.dtype
        #: uint8 view of layer 0 from which every block's affine view is cut,
        #: or None when the layers are separate allocations.
        try:
            self._base = t0.view(torch.uint8) if affine and t0.dtype != torch.uint8 else (t0 if affine else None)
        except RuntimeError:  # odd strides on size-1 dims: plan fragment by fragment
            self._base = None
        #: Why the pool cannot be written (its fragments overlap), or None.
        self._overlap = self._find_overlap(ptrs)

    def _find_overlap(self, ptrs: list[int]) -> str | None:
        """Whether any two fragments of the pool share a byte (then scattering
        into it would leave one block's KV overwritten by another's)."""
        f = self.fragment_bytes

        def dense(dims: list[tuple[int, int]]) -> bool:
            # sufficient test: with strides sorted ascending, each stride steps
            # past everything the smaller ones span
            span = f
            for n, stride in sorted((d for d in dims if d[0] > 1), key=lambda d: d[1]):
                if stride < span:
                    return False
                span = stride * (n - 1) + span
            return True
        within = [(2, self._kv_stride), (self.num_blocks, self._block_stride)]
        if self._base is not None:
            if not dense(within + [(self.num_layers, self._layer_stride)]):
                return "the pool's fragments overlap (K/V, block and layer strides)"
            return None
        if not dense(within):
            return "a layer's fragments overlap (K/V and block strides)"
        span = self._kv_stride + (self.num_blocks - 1) * self._block_stride + f
        spans = sorted((p, p + span) for p in ptrs)
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            return "two layers overlap in memory"
        return None

    @property
    def affine(self) -> bool:
        """Whether blocks are planned arithmetically (one strided copy each)."""
        return self._base is not None

    def fragments(self, block_id: int) -> list[torch.Tensor]:
        """Block ``block_id``'s fragments: layer 0 K, layer 0 V, layer 1 K, ..."""
        block_id = self._check_id(block_id)
        return [t[kv, block_id] for t in self.layers for kv in (0, 1)]

    def plan(self, block_id: int, destination: bool = False) -> FragmentPlan:
        """A :class:`FragmentPlan` for block ``block_id`` (source or destination).

        Raises
        ------
        LayoutError
            If ``block_id`` is not in ``[0, num_blocks)``, or (destination) the
            pool's fragments overlap.
        """
        block_id = self._check_id(block_id)
        if destination and self._overlap is not None:
            raise LayoutError(f"cannot scatter into this pool: {self._overlap}")
        if self._base is None:
            plan = plan_fragments(self.fragments(block_id), destination=destination, device=_CPU)
            plan.dtype = self.dtype
            return plan
        base = self._base
        view = base.as_strided((self.num_layers, 2, self.fragment_bytes),
                               (self._layer_stride, self._kv_stride, 1),
                               base.storage_offset() + block_id * self._block_stride)
        return FragmentPlan(None, self.block_bytes, view, self.dtype, 2 * self.num_layers, destination)

    def plans(self, block_ids: Iterable[int], destination: bool = False) -> list[FragmentPlan]:
        """:meth:`plan` for each id.

        Raises
        ------
        LayoutError
            As :meth:`plan`; and for ``destination``, an id given twice (two
            blocks would be loaded into one place).
        """
        ids = [self._check_id(b) for b in block_ids]
        if destination and len(set(ids)) != len(ids):
            dup = sorted({b for b in ids if ids.count(b) > 1})
            raise LayoutError(f"destination block ids given more than once: {dup[:8]}")
        return [self.plan(b, destination) for b in ids]

    def _check_id(self, block_id: Any) -> int:
        try:
            if isinstance(block_id, bool):
                raise TypeError
            b = operator.index(block_id)  # ints and integer scalars; not 1.7, "2" or True
        except TypeError:
            raise LayoutError(f"block id {block_id!r} is not an integer") from None
        if not 0 <= b < self.num_blocks:
            raise LayoutError(f"block id {b} outside the pool's [0, {self.num_blocks})")
        return b


def check_distinct_destinations(plans: Sequence[FragmentPlan]) -> None:
    """Refuse two destination plans that start at the same address (one
    block's load would overwrite another's while both report OK).

    Raises
    ------
    LayoutError
        If two strided plans share their first byte.
    """
    seen: set[int] = set()
    for p in plans:
        if p.strided is not None:
            a = p.strided.data_ptr()
            if a in seen:
                raise LayoutError("two destination blocks are the same memory")
            seen.add(a)


def gather_fragments(fragments: Sequence[Any] | FragmentPlan, staging: torch.Tensor, offset: int) -> int:
    """Copy ``fragments`` back to back into ``staging[offset:]``; return bytes copied.

    Fragments at a constant address stride (views of one KV pool) are one
    strided ``copy_`` (see :class:`FragmentPlan`); other tensor fragments go
    through one ``torch.cat(..., out=staging[...])`` (a single C++ call); other
    buffers one ``memmove``/``copy_`` each.

    Raises
    ------
    LayoutError
        If the fragments do not fit in ``staging``.
    """
    return plan_fragments(fragments, device=staging.device).gather(staging, offset)


def scatter_fragments(staging: torch.Tensor, offset: int, fragments: Sequence[Any] | FragmentPlan) -> int:
    """Copy ``staging[offset:]`` into destination ``fragments`` in order.

    Destinations are written in place (tensors of any dtype/shape, contiguous or
    not; writable ndarrays; writable bytes-likes). Returns bytes copied.

    Raises
    ------
    LayoutError
        If ``staging`` ends before the fragments are filled.
    """
    return plan_fragments(fragments, destination=True, device=staging.device).scatter(staging, offset)


def _gather_list(fragments: Sequence[Any], staging: torch.Tensor, offset: int) -> int:
    if fragments and all(isinstance(f, torch.Tensor) and f.device == staging.device for f in fragments):
        us = [f if (f.dtype == torch.uint8 and f.dim() == 1) else as_u8(f) for f in fragments]
        n = sum(u.numel() for u in us)
        torch.cat(us, out=staging[offset:offset + n])
        return n
    pos = offset
    base = _host_ptr(staging)
    for f in fragments:
        if base is not None and isinstance(f, torch.Tensor) and _host_ptr(f) is not None:
            n = f.numel() * f.element_size()
            ctypes.memmove(base + pos, f.data_ptr(), n)
        else:
            u = as_u8(f)
            n = u.numel()
            staging[pos:pos + n].copy_(u)
        pos += n
    return pos - offset


#: torch's fused multi-tensor copy (one C++ call for all fragments), if present.
_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)


def _scatter_list(staging: torch.Tensor, offset: int, fragments: Sequence[Any]) -> int:
    if (_FOREACH_COPY is not None and fragments
            and all(isinstance(f, torch.Tensor) and f.is_contiguous() and f.device == staging.device
                    for f in fragments)):
        us = [f if (f.dtype == torch.uint8 and f.dim() == 1) else f.reshape(-1).view(torch.uint8)
              for f in fragments if f.numel()]
        sizes = [u.numel() for u in us]
        n = sum(sizes)
        if us:
            _FOREACH_COPY(us, list(torch.split(staging[offset:offset + n], sizes)))
        return n
    pos = offset
    base = _host_ptr(staging)
    for f in fragments:
        if isinstance(f, torch.Tensor):
            n = f.numel() * f.element_size()
            if base is not None and _host_ptr(f) is not None:
                ctypes.memmove(f.data_ptr(), base + pos, n)
                pos += n
                continue
            src = staging[pos:pos + n]
            if f.is_contiguous():
                if n:
                    f.reshape(-1).view(torch.uint8).copy_(src)
            else:
                f.copy_(src.clone().view(f.dtype).view(f.shape))
        else:
            d = as_u8(f if not isinstance(f, np.ndarray) else torch.from_numpy(f))
            n = d.numel()
            d.copy_(staging[pos:pos + n])
        pos += n
    return pos - offset


def _non_overlapping(shape: Sequence[int], strides: Sequence[int]) -> bool:
    """Sufficient test that no two elements of a byte view share an address:
    with strides sorted ascending, each steps past all the smaller ones span."""
    span = 1
    for n, st in sorted(((n, st) for n, st in zip(shape, strides) if n > 1), key=lambda d: d[1]):
        if st < span:
            return False
        span = st * (n - 1) + span
    return True


def _merged_runs(plans: Sequence[FragmentPlan], offsets: Sequence[int], destination: bool):
    """Yield ``(i, j, view)``: blocks ``plans[i:j]`` as one strided view with a
    leading block dimension, or ``view=None`` for a single block (``j = i + 1``).

    Blocks merge when their strided views have equal shape and strides, lie in
    one storage at a constant positive address step, and their staging offsets
    follow each other; for destinations the merged view must also pass
    :func:`_non_overlapping` (else the blocks go one by one, as planned).
    """
    n = len(plans)
    i = 0
    while i < n:
        v = plans[i].strided
        j = i + 1
        step = 0
        if v is not None and j < n and plans[j].strided is not None:
            w = plans[j].strided
            step = w.data_ptr() - v.data_ptr()
            nb = plans[i].nbytes
            sto = v.untyped_storage().data_ptr()

            def follows(k: int) -> bool:
                x = plans[k].strided
                return (x is not None and x.shape == v.shape and x.stride() == v.stride()
                        and x.data_ptr() - v.data_ptr() == step * (k - i)
                        and offsets[k] - offsets[i] == nb * (k - i)
                        and x.untyped_storage().data_ptr() == sto)
            if step > 0:
                while j < n and follows(j):
                    j += 1
        if j - i > 1:
            shape, strides = (j - i, *v.shape), (step, *v.stride())
            merged = None
            if not destination or _non_overlapping(shape, strides):
                try:  # the span must lie inside v's storage (views of a sliced pool may not)
                    merged = v.as_strided(shape, strides, v.storage_offset())
                except RuntimeError:
                    merged = None
            if merged is not None:
                yield i, j, merged
                i = j
                continue
            j = i + 1
        yield i, i + 1, None
        i += 1


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


def _omp_set_num_threads() -> Callable[[int], None] | None:
    """``omp_set_num_threads`` of the OpenMP runtime torch uses, if it is loaded."""
    for name in ("libgomp.so.1", "libiomp5.so", "libomp.so"):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD).omp_set_num_threads
        except (OSError, AttributeError):
            continue
    return None


_OMP_SET = _omp_set_num_threads()


def _set_omp(n: int) -> None:
    if _OMP_SET is not None:
        _OMP_SET(n)


def _single_threaded_torch() -> None:
    """Copy-thread initializer: this thread's torch ops run on this thread only.

    The copy threads already split work across the CPUs; torch's intra-op
    OpenMP team per copy thread would oversubscribe them (on 2 CPUs, 2 copy
    threads x 2 OpenMP threads). ``omp_set_num_threads`` is per calling thread,
    so other threads (and ``torch.get_num_threads()``) are unaffected.
    """
    torch.get_num_threads()  # torch's lazy per-thread init first, or it would undo ours
    fn = _omp_set_num_threads()
    if fn is not None:
        fn(1)


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

    def __init__(self, engine: IOEngine, extent_bytes: int = DEFAULT_EXTENT_BYTES,
                 copy_threads: int | None = None):
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
        self._workers = (cf.ThreadPoolExecutor(self.copy_threads, thread_name_prefix="tierstore-copy",
                                               initializer=_single_threaded_torch)
                         if self.copy_threads > 1 else None)

    def map(self, fn: Callable[[Any], Any], items: Sequence[Any]) -> list[Any]:
        """``[fn(x) for x in items]``, on the copy threads when there are several."""
        items = list(items)
        if self._workers is None or len(items) < 2:
            return [fn(x) for x in items]
        # One contiguous chunk per thread, the first on the calling thread: one
        # hand-off per helper thread per call rather than one per item (thread
        # wake-ups cost tens of microseconds, a 2 MiB block copy ~200).
        k = min(self.copy_threads, len(items))
        bounds = [len(items) * i // k for i in range(k + 1)]
        chunks = [items[bounds[i]:bounds[i + 1]] for i in range(k)]
        futs = [self._workers.submit(lambda c: [fn(x) for x in c], c) for c in chunks[1:]]
        nthreads = torch.get_num_threads()
        try:  # the helpers take the other CPUs: keep torch's OpenMP team off them
            _set_omp(1)
            out = [fn(x) for x in chunks[0]]
        finally:
            _set_omp(nthreads)
        for f in futs:
            out.extend(f.result())
        return out

    def gather_blocks(self, plans: Sequence[FragmentPlan], staging: torch.Tensor,
                      offsets: Sequence[int]) -> list[int]:
        """Gather each planned block into ``staging`` at its offset; return bytes per block.

        The copies run back to back on the calling thread, each split across
        ``copy_threads`` of torch's intra-op (OpenMP) threads, as one large
        ``copy_`` is. Measured on 2 vCPUs (``bench/io_bench.py``): this keeps the
        OpenMP team busy, where one Python thread per CPU copying its own blocks
        lost 10-25 % to thread hand-offs and OpenMP wake-ups.

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
        with self._omp_threads():
            for i, j, view in _merged_runs(plans, offsets, destination=False):
                if view is None:
                    plans[i].gather(staging, offsets[i])
                else:
                    n = view.numel()
                    if offsets[i] + n > staging.numel():
                        raise LayoutError(f"gather overflows staging of {staging.numel()} bytes")
                    staging[offsets[i]:offsets[i] + n].view(view.shape).copy_(view)
            return [p.nbytes for p in plans]

    def scatter_blocks(self, staging: torch.Tensor, offsets: Sequence[int],
                       plans: Sequence[FragmentPlan]) -> list[int]:
        """Scatter ``staging`` at each offset into its planned destination block
        (see :meth:`gather_blocks`); return bytes per block.

        Raises
        ------
        LayoutError
            If a block reads past the end of ``staging``.
        """
        with self._omp_threads():
            for i, j, view in _merged_runs(plans, offsets, destination=True):
                if view is None:
                    plans[i].scatter(staging, offsets[i])
                else:
                    n = view.numel()
                    if offsets[i] + n > staging.numel():
                        raise LayoutError(f"scatter reads past staging of {staging.numel()} bytes")
                    view.copy_(staging[offsets[i]:offsets[i] + n].view(view.shape))
            return [p.nbytes for p in plans]

    @contextlib.contextmanager
    def _omp_threads(self):
        """This thread's torch ops use ``copy_threads`` OpenMP threads meanwhile."""
        n = torch.get_num_threads()
        if n == self.copy_threads or _OMP_SET is None:
            yield
            return
        _set_omp(self.copy_threads)
        try:
            yield
        finally:
            _set_omp(n)

    def close(self) -> None:
        """Stop the copy threads."""
        if self._workers is not None:
            self._workers.shutdown(wait=True)
            self._workers = None

    def write_extents(self, jobs: Iterable[tuple[int, Callable[[torch.Tensor], int], int | None]]
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

    def read_extents(self, jobs: Sequence[tuple[int, int]],
                     consume: Callable[[int, torch.Tensor | None, BaseException | None], None]) -> None:
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
            _, fut, err, n = entry
            if fut is not None:
                try:
                    fut.get()
                except OSError as exc:
                    err = exc
            inflight[i % 2] = None
            consume(i, None if err is not None else self.staging[i % 2][:n], err)


def write_fragments_raw(pipe: ExtentPipeline, offset: int, fragments: Sequence[Any],
                        placement: int | None = None) -> int:
    """Write fragments back to back from ``offset`` in extents of
    ``pipe.extent_bytes`` (raw, no headers). Returns padded bytes written.

    Raises the first ``OSError`` seen.
    """
    jobs = []
    group: list[Any] = []
    size = 0
    pos = offset
    for f in list(fragments) + [None]:
        n = 0 if f is None else fragment_nbytes(f)
        if f is None or size + n > pipe.extent_bytes:
            if group:
                jobs.append((pos, (lambda g: lambda buf: gather_fragments(g, buf, 0))(group), placement))
                pos += align_up(size, pipe.engine.block_size_bytes)
            group, size = [], 0
        if f is not None:
            if n > pipe.extent_bytes:
                raise LayoutError(f"fragment of {n} bytes exceeds extent_bytes={pipe.extent_bytes}")
            group.append(f)
            size += n
    for r in pipe.write_extents(jobs):
        if isinstance(r, BaseException):
            raise r
    return pos - offset


def read_fragments_raw(pipe: ExtentPipeline, offset: int, fragments: Sequence[Any]) -> int:
    """Inverse of :func:`write_fragments_raw`: fill ``fragments`` from ``offset``."""
    bs = pipe.engine.block_size_bytes
    jobs: list[tuple[int, int]] = []
    groups: list[list[Any]] = []
    group: list[Any] = []
    size = 0
    pos = offset
    for f in list(fragments) + [None]:
        n = 0 if f is None else fragment_nbytes(f)
        if f is None or size + n > pipe.extent_bytes:
            if group:
                jobs.append((pos, align_up(size, bs)))
                groups.append(group)
                pos += align_up(size, bs)
            group, size = [], 0
        if f is not None:
            group.append(f)
            size += n

    def consume(i: int, view, err) -> None:
        if err is not None:
            raise err
        scatter_fragments(view, 0, groups[i])
    pipe.read_extents(jobs, consume)
    return pos - offset
