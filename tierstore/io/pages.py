"""Engine-memory views: a block's KV fragments, planned once, and engine page pools.

An engine keeps KV in its own memory (a paged pool per layer on the GPU, or a
host pool). tierstore moves a *block* (all layers' K and V of
``tokens_per_block`` tokens) between that memory and its own tiers. The block
arrives as *fragments* (one per layer and K/V for vLLM's GPU layout; one per
layer with K and V fused for vLLM's CPU backend; one per K/V with all layers
for SGLang's ``page_first`` host pool). This module turns fragments into a
:class:`FragmentPlan` -- checked once, moved with the fewest copies -- and
addresses an engine's page pool by block id (:class:`KVPagePool`), so a block
costs one strided copy and no per-fragment Python.

Nothing here does I/O: :mod:`tierstore.io.batch` gathers plans into aligned
staging extents and scatters them back.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import LayoutError


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
_NBYTES = torch.Tensor.nbytes.__get__  # type: ignore[attr-defined]  # the property's getter (torch's stub says int)
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
    if (
        k < 2
        or not isinstance(f0, torch.Tensor)
        or not isinstance(fl, torch.Tensor)
        or f0.device != device
        or fl.device != device
    ):
        return None
    try:  # map over unbound methods: ~0.1 us per fragment and attribute
        ptrs = list(map(_DATA_PTR, fragments))
        sizes = list(map(_NBYTES, fragments))
    except TypeError:  # not all tensors
        return None
    p0, nb = ptrs[0], sizes[0]
    stride = ptrs[1] - p0
    if (
        nb == 0
        or stride < max(min_stride, 1)
        or sizes.count(nb) != k
        or ptrs != list(range(p0, p0 + k * stride, stride))
        or not all(map(_IS_CONTIGUOUS, fragments))
    ):
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

    __slots__ = ("fragments", "nbytes", "strided", "dtype", "count", "destination", "flat", "row_of")

    def __init__(
        self,
        fragments: Sequence[Any] | None,
        nbytes: int,
        strided: torch.Tensor | None,
        dtype: torch.dtype | None = None,
        count: int | None = None,
        destination: bool = False,
    ):
        #: Planned for writing into (checked for overlap); only such plans may be scattered into.
        self.destination = destination
        self.fragments = fragments
        self.nbytes = nbytes
        self.strided = strided
        #: Element dtype of the fragments (None if mixed or not tensors).
        self.dtype = dtype
        #: Number of fragments.
        self.count = count if count is not None else (len(fragments) if fragments is not None else None)
        #: The block as one contiguous 1-D uint8 tensor, when it is one (then one plain copy).
        self.flat: torch.Tensor | None = None
        #: ``(rows, i)`` when the block is row ``i`` of a :class:`BlockRows` batch
        #: (consecutive rows then move as one copy).
        self.row_of: tuple[torch.Tensor, int] | None = None

    @classmethod
    def of_bytes(cls, raw: torch.Tensor, destination: bool = False) -> FragmentPlan:
        """A plan for a block that is one contiguous 1-D ``uint8`` tensor (checked by the caller)."""
        p = cls([raw], raw.numel(), None, torch.uint8, 1, destination)
        p.flat = raw
        return p

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
        if self.flat is not None:
            staging[offset : offset + n].copy_(self.flat)
            return n
        if self.strided is not None:
            staging[offset : offset + n].view(self.strided.shape).copy_(self.strided)
            return n
        return _gather_list(self.fragments, staging, offset)  # type: ignore[arg-type]  # only row plans (flat) have none

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
        if self.flat is not None:
            self.flat.copy_(staging[offset : offset + n])
            return n
        if self.strided is not None:
            self.strided.copy_(staging[offset : offset + n].view(self.strided.shape))
            return n
        return _scatter_list(staging, offset, self.fragments)  # type: ignore[arg-type]  # only row plans (flat) have none


class BlockRows(Sequence[FragmentPlan]):
    """``n`` blocks that are the rows of one ``(n, block_bytes)`` uint8 tensor.

    A sequence of per-block :class:`FragmentPlan` (made when one is asked
    for), and the whole batch as :attr:`rows`, so that the mover copies all
    the blocks bound for one memory tier with one ``index_copy_`` instead of
    one copy per block (tiny blocks: the per-block Python would dominate).

    Parameters
    ----------
    rows : torch.Tensor
        Contiguous, 2-D, ``uint8``; row ``i`` is block ``i``.
    destination : bool
        The blocks will be written (loads).
    """

    __slots__ = ("rows", "destination", "_plans")

    #: Block ``i`` of the batch is ``rows[i]`` (a :class:`PageBatch` maps it through its ids).
    row_ids: Sequence[int] | None = None

    def __init__(self, rows: torch.Tensor, destination: bool = False) -> None:
        if rows.dtype != torch.uint8 or rows.dim() != 2 or not rows.is_contiguous():
            raise LayoutError(
                f"BlockRows needs a contiguous 2-D uint8 tensor, got {tuple(rows.shape)} {rows.dtype}"
            )
        self.rows = rows
        self.destination = destination
        self._plans: list[FragmentPlan | None] = [None] * rows.shape[0]

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        p = self._plans[i]
        if p is None:
            p = self._plans[i] = _RowPlan(self, i if i >= 0 else i + len(self))
        return p


class _RowPlan(FragmentPlan):
    """Row ``i`` of a :class:`BlockRows`: made without a tensor view (the view
    is made when the block is copied alone; consecutive rows are copied at once)."""

    __slots__ = ()

    def __init__(self, batch: BlockRows, i: int) -> None:
        self.fragments = None
        self.nbytes = batch.rows.shape[1]
        self.strided = None
        self.dtype = torch.uint8
        self.count = 1
        self.destination = batch.destination
        self.flat = None
        self.row_of = (batch.rows, i)

    def _view(self) -> torch.Tensor:
        rows, i = self.row_of  # type: ignore[misc]  # a row plan's, set in __init__
        return rows[i]

    def gather(self, staging: torch.Tensor, offset: int) -> int:
        if self.flat is None:
            self.flat = self._view()
        return FragmentPlan.gather(self, staging, offset)

    def scatter(self, staging: torch.Tensor, offset: int) -> int:
        if self.flat is None:
            self.flat = self._view()
        return FragmentPlan.scatter(self, staging, offset)


def plan_fragments(
    fragments: Sequence[Any] | FragmentPlan, *, destination: bool = False, device: torch.device | str = _CPU
) -> FragmentPlan:
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
            raise LayoutError(
                "this plan was made for reading; plan destinations with destination=True "
                "(e.g. KVPagePool.plans(ids, destination=True))"
            )
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
    get the per-layer ``kv_caches`` and the request's block ids; SGLang's host
    pool pages by index; LMCache's GPU connectors the same). When the pool's
    fragments sit at affine addresses,
    ``base + layer * layer_stride + kv * kv_stride + block * block_stride``,
    checking the pool once replaces checking every fragment of every block
    (about 30 us of Python per 64-fragment block), and a block moves as one
    ``(num_layers, num_kv, fragment_bytes)`` strided copy.

    A block's bytes are its fragments in order layer 0 K, layer 0 V, layer 1 K,
    ... (``num_kv = 2``), or layer 0, layer 1, ... when K and V are fused in one
    fragment (``kv_dim=None``).

    Parameters
    ----------
    layers : torch.Tensor or sequence of torch.Tensor
        One tensor per layer (or one tensor whose dim 0 is the layer), all of
        one shape, dtype, device and strides. ``layers[l]`` indexed at
        ``block_dim`` (and ``kv_dim``) must be a contiguous fragment.
        Per-layer tensors that are not at a constant address stride (separate
        allocations) are still accepted: their blocks are planned fragment by
        fragment (:func:`plan_fragments`).
    block_dim : int
        The block axis of a layer tensor.
    kv_dim : int or None
        The K/V axis (size 2) of a layer tensor, or ``None`` when each block's
        K and V share one fragment. ``block_dim`` and ``kv_dim`` must be the
        leading axes (in either order), so that the rest is the fragment.

    Layouts of the engines (per layer; ``H`` KV heads, ``D`` head dim, ``T``
    tokens per block):

    ============================================  =========================  ==========================
    engine layout                                  shape                      arguments
    ============================================  =========================  ==========================
    vLLM FlashAttention (GPU)                      ``(2, blocks, T, H, D)``   ``block_dim=1, kv_dim=0``
    vLLM FlashInfer (GPU)                          ``(blocks, 2, T, H, D)``   ``block_dim=0, kv_dim=1``
    vLLM CPU backend (K, V fused per head)         ``(blocks, H, T, 2*D)``    ``block_dim=0, kv_dim=None``
    SGLang host ``layer_first``, per layer         ``(2, pages, T, H, D)``    ``block_dim=1, kv_dim=0``
    SGLang host ``page_first`` (all layers fused)  ``(2, pages, T*L*H*D)``    one "layer", ``block_dim=1``
    ============================================  =========================  ==========================

    Sources: vLLM ``vllm/v1/attention/backends/*`` ``get_kv_cache_shape``;
    SGLang ``sglang/srt/mem_cache/memory_pool_host.py`` (``MHATokenToKVPoolHost.init_kv_buffer``).

    Raises
    ------
    LayoutError
        Wrong rank, a K/V axis other than 2, axes that are not leading,
        mismatched per-layer shapes, dtypes, devices or strides, or
        non-contiguous fragments.
    """

    def __init__(
        self, layers: torch.Tensor | Sequence[torch.Tensor], *, block_dim: int = 1, kv_dim: int | None = 0
    ):
        per_layer = list(layers.unbind(0)) if isinstance(layers, torch.Tensor) else list(layers)
        if not per_layer or not all(isinstance(t, torch.Tensor) for t in per_layer):
            raise LayoutError("KVPagePool needs a tensor or a non-empty list of per-layer tensors")
        lead = sorted([block_dim] + ([] if kv_dim is None else [kv_dim]))
        if lead != list(range(len(lead))):
            raise LayoutError(
                f"block_dim={block_dim}, kv_dim={kv_dim}: the block and K/V axes must be "
                "the leading axes of a layer tensor, so that the rest is one fragment"
            )
        t0 = per_layer[0]
        if t0.dim() < len(lead) + 1:
            raise LayoutError(
                f"a layer tensor of shape {tuple(t0.shape)} has no fragment axes after "
                f"block_dim={block_dim}, kv_dim={kv_dim}"
            )
        if kv_dim is not None and t0.shape[kv_dim] != 2:
            raise LayoutError(
                f"per-layer KV must have 2 entries (K, V) on axis {kv_dim}, got shape {tuple(t0.shape)}"
            )
        for i, t in enumerate(per_layer):
            if (
                t.shape != t0.shape
                or t.dtype != t0.dtype
                or t.device != t0.device
                or t.stride() != t0.stride()
            ):
                raise LayoutError(f"layer {i}: shape/dtype/device/strides differ from layer 0")
        if t0.shape[block_dim] == 0:
            raise LayoutError("the pool has no blocks (num_blocks = 0)")
        self._block_dim, self._kv_dim = block_dim, kv_dim
        frag = self._select(t0, 0, 0)
        if not frag.is_contiguous():
            raise LayoutError("each [kv, block] fragment must be contiguous")
        self.layers = per_layer
        self.num_layers = len(per_layer)
        self.num_kv = 1 if kv_dim is None else 2
        self.num_blocks = int(t0.shape[block_dim])
        self.fragment_bytes = frag.nbytes
        self.block_bytes = self.num_kv * self.num_layers * self.fragment_bytes
        self.device = t0.device
        es = t0.element_size()
        self._kv_stride = 0 if kv_dim is None else t0.stride(kv_dim) * es
        self._block_stride = t0.stride(block_dim) * es
        ptrs = [t.data_ptr() for t in per_layer]
        layer_stride = ptrs[1] - ptrs[0] if len(ptrs) > 1 else 0
        affine = ptrs == [ptrs[0] + i * layer_stride for i in range(len(ptrs))] and all(
            t.untyped_storage().data_ptr() == t0.untyped_storage().data_ptr() for t in per_layer
        )
        affine = affine and layer_stride >= 0  # as_strided takes no negative strides
        self._layer_stride = layer_stride
        self.dtype = t0.dtype
        #: uint8 view of layer 0 from which every block's affine view is cut,
        #: or None when the layers are separate allocations.
        try:
            self._base = (
                t0.view(torch.uint8) if affine and t0.dtype != torch.uint8 else (t0 if affine else None)
            )
        except RuntimeError:  # odd strides on size-1 dims: plan fragment by fragment
            self._base = None
        #: Why the pool cannot be written (its fragments overlap), or None.
        self._overlap = self._find_overlap(ptrs)

    def _select(self, t: torch.Tensor, block_id: int, kv: int) -> torch.Tensor:
        """Fragment ``[block_id, kv]`` of one layer tensor."""
        if self._kv_dim is None:
            return t.select(self._block_dim, block_id)
        if self._kv_dim < self._block_dim:
            return t[kv, block_id]
        return t[block_id, kv]

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

        within = [(self.num_kv, self._kv_stride), (self.num_blocks, self._block_stride)]
        if self._base is not None:
            if not dense(within + [(self.num_layers, self._layer_stride)]):
                return "the pool's fragments overlap (K/V, block and layer strides)"
            return None
        if not dense(within):
            return "a layer's fragments overlap (K/V and block strides)"
        span = (self.num_kv - 1) * self._kv_stride + (self.num_blocks - 1) * self._block_stride + f
        spans = sorted((p, p + span) for p in ptrs)
        if any(a[1] > b[0] for a, b in zip(spans, spans[1:])):
            return "two layers overlap in memory"
        return None

    @property
    def affine(self) -> bool:
        """Whether blocks are planned arithmetically (one strided copy each)."""
        return self._base is not None

    def fragments(self, block_id: int) -> list[torch.Tensor]:
        """Block ``block_id``'s fragments: layer 0 K, layer 0 V, layer 1 K, ...
        (layer 0, layer 1, ... with K and V fused)."""
        block_id = self._check_id(block_id)
        return [self._select(t, block_id, kv) for t in self.layers for kv in range(self.num_kv)]

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
        view = base.as_strided(
            (self.num_layers, self.num_kv, self.fragment_bytes),
            (self._layer_stride, self._kv_stride, 1),
            base.storage_offset() + block_id * self._block_stride,
        )
        return FragmentPlan(
            None, self.block_bytes, view, self.dtype, self.num_kv * self.num_layers, destination
        )

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

    def batch(self, block_ids: Sequence[int], destination: bool = False) -> Sequence[FragmentPlan]:
        """The blocks ``block_ids`` as one :class:`PageBatch`: checked once, moved between the pool
        and a memory tier with one copy per run of consecutive blocks (or one gather) instead of
        one per block. A pool that is not affine (:attr:`affine`) gives :meth:`plans`' list.

        Raises
        ------
        LayoutError
            As :meth:`plans`.
        """
        if self._base is None:
            return self.plans(block_ids, destination)
        if isinstance(block_ids, range) and block_ids.step == 1:  # ascending, distinct: bounds only
            if block_ids and (block_ids.start < 0 or block_ids.stop > self.num_blocks):
                bad = block_ids.start if block_ids.start < 0 else max(self.num_blocks, block_ids.start)
                raise LayoutError(f"block id {bad} outside the pool's [0, {self.num_blocks})")
            if destination and self._overlap is not None:
                raise LayoutError(f"cannot scatter into this pool: {self._overlap}")
            return PageBatch(self, list(block_ids), destination)
        arr = np.asarray(block_ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            return self.plans(block_ids, destination)  # names the bad id (or a bool/float)
        ids = arr.astype(np.int64, copy=False)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_blocks):
            bad = int(ids[(ids < 0) | (ids >= self.num_blocks)][0])
            raise LayoutError(f"block id {bad} outside the pool's [0, {self.num_blocks})")
        if destination:
            if self._overlap is not None:
                raise LayoutError(f"cannot scatter into this pool: {self._overlap}")
            ascending = ids.size < 2 or bool((ids[1:] > ids[:-1]).all())
            if not ascending:  # ascending ids (most calls: SGLang's allocator) are distinct, no sort
                uniq, counts = np.unique(ids, return_counts=True)
                if uniq.size != ids.size:
                    raise LayoutError(
                        f"destination block ids given more than once: {uniq[counts > 1][:8].tolist()}"
                    )
        return PageBatch(self, ids.tolist(), destination)

    def blocks_view(self) -> torch.Tensor:
        """The whole pool as one ``(num_blocks, num_layers, num_kv, fragment_bytes)`` uint8 view
        (block ``b`` is ``[b]``, the view :meth:`plan` makes); affine pools only.

        Raises
        ------
        LayoutError
            For a pool that is not affine.
        """
        base = self._base
        if base is None:
            raise LayoutError("the pool's layers are separate allocations: no one view of its blocks")
        return base.as_strided(
            (self.num_blocks, self.num_layers, self.num_kv, self.fragment_bytes),
            (self._block_stride, self._layer_stride, self._kv_stride, 1),
            base.storage_offset(),
        )

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


class PageBatch(Sequence[FragmentPlan]):
    """Blocks of one affine :class:`KVPagePool` by id (:meth:`KVPagePool.batch`), checked once.

    A sequence of per-block :class:`FragmentPlan` (made when one is asked for: the NVMe and
    remote paths), and the whole batch as :attr:`rows` with :attr:`row_ids`: block ``i`` is
    ``rows[row_ids[i]]``, so the mover moves a call's blocks between the pool and a memory
    tier's slots with one copy per run, or one gather (:mod:`tierstore.movers.memory`).

    Attributes
    ----------
    rows : torch.Tensor
        :meth:`KVPagePool.blocks_view`: ``(num_blocks, num_layers, num_kv, fragment_bytes)`` uint8.
    row_ids : list of int
        The pool's block id of each block of the batch (checked in bounds, and distinct for
        destinations).
    destination : bool
        The blocks will be written (loads).
    nbytes : int
        Bytes of one block.
    """

    __slots__ = ("pool", "rows", "row_ids", "destination", "nbytes", "_plans")

    def __init__(self, pool: KVPagePool, row_ids: list[int], destination: bool) -> None:
        self.pool = pool
        self.rows = pool.blocks_view()
        self.row_ids = row_ids
        self.destination = destination
        self.nbytes = pool.block_bytes
        self._plans: dict[int, FragmentPlan] = {}

    def __len__(self) -> int:
        return len(self.row_ids)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        p = self._plans.get(i)
        if p is None:
            p = self._plans[i] = self.pool.plan(self.row_ids[i], self.destination)
        return p


def check_distinct_destinations(plans: Sequence[FragmentPlan]) -> None:
    """Refuse destination plans that would write the same memory (one block's load would
    overwrite another's while both report OK), before anything is copied.

    Two contiguous blocks (``flat`` plans) must not share a byte (their ``[data_ptr,
    data_ptr + nbytes)`` ranges, sorted, must not overlap: CUDA's unified virtual addressing
    keeps host and device addresses apart); any two plans must not start at the same address
    (a strided or per-fragment plan by its first fragment). Tensors on the ``meta`` device hold no
    memory and are passed over. One pass over the plans and one sort.

    Raises
    ------
    LayoutError
        If two destinations overlap as above.
    """
    seen: set[int] = set()
    spans: list[tuple[int, int]] = []
    for p in plans:
        if p.flat is not None:
            t = p.flat
        elif p.strided is not None:
            t = p.strided
        elif p.fragments and isinstance(p.fragments[0], torch.Tensor):
            t = p.fragments[0]
        else:
            continue
        if t.is_meta:  # holds no memory (a replay's "load but copy nothing"): nothing to overwrite
            continue
        a = t.data_ptr()
        if t is p.flat:
            spans.append((a, a + p.nbytes))
        if a in seen:
            raise LayoutError("two destination blocks are the same memory")
        seen.add(a)
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:
            raise LayoutError("two destination blocks overlap in memory")


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
        torch.cat(us, out=staging[offset : offset + n])
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
            staging[pos : pos + n].copy_(u)
        pos += n
    return pos - offset


#: torch's fused multi-tensor copy (one C++ call for all fragments), if present.
_FOREACH_COPY = getattr(torch, "_foreach_copy_", None)


def _scatter_list(staging: torch.Tensor, offset: int, fragments: Sequence[Any]) -> int:
    if (
        _FOREACH_COPY is not None
        and fragments
        and all(
            isinstance(f, torch.Tensor) and f.is_contiguous() and f.device == staging.device
            for f in fragments
        )
    ):
        us = [
            f if (f.dtype == torch.uint8 and f.dim() == 1) else f.reshape(-1).view(torch.uint8)
            for f in fragments
            if f.numel()
        ]
        sizes = [u.numel() for u in us]
        n = sum(sizes)
        if us:
            _FOREACH_COPY(us, list(torch.split(staging[offset : offset + n], sizes)))
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
            src = staging[pos : pos + n]
            if f.is_contiguous():
                if n:
                    f.reshape(-1).view(torch.uint8).copy_(src)
            else:
                f.copy_(src.clone().view(f.dtype).view(f.shape))
        else:
            d = as_u8(f if not isinstance(f, np.ndarray) else torch.from_numpy(f))
            n = d.numel()
            d.copy_(staging[pos : pos + n])
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
        w = plans[j].strided if j < n else None
        if v is not None and w is not None:
            step = w.data_ptr() - v.data_ptr()
            nb = plans[i].nbytes
            sto = v.untyped_storage().data_ptr()
            while step > 0 and j < n:  # plans[j] follows plans[i] at the same step
                x = plans[j].strided
                if not (
                    x is not None
                    and x.shape == v.shape
                    and x.stride() == v.stride()
                    and x.data_ptr() - v.data_ptr() == step * (j - i)
                    and offsets[j] - offsets[i] == nb * (j - i)
                    and x.untyped_storage().data_ptr() == sto
                ):
                    break
                j += 1
        if v is not None and j - i > 1:
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
