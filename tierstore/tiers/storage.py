"""The storage seam: key -> block bytes, under the NVMe tier (and a remote tier).

The block index and the mover talk to flash (or to a remote store) only through
:class:`BlockStorage`. A backend stores whole blocks of exactly
``block_bytes`` bytes under 32-byte keys and reports per-block outcomes as
:class:`~tierstore.errors.Status` values. It never raises for an expected
outcome (no space, a miss, a failed or corrupt read); it raises
:class:`~tierstore.errors.TierStoreError` subclasses only for misuse.

Rules every backend keeps (the index relies on them):

* ``put`` is all-or-nothing *per block*: a block whose status is not ``OK`` left
  no trace, and a block whose status is ``OK`` is readable until it is deleted
  or evicted.
* ``get`` writes into the caller's destination only bytes that passed the
  backend's integrity check; a block that fails returns ``IO_ERROR`` or ``MISS``
  and must never be counted as loaded. A miss is always better than wrong KV.
* A backend owns its space (one owner per resource): when full, it evicts on
  its own terms and reports what left through the listener
  (:class:`tierstore.io.segments.RegionListener`): ``on_reclaim(keys)`` asks
  which to keep, ``on_dropped(keys)`` tells what left.
* ``placements[i]`` is an opaque ``int | None`` stream tag (the FDP layer gives
  it meaning: a placement identifier). Backends without placement ignore it.

The NVMe backend is the log-structured segment store of :mod:`tierstore.io.segments`.
"""
from __future__ import annotations

import abc
from typing import Iterable, Sequence

import torch

from ..errors import Status


class BlockStorage(abc.ABC):
    """Abstract key -> block storage (SGLang's L3 "storage": hash -> bytes).

    Attributes
    ----------
    block_bytes : int
        Size of every stored block in bytes.
    """

    block_bytes: int

    @abc.abstractmethod
    def capacity_blocks(self) -> int:
        """Blocks the backend can hold when empty."""

    def free_blocks(self) -> int:
        """Blocks that a ``put`` can take now without evicting anything (informational)."""
        return 0

    def set_listener(self, listener) -> None:
        """Attach the block index (``on_reclaim``/``on_dropped``); backends that never evict ignore it."""

    def put_fragments(self, keys: Sequence[bytes], fragments_per_block: Sequence, placements=None,
                      ns_digests=None) -> list[Status]:
        """Store blocks given as fragment lists or :class:`~tierstore.io.pages.FragmentPlan` objects.

        The default gathers each block into a contiguous tensor and calls
        :meth:`put`; backends with a staging path override it (one copy).
        """
        blocks = []
        for f in fragments_per_block:
            if hasattr(f, "gather"):  # a FragmentPlan
                b = torch.empty(f.nbytes, dtype=torch.uint8)
                f.gather(b, 0)
            else:
                b = torch.cat([t.reshape(-1).view(torch.uint8).cpu() for t in f])
            blocks.append(b)
        return self.put(keys, blocks, placements, ns_digests)

    def get_fragments(self, keys: Sequence[bytes], dest_fragments_per_block: Sequence, gate=None) -> list[Status]:
        """Load blocks into destination fragment lists or plans (default: via :meth:`get`).

        ``gate(indices)`` (optional) is a context manager around each copy into
        the destinations, yielding ``False`` when the caller gave up.
        """
        def nbytes(f):
            return f.nbytes if hasattr(f, "scatter") else sum(t.numel() * t.element_size() for t in f)

        def scatter(f, b):
            if hasattr(f, "scatter"):  # a FragmentPlan
                f.scatter(b, 0)
                return
            pos = 0
            for t in f:
                n = t.numel() * t.element_size()
                t.copy_(b[pos:pos + n].view(t.dtype).view(t.shape))
                pos += n
        dests = list(dest_fragments_per_block)
        bufs = [torch.empty(nbytes(f), dtype=torch.uint8) for f in dests]
        st = list(self.get(keys, bufs))
        for i, (s, f, b) in enumerate(zip(st, dests, bufs)):
            if s is not Status.OK:
                continue
            if gate is None:
                scatter(f, b)
                continue
            with gate([i]) as go:
                if go:
                    scatter(f, b)
                else:
                    st[i] = Status.MISS
        return st

    @abc.abstractmethod
    def put(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
            placements: Sequence[int | None] | None = None,
            ns_digests: Sequence[bytes] | None = None) -> list[Status]:
        """Store blocks.

        Parameters
        ----------
        keys : sequence of bytes
            32-byte block hashes.
        blocks : sequence of torch.Tensor
            Each a contiguous 1-D ``uint8`` CPU (or CUDA, where the backend
            supports it) tensor of ``block_bytes`` bytes.
        placements : sequence of int or None, optional
            Opaque placement tag per block.
        ns_digests : sequence of bytes, optional
            32-byte namespace digest per block, recorded in on-disk headers.

        Returns
        -------
        list of Status
            ``OK``, ``EXISTS`` or ``NO_SPACE``/``IO_ERROR`` per block.
        """

    @abc.abstractmethod
    def get(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor]) -> list[Status]:
        """Read blocks into ``dests`` (each a contiguous ``uint8`` tensor of
        ``block_bytes``). Returns ``OK``, ``MISS`` or ``IO_ERROR`` per block."""

    @abc.abstractmethod
    def delete(self, keys: Iterable[bytes]) -> None:
        """Forget blocks; unknown keys are ignored. Space may be reclaimed later."""

    @abc.abstractmethod
    def contains(self, key: bytes) -> bool:
        """Whether ``key`` is stored."""

    def keys(self) -> list[bytes]:
        """Keys currently stored (used to rebuild the index after a restart)."""
        return []

    def entries(self) -> dict[bytes, tuple[bytes, int]]:
        """``key -> (namespace digest, write sequence number)`` of every stored block.

        Persistent backends return what their on-disk headers record, so a
        restarted index gets each block's namespace back. The sequence number
        orders writes (larger = later); 0 where the backend keeps no order.
        """
        return {k: (bytes(32), 0) for k in self.keys()}

    def write_seq(self) -> int:
        """Sequence number the next write will get (0 where writes are unordered)."""
        return 0

    def stats(self) -> dict:
        """Backend counters (bytes written/read, host write amplification, ...)."""
        return {}

    def close(self) -> None:
        """Flush and release resources."""
