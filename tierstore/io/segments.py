"""The NVMe tier: a log-structured segment store that owns all of its space.

:class:`SegmentStorage` implements :class:`tierstore.tiers.storage.BlockStorage` over an
:class:`~tierstore.io.engine.IOEngine` and is the one owner of NVMe space. It is the facade of
rooms that hold data and never lock on their own (they run under the locks it passes in):

* :class:`~tierstore.io.segment_manager.SegmentManager` (Navy's ``RegionManager``): segment
  states, the open segment per placement stream, extent allocation;
* :data:`~tierstore.io.segment_policies.SEGMENT_POLICY`: the eviction order (``region_policy``);
* :class:`~tierstore.io.locator.BlockLocator`: key -> (segment, offset, length);
* :class:`~tierstore.io.segment_reads.SegmentReader`: the read path;
* :class:`~tierstore.io.segment_writes.SegmentWriter`: the write path (extents written,
  acknowledged, indexed) and the trim that returns a segment to the clean pool;
* :class:`~tierstore.io.invalidation_log.InvalidationLog` and :mod:`tierstore.io.recovery`
  (label, extent chains, a smaller tier) at open.

It owns eviction: blocks of a put are gathered into extents appended to their stream's open
segment (:mod:`tierstore.io.segment_writes`); when no free segment is left
(beyond ``reserve_segments``), one sealed segment is evicted: the listener (the index) says which
live blocks to keep, those are copied forward (``gc_bytes_written``), the rest are dropped and
reported (:meth:`RegionListener.on_dropped`), and the segment is trimmed.

Locks: ``_lock`` guards metadata and is never held across I/O; ``_write_lock`` serialises writers
(held across write I/O); ``_read_lock`` the read pipeline. Reads never queue behind writes; a
segment with reads in flight is not trimmed. Failures are per block, never raised:
ENOSPC/EFBIG/EDQUOT -> ``NO_SPACE``, other write/fdatasync errors -> ``IO_ERROR`` (no index entry,
the write pointer rolled back); EIO, a short read or a CRC mismatch -> ``IO_ERROR`` for that block,
which is dropped (later gets ``MISS``); a failed block's destination is never written. On-disk
format and durability: :mod:`tierstore.io.format`.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ConfigError, InvariantError, LayoutError, Status, StoreClosedError
from ..keytable import KeyTable
from ..tiers.storage import BlockStorage, RegionListener, StoredBlocks
from ..units import parse_size
from . import format as fmt
from . import label as lbl
from . import recovery
from .batch import DEFAULT_EXTENT_BYTES, ExtentPipeline
from .block_eviction import GRANULARITIES, BlockEviction, live_budget_for
from .engine import IOEngine
from .factory import open_engine
from .file import undo_open
from .invalidation_log import InvalidationLog, LabelInvalidationLog
from .journal import Journal, JournalState, check_owner, read_records
from .locator import BlockLocator
from .pages import check_distinct_destinations, plan_fragments
from .segment_manager import NO_PLACEMENT, RoomParts, SegmentManager, SegmentState
from .segment_policies import SEGMENT_POLICY
from .segment_reads import SegmentReader
from .segment_writes import SegmentWriter

__all__ = [
    "SegmentStorage",
    "SegmentState",
    "choose_segment_size",
    "DEFAULT_SEGMENT_BYTES",
    "MIN_SEGMENTS",
    "TARGET_SEGMENTS",
    "REGION_POLICIES",
]

#: Default segment (reclaim unit) size: 256 MiB, a typical FDP reclaim-unit /
#: Navy region-size multiple; configure to the device's RU size.
DEFAULT_SEGMENT_BYTES = 256 << 20
#: Fewest segments a store may have: segment eviction frees one segment at a
#: time, so with fewer a single eviction would drop a large share of the tier.
MIN_SEGMENTS = 8
#: Segments a tier is cut into when its size allows (segment eviction then frees
#: about 1/64 of the tier at a time).
TARGET_SEGMENTS = 64
#: The store's counters (:meth:`SegmentStorage.stats`), all 0 at open.
_COUNTERS = (
    "user_bytes_written",
    "gc_bytes_written",
    "bytes_loaded",
    "extents_written",
    "put_blocks_ok",
    "put_no_space",
    "put_io_error",
    "get_hits",
    "get_misses",
    "get_io_errors",
    "corrupt_blocks",
    "segments_reclaimed",
    "gc_runs",
    "regions_evicted",
    "region_evicted_blocks",
    "region_kept_blocks",
    "recovered_blocks",
    "recovery_dropped_blocks",
    "preallocate_errors",
    "trim_errors",
    "invalidated_blocks",
    "recovery_invalidated_blocks",
)
#: The accepted ``region_policy`` names (:data:`SEGMENT_POLICY`), for old imports.
REGION_POLICIES = tuple(SEGMENT_POLICY.names())
_log = logging.getLogger(__name__)


#: Segments kept free for eviction's copy-forward (the store's default; ``serve --check`` uses it too).
RESERVE_SEGMENTS = 1


def choose_segment_size(
    capacity_bytes: int,
    block_bytes: int,
    preferred_bytes: int | None = None,
    min_segments: int = MIN_SEGMENTS,
) -> int:
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
        raise ConfigError(
            f"NVMe tier of {capacity_bytes} bytes is too small for region eviction: it needs "
            f"at least {min_segments} segments of one {block_bytes}-byte block ({one} bytes "
            f"with its header and the tier's label), i.e. nvme capacity >= {min_segments * one} "
            "bytes"
        )
    seg = min(DEFAULT_SEGMENT_BYTES, max(one, capacity_bytes // TARGET_SEGMENTS))
    unit = 1 << 20 if seg >= 1 << 20 and one <= (seg >> 20 << 20) else fmt.ALIGN_BYTES
    seg = max(one, seg // unit * unit)
    while capacity_bytes // seg < min_segments:
        seg -= unit if seg - unit >= one else fmt.ALIGN_BYTES
    return seg


def _check_sizes(
    cap: int,
    block_bytes: int,
    segment_size_bytes,
    extent_size_bytes,
    reserve_segments: int,
    region_policy: str,
    labelled: bool,
) -> tuple[int, int]:
    """``(segment bytes, extent bytes)`` parsed; a ``ConfigError`` for any inconsistency."""
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
    SEGMENT_POLICY.canonical(region_policy)
    n_seg = cap // seg_b
    if n_seg < reserve_segments + 1:
        raise ConfigError(
            f"capacity_bytes={cap}: holds {n_seg} segments of {seg_b}; need at "
            f"least reserve_segments + 1 = {reserve_segments + 1}"
        )
    start0 = lbl.LABEL_BYTES if labelled else 0  # where segment 0's chain starts
    if seg_b < start0 + one:
        raise ConfigError(
            f"segment_size_bytes={seg_b}: must hold the label and one block extent ({start0 + one} bytes)"
        )
    return seg_b, ext_b


def _put_args(
    keys, fragments_per_block, placements, ns_digests, block_bytes: int
) -> tuple[list, list, list, list]:
    """A put's arguments checked and normalised: ``(keys, fragment plans, placements, ns digests)``.

    Raises
    ------
    LayoutError
        Wrong key length, block size or argument lengths (nothing is written).
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
        if p.nbytes != block_bytes:
            raise LayoutError(f"block of {p.nbytes} bytes; this store holds {block_bytes}-byte blocks")
    nss = [bytes(d) if d is not None else bytes(32) for d in (ns_digests or [None] * n)]
    for d in nss:
        if len(d) != 32:
            raise LayoutError("ns_digest must be 32 bytes")
    placements = list(placements) if placements is not None else [None] * n
    return keys, plans, placements, nss


def _get_args(keys, dest_fragments_per_block, block_bytes: int) -> tuple[list, list]:
    """A get's arguments checked: ``(keys, destination plans)`` (``LayoutError`` otherwise)."""
    n = len(keys)
    if len(dest_fragments_per_block) != n:
        raise LayoutError(f"{n} keys but {len(dest_fragments_per_block)} destination lists")
    dests = [plan_fragments(frags, destination=True) for frags in dest_fragments_per_block]
    check_distinct_destinations(dests)
    for p in dests:
        if p.nbytes != block_bytes:
            raise LayoutError(f"destination of {p.nbytes} bytes; blocks are {block_bytes} bytes")
    keys = [bytes(k) for k in keys]
    return keys, dests


def _group_new(keys: list[bytes], placements: list, present) -> tuple[list, dict[int | None, list[int]]]:
    """``(status, groups)`` of a put: ``EXISTS`` for a key ``present`` (its row, ``>= 0``; ``None``:
    nothing is) or earlier in ``keys``, ``None`` for the others, grouped by placement stream."""
    status: list[Status | None] = [None] * len(keys)
    seen: set[bytes] = set()
    groups: dict[int | None, list[int]] = {}
    for i, k in enumerate(keys):
        if (present is not None and present[i] >= 0) or k in seen:
            status[i] = Status.EXISTS
            continue
        seen.add(k)
        groups.setdefault(placements[i], []).append(i)
    return status, groups


def _invalidation_log(
    path: str | None, log: str | None | bool, labelled: bool, engine: IOEngine, placement: int | None
) -> InvalidationLog | LabelInvalidationLog | None:
    """The tier's invalidation log: ``log`` (a path; ``False``: none), by default
    ``<path>.invalidations`` beside a regular file, in the label page of a labelled tier on a
    device (nothing is created beside a device node) and none in memory."""
    if log is None:
        if path and os.path.isfile(path):
            log = path + ".invalidations"
        elif path and labelled:
            return LabelInvalidationLog(engine, placement)
        else:
            log = False
    return InvalidationLog(log) if log else None


def _engine_for(
    engine: str | IOEngine,
    path: str | None,
    n_seg: int,
    seg_b: int,
    owns_engine: bool | None,
    format: bool,
    iodepth: int,
    max_io_bytes: int | str,
) -> tuple[IOEngine, bool]:
    """``(engine, whether the store closes it)``: ``engine`` itself when it is one, else one opened
    on ``path`` large enough for the tier and for the segments a shrink drops (after the label check)."""
    if isinstance(engine, IOEngine):
        if engine.size_bytes < n_seg * seg_b:
            raise ConfigError(f"engine of {engine.size_bytes} bytes < {n_seg * seg_b}")
        return engine, bool(owns_engine)
    size = n_seg * seg_b
    if path is not None and engine != "memory":
        old = lbl.check_target(path, format=format).label
        if old is not None and old.segment_size_bytes == seg_b:  # reach the segments a shrink drops
            size = max(size, old.n_segments * seg_b)
    return open_engine(engine, path, size, iodepth=iodepth, max_io_bytes=max_io_bytes), True


def _open_journal(
    path: str | None, journal_path: str | None, block: bool, owner_id: bytes = b""
) -> tuple[Journal | None, JournalState | None]:
    """``(journal to append to, state to recover with)``. Block mode: ``journal_path``, else
    ``<path>.journal`` beside a regular file, else in memory without a path. Region mode appends
    nothing but still reads a journal a block-mode open left (its tombstones stay dead).

    Raises
    ------
    ConfigError
        Block mode on a device without ``journal_path`` (it has nowhere durable to go), or
        ``journal_path`` is the tier's own path.
    ForeignDataError
        The journal belongs to another tier (:func:`~tierstore.io.journal.check_owner`).
    """
    if (
        journal_path is not None
        and path is not None
        and os.path.abspath(journal_path) == os.path.abspath(path)
    ):
        raise ConfigError(
            f"journal_path {journal_path!r} is the NVMe tier's own path: give the journal its own file"
        )
    if journal_path is None and path is not None:
        if not os.path.isfile(path):
            if block:
                raise ConfigError(
                    f"eviction_granularity='block' on {path}: give journal_path, a file on a "
                    "durable file system (a deallocated block must never come back after a crash)"
                )
        else:
            journal_path = path + ".journal"
    if block:
        j = Journal(journal_path, owner_id)
        return j, j.state()
    if journal_path is not None and os.path.exists(journal_path):
        res = read_records(journal_path)
        check_owner(res, journal_path, owner_id)
        return None, JournalState.of(res.records)
    return None, None


class SegmentStorage(BlockStorage):
    """Crash-safe log-structured block store on a file or block device.

    Parameters
    ----------
    path : str or None
        File (created sparse) or block device; ``None`` with an engine object or ``engine="memory"``.
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
        Which sealed segment eviction tries first (:mod:`tierstore.io.segment_policies`); block mode
        collects garbage from the segment with the fewest live blocks (``min_live``).
    eviction_granularity : {"region", "block"}
        ``block``: evict single blocks in the listener's order (:mod:`tierstore.io.block_eviction`).
    live_fraction, trim_min_bytes, journal_path
        Block mode: the share of the usable blocks kept live, the shortest dead run worth a
        deallocate, the journal's file (default ``<path>.journal``; in memory without a path).
    listener : RegionListener, optional
        The block index; may be set later with :meth:`set_listener`.
    invalidation_log : str or None or False
        Path of the invalidation log (:mod:`tierstore.io.invalidation_log`); default
        ``<path>.invalidations`` for a regular file, the label page of a labelled device
        (:class:`~tierstore.io.invalidation_log.LabelInvalidationLog`), none in memory
        (``False``: none).
    owns_engine : bool, optional
        Close an engine object given in ``engine`` on :meth:`close` (default: no).
    label : bool, optional
        Keep the tier's label in device bytes ``[0, 4096)`` (:mod:`tierstore.io.label`): the geometry
        it was formatted with, checked at every open; segment 0's chain then starts at byte 4096.
        Default: when ``path`` is given (a tier that outlives the process).
    format : bool
        Allowed to format a target without the label (``tiers.nvme.format``);
        without it such a target is refused before anything is written.
    metadata_placement : int or None
        The placement (FDP PID) of the tier's own writes that carry no block: the label and the
        zeroed chain starts of a format. ``None``: untagged. On an FDP device build passes the
        default handle's PID (:meth:`tierstore.fdp.placement.PlacementPolicy.placement_for_metadata`),
        so every write the device sees names a reclaim unit handle.
    keep_data : bool
        ``False``: the accounting mode (:class:`tierstore.config.TiersConfig`): every extent is laid
        out and written as usual with its real header (keys, offsets, lengths; payload CRCs 0), but
        payload bytes are neither gathered nor checksummed (the engine, e.g. ``null``, keeps none),
        and a get of a present block reports ``OK`` without reading or scattering. Only for
        experiments at real block sizes; such a store serves no KV.

    Reopening with another capacity keeps the segment size of the label: a larger tier keeps every
    block; a smaller one keeps the blocks of the segments that still fit and drops the others,
    counted in ``recovery_dropped_blocks`` and said in one warning.

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

    def __init__(
        self,
        path: str | None,
        capacity_bytes: int | str,
        block_bytes: int,
        segment_size_bytes: int | str = DEFAULT_SEGMENT_BYTES,
        engine: str | IOEngine = "posix",
        extent_size_bytes: int | str = DEFAULT_EXTENT_BYTES,
        iodepth: int = 16,
        max_io_bytes: int | str = 1 << 20,
        reserve_segments: int = RESERVE_SEGMENTS,
        verify_on_recovery: bool = False,
        copy_threads: int | None = None,
        region_policy: str = "lru",
        listener: RegionListener | None = None,
        invalidation_log: str | None | bool = None,
        owns_engine: bool | None = None,
        keep_data: bool = True,
        label: bool | None = None,
        format: bool = False,
        metadata_placement: int | None = None,
        eviction_granularity: str = "region",
        live_fraction: float = 0.9,
        trim_min_bytes: int | str = 1 << 20,
        journal_path: str | None = None,
    ):
        if eviction_granularity not in GRANULARITIES:
            raise ConfigError(
                f"eviction_granularity={eviction_granularity!r}: accepted values are {list(GRANULARITIES)}"
            )
        block = eviction_granularity == "block"
        cap = parse_size(capacity_bytes, "capacity_bytes")
        self.keep_data = bool(keep_data)
        self._labelled = (path is not None) if label is None else bool(label)
        seg_b, ext_b = _check_sizes(
            cap,
            block_bytes,
            segment_size_bytes,
            extent_size_bytes,
            reserve_segments,
            region_policy,
            self._labelled,
        )
        self.block_bytes = int(block_bytes)
        self.segment_size_bytes = seg_b
        self.n_segments = cap // seg_b
        self.reserve_segments = int(reserve_segments)
        self.region_policy = region_policy
        self.eviction_granularity = eviction_granularity
        self.extent_size_bytes, self.blocks_per_extent = fmt.blocks_per_extent_for(
            ext_b, seg_b, self.block_bytes
        )
        self._slot_bytes = fmt.block_slot_bytes(self.block_bytes)
        self._metadata_placement = metadata_placement
        self.engine, self._own_engine = _engine_for(
            engine, path, self.n_segments, seg_b, owns_engine, format, iodepth, max_io_bytes
        )
        self.path = path
        self._listener = listener
        self._make_rooms(copy_threads, "min_live" if block else region_policy)
        self._inval_log = _invalidation_log(
            path, invalidation_log, self._labelled, self.engine, metadata_placement
        )
        try:
            budget = live_budget_for(self._segs, live_fraction) if block else 0
            self._open(
                format,
                verify_on_recovery,
                (journal_path, block, budget, parse_size(trim_min_bytes, "trim_min_bytes")),
            )
        except BaseException:
            self._wpipe.close()
            self._rpipe.close()
            if self._own_engine:
                self.engine.close()
                if not isinstance(engine, IOEngine):
                    undo_open(self.engine, path)  # a file this open created or grew: as it was
            raise

    def _make_rooms(self, copy_threads: int | None, segment_policy: str) -> None:
        """The locks, the two pipelines, the counters and the rooms (module doc) over the open engine."""
        # Two pipelines: reads never wait for a writer's staging buffers.
        self._wpipe = ExtentPipeline(self.engine, self.extent_size_bytes, copy_threads)
        self._rpipe = ExtentPipeline(self.engine, self.extent_size_bytes, copy_threads)
        self._lock = threading.Lock()  # metadata only, never across I/O
        self._write_lock = threading.RLock()  # one writer at a time (across write I/O)
        self._read_lock = threading.Lock()  # one user of the read pipeline at a time
        self._readers_done = threading.Condition(self._lock)
        self._st = dict.fromkeys(_COUNTERS, 0)
        start0 = lbl.LABEL_BYTES if self._labelled else 0  # where segment 0's chain starts
        self._segs = SegmentManager(
            self.n_segments,
            self.segment_size_bytes,
            self.block_bytes,
            self.blocks_per_extent,
            self.reserve_segments,
            start0,
            SEGMENT_POLICY.make(segment_policy),
            self._lock,
            self.engine.preallocate,
            self._st,
        )
        self._blk: BlockEviction | None = None
        self._loc = BlockLocator(
            max(1024, self.capacity_blocks() + 1),
            self.segment_size_bytes,
            self._slot_bytes,
            device_bytes=self.n_segments * self.segment_size_bytes,
        )
        parts = RoomParts(self.engine, self._loc, self._segs, self.keep_data, self._st)
        self._reader = SegmentReader(parts, self._rpipe, self._read_lock, self.extent_size_bytes)
        self._writer = SegmentWriter(parts, self._wpipe, self._readers_done, self.block_bytes)
        self._closed = False

    def _open(self, format: bool, verify: bool, blk: tuple) -> None:
        """Check the label, open the journal (``blk``: path, block mode, live budget, trim_min_bytes;
        after the label: nothing is created beside a target that is refused), recover the chains,
        drop what a smaller tier lost, write the label."""
        old, store_id = None, b""
        if self._labelled:
            old, store_id = recovery.open_label(
                self.engine, self._segs, self.path, format, self._metadata_placement
            )
        if self._labelled and not store_id:  # a new tier: its id now, so its journal names it
            store_id = uuid.uuid4().bytes
        journal, state = _open_journal(self.path, blk[0], blk[1], store_id)
        if blk[1]:
            self._blk = BlockEviction(
                self._segs,
                self._loc,
                self.engine,
                self._slot_bytes,
                blk[2],
                blk[3],
                journal,
                self._lock,
                self._st,
            )
            self._writer.blk = self._blk
        inval = self._inval_log.read() if self._inval_log is not None else {}
        on_disk = recovery.OnDisk(
            self.engine, self._segs, self._loc, inval, self.extent_size_bytes, self.path, state
        )
        found = recovery.recover(on_disk, verify)
        for si in found.stale_segments:  # reset, but its trim was lost or ignored: trim it again
            try:
                self.engine.trim(
                    si * self.segment_size_bytes + self._segs.chain_start(si),
                    self.segment_size_bytes - self._segs.chain_start(si),
                ).get()
            except OSError:
                self._st["trim_errors"] += 1  # still free: its chain is stale by gen (recovery.recover)
        over_budget: list[int] = []
        if self._blk is not None:
            self._blk.recovered(found.tombstoned, found.stale_segments, found.journal_mismatch)
            over_budget = self._drop_over_budget()  # counted in recovery_dropped_blocks
        self._st["recovery_dropped_blocks"] += found.dropped_blocks
        self._st["recovery_damaged_extents"] = len(found.damaged_extents)
        self._st["recovery_invalidated_blocks"] += found.invalidated_blocks
        self._st["recovered_blocks"] = len(self._loc)
        for si in found.empty_segments:
            self._segs.state[si] = SegmentState.RECLAIMING
            self._writer.finish_reclaim(si)
        for si in over_budget:  # RECLAIMING already (BlockEviction.evict_keys)
            self._writer.finish_reclaim(si)
        self._st["segments_reclaimed"] = 0
        if old is not None and old.n_segments > self.n_segments:
            dropped, trim_errors = recovery.drop_beyond(on_disk, old.n_segments)
            self._st["recovery_dropped_blocks"] += dropped
            self._st["trim_errors"] += trim_errors
        if self._labelled and (old is None or old.n_segments != self.n_segments):
            recovery.write_label(
                self.engine, self._segs, store_id, self._metadata_placement, relabel=old is not None
            )

    def _drop_over_budget(self) -> list[int]:
        """Block mode, at open: the blocks recovered beyond the live budget are dropped and said in
        one warning (:meth:`BlockEviction.drop_over_budget`); returns the segments left empty."""
        assert self._blk is not None
        n_found = len(self._loc)
        dropped, empty = self._blk.drop_over_budget()
        if dropped:
            _log.warning(
                "%s: %d blocks recovered, %d more than this open's live budget (%d blocks: live_fraction "
                "of a %d-byte tier): the %d oldest were dropped (recovery_dropped_blocks)",
                self.path or "device",
                n_found,
                dropped,
                self._blk.live_budget,
                self.n_segments * self.segment_size_bytes,
                dropped,
            )
        return empty

    # ================================================================ seam API
    def capacity_blocks(self) -> int:
        """Blocks the store can hold when empty (batched puts pack more; block mode: the live budget)."""
        return self._blk.live_budget if self._blk is not None else self._segs.capacity_blocks()

    def packed_capacity_blocks(self) -> int:
        """The most blocks the store can hold when empty: every extent full (block mode: the live
        budget, as :meth:`capacity_blocks`)."""
        return self._blk.live_budget if self._blk is not None else self._segs.packed_capacity_blocks()

    def segment_capacity_blocks(self) -> tuple[int, int]:
        """What the segments hold when empty, in either mode: ``(least, most)`` blocks, one block
        per extent and every extent full (block mode keeps at most ``live_fraction`` of the most
        live: :meth:`capacity_blocks`)."""
        return self._segs.capacity_blocks(), self._segs.packed_capacity_blocks()

    def free_blocks(self) -> int:
        """Blocks that fit without evicting anything (worst case: one per extent)."""
        with self._lock:
            return (
                self._blk.live_budget - len(self._loc) if self._blk is not None else self._segs.free_blocks()
            )

    def delete(self, keys: Iterable[bytes]) -> None:
        """Forget blocks; a sealed segment left without live blocks is reclaimed."""
        with self._lock:
            if self._blk is not None:  # block mode: tombstoned, trimmed by a later put
                empty = self._blk.evict_keys(keys, "deleted_blocks")
            else:
                freed = self._loc.remove(keys)
                empty = [
                    si
                    for si in (off // self.segment_size_bytes for off, _ in freed)
                    if self._segs.release(si)
                ]
        if self._blk is not None:
            self._blk.commit()
        for si in empty:
            self._writer.finish_reclaim(si)

    def locate(self, key: bytes) -> tuple[int, int] | None:
        """``(segment, payload device offset)`` of ``key``, or ``None`` (for tools and tests)."""
        with self._lock:
            where = self._loc.locate(bytes(key))
        return None if where is None else where[:2]

    def touch(self, keys: Sequence[bytes]) -> None:
        """Record a hit on ``keys`` for the segment LRU (Navy's ``RegionManager::touch``)."""
        with self._lock:
            rows = self._loc.rows_of(keys)
            rows = rows[rows >= 0]
            if rows.size:
                self._segs.touch(np.unique(self._loc.offsets(rows) // self.segment_size_bytes))

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return self._loc.row(bytes(key)) >= 0

    def scan(self) -> StoredBlocks:
        """Every stored block: ``(keys, namespace digest per key, write seq per key)``.

        What a restarted index adopts (one pass, no per-block objects kept)."""
        with self._lock:
            return self._loc.scan()

    def write_seq(self) -> int:
        """Sequence number the next extent will get."""
        with self._lock:
            return self._segs.next_seq

    def __len__(self) -> int:
        return len(self._loc)

    def stats(self) -> dict:
        """Counters; ``host_write_amplification = (user + gc bytes) / user bytes``."""
        with self._lock:
            out = dict(self._st)
            user = out["user_bytes_written"]
            out["host_write_amplification"] = (user + out["gc_bytes_written"]) / user if user else 1.0
            out["blocks"] = len(self._loc)
            out.update(self._segs.state_counts())
            if self._segs.usable_segments() < self.n_segments:  # its file system filled after start
                # in the unit of capacity_blocks (the store's capacity_bytes()["nvme"]), scaled by the
                # segments the tier can use (SegmentManager.usable_segments)
                usable = self.capacity_blocks() * self._segs.usable_segments() // self.n_segments
                out["usable_bytes"] = usable * self.block_bytes
            out["dead_blocks"] = self._segs.dead_blocks()
            out["extent_size_bytes"] = self.extent_size_bytes
            out["segment_size_bytes"] = self.segment_size_bytes
            out["blocks_per_extent"] = self.blocks_per_extent
            out["index_bytes"] = self.index_nbytes()
            if self._blk is not None:
                out.update(self._blk.stats(), eviction_granularity="block")
            out["engine"] = self.engine.stats()
            return out

    @property
    def key_table(self) -> KeyTable:
        """The locator's key table, which this tier owns (recovery fills it before any index
        exists); ``build.assemble`` gives it to the block index, which holds its keys in the same
        rows (:class:`~tierstore.keytable.HeldKeys`)."""
        return self._loc.key_table

    def index_nbytes(self) -> int:
        """Bytes of in-memory metadata: key table, per-block and per-segment arrays."""
        return self._loc.nbytes + self._segs.nbytes

    def close(self) -> None:
        with self._write_lock:
            with self._lock:
                if self._closed:
                    return
                self._closed = True
            self._wpipe.close()
            self._rpipe.close()
            if self._blk is not None:
                self._blk.flush_trims()
                self._blk.journal.close()
            if self._own_engine:
                self.engine.close()

    def check_invariants(self) -> None:
        """Blocks, live counts and (block mode) dead slots agree (:meth:`BlockEviction.check`).

        Raises
        ------
        InvariantError
        """
        with self._lock:
            if len(self._loc) != int(self._segs.live.sum()) or (self._segs.live > self._segs.written).any():
                raise InvariantError(
                    f"{len(self._loc)} blocks, live counts sum to {int(self._segs.live.sum())}"
                )
            if self._blk is not None:
                if len(self._loc) > self._blk.live_budget:
                    raise InvariantError(f"{len(self._loc)} live blocks > budget {self._blk.live_budget}")
                self._blk.check(self._loc.offsets(self._loc.table.held_rows()))

    # ============================================================ fragment API
    def put_fragments(
        self,
        keys: Sequence[bytes],
        fragments_per_block: Sequence[Sequence[Any]],
        placements: Sequence[int | None] | None = None,
        ns_digests: Sequence[bytes] | None = None,
    ) -> list[Status]:
        """Store blocks given as lists of fragments (or plans), without a contiguous copy.

        Parameters as :meth:`~tierstore.tiers.storage.BlockStorage.put_fragments`. Here a
        fragment may also be an ndarray or a bytes-like (tensors must be on the CPU); fragments
        are gathered straight into the staging extent; a placement is the stream (one open
        segment each); a namespace digest is recorded in the extent header.

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
        keys, plans, placements, nss = _put_args(
            keys, fragments_per_block, placements, ns_digests, self.block_bytes
        )
        with self._write_lock:
            return self._put_locked(keys, plans, placements, nss, gc=False)

    def get_fragments(
        self,
        keys: Sequence[bytes],
        dest_fragments_per_block: Sequence[Sequence[Any]],
        gate: Callable[[list[int]], Any] | None = None,
    ) -> list[Status]:
        """:meth:`BlockStorage.get_fragments <tierstore.tiers.storage.BlockStorage.get_fragments>`.

        Destinations may be tensors of any dtype and shape, contiguous or not.
        Blocks are read in device order, neighbours coalesced into reads of up
        to ``extent_size_bytes``; a block that fails its read or CRC-32C is
        dropped and reported ``IO_ERROR``.
        """
        keys, dests = _get_args(keys, dest_fragments_per_block, self.block_bytes)
        status = [Status.MISS] * len(keys)
        with self._lock:
            if self._closed:
                raise StoreClosedError("SegmentStorage is closed")
            found = self._reader.pin(keys)
        try:
            bad = self._reader.read(keys, found, dests, status, gate)
        finally:
            with self._lock:
                self._reader.unpin(found)
                self._readers_done.notify_all()
        dropped: list[bytes] = []
        if bad:
            with self._lock:
                dropped, empty = self._reader.forget_bad(bad)
                total = self._st["corrupt_blocks"]
                for key, off in bad if self._blk is not None else ():
                    if key in dropped:
                        self._blk.retire(off // self.segment_size_bytes, off, key)
            for si in empty:
                self._writer.finish_reclaim(si)
            # a block lost is said, not only counted (the caller sees IO_ERROR: a miss, recomputed)
            _log.warning(
                "%s: %d NVMe block(s) of this read failed their read or payload CRC-32C and were "
                "dropped (served as misses, never as KV); %d since the tier opened (corrupt_blocks)",
                self.path or "NVMe tier",
                len(bad),
                total,
            )
        hits, misses = status.count(Status.OK), status.count(Status.MISS)
        with self._lock:
            self._st["get_hits"] += hits
            self._st["bytes_loaded"] += hits * self.block_bytes
            self._st["get_misses"] += misses
            self._st["get_io_errors"] += len(status) - hits - misses
        if dropped and self._listener is not None:
            self._listener.on_dropped(dropped)
        return status

    def compact(self) -> bool:
        """Evict one region now (copying forward what the listener keeps);
        ``True`` if a segment was freed."""
        with self._write_lock:
            return _evict_one_segment(self)

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
                seq = self._segs.next_seq
            if self._inval_log is not None:
                self._inval_log.append(ns_digest, seq)
            with self._lock:
                rows = self._loc.rows_of_namespace(ns_digest)
                if rows is None:
                    return 0
                keys = self._loc.keys_of(rows)
            self.delete(keys)
            with self._lock:
                self._st["invalidated_blocks"] += len(keys)
            return len(keys)

    # =============================================================== internals
    def _put_locked(self, keys, plans, placements, nss, gc: bool) -> list[Status]:
        with self._lock:
            if self._closed:
                raise StoreClosedError("SegmentStorage is closed")
            status, groups = _group_new(keys, placements, self._loc.rows_of(keys) if not gc else None)
        if self._blk is not None and not gc:  # block mode: make room by single blocks first
            for si in self._blk.make_room(groups, status, self._listener, Status.NO_SPACE):
                self._writer.finish_reclaim(si)
        # Plan, write and acknowledge what fits; then evict a region and retry.
        while groups:
            with self._lock:
                plan, leftover = self._segs.plan_extents(groups, allow_reserve=gc)
            self._writer.write(plan, keys, plans, nss, status, gc)
            if leftover and not gc and self._blk is not None and _gc_would_take_full_or_newest(self):
                freed = self._blk.free_segment(sum(map(len, leftover.values())), self._listener)
                for si in freed:
                    self._writer.finish_reclaim(si)
                if freed:
                    groups = leftover
                    continue
            if leftover and not gc and _evict_one_segment(self):
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
        if self._blk is not None and not gc:
            self._blk.flush_trims()
        return [s if s is not None else Status.IO_ERROR for s in status]


# ================================================================ region eviction (GC)
def _gc_would_take_full_or_newest(self: SegmentStorage) -> bool:
    """Block mode, no segment free: should single LRU victims free one (``free_segment``) rather
    than region GC? Yes when GC's first choice has no dead slot (it would free space only by
    dropping a segment of live blocks in segment order, not in the NVMe policy's) or is the newest
    sealed segment (after a reopen, every new block would go at once). Otherwise GC reclaims the
    holes the evictions left, keeping the blocks the listener predicts will be reused."""
    with self._lock:
        segs = self._segs
        order = [
            si for si in segs.victims(self._listener is not None) if segs.state[si] == SegmentState.SEALED
        ]
        if not order:
            return True
        first = order[0]
        newest = max(order, key=lambda si: int(segs.sealed_at[si]))
        return first == newest or int(segs.live[first]) >= int(segs.written[first])


def _evict_one_segment(self: SegmentStorage) -> bool:
    """Free one segment (write lock held): the first victim in
    :meth:`SegmentManager.victims` order whose eviction frees space; the blocks the
    listener keeps are copied forward, the rest dropped. Without a
    listener every live block is kept (compaction)."""
    with self._lock:
        order = self._segs.victims(self._listener is not None)
    for si in order:
        with self._lock:
            if self._segs.state[si] != SegmentState.SEALED:
                continue
            rows = self._segs.live_rows(si, self._loc)
            keys = self._loc.keys_of(rows.tolist())
            written = int(self._segs.written[si])
        keep = (
            list(self._listener.on_reclaim(keys))
            if (self._listener is not None and keys)
            else [True] * len(keys)
        )
        if len(keep) != len(keys):
            raise InvariantError(f"listener kept {len(keep)} flags for {len(keys)} keys")
        if sum(map(bool, keep)) >= written:
            continue  # nothing dead and everything kept: evicting it frees nothing
        with self._lock:
            if self._segs.state[si] != SegmentState.SEALED:
                continue
            self._segs.state[si] = SegmentState.RECLAIMING
            placement = int(self._segs.placement[si])
            ns_of = {k: self._loc.namespace_of(r) for k, r in zip(keys, rows.tolist())}
        if _reclaim_segment(self, si, keys, keep, None if placement == NO_PLACEMENT else placement, ns_of):
            return True
    return False


def _reclaim_segment(
    self: SegmentStorage, si: int, keys: list[bytes], keep: list, placement, ns_of: dict
) -> bool:
    """Copy the kept blocks forward, drop the others, free the segment. A kept
    block that cannot be copied (no space, a read error) is never dropped:
    the segment then stays sealed and ``False`` is returned."""
    kept = [k for k, flag in zip(keys, keep) if flag]
    moved: set[bytes] = set()
    if kept:
        with self._lock:
            self._st["gc_runs"] += 1
        for a in range(0, len(kept), self.blocks_per_extent):
            ck = kept[a : a + self.blocks_per_extent]
            bufs = [torch.empty(self.block_bytes, dtype=torch.uint8) for _ in ck]
            st = self.get_fragments(ck, [[b] for b in bufs])
            ok = [j for j, x in enumerate(st) if x is Status.OK]
            if not ok:
                continue
            res = self._put_locked(
                [ck[j] for j in ok],
                [plan_fragments([bufs[j]]) for j in ok],
                [placement] * len(ok),
                [ns_of[ck[j]] for j in ok],
                gc=True,
            )
            moved.update(ck[j] for j, r in zip(ok, res) if r is Status.OK)
    dropped: list[bytes] = []
    keep_set = set(kept)
    with self._lock:
        base = si * self.segment_size_bytes
        for k in keys:
            if k in moved or k in keep_set:
                continue
            if not self._loc.remove_at(k, base, base + self.segment_size_bytes):
                continue
            self._segs.live[si] -= 1
            dropped.append(k)
        self._st["region_evicted_blocks"] += len(dropped)
        if self._blk is not None:  # dropped by GC: covered by the reset that follows (or kept intact)
            self._blk.superseded(np.full(len(dropped), si))
            self._st["gc_evicted_blocks"] += len(dropped)
        self._st["region_kept_blocks"] += len(moved)
        stuck = self._segs.live[si] > 0
        if stuck:  # kept blocks could not move: the segment stays as it is
            self._segs.state[si] = SegmentState.SEALED
            self._st["region_evictions_abandoned"] = self._st.get("region_evictions_abandoned", 0) + 1
        else:
            self._st["regions_evicted"] += 1
    if dropped and self._listener is not None:
        self._listener.on_dropped(dropped)
    if stuck:
        return False
    self._writer.finish_reclaim(si)
    return True
