"""Log-structured segment store of the NVMe tier: :class:`SegmentStorage`.

Implements the tier seam :class:`tierstore.tiers.storage.BlockStorage` over an
:class:`~tierstore.io.engine.IOEngine`. Blocks of a ``put`` are gathered into
large extents (16 MiB default, :mod:`tierstore.io.batch`) and appended to the
open segment of their placement stream (one open segment per placement, as
FDP reclaim-unit handles want). The on-disk format, durability and recovery
rules are documented in :mod:`tierstore.io.format`.

Space accounting
----------------
* ``capacity_blocks()`` and ``free_blocks()`` are *guaranteed* counts: they
  assume the worst case, one block per extent (one 4 KiB header per block), so
  a sequence of puts totalling ``free_blocks()`` blocks always fits. Batched
  puts pack more (one header per extent), so the store can take more than
  ``free_blocks()`` says, never less.
* ``reserve_segments`` (1 default) erased segments are kept back from puts so
  that garbage collection can always copy live data forward and make progress.
* Space is reclaimed by whole segments only: a sealed segment whose blocks are
  all deleted is punched immediately; otherwise, when a put finds no free
  segment, the sealed segment with the fewest live blocks is compacted (its
  live blocks are copied forward, counted as ``gc_bytes_written`` -> host write
  amplification) and then punched.

Failure semantics (per block, never raised)
-------------------------------------------
* ENOSPC/EFBIG/EDQUOT on write -> ``NO_SPACE``; other write or fdatasync
  errors -> ``IO_ERROR``. A failed block leaves no index entry, and the
  segment's write pointer is rolled back so the log chain stays intact.
* EIO, a short read or a CRC mismatch on read -> ``IO_ERROR`` for that block
  only (a failed multi-block read is retried block by block); the block is
  dropped from the index, so later gets are ``MISS``. Destination bytes of a
  failed block are unspecified but never counted as loaded.
"""
from __future__ import annotations

import dataclasses
import errno
import logging
import threading
from typing import Any, Iterable, Sequence

import torch

from . import format as fmt
from .batch import DEFAULT_EXTENT_BYTES, ExtentPipeline
from .pages import align_up, check_distinct_destinations, plan_fragments
from .engine import IOEngine, alloc_aligned
from .factory import open_engine
from ..errors import ConfigError, CorruptData, InvariantError, LayoutError, Status, TierStoreError
from ..tiers.storage import BlockStorage
from ..units import parse_size

#: Default segment (reclaim unit) size: 256 MiB, a typical FDP reclaim-unit /
#: Navy region-size multiple; configure to the device's RU size.
DEFAULT_SEGMENT_BYTES = 256 << 20
_NOSPACE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Loc:
    seg: int
    offset: int        # absolute device offset of the block payload
    length: int
    crc: int
    seq: int
    placement: int | None
    ns: bytes


@dataclasses.dataclass
class _Seg:
    idx: int
    state: str = "free"          # free | open | sealed
    gen: int = 0
    wp: int = 0                  # write pointer, bytes from segment start
    written: int = 0             # blocks ever written since last reclaim
    live: set = dataclasses.field(default_factory=set)
    placement: int | None = None


@dataclasses.dataclass
class _Plan:
    seg: int
    ext_off: int
    seq: int
    gen: int
    placement: int | None
    idx: list
    entries: list = dataclasses.field(default_factory=list)


class SegmentStorage(BlockStorage):
    """Crash-safe log-structured block store on a file or block device.

    Parameters
    ----------
    path : str or None
        File (created sparse) or block device; ``None`` for ``engine="memory"``.
    capacity_bytes : int or str
        Device bytes to use; rounded down to whole segments.
    block_bytes : int
        Bytes of every block (any size; payload slots are padded to 4096).
    segment_size_bytes : int or str
        Reclaim-unit size, multiple of 4096, at least one 1-block extent.
    engine : {"posix", "uring", "memory", "kvikio"} or IOEngine
        Backend name, or an open engine (not closed by :meth:`close`).
    extent_size_bytes : int or str
        Target extent (and staging buffer) size, 16 MiB default; an extent
        holds at least one block.
    iodepth : int
        I/Os in flight per extent transfer.
    max_io_bytes : int or str
        Largest single I/O (1 MiB default, like fio ``bs=1M``).
    reserve_segments : int
        Erased segments kept back for garbage collection (>= 1).
    verify_on_recovery : bool
        Verify every payload CRC when reopening (default: lazily on read).
    copy_threads : int, optional
        CPUs used to gather/scatter (torch intra-op threads) and checksum
        (Python threads) the blocks of an extent while I/O is in flight
        (default: all CPUs but one, 1 to 4; see
        :func:`tierstore.io.batch.default_copy_threads`).

    Raises
    ------
    ConfigError
        Inconsistent sizes (fewer than ``reserve_segments + 1`` segments, ...).
    OSError
        The device cannot be opened with O_DIRECT.
    """

    def __init__(self, path: str | None, capacity_bytes: int | str, block_bytes: int,
                 segment_size_bytes: int | str = DEFAULT_SEGMENT_BYTES,
                 engine: str | IOEngine = "posix",
                 extent_size_bytes: int | str = DEFAULT_EXTENT_BYTES, iodepth: int = 16,
                 max_io_bytes: int | str = 1 << 20, reserve_segments: int = 1,
                 verify_on_recovery: bool = False, copy_threads: int | None = None):
        cap = parse_size(capacity_bytes, "capacity_bytes")
        seg_b = parse_size(segment_size_bytes, "segment_size_bytes")
        ext_b = parse_size(extent_size_bytes, "extent_size_bytes")
        if block_bytes <= 0:
            raise ConfigError(f"block_bytes={block_bytes}: must be > 0")
        if seg_b <= 0 or seg_b % fmt.ALIGN_BYTES:
            raise ConfigError(f"segment_size_bytes={seg_b}: must be a positive multiple of 4096")
        one = fmt.extent_bytes_for(1, block_bytes)
        if seg_b < one:
            raise ConfigError(f"segment_size_bytes={seg_b}: must hold one block extent ({one} bytes)")
        if reserve_segments < 1:
            raise ConfigError(f"reserve_segments={reserve_segments}: must be >= 1")
        n_seg = cap // seg_b
        if n_seg < reserve_segments + 1:
            raise ConfigError(f"capacity_bytes={cap}: holds {n_seg} segments of {seg_b}; need at "
                              f"least reserve_segments + 1 = {reserve_segments + 1}")
        self.block_bytes = int(block_bytes)
        self.segment_size_bytes = seg_b
        self.n_segments = n_seg
        self.reserve_segments = int(reserve_segments)
        self.extent_size_bytes = min(max(align_up(ext_b, fmt.ALIGN_BYTES), one), seg_b)
        bpe = 1
        while fmt.extent_bytes_for(bpe + 1, self.block_bytes) <= self.extent_size_bytes:
            bpe += 1
        self.blocks_per_extent = bpe
        self._one_block_extent_bytes = one
        if isinstance(engine, IOEngine):
            self.engine = engine
            self._own_engine = False
            if engine.size_bytes < n_seg * seg_b:
                raise ConfigError(f"engine of {engine.size_bytes} bytes < {n_seg * seg_b}")
        else:
            self.engine = open_engine(engine, path, n_seg * seg_b, iodepth=iodepth,
                                      max_io_bytes=max_io_bytes)
            self._own_engine = True
        self.path = path
        self._pipe = ExtentPipeline(self.engine, self.extent_size_bytes, copy_threads)
        self._lock = threading.RLock()
        self._segs = [_Seg(i) for i in range(n_seg)]
        self._index: dict[bytes, _Loc] = {}
        self._open: dict[int | None, int] = {}
        self._next_seq = 1
        self._closed = False
        self._st = {"user_bytes_written": 0, "gc_bytes_written": 0, "bytes_loaded": 0,
                    "extents_written": 0, "put_blocks_ok": 0, "put_no_space": 0,
                    "put_io_error": 0, "get_hits": 0, "get_misses": 0, "get_io_errors": 0,
                    "corrupt_blocks": 0, "segments_reclaimed": 0, "gc_runs": 0,
                    "recovered_blocks": 0, "recovery_dropped_blocks": 0, "preallocate_errors": 0}
        try:
            self._recover(verify_on_recovery)
        except BaseException:
            self._pipe.close()
            if self._own_engine:
                self.engine.close()
            raise

    # ================================================================ seam API
    def capacity_blocks(self) -> int:
        return (self.n_segments - self.reserve_segments) * (self.segment_size_bytes // self._one_block_extent_bytes)

    def free_blocks(self) -> int:
        with self._lock:
            per = self.segment_size_bytes // self._one_block_extent_bytes
            n_free = sum(1 for s in self._segs if s.state == "free")
            total = max(0, n_free - self.reserve_segments) * per
            for si in self._open.values():
                total += (self.segment_size_bytes - self._segs[si].wp) // self._one_block_extent_bytes
            return total

    def put(self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor],
            placements: Sequence[int | None] | None = None,
            ns_digests: Sequence[bytes] | None = None) -> list[Status]:
        """Store whole blocks (1-D uint8 tensors of ``block_bytes``); see
        :meth:`put_fragments`."""
        if len(keys) != len(blocks):
            raise LayoutError(f"{len(keys)} keys but {len(blocks)} blocks")
        for b in blocks:
            if not isinstance(b, torch.Tensor) or b.dtype != torch.uint8 or b.dim() != 1:
                raise LayoutError("each block must be a 1-D uint8 tensor")
        return self.put_fragments(keys, [[b] for b in blocks], placements, ns_digests)

    def get(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor]) -> list[Status]:
        """Load whole blocks into ``dests``; see :meth:`get_fragments`."""
        if len(keys) != len(dests):
            raise LayoutError(f"{len(keys)} keys but {len(dests)} destinations")
        return self.get_fragments(keys, [[d] for d in dests])

    def delete(self, keys: Iterable[bytes]) -> None:
        with self._lock:
            for k in keys:
                loc = self._index.pop(bytes(k), None)
                if loc is None:
                    continue
                seg = self._segs[loc.seg]
                seg.live.discard(bytes(k))
                if seg.state == "sealed" and not seg.live:
                    self._reclaim(seg)

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return bytes(key) in self._index

    def reclaim_group(self, key: bytes) -> list[bytes] | None:
        """Live keys of the *sealed* segment holding ``key`` (evicting all of them
        frees the whole segment, i.e. one reclaim unit); ``None`` if ``key`` is
        absent or its segment is still open."""
        with self._lock:
            loc = self._index.get(bytes(key))
            if loc is None or self._segs[loc.seg].state != "sealed":
                return None
            return list(self._segs[loc.seg].live)

    def keys(self) -> list[bytes]:
        with self._lock:
            return list(self._index)

    def entries(self) -> dict[bytes, tuple[bytes, int]]:
        """``key -> (namespace digest, extent sequence number)`` from the on-disk
        headers (survives restarts); a larger sequence number is a later write."""
        with self._lock:
            return {k: (loc.ns, loc.seq) for k, loc in self._index.items()}

    def write_seq(self) -> int:
        """Sequence number the next extent will get."""
        with self._lock:
            return self._next_seq

    def stats(self) -> dict:
        """Counters; ``host_write_amplification = (user + gc bytes) / user bytes``."""
        with self._lock:
            out = dict(self._st)
            user = out["user_bytes_written"]
            out["host_write_amplification"] = (user + out["gc_bytes_written"]) / user if user else 1.0
            out["blocks"] = len(self._index)
            for state in ("free", "open", "sealed"):
                out[f"segments_{state}"] = sum(1 for s in self._segs if s.state == state)
            out["dead_blocks"] = sum(s.written - len(s.live) for s in self._segs)
            out["extent_size_bytes"] = self.extent_size_bytes
            out["segment_size_bytes"] = self.segment_size_bytes
            out["blocks_per_extent"] = self.blocks_per_extent
            out["engine"] = self.engine.stats()
            return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._pipe.close()
            if self._own_engine:
                self.engine.close()

    # ============================================================ fragment API
    def put_fragments(self, keys: Sequence[bytes], fragments_per_block: Sequence[Sequence[Any]],
                      placements: Sequence[int | None] | None = None,
                      ns_digests: Sequence[bytes] | None = None, *, _gc: bool = False) -> list[Status]:
        """Store blocks given as lists of fragments, without a contiguous copy.

        Parameters
        ----------
        keys : sequence of bytes
            32-byte block hashes.
        fragments_per_block : sequence of sequences
            Per block, its fragments in order (CPU tensors of any dtype/shape,
            ndarrays or bytes-likes), e.g. the 2 x num_layers per-layer K/V
            pieces; their byte sizes must sum to ``block_bytes``. They are
            gathered straight into the staging extent.
        placements : sequence of int or None, optional
            Placement stream per block; one open segment per stream.
        ns_digests : sequence of bytes, optional
            32-byte namespace digest per block, recorded in the extent header.

        Returns
        -------
        list of Status
            ``OK`` (durable: written and fdatasync'ed), ``EXISTS``, ``NO_SPACE``
            or ``IO_ERROR`` per block.

        Raises
        ------
        LayoutError
            Wrong key length, block size or argument lengths (misuse).
        """
        n = len(keys)
        if len(fragments_per_block) != n:
            raise LayoutError(f"{n} keys but {len(fragments_per_block)} fragment lists")
        if placements is not None and len(placements) != n:
            raise LayoutError(f"{n} keys but {len(placements)} placements")
        if ns_digests is not None and len(ns_digests) != n:
            raise LayoutError(f"{n} keys but {len(ns_digests)} ns_digests")
        keys = [bytes(k) for k in keys]
        for k in keys:
            if len(k) != fmt.KEY_BYTES:
                raise LayoutError(f"key of {len(k)} bytes; keys are {fmt.KEY_BYTES} bytes")
        # Check every block's fragments once, before any I/O (a misuse raises
        # here, with nothing written); the copy threads then move each block
        # with one call.
        fragments_per_block = [plan_fragments(frags) for frags in fragments_per_block]
        for p in fragments_per_block:
            if p.nbytes != self.block_bytes:
                raise LayoutError(f"block of {p.nbytes} bytes; this store holds {self.block_bytes}-byte blocks")
        nss = [bytes(d) if d is not None else bytes(32) for d in (ns_digests or [None] * n)]
        for d in nss:
            if len(d) != 32:
                raise LayoutError("ns_digest must be 32 bytes")
        pls = list(placements) if placements is not None else [None] * n
        with self._lock:
            if self._closed:
                raise TierStoreError("SegmentStorage is closed")
            status: list[Status | None] = [None] * n
            seen: set[bytes] = set()
            groups: dict[int | None, list[int]] = {}
            for i, k in enumerate(keys):
                if (k in self._index and not _gc) or k in seen:
                    status[i] = Status.EXISTS
                    continue
                seen.add(k)
                groups.setdefault(pls[i], []).append(i)
            # Plan, write and acknowledge what fits; only then garbage-collect
            # (never with planned-but-unwritten extents outstanding), and retry.
            while groups:
                plans, leftover = self._plan(groups, allow_reserve=_gc)
                self._write_plans(plans, keys, fragments_per_block, nss, status, gc=_gc)
                if leftover and not _gc and self._gc_for_space():
                    groups = leftover
                    continue
                for idx in leftover.values():
                    for i in idx:
                        status[i] = Status.NO_SPACE
                    self._st["put_no_space"] += len(idx)
                break
            out = []
            for s in status:
                out.append(s if s is not None else Status.IO_ERROR)
            return out

    def get_fragments(self, keys: Sequence[bytes], dest_fragments_per_block: Sequence[Sequence[Any]]
                      ) -> list[Status]:
        """Load blocks and scatter each into its destination fragments.

        Parameters
        ----------
        keys : sequence of bytes
            32-byte block hashes.
        dest_fragments_per_block : sequence of sequences
            Per block, writable destinations (tensors of any dtype/shape,
            contiguous or not) whose byte sizes sum to ``block_bytes``.

        Returns
        -------
        list of Status
            ``OK`` (bytes verified and copied), ``MISS`` or ``IO_ERROR``.
            Blocks are read in device order, neighbours coalesced into large
            reads of up to ``extent_size_bytes``.
        """
        n = len(keys)
        if len(dest_fragments_per_block) != n:
            raise LayoutError(f"{n} keys but {len(dest_fragments_per_block)} destination lists")
        dest_fragments_per_block = [plan_fragments(frags, destination=True) for frags in dest_fragments_per_block]
        check_distinct_destinations(dest_fragments_per_block)
        for p in dest_fragments_per_block:
            if p.nbytes != self.block_bytes:
                raise LayoutError(f"destination of {p.nbytes} bytes; blocks are {self.block_bytes} bytes")
        keys = [bytes(k) for k in keys]
        with self._lock:
            if self._closed:
                raise TierStoreError("SegmentStorage is closed")
            status = [Status.MISS] * n
            found = [(self._index[k].offset, i) for i, k in enumerate(keys) if k in self._index]
            found.sort()
            runs = self._runs([(i, self._index[keys[i]]) for _, i in found])
            jobs = [(start, length) for start, length, _ in runs]

            def consume(r: int, view, err) -> None:
                start, _, members = runs[r]
                if err is not None:
                    for i, loc in members:
                        self._read_one(keys[i], loc, dest_fragments_per_block[i], status, i)
                    return
                mv = memoryview(view.numpy())
                # Verify every block first (CRC-32C on the copy threads), then
                # scatter the good ones back to back on torch's threads.
                oks = self._pipe.map(
                    lambda m: fmt.payload_crc(keys[m[0]], mv[m[1].offset - start:m[1].offset - start + m[1].length])
                    == m[1].crc, members)
                good = [m for m, ok in zip(members, oks) if ok]
                self._pipe.scatter_blocks(view, [loc.offset - start for _, loc in good],
                                          [dest_fragments_per_block[i] for i, _ in good])
                for (i, loc), ok in zip(members, oks):
                    if ok:
                        self._st["bytes_loaded"] += loc.length
                        status[i] = Status.OK
                    else:
                        self._drop_corrupt(keys[i], loc)
                        status[i] = Status.IO_ERROR
            self._pipe.read_extents(jobs, consume)
            for s in status:
                if s is Status.OK:
                    self._st["get_hits"] += 1
                elif s is Status.MISS:
                    self._st["get_misses"] += 1
                else:
                    self._st["get_io_errors"] += 1
            return status

    def compact(self) -> bool:
        """Run one garbage-collection step; ``True`` if a segment was freed."""
        with self._lock:
            return self._gc_one()

    # =============================================================== internals
    def _runs(self, members: list[tuple[int, _Loc]]) -> list[tuple[int, int, list]]:
        """Coalesce sorted blocks into aligned reads of at most ``extent_size_bytes``."""
        cap = self.extent_size_bytes
        runs: list[tuple[int, int, list]] = []
        cur: list = []
        start = end = 0
        for i, loc in members:
            slot = fmt.block_slot_bytes(loc.length)
            b_end = loc.offset + slot
            if cur and loc.offset >= end and b_end - start <= cap and loc.offset - end <= 64 * 1024:
                cur.append((i, loc))
                end = b_end
                continue
            if cur:
                runs.append((start, end - start, cur))
            cur, start, end = [(i, loc)], loc.offset, b_end
        if cur:
            runs.append((start, end - start, cur))
        return runs

    def _drop_corrupt(self, key: bytes, loc: _Loc) -> None:
        cur = self._index.get(key)
        if cur is loc:
            del self._index[key]
            self._segs[loc.seg].live.discard(key)
        self._st["corrupt_blocks"] += 1

    def _verify_and_scatter(self, key, loc, view, mv, rel, dests, status, i) -> None:
        if fmt.payload_crc(key, mv[rel:rel + loc.length]) != loc.crc:
            self._drop_corrupt(key, loc)
            status[i] = Status.IO_ERROR
            return
        plan_fragments(dests, destination=True).scatter(view, rel)
        self._st["bytes_loaded"] += loc.length
        status[i] = Status.OK

    def _read_one(self, key, loc, dests, status, i) -> None:
        slot = fmt.block_slot_bytes(loc.length)
        keep, buf = alloc_aligned(slot)
        try:
            self.engine.read(loc.offset, buf[:slot]).get()
        except OSError:
            self._drop_corrupt(key, loc)
            status[i] = Status.IO_ERROR
            return
        self._verify_and_scatter(key, loc, buf, memoryview(keep), 0, dests, status, i)
        del keep

    def _fit(self, remaining: int, want: int) -> int:
        k = min(want, self.blocks_per_extent)
        while k > 0 and fmt.extent_bytes_for(k, self.block_bytes) > remaining:
            k -= 1
        return k

    def _take_free(self, allow_reserve: bool) -> _Seg | None:
        free = [s for s in self._segs if s.state == "free"]
        floor = 0 if allow_reserve else self.reserve_segments
        if len(free) > floor:
            return free[0]
        return None

    def _open_for(self, placement: int | None, allow_reserve: bool, planned: set) -> _Seg | None:
        si = self._open.get(placement)
        if si is not None:
            seg = self._segs[si]
            if self._fit(self.segment_size_bytes - seg.wp, 1):
                return seg
            seg.state = "sealed"
            del self._open[placement]
            if not seg.live and si not in planned:
                self._reclaim(seg)
        seg = self._take_free(allow_reserve)
        if seg is None:
            return None
        if seg.state != "free":
            raise InvariantError(f"segment {seg.idx} taken while {seg.state}")
        # Allocate the whole segment (reclaim unit) before writing into it:
        # writes then never allocate, and a full file system shows here, with
        # nothing written; the puts that needed it get NO_SPACE.
        try:
            self.engine.preallocate(seg.idx * self.segment_size_bytes, self.segment_size_bytes)
        except OSError as exc:
            self._st["preallocate_errors"] += 1
            _log.warning("segment %d: cannot allocate %d bytes (%s); treating as no space",
                         seg.idx, self.segment_size_bytes, exc)
            return None
        seg.state = "open"
        seg.placement = placement
        seg.wp = 0
        seg.written = 0
        seg.live = set()
        self._open[placement] = seg.idx
        return seg

    def _plan(self, groups, allow_reserve: bool) -> tuple[list[_Plan], dict]:
        plans: list[_Plan] = []
        leftover: dict = {}
        planned: set[int] = set()
        for placement, idx in groups.items():
            pending = list(idx)
            while pending:
                seg = self._open_for(placement, allow_reserve, planned)
                if seg is None:
                    leftover[placement] = pending
                    break
                planned.add(seg.idx)
                k = self._fit(self.segment_size_bytes - seg.wp, len(pending))
                take, pending = pending[:k], pending[k:]
                seq = self._next_seq
                self._next_seq += 1
                if seg.wp == 0:
                    seg.gen = seq
                ext_off = seg.idx * self.segment_size_bytes + seg.wp
                seg.wp += fmt.extent_bytes_for(k, self.block_bytes)
                plans.append(_Plan(seg.idx, ext_off, seq, seg.gen, placement, take))
        return plans, leftover

    def _write_plans(self, plans, keys, frags, nss, status, gc: bool) -> None:
        def make_fill(p: _Plan):
            def fill(buf: torch.Tensor) -> int:
                mv = memoryview(buf.numpy())
                hb = fmt.header_bytes_for(len(p.idx))
                slot = fmt.block_slot_bytes(self.block_bytes)
                jobs = [(i, hb + j * slot) for j, i in enumerate(p.idx)]

                # Copies back to back on torch's threads, then CRC-32C on the
                # copy threads (crc32c releases the GIL).
                self._pipe.gather_blocks([frags[i] for i in p.idx], buf, [pos for _, pos in jobs])
                if slot > self.block_bytes:
                    for _, pos in jobs:
                        buf[pos + self.block_bytes:pos + slot].zero_()

                def one(job) -> fmt.BlockEntry:
                    i, pos = job
                    return fmt.BlockEntry(keys[i], nss[i], pos, self.block_bytes,
                                          fmt.payload_crc(keys[i], mv[pos:pos + self.block_bytes]))
                entries = self._pipe.map(one, jobs)
                end = hb + len(jobs) * slot
                fmt.encode_header(mv, p.seq, p.gen, p.ext_off, end - hb, p.placement, entries)
                p.entries = entries
                return end
            return fill

        try:
            results = self._pipe.write_extents((p.ext_off, make_fill(p), p.placement) for p in plans)
        except BaseException:
            # Nothing of this call is acknowledged: give the planned space back so
            # that no hole is left in a segment's chain (recovery stops at one).
            first: dict[int, int] = {}
            for p in plans:
                first[p.seg] = min(first.get(p.seg, p.ext_off), p.ext_off)
            for si, off in first.items():
                seg = self._segs[si]
                seg.wp = off - si * self.segment_size_bytes
                if seg.wp == 0:
                    seg.written = 0
            raise
        # A failed extent breaks its segment's chain: later extents of the same
        # segment in this batch are not acknowledged either; roll the pointer back.
        first_fail: dict[int, int] = {}
        for p, r in zip(plans, results):
            if isinstance(r, BaseException):
                first_fail[p.seg] = min(first_fail.get(p.seg, p.ext_off), p.ext_off)
        sync_err: OSError | None = None
        if len(first_fail) < len({p.seg for p in plans}):
            try:
                self.engine.sync()
            except OSError as exc:
                sync_err = exc
        for p, r in zip(plans, results):
            seg = self._segs[p.seg]
            failed = isinstance(r, BaseException) or (p.seg in first_fail and p.ext_off >= first_fail[p.seg])
            if failed or sync_err is not None:
                err = r if isinstance(r, BaseException) else sync_err
                st = Status.NO_SPACE if isinstance(err, OSError) and err.errno in _NOSPACE_ERRNOS else Status.IO_ERROR
                for i in p.idx:
                    status[i] = st
                self._st["put_no_space" if st is Status.NO_SPACE else "put_io_error"] += len(p.idx)
                continue
            self._st["extents_written"] += 1
            seg.written += len(p.entries)
            for e in p.entries:
                key = e.key
                old = self._index.get(key)
                if old is not None:
                    self._segs[old.seg].live.discard(key)
                self._index[key] = _Loc(p.seg, p.ext_off + e.payload_offset, e.length_bytes,
                                        e.payload_crc32c, p.seq, p.placement, e.ns_digest)
                seg.live.add(key)
                self._st["gc_bytes_written" if gc else "user_bytes_written"] += e.length_bytes
                if not gc:
                    self._st["put_blocks_ok"] += 1
            for i in p.idx:
                status[i] = Status.OK
        for si, off in first_fail.items():
            seg = self._segs[si]
            seg.wp = off - si * self.segment_size_bytes
            if seg.wp == 0:
                seg.written = 0
        # Old copies replaced by GC may leave fully dead sealed segments.
        for p in plans:
            seg = self._segs[p.seg]
            if seg.state == "sealed" and not seg.live:
                self._reclaim(seg)

    def _reclaim(self, seg: _Seg) -> None:
        if seg.live:
            raise InvariantError(f"reclaiming segment {seg.idx} with {len(seg.live)} live blocks")
        base = seg.idx * self.segment_size_bytes
        try:
            self.engine.trim(base, self.segment_size_bytes).get()
        except OSError:
            # Punch failed (e.g. unsupported): the segment is still reusable,
            # recovery ignores stale extents by segment_gen/seq.
            self._st.setdefault("trim_errors", 0)
            self._st["trim_errors"] += 1
        if self._open.get(seg.placement) == seg.idx:
            del self._open[seg.placement]
        seg.state = "free"
        seg.wp = 0
        seg.written = 0
        seg.live = set()
        self._st["segments_reclaimed"] += 1

    def _gc_for_space(self) -> bool:
        """Free segments until a put may take one; ``True`` on progress."""
        progress = False
        while sum(1 for x in self._segs if x.state == "free") <= self.reserve_segments:
            if not self._gc_one():
                break
            progress = True
        return progress

    def _gc_one(self) -> bool:
        cands = [x for x in self._segs if x.state == "sealed"]
        if not cands:
            return False
        victim = min(cands, key=lambda x: len(x.live))
        if not victim.live:
            self._reclaim(victim)
            return True
        if len(victim.live) >= victim.written:
            return False  # nothing dead anywhere: compaction cannot gain space
        self._st["gc_runs"] += 1
        live = sorted(victim.live, key=lambda k: self._index[k].offset)
        for a in range(0, len(live), self.blocks_per_extent):
            chunk = live[a:a + self.blocks_per_extent]
            bufs = [torch.empty(self.block_bytes, dtype=torch.uint8) for _ in chunk]
            locs = [self._index[k] for k in chunk]
            st = self.get_fragments(chunk, [[b] for b in bufs])
            by_pl: dict = {}
            for j, x in enumerate(st):
                if x is Status.OK:
                    by_pl.setdefault(locs[j].placement, []).append(j)
            for pl, js in by_pl.items():
                res = self.put_fragments([chunk[j] for j in js], [[bufs[j]] for j in js],
                                         [pl] * len(js), [locs[j].ns for j in js], _gc=True)
                if any(r is not Status.OK for r in res):
                    return False
        if victim.state == "sealed" and not victim.live:
            self._reclaim(victim)
            return True
        return False

    # ================================================================ recovery
    def _recover(self, verify: bool) -> None:
        S = self.segment_size_bytes
        keep, page = alloc_aligned(max(self.extent_size_bytes, 1 << 20))
        mv = memoryview(keep)
        max_seq = 0
        for seg in self._segs:
            base = seg.idx * S
            pos = 0
            gen = None
            last_seq = -1
            while pos + fmt.ALIGN_BYTES <= S:
                try:
                    self.engine.read(base + pos, page[:fmt.ALIGN_BYTES]).get()
                    hb = fmt.peek_header_bytes(mv[:fmt.ALIGN_BYTES])
                    if pos + hb > S:
                        break
                    if hb > fmt.ALIGN_BYTES:
                        if hb > page.numel():  # written with larger extents: grow, do not stop
                            del mv, page, keep
                            keep, page = alloc_aligned(align_up(hb, fmt.ALIGN_BYTES))
                            mv = memoryview(keep)
                        self.engine.read(base + pos, page[:hb]).get()
                    h = fmt.decode_header(mv[:hb])
                except (OSError, CorruptData):
                    break
                if ((gen is not None and h.segment_gen != gen) or h.seq <= last_seq
                        or h.extent_offset != base + pos or pos + h.total_bytes > S
                        or (gen is None and h.segment_gen != h.seq)):
                    break
                gen = h.segment_gen
                last_seq = h.seq
                # Opened with another block size (another KV layout): refuse,
                # before anything is reclaimed. Serving a cut-off or padded
                # block would be wrong KV; dropping them would lose the store.
                other = {e.length_bytes for e in h.entries} - {self.block_bytes}
                if other:
                    raise ConfigError(
                        f"{self.path or 'device'}: holds blocks of {sorted(other)} bytes, but was opened "
                        f"for {self.block_bytes}-byte blocks (another KV layout?); open it with the "
                        f"layout it was written with, or use another path. Nothing was changed.")
                good = list(h.entries)
                if verify:
                    good = self._verify_extent(base + pos, h)
                    self._st["recovery_dropped_blocks"] += len(h.entries) - len(good)
                for e in good:
                    new = _Loc(seg.idx, base + pos + e.payload_offset, e.length_bytes,
                               e.payload_crc32c, h.seq, h.placement, e.ns_digest)
                    old = self._index.get(e.key)
                    if old is not None:
                        # Two copies (a GC copy-forward cut short by a crash):
                        # the newer wins only if its payload verifies, since a
                        # torn newer copy must not retire the good older one.
                        newer, older = (new, old) if new.seq > old.seq else (old, new)
                        winner = newer if self._verify_loc(e.key, newer) else older
                        if winner is old:
                            continue
                        self._segs[old.seg].live.discard(e.key)
                    self._index[e.key] = new
                    seg.live.add(e.key)
                seg.written += len(h.entries)
                max_seq = max(max_seq, h.seq)
                pos += h.total_bytes
            if pos:
                seg.state = "sealed"
                seg.gen = gen or 0
                seg.wp = pos
        self._next_seq = max_seq + 1
        # Recovered segments are never appended to again (sealed until
        # reclaimed): a torn extent ends a chain, but complete extents of a dead
        # process may lie beyond it with sequence numbers above _next_seq;
        # appending at the chain end could splice them back into the chain.
        self._st["recovered_blocks"] = len(self._index)
        del mv, page, keep
        for seg in self._segs:
            if seg.state == "sealed" and not seg.live:
                self._reclaim(seg)
        self._st["segments_reclaimed"] = 0

    def _verify_loc(self, key: bytes, loc: _Loc) -> bool:
        slot = fmt.block_slot_bytes(loc.length)
        keep, buf = alloc_aligned(slot)
        try:
            self.engine.read(loc.offset, buf[:slot]).get()
        except OSError:
            return False
        return fmt.payload_crc(key, memoryview(keep)[:loc.length]) == loc.crc

    def _verify_extent(self, ext_off: int, h: fmt.ExtentHeader) -> list:
        good = []
        for e in h.entries:
            slot = fmt.block_slot_bytes(e.length_bytes)
            keep, buf = alloc_aligned(slot)
            try:
                self.engine.read(ext_off + e.payload_offset, buf[:slot]).get()
            except OSError:
                continue
            if fmt.payload_crc(e.key, memoryview(keep)[:e.length_bytes]) == e.payload_crc32c:
                good.append(e)
        return good
