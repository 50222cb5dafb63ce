"""What a segment store finds when it opens: the label, the extent chains, a smaller tier.

Functions of :class:`~tierstore.io.segments.SegmentStorage`'s open, run once,
before the store is shared (no lock is taken; nothing else runs yet):

* :func:`open_label` / :func:`write_label`: the tier's label in device bytes
  ``[0, 4096)`` (:mod:`tierstore.io.label`): checked before anything is
  written; a target without it is formatted (every chain start zeroed) only
  when it holds nothing or ``format`` is set.
* :func:`recover`: walks every segment's extent chain (:func:`read_chain`, the
  rules of :mod:`tierstore.io.format`) in segment order and adopts each block
  into the :class:`~tierstore.io.locator.BlockLocator` and the
  :class:`~tierstore.io.segment_manager.SegmentManager`, skipping blocks of a
  namespace the invalidation log dropped after they were written, and blocks (and
  whole reset segments) the journal tombstoned (:mod:`tierstore.io.journal`). Of two
  copies of a key (a GC copy-forward cut short by a crash) the newer wins only
  if its payload verifies. Recovered segments are sealed (never appended to).
* :func:`drop_beyond`: a tier reopened with fewer segments counts and trims
  the blocks past its new end.

A block written with another block size refuses the open (:func:`layout_refusal`):
serving a cut-off block would be wrong KV, dropping them would lose the store.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import stat
from collections.abc import Iterable, Iterator

import numpy as np

from ..errors import ConfigError, CorruptData, ForeignDataError
from ..units import format_bytes
from . import format as fmt
from . import label as lbl
from .engine import IOEngine, alloc_aligned
from .invalidation_log import LABEL_TAIL_OFFSET, is_invalidated
from .journal import JournalState
from .locator import BlockLocator
from .pages import align_up
from .segment_manager import SegmentManager, SegmentState

__all__ = [
    "OnDisk",
    "RecoveryCounts",
    "recover",
    "read_chain",
    "drop_beyond",
    "open_label",
    "write_label",
    "layout_refusal",
]

_log = logging.getLogger("tierstore.io.segments")


@dataclasses.dataclass
class RecoveryCounts:
    """What :func:`recover` found: blocks adopted, dropped (failed verification), skipped as
    invalidated, and the sealed segments left with no live block (to reclaim)."""

    recovered_blocks: int = 0
    dropped_blocks: int = 0
    invalidated_blocks: int = 0
    empty_segments: list = dataclasses.field(default_factory=list)
    #: ``(segment, byte)`` of each place an extent chain broke: a header that carried the extent
    #: magic but failed its checks, could not be read, or was overwritten (a later extent of the
    #: chain follows): the blocks from there up to the next readable extent of the chain (or the
    #: chain's end) are not recovered (misses); consecutive damaged extents count once
    damaged_extents: list = dataclasses.field(default_factory=list)
    #: ``(segment, payload device offset)`` of each block a journal BLOCK_DEAD record skipped
    tombstoned: list = dataclasses.field(default_factory=list)
    #: segments whose chain is older than their last SEGMENT_RESET (left free, to trim again)
    stale_segments: list = dataclasses.field(default_factory=list)
    #: BLOCK_DEAD records naming another key than the block at their offset (ignored)
    journal_mismatch: int = 0


@dataclasses.dataclass(frozen=True)
class OnDisk:
    """The tier that :func:`recover` and :func:`drop_beyond` read, and what they rebuild.

    Attributes
    ----------
    engine : IOEngine
        The tier's device.
    segs : SegmentManager
        Segment states, rebuilt from the chains.
    locator : BlockLocator
        Key -> location, rebuilt from the chains.
    invalidated : dict of bytes to int
        The invalidation log's ``ns_digest -> write_seq``: a namespace's blocks written before
        its seq are skipped.
    extent_bytes : int
        The largest extent the tier writes, bytes (the read buffer is at least this).
    path : str or None
        The tier's path, for messages.
    journal : JournalState or None
        The tier's journal state (tombstoned blocks, segment resets); ``None`` without one.
    """

    engine: IOEngine
    segs: SegmentManager
    locator: BlockLocator
    invalidated: dict[bytes, int]
    extent_bytes: int
    path: str | None
    journal: JournalState | None = None


def layout_refusal(path: str | None, block_bytes: int, other) -> str:
    """The message refusing a tier that holds blocks of another size than ``block_bytes``."""
    return (
        f"{path or 'device'}: holds blocks of {', '.join(map(str, sorted(other)))} bytes, but was opened "
        f"for {block_bytes}-byte blocks (another KV layout?); open it with the "
        f"layout it was written with, or use another path. Nothing was changed."
    )


def read_chain(
    engine: IOEngine, segs: SegmentManager, si: int, buf: list, damaged: list | None = None
) -> Iterator[tuple[int, fmt.ExtentHeader]]:
    """Yield ``(position, header)`` of each extent of segment ``si``'s chain, in order, until
    the chain ends (:mod:`tierstore.io.format`). ``buf`` is ``[keepalive, page]``, a reusable
    aligned buffer (grown here).

    A header that starts with the extent magic but fails its checksum or bounds is damage, not
    the chain's end, and so are a header that cannot be read (``OSError``) and a chain's first
    header position holding bytes that are neither zero nor a header: ``(si, position)`` goes to
    ``damaged``. Past the first extent, wherever the chain seems to end before its segment does (a
    damaged or unreadable header, zeros, other bytes), the chain is looked past
    (:func:`_next_extent`, one window read of an extent's reach): where a later extent of the same
    chain follows, the place is counted in ``damaged`` and the chain goes on from there (the
    blocks in between are lost, the later ones kept). A chain's normal end costs that one read."""
    S = segs.segment_bytes
    pos = start = segs.chain_start(si)
    gen = None
    last_seq = -1
    reach = buf[1].numel()
    while pos + fmt.ALIGN_BYTES <= S:
        try:
            h = _read_header(engine, si * S, pos, S, buf)
        except (CorruptData, OSError) as e:
            head = bytes(memoryview(buf[0])[: fmt.ALIGN_BYTES])
            unreadable = isinstance(e, OSError)
            # the chain's first header with bytes that are neither zero nor a header: a chain start
            # is only ever zero (formatted, never written, trimmed), a header, or an older header
            # left by an ignored trim, so this is damage too (its magic destroyed); further on, a
            # chain's end can be followed by stale bytes of an earlier use, so there only a header
            # whose magic survives, or a later extent of this chain beyond, tells damage
            bad = unreadable or head[: len(fmt.MAGIC)] == fmt.MAGIC or (pos == start and any(head))
            nxt = None
            if gen is not None:  # zeros too: a zeroed header mid-chain looks like the chain's end
                nxt = _next_extent(engine, segs, si, pos, gen, last_seq, buf, reach)
            if damaged is not None and (bad or nxt is not None):
                damaged.append((si, pos))
                if unreadable:
                    _log.warning("segment %d: reading the extent header at byte %d failed: %s", si, pos, e)
            if nxt is None:
                return
            pos = nxt
            continue
        if h is None or not _continues(h, si * S + pos, S - pos, gen, last_seq):
            return
        gen = h.segment_gen
        last_seq = h.seq
        reach = max(reach, h.total_bytes)
        yield pos, h
        pos += h.total_bytes


def _read_header(engine: IOEngine, base: int, pos: int, S: int, buf: list) -> fmt.ExtentHeader | None:
    """The extent header at segment byte ``pos`` (device offset ``base + pos``), or ``None`` when
    its size reaches past the segment's ``S`` bytes.

    Raises
    ------
    CorruptData
        The bytes there are not a whole, valid header (:func:`tierstore.io.format.decode_header`).
    OSError
        The read failed.
    """
    engine.read(base + pos, buf[1][: fmt.ALIGN_BYTES]).get()
    hb = fmt.peek_header_bytes(memoryview(buf[0])[: fmt.ALIGN_BYTES])
    if pos + hb > S:
        return None
    if hb > fmt.ALIGN_BYTES:
        if hb > buf[1].numel():  # written with larger extents: grow, do not stop
            buf[:] = alloc_aligned(align_up(hb, fmt.ALIGN_BYTES))
        engine.read(base + pos, buf[1][:hb]).get()
    return fmt.decode_header(memoryview(buf[0])[:hb])


def _continues(h: fmt.ExtentHeader, offset: int, room_bytes: int, gen: int | None, last_seq: int) -> bool:
    """Whether header ``h``, read at device ``offset`` with ``room_bytes`` left in its segment,
    continues a chain of generation ``gen`` (``None``: it would be the first) whose last extent
    had sequence number ``last_seq``."""
    return (
        (gen is None or h.segment_gen == gen)
        and h.seq > last_seq
        and h.extent_offset == offset
        and h.total_bytes <= room_bytes
        and (gen is not None or h.segment_gen == h.seq)
    )


def _next_extent(
    engine: IOEngine, segs: SegmentManager, si: int, pos: int, gen: int, last_seq: int, buf: list, reach: int
) -> int | None:
    """The segment byte of the next extent of segment ``si``'s chain (generation ``gen``, last
    sequence number ``last_seq``) past a damaged header at ``pos``, or ``None``.

    The damaged extent is at most ``reach`` bytes long (the largest extent this tier writes or
    this chain held), so the next one starts at an :data:`~tierstore.io.format.ALIGN_BYTES`
    boundary within ``(pos, pos + reach]``: one read of that window, then a check of each page
    that starts with the extent magic. Only a header of the same generation, a later sequence
    number and its own offset counts (stale bytes of an earlier use of the segment never do).
    """
    S = segs.segment_bytes
    base = si * S
    lo = pos + fmt.ALIGN_BYTES
    n = (min(S, pos + reach + fmt.ALIGN_BYTES) - lo) // fmt.ALIGN_BYTES * fmt.ALIGN_BYTES
    if n <= 0:
        return None
    if n > buf[1].numel():
        buf[:] = alloc_aligned(n)
    try:
        engine.read(base + lo, buf[1][:n]).get()
    except OSError:
        return None
    pages = np.frombuffer(memoryview(buf[0])[:n], dtype=np.uint8).reshape(-1, fmt.ALIGN_BYTES)
    magic = np.frombuffer(fmt.MAGIC, dtype=np.uint8)
    for i in np.flatnonzero((pages[:, : len(magic)] == magic).all(axis=1)).tolist():
        p = lo + i * fmt.ALIGN_BYTES
        try:
            h = _read_header(engine, base, p, S, buf)
        except (CorruptData, OSError):
            continue
        if h is not None and _continues(h, base + p, S - p, gen, last_seq):
            return p
    return None


def recover(tier: OnDisk, verify: bool) -> RecoveryCounts:
    """Rebuild ``tier.segs`` and ``tier.locator`` from the extent chains on ``tier.engine`` (module
    doc), each block's CRC checked when ``verify``.

    A chain whose first extent's gen is not above its segment's last reset in ``tier.journal``
    is stale (the segment stays free), and a block its BLOCK_DEAD record names (same segment,
    gen, offset and key) is skipped. Sets ``segs.next_seq`` past every sequence number seen.

    Raises
    ------
    ConfigError
        A block of another size than ``segs.block_bytes`` (nothing is changed).
    """
    engine, segs, locator, invalidated = tier.engine, tier.segs, tier.locator, tier.invalidated
    S = segs.segment_bytes
    out = RecoveryCounts()
    buf = list(alloc_aligned(max(tier.extent_bytes, 1 << 20)))
    max_seq = 0
    js = tier.journal if tier.journal is not None else JournalState()
    for si in range(segs.n_segments):
        base = si * S
        start = pos = segs.chain_start(si)
        h = None
        for pos, h in read_chain(engine, segs, si, buf, out.damaged_extents):
            if pos == start and h.segment_gen <= js.reset_gen.get(si, -1):
                out.stale_segments.append(si)  # reset durably; its trim was lost or ignored
                h = None
                break
            _adopt_extent(tier, si, base + pos, h, js.dead.get((si, h.segment_gen), {}), verify, out)
            max_seq = max(max_seq, h.seq)
        _end_chain(segs, si, h, pos, start)
    segs.next_seq = (
        max(max_seq, max(invalidated.values(), default=0), max(js.reset_gen.values(), default=0)) + 1
    )
    # Recovered segments are never appended to again (sealed until
    # reclaimed): a torn extent ends a chain, but complete extents of a dead
    # process may lie beyond it with sequence numbers above next_seq;
    # appending at the chain end could splice them back into the chain.
    out.recovered_blocks = len(locator)
    if out.damaged_extents:
        _log.warning(
            "%s: %d extent header(s) were unreadable at recovery (read error, bad magic or checksum, "
            "or zeroed mid-chain; first at segment %d, byte %d): the blocks from there up to the next "
            "readable extent of the same chain (found within one extent's reach), or to the chain's end, "
            "are not recovered (misses, never KV); recovered %d blocks",
            tier.path or "NVMe tier",
            len(out.damaged_extents),
            *out.damaged_extents[0],
            out.recovered_blocks,
        )
    del buf
    empty = (segs.state == SegmentState.SEALED) & (segs.live == 0)
    out.empty_segments = [int(si) for si in empty.nonzero()[0]]
    return out


def _end_chain(segs: SegmentManager, si: int, h, pos: int, start: int) -> None:
    """Segment ``si`` after its chain was read: sealed at the end of its last extent ``h`` (at
    ``pos``), with that extent's gen and seq; without one (empty, or stale), its write pointer at
    the chain's ``start``."""
    if h is not None:
        segs.state[si] = SegmentState.SEALED
        segs.gen[si] = h.segment_gen
        segs.wp[si] = pos + h.total_bytes
        segs.sealed_at[si] = h.seq
    else:
        segs.wp[si] = start


def _adopt_extent(
    tier: OnDisk, si: int, ext_off: int, h, dead: dict, verify: bool, out: RecoveryCounts
) -> None:
    """Adopt the blocks of the extent at device offset ``ext_off`` of segment ``si`` (header ``h``):
    each one not failing its CRC (``verify``), not invalidated after it was written and not
    tombstoned (``dead``: the journal's dead blocks of this segment generation); counted in ``out``.

    Raises
    ------
    ConfigError
        A block of another size than ``segs.block_bytes``.
    """
    bb = tier.segs.block_bytes
    other = {e.length_bytes for e in h.entries} - {bb}
    if other:
        raise ConfigError(layout_refusal(tier.path, bb, other))
    good = list(h.entries)
    if verify:
        good = [
            e
            for e in h.entries
            if _verify_at(tier.engine, bb, e.key, ext_off + e.payload_offset, e.payload_crc32c)
        ]
        out.dropped_blocks += len(h.entries) - len(good)
    for e in good:
        if is_invalidated(tier.invalidated, e.ns_digest, h.seq):
            out.invalidated_blocks += 1
            continue
        if _tombstoned(dead, ext_off + e.payload_offset, e.key, si, out):
            continue
        _adopt(tier, si, ext_off + e.payload_offset, e, h.seq)
    tier.segs.written[si] += len(h.entries)


def _tombstoned(dead: dict, off: int, key: bytes, si: int, out: RecoveryCounts) -> bool:
    """Whether the journal says the block ``key`` at ``off`` was evicted (a record naming another
    key there is counted in ``journal_mismatch`` and ignored: a tombstone never drops another block)."""
    k = dead.get(off)
    if k is None:
        return False
    if k != key:
        out.journal_mismatch += 1
        return False
    out.tombstoned.append((si, off))
    return True


def _adopt(tier: OnDisk, si: int, off: int, e: fmt.BlockEntry, seq: int) -> None:
    segs, locator = tier.segs, tier.locator
    row = locator.row(e.key)
    if row >= 0:
        # Two copies (a GC copy-forward cut short by a crash): the newer
        # wins only if its payload verifies, since a torn newer copy must
        # not retire the good older one.
        old = (locator.offsets(row), int(locator.crc[row]), locator.seqs(row))
        new = (off, e.payload_crc32c, seq)
        newer, older = (new, old) if seq > old[2] else (old, new)
        winner = newer if _verify_at(tier.engine, segs.block_bytes, e.key, newer[0], newer[1]) else older
        if winner is old:
            return
        segs.live[old[0] // segs.segment_bytes] -= 1
    row = locator.place(e.key, off, e.payload_crc32c, seq, e.ns_digest)
    segs.adopted(si, row)


def _verify_at(engine: IOEngine, block_bytes: int, key: bytes, off: int, crc: int) -> bool:
    slot = fmt.block_slot_bytes(block_bytes)
    keep, buf = alloc_aligned(slot)
    try:
        engine.read(off, buf[:slot]).get()
    except OSError:
        return False
    return fmt.payload_crc(key, memoryview(keep)[:block_bytes]) == crc


def drop_beyond(tier: OnDisk, old_n: int) -> tuple[int, int]:
    """The tier was reopened with fewer segments than the ``old_n`` its label says: count the
    blocks of the segments past the new end that are not recovered (dropped), trim those
    segments, and say so once. Returns ``(dropped blocks, trim errors)``. Blocks that were no
    longer stored are not counted: invalidated, tombstoned by ``tier.journal`` (block mode:
    evicted before) or in a chain it says was reset (what :func:`recover` skips too)."""
    engine, segs, locator, invalidated = tier.engine, tier.segs, tier.locator, tier.invalidated
    S = segs.segment_bytes
    reach = min(old_n, engine.size_bytes // S)
    buf = list(alloc_aligned(max(tier.extent_bytes, 1 << 20)))
    js = tier.journal if tier.journal is not None else JournalState()
    lost: set[bytes] = set()
    for si in range(segs.n_segments, reach):
        start = segs.chain_start(si)
        for pos, h in read_chain(engine, segs, si, buf):
            if pos == start and h.segment_gen <= js.reset_gen.get(si, -1):
                break  # a stale chain: reset durably, its trim lost or ignored
            dead = js.dead.get((si, h.segment_gen), {})
            lost.update(
                e.key
                for e in h.entries
                if not is_invalidated(invalidated, e.ns_digest, h.seq)
                and dead.get(si * S + pos + e.payload_offset) != e.key
            )
    lost = {k for k in lost if locator.row(k) < 0}
    trim_errors = 0
    for si in range(segs.n_segments, reach):
        try:
            engine.trim(si * S, S).get()
        except OSError:
            trim_errors += 1
    unread = f"; {old_n - reach} segments past this open's device size were not read" if reach < old_n else ""
    _log.warning(
        "%s: reopened with %d segments of %d bytes (%s) after %d (%s): %d blocks stored in the "
        "segments past the new end were dropped (recovery_dropped_blocks)%s",
        tier.path or "device",
        segs.n_segments,
        S,
        format_bytes(segs.n_segments * S),
        old_n,
        format_bytes(old_n * S),
        len(lost),
        unread,
    )
    return len(lost), trim_errors


# ---------------------------------------------------------------------------- label
def _read_page(engine: IOEngine, off: int) -> bytes:
    keep, page = alloc_aligned(lbl.LABEL_BYTES)
    engine.read(off, page[: lbl.LABEL_BYTES]).get()
    return bytes(memoryview(keep)[: lbl.LABEL_BYTES])


def _is_device(path: str | None) -> bool:
    """Whether ``path`` is a block or character device (a raw SSD, ``/dev/ngXnY``)."""
    try:
        mode = os.stat(path).st_mode if path else 0
    except OSError:
        return False
    return stat.S_ISBLK(mode) or stat.S_ISCHR(mode)


def open_label(
    engine: IOEngine, segs: SegmentManager, path: str | None, format: bool, metadata_placement: int | None
) -> tuple[lbl.StoreLabel | None, bytes]:
    """Check the label through the engine (the module doc of :mod:`tierstore.io.label`):
    ``(the label found or None for a target formatted now, the store id)``.

    A target without the label is formatted (every segment's chain start
    zeroed where it is not, so nothing written before is ever recovered)
    when its first page is zeros or :data:`.format.UNLABELLED_PAGE` (a file
    with data elsewhere was refused before by :func:`.label.check_target`),
    or with ``format``; else refused. A tier that
    grew gets the chain starts of its new segments zeroed the same way.

    Raises
    ------
    ConfigError
        The label names another block or segment size (nothing is changed).
    ForeignDataError
        The target holds something else and ``format`` is not set (nothing is written).
    """
    raw = _read_page(engine, 0)
    try:
        found, damaged = lbl.decode_label(raw), ""
    except CorruptData as e:
        found, damaged = None, str(e)
    where = path or "device"
    if found is not None:
        if found.block_bytes != segs.block_bytes:
            raise ConfigError(layout_refusal(path, segs.block_bytes, {found.block_bytes}))
        if found.segment_size_bytes != segs.segment_bytes:
            raise ConfigError(
                f"{where}: formatted with segment_size_bytes={found.segment_size_bytes}, opened with "
                f"{segs.segment_bytes}; a tier keeps its segment size whatever its capacity: open it "
                "with the first (tierstore's build does), or use another path. Nothing was changed."
            )
        if found.n_segments < segs.n_segments:
            _scrub(engine, segs, range(found.n_segments, segs.n_segments), metadata_placement)
        return found, found.store_id
    is_dev = bool(getattr(engine, "is_block_device", False)) or _is_device(path)
    ours = raw == fmt.UNLABELLED_PAGE  # the file engine marked it when it created (or found it empty)
    if ((any(raw) and not ours) or damaged or is_dev) and not format:  # a device: only when told to
        kind = "legacy" if raw[:8] == fmt.MAGIC else "foreign"
        raise ForeignDataError(
            lbl.refusal(lbl.Target(where, kind, is_dev, engine.size_bytes, None, raw[:16], damaged))
        )
    _scrub(engine, segs, range(segs.n_segments), metadata_placement)
    return None, b""


def _scrub(engine: IOEngine, segs: SegmentManager, segments: Iterable[int], placement: int | None) -> None:
    """Zero the chain start of each of ``segments`` that is not zero (read first,
    so an empty sparse file gets no write)."""
    keep, zero = alloc_aligned(fmt.ALIGN_BYTES)
    zero.zero_()
    wrote = False
    for si in segments:
        off = si * segs.segment_bytes + segs.chain_start(si)
        if any(_read_page(engine, off)):
            engine.write(off, zero[: fmt.ALIGN_BYTES], placement).get()
            wrote = True
    if wrote:
        engine.sync()
    del keep


def write_label(
    engine: IOEngine, segs: SegmentManager, store_id: bytes, placement: int | None, relabel: bool = False
) -> bytes:
    """Write the label (this geometry) and make it durable; returns the store id written. A
    ``relabel`` (the tier had a label) keeps the invalidation records after it
    (:class:`~tierstore.io.invalidation_log.LabelInvalidationLog`)."""
    page = lbl.StoreLabel(segs.segment_bytes, segs.block_bytes, segs.n_segments, store_id).encode()
    if relabel:
        old = _read_page(engine, 0)
        try:
            if lbl.decode_label(old) is not None:
                page = page[:LABEL_TAIL_OFFSET] + old[LABEL_TAIL_OFFSET:]
        except CorruptData:
            pass  # a damaged label's tail is not trusted
    keep, buf = alloc_aligned(lbl.LABEL_BYTES)
    memoryview(keep)[: lbl.LABEL_BYTES] = page
    engine.write(0, buf[: lbl.LABEL_BYTES], placement).get()
    engine.sync()
    return page[40:56]
