"""A compact map from 32-byte block keys to dense row ids.

The block index and the NVMe locator share one entry per block (15M for a 30 TB
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

Rows are dense, reused last freed first; owners index numpy arrays by row. Two holders may
share a table (:class:`HeldKeys`, which keeps each side's own row order): a row's ``held`` byte
has a bit per holder; a slot is emptied when its last holder lets go. Its own lock, innermost,
is held for one operation. :class:`GhostKeys`: the bounded FIFO of refused keys.
"""

from __future__ import annotations

import mmap
import struct
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import cast

import numpy as np

from .errors import LayoutError

KEY_BYTES = 32
_EMPTY = 0  # slot values: 0 empty, -1 tombstone, row + 1 the key at that row
_TOMB = -1
_V32 = np.dtype("V32")
_NO_ROW = np.int64(-1)
#: The home-slot hash of a key: its first 8 bytes, little-endian (module doc).
_HOME = struct.Struct("<Q").unpack_from
#: Batches at least this long take the vectorised probe (numpy's fixed cost
#: per call is ~10 us; the scalar probe costs ~0.6 us a key).
VECTOR_MIN_KEYS = 16
#: Lookups (:meth:`KeyTable.get_many`) of at least this many keys take the vectorised probe:
#: below, the inlined scalar probe (~0.5-0.8 us a key) costs less than its ~15 numpy calls (1-2 us
#: each on a 2-vCPU VM); measured equal at ~32-40 keys (``bench/README_core.md``, session 39).
FIND_VECTOR_MIN_KEYS = 32
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
#: Holder bits of a row's ``held`` byte (:class:`HeldKeys`): the block index and the NVMe
#: locator. A holder's bit ``<< 2`` marks a row it detached (reserved, its key unfindable for
#: it). A key's slot stays while a holder bit is set; its row is freed when the byte is 0.
INDEX = 1
LOCATOR = 2
_HOLDERS = INDEX | LOCATOR
#: ``held byte -> 1/0`` per holder: rows it holds (lookups), rows it may adopt (another holder
#: has the key and it neither holds nor reserves that row).
_HOLDS = {h: bytes(1 if v & h else 0 for v in range(16)) for h in (INDEX, LOCATOR)}
_ANY = bytes(1 if v & _HOLDERS else 0 for v in range(16))  # any holder: every slot's row
_ADOPTS = {
    h: bytes(1 if v & (_HOLDERS ^ h) and not v & (h | h << 2) else 0 for v in range(16))
    for h in (INDEX, LOCATOR)
}


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


def _probe(slots: memoryview, p: int, keys: bytearray, held: bytearray, key: bytes, accept: bytes) -> int:
    """Where ``key`` is, in a row whose held byte ``accept`` maps to 1, on the probe chain that
    starts at slot ``p`` of ``slots`` (tombstones are stepped over), or -1 at the empty slot that
    ends the chain; ``keys``, ``held``: the table's key bytes and held bytes."""
    while True:
        s = slots[p]
        if s == _EMPTY:
            return -1
        if s > 0 and keys.startswith(key, (s - 1) * KEY_BYTES) and accept[held[s - 1]]:
            return p
        p += 1


def _probe_keys(
    slots: memoryview,
    keys: bytearray,
    held: bytearray,
    find: Sequence[bytes],
    homes: Sequence[int],
    accept: bytes,
) -> list[int]:
    """:func:`_probe` of each key of ``find`` from its slot in ``homes`` (-1: none, the key's row is
    -1), inlined: one loop, no call a key (a call a key made a ``get_many`` of 64 ~10 % slower).
    Returns the row of each key, -1 at the empty slot that ends its chain."""
    starts = keys.startswith
    out = []
    for k, p in zip(find, homes):
        row = -1
        while p >= 0:
            v = slots[p]
            if v == _EMPTY:
                break
            if v > 0 and starts(k, (v - 1) * KEY_BYTES) and accept[held[v - 1]]:
                row = v - 1
                break
            p += 1
        out.append(row)
    return out


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


def _check_lengths(keys: Sequence[bytes]) -> None:
    """Refuse a batch with a key that is not 32 bytes, before any of it is taken.

    Raises
    ------
    LayoutError
        Naming the first such key's length.
    """
    if any(len(k) != KEY_BYTES for k in keys):
        bad = next(len(k) for k in keys if len(k) != KEY_BYTES)
        raise LayoutError(f"key of {bad} bytes; keys are {KEY_BYTES} bytes")


class KeyTable:
    """32-byte key -> row id (``0 <= row < capacity_rows``), for one or two holders.

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
    Holders: every method takes ``holder`` (:data:`INDEX`, the default, or :data:`LOCATOR`);
    a holder finds, lists and removes only the keys it holds, and :meth:`add` of a key another
    holder has sets its bit on that row (adopts it) instead of inserting a second copy. A key
    a holder detached (:meth:`detach`) keeps its row reserved for it; that holder's next
    :meth:`add` of the key takes a new row and slot (a key then has two slots, each held by
    one holder). :class:`HeldKeys` binds a holder. Thread-safe: every method holds the
    table's own lock for its one operation (never across I/O, never calling out).

    Memory: ``32`` bytes per row for keys, 1 for the ``held`` byte, and 4 bytes per
    slot: the power of two at least ``max(capacity_rows, 2 * keys)`` (never less
    than before) plus ``TAIL_SLOTS``, so ``2 * keys <= slots < 4 * keys`` once keys
    pass half the capacity; during a rehash the old array too (module doc).
    """

    __slots__ = (
        "_keys", "_held", "_sa", "_slots", "_mask", "_oa", "_old", "_old_mask", "_old_at", "_debt",
        "_free", "_next_row", "_n", "_count", "_tombs", "_cap", "_lock", "rehash_slots", "full_rebuilds",
    )  # fmt: skip

    _sa: np.ndarray  # the slot array inserts go to, and a memoryview of it (fast scalar reads)
    _slots: memoryview
    _oa: np.ndarray | None  # during a rehash: the array being moved, and its memoryview
    _old: memoryview | None

    def __init__(self, capacity_rows: int = 1024) -> None:
        self._cap = max(16, int(capacity_rows))
        self._lock = threading.Lock()
        self.rehash_slots = 0
        self.full_rebuilds = 0
        self.clear()

    # ------------------------------------------------------------ properties
    def __len__(self) -> int:
        """Keys held by any holder."""
        return self._n

    def held_count(self, holder: int = INDEX) -> int:
        """Keys ``holder`` holds."""
        return self._count[holder]

    @property
    def capacity_rows(self) -> int:
        """Rows allocated (row ids are below this)."""
        return self._cap

    @property
    def nbytes(self) -> int:
        """Bytes held by the table's buffers (during a rehash also the old array's slots not
        moved yet: the moved ones' pages are given back)."""
        with self._lock:
            old = 0 if self._oa is None else 4 * (self._oa.size - self._old_at)
            return (
                len(self._keys)
                + len(self._held)
                + self._sa.nbytes
                + old
                + self._free.itemsize * len(self._free)
            )

    @property
    def rehashing(self) -> bool:
        """Whether an old slot array is still being moved."""
        return self._oa is not None

    def holder(self, holder: int, owner: bool) -> HeldKeys:
        """This table as ``holder`` sees it; ``owner``: whether its :attr:`HeldKeys.nbytes`
        counts the table (one owner per table)."""
        return HeldKeys(self, holder, owner)

    def reserve(self, rows: int) -> None:
        """Grow to at least ``rows`` rows, exactly (a second holder sizes the table for its
        blocks too)."""
        with self._lock:
            if self._cap < rows:
                self._grow_rows(int(rows))

    # --------------------------------------------------------------- lookups
    def get(self, key: bytes, holder: int = INDEX) -> int:
        """Row of ``key`` if ``holder`` holds it, else -1."""
        if len(key) != KEY_BYTES:
            return -1
        with self._lock:  # :func:`_probe`, inlined: a get is the hot path of every lookup (a call: +10%)
            kb = self._keys
            hb = self._held
            h = _HOME(key)[0]
            slots = self._slots
            p = h & self._mask
            while True:
                s = slots[p]
                if s == _EMPTY:
                    break
                if s > 0 and kb.startswith(key, (s - 1) * KEY_BYTES) and hb[s - 1] & holder:
                    return s - 1
                p += 1
            return -1 if self._old is None else self._find_old(key, h, _HOLDS[holder])

    def _find(self, key: bytes, accept: bytes) -> int:
        """Row of ``key`` whose held byte ``accept`` maps to 1, or -1 (a probe of the new array,
        then of the old one's unmoved slots)."""
        h = _HOME(key)[0]
        p = _probe(self._slots, h & self._mask, self._keys, self._held, key, accept)
        if p >= 0:
            return self._slots[p] - 1
        return -1 if self._old is None else self._find_old(key, h, accept)

    def _find_old(self, key: bytes, h: int, accept: bytes) -> int:
        """Row of ``key`` (home hash ``h``) in the old array of a rehash, or -1."""
        old = self._old
        assert old is not None
        p = _probe(old, max(h & self._old_mask, self._old_at), self._keys, self._held, key, accept)
        return old[p] - 1 if p >= 0 else -1  # slots below _old_at were moved

    def get_many(self, keys: Sequence[bytes], holder: int = INDEX) -> np.ndarray:
        """Rows of ``keys`` that ``holder`` holds (``int64``, -1 elsewhere), vectorised for
        long batches.

        The vectorised probe compares whole 32-byte keys as ``V32`` records
        (one gather and one compare at the home slot, in the new array and
        during a rehash in the old one); keys displaced by a collision (about
        a third) are probed on one by one.

        Raises
        ------
        LayoutError
            If a key is not 32 bytes (vectorised path).
        """
        with self._lock:  # every slot held by holder (a table of one holder): no mask to gather
            return self._find_many(keys, _ANY if self._n == self._count[holder] else _HOLDS[holder])

    def _find_many(self, keys: Sequence[bytes], accept: bytes) -> np.ndarray:
        n = len(keys)
        if n < FIND_VECTOR_MIN_KEYS:
            return _find_short(self, keys, accept)
        raw = b"".join(keys)
        if len(raw) != n * KEY_BYTES:
            raise LayoutError("every key must be 32 bytes")
        ok = None if accept is _ANY else np.frombuffer(accept, dtype=np.uint8).astype(bool)
        hv = None if ok is None else np.frombuffer(self._held, dtype=np.uint8)
        q = np.frombuffer(raw, dtype=_V32)
        kv = np.frombuffer(self._keys, dtype=_V32)
        h = np.frombuffer(raw, dtype="<u8")[::4]
        # the home slots: the hash's low bits, read as int64 (an index array as it is, no astype)
        home = h.view(np.int64) & self._mask
        s = self._sa[home]
        r = s - 1
        match = kv[r] == q  # s <= 0 reads some other row: masked next
        match &= s > 0
        if ok is not None and hv is not None:
            match &= ok[hv[r]]
        out = np.where(match, r, _NO_ROW)  # int64 (the scalar's type wins): no astype
        full = s != _EMPTY
        more = full > match  # a full home slot that is not the key's: probe on from the next one
        if self._oa is not None:  # not in the new array: its home slot in the old one
            idx = (~match & (s == _EMPTY)).nonzero()[0]
            pos = np.maximum((h[idx] & np.uint64(self._old_mask)).astype(np.intp), self._old_at)
            so = self._oa[pos]
            hit = (kv[so - 1] == q[idx]) & (so > 0)
            if ok is not None and hv is not None:
                hit &= ok[hv[so - 1]]
            out[idx[hit]] = so[hit] - 1
            more[idx[~hit & (so != _EMPTY)]] = True
        more_at = more.nonzero()[0].tolist()
        if more_at:  # displaced by a collision (or, in a rehash, maybe in the old array): probe on
            homes = (home + full).tolist()  # past a full home slot; an empty one (rehash): -1 there
            found = _probe_keys(
                self._slots,
                self._keys,
                self._held,
                [keys[i] for i in more_at],
                [homes[i] for i in more_at],
                accept,
            )
            for i, row in zip(more_at, found):
                if row < 0 and self._old is not None:
                    row = self._find_old(keys[i], _HOME(keys[i])[0], accept)
                out[i] = row
        return out

    def key_of(self, row: int) -> bytes:
        """The key stored at ``row``."""
        o = row * KEY_BYTES
        return bytes(self._keys[o : o + KEY_BYTES])

    def keys_of(self, rows: Iterable[int]) -> list[bytes]:
        """Keys of several rows."""
        kb = self._keys
        return [bytes(kb[r * KEY_BYTES : (r + 1) * KEY_BYTES]) for r in rows]

    def rows(self, holder: int = INDEX) -> np.ndarray:
        """Rows ``holder`` holds, ascending (``int64``)."""
        with self._lock:
            return np.flatnonzero(np.frombuffer(self._held, dtype=np.uint8)[: self._next_row] & holder)

    def live_mask(self, rows: np.ndarray, holder: int = INDEX) -> np.ndarray:
        """Boolean mask: which of ``rows`` ``holder`` holds."""
        with self._lock:
            return (np.frombuffer(self._held, dtype=np.uint8)[rows] & holder) != 0

    def is_live(self, row: int, holder: int = INDEX) -> bool:
        """Whether ``holder`` holds ``row``."""
        return 0 <= row < self._cap and bool(self._held[row] & holder)

    # ------------------------------------------------------------- mutation
    def add(self, key: bytes, holder: int = INDEX) -> tuple[int, bool]:
        """Hold ``key``; return ``(row, inserted)`` (``inserted`` False if ``holder`` held it;
        True also when it adopted another holder's row).

        Raises
        ------
        LayoutError
            If ``key`` is not 32 bytes.
        """
        with self._lock:
            return self._add(key, holder)

    def _add(self, key: bytes, holder: int) -> tuple[int, bool]:
        if len(key) != KEY_BYTES:
            raise LayoutError(f"key of {len(key)} bytes; keys are {KEY_BYTES} bytes")
        slots = self._slots
        kb = self._keys
        hb = self._held
        h = _HOME(key)[0]
        p = h & self._mask
        free = -1  # the first tombstone on the key's chain, else the empty slot that ends it
        adopt = -1  # the key's row held by another holder only (not one this holder detached)
        while True:
            s = slots[p]
            if s == _EMPTY:
                break
            if s == _TOMB:
                if free < 0:
                    free = p
            elif kb.startswith(key, (s - 1) * KEY_BYTES):
                if hb[s - 1] & holder:
                    return s - 1, False
                if adopt < 0 and _ADOPTS[holder][hb[s - 1]]:
                    adopt = s - 1
            p += 1
        if self._old is not None:
            row = self._find_old(key, h, _HOLDS[holder])
            if row >= 0:
                return row, False
            if adopt < 0:
                adopt = self._find_old(key, h, _ADOPTS[holder])
        if adopt >= 0:
            hb[adopt] |= holder
            self._count[holder] += 1
            return adopt, True
        if free < 0:
            free = p
        if self._oa is None and 2 * (self._n + self._tombs + 1) > self._mask + 1:
            self._make_room(1)
            free = -1  # inserts go to the new array now
        row = self._take_row()
        o = row * KEY_BYTES
        kb = self._keys  # _take_row may have grown it
        kb[o : o + KEY_BYTES] = key
        self._held[row] = holder
        self._n += 1
        self._count[holder] += 1
        if 0 <= free < len(slots) - 1:  # the last slot stays empty
            if slots[free] == _TOMB:
                self._tombs -= 1
            slots[free] = row + 1
        else:
            self._place(row)
        self._step(1)
        return row, True

    def add_many(self, keys: Sequence[bytes], holder: int = INDEX) -> tuple[list[int], list[int]]:
        """Hold each of ``keys`` in order, with one scalar probe a key (:meth:`add`'s): a key
        given twice is taken once (its later copy finds it). Returns ``(rows, inserted)``: the
        row of every key, and the indices of the keys that took a row (inserted, or another
        holder's row adopted). For short calls, where it costs less than a vectorised lookup
        and a batch insert (the block index's short store path).

        Raises
        ------
        LayoutError
            If a key is not 32 bytes (checked before anything is taken).
        """
        _check_lengths(keys)
        out: list[int] = []
        inserted: list[int] = []
        with self._lock:
            for i, key in enumerate(keys):
                row, new = self._add(key, holder)
                out.append(row)
                if new:
                    inserted.append(i)
        return out, inserted

    def add_absent(self, keys: Sequence[bytes], holder: int = INDEX) -> np.ndarray:
        """Hold ``keys``, which the caller knows ``holder`` does not hold and are distinct;
        return their rows (another holder's rows adopted, the other keys inserted).

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
            _check_lengths(keys)  # before any key is taken
        with self._lock:
            if n < VECTOR_MIN_KEYS:
                return np.fromiter((self._add(k, holder)[0] for k in keys), dtype=np.int64, count=n)
            rows = self._find_many(keys, _ADOPTS[holder]) if self._n > self._count[holder] else None
            if rows is None or not (rows >= 0).any():
                return self._insert(keys, holder)
            got = (rows >= 0).nonzero()[0]
            np.frombuffer(self._held, dtype=np.uint8)[rows[got]] |= holder
            self._count[holder] += int(got.size)
            fresh = (rows < 0).nonzero()[0]
            if fresh.size:
                rows[fresh] = self._insert([keys[i] for i in fresh.tolist()], holder)
            return rows

    def _insert(self, keys: Sequence[bytes], holder: int) -> np.ndarray:
        """Rows for ``keys``, in no slot: fresh or freed rows (:meth:`add_absent`)."""
        n = len(keys)
        if n < VECTOR_MIN_KEYS:
            return np.fromiter((self._add(k, holder)[0] for k in keys), dtype=np.int64, count=n)
        raw = b"".join(keys)
        if len(raw) != n * KEY_BYTES:
            raise LayoutError("every key must be 32 bytes")
        self._make_room(n)
        fresh = not self._free
        rows = self._take_rows(n)
        if fresh:  # consecutive new rows: plain byte copies
            r0 = int(rows[0])
            self._keys[r0 * KEY_BYTES : (r0 + n) * KEY_BYTES] = raw
            self._held[r0 : r0 + n] = bytes([holder]) * n
        else:
            np.frombuffer(self._keys, dtype=_V32)[rows] = np.frombuffer(raw, dtype=_V32)
            np.frombuffer(self._held, dtype=np.uint8)[rows] = holder
        self._n += n
        self._count[holder] += n
        self._place_rows(rows)
        self._step(n)
        return rows

    def remove(self, key: bytes, free_row: bool = True, holder: int = INDEX) -> int:
        """Let go of ``key``; return its former row, or -1 if ``holder`` did not hold it.

        Its slot is emptied when no holder is left, its row freed when no holder holds or
        reserves it. With ``free_row=False`` ``holder`` keeps the row reserved until
        :meth:`release_row` (an owner whose row is still referenced, e.g. by I/O in flight).
        """
        if len(key) != KEY_BYTES:
            return -1
        with self._lock:
            return self._remove(key, free_row, holder)

    def _remove(self, key: bytes, free_row: bool, holder: int) -> int:
        hb = self._held
        h = _HOME(key)[0]
        slots = self._slots
        p = _probe(slots, h & self._mask, self._keys, hb, key, _HOLDS[holder])
        if p < 0:  # not in the new array: in the old one's unmoved slots, during a rehash
            if self._old is None:
                return -1
            slots = self._old
            p = _probe(slots, max(h & self._old_mask, self._old_at), self._keys, hb, key, _HOLDS[holder])
            if p < 0:
                return -1
        row = slots[p] - 1
        v = hb[row] & (0xFF ^ holder)
        if not free_row:
            v |= holder << 2
        hb[row] = v
        self._count[holder] -= 1
        if not v & _HOLDERS:  # the last holder let go
            slots[p] = _TOMB  # an old array's tombstones go with it
            if slots is self._slots:
                self._tombs += 1
            self._n -= 1
        if not v:
            self._free.append(row)
        return row

    def remove_row(self, row: int, holder: int = INDEX) -> bool:
        """Let go of the key at ``row``; False if ``holder`` does not hold the row."""
        with self._lock:
            if not self.is_live(row, holder):
                return False
            return self._remove(self.key_of(row), True, holder) == row

    def detach(self, key: bytes, holder: int = INDEX) -> int:
        """Make ``key`` unfindable for ``holder`` but keep its row reserved; see :meth:`release_row`."""
        return self.remove(key, False, holder)

    def release_row(self, row: int, holder: int = INDEX) -> None:
        """Give up a row ``holder`` detached with :meth:`detach` (freed if no holder is left)."""
        with self._lock:
            v = self._held[row] & (0xFF ^ (holder << 2))
            self._held[row] = v
            if not v:
                self._free.append(row)

    def drop_holder(self, holder: int) -> int:
        """Let go of every row ``holder`` holds or reserves (a new block index over a table an
        earlier one held); returns the keys it held."""
        with self._lock:
            hv = np.frombuffer(self._held, dtype=np.uint8)[: self._next_row]
            held = np.flatnonzero(hv & holder).tolist()
            reserved = np.flatnonzero(hv & (holder << 2)).tolist()
            del hv  # no view of the buffer outlives the call (a growth resizes it)
        for row in held:
            with self._lock:
                self._remove(self.key_of(row), True, holder)
        for row in reserved:
            self.release_row(row, holder)
        return len(held)

    def clear(self) -> None:
        """Remove every key of every holder (capacity is kept)."""
        with self._lock:
            cap = self._cap
            self._keys = bytearray(KEY_BYTES * cap)
            self._held = bytearray(cap)
            self._free = array("i")
            self._next_row = 0
            self._n = 0
            self._count = [0] * (_HOLDERS + 1)
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

    def _take_row(self) -> int:
        if self._free:
            return self._free.pop()
        if self._next_row >= self._cap:
            self._grow_rows()
        r = self._next_row
        self._next_row += 1
        return r

    def _grow_rows(self, new_cap: int = 0) -> None:
        """1.5x the rows (or ``new_cap``), extending the buffers in place: ``realloc`` (``mremap``
        for a large buffer: no copy) and zeros in chunks, so the old and the new keys are never
        held at once (that doubled the table's peak memory at each growth)."""
        new_cap = new_cap or self._cap + max(16, self._cap // 2)
        for buf, n in ((self._keys, KEY_BYTES * (new_cap - self._cap)), (self._held, new_cap - self._cap)):
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
        rows = np.flatnonzero(np.frombuffer(self._held, dtype=np.uint8)[: self._next_row] & _HOLDERS)
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


def _find_short(t: KeyTable, keys: Sequence[bytes], accept: bytes) -> np.ndarray:
    """:meth:`KeyTable._find_many` of a short batch: one scalar probe a key (:func:`_probe_keys`). A key
    that is not 32 bytes is -1 in a batch shorter than ``VECTOR_MIN_KEYS``, else a
    :class:`LayoutError` (the vectorised probe's answer, kept for batches it used to take)."""
    if len(keys) >= VECTOR_MIN_KEYS:
        _check_lengths(keys)
    mask = t._mask
    homes = [_HOME(k)[0] & mask if len(k) == KEY_BYTES else -1 for k in keys]
    out = _probe_keys(t._slots, t._keys, t._held, keys, homes, accept)
    if t._old is not None:
        for i, row in enumerate(out):
            if row < 0 and homes[i] >= 0:
                out[i] = t._find_old(keys[i], _HOME(keys[i])[0], accept)
    return np.array(out, dtype=np.int64)


class HeldKeys:
    """One holder's side of a :class:`KeyTable`: its methods with ``holder`` bound, and the
    holder's own row order.

    The block index holds its keys through ``HeldKeys(table, INDEX, ...)``, the NVMe locator
    through ``HeldKeys(table, LOCATOR, ...)``; each keeps its per-row columns indexed by the
    shared rows and grows them to :attr:`capacity_rows` when a row of its own passes their end.

    Order: a shared table's row numbers depend on both holders' history, so a side that shares
    its table numbers its rows itself: each row it takes gets the number a table of its own
    would have given it (its *ordinal*: the last one it let go of, else the next new one; a
    detached row keeps its ordinal until :meth:`release_row`), kept in an ``int32`` column
    (4 B a row). :meth:`rows` and :meth:`in_order` list rows in ordinal order, so every
    decision ordered by row (the index's flush candidates and removals, the locator's
    copy-forward, scan and invalidation order) is the one a table of the holder's own gives.

    Parameters
    ----------
    table : KeyTable
    holder : int
        :data:`INDEX` or :data:`LOCATOR`.
    owner : bool
        Whether this side owns the table: its :attr:`nbytes` counts the table's bytes (the
        other side's counts none, so the two sides' sums count the table once).
    shared : bool
        Whether another holder may take rows of the table (then ordinals are kept); ``False``:
        this side is the table's only holder and its row numbers are its order.

    Raises
    ------
    ValueError
        If ``holder`` is neither :data:`INDEX` nor :data:`LOCATOR`.
    """

    __slots__ = (
        "table", "holder", "owner", "get", "get_many", "_add", "_add_absent", "_remove",
        "_release_row", "live_mask", "is_live", "key_of", "keys_of", "_ord", "_ord_free", "_ord_next",
    )  # fmt: skip

    def __init__(self, table: KeyTable, holder: int, owner: bool, shared: bool = True) -> None:
        if holder not in _HOLDS:
            raise ValueError(f"holder must be INDEX ({INDEX}) or LOCATOR ({LOCATOR}), not {holder}")
        self.table, self.holder, self.owner = table, holder, owner
        # the lookups: the table's bound methods for INDEX, their default holder (a partial with a
        # keyword cost ~0.35 us more a scalar get), a functools.partial (no Python frame) else
        self.get: Callable[[bytes], int] = table.get if holder == INDEX else partial(table.get, holder=holder)
        self.get_many: Callable[[Sequence[bytes]], np.ndarray] = (
            table.get_many if holder == INDEX else partial(table.get_many, holder=holder)
        )
        self._add = partial(table.add, holder=holder)
        self._add_absent = partial(table.add_absent, holder=holder)
        self._remove = partial(table.remove, holder=holder)
        self._release_row = partial(table.release_row, holder=holder)
        self.live_mask: Callable[[np.ndarray], np.ndarray] = partial(table.live_mask, holder=holder)
        self.is_live: Callable[[int], bool] = partial(table.is_live, holder=holder)
        self.key_of = table.key_of
        self.keys_of = table.keys_of
        # ordinals (class doc): per row, the free list (last freed, first reused), the next new one
        self._ord: np.ndarray | None = np.zeros(table.capacity_rows, dtype=np.int32) if shared else None
        self._ord_free = array("i")
        self._ord_next = 0

    def __len__(self) -> int:
        """Keys this holder holds."""
        return self.table.held_count(self.holder)

    @property
    def capacity_rows(self) -> int:
        """Rows the table has allocated (every row id is below it)."""
        return self.table.capacity_rows

    @property
    def nbytes(self) -> int:
        """The table's bytes if this side owns it, else 0; and this side's ordinals."""
        own = 0 if self._ord is None else self._ord.nbytes + self._ord_free.itemsize * len(self._ord_free)
        return own + (self.table.nbytes if self.owner else 0)

    # ------------------------------------------------------------ mutation
    def add(self, key: bytes) -> tuple[int, bool]:
        """:meth:`KeyTable.add` for this holder (a row it takes gets its ordinal)."""
        row, new = self._add(key)
        if new and self._ord is not None:
            self._number(np.array([row], dtype=np.int64))
        return row, new

    def add_many(self, keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """:meth:`KeyTable.add_many` for this holder (the rows it takes get ordinals, in order)."""
        rows, inserted = self.table.add_many(keys, self.holder)
        if inserted and self._ord is not None:
            self._number(np.array([rows[i] for i in inserted], dtype=np.int64))
        return rows, inserted

    def add_absent(self, keys: Sequence[bytes]) -> np.ndarray:
        """:meth:`KeyTable.add_absent` for this holder (ordinals given in the order of ``keys``)."""
        rows = self._add_absent(keys)
        if rows.size and self._ord is not None:
            self._number(rows)
        return rows

    def remove(self, key: bytes, free_row: bool = True) -> int:
        """:meth:`KeyTable.remove` for this holder (the row's ordinal is free again unless
        ``free_row`` is False)."""
        row = self._remove(key, free_row)
        if row >= 0 and free_row and self._ord is not None:
            self._ord_free.append(int(self._ord[row]))
        return row

    def remove_row(self, row: int) -> bool:
        """Let go of the key at ``row``; False if this holder does not hold the row."""
        if not self.is_live(row):
            return False
        return self.remove(self.key_of(row)) == row

    def detach(self, key: bytes) -> int:
        """:meth:`KeyTable.detach` for this holder (the row keeps its ordinal)."""
        return self.remove(key, False)

    def release_row(self, row: int) -> None:
        """:meth:`KeyTable.release_row` for this holder (the row's ordinal is free again)."""
        self._release_row(row)
        if self._ord is not None:
            self._ord_free.append(int(self._ord[row]))

    def _number(self, rows: np.ndarray) -> None:
        """Give ``rows`` (taken in this order) the ordinals a table of this holder's own would
        give them: freed ones first, last freed first, then new ones."""
        assert self._ord is not None
        if int(rows.max()) >= self._ord.size:
            grown = np.zeros(self.table.capacity_rows, dtype=np.int32)
            grown[: self._ord.size] = self._ord
            self._ord = grown
        n = int(rows.size)
        free = self._ord_free
        k = min(n, len(free))
        if k:
            self._ord[rows[:k]] = np.frombuffer(free, dtype=np.int32)[len(free) - k :][::-1]
            del free[len(free) - k :]
        if n > k:
            self._ord[rows[k:]] = np.arange(self._ord_next, self._ord_next + n - k, dtype=np.int32)
            self._ord_next += n - k

    # ------------------------------------------------------------ order
    def held_rows(self) -> np.ndarray:
        """Rows this holder holds, by row number (``int64``): for sets, sums and checks (in a
        shared table row numbers are no order of this holder's: :meth:`rows`)."""
        return self.table.rows(self.holder)

    def rows(self) -> np.ndarray:
        """Rows this holder holds (``int64``) in its order: the ascending rows of a table of its
        own (class doc)."""
        return self.in_order(self.table.rows(self.holder))

    def in_order(self, rows: np.ndarray) -> np.ndarray:
        """``rows`` (distinct rows this holder holds or reserves, ``int64``) in its order."""
        if self._ord is None:
            return np.sort(rows)
        if rows.size < 2:
            return rows
        o = self._ord[rows]
        if 16 * rows.size < self._ord_next:  # few: a sort
            return rows[np.argsort(o, kind="stable")]
        at = np.full(self._ord_next, -1, dtype=np.int32)  # many: ordinals are distinct, place them
        at[o] = rows
        return at[at >= 0].astype(np.int64)


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
