"""Where each block of the segment store lies: key -> (segment, offset, length).

:class:`BlockLocator` maps a 32-byte block key to a dense row of a
:class:`~tierstore.keytable.KeyTable` and keeps, per row, in numpy arrays:
the payload's device offset (``off``), its CRC-32C (``crc``), the sequence
number of the extent it was written in (``seq``) and its interned namespace
(``ns_id``; ``namespaces.digests[ns_id]`` is the 32-byte digest). About 70 bytes per
block, no Python object per block. Every payload occupies one slot of
``slot_bytes`` (the block padded to 4096, :func:`tierstore.io.format.block_slot_bytes`)
in segment ``off // segment_bytes``.

Not thread-safe and holds no lock: it is a room of
:class:`~tierstore.io.segments.SegmentStorage` and is used only under that
store's metadata lock. It never does I/O and never touches per-segment
counters: :meth:`remove` and :meth:`commit` return what the caller needs to
account for them (freed extents, replaced offsets).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ..identity import NamespaceIds
from ..keytable import KeyTable
from ..tiers.storage import StoredBlocks
from . import format as fmt

__all__ = ["BlockLocator"]


class BlockLocator:
    """Key -> payload location of every stored block (module doc).

    Parameters
    ----------
    rows : int
        Initial row capacity (grows as needed).
    segment_bytes : int
        Segment size, to name a payload's segment.
    slot_bytes : int
        Device bytes of one payload slot (the length :meth:`remove` reports).
    """

    def __init__(self, rows: int, segment_bytes: int, slot_bytes: int) -> None:
        self.segment_bytes = int(segment_bytes)
        self.slot_bytes = int(slot_bytes)
        self.table = KeyTable(rows)
        cap = self.table.capacity_rows
        self.off = np.zeros(cap, dtype=np.int64)
        self.crc = np.zeros(cap, dtype=np.uint32)
        self.seq = np.zeros(cap, dtype=np.int64)
        self.ns_id = np.zeros(cap, dtype=np.int32)
        self.namespaces = NamespaceIds()

    def __len__(self) -> int:
        return len(self.table)

    def row(self, key: bytes) -> int:
        """Row of ``key``, or -1."""
        return self.table.get(key)

    def rows_of(self, keys: Sequence[bytes]) -> np.ndarray:
        """int64 row per key, -1 where absent."""
        return self.table.get_many(keys)

    def locate(self, key: bytes) -> tuple[int, int, int] | None:
        """``(segment, payload device offset, slot length in bytes)`` of ``key``, or ``None``."""
        row = self.table.get(key)
        if row < 0:
            return None
        off = int(self.off[row])
        return off // self.segment_bytes, off, self.slot_bytes

    def find(self, keys: Sequence[bytes]) -> list[tuple[int, int, int]]:
        """``(offset, index in keys, crc)`` of each present key, in the order of ``keys``."""
        rows = self.table.get_many(keys)
        return [(int(self.off[r]), i, int(self.crc[r])) for i, r in enumerate(rows.tolist()) if r >= 0]

    def remove(self, keys: Iterable[bytes]) -> list[tuple[int, int]]:
        """Forget ``keys``; the ``(offset, length)`` device extent each present one occupied,
        in the order of ``keys`` (absent keys are skipped)."""
        freed = []
        for k in keys:
            row = self.table.remove(bytes(k))
            if row >= 0:
                freed.append((int(self.off[row]), self.slot_bytes))
        return freed

    def remove_at(self, key: bytes, lo: int, hi: int) -> bool:
        """Forget ``key`` if its current copy lies in device bytes ``[lo, hi)``; whether it did."""
        row = self.table.get(key)
        if row < 0 or not (lo <= int(self.off[row]) < hi):
            return False
        self.table.remove(key)
        return True

    def commit(
        self, ext_off: int, seq: int, entries: Sequence[fmt.BlockEntry]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Point the keys of the extent written at ``ext_off`` (distinct keys) at their new copy.

        Returns ``(rows, replaced)``: the row of each entry, and the device offsets of the
        copies this one retires (keys that were present: a GC copy-forward).
        """
        keys = [e.key for e in entries]
        rows = self.table.get_many(keys)
        new = rows < 0
        replaced = self.off[rows[~new]]
        if new.any():
            rows[new] = self.table.add_absent([keys[i] for i in new.nonzero()[0].tolist()])
            if int(rows.max()) >= self.off.size:
                self._grow()
        self.off[rows] = [ext_off + e.payload_offset for e in entries]
        self.crc[rows] = [e.payload_crc32c for e in entries]
        self.seq[rows] = seq
        if not entries:
            self.ns_id[rows] = 0
        elif all(e.ns_digest == entries[0].ns_digest for e in entries):
            self.ns_id[rows] = self.namespaces.intern(entries[0].ns_digest)
        else:
            self.ns_id[rows] = [self.namespaces.intern(e.ns_digest) for e in entries]
        return rows, replaced

    def place(self, key: bytes, off: int, crc: int, seq: int, ns_digest: bytes) -> int:
        """Point ``key`` (added if absent) at the copy at ``off``; its row (recovery)."""
        row = self.table.get(key)
        if row < 0:
            row, _ = self.table.add(key)
            if row >= self.off.size:
                self._grow()
        self.off[row] = off
        self.crc[row] = crc
        self.seq[row] = seq
        self.ns_id[row] = self.namespaces.intern(ns_digest)
        return row

    def keys_of(self, rows) -> list[bytes]:
        return self.table.keys_of(rows)

    def namespace_of(self, row: int) -> bytes:
        return self.namespaces.digests[int(self.ns_id[row])]

    def rows_of_namespace(self, ns_digest: bytes) -> np.ndarray | None:
        """Rows of the blocks of ``ns_digest``; ``None`` if it was never seen."""
        nid = self.namespaces.ids.get(ns_digest)
        if nid is None:
            return None
        rows = self.table.rows()
        return rows[self.ns_id[rows] == nid]

    def rows_in(self, rows: np.ndarray, lo: int, hi: int) -> np.ndarray:
        """Those of ``rows`` (unique) that are live and whose copy lies in device bytes ``[lo, hi)``."""
        rows = rows[self.table.live_mask(rows)]
        off = self.off[rows]
        return rows[(off >= lo) & (off < hi)]

    def scan(self) -> StoredBlocks:
        """Every block: keys, namespace digest per key, write sequence number per key."""
        rows = self.table.rows()
        keys = self.table.keys_of(rows)
        return StoredBlocks(
            keys, [self.namespaces.digests[i] for i in self.ns_id[rows].tolist()], self.seq[rows].copy()
        )

    def entries(self) -> dict[bytes, tuple[bytes, int]]:
        """``key -> (namespace digest, write sequence number)``."""
        rows = self.table.rows()
        keys = self.table.keys_of(rows)
        return {
            k: (self.namespaces.digests[int(self.ns_id[r])], int(self.seq[r])) for k, r in zip(keys, rows)
        }

    @property
    def nbytes(self) -> int:
        """Bytes of the key table and the per-row arrays."""
        return self.table.nbytes + self.off.nbytes + self.crc.nbytes + self.seq.nbytes + self.ns_id.nbytes

    def _grow(self) -> None:
        cap = self.table.capacity_rows
        for name in ("off", "crc", "seq", "ns_id"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=old.dtype)
            new[: old.size] = old
            setattr(self, name, new)
