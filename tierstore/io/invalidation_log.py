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
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator

import crc32c

#: Namespace invalidation record: 32-byte namespace digest, u64 write_seq, u32 CRC-32C of both.
NS_RECORD = struct.Struct("<32sQI")


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
