"""The segment store's invalidation log: which namespaces were dropped, durably.

:meth:`tierstore.io.segments.SegmentStorage.invalidate_namespace` appends one
record per call to ``<path>.invalidations`` (fsync'ed before any block is
dropped); recovery (:mod:`tierstore.io.recovery`) drops the blocks of a logged
namespace written before the record's sequence number.

On-disk format (little-endian, no header): back-to-back records of
:data:`NS_RECORD` = ``"<32sQI"`` (44 bytes): the 32-byte namespace digest, the
u64 write sequence number (blocks written before it are invalid), and the u32
CRC-32C of the 40 bytes before it. Reading stops at the first short record or
CRC mismatch: a torn tail (a crash during an append) was never acknowledged.
:func:`tierstore.io.journal.read_legacy_invalidations` reads the same format.

A record kind is a ``struct`` whose last field is the CRC-32C of the packed
fields before it; :meth:`InvalidationLog._append_record` and
:meth:`InvalidationLog._records` handle any such kind, so a second kind (issue
26: deallocated key ranges, which recovery must never resurrect) is an added
struct and reader, not a rewrite of this one. The log holds no lock: its owner
serialises appends (``SegmentStorage._write_lock``).

A tier on a block or character device has no directory of its own (tierstore
never creates a file beside a device node): :class:`LabelInvalidationLog` keeps
the same records on the device, in the label page after the label
(:data:`LABEL_TAIL_RECORDS`, one per namespace); when all are taken, invalidating
another namespace is refused (``OSError`` ENOSPC, nothing recorded or dropped:
folding records into one for every namespace would drop every tenant's blocks at
the next start, fresh-user trial 12). Reformatting the tier clears the records.
"""

from __future__ import annotations

import errno
import os
import struct
from collections.abc import Iterator

import crc32c

from . import label as lbl
from .engine import IOEngine, alloc_aligned

#: Namespace invalidation record: 32-byte namespace digest, u64 write_seq, u32 CRC-32C of both.
NS_RECORD = struct.Struct("<32sQI")
#: Where the records start in the label page: after the 64 bytes the label uses.
LABEL_TAIL_OFFSET = 64
#: Records the label page holds after the label (91 of 44 bytes in 4032 bytes).
LABEL_TAIL_RECORDS = (lbl.LABEL_BYTES - LABEL_TAIL_OFFSET) // NS_RECORD.size


def is_invalidated(invalidated: dict[bytes, int], ns_digest: bytes, seq: int) -> bool:
    """Whether a block of ``ns_digest`` written at ``seq`` was dropped by a logged invalidation
    (``invalidated`` as :meth:`InvalidationLog.read` gives it)."""
    return seq < invalidated.get(ns_digest, 0)


def _pack(ns_digest: bytes, seq: int) -> bytes:
    body = NS_RECORD.pack(ns_digest, seq, 0)[:-4]
    return body + crc32c.crc32c(body).to_bytes(4, "little")


def _unpack(data: bytes) -> Iterator[tuple[bytes, int]]:
    """The records of ``data`` whose CRC holds (zeroed and torn slots are skipped: a torn rewrite of
    the page loses at most the records in its torn sectors, not every record after them)."""
    for off in range(0, len(data) - NS_RECORD.size + 1, NS_RECORD.size):
        ns, seq, crc = NS_RECORD.unpack_from(data, off)
        if crc32c.crc32c(data[off : off + NS_RECORD.size - 4]) == crc:
            yield ns, seq


class InvalidationLog:
    """Append-only log of namespace invalidations in the file ``path``.

    Parameters
    ----------
    path : str
        The log file (created on the first append, mode 0644).
    """

    def __init__(self, path: str) -> None:
        self.path = path

    def append(self, ns_digest: bytes, seq: int) -> None:
        """Durably record that blocks of ``ns_digest`` written before ``seq`` are invalid.

        Parameters
        ----------
        ns_digest : bytes
            32-byte namespace digest.
        seq : int
            The store's next write sequence number when the namespace was dropped (u64).

        Raises
        ------
        OSError
            The record could not be written or fsync'ed (the caller then drops nothing).
        struct.error
            ``ns_digest`` longer than 32 bytes or ``seq`` outside u64.
        """
        self._append_record(NS_RECORD, bytes(ns_digest), int(seq))

    def read(self) -> dict[bytes, int]:
        """``ns_digest -> write_seq``: the largest sequence number logged per namespace.

        A missing file gives ``{}``; a torn or corrupt tail is ignored (module doc).
        """
        out: dict[bytes, int] = {}
        for ns, seq in self._records(NS_RECORD):
            out[ns] = max(out.get(ns, 0), seq)
        return out

    def _append_record(self, kind: struct.Struct, *fields) -> None:
        """Append one record of ``kind`` (its CRC-32C computed here) and fsync the file."""
        body = kind.pack(*fields, 0)[:-4]
        data = body + crc32c.crc32c(body).to_bytes(4, "little")
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)

    def _records(self, kind: struct.Struct) -> Iterator[tuple]:
        """The fields (CRC left out) of each record of ``kind``, up to the first bad one."""
        if not os.path.exists(self.path):
            return
        with open(self.path, "rb") as f:
            data = f.read()
        for off in range(0, len(data) - kind.size + 1, kind.size):
            *fields, crc = kind.unpack_from(data, off)
            if crc32c.crc32c(data[off : off + kind.size - 4]) != crc:
                return
            yield tuple(fields)


class LabelInvalidationLog:
    """The invalidation records of a tier on a device, in its label page (module doc).

    The page is rewritten whole and synced on each append, under the owner's write lock; the
    label's own 64 bytes (its first sector) are written unchanged, so a torn write can lose only
    the record being appended (never acknowledged) and never the label.

    Parameters
    ----------
    engine : IOEngine
        The tier's engine (the only way to reach ``/dev/ngXnY``).
    placement : int or None
        The placement of metadata writes (FDP), as for the label.
    """

    def __init__(self, engine: IOEngine, placement: int | None) -> None:
        self.engine = engine
        self.placement = placement
        self.path = None

    def _page(self) -> bytearray:
        keep, buf = alloc_aligned(lbl.LABEL_BYTES)
        self.engine.read(0, buf[: lbl.LABEL_BYTES]).get()
        return bytearray(memoryview(keep)[: lbl.LABEL_BYTES])

    def read(self) -> dict[bytes, int]:
        """``ns_digest -> write_seq`` as :meth:`InvalidationLog.read`;
        ``{}`` before the label is written."""
        page = self._page()
        if lbl.decode_label(page) is None:
            return {}
        out: dict[bytes, int] = {}
        for ns, seq in _unpack(bytes(page[LABEL_TAIL_OFFSET:])):
            out[ns] = max(out.get(ns, 0), seq)
        return out

    def append(self, ns_digest: bytes, seq: int) -> None:
        """Durably record that blocks of ``ns_digest`` written before ``seq`` are invalid.

        Raises
        ------
        OSError
            ENOSPC when :data:`LABEL_TAIL_RECORDS` other namespaces hold every record (nothing
            written); or the page could not be written or synced, or the label is not there
            (nothing dropped).
        """
        page = self._page()
        if lbl.decode_label(page) is None:
            raise OSError("the NVMe tier's label is missing: the invalidation cannot be recorded")
        recs = self.read()
        ns_digest = bytes(ns_digest)
        if ns_digest not in recs and len(recs) >= LABEL_TAIL_RECORDS:
            raise OSError(
                errno.ENOSPC,
                f"the invalidation log of this device tier is full ({LABEL_TAIL_RECORDS} namespaces "
                "were invalidated since it was formatted): this invalidation is not recorded on the "
                "device, so the namespace's blocks there would be served again after a restart; "
                "invalidating one of the recorded namespaces again still works; reformat the tier "
                "(nvme_format / tiers.nvme.format) to clear the log",
            )
        recs[ns_digest] = max(recs.get(ns_digest, 0), int(seq))
        tail = b"".join(_pack(ns, s) for ns, s in recs.items())
        page[LABEL_TAIL_OFFSET:] = tail + bytes(lbl.LABEL_BYTES - LABEL_TAIL_OFFSET - len(tail))
        keep, buf = alloc_aligned(lbl.LABEL_BYTES)
        memoryview(keep)[: lbl.LABEL_BYTES] = page
        self.engine.write(0, buf[: lbl.LABEL_BYTES], self.placement).get()
        self.engine.sync()
