"""Where each block of the segment store lies: key -> (segment, offset, length).

:class:`BlockLocator` maps a 32-byte block key to a dense row of a
:class:`~tierstore.keytable.KeyTable` that it owns (holder ``LOCATOR``; the block index may
share it: :attr:`BlockLocator.key_table`) and keeps, per row, in numpy arrays:
the payload's device offset (:meth:`~BlockLocator.offsets`), its CRC-32C (``crc``),
the sequence number of the extent it was written in (:meth:`~BlockLocator.seqs`) and
its interned namespace (``ns_id``; ``namespaces.digests[ns_id]`` is the 32-byte digest).
Narrow where the range allows, widened (never wrapped) where it does not: offsets as
``uint32`` counts of 4096 bytes on a device under 16 TiB (else ``int64`` bytes), seqs
as ``uint32`` offsets from a base (rebased, or ``int64`` once live seqs span 2**32),
namespace ids ``uint16`` up to 65535 namespaces (then ``int32``). About 58 bytes per
block, no Python object per block. Every payload occupies one slot of ``slot_bytes``
(the block padded to 4096, :func:`tierstore.io.format.block_slot_bytes`) in segment
``offset // segment_bytes``.

Not thread-safe and holds no lock (the key table has its own, innermost): a room of
:class:`~tierstore.io.segments.SegmentStorage` and is used only under that
store's metadata lock. It never does I/O and never touches per-segment
counters: :meth:`remove` and :meth:`commit` return what the caller needs to
account for them (freed extents, replaced offsets).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from ..errors import LayoutError
from ..identity import NamespaceIds
from ..keytable import LOCATOR, HeldKeys, KeyTable
from ..tiers.storage import StoredBlocks
from . import format as fmt

__all__ = ["BlockLocator"]

_U32_SPAN = 1 << 32
#: Namespace ids a ``uint16`` column holds (the next one widens it to ``int32``).
_U16_IDS = 1 << 16


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
    device_bytes : int, optional
        The tier's size: offsets are kept as ``uint32`` counts of
        :data:`~tierstore.io.format.ALIGN_BYTES` when every offset below it fits
        (a device under 16 TiB), else (or when ``None``) as ``int64`` bytes.

    Raises
    ------
    LayoutError
        From :meth:`commit` and :meth:`place`: an offset not a multiple of
        ``ALIGN_BYTES``, or at or past ``device_bytes`` (a narrow column cannot hold it).
    """

    def __init__(
        self, rows: int, segment_bytes: int, slot_bytes: int, device_bytes: int | None = None
    ) -> None:
        self.segment_bytes = int(segment_bytes)
        self.slot_bytes = int(slot_bytes)
        self.table = HeldKeys(KeyTable(rows), LOCATOR, owner=True)
        cap = self.table.capacity_rows
        narrow = device_bytes is not None and device_bytes <= fmt.ALIGN_BYTES * _U32_SPAN
        self._off_unit = fmt.ALIGN_BYTES if narrow else 1
        self._off_end = int(device_bytes) if narrow and device_bytes is not None else 1 << 63
        self._off: np.ndarray = np.zeros(cap, dtype=np.uint32 if narrow else np.int64)
        self.crc = np.zeros(cap, dtype=np.uint32)
        self._seq: np.ndarray = np.zeros(cap, dtype=np.uint32)
        self._seq_base: int | None = None  # seq of row r: _seq[r] + _seq_base (int64 column: base 0)
        self.ns_id: np.ndarray = np.zeros(cap, dtype=np.uint16)
        self.namespaces = NamespaceIds()

    def __len__(self) -> int:
        return len(self.table)

    @property
    def key_table(self) -> KeyTable:
        """The key table (owned here; the block index holds its keys in it too when
        ``build.assemble`` gives it to the index)."""
        return self.table.table

    # ------------------------------------------------------------ columns
    def offsets(self, rows):
        """Payload device offsets in bytes (``int64``) of ``rows`` (an int or an index array)."""
        off = self._off[rows]
        if self._off_unit == 1:
            return off if isinstance(off, np.ndarray) else int(off)
        if isinstance(off, np.ndarray):
            return off.astype(np.int64) * self._off_unit
        return int(off) * self._off_unit

    def seqs(self, rows):
        """Write sequence numbers (``int64``) of ``rows`` (an int or an index array)."""
        base = self._seq_base or 0
        seq = self._seq[rows]
        if isinstance(seq, np.ndarray):
            return seq.astype(np.int64) + base
        return int(seq) + base

    def _stored_off(self, off) -> np.ndarray:
        """Byte offsets ``off`` (an int or a list) as the offset column stores them; checked
        before any row changes (:class:`BlockLocator`'s ``Raises``)."""
        off = np.asarray(off, dtype=np.int64)
        if self._off_unit == 1 or not off.size:
            return off
        if bool((off % self._off_unit).any()) or int(off.max()) >= self._off_end or int(off.min()) < 0:
            raise LayoutError(
                f"payload offsets must be multiples of {self._off_unit} below {self._off_end} "
                f"(the device's size): got {np.atleast_1d(off).tolist()[:4]}"
            )
        return off // self._off_unit

    def _fit_seq(self, seq: int) -> int:
        """Make the seq column hold ``seq`` (before any row changes): rebase the ``uint32``
        column, or widen it to ``int64`` once live seqs and ``seq`` span 2**32 or more (module
        doc). Returns what to store for ``seq``."""
        if self._seq.dtype == np.uint32:
            if self._seq_base is None:
                self._seq_base = seq - (_U32_SPAN >> 1)  # room both ways: recovery meets seqs in any order
            elif not 0 <= seq - self._seq_base < _U32_SPAN:
                self._rebase_seqs(seq)
        return seq - (self._seq_base or 0)

    def _rebase_seqs(self, seq: int) -> None:
        live = self.table.held_rows()
        lo = hi = seq
        if live.size:
            vals = self._seq[live]
            base = self._seq_base or 0
            lo, hi = min(lo, int(vals.min()) + base), max(hi, int(vals.max()) + base)
        if hi - lo >= _U32_SPAN:
            self._seq = self._seq.astype(np.int64) + (self._seq_base or 0)
            self._seq_base = None
            return
        new_base = lo - ((_U32_SPAN - 1 - (hi - lo)) >> 1)  # the live span centred
        assert self._seq_base is not None
        # modular uint32 arithmetic: exact for live rows (their new offsets fit), dead rows are junk
        self._seq += np.uint32((self._seq_base - new_base) % _U32_SPAN)
        self._seq_base = new_base

    def _put_ns(self, rows, nid) -> None:
        """Store namespace ids ``nid`` (an int or a list) at ``rows``, widening past ``uint16``."""
        if self.ns_id.dtype == np.uint16 and len(self.namespaces.digests) > _U16_IDS:
            self.ns_id = self.ns_id.astype(np.int32)
        self.ns_id[rows] = nid

    # ------------------------------------------------------------ lookups
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
        off = self.offsets(row)
        return off // self.segment_bytes, off, self.slot_bytes

    def find(self, keys: Sequence[bytes]) -> list[tuple[int, int, int]]:
        """``(offset, index in keys, crc)`` of each present key, in the order of ``keys``."""
        rows = self.table.get_many(keys)
        return [(self.offsets(r), i, int(self.crc[r])) for i, r in enumerate(rows.tolist()) if r >= 0]

    def remove(self, keys: Iterable[bytes]) -> list[tuple[int, int]]:
        """Forget ``keys``; the ``(offset, length)`` device extent each present one occupied,
        in the order of ``keys`` (absent keys are skipped)."""
        freed = []
        for k in keys:
            row = self.table.remove(bytes(k))
            if row >= 0:
                freed.append((self.offsets(row), self.slot_bytes))
        return freed

    def remove_at(self, key: bytes, lo: int, hi: int) -> bool:
        """Forget ``key`` if its current copy lies in device bytes ``[lo, hi)``; whether it did."""
        row = self.table.get(key)
        if row < 0 or not (lo <= self.offsets(row) < hi):
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
        off = self._stored_off([ext_off + e.payload_offset for e in entries])
        stored_seq = self._fit_seq(seq)
        rows = self.table.get_many(keys)
        new = rows < 0
        replaced = self.offsets(rows[~new])
        if new.any():
            rows[new] = self.table.add_absent([keys[i] for i in new.nonzero()[0].tolist()])
            if int(rows.max()) >= self._off.size:
                self._grow()
        self._off[rows] = off
        self.crc[rows] = [e.payload_crc32c for e in entries]
        self._seq[rows] = stored_seq
        if not entries:
            self.ns_id[rows] = 0
        elif all(e.ns_digest == entries[0].ns_digest for e in entries):
            self._put_ns(rows, self.namespaces.intern(entries[0].ns_digest))
        else:
            self._put_ns(rows, [self.namespaces.intern(e.ns_digest) for e in entries])
        return rows, replaced

    def place(self, key: bytes, off: int, crc: int, seq: int, ns_digest: bytes) -> int:
        """Point ``key`` (added if absent) at the copy at ``off``; its row (recovery)."""
        stored = self._stored_off(off)
        stored_seq = self._fit_seq(seq)
        row = self.table.get(key)
        if row < 0:
            row, _ = self.table.add(key)
            if row >= self._off.size:
                self._grow()
        self._off[row] = stored
        self.crc[row] = crc
        self._seq[row] = stored_seq
        self._put_ns(row, self.namespaces.intern(ns_digest))
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
        off = self.offsets(rows)
        return rows[(off >= lo) & (off < hi)]

    def scan(self) -> StoredBlocks:
        """Every block: keys, namespace digest per key, write sequence number per key."""
        rows = self.table.rows()
        keys = self.table.keys_of(rows)
        return StoredBlocks(
            keys, [self.namespaces.digests[i] for i in self.ns_id[rows].tolist()], self.seqs(rows)
        )

    def entries(self) -> dict[bytes, tuple[bytes, int]]:
        """``key -> (namespace digest, write sequence number)``."""
        rows = self.table.rows()
        keys = self.table.keys_of(rows)
        seqs = self.seqs(rows).tolist()
        return {k: (self.namespaces.digests[int(self.ns_id[r])], s) for k, r, s in zip(keys, rows, seqs)}

    @property
    def nbytes(self) -> int:
        """Bytes of the key table and the per-row arrays."""
        return self.table.nbytes + self._off.nbytes + self.crc.nbytes + self._seq.nbytes + self.ns_id.nbytes

    def _grow(self) -> None:
        cap = self.table.capacity_rows
        for name in ("_off", "crc", "_seq", "ns_id"):
            old = getattr(self, name)
            new = np.zeros(cap, dtype=old.dtype)
            new[: old.size] = old
            setattr(self, name, new)
