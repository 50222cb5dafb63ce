"""Class-first eviction: the engine's lifetime class first, LRU within a class.

A block stored with an engine hint (``store(..., lifetime="query" | "conversation" | "system")``,
:func:`tierstore.fdp.lifetime.class_from_hint`) is evicted before every block of a longer class:
all ``query`` (SHORT) blocks first, then ``conversation`` (MEDIUM), then ``system`` (LONG), each
class in least-recently-used order. A block stored without a hint counts as ``conversation``
(the vLLM connector's default hint), so a tier whose blocks carry no hint evicts in plain LRU order.

The order is the offline simulator's ``engine`` order (``bench/frontier_sim.py``, ``ORDERS``); what
it gains depends on the hint being right (``bench/README_frontier.md``): the class is the engine's
word, fixed when the block is stored, and this policy never infers one. Not a default.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from ..errors import ConfigError
from ..fdp.lifetime import LifetimeClass
from .base import EntryInfo
from .lru import LRUPolicy


class ClassLRUPolicy(LRUPolicy):
    """Evict the shortest engine lifetime class first, least recently used first within it.

    Parameters
    ----------
    unhinted : LifetimeClass
        Class of a block stored without an engine hint (default MEDIUM, ``"conversation"``).

    Notes
    -----
    One ``OrderedDict`` per class and a key -> class map: insert, hit and remove are O(1); victims
    are found by the :class:`LRUPolicy` scan over :meth:`_coldest` (the classes' orders chained,
    SHORT first). A hit refreshes a block within its class only; the class never changes while the
    block is tracked (the hint is fixed at store time).
    """

    name = "class_lru"
    evict_is_prefix = True

    def __init__(self, unhinted: LifetimeClass = LifetimeClass.MEDIUM) -> None:
        if unhinted not in tuple(LifetimeClass):
            raise ConfigError(f"ClassLRUPolicy: unhinted must be a LifetimeClass (got {unhinted!r})")
        self.unhinted = LifetimeClass(unhinted)
        self._by_class: tuple[OrderedDict[bytes, None], ...] = tuple(OrderedDict() for _ in LifetimeClass)
        self._class: dict[bytes, int] = {}

    def _class_of(self, entry: EntryInfo) -> int:
        lt = entry.lifetime
        return int(self.unhinted if lt is None else lt)

    def on_insert(self, entry: EntryInfo, now_s: float) -> None:
        key = entry.key
        c = self._class.get(key)
        if c is None:
            c = self._class[key] = self._class_of(entry)
        od = self._by_class[c]
        od[key] = None
        od.move_to_end(key)

    def on_access(self, entry: EntryInfo, now_s: float) -> None:
        c = self._class.get(entry.key)
        if c is not None:
            self._by_class[c].move_to_end(entry.key)

    def on_insert_many(self, keys, entry, now_s: float) -> None:
        for i, k in enumerate(keys):
            c = self._class.get(k)
            if c is None:
                c = self._class[k] = self._class_of(entry(i))
            od = self._by_class[c]
            od[k] = None
            od.move_to_end(k)

    def on_access_many(self, keys, entry, now_s: float) -> None:
        cls, by = self._class, self._by_class
        for k in keys:
            c = cls.get(k)
            if c is not None:
                by[c].move_to_end(k)

    def on_remove(self, key: bytes) -> None:
        c = self._class.pop(key, None)
        if c is not None:
            del self._by_class[c][key]

    def _coldest(self) -> Iterator[bytes]:
        for od in self._by_class:  # SHORT, MEDIUM, LONG (LifetimeClass values 0, 1, 2)
            yield from od

    def __len__(self) -> int:
        return len(self._class)
