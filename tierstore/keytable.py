"""A compact map from 32-byte block keys to dense row ids.

The block index and the NVMe locator keep one entry per block (15M for a 30 TB
tier of 2 MiB blocks); a ``dict`` of ``bytes`` to ``int`` costs ~150 B an entry.
:class:`KeyTable` stores the keys back to back in one ``bytearray`` (32 B each)
and an open-addressing slot array of 32-bit entries (0 empty, -1 tombstone,
``row + 1`` a key) at load factor <= 1/2 (8 to 16 B a key): 41-49 B a key, the
per-row state kept by the owner in arrays indexed by row (CacheLib Navy's index:
a flat table of small entries, ``cachelib/navy/block_cache/Index.h``).

Hashing: keys are SHA-256 digests (:mod:`tierstore.identity`), so their first 8
bytes, little-endian, are uniform; the home slot is those bits masked to the
table size. Collisions probe linearly without wrapping, into ``TAIL_SLOTS``
past the power-of-two range (the last slot stays empty: every probe ends).

Resizing is incremental (Redis's ``dictRehash``, ``src/dict.c``): when keys and
tombstones pass half the slots, a zeroed array (anonymous ``mmap``: no pass over it) takes
every insert, and inserts move the keys of ``REHASH_SLOTS_PER_KEY`` old slots each into
it, in steps of at least ``REHASH_BATCH_SLOTS`` (so no call moves more than their sum);
lookups probe the new array, then the old one from its first unmoved slot. No call does work that grows
with the table (:attr:`KeyTable.rehash_slots` counts the slots moved). Both arrays
are held until the move ends, at most ``len(old) / 16`` inserts later (the new
one's load stays under 5/8). Only a probe that runs off the tail (a run of 256
full slots) lays the table out again at once (:attr:`KeyTable.full_rebuilds`).

Rows are dense and reused last freed, first reused, so owners index numpy arrays
by row. Not thread-safe: the owner serialises access. :class:`GhostKeys` is the
bounded FIFO of refused keys that the "admit on the second sighting" rules keep.
"""

from __future__ import annotations

import mmap
import struct
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import cast

import numpy as np

from .errors import LayoutError

KEY_BYTES = 32
_EMPTY = 0  # slot values: 0 empty, -1 tombstone, row + 1 the key at that row
_TOMB = -1
_V32 = np.dtype("V32")
#: The home-slot hash of a key: its first 8 bytes, little-endian (module doc).
_HOME = struct.Struct("<Q").unpack_from
#: Batches at least this long take the vectorised probe (numpy's fixed cost
#: per call is ~10 us; the scalar probe costs ~0.6 us a key).
VECTOR_MIN_KEYS = 16
#: Vectorised probe steps a batch insert takes for keys displaced from their home slot
#: (every slot a key steps past is full, so where it lands is on its probe chain).
_PROBE_ROUNDS = 4
#: Slots past the power-of-two range (probes never wrap), and the fewest slots of a table.
TAIL_SLOTS = 256
MIN_SLOTS = 256
#: Old slots moved during a rehash per key inserted, in steps of at least ``REHASH_BATCH_SLOTS``
#: (one step moves them with a few numpy calls). With ``len(old) <= 2 * len(new)``, 16 a key
#: ends the move before the new array takes ``len(new) / 8 + 64`` more keys (load ~<= 5/8).
REHASH_SLOTS_PER_KEY = 16
REHASH_BATCH_SLOTS = 1024
#: Zeros appended per step when the row buffers grow (the only transient of a growth).
_GROW_CHUNK_BYTES = 1 << 20


def _pow2_at_least(n: int) -> int:
    p = 1
    while p < n:
        p <<= 1
    return p


def _zeroed(n: int) -> tuple[np.ndarray, memoryview]:
    """An ``int32`` slot array of ``n`` empty slots and a memoryview of it (scalar reads as fast
    as ``array``'s). A private anonymous ``mmap``: the OS zeroes each page at its first touch,
    so no call pays for the whole array (``np.zeros``' ``calloc`` memsets it once glibc's mmap
    threshold has risen past its size), and :func:`_drop_pages` can free pages of it."""
    buf = mmap.mmap(-1, 4 * n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(buf, dtype=np.int32)
    return a, a.data


def _drop_pages(a: np.ndarray, start: int, end: int) -> None:
    """Give the OS back the pages of an array from :func:`_zeroed` that end in slots
    ``[start, end)`` (slots below ``start`` given back before): ``MADV_DONTNEED``, they read as
    zeros after. So unmapping the array later costs no pass over it (freeing 8 MiB of touched
    pages at once took 0.6-1.6 ms)."""
    lo = 4 * start // mmap.PAGESIZE * mmap.PAGESIZE
    hi = 4 * end // mmap.PAGESIZE * mmap.PAGESIZE
    if hi > lo:
        view = cast(memoryview, a.base)  # np.frombuffer's base: the memoryview of the mmap
        cast(mmap.mmap, view.obj).madvise(mmap.MADV_DONTNEED, lo, hi - lo)


class KeyTable:
    """32-byte key -> row id (``0 <= row < capacity_rows``).

    Parameters
    ----------
    capacity_rows : int
        Rows to allocate up front (grows by 1.5x when full). Size it to the
        blocks the owner can hold, so no growth slack is spent.

    Attributes
    ----------
    rehash_slots : int
        Old slots moved by incremental rehashing so far (each insert call moves at most
        ``REHASH_BATCH_SLOTS + REHASH_SLOTS_PER_KEY * keys inserted``).
    full_rebuilds : int
        Whole-table layouts after a probe ran off the tail (expected 0).

    Notes
    -----
    Memory: ``32`` bytes per row for keys, 1 for the live flag, and 4 bytes per
    slot: the power of two at least ``max(capacity_rows, 2 * keys)`` (never less
    than before) plus ``TAIL_SLOTS``, so ``2 * keys <= slots < 4 * keys`` once keys
    pass half the capacity; during a rehash the old array too (module doc).
    """

    __slots__ = (
        "_keys", "_live", "_sa", "_slots", "_mask", "_oa", "_old", "_old_mask", "_old_at", "_debt",
        "_free", "_next_row", "_n", "_tombs", "_cap", "rehash_slots", "full_rebuilds",
    )  # fmt: skip

    _sa: np.ndarray  # the slot array inserts go to, and a memoryview of it (fast scalar reads)
    _slots: memoryview
    _oa: np.ndarray | None  # during a rehash: the array being moved, and its memoryview
    _old: memoryview | None

    def __init__(self, capacity_rows: int = 1024) -> None:
        self._cap = max(16, int(capacity_rows))
        self._keys = bytearray(KEY_BYTES * self._cap)
        self._live = bytearray(self._cap)
        self._free = array("i")
        self.rehash_slots = 0
        self.full_rebuilds = 0
        self.clear()

    # ------------------------------------------------------------ properties
    def __len__(self) -> int:
        return self._n

    @property
    def capacity_rows(self) -> int:
        """Rows allocated (row ids are below this)."""
        return self._cap

    @property
    def nbytes(self) -> int:
        """Bytes held by the table's buffers (during a rehash also the old array's slots not
        moved yet: the moved ones' pages are given back)."""
        old = 0 if self._oa is None else 4 * (self._oa.size - self._old_at)
        return (
            len(self._keys) + len(self._live) + self._sa.nbytes + old + self._free.itemsize * len(self._free)
        )

    @property
    def rehashing(self) -> bool:
        """Whether an old slot array is still being moved."""
        return self._oa is not None

    # --------------------------------------------------------------- lookups
    def get(self, key: bytes) -> int:
        """Row of ``key``, or -1."""
        if len(key) != KEY_BYTES:
            return -1
        kb = self._keys
        h = _HOME(key)[0]
        slots = self._slots
        p = h & self._mask
        while True:
            s = slots[p]
            if s == _EMPTY:
                break
            if s > 0 and kb.startswith(key, (s - 1) * KEY_BYTES):
                return s - 1
            p += 1
        return -1 if self._old is None else self._get_old(key, h)

    def _get_old(self, key: bytes, h: int) -> int:
        """Row of ``key`` (home hash ``h``) in the old array of a rehash, or -1."""
        old = self._old
        assert old is not None
        kb = self._keys
        p = max(h & self._old_mask, self._old_at)  # slots below _old_at were moved
        while True:
            s = old[p]
            if s == _EMPTY:
                return -1
            if s > 0 and kb.startswith(key, (s - 1) * KEY_BYTES):
                return s - 1
            p += 1

    def get_many(self, keys: Sequence[bytes]) -> np.ndarray:
        """Rows of ``keys`` (``int64``, -1 where absent), vectorised for long batches.

        The vectorised probe compares whole 32-byte keys as ``V32`` records
        (one gather and one compare at the home slot, in the new array and
        during a rehash in the old one); keys displaced by a collision (about
        a third) are probed on one by one.

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
        kv = np.frombuffer(self._keys, dtype=_V32)
        h = np.frombuffer(raw, dtype="<u8")[::4]
        s = self._sa[(h & np.uint64(self._mask)).astype(np.intp)]
        match = kv[s - 1] == q  # s <= 0 reads some other row: masked next
        match &= s > 0
        out = np.where(match, s - 1, -1).astype(np.int64)
        more = ~match & (s != _EMPTY)
        if self._oa is not None:  # not in the new array: its home slot in the old one
            idx = (~match & (s == _EMPTY)).nonzero()[0]
            pos = np.maximum((h[idx] & np.uint64(self._old_mask)).astype(np.intp), self._old_at)
            so = self._oa[pos]
            hit = (kv[so - 1] == q[idx]) & (so > 0)
            out[idx[hit]] = so[hit] - 1
            more[idx[~hit & (so != _EMPTY)]] = True
        get = self.get
        for i in more.nonzero()[0].tolist():  # displaced by a collision: probe on one by one
            out[i] = get(keys[i])
        return out

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
        rows, inserted = self.add_many((key,))
        return rows[0], bool(inserted)

    def add_many(self, keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """Insert each of ``keys`` that is not present, in order, with one scalar probe a key
        (a key given twice is inserted once: its later copy finds it). Returns ``(rows,
        inserted)``: the row of every key, and the indices of the keys inserted. The rehash
        steps of the inserts are taken once, after the last (:meth:`add_absent` does the same).

        Raises
        ------
        LayoutError
            If a key is not 32 bytes (checked before anything is inserted).
        """
        if len(b"".join(keys)) != KEY_BYTES * len(keys):
            bad = next(len(k) for k in keys if len(k) != KEY_BYTES)
            raise LayoutError(f"key of {bad} bytes; keys are {KEY_BYTES} bytes")
        out: list[int] = []
        inserted: list[int] = []
        for i, key in enumerate(keys):
            slots = self._slots
            kb = self._keys
            h = _HOME(key)[0]
            p = h & self._mask
            free = -1  # the first tombstone on the key's chain, else the empty slot that ends it
            row = -1
            while True:
                s = slots[p]
                if s == _EMPTY:
                    break
                if s == _TOMB:
                    if free < 0:
                        free = p
                elif kb.startswith(key, (s - 1) * KEY_BYTES):
                    row = s - 1
                    break
                p += 1
            if row < 0 and self._old is not None:
                row = self._get_old(key, h)
            if row >= 0:
                out.append(row)
                continue
            if free < 0:
                free = p
            if self._oa is None and 2 * (self._n + self._tombs + 1) > self._mask + 1:
                self._make_room(1)
                free = -1  # inserts go to the new array now
            if self._free:  # a freed row first (last freed, first reused), else a fresh one
                row = self._free.pop()
            else:
                if self._next_row >= self._cap:
                    self._grow_rows()
                row = self._next_row
                self._next_row += 1
            o = row * KEY_BYTES
            self._keys[o : o + KEY_BYTES] = key  # _grow_rows extends the buffer
            self._live[row] = 1
            self._n += 1
            if 0 <= free < len(slots) - 1:  # the last slot stays empty
                if slots[free] == _TOMB:
                    self._tombs -= 1
                slots[free] = row + 1
            else:
                self._place(row)
            out.append(row)
            inserted.append(i)
        if inserted:
            self._step(len(inserted))
        return out, inserted

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
            return np.array(self.add_many(keys)[0], dtype=np.int64)
        raw = b"".join(keys)
        if len(raw) != n * KEY_BYTES:
            raise LayoutError("every key must be 32 bytes")
        self._make_room(n)
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
        self._place_rows(rows)
        self._step(n)
        return rows

    def remove(self, key: bytes, free_row: bool = True) -> int:
        """Remove ``key``; return its former row, or -1 if absent.

        With ``free_row=False`` the row is not reused until :meth:`release_row`
        (an owner whose row is still referenced, e.g. by I/O in flight).
        """
        if len(key) != KEY_BYTES:
            return -1
        kb = self._keys
        h = _HOME(key)[0]
        slots = self._slots
        p = h & self._mask
        while True:  # one probe: the new array, then the old one's unmoved slots
            s = slots[p]
            if s == _EMPTY:
                if slots is self._old or self._old is None:
                    return -1
                slots = self._old
                p = max(h & self._old_mask, self._old_at)
                continue
            if s > 0 and kb.startswith(key, (s - 1) * KEY_BYTES):
                break
            p += 1
        slots[p] = _TOMB  # an old array's tombstones go with it
        if slots is self._slots:
            self._tombs += 1
        row = s - 1
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

    def detach(self, key: bytes) -> int:
        """Make ``key`` unfindable but keep its row reserved; see :meth:`release_row`."""
        return self.remove(key, free_row=False)

    def release_row(self, row: int) -> None:
        """Return a row detached with :meth:`detach` to the free list."""
        self._free.append(row)

    def clear(self) -> None:
        """Remove every key (capacity is kept)."""
        cap = self._cap
        self._keys = bytearray(KEY_BYTES * cap)
        self._live = bytearray(cap)
        self._free = array("i")
        self._next_row = 0
        self._n = 0
        self._tombs = 0
        nslots = _pow2_at_least(max(MIN_SLOTS, cap))
        self._sa, self._slots = _zeroed(nslots + TAIL_SLOTS)
        self._mask = nslots - 1
        self._oa = self._old = None
        self._old_mask = self._old_at = self._debt = 0

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

    def _grow_rows(self) -> None:
        """1.5x the rows, extending the buffers in place: ``realloc`` (``mremap`` for a large
        buffer: no copy) and zeros in chunks, so the old and the new keys are never held at
        once (that doubled the table's peak memory at each growth)."""
        new_cap = self._cap + max(16, self._cap // 2)
        for buf, n in ((self._keys, KEY_BYTES * (new_cap - self._cap)), (self._live, new_cap - self._cap)):
            for done in range(0, n, _GROW_CHUNK_BYTES):
                buf.extend(bytes(min(_GROW_CHUNK_BYTES, n - done)))
        self._cap = new_cap

    def _make_room(self, n: int) -> None:
        """Before ``n`` inserts: start a rehash if keys and tombstones would pass half the slots."""
        if self._oa is None and 2 * (self._n + self._tombs + n) > self._mask + 1:
            nslots = _pow2_at_least(max(MIN_SLOTS, self._cap, 2 * (self._n + n), self._mask + 1))
            self._oa, self._old, self._old_mask, self._old_at = self._sa, self._slots, self._mask, 0
            self._debt = 0
            self._sa, self._slots = _zeroed(nslots + TAIL_SLOTS)
            self._mask = nslots - 1
            self._tombs = 0

    def _step(self, inserted: int) -> None:
        """Move the keys of the next old slots into the new array (module doc)."""
        old = self._oa
        if old is None:
            return
        self._debt += REHASH_SLOTS_PER_KEY * inserted
        if self._debt < REHASH_BATCH_SLOTS:  # a step costs numpy's fixed cost: batch them
            return
        a = self._old_at
        b = min(len(old), a + self._debt)
        self._debt = 0
        v = old[a:b]
        rows = v[v > 0].astype(np.int64) - 1
        _drop_pages(old, a, b)  # the moved pages (rows is a copy)
        self._old_at = b  # before placing: a full rebuild there finds these rows live
        self.rehash_slots += b - a
        if b == len(old):
            self._oa = self._old = None
        if rows.size:
            self._place_rows(rows)

    def _place_rows(self, rows: np.ndarray) -> None:
        """Put ``rows`` (keys absent from the new array, already written) in their first free slots."""
        if rows.size < VECTOR_MIN_KEYS:
            for r in rows.tolist():
                if not self._place(r):
                    return
            return
        slots = self._sa
        kv = np.frombuffer(self._keys, dtype="<u8").reshape(self._cap, 4)
        home = (kv[rows, 0] & np.uint64(self._mask)).astype(np.intp)
        s = slots[home]
        free = (s <= 0).nonzero()[0]
        r1 = (rows + 1).astype(np.int32)
        slots[home[free]] = r1[free]
        # keys sharing a home slot: one of them landed there, the others probe on
        landed = free[slots[home[free]] == r1[free]]
        self._tombs -= int(np.count_nonzero(s[landed] == _TOMB))
        placed = np.zeros(rows.size, dtype=bool)
        placed[landed] = True
        rest = (~placed).nonzero()[0]
        pos = home[rest]
        last = len(slots) - 2  # the last slot stays empty: every probe ends
        for _ in range(_PROBE_ROUNDS):  # displaced keys step on together (module doc: linear probing)
            if rest.size < VECTOR_MIN_KEYS:
                break
            pos = np.minimum(pos + 1, last)
            s = slots[pos]
            free = (s <= 0).nonzero()[0]
            slots[pos[free]] = r1[rest[free]]
            won = free[slots[pos[free]] == r1[rest[free]]]
            self._tombs -= int(np.count_nonzero(s[won] == _TOMB))
            keep = np.ones(rest.size, dtype=bool)
            keep[won] = False
            rest, pos = rest[keep], pos[keep]
        for r in rows[rest].tolist():
            if not self._place(r):
                return  # the table was laid out again: every live row, these included, is placed

    def _place(self, row: int) -> bool:
        """Put ``row`` (a key absent from the new array, already written) in its first free
        slot. False if the probe reached the last slot and the table was laid out again."""
        slots = self._slots
        end = len(slots) - 1  # the last slot stays empty: every probe ends
        p = _HOME(self._keys, row * KEY_BYTES)[0] & self._mask
        while p < end:
            s = slots[p]
            if s <= 0:
                if s == _TOMB:
                    self._tombs -= 1
                slots[p] = row + 1
                return True
            p += 1
        self._rebuild()
        return False

    def _rebuild(self) -> None:
        """Lay out every live row at once (vectorised linear probing, no wrap): only after a
        probe ran off the tail."""
        self.full_rebuilds += 1
        rows = self.rows()
        n = int(rows.size)
        nslots = _pow2_at_least(max(MIN_SLOTS, self._cap, 2 * n, self._mask + 1))
        mask = nslots - 1
        kv = np.frombuffer(self._keys, dtype="<u8").reshape(self._cap, 4)
        home = (kv[rows, 0] & np.uint64(mask)).astype(np.int64)
        order = np.argsort(home, kind="stable")
        idx = np.arange(n, dtype=np.int64)
        pos = np.maximum.accumulate(home[order] - idx) + idx
        end = int(pos[-1]) + 1 if n else 0
        self._sa, self._slots = _zeroed(max(nslots, end) + TAIL_SLOTS)
        self._sa[pos] = (rows[order] + 1).astype(np.int32)
        self._mask = mask
        self._tombs = 0
        self._oa = self._old = None
        self._old_mask = self._old_at = self._debt = 0


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
