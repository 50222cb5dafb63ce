"""One copy of the input checks of the store's callers (:class:`tierstore.api.KVStore`,
:class:`tierstore.client.RemoteKVStore`): block keys, KV blocks and fragment plans are
checked against the layout here, before anything is stored or loaded, so a bad input
raises :class:`~tierstore.errors.LayoutError` and loses nothing.

``check_keys`` (32-byte keys), ``plan_block`` (one block's fragments or
:class:`~tierstore.io.pages.FragmentPlan` → a checked plan), ``plan_sources`` (the blocks
of a store call → :class:`~tierstore.io.pages.BlockRows` or plans), ``destination_bytes``
(a load destination as its contiguous bytes), ``plan_destinations`` (a load's destinations
and the shaping of its result), ``plan_fragment_destinations`` (a fragment load's
destinations), ``token_blocks``, ``check_start_block``, ``refuse_numpy``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from ..errors import LayoutError, Status
from ..layout import KVLayout
from .pages import BlockRows, FragmentPlan, PageBatch, check_distinct_destinations, plan_fragments


def check_keys(keys) -> list[bytes]:
    """Block keys as a list of 32-byte ``bytes``.

    Raises
    ------
    LayoutError
        For a key of another length or type (e.g. token ids, or a truncated hex decode), or
        ``keys`` that are no sequence (``None``, a single key).
    """
    if type(keys) is list:
        out = keys
    elif isinstance(keys, (bytes, bytearray, str)) or not isinstance(keys, Iterable):
        raise LayoutError(
            f"block keys are a sequence of 32-byte digests (or a LookupResult); got {type(keys).__name__}"
        )
    else:
        out = list(keys)
    if set(map(type, out)) <= {bytes} and set(map(len, out)) <= {32}:  # the common case, at C speed
        return out
    for k in out:
        if not isinstance(k, (bytes, bytearray)) or len(k) != 32:
            raise LayoutError(
                f"block keys are 32-byte SHA-256 digests; got {type(k).__name__} "
                f"of length {len(k) if hasattr(k, '__len__') else '?'} (token ids go to "
                "lookup()/store(), keys to the *_keys methods)"
            )
    return [bytes(k) for k in out]


def check_start_block(start_block: int) -> None:
    """Refuse a negative ``start_block`` (:class:`LayoutError`)."""
    if start_block < 0:
        raise LayoutError(
            f"start_block={start_block}: must be >= 0 (the index of the prompt's first full block given)"
        )


def refuse_numpy(x, what: str) -> None:
    """KV is given as torch tensors; a numpy array is refused by name (its dtype
    has no bfloat16, and a silent conversion would copy)."""
    if isinstance(x, np.ndarray):
        raise LayoutError(
            f"{what}: numpy arrays are not accepted; pass torch tensors (torch.from_numpy(a) "
            "shares the array's memory)"
        )


def plan_block(frags, layout: KVLayout, *, destination: bool) -> FragmentPlan:
    """Check a block's fragments (``layout.num_fragments`` tensors) or a ready
    :class:`FragmentPlan` against ``layout`` and plan the copy: views of one KV pool
    at a constant stride move as one strided copy (:mod:`tierstore.io.pages`).

    Raises
    ------
    LayoutError
        A wrong fragment count, size, dtype or grid (the message names the fragment).
    """
    lay = layout
    if isinstance(frags, FragmentPlan):  # e.g. from KVPagePool.plans(block_ids)
        grid = (
            tuple(frags.strided.shape[:-1])
            if frags.strided is not None and frags.strided.dim() == 3
            else None
        )
        if (
            frags.nbytes != lay.bytes_per_block
            or frags.count not in (None, 1, lay.num_fragments)
            or grid not in (None, lay.fragment_grid)
        ):
            raise LayoutError(
                f"planned block of {frags.count} fragments {grid or ''}, {frags.nbytes} bytes; "
                f"the layout ({lay.block_order}) has {lay.num_fragments} fragments "
                f"{lay.fragment_grid}, {lay.bytes_per_block} bytes"
            )
        if frags.dtype not in (None, lay.dtype, torch.uint8):
            raise LayoutError(f"planned block of dtype {frags.dtype}; the layout's is {lay.dtype}")
        return plan_fragments(frags, destination=destination)  # a reading plan is no destination
    refuse_numpy(frags, "a block's fragments")
    if isinstance(frags, torch.Tensor) or not hasattr(frags, "__len__"):
        raise LayoutError("each block's fragments must be a list of tensors (or a FragmentPlan)")
    if len(frags):
        refuse_numpy(frags[0], "a fragment")
    if len(frags) != lay.num_fragments:
        raise LayoutError(f"expected {lay.num_fragments} fragments, got {len(frags)}")
    plan = plan_fragments(frags, destination=destination)
    if (
        plan.strided is None
        or plan.strided.shape[-1] != lay.fragment_bytes
        or plan.dtype not in (lay.dtype, torch.uint8)
    ):
        lay.check_fragments(frags)  # names the wrong fragment
    return plan


def check_page_batch(batch: PageBatch, layout: KVLayout, *, destination: bool) -> PageBatch:
    """Check a :class:`PageBatch` against ``layout`` once (its blocks are alike: one pool, ids
    checked when it was made); a batch made for reading is refused as a destination.

    Raises
    ------
    LayoutError
        As :func:`plan_block` for one of its blocks.
    """
    if destination and not batch.destination:
        raise LayoutError(
            "this plan was made for reading; plan destinations with destination=True "
            "(e.g. KVPagePool.batch(block_ids, destination=True))"
        )
    if len(batch):
        plan_block(batch[0], layout, destination=destination)
    return batch


def plan_sources(blocks, layout: KVLayout) -> Sequence[FragmentPlan]:
    """Plan each block's bytes as a copy source; checks sizes before anything is stored.

    A tensor of blocks (``(n, *layout.block_shape)`` of the layout's dtype,
    or ``(n, bytes_per_block)`` uint8) becomes one :class:`BlockRows`
    (checked once, copied into memory tiers with one copy per tier); a
    :class:`PageBatch` is checked once; a single 1-D tensor is one block;
    other sequences are planned per block.
    """
    if isinstance(blocks, PageBatch):
        return check_page_batch(blocks, layout, destination=False)
    refuse_numpy(blocks, "kv_blocks")
    bb = layout.bytes_per_block
    if isinstance(blocks, torch.Tensor) and blocks.dim() > 1 and blocks.shape[0] == 0:
        return []  # no new blocks (everything hit): nothing to plan, nothing stored
    if isinstance(blocks, torch.Tensor) and blocks.dim() > 1:
        lay = layout
        if blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.shape[1] == bb:
            rows = blocks
        elif blocks.dtype == lay.dtype and tuple(blocks.shape[1:]) == lay.block_shape:
            rows = (
                blocks.view(blocks.shape[0], -1).view(torch.uint8)
                if blocks.is_contiguous()
                else blocks.contiguous().view(blocks.shape[0], -1).view(torch.uint8)
            )
        else:
            return plan_sources(list(blocks), layout)  # each block checked (and named) on its own
        return BlockRows(rows if rows.is_contiguous() else rows.contiguous())
    if isinstance(blocks, torch.Tensor):
        blocks = [blocks]
    elif blocks is None or isinstance(blocks, (str, bytes)) or not hasattr(blocks, "__iter__"):
        raise LayoutError(
            f"kv_blocks: expected a tensor of blocks (n, *layout.block_shape) or a sequence "
            f"of blocks, got {type(blocks).__name__}"
        )
    out = []
    for b in blocks:
        refuse_numpy(b, "a block")
        if isinstance(b, torch.Tensor):
            raw = layout.as_bytes(b) if b.dtype != torch.uint8 or b.dim() != 1 else b
            if raw.numel() != bb:
                raise LayoutError(f"block of {raw.numel()} bytes; the layout's blocks are {bb} bytes")
            if not raw.is_contiguous():
                raw = raw.contiguous()
            out.append(FragmentPlan.of_bytes(raw))
        else:
            out.append(plan_block(b, layout, destination=False))
    return out


def destination_bytes(d: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A load destination (a ``uint8`` block or a typed block of ``layout``) as
    its ``bytes_per_block`` contiguous bytes (a view).

    Raises
    ------
    LayoutError
        Another size, or not contiguous.
    """
    refuse_numpy(d, "a destination")
    bb = layout.bytes_per_block
    if not d.is_contiguous():  # flattening would copy: the load would fill the copy, not ``d``
        raise LayoutError(
            f"a destination must be contiguous (got shape {tuple(d.shape)}, strides {d.stride()}): "
            f"a load writes {bb} contiguous bytes; load into a contiguous block and copy from it"
        )
    raw = layout.as_bytes(d) if d.dtype != torch.uint8 else d.reshape(-1)
    if raw.numel() != bb or not raw.is_contiguous():
        raise LayoutError(
            f"destination of {raw.numel()} bytes (contiguous={raw.is_contiguous()}); "
            f"blocks are {bb} contiguous bytes"
        )
    return raw


def token_blocks(token_ids, n: int, layout: KVLayout) -> list[np.ndarray]:
    """The first ``n`` full blocks of ``token_ids`` as ``int64`` arrays of ``layout.tokens_per_block``
    (what the index keeps to verify a match when ``verify_tokens`` is on)."""
    arr = np.asarray(token_ids, dtype=np.int64)
    b = layout.tokens_per_block
    return [arr[i * b : (i + 1) * b] for i in range(n)]


def plan_destinations(
    n: int, dests: Sequence[torch.Tensor] | None, layout: KVLayout
) -> tuple[Sequence[FragmentPlan], Callable[[list[Status]], tuple[list[Status], list]]]:
    """Plan the destinations of a load of ``n`` blocks (``KVStore.load``), checked before anything
    is loaded, and the function that turns the load's statuses into its result.

    Parameters
    ----------
    n : int
        Blocks to load.
    dests : sequence of torch.Tensor or None
        One per block, each as :func:`destination_bytes` accepts; ``None``: one new
        ``(n, bytes_per_block)`` ``uint8`` CPU buffer (memory tiers fill it with one copy each).

    Returns
    -------
    plans : sequence of FragmentPlan
        A :class:`BlockRows` for the new buffer, else one plan per destination.
    finish : callable
        ``statuses -> (statuses, tensors)``: per block its destination (a typed block view of the
        new buffer when ``dests`` is ``None``) when ``OK``, else ``None``.

    Raises
    ------
    LayoutError
        Not one destination per block, a destination :func:`destination_bytes` refuses, or two
        destinations that overlap in memory (:func:`~tierstore.io.pages.check_distinct_destinations`).
    """
    if dests is not None and len(dests) != n:
        raise LayoutError(f"{n} keys but {len(dests)} destinations")
    if dests is None:
        plans: Sequence[FragmentPlan] = BlockRows(
            torch.empty((n, layout.bytes_per_block), dtype=torch.uint8), destination=True
        )
        raws = list(plans.rows.unbind(0)) if n else []  # type: ignore[attr-defined]  # BlockRows
    else:
        raws = [destination_bytes(d, layout) for d in dests]
        plans = [FragmentPlan.of_bytes(r, destination=True) for r in raws]
        check_distinct_destinations(plans)

    def finish(st: list[Status]) -> tuple[list[Status], list]:
        outs: list[torch.Tensor | None] = []
        for s, r, d in zip(st, raws, dests if dests is not None else raws):
            if s is not Status.OK:
                outs.append(None)
            elif dests is None:
                outs.append(layout.block_view(r))
            else:
                outs.append(d)
        return st, outs

    return plans, finish


def plan_fragment_destinations(n: int, dest_fragments_per_block, layout: KVLayout) -> Sequence[FragmentPlan]:
    """Plan the destinations of a fragment load of ``n`` blocks (``load_fragments``): per block its
    fragments or a :class:`FragmentPlan` (:func:`plan_block`), no two writing the same bytes.

    Raises
    ------
    LayoutError
        Not one destination per block, a wrong fragment count or size, or overlapping destinations.
    """
    if isinstance(dest_fragments_per_block, PageBatch):  # distinct ids: checked when it was made
        if len(dest_fragments_per_block) != n:
            raise LayoutError(f"{n} blocks to load but {len(dest_fragments_per_block)} destinations")
        return check_page_batch(dest_fragments_per_block, layout, destination=True)
    dests = list(dest_fragments_per_block)
    if len(dests) != n:
        raise LayoutError(f"{n} blocks to load but {len(dests)} destinations")
    plans = [plan_block(frags, layout, destination=True) for frags in dests]
    check_distinct_destinations(plans)
    return plans


__all__ = [
    "check_keys",
    "check_page_batch",
    "check_start_block",
    "destination_bytes",
    "plan_block",
    "plan_destinations",
    "plan_fragment_destinations",
    "plan_sources",
    "refuse_numpy",
    "token_blocks",
]
