"""Least-recently-used eviction, the baseline."""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable

from .base import EntryInfo, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evict the least recently inserted-or-hit unprotected keys first."""

    name = "lru"
    evict_is_prefix = True  # evict(k): the k coldest unprotected keys, nothing moved

    def __init__(self) -> None:
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def on_insert(self, entry: EntryInfo, now_s: float) -> None:
        self._order[entry.key] = None
        self._order.move_to_end(entry.key)

    def on_access(self, entry: EntryInfo, now_s: float) -> None:
        if entry.key in self._order:
            self._order.move_to_end(entry.key)

    def on_insert_many(self, keys, entry, now_s: float) -> None:
        od = self._order
        n0 = len(od)
        for k in keys:  # a new key goes to the end
            od[k] = None
        if len(od) != n0 + len(keys):  # some were present (or repeated): move each to the end
            deque(map(od.move_to_end, keys), maxlen=0)

    def on_access_many(self, keys, entry, now_s: float) -> None:
        od = self._order
        try:  # hits are present: every move is one C call
            deque(map(od.move_to_end, keys), maxlen=0)
        except KeyError:  # one was not: again one by one (the keys end up in the same order)
            for k in keys:
                if k in od:
                    od.move_to_end(k)

    def on_remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def evict(
        self, n: int, protected: Callable[[bytes], bool], now_s: float = 0.0, max_scan: int | None = None
    ) -> list[bytes]:
        if n <= 0:
            return []
        out: list[bytes] = []
        order = self._order if max_scan is None else itertools.islice(self._order, max_scan)
        for key in order:
            if not protected(key):
                out.append(key)
                if len(out) == n:
                    return out
        return []

    def __len__(self) -> int:
        return len(self._order)
