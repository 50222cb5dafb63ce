"""A compact map from 32-byte block keys to dense row ids.

The block index and the NVMe region manager each keep one entry per block;
a storage server with a 30 TB NVMe tier of 2 MiB blocks holds 15M of them. A
Python ``dict`` of ``bytes`` keys to ``int`` rows costs about 150 bytes per
entry (the 65-byte ``bytes`` object, a 28-byte ``int`` and the dict's own
slots). :class:`KeyTable` stores the keys back to back in one ``bytearray``
(32 bytes each) and an open-addressing slot array of 32-bit row ids at load
factor <= 1/2 (8 to 16 bytes per key): about 46-62 bytes per key, with the
per-row state kept by the owner in arrays indexed by row (CacheLib Navy's
index takes the same approach: a flat table of small fixed-size entries,
``cachelib/navy/block_cache/Index.h``).

Hashing: keys are SHA-256 digests (:mod:`tierstore.identity`), so their first
8 bytes, read little-endian, are already uniform; the home slot is those bits
masked to the table size. Collisions probe linearly *without* wrapping: the
slot array has a tail past the power-of-two range, so a rebuild can lay the
whole table out with one vectorised pass (sorted home slots, position =
running maximum of ``home - i`` plus ``i``).

Rows are dense and reused after removal, so owners index numpy arrays by row.
Not thread-safe: the owner serialises access under its own lock.

:class:`GhostKeys` is the bounded FIFO of recently refused keys that both
"admit on the second sighting" rules keep (NVMe and remote admission).
"""

from __future__ import annotations

import struct
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np

from .errors import LayoutError

KEY_BYTES = 32
_EMPTY = -1
_TOMB = -2
_V32 = np.dtype("V32")
#: The home-slot hash of a key: its first 8 bytes, little-endian (module doc).
_HOME = struct.Struct("<Q").unpack_from
#: Batches at least this long take the vectorised probe (numpy's fixed cost
#: per call is ~10 us; the scalar probe costs ~0.6 us a key).
VECTOR_MIN_KEYS = 16


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


class KeyTable:
    """32-byte key -> row id (``0 <= row < capacity_rows``).

    Parameters
    ----------
    capacity_rows : int
        Rows to allocate up front (grows by 1.5x when full). Size it to the
        blocks the owner can hold, so no growth slack is spent.

    Notes
    -----
    Memory: ``32`` bytes per row for keys, 1 for the live flag, and 4 bytes per
    slot with ``2 * rows <= slots < 4 * rows``.
    """

    __slots__ = ("_keys", "_live", "_slots", "_mask", "_free", "_next_row", "_n", "_tombs", "_cap")

    def __init__(self, capacity_rows: int = 1024) -> None:
        self._cap = max(16, int(capacity_rows))
        self._keys = bytearray(KEY_BYTES * self._cap)
        self._live = bytearray(self._cap)
        self._free = array("i")
        self._next_row = 0
        self._n = 0
        self._tombs = 0
        self._build_slots(np.empty(0, dtype=np.int64))

    # ------------------------------------------------------------ properties
    def __len__(self) -> int:
        return self._n

    @property
    def capacity_rows(self) -> int:
        """Rows allocated (row ids are below this)."""
        return self._cap

    @property
    def nbytes(self) -> int:
        """Bytes held by the table's buffers."""
        return (
            len(self._keys)
            + len(self._live)
            + self._slots.itemsize * len(self._slots)
            + self._free.itemsize * len(self._free)
        )

    # --------------------------------------------------------------- lookups
    def get(self, key: bytes) -> int:
        """Row of ``key``, or -1."""
        if len(key) != KEY_BYTES:
            return -1
        slots = self._slots
        kb = self._keys
        p = _HOME(key)[0] & self._mask
        while True:
            s = slots[p]
            if s == _EMPTY:
                return -1
            if s >= 0 and kb.startswith(key, s * KEY_BYTES):
                return s
            p += 1

    def get_many(self, keys: Sequence[bytes]) -> np.ndarray:
        """Rows of ``keys`` (``int64``, -1 where absent), vectorised for long batches.

        The vectorised probe compares whole 32-byte keys as ``V32`` records
        (one gather and one compare per probe step) and advances only the keys
        not yet resolved; most keys sit in their home slot, so a batch takes
        one to three steps.

        Raises
        ------
        LayoutError
            If a key is not 32 bytes (vectorised path).
        """
        n = len(keys)
        if n < VECTOR_MIN_KEYS:
            get = self.get
            return np.fromiter((get(k) for k in keys), dtype=np.int64, count=n)
        raw = b"".join(keys)
        if len(raw) != n * KEY_BYTES:
            raise LayoutError("every key must be 32 bytes")
        q = np.frombuffer(raw, dtype=_V32)
        slots = np.frombuffer(self._slots, dtype=np.int32)
        kv = np.frombuffer(self._keys, dtype=_V32)
        pos = (np.frombuffer(raw, dtype="<u8")[::4] & np.uint64(self._mask)).astype(np.intp)
        s = slots[pos]
        match = kv[s] == q  # s < 0 reads some other row: masked next
        match &= s >= 0
        out = np.where(match, s, -1).astype(np.int64)
        more = (~match & (s != _EMPTY)).nonzero()[0]
        if more.size:  # displaced by a collision (about a third of keys): probe on one by one
            get = self.get
            for i in more.tolist():
                out[i] = get(keys[i])
        return out

    def add_absent(self, keys: Sequence[bytes]) -> np.ndarray:
        """Insert ``keys``, which the caller knows are absent and distinct; return their rows.

        One vectorised pass places every key whose home slot is free (empty
        or a tombstone: the key is absent, so no later slot of its probe chain
        can hold it); the others are probed one by one.

        Raises
        ------
        LayoutError
            If a key is not 32 bytes.
        """
        n = len(keys)
        if n < VECTOR_MIN_KEYS:
            return np.fromiter((self.add(k)[0] for k in keys), dtype=np.int64, count=n)
        raw = b"".join(keys)
        if len(raw) != n * KEY_BYTES:
            raise LayoutError("every key must be 32 bytes")
        if 2 * (self._n + self._tombs + n) > self._mask + 1:
            self._rebuild(self._n + n)
        fresh = not self._free
        rows = self._take_rows(n)
        if fresh:  # consecutive new rows: plain byte copies
            r0 = int(rows[0])
            self._keys[r0 * KEY_BYTES : (r0 + n) * KEY_BYTES] = raw
            self._live[r0 : r0 + n] = b"\x01" * n
        else:
            np.frombuffer(self._keys, dtype=_V32)[rows] = np.frombuffer(raw, dtype=_V32)
            np.frombuffer(self._live, dtype=np.uint8)[rows] = 1
        self._n += n
        slots = np.frombuffer(self._slots, dtype=np.int32)
        home = (np.frombuffer(raw, dtype="<u8")[::4] & np.uint64(self._mask)).astype(np.intp)
        s = slots[home]
        free = (s < 0).nonzero()[0]
        r32 = rows.astype(np.int32)
        slots[home[free]] = r32[free]
        # keys sharing a home slot: one of them landed there, the others probe on
        landed = slots[home[free]] == r32[free]
        self._tombs -= int(np.count_nonzero(s[free[landed]] == _TOMB))
        placed = np.zeros(n, dtype=bool)
        placed[free[landed]] = True
        rest = (~placed).nonzero()[0]
        for i in rest.tolist():
            if not self._place(keys[i], int(rows[i])):
                break  # the table was rebuilt: every live row, these included, is placed
        return rows

    def _place(self, key: bytes, row: int) -> bool:
        """Put ``row`` (an absent key, already written) in its first free slot.
        False if the probe ran off the tail and the table was rebuilt instead."""
        slots = self._slots
        p = _HOME(key)[0] & self._mask
        while p < len(slots):
            s = slots[p]
            if s < 0:
                if s == _TOMB:
                    self._tombs -= 1
                slots[p] = row
                return True
            p += 1
        self._rebuild(self._n)
        return False

    def key_of(self, row: int) -> bytes:
        """The key stored at ``row``."""
        o = row * KEY_BYTES
        return bytes(self._keys[o : o + KEY_BYTES])

    def keys_of(self, rows: Iterable[int]) -> list[bytes]:
        """Keys of several rows."""
        kb = self._keys
        return [bytes(kb[r * KEY_BYTES : (r + 1) * KEY_BYTES]) for r in rows]

    def rows(self) -> np.ndarray:
        """Live rows, ascending (``int64``)."""
        return np.flatnonzero(np.frombuffer(self._live, dtype=np.uint8)[: self._next_row])

    def live_mask(self, rows: np.ndarray) -> np.ndarray:
        """Boolean mask: which of ``rows`` hold a key."""
        return np.frombuffer(self._live, dtype=np.uint8)[rows].astype(bool)

    def is_live(self, row: int) -> bool:
        """Whether ``row`` holds a key."""
        return 0 <= row < self._cap and self._live[row] == 1

    # ------------------------------------------------------------- mutation
    def add(self, key: bytes) -> tuple[int, bool]:
        """Insert ``key``; return ``(row, inserted)`` (``inserted`` False if present).

        Raises
        ------
        LayoutError
            If ``key`` is not 32 bytes.
        """
        if len(key) != KEY_BYTES:
            raise LayoutError(f"key of {len(key)} bytes; keys are {KEY_BYTES} bytes")
        slots = self._slots
        kb = self._keys
        p = _HOME(key)[0] & self._mask
        tomb = -1
        while True:
            if p >= len(slots):  # ran off the tail: rebuild bigger, then insert there
                self._rebuild(len(slots))
                return self.add(key)
            s = slots[p]
            if s == _EMPTY:
                break
            if s == _TOMB:
                if tomb < 0:
                    tomb = p
            else:
                o = s * KEY_BYTES
                if kb[o : o + KEY_BYTES] == key:
                    return s, False
            p += 1
        row = self._take_row()
        o = row * KEY_BYTES
        self._keys[o : o + KEY_BYTES] = key
        self._live[row] = 1
        if tomb >= 0:
            self._slots[tomb] = row
            self._tombs -= 1
        else:
            self._slots[p] = row
        self._n += 1
        if 2 * (self._n + self._tombs) > self._mask + 1:
            self._rebuild(self._n)
        return row, True

    def remove(self, key: bytes, free_row: bool = True) -> int:
        """Remove ``key``; return its former row, or -1 if absent.

        With ``free_row=False`` the row is not reused until :meth:`release_row`
        (an owner whose row is still referenced, e.g. by I/O in flight).
        """
        row = self.get(key)
        if row < 0:
            return -1
        slots = self._slots
        p = _HOME(key)[0] & self._mask
        while slots[p] != row:  # the key's slot: the first on its probe chain that holds its row
            p += 1
        slots[p] = _TOMB
        self._tombs += 1
        self._live[row] = 0
        self._n -= 1
        if free_row:
            self._free.append(row)
        return row

    def remove_row(self, row: int) -> bool:
        """Remove the key at ``row``; False if the row is not live."""
        if not self.is_live(row):
            return False
        return self.remove(self.key_of(row)) == row

    def clear(self) -> None:
        """Remove every key (capacity is kept)."""
        cap = self._cap
        self._keys = bytearray(KEY_BYTES * cap)
        self._live = bytearray(cap)
        self._free = array("i")
        self._next_row = 0
        self._n = 0
        self._tombs = 0
        self._build_slots(np.empty(0, dtype=np.int64))

    # ------------------------------------------------------------- internals
    def _take_rows(self, n: int) -> np.ndarray:
        """``n`` free rows (``int64``): freed ones first, then fresh ones."""
        k = min(n, len(self._free))
        out = np.empty(n, dtype=np.int64)
        if k:
            out[:k] = np.frombuffer(self._free, dtype=np.int32)[len(self._free) - k :][::-1]
            del self._free[len(self._free) - k :]
        fresh = n - k
        if fresh:
            while self._next_row + fresh > self._cap:
                self._grow_rows()
            out[k:] = np.arange(self._next_row, self._next_row + fresh)
            self._next_row += fresh
        return out

    def _take_row(self) -> int:
        if self._free:
            return self._free.pop()
        if self._next_row >= self._cap:
            self._grow_rows()
        r = self._next_row
        self._next_row += 1
        return r

    def detach(self, key: bytes) -> int:
        """Make ``key`` unfindable but keep its row reserved; see :meth:`release_row`."""
        return self.remove(key, free_row=False)

    def release_row(self, row: int) -> None:
        """Return a row detached with :meth:`detach` to the free list."""
        self._free.append(row)

    def _grow_rows(self) -> None:
        new_cap = self._cap + max(16, self._cap // 2)
        keys = bytearray(KEY_BYTES * new_cap)
        keys[: len(self._keys)] = self._keys
        live = bytearray(new_cap)
        live[: len(self._live)] = self._live
        self._keys, self._live, self._cap = keys, live, new_cap

    def _rebuild(self, at_least: int) -> None:
        self._build_slots(self.rows(), at_least)

    def _build_slots(self, rows: np.ndarray, at_least: int = 0) -> None:
        """Lay out every live row again: vectorised linear probing, no wrap."""
        n = int(rows.size)
        nslots = _pow2_at_least(max(32, 2 * max(n, at_least, self._cap // 2)))
        mask = nslots - 1
        if n:
            kv = np.frombuffer(self._keys, dtype="<u8").reshape(self._cap, 4)
            home = (kv[rows, 0] & np.uint64(mask)).astype(np.int64)
            order = np.argsort(home, kind="stable")
            hs = home[order]
            idx = np.arange(n, dtype=np.int64)
            pos = np.maximum.accumulate(hs - idx) + idx
            end = int(pos[-1]) + 1
        else:
            pos = order = np.empty(0, dtype=np.int64)
            end = 0
        total = max(nslots, end) + 64  # tail: probes never wrap
        slots = np.full(total, _EMPTY, dtype=np.int32)
        if n:
            slots[pos] = rows[order].astype(np.int32)
        self._slots = array("i", slots.tobytes())
        self._mask = mask
        self._tombs = 0


class GhostKeys:
    """A bounded FIFO set of keys: the "ghost" set of a second-sighting admission rule.

    TinyLFU's doorkeeper (G. Einziger, R. Friedman and B. Manes, ACM TOS 13(4),
    2017, section 3.4.2) as an exact key set instead of a Bloom filter.

    Parameters
    ----------
    limit : int
        Keys remembered; adding one more forgets the oldest. Memory is about
        ``100 * limit`` bytes (a 32-byte ``bytes`` key and its dict entry).
    """

    __slots__ = ("limit", "_keys")

    def __init__(self, limit: int) -> None:
        self.limit = int(limit)
        self._keys: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def take(self, key: bytes) -> bool:
        """Forget ``key``; whether it was remembered (its second sighting)."""
        if key in self._keys:
            del self._keys[key]
            return True
        return False

    def add(self, key: bytes) -> None:
        """Remember ``key`` (the newest), forgetting the oldest beyond :attr:`limit`."""
        self._keys[key] = None
        if len(self._keys) > self.limit:
            self._keys.popitem(last=False)
