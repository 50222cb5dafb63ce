"""The NVMe tier's journal: durable tombstones, segment resets and namespace invalidations.

Why it exists
-------------
Per-block eviction deallocates single payload slots (DSM Deallocate / TRIM,
``fallocate(PUNCH_HOLE)``). Deallocate is advisory: a deallocated LBA may
read back as zeros, ones *or the last data written* (NVMe DLFEAT; QEMU's
emulated namespace ignores discards), so after a crash the extent chains on
the device still list evicted blocks and may still hold their bytes. The
journal says durably which of them are gone, and it must be **committed
before the trim** (in memory: drop; then :meth:`Journal.append`; then
:meth:`Journal.commit`; only then deallocate). It also replaces the segment
store's ``<path>.invalidations`` log (:func:`read_legacy_invalidations` reads
that one).

Continued in ``docs/FORMAT.md`` (``tierstore/io/journal.py``): on-disk format (little-endian,
version 1); durability.
"""

from __future__ import annotations

import dataclasses
import enum
import fcntl
import os
import struct
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import crc32c

from ..closing import Closing
from ..errors import ConfigError, CorruptData, ForeignDataError, LayoutError, StoreLockedError
from .label import MAGIC as TIER_MAGIC

__all__ = [
    "RecordKind",
    "JournalRecord",
    "JournalState",
    "Journal",
    "live_records",
    "read_records",
    "read_legacy_invalidations",
    "HEADER_FMT",
    "RECORD_FMT",
    "RECORD_BYTES",
    "MAGIC",
]

MAGIC = b"TSJOURN1"
VERSION = 1
HEADER_FMT = "<8sIIQ36sI"
RECORD_FMT = "<B3xIQQ32sII"
_HEADER = struct.Struct(HEADER_FMT)
_RECORD = struct.Struct(RECORD_FMT)
HEADER_BYTES = _HEADER.size  # 64
RECORD_BYTES = _RECORD.size  # 64
_CRC_AT = 60
_ZERO32 = bytes(32)
#: The segment store's legacy ``<path>.invalidations`` record: namespace digest, u64 write_seq,
#: u32 CRC-32C of both (:data:`tierstore.io.invalidation_log.NS_RECORD`).
_LEGACY = struct.Struct("<32sQI")


class RecordKind(enum.IntEnum):
    """What a journal record says (module doc)."""

    NS_INVALIDATE = 1
    BLOCK_DEAD = 2
    SEGMENT_RESET = 3


class JournalRecord(NamedTuple):
    """One record. ``seq`` is the journal sequence number (assigned by the journal)."""

    kind: RecordKind
    segment: int = 0
    segment_gen: int = 0
    value: int = 0
    digest: bytes = _ZERO32
    seq: int = -1


def _check(rec: JournalRecord) -> None:
    if not isinstance(rec.kind, RecordKind):
        raise LayoutError(f"record kind {rec.kind!r}: a RecordKind")
    if len(rec.digest) != 32:
        raise LayoutError(f"digest of {len(rec.digest)} bytes: must be 32")
    if not (0 <= rec.segment < 1 << 32 and 0 <= rec.segment_gen < 1 << 64 and 0 <= rec.value < 1 << 64):
        raise LayoutError(f"{rec}: segment is a u32, segment_gen and value u64")


def _pack(rec: JournalRecord, seq: int) -> bytes:
    buf = bytearray(
        _RECORD.pack(int(rec.kind), rec.segment, rec.segment_gen, rec.value, rec.digest, seq & 0xFFFFFFFF, 0)
    )
    struct.pack_into("<I", buf, _CRC_AT, crc32c.crc32c(bytes(buf[:_CRC_AT])))
    return bytes(buf)


def _header(base_seq: int, owner_id: bytes = b"") -> bytes:
    """The 64-byte header; ``owner_id`` (16 bytes: the tier label's store id, or empty) goes to
    the first 16 reserved bytes, so a journal is never read for another tier (docs/FORMAT.md)."""
    buf = bytearray(_HEADER.pack(MAGIC, VERSION, RECORD_BYTES, base_seq, owner_id[:16].ljust(36, b"\0"), 0))
    struct.pack_into("<I", buf, _CRC_AT, crc32c.crc32c(bytes(buf[:_CRC_AT])))
    return bytes(buf)


@dataclasses.dataclass
class ReadResult:
    """What :func:`read_records` found.

    Attributes
    ----------
    records : list of JournalRecord
        The valid prefix, in order.
    base_seq : int
        Sequence number of the first record.
    valid_bytes : int
        Header plus the valid records (where the next append goes).
    tail_bytes : int
        Bytes after the valid prefix (a torn tail, or corruption).
    good_after_bad : int
        Well-formed records (CRC and sequence number right) found after the
        first bad one: non-zero means corruption inside the journal, not a tear.
    owner_id : bytes
        The store id of the tier the journal belongs to (16 bytes; zeros: not recorded).
    """

    records: list
    base_seq: int
    valid_bytes: int
    tail_bytes: int
    good_after_bad: int
    owner_id: bytes = bytes(16)


def _decode(data: bytes, base_seq: int) -> ReadResult:
    recs: list[JournalRecord] = []
    off = HEADER_BYTES
    n = len(data)
    while off + RECORD_BYTES <= n:
        rec = _decode_one(data, off, base_seq + len(recs))
        if rec is None:
            break
        recs.append(rec)
        off += RECORD_BYTES
    valid = off
    good_after = 0
    probe = off + RECORD_BYTES
    while probe + RECORD_BYTES <= n:  # a tear ends the file; good records after a bad one are corruption
        if _decode_one(data, probe, base_seq + (probe - HEADER_BYTES) // RECORD_BYTES) is not None:
            good_after += 1
        probe += RECORD_BYTES
    return ReadResult(recs, base_seq, valid, n - valid, good_after)


def _decode_one(data: bytes, off: int, seq: int) -> JournalRecord | None:
    kind, seg, gen, value, digest, seq32, crc = _RECORD.unpack_from(data, off)
    if crc32c.crc32c(data[off : off + _CRC_AT]) != crc or seq32 != seq & 0xFFFFFFFF:
        return None
    try:
        k = RecordKind(kind)
    except ValueError:
        return None
    return JournalRecord(k, seg, gen, value, digest, seq)


def read_records(path: str) -> ReadResult:
    """Read a journal file (module doc) without changing it.

    Raises
    ------
    ForeignDataError
        The file does not start with the journal's magic: tierstore did not write it.
    CorruptData
        It does, but its header is short or its CRC is wrong (a damaged journal).
    FileNotFoundError
        No such file.
    """
    with open(path, "rb") as f:
        data = f.read()
    if data[: len(MAGIC)] != MAGIC[: len(data)]:
        what = (
            "an NVMe tier tierstore wrote (its label), not a journal"
            if data[: len(TIER_MAGIC)] == TIER_MAGIC
            else "a file tierstore did not write"
        )
        raise ForeignDataError(
            f"{path}: not a tierstore journal (it starts with {data[: len(MAGIC)]!r}, not {MAGIC!r}): "
            f"{what}; nothing was changed. Give journal_path (default: the tier's path + '.journal') "
            "a path of its own"
        )
    if len(data) < HEADER_BYTES:
        raise CorruptData(f"{path}: {len(data)} bytes, shorter than a journal header ({HEADER_BYTES})")
    magic, version, rec_b, base, reserved, crc = _HEADER.unpack_from(data, 0)
    if crc32c.crc32c(data[:_CRC_AT]) != crc:
        raise CorruptData(f"{path}: a tierstore journal whose header CRC is wrong: damaged; left as it is")
    if version != VERSION or rec_b != RECORD_BYTES:
        raise CorruptData(
            f"{path}: journal version {version} with {rec_b}-byte records; this tierstore reads "
            f"version {VERSION} with {RECORD_BYTES}-byte records"
        )
    res = _decode(data, base)
    res.owner_id = bytes(reserved[:16])
    return res


def check_owner(res: ReadResult, path: str, owner_id: bytes) -> None:
    """Refuse a journal that belongs to another tier.

    Raises
    ------
    ForeignDataError
        ``res`` names a store id and it is not ``owner_id`` (a journal of another tier given as
        ``journal_path``, or the journal of a tier that was deleted and made again at the same
        path): its resets and tombstones would drop this tier's blocks. Nothing was changed.
    """
    if owner_id and any(res.owner_id) and res.owner_id != owner_id[:16]:
        raise ForeignDataError(
            f"{path}: the journal of another tier (store id {res.owner_id.hex()}; this tier is "
            f"{owner_id[:16].hex()}): its tombstones and segment resets would drop this tier's blocks. "
            "Give this tier its own journal_path, or remove that file if its tier is gone. Nothing was "
            "changed."
        )


def _ours(path: str) -> bool:
    """Whether ``path`` is empty or starts with a journal header's magic (a ``.tmp`` a crash left)."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(MAGIC))
    except OSError:
        return False
    return head in (b"", MAGIC)


def read_legacy_invalidations(path: str) -> dict[bytes, int]:
    """``ns_digest -> write_seq`` (the largest per namespace) from a legacy
    ``<path>.invalidations`` file of the segment store; reading stops at the
    first record whose CRC is wrong (a torn tail). A missing file gives ``{}``."""
    out: dict[bytes, int] = {}
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return out
    for off in range(0, len(data) - _LEGACY.size + 1, _LEGACY.size):
        ns, seq, crc = _LEGACY.unpack_from(data, off)
        if crc32c.crc32c(ns + seq.to_bytes(8, "little")) != crc:
            break
        out[ns] = max(out.get(ns, 0), seq)
    return out


@dataclasses.dataclass
class JournalState:
    """What recovery needs from a journal (the segment store applies it to the chains it walks).

    Attributes
    ----------
    reset_gen : dict
        ``segment -> the highest segment_gen reset``: a chain whose first extent's
        gen is not above it is stale (its trim was ignored or lost).
    dead : dict
        ``(segment, segment_gen) -> {payload device offset: block key}``: blocks
        evicted from that generation of the segment (gens at or below the
        segment's reset gen are dropped: the reset covers them).
    invalidated : dict
        ``ns digest -> write_seq``: blocks of the namespace in extents with a
        smaller sequence number are invalid.
    """

    reset_gen: dict = dataclasses.field(default_factory=dict)
    dead: dict = dataclasses.field(default_factory=dict)
    invalidated: dict = dataclasses.field(default_factory=dict)

    def apply(self, rec: JournalRecord) -> None:
        """Fold one record in (records in journal order)."""
        if rec.kind is RecordKind.NS_INVALIDATE:
            self.invalidated[rec.digest] = max(self.invalidated.get(rec.digest, 0), rec.value)
        elif rec.kind is RecordKind.SEGMENT_RESET:
            g = max(self.reset_gen.get(rec.segment, -1), rec.segment_gen)
            self.reset_gen[rec.segment] = g
            for key in [k for k in self.dead if k[0] == rec.segment and k[1] <= g]:
                del self.dead[key]
        elif rec.segment_gen > self.reset_gen.get(rec.segment, -1):
            self.dead.setdefault((rec.segment, rec.segment_gen), {})[rec.value] = rec.digest

    @classmethod
    def of(cls, records: Iterable[JournalRecord], legacy: dict[bytes, int] | None = None) -> JournalState:
        """The state of ``records`` (plus legacy invalidations, :func:`read_legacy_invalidations`)."""
        st = cls()
        for ns, seq in (legacy or {}).items():
            st.invalidated[ns] = max(st.invalidated.get(ns, 0), seq)
        for r in records:
            st.apply(r)
        return st


def live_records(records: Sequence[JournalRecord]) -> list[JournalRecord]:
    """The records a compacted journal keeps, in their original order: per
    namespace the NS_INVALIDATE with the largest write_seq (the first of equals),
    per segment the SEGMENT_RESET with the largest gen (the last of equals), and
    every BLOCK_DEAD of a generation above its segment's last reset (the last
    record per slot). :meth:`JournalState.of` gives the same state for both."""
    ns_best: dict[bytes, int] = {}
    reset_best: dict[int, int] = {}
    dead_last: dict[tuple, int] = {}
    for i, r in enumerate(records):
        if r.kind is RecordKind.NS_INVALIDATE:
            j = ns_best.get(r.digest)
            if j is None or r.value > records[j].value:
                ns_best[r.digest] = i
        elif r.kind is RecordKind.SEGMENT_RESET:
            j = reset_best.get(r.segment)
            if j is None or r.segment_gen >= records[j].segment_gen:
                reset_best[r.segment] = i
        else:
            dead_last[(r.segment, r.segment_gen, r.value)] = i
    keep = set(ns_best.values()) | set(reset_best.values())
    for (seg, gen, _), i in dead_last.items():
        j = reset_best.get(seg)
        if j is None or gen > records[j].segment_gen:
            keep.add(i)
    return [records[i] for i in sorted(keep)]


class Journal(Closing):
    """An append-only journal (module doc), in a file or in memory.

    Parameters
    ----------
    path : str or None
        The journal file (created if absent, through ``<path>.tmp``: a leftover of
        tierstore's is removed, any other file there is refused); ``None`` keeps the
        records in memory.
    owner_id : bytes, optional
        The tier's store id (its label's, 16 bytes), written into a new journal's header;
        an existing journal that names another id is refused.

    Attributes
    ----------
    records : list of JournalRecord
        Every committed record since the journal was opened or last compacted
        (what recovery reads back from the file).
    opened : ReadResult or None
        What opening the file found (torn tail bytes cut off, and so on).

    Raises
    ------
    ConfigError
        ``path`` is empty or a directory, or its directory does not exist.
    ForeignDataError
        ``path`` is another tier's journal, or ``<path>.tmp`` is a file tierstore did not write.
    StoreLockedError
        Another open tier holds the journal.
    CorruptData
        ``path`` exists and is not a journal tierstore wrote, or a bad record
        is followed by good ones (nothing is changed then).
    OSError
        The file or its directory cannot be written.
    """

    def __init__(self, path: str | None, owner_id: bytes = b"") -> None:
        if path is not None and (not path or os.path.isdir(path)):
            raise ConfigError(f"journal_path {path!r}: give a file path (in an existing directory)")
        self.path = path
        self._owner = owner_id
        self.records: list[JournalRecord] = []
        self._pending: list[JournalRecord] = []
        self._base = 1
        self._next = 1
        self._fd = -1
        self.opened: ReadResult | None = None
        self.stats = {
            "records_appended": 0,
            "commits": 0,
            "compactions": 0,
            "bytes_written": 0,
            "torn_tail_bytes": 0,
        }
        if path is None:
            return
        self._clear_tmp(path)  # a compaction (or a creation) that did not reach its rename
        if os.path.exists(path):
            res = read_records(path)
            check_owner(res, path, owner_id)
            if res.good_after_bad:
                raise CorruptData(
                    f"{path}: record {len(res.records)} (byte {res.valid_bytes}) is bad but "
                    f"{res.good_after_bad} "
                    "later records are good: the journal is damaged, not torn; it was left as it is. "
                    "To open the tier anyway, move this file aside (the tier then opens without it: "
                    "blocks it recorded as evicted may be recovered again) or give the tier another path"
                )
            self.opened = res
            self.records = list(res.records)
            self._base = res.base_seq
            self._next = res.base_seq + len(res.records)
            if res.tail_bytes:  # a torn append: never committed, cut it so appends continue the chain
                fd = os.open(path, os.O_WRONLY)
                try:
                    os.ftruncate(fd, res.valid_bytes)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                self.stats["torn_tail_bytes"] = res.tail_bytes
        else:
            self._create(path, base_seq=1, records=[], owner_id=owner_id)
            self.opened = ReadResult([], 1, HEADER_BYTES, 0, 0)
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:  # one writer per journal, as per tier file (io/_fileops.py's lock)
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = -1
            raise StoreLockedError(
                f"{path}: the journal is in use by another open tier (each tier needs its own journal_path)"
            ) from None

    # ----------------------------------------------------------------- API
    @property
    def next_seq(self) -> int:
        """Sequence number the next appended record gets."""
        return self._next + len(self._pending)

    @property
    def committed_seq(self) -> int:
        """Sequence number of the last durable record (``base_seq - 1`` when none is)."""
        return self._next - 1

    def append(
        self,
        kind: RecordKind,
        segment: int = 0,
        segment_gen: int = 0,
        value: int = 0,
        digest: bytes = _ZERO32,
    ) -> int:
        """Buffer one record; returns its sequence number. Durable only after :meth:`commit`.

        Raises
        ------
        LayoutError
            A field out of its range (nothing is buffered).
        """
        rec = JournalRecord(RecordKind(kind), int(segment), int(segment_gen), int(value), bytes(digest))
        _check(rec)
        seq = self.next_seq
        self._pending.append(rec._replace(seq=seq))
        return seq

    def commit(self) -> int:
        """Write the buffered records and ``fdatasync`` (one write, one sync); returns
        :attr:`committed_seq`. Nothing buffered: no I/O.

        Raises
        ------
        OSError
            The write or the sync failed; the records stay buffered (not durable),
            and the file is cut back to its last committed record.
        """
        if not self._pending:
            return self.committed_seq
        if self._fd >= 0:
            data = b"".join(_pack(r, r.seq) for r in self._pending)
            size = HEADER_BYTES + (self._next - self._base) * RECORD_BYTES
            try:
                _write_all(self._fd, data)
                os.fdatasync(self._fd)
            except OSError:
                os.ftruncate(self._fd, size)  # no half batch before the next try
                raise
            self.stats["bytes_written"] += len(data)
        self.records.extend(self._pending)
        self.stats["records_appended"] += len(self._pending)
        self.stats["commits"] += 1
        self._next += len(self._pending)
        self._pending = []
        return self.committed_seq

    def state(self, legacy: dict[bytes, int] | None = None) -> JournalState:
        """:class:`JournalState` of the committed records (plus ``legacy`` invalidations)."""
        return JournalState.of(self.records, legacy)

    def import_legacy_invalidations(self, legacy_path: str) -> int:
        """Append and commit one NS_INVALIDATE per namespace of a legacy
        ``.invalidations`` file not already covered; returns records added. The
        caller may delete the legacy file after this returns."""
        have = self.state().invalidated
        n = 0
        for ns, seq in sorted(read_legacy_invalidations(legacy_path).items()):
            if have.get(ns, -1) < seq:
                self.append(RecordKind.NS_INVALIDATE, value=seq, digest=ns)
                n += 1
        self.commit()
        return n

    def file_bytes(self) -> int:
        """Bytes of the journal (header and committed records)."""
        return HEADER_BYTES + len(self.records) * RECORD_BYTES

    def should_compact(self, min_bytes: int = 1 << 20, ratio: float = 4.0) -> bool:
        """Whether the journal exceeds ``min_bytes`` and ``ratio`` times its live records."""
        return self.file_bytes() > min_bytes and len(self.records) > ratio * max(
            1, len(live_records(self.records))
        )

    def compact(self) -> int:
        """Commit what is buffered, then keep only :func:`live_records`: written to
        ``<path>.tmp``, synced, renamed over the journal, directory synced. The kept
        records are numbered so that they end just before :attr:`next_seq`. Returns
        the records kept.

        Raises
        ------
        OSError
            Writing the new journal failed; the old one is still the journal.
        """
        self.commit()
        live = live_records(self.records)
        base = self._next - len(live)
        live = [r._replace(seq=base + i) for i, r in enumerate(live)]
        if self.path is not None:
            os.close(self._fd)
            self._fd = -1
            try:
                self._create(self.path, base, live, owner_id=self._owner)
            finally:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the new inode: this process's
        self.records = live
        self._base = base
        self.stats["compactions"] += 1
        return len(live)

    def close(self) -> None:
        """Commit what is buffered and close the file. Idempotent."""
        if self._fd >= 0:
            try:
                self.commit()
            finally:
                os.close(self._fd)
                self._fd = -1

    # ----------------------------------------------------------- internals
    @staticmethod
    def _clear_tmp(path: str) -> None:
        """Remove ``<path>.tmp`` if tierstore left it (empty, or a journal header: a crash before
        the rename); refuse anything else there (a user's file) with nothing changed."""
        tmp = path + ".tmp"
        if not os.path.lexists(tmp):
            return
        if os.path.islink(tmp) or not _ours(tmp):
            raise ForeignDataError(
                f"{tmp}: exists and is not a journal tierstore was writing; the journal "
                "is written there before its rename: move that file. Nothing was changed."
            )
        os.unlink(tmp)
        _fsync_dir(path)

    @staticmethod
    def _create(path: str, base_seq: int, records: Sequence[JournalRecord], owner_id: bytes = b"") -> None:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise ConfigError(f"journal {path}: the directory {parent} does not exist")
        tmp = path + ".tmp"
        Journal._clear_tmp(path)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            _write_all(
                fd,
                _header(base_seq, owner_id) + b"".join(_pack(r, base_seq + i) for i, r in enumerate(records)),
            )
            os.fdatasync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        _fsync_dir(path)


def _write_all(fd: int, data: bytes) -> None:
    mv = memoryview(data)
    while mv:
        n = os.write(fd, mv)
        mv = mv[n:]


def _fsync_dir(path: str) -> None:
    """fsync(2) the directory holding ``path`` (a rename or a new name is durable only then)."""
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
