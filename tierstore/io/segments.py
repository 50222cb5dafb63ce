"""The NVMe tier: a log-structured segment store that owns all of its space.

:class:`SegmentStorage` implements the tier seam
:class:`tierstore.tiers.storage.BlockStorage` over an
:class:`~tierstore.io.engine.IOEngine`, and it is the **one owner of NVMe
space** (CacheLib Navy's ``RegionManager``): it keeps the segments (regions,
one reclaim unit each), the open segment of every placement stream, the clean
pool, region-level eviction and garbage collection. The block index never
decides a segment's fate; it hears what left through a
:class:`RegionListener` callback, and is asked, once per evicted segment,
which of its blocks to keep (copy forward: blocks in use, pinned or predicted
to be reused).

Blocks of a ``put`` are gathered into large extents (16 MiB default,
:mod:`tierstore.io.batch`) and appended to the open segment of their
placement stream (one open segment per placement, as FDP reclaim-unit handles
want). The on-disk format, durability and recovery rules are in
:mod:`tierstore.io.format`.

Segment life cycle (:class:`SegmentState`)
------------------------------------------
``FREE -> OPEN`` (allocated whole with fallocate when a stream needs room; a
full file system shows here, before anything is written) ``-> SEALED`` (its
tail cannot take one more extent) ``-> RECLAIMING`` (every live block is
either copied forward or dropped; in-flight reads of it are waited for)
``-> FREE`` (trimmed: punch hole / NVMe Deallocate). A sealed segment whose
blocks were all deleted goes straight to ``RECLAIMING``.

Region eviction
---------------
When a put finds no free segment (beyond ``reserve_segments`` kept for GC),
the region policy picks a victim among sealed segments: ``"lru"`` (the
segment read or written least recently: Navy's region LRU, touched by
:meth:`SegmentStorage.touch` on hits), ``"fifo"`` (the oldest sealed one; a
reclaim unit's data then dies together) or ``"min_live"`` (the one with the
fewest live blocks, greedy GC). The listener says which live blocks to keep; those
are copied forward into the open segment of their stream (``gc_bytes_written``,
host write amplification), the rest are dropped and reported with
:meth:`RegionListener.on_dropped`.

Locking: ``_lock`` guards metadata only and is never held across I/O. Writers
are serialised by ``_write_lock`` (held across write I/O); reads never take it,
so **reads never queue behind writes**. Reads and writes use separate staging
pipelines. A segment with reads in flight is not trimmed until they finish.

Memory: keys live in a :class:`~tierstore.keytable.KeyTable` and each block's
location in numpy arrays indexed by row (about 70 bytes per block), not in a
Python object per block.

Failure semantics (per block, never raised)
-------------------------------------------
* ENOSPC/EFBIG/EDQUOT on write -> ``NO_SPACE``; other write or fdatasync
  errors -> ``IO_ERROR``. A failed block leaves no index entry, and the
  segment's write pointer is rolled back so the log chain stays intact.
* EIO, a short read or a CRC mismatch on read -> ``IO_ERROR`` for that block
  only (a failed multi-block read is retried block by block); the block is
  dropped, so later gets are ``MISS``. Destination bytes of a failed block
  are never written.

Invalidation log
----------------
:meth:`invalidate_namespace` drops every block of a namespace and appends a
record ``(ns_digest, write_seq)`` to ``<path>.invalidations`` (fsync'ed) for
file-backed stores. Recovery drops blocks of a logged namespace written
before the record's sequence number, so an invalidated namespace is never
served again after a restart; blocks stored under it afterwards are kept.
"""
from __future__ import annotations

import dataclasses
import enum
import errno
import logging
import os
import stat
import struct
import threading
from array import array
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import torch

from . import format as fmt
from . import label as lbl
from .batch import DEFAULT_EXTENT_BYTES, ExtentPipeline
from .pages import FragmentPlan, align_up, check_distinct_destinations, plan_fragments
from .engine import IOEngine, alloc_aligned
from .factory import open_engine
from ..errors import (ConfigError, CorruptData, ForeignDataError, InvariantError, LayoutError, Status,
                      StoreClosedError, TierStoreError)
from ..keytable import KeyTable
from ..tiers.storage import BlockStorage, RegionListener, StoredBlocks
from ..units import format_bytes, parse_size

#: Default segment (reclaim unit) size: 256 MiB, a typical FDP reclaim-unit /
#: Navy region-size multiple; configure to the device's RU size.
DEFAULT_SEGMENT_BYTES = 256 << 20
#: Fewest segments a store may have: region eviction frees one segment at a
#: time, so with fewer a single eviction drops a large share of the tier
#: (issue: a 2 MiB tier of two 1 MiB segments lost half its blocks at once).
MIN_SEGMENTS = 8
#: Segments a tier is cut into when its size allows (region eviction then frees
#: about 1/64 of the tier at a time).
TARGET_SEGMENTS = 64
_NOSPACE_ERRNOS = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
_NO_PLACEMENT = -1
REGION_POLICIES = ("lru", "fifo", "min_live")
_log = logging.getLogger(__name__)
#: Invalidation log record: 32-byte namespace digest, u64 write_seq, u32 CRC-32C of both.
_INVAL_REC = struct.Struct("<32sQI")


class SegmentState(enum.IntEnum):
    """Life cycle of a segment (reclaim unit); see the module doc."""

    FREE = 0
    OPEN = 1
    SEALED = 2
    RECLAIMING = 3


@dataclasses.dataclass
class _Plan:
    seg: int
    ext_off: int
    seq: int
    gen: int
    placement: int | None
    idx: list
    entries: list = dataclasses.field(default_factory=list)


def _consecutive_rows(plans: Sequence[FragmentPlan]) -> torch.Tensor | None:
    """``rows[i:i + k]`` when ``plans`` are the plans of rows ``i .. i + k - 1``
    of one :class:`~tierstore.io.pages.BlockRows` (one copy moves them all), else None."""
    first = getattr(plans[0], "row_of", None) if plans else None
    if first is None or len(plans) < 2:
        return None
    rows, i0 = first
    for j, p in enumerate(plans):
        r = getattr(p, "row_of", None)
        if r is None or r[0] is not rows or r[1] != i0 + j:
            return None
    return rows[i0:i0 + len(plans)]


def _is_device(path: str | None) -> bool:
    """Whether ``path`` is a block or character device (a raw SSD, ``/dev/ngXnY``)."""
    try:
        mode = os.stat(path).st_mode if path else 0
    except OSError:
        return False
    return stat.S_ISBLK(mode) or stat.S_ISCHR(mode)


def choose_segment_size(capacity_bytes: int, block_bytes: int, preferred_bytes: int | None = None,
                        min_segments: int = MIN_SEGMENTS) -> int:
    """Segment (reclaim unit) size for a tier of ``capacity_bytes``.

    ``preferred_bytes`` (a device's RU size) if the tier holds at least
    ``min_segments`` of them; else about ``TARGET_SEGMENTS`` segments, whole
    MiB (or 4 KiB multiples for small tiers), between one one-block extent
    (plus the 4096-byte label segment 0 carries, :mod:`tierstore.io.label`)
    and 256 MiB, and never fewer than ``min_segments``.

    Raises
    ------
    ConfigError
        If the tier cannot hold ``min_segments`` segments of one block each;
        the message gives the minimum capacity.
    """
    one = fmt.extent_bytes_for(1, block_bytes) + lbl.LABEL_BYTES  # segment 0 holds the label and a block
    if preferred_bytes:
        if capacity_bytes // preferred_bytes >= min_segments:
            return int(preferred_bytes)
    if capacity_bytes // min_segments < one:
        raise ConfigError(f"NVMe tier of {capacity_bytes} bytes is too small for region eviction: it needs "
                          f"at least {min_segments} segments of one {block_bytes}-byte block ({one} bytes "
                          f"with its header and the tier's label), i.e. nvme capacity >= {min_segments * one} "
                          "bytes")
    seg = min(DEFAULT_SEGMENT_BYTES, max(one, capacity_bytes // TARGET_SEGMENTS))
    unit = 1 << 20 if seg >= 1 << 20 and one <= (seg >> 20 << 20) else fmt.ALIGN_BYTES
    seg = max(one, seg // unit * unit)
    while capacity_bytes // seg < min_segments:
        seg -= unit if seg - unit >= one else fmt.ALIGN_BYTES
    return seg


class SegmentStorage(BlockStorage):
    """Crash-safe log-structured block store on a file or block device.

    Parameters
    ----------
    path : str or None
        File (created sparse) or block device; ``None`` with an engine object
        or ``engine="memory"``.
    capacity_bytes : int or str
        Device bytes to use; rounded down to whole segments.
    block_bytes : int
        Bytes of every block (any size; payload slots are padded to 4096).
    segment_size_bytes : int or str
        Reclaim-unit size, multiple of 4096, at least one 1-block extent.
    engine : {"posix", "uring", "memory", "kvikio"} or IOEngine
        Backend name, or an open engine (not closed by :meth:`close`).
    extent_size_bytes : int or str
        Target extent (and staging buffer) size, 16 MiB default.
    iodepth : int
        I/Os in flight per extent transfer.
    max_io_bytes : int or str
        Largest single I/O (1 MiB default, like fio ``bs=1M``).
    reserve_segments : int
        Erased segments kept back for garbage collection (>= 1).
    verify_on_recovery : bool
        Verify every payload CRC when reopening (default: lazily on read).
    copy_threads : int, optional
        CPUs used to gather/scatter and checksum next to I/O
        (:func:`tierstore.io.batch.default_copy_threads`).
    region_policy : {"lru", "fifo", "min_live"}
        Which sealed segment region eviction picks (module doc).
    listener : RegionListener, optional
        The block index; may be set later with :meth:`set_listener`.
    invalidation_log : str or None or False
        Path of the invalidation log; default ``<path>.invalidations`` for a
        regular file, none for devices and memory (``False`` disables it).
    owns_engine : bool, optional
        Close an engine object given in ``engine`` on :meth:`close` (default: no).
    label : bool, optional
        Keep the tier's label in device bytes ``[0, 4096)`` (:mod:`tierstore.io.label`):
        the geometry it was formatted with, checked at every open; segment 0's
        chain then starts at byte 4096. Default: when ``path`` is given (a tier
        that outlives the process).
    format : bool
        Allowed to format a target without the label (``tiers.nvme.format``);
        without it such a target is refused before anything is written.
    metadata_placement : int or None
        The placement (FDP PID) of the tier's own writes that carry no block: the
        label and the zeroed chain starts of a format. ``None``: untagged. On an
        FDP device build passes the default handle's PID
        (:meth:`tierstore.fdp.placement.PlacementPolicy.placement_for_metadata`),
        so every write the device sees names a reclaim unit handle.
    keep_data : bool
        ``False``: the accounting mode (:class:`tierstore.config.TiersConfig`):
        every extent is laid out and written as usual with its real header
        (keys, offsets, lengths; payload CRCs 0), but payload bytes are neither
        gathered nor checksummed (the engine, e.g. ``null``, keeps none), and a
        get of a present block reports ``OK`` without reading or scattering.
        Only for experiments at real block sizes; such a store serves no KV.

    Reopening with another capacity keeps the segment size of the label: a
    larger tier keeps every block; a smaller one keeps the blocks of the
    segments that still fit and drops the others, counted in
    ``recovery_dropped_blocks`` and said in one warning.

    Raises
    ------
    ConfigError
        Inconsistent sizes, an unknown region policy, or a file written with
        another block or segment size (nothing is changed then).
    ForeignDataError
        A labelled tier's target holds data tierstore did not write, and
        ``format`` is not set (nothing is written).
    StoreLockedError
        Another store holds the file (:func:`tierstore.io._fileops.lock_exclusive`).
    OSError
        The device cannot be opened with O_DIRECT.
    """

    def __init__(self, path: str | None, capacity_bytes: int | str, block_bytes: int,
                 segment_size_bytes: int | str = DEFAULT_SEGMENT_BYTES,
                 engine: str | IOEngine = "posix",
                 extent_size_bytes: int | str = DEFAULT_EXTENT_BYTES, iodepth: int = 16,
                 max_io_bytes: int | str = 1 << 20, reserve_segments: int = 1,
                 verify_on_recovery: bool = False, copy_threads: int | None = None,
                 region_policy: str = "lru", listener: RegionListener | None = None,
                 invalidation_log: str | None | bool = None, owns_engine: bool | None = None,
                 keep_data: bool = True, label: bool | None = None, format: bool = False,
                 metadata_placement: int | None = None):
        cap = parse_size(capacity_bytes, "capacity_bytes")
        self.keep_data = bool(keep_data)
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
        if region_policy not in REGION_POLICIES:
            raise ConfigError(f"region_policy={region_policy!r}: accepted values are {list(REGION_POLICIES)}")
        n_seg = cap // seg_b
        if n_seg < reserve_segments + 1:
            raise ConfigError(f"capacity_bytes={cap}: holds {n_seg} segments of {seg_b}; need at "
                              f"least reserve_segments + 1 = {reserve_segments + 1}")
        self.block_bytes = int(block_bytes)
        self.segment_size_bytes = seg_b
        self.n_segments = n_seg
        self.reserve_segments = int(reserve_segments)
        self.region_policy = region_policy
        self.extent_size_bytes = min(max(align_up(ext_b, fmt.ALIGN_BYTES), one), seg_b)
        bpe = 1
        while fmt.extent_bytes_for(bpe + 1, self.block_bytes) <= self.extent_size_bytes:
            bpe += 1
        self.blocks_per_extent = bpe
        self._slot_bytes = fmt.block_slot_bytes(self.block_bytes)
        self._one_block_extent_bytes = one
        self._labelled = (path is not None) if label is None else bool(label)
        self._metadata_placement = metadata_placement
        #: where segment 0's chain starts (after the label)
        self._start0 = lbl.LABEL_BYTES if self._labelled else 0
        if seg_b < self._start0 + one:
            raise ConfigError(f"segment_size_bytes={seg_b}: must hold the label and one block extent "
                              f"({self._start0 + one} bytes)")
        if isinstance(engine, IOEngine):
            self.engine = engine
            self._own_engine = bool(owns_engine)
            if engine.size_bytes < n_seg * seg_b:
                raise ConfigError(f"engine of {engine.size_bytes} bytes < {n_seg * seg_b}")
        else:
            size = n_seg * seg_b
            if path is not None and engine != "memory":
                old = lbl.check_target(path, format=format).label
                if old is not None and old.segment_size_bytes == seg_b:  # reach the segments a shrink drops
                    size = max(size, old.n_segments * seg_b)
            self.engine = open_engine(engine, path, size, iodepth=iodepth, max_io_bytes=max_io_bytes)
            self._own_engine = True
        self.path = path
        self._listener = listener
        # Two pipelines: reads never wait for a writer's staging buffers.
        self._wpipe = ExtentPipeline(self.engine, self.extent_size_bytes, copy_threads)
        self._rpipe = ExtentPipeline(self.engine, self.extent_size_bytes, copy_threads)
        self._lock = threading.Lock()              # metadata only, never across I/O
        self._write_lock = threading.RLock()       # one writer at a time (across write I/O)
        self._read_lock = threading.Lock()         # one user of the read pipeline at a time
        self._readers_done = threading.Condition(self._lock)
        # --- per segment
        self._state = np.zeros(n_seg, dtype=np.uint8)
        self._gen = np.zeros(n_seg, dtype=np.int64)
        self._wp = np.zeros(n_seg, dtype=np.int64)
        self._written = np.zeros(n_seg, dtype=np.int64)
        self._live = np.zeros(n_seg, dtype=np.int64)
        self._seg_placement = np.full(n_seg, _NO_PLACEMENT, dtype=np.int64)
        self._readers = np.zeros(n_seg, dtype=np.int64)
        self._sealed_at = np.zeros(n_seg, dtype=np.int64)   # seq when sealed: FIFO order
        self._touched = np.zeros(n_seg, dtype=np.int64)     # last write or hit (a counter): LRU order
        self._ticks = 0
        self._members: list[array] = [array("i") for _ in range(n_seg)]
        self._open: dict[int | None, int] = {}
        self._to_reclaim: list[int] = []
        # --- per block (row of the key table)
        rows = max(1024, self.capacity_blocks() + 1)
        self._table = KeyTable(rows)
        self._off = np.zeros(self._table.capacity_rows, dtype=np.int64)
        self._crc = np.zeros(self._table.capacity_rows, dtype=np.uint32)
        self._seq = np.zeros(self._table.capacity_rows, dtype=np.int64)
        self._ns_id = np.zeros(self._table.capacity_rows, dtype=np.int32)
        self._ns_list: list[bytes] = [bytes(32)]
        self._ns_ids: dict[bytes, int] = {bytes(32): 0}
        self._next_seq = 1
        self._closed = False
        self._warned_no_space = 0
        self._st = {"user_bytes_written": 0, "gc_bytes_written": 0, "bytes_loaded": 0,
                    "extents_written": 0, "put_blocks_ok": 0, "put_no_space": 0,
                    "put_io_error": 0, "get_hits": 0, "get_misses": 0, "get_io_errors": 0,
                    "corrupt_blocks": 0, "segments_reclaimed": 0, "gc_runs": 0,
                    "regions_evicted": 0, "region_evicted_blocks": 0, "region_kept_blocks": 0,
                    "recovered_blocks": 0, "recovery_dropped_blocks": 0, "preallocate_errors": 0,
                    "trim_errors": 0, "invalidated_blocks": 0, "recovery_invalidated_blocks": 0}
        if invalidation_log is None:
            invalidation_log = (path + ".invalidations") if (path and os.path.isfile(path)) else False
        self._inval_path = invalidation_log or None
        try:
            old = self._open_label(format) if self._labelled else None
            self._recover(verify_on_recovery)
            if old is not None and old.n_segments > n_seg:
                self._drop_beyond(old.n_segments)
            if self._labelled and (old is None or old.n_segments != n_seg):
                self._write_label()
        except BaseException:
            self._wpipe.close()
            self._rpipe.close()
            if self._own_engine:
                self.engine.close()
                if not isinstance(engine, IOEngine) and getattr(self.engine, "created", False):
                    os.unlink(path)  # a file this open created: leave nothing behind
            raise

    # ================================================================ seam API
    def set_listener(self, listener: RegionListener | None) -> None:
        """Attach the block index (see :class:`RegionListener`)."""
        self._listener = listener

    def capacity_blocks(self) -> int:
        """Blocks the store can hold when empty (batched puts pack more)."""
        per = self.segment_size_bytes // self._one_block_extent_bytes
        per0 = (self.segment_size_bytes - self._start0) // self._one_block_extent_bytes
        return (self.n_segments - self.reserve_segments) * per - (per - per0)

    def free_blocks(self) -> int:
        """Blocks that fit without evicting anything (worst case: one per extent)."""
        with self._lock:
            per = self.segment_size_bytes // self._one_block_extent_bytes
            n_free = int((self._state == SegmentState.FREE).sum())
            total = max(0, n_free - self.reserve_segments) * per
            if total and self._state[0] == SegmentState.FREE:  # segment 0 holds the label
                total -= per - (self.segment_size_bytes - self._start0) // self._one_block_extent_bytes
            for si in self._open.values():
                total += (self.segment_size_bytes - int(self._wp[si])) // self._one_block_extent_bytes
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
        """Forget blocks; a sealed segment left without live blocks is reclaimed."""
        empty: list[int] = []
        with self._lock:
            for k in keys:
                row = self._table.remove(bytes(k))
                if row < 0:
                    continue
                si = int(self._off[row]) // self.segment_size_bytes
                self._live[si] -= 1
                if self._live[si] == 0 and self._state[si] == SegmentState.SEALED:
                    self._state[si] = SegmentState.RECLAIMING
                    empty.append(si)
        for si in empty:
            self._finish_reclaim(si)

    def locate(self, key: bytes) -> tuple[int, int] | None:
        """``(segment, payload device offset)`` of ``key``, or ``None`` (for tools and tests)."""
        with self._lock:
            row = self._table.get(bytes(key))
            if row < 0:
                return None
            off = int(self._off[row])
            return off // self.segment_size_bytes, off

    def touch(self, keys: Sequence[bytes]) -> None:
        """Record a hit on ``keys`` for the region LRU (Navy's ``RegionManager::touch``)."""
        with self._lock:
            rows = self._table.get_many(keys)
            rows = rows[rows >= 0]
            if rows.size:
                self._ticks += 1
                self._touched[np.unique(self._off[rows] // self.segment_size_bytes)] = self._ticks

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return self._table.get(bytes(key)) >= 0

    def keys(self) -> list[bytes]:
        with self._lock:
            return self._table.keys_of(self._table.rows())

    def entries(self) -> dict[bytes, tuple[bytes, int]]:
        """``key -> (namespace digest, extent sequence number)`` from the on-disk
        headers (survives restarts); a larger sequence number is a later write."""
        with self._lock:
            rows = self._table.rows()
            keys = self._table.keys_of(rows)
            return {k: (self._ns_list[int(self._ns_id[r])], int(self._seq[r])) for k, r in zip(keys, rows)}

    def scan(self) -> StoredBlocks:
        """Every stored block: ``(keys, namespace digest per key, write seq per key)``.

        What a restarted index adopts (one pass, no per-block objects kept)."""
        with self._lock:
            rows = self._table.rows()
            keys = self._table.keys_of(rows)
            nss = [self._ns_list[i] for i in self._ns_id[rows].tolist()]
            return StoredBlocks(keys, nss, self._seq[rows].copy())

    def write_seq(self) -> int:
        """Sequence number the next extent will get."""
        with self._lock:
            return self._next_seq

    def __len__(self) -> int:
        return len(self._table)

    def stats(self) -> dict:
        """Counters; ``host_write_amplification = (user + gc bytes) / user bytes``."""
        with self._lock:
            out = dict(self._st)
            user = out["user_bytes_written"]
            out["host_write_amplification"] = (user + out["gc_bytes_written"]) / user if user else 1.0
            out["blocks"] = len(self._table)
            for state in SegmentState:
                out[f"segments_{state.name.lower()}"] = int((self._state == state).sum())
            out["dead_blocks"] = int((self._written - self._live).sum())
            out["extent_size_bytes"] = self.extent_size_bytes
            out["segment_size_bytes"] = self.segment_size_bytes
            out["blocks_per_extent"] = self.blocks_per_extent
            out["index_bytes"] = self.index_nbytes()
            out["engine"] = self.engine.stats()
            return out

    def index_nbytes(self) -> int:
        """Bytes of in-memory metadata: key table, per-block and per-segment arrays."""
        per_row = self._off.nbytes + self._crc.nbytes + self._seq.nbytes + self._ns_id.nbytes
        members = sum(m.itemsize * len(m) for m in self._members)
        per_seg = sum(a.nbytes for a in (self._state, self._gen, self._wp, self._written, self._live,
                                         self._seg_placement, self._readers, self._sealed_at))
        return self._table.nbytes + per_row + members + per_seg

    def close(self) -> None:
        with self._write_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            self._wpipe.close()
            self._rpipe.close()
            if self._own_engine:
                self.engine.close()

    # ============================================================ fragment API
    def put_fragments(self, keys: Sequence[bytes], fragments_per_block: Sequence[Sequence[Any]],
                      placements: Sequence[int | None] | None = None,
                      ns_digests: Sequence[bytes] | None = None) -> list[Status]:
        """Store blocks given as lists of fragments (or plans), without a contiguous copy.

        Parameters
        ----------
        keys : sequence of bytes
            32-byte block hashes.
        fragments_per_block : sequence
            Per block, its fragments in order (CPU tensors of any dtype/shape,
            ndarrays or bytes-likes) or a :class:`~tierstore.io.pages.FragmentPlan`;
            their byte sizes must sum to ``block_bytes``. They are gathered
            straight into the staging extent.
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
            Wrong key length, block size or argument lengths (misuse; nothing
            is written).
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
        plans = [plan_fragments(frags) for frags in fragments_per_block]
        for p in plans:
            if p.nbytes != self.block_bytes:
                raise LayoutError(f"block of {p.nbytes} bytes; this store holds {self.block_bytes}-byte blocks")
        nss = [bytes(d) if d is not None else bytes(32) for d in (ns_digests or [None] * n)]
        for d in nss:
            if len(d) != 32:
                raise LayoutError("ns_digest must be 32 bytes")
        pls = list(placements) if placements is not None else [None] * n
        with self._write_lock:
            return self._put_locked(keys, plans, pls, nss, gc=False)

    def get_fragments(self, keys: Sequence[bytes], dest_fragments_per_block: Sequence[Sequence[Any]],
                      gate: Callable[[], Any] | None = None) -> list[Status]:
        """Load blocks and scatter each into its destination fragments.

        Parameters
        ----------
        keys : sequence of bytes
            32-byte block hashes.
        dest_fragments_per_block : sequence
            Per block, writable destinations (tensors of any dtype/shape,
            contiguous or not) whose byte sizes sum to ``block_bytes``, or a
            destination :class:`~tierstore.io.pages.FragmentPlan`.
        gate : callable, optional
            ``gate(indices)`` returns a context manager entered around each
            scatter of the blocks at ``indices``; it yields ``False`` when the
            caller gave up (a deadline passed), and those blocks are then
            reported ``MISS`` and their destinations left untouched.

        Returns
        -------
        list of Status
            ``OK`` (bytes verified and copied), ``MISS`` or ``IO_ERROR``.
            Blocks are read in device order, neighbours coalesced into reads of
            up to ``extent_size_bytes``.
        """
        n = len(keys)
        if len(dest_fragments_per_block) != n:
            raise LayoutError(f"{n} keys but {len(dest_fragments_per_block)} destination lists")
        dests = [plan_fragments(frags, destination=True) for frags in dest_fragments_per_block]
        check_distinct_destinations(dests)
        for p in dests:
            if p.nbytes != self.block_bytes:
                raise LayoutError(f"destination of {p.nbytes} bytes; blocks are {self.block_bytes} bytes")
        keys = [bytes(k) for k in keys]
        status = [Status.MISS] * n
        with self._lock:
            if self._closed:
                raise StoreClosedError("SegmentStorage is closed")
            rows = self._table.get_many(keys)
            found = [(int(self._off[r]), i, int(self._crc[r])) for i, r in enumerate(rows.tolist()) if r >= 0]
            segs = [off // self.segment_size_bytes for off, _, _ in found]
            for si in segs:
                self._readers[si] += 1
        bad: list[tuple[bytes, int]] = []
        try:
            if not self.keep_data:  # accounting mode: present blocks are hits, no bytes move
                for _, i, _ in found:
                    status[i] = Status.OK
                found = []
            found.sort()
            runs = self._runs(found)
            with self._read_lock:
                self._read_runs(keys, runs, dests, status, bad, gate)
        finally:
            with self._lock:
                for si in segs:
                    self._readers[si] -= 1
                self._readers_done.notify_all()
        dropped = self._drop_corrupt(bad) if bad else []
        with self._lock:
            for s in status:
                if s is Status.OK:
                    self._st["get_hits"] += 1
                    self._st["bytes_loaded"] += self.block_bytes
                elif s is Status.MISS:
                    self._st["get_misses"] += 1
                else:
                    self._st["get_io_errors"] += 1
        if dropped and self._listener is not None:
            self._listener.on_dropped(dropped)
        return status

    def compact(self) -> bool:
        """Evict one region now (copying forward what the listener keeps);
        ``True`` if a segment was freed."""
        with self._write_lock:
            return self._evict_region()

    def invalidate_namespace(self, ns_digest: bytes) -> int:
        """Drop every block of ``ns_digest``, durably (module doc). Returns blocks dropped.

        Raises
        ------
        LayoutError
            If ``ns_digest`` is not 32 bytes.
        OSError
            If the invalidation log cannot be written (nothing is dropped then).
        """
        ns_digest = bytes(ns_digest)
        if len(ns_digest) != 32:
            raise LayoutError("ns_digest must be 32 bytes")
        with self._write_lock:
            with self._lock:
                seq = self._next_seq
                nid = self._ns_ids.get(ns_digest)
            if self._inval_path is not None:
                self._append_invalidation(ns_digest, seq)
            if nid is None:
                return 0
            with self._lock:
                rows = self._table.rows()
                rows = rows[self._ns_id[rows] == nid]
                keys = self._table.keys_of(rows)
            self.delete(keys)
            with self._lock:
                self._st["invalidated_blocks"] += len(keys)
            return len(keys)

    # =============================================================== internals
    def _put_locked(self, keys, plans, pls, nss, gc: bool) -> list[Status]:
        n = len(keys)
        with self._lock:
            if self._closed:
                raise StoreClosedError("SegmentStorage is closed")
            status: list[Status | None] = [None] * n
            seen: set[bytes] = set()
            groups: dict[int | None, list[int]] = {}
            present = self._table.get_many(keys) if not gc else None
            for i, k in enumerate(keys):
                if (present is not None and present[i] >= 0) or k in seen:
                    status[i] = Status.EXISTS
                    continue
                seen.add(k)
                groups.setdefault(pls[i], []).append(i)
        # Plan, write and acknowledge what fits; then evict a region and retry.
        while groups:
            with self._lock:
                plan, leftover = self._plan(groups, allow_reserve=gc)
            self._write_plans(plan, keys, plans, nss, status, gc)
            if leftover and not gc and self._evict_region():
                groups = leftover
                continue
            refused = sum(len(idx) for idx in leftover.values())
            for idx in leftover.values():
                for i in idx:
                    status[i] = Status.NO_SPACE
            if refused:
                with self._lock:
                    self._st["put_no_space"] += refused
            break
        return [s if s is not None else Status.IO_ERROR for s in status]

    def _read_runs(self, keys, runs, dests, status, bad, gate) -> None:
        def consume(r: int, view, err) -> None:
            start, _, members = runs[r]
            if err is not None:
                for off, i, crc in members:
                    self._read_one(keys[i], off, crc, dests[i], status, i, bad, gate)
                return
            mv = memoryview(view.numpy())
            oks = self._rpipe.map(lambda m: fmt.payload_crc(keys[m[1]], mv[m[0] - start:m[0] - start + self.block_bytes])
                                  == m[2], members)
            good = [m for m, ok in zip(members, oks) if ok]
            for (off, i, _), ok in zip(members, oks):
                if not ok:
                    bad.append((keys[i], off))
                    status[i] = Status.IO_ERROR
            self._scatter(view, [(off - start, i) for off, i, _ in good], dests, status, gate)
        self._rpipe.read_extents([(start, length) for start, length, _ in runs], consume)

    def _scatter(self, view, items, dests, status, gate) -> None:
        if not items:
            return
        if gate is None:
            self._rpipe.scatter_blocks(view, [rel for rel, _ in items], [dests[i] for _, i in items])
            for _, i in items:
                status[i] = Status.OK
            return
        with gate([i for _, i in items]) as go:
            if not go:
                return
            self._rpipe.scatter_blocks(view, [rel for rel, _ in items], [dests[i] for _, i in items])
            for _, i in items:
                status[i] = Status.OK

    def _runs(self, members: list[tuple[int, int, int]]) -> list[tuple[int, int, list]]:
        """Coalesce sorted ``(offset, index, crc)`` into reads of at most ``extent_size_bytes``."""
        cap = self.extent_size_bytes
        slot = self._slot_bytes
        runs: list[tuple[int, int, list]] = []
        cur: list = []
        start = end = 0
        for m in members:
            off = m[0]
            b_end = off + slot
            if cur and off >= end and b_end - start <= cap and off - end <= 64 * 1024:
                cur.append(m)
                end = b_end
                continue
            if cur:
                runs.append((start, end - start, cur))
            cur, start, end = [m], off, b_end
        if cur:
            runs.append((start, end - start, cur))
        return runs

    def _read_one(self, key, off, crc, dest: FragmentPlan, status, i, bad, gate) -> None:
        keep, buf = alloc_aligned(self._slot_bytes)
        try:
            self.engine.read(off, buf[:self._slot_bytes]).get()
        except OSError:
            bad.append((key, off))
            status[i] = Status.IO_ERROR
            return
        if fmt.payload_crc(key, memoryview(keep)[:self.block_bytes]) != crc:
            bad.append((key, off))
            status[i] = Status.IO_ERROR
            return
        self._scatter(buf, [(0, i)], {i: dest}, status, gate)
        del keep

    def _drop_corrupt(self, bad: list[tuple[bytes, int]]) -> list[bytes]:
        """Forget blocks whose read failed, if the table still points at the bad copy."""
        dropped = []
        empty = []
        with self._lock:
            for key, off in bad:
                self._st["corrupt_blocks"] += 1
                row = self._table.get(key)
                if row < 0 or int(self._off[row]) != off:
                    continue
                self._table.remove(key)
                si = off // self.segment_size_bytes
                self._live[si] -= 1
                dropped.append(key)
                if self._live[si] == 0 and self._state[si] == SegmentState.SEALED:
                    self._state[si] = SegmentState.RECLAIMING
                    empty.append(si)
        for si in empty:
            self._finish_reclaim(si)
        return dropped

    def _fit(self, remaining: int, want: int) -> int:
        k = min(want, self.blocks_per_extent)
        while k > 0 and fmt.extent_bytes_for(k, self.block_bytes) > remaining:
            k -= 1
        return k

    def _take_free(self, allow_reserve: bool) -> int | None:
        free = np.flatnonzero(self._state == SegmentState.FREE)
        floor = 0 if allow_reserve else self.reserve_segments
        return int(free[0]) if free.size > floor else None

    def _seal(self, si: int, planned: set) -> None:
        self._state[si] = SegmentState.SEALED
        self._sealed_at[si] = self._next_seq
        pl = int(self._seg_placement[si])
        self._open.pop(None if pl == _NO_PLACEMENT else pl, None)
        if self._live[si] == 0 and si not in planned and self._written[si] > 0:
            # everything in it died before it filled: reclaim at once (after this plan)
            self._state[si] = SegmentState.RECLAIMING
            self._to_reclaim.append(si)

    def _open_for(self, placement: int | None, allow_reserve: bool, planned: set) -> int | None:
        si = self._open.get(placement)
        if si is not None:
            if self._fit(self.segment_size_bytes - int(self._wp[si]), 1):
                return si
            self._seal(si, planned)
        si = self._take_free(allow_reserve)
        if si is None:
            return None
        # Allocate the whole segment (reclaim unit) before writing into it:
        # writes then never allocate, and a full file system shows here, with
        # nothing written; the puts that needed it get NO_SPACE. fallocate is
        # I/O: ``_lock`` is released around it (readers must not wait for it).
        # The segment is claimed first (OPEN, no blocks yet); only writers take
        # free segments, and they are serialised by ``_write_lock``.
        self._state[si] = SegmentState.OPEN
        err = self._unlocked(self.engine.preallocate, si * self.segment_size_bytes, self.segment_size_bytes)
        if err is not None:
            exc = err
            self._state[si] = SegmentState.FREE
            self._st["preallocate_errors"] += 1
            if self._warned_no_space == 0:
                _log.warning("segment %d: cannot allocate %d bytes (%s); treating as no space "
                             "(logged once; see the preallocate_errors counter)",
                             si, self.segment_size_bytes, exc)
            self._warned_no_space += 1
            return None
        self._state[si] = SegmentState.OPEN
        self._seg_placement[si] = _NO_PLACEMENT if placement is None else int(placement)
        self._wp[si] = self._chain_start(si)
        self._written[si] = 0
        self._live[si] = 0
        self._members[si] = array("i")
        self._open[placement] = si
        return si

    def _unlocked(self, fn, *args) -> OSError | None:
        """Run ``fn(*args)`` (an I/O) with ``_lock`` released; the caller holds
        ``_lock`` and ``_write_lock``. Returns the ``OSError`` raised, if any."""
        self._lock.release()
        try:
            fn(*args)
        except OSError as exc:
            return exc
        finally:
            self._lock.acquire()
        return None

    def _plan(self, groups, allow_reserve: bool) -> tuple[list[_Plan], dict]:
        plans: list[_Plan] = []
        leftover: dict = {}
        planned: set[int] = set()
        self._to_reclaim: list[int] = []
        for placement, idx in groups.items():
            pending = list(idx)
            while pending:
                si = self._open_for(placement, allow_reserve, planned)
                if si is None:
                    leftover[placement] = pending
                    break
                planned.add(si)
                k = self._fit(self.segment_size_bytes - int(self._wp[si]), len(pending))
                take, pending = pending[:k], pending[k:]
                seq = self._next_seq
                self._next_seq += 1
                if self._wp[si] == self._chain_start(si):
                    self._gen[si] = seq
                ext_off = si * self.segment_size_bytes + int(self._wp[si])
                self._wp[si] += fmt.extent_bytes_for(k, self.block_bytes)
                plans.append(_Plan(si, ext_off, seq, int(self._gen[si]), placement, take))
        return plans, leftover

    def _write_plans(self, plans: list[_Plan], keys, frags, nss, status, gc: bool) -> None:
        to_reclaim = list(self._to_reclaim)
        self._to_reclaim = []
        if not plans:
            for si in to_reclaim:
                self._finish_reclaim(si)
            return
        slot = self._slot_bytes

        def make_fill(p: _Plan):
            def fill(buf: torch.Tensor) -> int:
                mv = memoryview(buf.numpy())
                hb = fmt.header_bytes_for(len(p.idx))
                jobs = [(i, hb + j * slot) for j, i in enumerate(p.idx)]
                # Copies back to back on torch's threads, then CRC-32C on the
                # copy threads (crc32c releases the GIL).
                mine = [frags[i] for i in p.idx]
                bb = self.block_bytes
                k = len(mine)
                if not self.keep_data:  # accounting mode: the real header, payload and padding unwritten
                    p.entries = [fmt.BlockEntry(keys[i], nss[i], pos, bb, 0) for i, pos in jobs]
                    end = hb + len(jobs) * slot
                    fmt.encode_header(mv, p.seq, p.gen, p.ext_off, end - hb, p.placement, p.entries)
                    return end
                rows = _consecutive_rows(mine)
                if rows is not None:  # rows i..i+k of one BlockRows: one strided copy
                    buf.as_strided((k, bb), (slot, 1), buf.storage_offset() + hb).copy_(rows)
                else:
                    self._wpipe.gather_blocks(mine, buf, [pos for _, pos in jobs])
                if slot > bb:
                    buf.as_strided((k, slot - bb), (slot, 1), buf.storage_offset() + hb + bb).zero_()

                def one(job) -> fmt.BlockEntry:
                    i, pos = job
                    return fmt.BlockEntry(keys[i], nss[i], pos, self.block_bytes,
                                          fmt.payload_crc(keys[i], mv[pos:pos + self.block_bytes]))
                entries = self._wpipe.map(one, jobs)
                end = hb + len(jobs) * slot
                fmt.encode_header(mv, p.seq, p.gen, p.ext_off, end - hb, p.placement, entries)
                p.entries = entries
                return end
            return fill

        try:
            results = self._wpipe.write_extents((p.ext_off, make_fill(p), p.placement) for p in plans)
        except BaseException:
            # Nothing of this call is acknowledged: give the planned space back so
            # that no hole is left in a segment's chain (recovery stops at one).
            with self._lock:
                self._rollback(plans, {p.seg: p.ext_off for p in reversed(plans)})
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
        errs = [r for r in results if isinstance(r, BaseException)] + ([sync_err] if sync_err else [])
        if errs:  # outside the lock: the cause of the IO_ERROR / NO_SPACE statuses, once per call
            _log.warning("segment store: %d of %d extents not acknowledged: %r", len(first_fail) or len(plans),
                        len(plans), errs[0])
        with self._lock:
            for p, r in zip(plans, results):
                failed = isinstance(r, BaseException) or (p.seg in first_fail and p.ext_off >= first_fail[p.seg])
                if failed or sync_err is not None:
                    err = r if isinstance(r, BaseException) else sync_err
                    st = (Status.NO_SPACE if isinstance(err, OSError) and err.errno in _NOSPACE_ERRNOS
                          else Status.IO_ERROR)
                    for i in p.idx:
                        status[i] = st
                    self._st["put_no_space" if st is Status.NO_SPACE else "put_io_error"] += len(p.idx)
                    continue
                self._commit(p, gc)
                for i in p.idx:
                    status[i] = Status.OK
            if first_fail or sync_err is not None:
                self._rollback(plans, first_fail if sync_err is None else
                               {p.seg: p.ext_off for p in reversed(plans)})
            for p in plans:  # old copies replaced by GC may leave dead sealed segments
                if self._state[p.seg] == SegmentState.SEALED and self._live[p.seg] == 0:
                    self._state[p.seg] = SegmentState.RECLAIMING
                    to_reclaim.append(p.seg)
        for si in to_reclaim:
            self._finish_reclaim(si)

    def _commit(self, p: _Plan, gc: bool) -> None:
        """Index the blocks of a written extent (under ``_lock``), vectorised:
        keys of one extent are distinct (a put drops duplicates)."""
        ents = p.entries
        k = len(ents)
        self._st["extents_written"] += 1
        self._written[p.seg] += k
        self._ticks += 1
        self._touched[p.seg] = self._ticks
        keys = [e.key for e in ents]
        rows = self._table.get_many(keys)
        new = rows < 0
        old = rows[~new]
        if old.size:  # a newer copy (GC copy-forward) retires the old one
            np.subtract.at(self._live, self._off[old] // self.segment_size_bytes, 1)
        if new.any():
            rows[new] = self._table.add_absent([keys[i] for i in new.nonzero()[0].tolist()])
            if int(rows.max()) >= self._off.size:
                self._grow_rows()
        self._off[rows] = [p.ext_off + e.payload_offset for e in ents]
        self._crc[rows] = [e.payload_crc32c for e in ents]
        self._seq[rows] = p.seq
        ns0 = ents[0].ns_digest if ents else None
        if all(e.ns_digest == ns0 for e in ents):
            self._ns_id[rows] = self._intern_ns(ns0) if ents else 0
        else:
            self._ns_id[rows] = [self._intern_ns(e.ns_digest) for e in ents]
        self._live[p.seg] += k
        self._members[p.seg].frombytes(rows.astype(np.int32).tobytes())
        self._st["gc_bytes_written" if gc else "user_bytes_written"] += sum(e.length_bytes for e in ents)
        if not gc:
            self._st["put_blocks_ok"] += k

    def _rollback(self, plans: list[_Plan], first: dict[int, int]) -> None:
        for si, off in first.items():
            self._wp[si] = off - si * self.segment_size_bytes
            if self._wp[si] == self._chain_start(si):
                self._written[si] = 0

    def _grow_rows(self) -> None:
        cap = self._table.capacity_rows
        for name in ("_off", "_crc", "_seq", "_ns_id"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=old.dtype)
            new[:old.size] = old
            setattr(self, name, new)

    def _intern_ns(self, ns: bytes) -> int:
        nid = self._ns_ids.get(ns)
        if nid is None:
            nid = self._ns_ids[ns] = len(self._ns_list)
            self._ns_list.append(ns)
        return nid

    def _live_rows(self, si: int) -> np.ndarray:
        """Rows whose current copy lies in segment ``si`` (under ``_lock``)."""
        rows = np.frombuffer(self._members[si], dtype=np.int32).astype(np.int64) if self._members[si] \
            else np.empty(0, dtype=np.int64)
        if not rows.size:
            return rows
        rows = np.unique(rows)
        rows = rows[self._table.live_mask(rows)]
        base = si * self.segment_size_bytes
        off = self._off[rows]
        return rows[(off >= base) & (off < base + self.segment_size_bytes)]

    def _victims(self) -> list[int]:
        """Sealed segments in the order eviction considers them (under ``_lock``).

        With a listener (a cache): the region policy's order. Without one (a
        plain store that must not lose acknowledged blocks): fewest live
        blocks first, and only segments with dead space (greedy GC)."""
        sealed = np.flatnonzero(self._state == SegmentState.SEALED)
        if not sealed.size:
            return []
        if self._listener is None:
            sealed = sealed[self._live[sealed] < self._written[sealed]]
            return sealed[np.argsort(self._live[sealed], kind="stable")].tolist()
        if self.region_policy == "min_live":
            return sealed[np.argsort(self._live[sealed], kind="stable")].tolist()
        if self.region_policy == "lru":
            return sealed[np.argsort(self._touched[sealed], kind="stable")].tolist()
        return sealed[np.argsort(self._sealed_at[sealed], kind="stable")].tolist()

    def _evict_region(self) -> bool:
        """Free one segment (write lock held): the first victim in
        :meth:`_victims` order whose eviction frees space; the blocks the
        listener keeps are copied forward, the rest dropped. Without a
        listener every live block is kept (compaction)."""
        with self._lock:
            order = self._victims()
        for si in order:
            with self._lock:
                if self._state[si] != SegmentState.SEALED:
                    continue
                rows = self._live_rows(si)
                keys = self._table.keys_of(rows.tolist())
                written = int(self._written[si])
            keep = (list(self._listener.on_reclaim(keys)) if (self._listener is not None and keys)
                    else [True] * len(keys))
            if len(keep) != len(keys):
                raise InvariantError(f"listener kept {len(keep)} flags for {len(keys)} keys")
            if sum(map(bool, keep)) >= written:
                continue  # nothing dead and everything kept: evicting it frees nothing
            with self._lock:
                if self._state[si] != SegmentState.SEALED:
                    continue
                self._state[si] = SegmentState.RECLAIMING
                pls = int(self._seg_placement[si])
                ns_of = {k: self._ns_list[int(self._ns_id[r])] for k, r in zip(keys, rows.tolist())}
            if self._evict_segment(si, keys, keep, None if pls == _NO_PLACEMENT else pls, ns_of):
                return True
        return False

    def _evict_segment(self, si: int, keys: list[bytes], keep: list, placement, ns_of: dict) -> bool:
        """Copy the kept blocks forward, drop the others, free the segment. A kept
        block that cannot be copied (no space, a read error) is never dropped:
        the segment then stays sealed and ``False`` is returned."""
        kept = [k for k, flag in zip(keys, keep) if flag]
        moved: set[bytes] = set()
        if kept:
            with self._lock:
                self._st["gc_runs"] += 1
            for a in range(0, len(kept), self.blocks_per_extent):
                ck = kept[a:a + self.blocks_per_extent]
                bufs = [torch.empty(self.block_bytes, dtype=torch.uint8) for _ in ck]
                st = self.get_fragments(ck, [[b] for b in bufs])
                ok = [j for j, x in enumerate(st) if x is Status.OK]
                if not ok:
                    continue
                res = self._put_locked([ck[j] for j in ok], [plan_fragments([bufs[j]]) for j in ok],
                                       [placement] * len(ok), [ns_of[ck[j]] for j in ok], gc=True)
                moved.update(ck[j] for j, r in zip(ok, res) if r is Status.OK)
        dropped: list[bytes] = []
        keep_set = set(kept)
        with self._lock:
            base = si * self.segment_size_bytes
            for k in keys:
                if k in moved or k in keep_set:
                    continue
                row = self._table.get(k)
                if row < 0 or not (base <= int(self._off[row]) < base + self.segment_size_bytes):
                    continue
                self._table.remove(k)
                self._live[si] -= 1
                dropped.append(k)
            self._st["region_evicted_blocks"] += len(dropped)
            self._st["region_kept_blocks"] += len(moved)
            stuck = self._live[si] > 0
            if stuck:  # kept blocks could not move: the segment stays as it is
                self._state[si] = SegmentState.SEALED
                self._st["region_evictions_abandoned"] = self._st.get("region_evictions_abandoned", 0) + 1
            else:
                self._st["regions_evicted"] += 1
        if dropped and self._listener is not None:
            self._listener.on_dropped(dropped)
        if stuck:
            return False
        self._finish_reclaim(si)
        return True

    def _finish_reclaim(self, si: int) -> None:
        """Wait for reads of ``si`` to end, trim it and return it to the clean pool."""
        with self._lock:
            while self._readers[si] > 0:
                self._readers_done.wait()
            if self._live[si] != 0:
                raise InvariantError(f"reclaiming segment {si} with {int(self._live[si])} live blocks")
            if self._state[si] != SegmentState.RECLAIMING:
                raise InvariantError(f"segment {si} reclaimed while {SegmentState(int(self._state[si])).name}")
        start = self._chain_start(si)  # segment 0's label stays
        try:
            self.engine.trim(si * self.segment_size_bytes + start, self.segment_size_bytes - start).get()
            trim_failed = False
        except OSError:
            trim_failed = True  # still reusable: recovery ignores stale extents by segment_gen/seq
        with self._lock:
            if trim_failed:
                self._st["trim_errors"] += 1
            self._state[si] = SegmentState.FREE
            self._wp[si] = start
            self._written[si] = 0
            self._members[si] = array("i")
            self._st["segments_reclaimed"] += 1

    # ================================================================ recovery
    def _append_invalidation(self, ns_digest: bytes, seq: int) -> None:
        import crc32c
        rec = ns_digest + seq.to_bytes(8, "little")
        data = _INVAL_REC.pack(ns_digest, seq, crc32c.crc32c(rec))
        fd = os.open(self._inval_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _read_invalidations(self) -> dict[bytes, int]:
        """``ns_digest -> write_seq`` of the latest record per namespace; a torn tail is ignored."""
        import crc32c
        out: dict[bytes, int] = {}
        if self._inval_path is None or not os.path.exists(self._inval_path):
            return out
        with open(self._inval_path, "rb") as f:
            data = f.read()
        for off in range(0, len(data) - _INVAL_REC.size + 1, _INVAL_REC.size):
            ns, seq, crc = _INVAL_REC.unpack_from(data, off)
            if crc32c.crc32c(ns + seq.to_bytes(8, "little")) != crc:
                break
            out[ns] = max(out.get(ns, 0), seq)
        return out

    def _chain_start(self, si: int) -> int:
        """Byte of segment ``si`` where its extent chain starts (segment 0: after the label)."""
        return self._start0 if si == 0 else 0

    def _chain(self, si: int, buf: list):
        """Yield ``(position, header)`` of each extent of segment ``si``'s chain, in
        order, until the first header that fails (:mod:`tierstore.io.format`).
        ``buf`` is ``[keepalive, page]``, a reusable aligned buffer (grown here)."""
        S = self.segment_size_bytes
        base = si * S
        pos = self._chain_start(si)
        gen = None
        last_seq = -1
        while pos + fmt.ALIGN_BYTES <= S:
            try:
                self.engine.read(base + pos, buf[1][:fmt.ALIGN_BYTES]).get()
                hb = fmt.peek_header_bytes(memoryview(buf[0])[:fmt.ALIGN_BYTES])
                if pos + hb > S:
                    return
                if hb > fmt.ALIGN_BYTES:
                    if hb > buf[1].numel():  # written with larger extents: grow, do not stop
                        buf[:] = alloc_aligned(align_up(hb, fmt.ALIGN_BYTES))
                    self.engine.read(base + pos, buf[1][:hb]).get()
                h = fmt.decode_header(memoryview(buf[0])[:hb])
            except (OSError, CorruptData):
                return
            if ((gen is not None and h.segment_gen != gen) or h.seq <= last_seq
                    or h.extent_offset != base + pos or pos + h.total_bytes > S
                    or (gen is None and h.segment_gen != h.seq)):
                return
            gen = h.segment_gen
            last_seq = h.seq
            yield pos, h
            pos += h.total_bytes

    def _recover(self, verify: bool) -> None:
        S = self.segment_size_bytes
        buf = list(alloc_aligned(max(self.extent_size_bytes, 1 << 20)))
        max_seq = 0
        inval = self._read_invalidations()
        self._inval = inval
        for si in range(self.n_segments):
            base = si * S
            start = pos = self._chain_start(si)
            h = None
            for pos, h in self._chain(si, buf):
                # Opened with another block size (another KV layout): refuse,
                # before anything is reclaimed. Serving a cut-off or padded
                # block would be wrong KV; dropping them would lose the store.
                other = {e.length_bytes for e in h.entries} - {self.block_bytes}
                if other:
                    raise ConfigError(self._layout_refusal(other))
                good = list(h.entries)
                if verify:
                    good = self._verify_extent(base + pos, h)
                    self._st["recovery_dropped_blocks"] += len(h.entries) - len(good)
                for e in good:
                    if e.ns_digest in inval and h.seq < inval[e.ns_digest]:
                        self._st["recovery_invalidated_blocks"] += 1
                        continue
                    self._adopt(si, base + pos + e.payload_offset, e, h.seq)
                self._written[si] += len(h.entries)
                max_seq = max(max_seq, h.seq)
            if h is not None:
                pos += h.total_bytes
                self._state[si] = SegmentState.SEALED
                self._gen[si] = h.segment_gen
                self._wp[si] = pos
                self._sealed_at[si] = h.seq
            else:
                self._wp[si] = start
        self._next_seq = max(max_seq, max(inval.values(), default=0)) + 1
        # Recovered segments are never appended to again (sealed until
        # reclaimed): a torn extent ends a chain, but complete extents of a dead
        # process may lie beyond it with sequence numbers above _next_seq;
        # appending at the chain end could splice them back into the chain.
        self._st["recovered_blocks"] = len(self._table)
        del buf
        for si in np.flatnonzero((self._state == SegmentState.SEALED) & (self._live == 0)).tolist():
            self._state[si] = SegmentState.RECLAIMING
            self._finish_reclaim(si)
        self._st["segments_reclaimed"] = 0

    def _layout_refusal(self, other) -> str:
        return (f"{self.path or 'device'}: holds blocks of {sorted(other)} bytes, but was opened "
                f"for {self.block_bytes}-byte blocks (another KV layout?); open it with the "
                f"layout it was written with, or use another path. Nothing was changed.")

    # ================================================================ label
    def _read_page(self, off: int) -> bytes:
        keep, page = alloc_aligned(lbl.LABEL_BYTES)
        self.engine.read(off, page[:lbl.LABEL_BYTES]).get()
        return bytes(memoryview(keep)[:lbl.LABEL_BYTES])

    def _open_label(self, format: bool) -> lbl.StoreLabel | None:
        """Check the label through the engine (the module doc of :mod:`tierstore.io.label`):
        the label found, or ``None`` for a target formatted now.

        A target without the label is formatted (every segment's chain start
        zeroed where it is not, so nothing written before is ever recovered)
        when it holds nothing, or with ``format``; else refused. A tier that
        grew gets the chain starts of its new segments zeroed the same way.
        """
        raw = self._read_page(0)
        try:
            found, damaged = lbl.decode_label(raw), ""
        except CorruptData as e:
            found, damaged = None, str(e)
        where = self.path or "device"
        if found is not None:
            if found.block_bytes != self.block_bytes:
                raise ConfigError(self._layout_refusal({found.block_bytes}))
            if found.segment_size_bytes != self.segment_size_bytes:
                raise ConfigError(
                    f"{where}: formatted with segment_size_bytes={found.segment_size_bytes}, opened with "
                    f"{self.segment_size_bytes}; a tier keeps its segment size whatever its capacity: open it "
                    "with the first (tierstore's build does), or use another path. Nothing was changed.")
            self._store_id = found.store_id
            if found.n_segments < self.n_segments:
                self._scrub(range(found.n_segments, self.n_segments))
            return found
        is_dev = bool(getattr(self.engine, "is_block_device", False)) or _is_device(self.path)
        if (any(raw) or damaged or is_dev) and not format:  # a device is formatted only when told to
            kind = "legacy" if raw[:8] == fmt.MAGIC else "foreign"
            raise ForeignDataError(lbl.refusal(lbl.Target(where, kind, is_dev, self.engine.size_bytes, None,
                                                          raw[:16], damaged)))
        self._store_id = b""
        self._scrub(range(self.n_segments))
        return None

    def _scrub(self, segments: Iterable[int]) -> None:
        """Zero the chain start of each of ``segments`` that is not zero (read first,
        so an empty sparse file gets no write)."""
        keep, zero = alloc_aligned(fmt.ALIGN_BYTES)
        zero.zero_()
        wrote = False
        for si in segments:
            off = si * self.segment_size_bytes + self._chain_start(si)
            if any(self._read_page(off)):
                self.engine.write(off, zero[:fmt.ALIGN_BYTES], self._metadata_placement).get()
                wrote = True
        if wrote:
            self.engine.sync()
        del keep

    def _write_label(self) -> None:
        """Write the label (this geometry) and make it durable."""
        page = lbl.StoreLabel(self.segment_size_bytes, self.block_bytes, self.n_segments,
                              getattr(self, "_store_id", b"")).encode()
        keep, buf = alloc_aligned(lbl.LABEL_BYTES)
        memoryview(keep)[:lbl.LABEL_BYTES] = page
        self.engine.write(0, buf[:lbl.LABEL_BYTES], self._metadata_placement).get()
        self.engine.sync()
        self._store_id = page[40:56]

    def _drop_beyond(self, old_n: int) -> None:
        """The tier was reopened with fewer segments than its label says: count the
        blocks of the segments past the new end that are not recovered (dropped),
        trim those segments, and say so once."""
        S = self.segment_size_bytes
        reach = min(old_n, self.engine.size_bytes // S)
        buf = list(alloc_aligned(max(self.extent_size_bytes, 1 << 20)))
        lost: set[bytes] = set()
        for si in range(self.n_segments, reach):
            for _, h in self._chain(si, buf):
                lost.update(e.key for e in h.entries
                            if not (e.ns_digest in self._inval and h.seq < self._inval[e.ns_digest]))
        lost = {k for k in lost if self._table.get(k) < 0}
        for si in range(self.n_segments, reach):
            try:
                self.engine.trim(si * S, S).get()
            except OSError:
                self._st["trim_errors"] += 1
        self._st["recovery_dropped_blocks"] += len(lost)
        unread = f"; {old_n - reach} segments past this open's device size were not read" if reach < old_n else ""
        _log.warning("%s: reopened with %d segments of %d bytes (%s) after %d (%s): %d blocks stored in the "
                     "segments past the new end were dropped (recovery_dropped_blocks)%s",
                     self.path or "device", self.n_segments, S, format_bytes(self.n_segments * S), old_n,
                     format_bytes(old_n * S), len(lost), unread)

    def _adopt(self, si: int, off: int, e: fmt.BlockEntry, seq: int) -> None:
        row = self._table.get(e.key)
        if row >= 0:
            # Two copies (a GC copy-forward cut short by a crash): the newer
            # wins only if its payload verifies, since a torn newer copy must
            # not retire the good older one.
            old = (int(self._off[row]), int(self._crc[row]), int(self._seq[row]))
            new = (off, e.payload_crc32c, seq)
            newer, older = (new, old) if seq > old[2] else (old, new)
            winner = newer if self._verify_at(e.key, newer[0], newer[1]) else older
            if winner is old:
                return
            self._live[old[0] // self.segment_size_bytes] -= 1
        else:
            row, _ = self._table.add(e.key)
            if row >= self._off.size:
                self._grow_rows()
        self._off[row] = off
        self._crc[row] = e.payload_crc32c
        self._seq[row] = seq
        self._ns_id[row] = self._intern_ns(e.ns_digest)
        self._live[si] += 1
        self._members[si].append(row)

    def _verify_at(self, key: bytes, off: int, crc: int) -> bool:
        keep, buf = alloc_aligned(self._slot_bytes)
        try:
            self.engine.read(off, buf[:self._slot_bytes]).get()
        except OSError:
            return False
        return fmt.payload_crc(key, memoryview(keep)[:self.block_bytes]) == crc

    def _verify_extent(self, ext_off: int, h: fmt.ExtentHeader) -> list:
        return [e for e in h.entries if self._verify_at(e.key, ext_off + e.payload_offset, e.payload_crc32c)]
