"""The index's rows: one row per block in numpy arrays, no Python object per block.

:class:`RowTable` holds its keys in a :class:`~tierstore.keytable.KeyTable` (key -> row; its own,
or the NVMe locator's, shared: holder ``INDEX``) and owns every
per-row array (flags, memory slots, namespace id, chain position, hits, times, request
references, readers, pin expiry, lifetime hint and class, NVMe write time), about 33 bytes a
row: times are millisecond ticks (``TICKS_PER_S``), counters 16-bit, and a column is rebased
or widened by the first value past its range, never wrapped. It replaces its arrays when it
grows or widens, so nobody keeps an array in an attribute: a room reads ``rows.flags`` under
the index lock each time (or binds it in a method that cannot grow the table). :class:`EntryView`
is what policies read about one row. The ``flags`` byte of a row says what is in flight and
where its copies are; ``TOP`` maps it to the fastest readable tier. Every method runs under
the owner's lock (``BlockIndex._lock``); this module has none.
"""

from __future__ import annotations

import dataclasses
import math
import operator
import threading
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..contract import MEMORY_TIERS, Tier
from ..errors import Status
from ..fdp.lifetime import LifetimeClass
from ..identity import NamespaceIds
from ..keytable import INDEX, HeldKeys, KeyTable
from ..tiers.memory import SlotAllocator

# --- row flags
PENDING = 1  # a store of this key is in flight: not visible yet
EVICT_HBM = 2  # its HBM copy is being evicted: not readable
EVICT_HOST = 4  # its host copy is being evicted: not readable
DOOMED = 8  # removed while in use: freed when the last user goes
ON_NVME = 16  # has a copy on the NVMe tier
NVME_WRITING = 32  # a demotion write to NVMe is in flight
IN_HBM = 64  # holds an HBM slot (``slot[HBM][row] >= 0``)
IN_HOST = 128  # holds a host slot (``slot[HOST][row] >= 0``)
EVICT = {Tier.HBM: EVICT_HBM, Tier.HOST: EVICT_HOST}
IN = {Tier.HBM: IN_HBM, Tier.HOST: IN_HOST}
NO_HINT = -1
#: Flags of a row that some plan or request still holds (never a victim, never freed).
BUSY = PENDING | DOOMED | EVICT_HBM | EVICT_HOST | NVME_WRITING


def _top_of_flags(f: int) -> int:
    """Fastest readable tier (0 HBM, 1 host, 2 NVMe) of a row with flags ``f``, or -1."""
    if f & (PENDING | DOOMED):
        return -1
    if f & IN_HBM and not f & EVICT_HBM:
        return 0
    if f & IN_HOST and not f & EVICT_HOST:
        return 1
    return 2 if f & ON_NVME else -1


#: ``flags -> fastest readable tier`` for every flag byte: one gather finds the
#: tops of a whole chain (:meth:`RowTable.tops`).
TOP = np.array([_top_of_flags(f) for f in range(256)], dtype=np.int64)
TOP_TIER = [None if t < 0 else Tier(t) for t in TOP.tolist()]

#: Per-row arrays other than ``flags`` and ``slot``: ``(name, dtype, fill of a new element)``.
_ARRAYS = (
    ("ns", np.uint16, 0),  # widened to int32 past 65535 namespaces (``_init``)
    ("pos", np.int16, 0),  # widened to int32 past position 32767 (``_init``): ``identity.POSITION_MAX``
    ("hits", np.uint16, 0),  # saturates at 65535 (``count_hits``)
    ("created", np.uint32, 0),  # the four times: ticks (``TICKS_PER_S``), ``RowTable.stamp``
    ("last", np.uint32, 0),
    ("refs", np.int16, 0),  # widened to int32 past 32767 (``count_up``)
    ("readers", np.int16, 0),  # widened to int32 past 32767 (``count_up``)
    ("pin_until", np.uint32, 0),
    ("hint", np.int8, NO_HINT),
    ("nvme_class", np.int8, NO_HINT),
    ("nvme_at", np.uint32, 0),
)
#: The time columns: ticks after :attr:`RowTable.tick_base`; 0 stands for time 0.0 (never written,
#: not pinned), every time stored is a tick in ``[1, tick_max]``.
TIMES = ("created", "last", "pin_until", "nvme_at")
#: Resolution of the time columns: 1 ms. A time is stored as the nearest tick (a pin's expiry as
#: the next tick at or after it: a lease never ends early, at most 1 ms late). Times 1 ms apart or
#: more keep their order; closer ones may tie (a hit within the write's millisecond does not count
#: as a hit since written). ``uint32`` ticks span 2**32 - 2 ms (49.7 days) of live times.
TICKS_PER_S = 1000
HITS_MAX = 0xFFFF
_TICK_MAX_U32 = 0xFFFFFFFF
_COUNT_MAX_I16 = 0x7FFF
_HITS_BELOW_MAX, _ONE_U16 = np.uint16(HITS_MAX - 1), np.uint16(1)


def _row_field(array: str, cast: Callable[[Any], Any]) -> Any:
    """A read-only :class:`EntryView` attribute: the view's element of row array ``array``, as ``cast``.
    A plain ``property`` (as fast as a hand-written one); its type is the annotation at its use."""
    get = operator.attrgetter(array)
    return property(lambda view: cast(get(view._rows)[view.row]))


def _time_field(array: str) -> Any:
    """A read-only :class:`EntryView` time attribute: the view's element of time column ``array``,
    as clock seconds (0.0 for tick 0)."""
    get = operator.attrgetter(array)

    def read(view: EntryView) -> float:
        rows = view._rows
        t = int(get(rows)[view.row])
        return (rows.tick_base + t) / TICKS_PER_S if t else 0.0

    return property(read)


def _lifetime(hint: np.int8) -> LifetimeClass | None:
    return None if hint == NO_HINT else LifetimeClass(int(hint))


class EntryView:
    """What policies may read about one block (:class:`tierstore.policies.base.EntryInfo`).

    A view over the row arrays, made on demand; not kept by the index. Every
    attribute but ``key``, ``size_bytes`` and ``ns`` is one row array's element.
    ``nvme_written_s``: when its NVMe copy was last written (stored, demoted or
    copied forward), clock seconds; 0.0 if it never was (a reinsertion policy's
    reference bit: ``last_access_s > nvme_written_s`` means hit since written).
    The times are clock seconds to the millisecond (:data:`TICKS_PER_S`); ``hits``
    stops at :data:`HITS_MAX`.
    """

    __slots__ = ("_rows", "row", "key")

    hits: int = _row_field("hits", int)
    last_access_s: float = _time_field("last")
    created_s: float = _time_field("created")
    position: int = _row_field("pos", int)
    lifetime: LifetimeClass | None = _row_field("hint", _lifetime)
    ref_count: int = _row_field("refs", int)
    nvme_written_s: float = _time_field("nvme_at")

    def __init__(self, rows: RowTable, row: int, key: bytes) -> None:
        self._rows = rows
        self.row = row
        self.key = key

    @property
    def size_bytes(self) -> int:
        return self._rows.block_bytes

    @property
    def ns(self) -> bytes:
        return self._rows.namespaces.digests[int(self._rows.ns[self.row])]


def distinct(rows: np.ndarray) -> bool:
    """Whether an index array names each row once (then a fancy-indexed update counts each row
    once, as ``ufunc.at`` would, at a fraction of its cost: ~4 us against ~25 us for 128 rows).
    One comparison when ascending (the common case), else one sort."""
    if rows.size < 2 or bool((rows[1:] > rows[:-1]).all()):
        return True
    s = np.sort(rows)
    return not bool((s[1:] == s[:-1]).any())


class RowTable:
    """Key table and per-row arrays of the block index (no lock of its own).

    Parameters
    ----------
    capacity_rows : int
        Rows to allocate up front (the table grows beyond it).
    block_bytes : int
        Bytes per block (what :attr:`EntryView.size_bytes` says).
    slot_counts : dict, optional
        Slots of each memory tier: a tier's slot column is ``int16`` when every slot and -1
        fit (under 32768 slots), else ``int32`` (the default where not given).
    table : KeyTable, optional
        A key table another holder owns (the NVMe locator's, from ``build.assemble``): the
        index holds its keys in it (reserving ``capacity_rows``) and does not count its bytes.
        ``None``: a table of its own.
    """

    # the per-row arrays of _ARRAYS (set by name in __init__ and grow)
    ns: np.ndarray
    pos: np.ndarray
    hits: np.ndarray
    created: np.ndarray
    last: np.ndarray
    refs: np.ndarray
    readers: np.ndarray
    pin_until: np.ndarray
    hint: np.ndarray
    nvme_class: np.ndarray
    nvme_at: np.ndarray

    def __init__(
        self,
        capacity_rows: int,
        block_bytes: int,
        slot_counts: dict[Tier, int] | None = None,
        table: KeyTable | None = None,
    ) -> None:
        self.block_bytes = block_bytes
        if table is None:
            self.table = HeldKeys(KeyTable(capacity_rows), INDEX, owner=True, shared=False)
        else:
            table.reserve(capacity_rows)
            table.drop_holder(INDEX)  # an earlier index's keys (the same NVMe tier reopened)
            self.table = HeldKeys(table, INDEX, owner=False)
        cap = self.table.capacity_rows
        # one spare element at the end, always 0: ``flags[-1]`` is the flags of
        # an absent key (row -1), so chains are classified without masking
        self.flags = np.zeros(cap + 1, dtype=np.uint8)
        counts = slot_counts or {}
        self.slot = {
            t: np.full(cap, -1, dtype=np.int16 if counts.get(t, 1 << 31) <= 1 << 15 else np.int32)
            for t in MEMORY_TIERS
        }
        for name, dtype, fill in _ARRAYS:
            setattr(self, name, np.full(cap, fill, dtype=dtype))
        self.tick_base = 0  # the time columns hold ticks after this one (``tick``)
        self.tick_max = _TICK_MAX_U32  # the largest tick they hold: 2**62 once widened to int64
        self.namespaces = NamespaceIds()
        self.tokens: dict[int, np.ndarray] = {}  # row -> token ids (``verify_tokens``)
        self.doomed: set[int] = set()  # rows hidden while in use, freed by their last user

    def grow(self) -> None:
        """Reallocate every array to the key table's capacity (after it grew)."""
        cap = self.table.capacity_rows
        old_flags = self.flags
        self.flags = np.zeros(cap + 1, dtype=np.uint8)
        self.flags[: old_flags.size - 1] = old_flags[:-1]
        for name, _, fill in _ARRAYS:
            old = getattr(self, name)
            new = np.zeros(cap, dtype=old.dtype)
            new[: old.size] = old
            if fill:
                new[old.size :] = fill
            setattr(self, name, new)
        for t in MEMORY_TIERS:
            old = self.slot[t]
            new = np.full(cap, -1, dtype=old.dtype)
            new[: old.size] = old
            self.slot[t] = new

    def _init(self, rows, flags: int, nid, positions, hint: int, now: float) -> None:
        """Give new rows their first state (``rows`` an int or an index array)."""
        top = rows if isinstance(rows, int) else int(np.maximum.reduce(rows, initial=-1))  # no wrapper
        if top >= self.flags.size - 1:
            self.grow()
        if nid > 0xFFFF and self.ns.dtype == np.uint16:
            self.ns = self.ns.astype(np.int32)
        if self.pos.dtype == np.int16 and int(np.max(positions, initial=-1)) > 0x7FFF:
            self.pos = self.pos.astype(np.int32)
        t = self.tick(now)  # before any time column is bound: it may rebase or widen them
        self.flags[rows] = flags
        self.slot[Tier.HBM][rows] = -1
        self.slot[Tier.HOST][rows] = -1
        self.ns[rows] = nid
        self.pos[rows] = positions
        self.hits[rows] = 0
        self.created[rows] = t
        self.last[rows] = t
        self.refs[rows] = 0
        self.readers[rows] = 0
        self.pin_until[rows] = 0
        self.hint[rows] = hint
        self.nvme_class[rows] = NO_HINT

    def new_rows(
        self, keys: Sequence[bytes], nid: int, positions: np.ndarray, hint: int, now: float
    ) -> np.ndarray:
        """Rows for many absent, distinct keys of a store in flight (``PENDING``): one batch insert."""
        rows = self.table.add_absent(keys)
        if rows.size:
            self._init(rows, PENDING, nid, positions, hint, now)
        return rows

    def add_new(
        self, keys: Sequence[bytes], nid: int, first_position: int, hint: int, now: float, exists: list
    ) -> tuple[list[int], list[int]]:
        """A short store's keys, one probe each (:meth:`KeyTable.add_many`): a key in the table (or
        given earlier in the call) gets ``exists[i] = Status.EXISTS``, the others new ``PENDING``
        rows at chain positions ``first_position + i``. Returns ``(indices, rows)`` of the new
        keys. For calls under :data:`~tierstore.index.core.SCALAR_STORE_KEYS` keys, where this
        costs less than a lookup and a batch insert; the same rows, in the same order.

        Raises
        ------
        LayoutError
            A key is not 32 bytes (checked before anything is inserted).
        """
        rows, todo = self.table.add_many(keys)
        new = rows if len(todo) == len(keys) else [rows[i] for i in todo]
        if len(new) < len(keys):
            got = set(todo)
            for i in range(len(keys)):
                if i not in got:
                    exists[i] = Status.EXISTS
        if new:
            at = np.array(new, dtype=np.int64)
            self._init(at, PENDING, nid, np.array(todo, dtype=np.int64) + first_position, hint, now)
        return todo, new

    def adopt(self, keys: Sequence[bytes], nss: Sequence[bytes], now: float) -> int:
        """Rows for blocks found on NVMe at start-up (keys already indexed are skipped).
        Returns the rows added."""
        n = 0
        for k, ns in zip(keys, nss):
            row, new = self.table.add(k)
            if not new:
                continue
            self._init(row, ON_NVME, self.namespaces.intern(ns), -1, NO_HINT, now)
            self.stamp("nvme_at", row, now)
            n += 1
        return n

    def drop_new(self, row: int) -> None:
        """Forget a row whose store never became visible."""
        self.tokens.pop(row, None)
        self.table.remove_row(row)
        self.flags[row] = 0

    def release_row(self, row: int, alloc: dict[Tier, SlotAllocator]) -> None:
        """Free a doomed row's memory slots (into ``alloc``) and the row itself."""
        for t in MEMORY_TIERS:
            s = int(self.slot[t][row])
            if s >= 0 and not self.flags[row] & EVICT[t]:
                alloc[t].give(s)
                self.set_slot(row, t, -1)
        self.tokens.pop(row, None)
        self.flags[row] = 0
        self.table.release_row(row)

    def tops(self, rows: np.ndarray) -> np.ndarray:
        """Per row (``-1`` = absent): the fastest readable tier (0 HBM, 1 host,
        2 NVMe), or -1 when the row is absent, pending, doomed or has no
        readable copy. One gather of the flags and one of a 256-entry table
        (row -1 reads the spare, always-zero flags element)."""
        return TOP[self.flags[rows]]

    def top(self, row: int) -> Tier | None:
        """Fastest readable copy of a visible row (``None`` for row -1)."""
        return TOP_TIER[self.flags[row]]

    def readable(self, row: int, tier: Tier) -> bool:
        f = int(self.flags[row])
        if tier == Tier.NVME:
            return bool(f & ON_NVME)
        return bool(f & IN[tier]) and not f & EVICT[tier]

    def set_slot(self, row: int, tier: Tier, slot: int) -> None:
        self.slot[tier][row] = slot
        if slot >= 0:
            self.flags[row] |= IN[tier]
        else:
            self.flags[row] &= 0xFF ^ IN[tier]

    def pinned(self, row: int, now: float) -> bool:
        return bool(self.pin_until[row] > self.pin_now(now))

    def protected(self, row: int, now: float) -> bool:
        """In use (referenced, read, pinned) or held by a plan: never a victim, kept on reclaim."""
        return (
            self.refs[row] > 0
            or self.readers[row] > 0
            or self.pin_until[row] > self.pin_now(now)
            or bool(int(self.flags[row]) & BUSY)
        )

    def protected_many(self, rows: np.ndarray, now: float) -> np.ndarray:
        """:meth:`protected` of each of ``rows`` (``int64``; -1, a key not in the index, counts
        as protected) as one ``bool`` array of the same length: one pass per call, not a call
        per row (a victim search tests whole chunks of a tier's order)."""
        absent = rows < 0
        if absent.all():  # none to read (and the arrays may have no row 0 yet)
            return absent
        r = np.where(absent, 0, rows)
        return (
            absent
            | (self.refs[r] > 0)
            | (self.readers[r] > 0)
            | (self.pin_until[r] > self.pin_now(now))
            | ((self.flags[r] & BUSY) != 0)
        )

    # ------------------------------------------------------------ times and counters
    def tick(self, t_s: float, up: bool = False) -> int:
        """Clock time ``t_s`` (seconds) as a tick of the time columns (:data:`TIMES`): the nearest
        one, or with ``up`` the first at or after it (a pin's expiry: never early). A time outside
        the span the columns hold first rebases them (:meth:`_refit`); nothing wraps."""
        x = t_s * TICKS_PER_S
        a = math.ceil(x) if up else round(x)
        t = a - self.tick_base
        if 1 <= t <= self.tick_max:
            return t
        self._refit(a)
        return a - self.tick_base

    def stamp(self, name: str, rows: Any, t_s: float) -> None:
        """Set time column ``name`` of ``rows`` (an int, a list or an index array) to ``t_s``."""
        t = self.tick(t_s)  # first: it may replace the column
        getattr(self, name)[rows] = t

    def pin_now(self, now: float) -> float:
        """``now`` on the ``pin_until`` column's scale: a row is pinned while ``pin_until > pin_now(now)``
        (a lease's tick is at or after its expiry: exact to 1 ms, never early; 0, no pin, never is)."""
        return max(now * TICKS_PER_S - self.tick_base, 0.0)

    def _refit(self, a: int) -> None:
        """Make absolute tick ``a`` storable: the base becomes one tick before the earliest live
        time (or ``a``) and every stored time is shifted to it in place, O(rows), once per span
        of 49.7 days at most; where the live times and ``a`` span more than ``uint32`` holds the
        columns are widened to ``int64`` (for good). Times of free rows are clipped into range."""
        live = self.table.held_rows()
        if self.doomed:
            live = np.union1d(live, np.fromiter(self.doomed, dtype=np.int64))
        lo = hi = a
        for name in TIMES:
            v = getattr(self, name)[live]
            v = v[v != 0]
            if v.size:
                lo = min(lo, self.tick_base + int(v.min()))
                hi = max(hi, self.tick_base + int(v.max()))
        base = lo - 1
        wide = hi - base > self.tick_max
        if wide:
            self.tick_max = 1 << 62
        for name in TIMES:
            old = getattr(self, name)
            col = old.astype(np.int64)
            nz = col != 0
            col[nz] += self.tick_base - base
            np.clip(col, 1, self.tick_max, out=col, where=nz)
            if wide:
                setattr(self, name, col)
            else:
                old[...] = col
        self.tick_base = base

    def count_hits(self, rows: np.ndarray) -> None:
        """One more hit on each of ``rows`` (distinct), saturating at :data:`HITS_MAX`."""
        h = self.hits[rows]
        np.minimum(h, _HITS_BELOW_MAX, out=h)  # two element-wise ufuncs: cheaper than a max()
        h += _ONE_U16
        self.hits[rows] = h

    def count_up(self, name: str, rows: Any) -> None:
        """Raise counter ``name`` (``refs`` or ``readers``) by one per occurrence of each row in
        ``rows`` (an int, or an index array: a row given twice is raised twice). An ``int16``
        column that would pass 32767 is widened to ``int32`` first: a count never wraps."""
        a = getattr(self, name)
        if isinstance(rows, int):
            if a.dtype == np.int16 and a[rows] >= _COUNT_MAX_I16:
                a = self._widen(name)
            a[rows] += 1
            return
        if a.dtype == np.int16 and rows.size and int(a[rows].max()) + rows.size > _COUNT_MAX_I16:
            u, n = np.unique(rows, return_counts=True)  # exact, only near the limit
            if int((a[u].astype(np.int64) + n).max()) > _COUNT_MAX_I16:
                a = self._widen(name)
        if distinct(rows):
            a[rows] += 1
        else:
            np.add.at(a, rows, 1)

    def count_down(self, name: str, rows: np.ndarray) -> bool:
        """Lower counter ``name`` (``refs`` or ``readers``) by one per occurrence of each row in
        ``rows`` (an index array); returns whether any of them went negative (the caller's
        invariant error)."""
        a = getattr(self, name)
        if distinct(rows):
            a[rows] -= 1
        else:
            np.subtract.at(a, rows, 1)
        return bool((a[rows] < 0).any())

    def _widen(self, name: str) -> np.ndarray:
        a = getattr(self, name).astype(np.int32)
        setattr(self, name, a)
        return a

    def view(self, row: int, key: bytes | None = None) -> EntryView:
        return EntryView(self, row, key if key is not None else self.table.key_of(row))

    def views(self, rows: Sequence[int], keys: Sequence[bytes]) -> Callable[[int], EntryView]:
        """``j -> view(rows[j], keys[j])``: the entry callback of a policy's ``on_*_many``."""
        return lambda j: EntryView(self, rows[j], keys[j])

    def nbytes(self) -> int:
        """Bytes of per-block metadata (the key table when the index owns it, else its row
        ordinals in the shared one; and the row arrays)."""
        arrays = [self.flags, *(getattr(self, name) for name, _, _ in _ARRAYS), *self.slot.values()]
        return self.table.nbytes + sum(a.nbytes for a in arrays)


@dataclasses.dataclass(eq=False, repr=False)
class IndexRoom:
    """A room of the block index: it shares the index's rows, lock and clock, and has no lock of its own.

    Parameters
    ----------
    rows : RowTable
    lock : threading.RLock
        The index lock (``BlockIndex._lock``).
    clock : callable
        Seconds, monotonic (the index's clock).
    """

    rows: RowTable
    _lock: threading.RLock
    _clock: Callable[[], float]
