"""Least-recently-used eviction, the baseline."""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator

from .base import EntryInfo, EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Evict the least recently inserted-or-hit unprotected keys first."""

    #: Candidates of the first chunk of a vectorised victim search (:meth:`evict_upto`).
    CHUNK_KEYS = 64

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

    def _coldest(self) -> Iterator[bytes]:
        """The tracked keys, the next victim first (a subclass with another order overrides it)."""
        return iter(self._order)

    def evict(
        self, n: int, protected: Callable[[bytes], bool], now_s: float = 0.0, max_scan: int | None = None
    ) -> list[bytes]:
        if n <= 0:
            return []
        if max_scan is None:
            out = self.evict_upto(n, protected, now_s)
            return out if len(out) == n else []
        out = []
        for key in itertools.islice(self._coldest(), max_scan):
            if not protected(key):
                out.append(key)
                if len(out) == n:
                    return out
        return []

    def evict_upto(
        self, n: int, protected: Callable[[bytes], bool], now_s: float = 0.0, max_scan: int | None = None
    ) -> list[bytes]:
        """The coldest ``n`` unprotected keys (fewer if the tier has fewer), in one pass over the
        order (each successive ``evict(1)`` of the base class would scan again from the coldest
        end). With ``protected.many`` and no ``max_scan``, candidates are tested a chunk at a time
        (``CHUNK_KEYS``, doubling): one vectorised test per chunk instead of a call per key."""
        out: list[bytes] = []
        if n <= 0:
            return out
        many = getattr(protected, "many", None)
        if many is None or max_scan is not None:
            for i, key in enumerate(self._coldest()):
                if max_scan is not None and i >= max_scan + len(out):  # as evict(1, max_scan + taken)
                    break
                if not protected(key):
                    out.append(key)
                    if len(out) == n:
                        break
            return out
        it = self._coldest()
        size = max(n, self.CHUNK_KEYS)
        while len(out) < n:
            keys = list(itertools.islice(it, size))
            if not keys:
                break
            free = itertools.compress(keys, ~many(keys))
            out.extend(itertools.islice(free, n - len(out)))
            size *= 2
        return out

    def __len__(self) -> int:
        return len(self._order)
