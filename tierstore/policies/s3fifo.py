"""S3-FIFO eviction (Yang et al., "FIFO queues are all you need for cache eviction", SOSP 2023).

Three FIFO queues:

* ``S`` -- a small probationary FIFO (``small_fraction`` of the tracked keys,
  10% in the paper) that new keys enter;
* ``M`` -- the main FIFO;
* ``G`` -- a ghost FIFO of keys recently evicted from ``S`` (keys only, no data),
  as many keys as ``M`` holds (paper §4.1).

A hit increments a 2-bit frequency (capped at 3). Eviction (paper Algorithm 1):
when ``|S| >= small_fraction * total`` the oldest key of ``S`` is examined: if it
was accessed at least ``main_threshold`` times since insertion it moves to
``M``, otherwise it is a victim (and its key goes to ``G``). Otherwise the
oldest key of ``M`` is examined: if its frequency is > 0 it is reinserted at
the head of ``M`` with frequency - 1 (CLOCK-like second chance), otherwise it is
a victim. A key inserted while it is in ``G`` goes straight to ``M``.

``main_threshold = 1`` follows the paper's text ("moved to M if it is accessed
at least once", §4.1); Algorithm 1 prints ``freq > 1``, so the threshold is a
parameter.

Adaptation to the all-or-nothing contract: protected keys (ACTIVE, PINNED,
I/O in flight) are skipped in place; victims stay tracked (in ``_victims``)
until :meth:`on_remove`; if ``n`` victims cannot be found, they are put back
at the tail they came from and ``[]`` is returned. In a multi-tier store a
block demoted from this tier and later promoted back re-enters through the
ghost, i.e. straight into ``M`` -- its second sighting.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from ..errors import ConfigError
from .base import EntryInfo, EvictionPolicy

_S, _M = "S", "M"


class S3FIFOPolicy(EvictionPolicy):
    """S3-FIFO victim selection for one tier.

    Parameters
    ----------
    small_fraction : float
        Target share of tracked keys held in the small FIFO ``S`` (paper: 0.1).
    main_threshold : int
        Accesses in ``S`` needed to move to ``M`` instead of being evicted.
    ghost_min_keys : int
        Lower bound on the ghost FIFO's length (the paper sizes it as ``|M|``).
    """

    name = "s3fifo"

    def __init__(
        self, small_fraction: float = 0.1, main_threshold: int = 1, ghost_min_keys: int = 64
    ) -> None:
        if not 0.0 < small_fraction < 1.0 or main_threshold < 1 or ghost_min_keys < 0:
            raise ConfigError(
                f"S3FIFOPolicy: need 0 < small_fraction < 1, main_threshold >= 1, "
                f"ghost_min_keys >= 0 (got {small_fraction}, {main_threshold}, {ghost_min_keys})"
            )
        self.small_fraction = float(small_fraction)
        self.main_threshold = int(main_threshold)
        self.ghost_min_keys = int(ghost_min_keys)
        self._q: dict[str, OrderedDict[bytes, None]] = {_S: OrderedDict(), _M: OrderedDict()}  # oldest first
        self._freq: dict[bytes, int] = {}
        self._victims: dict[bytes, str] = {}  # picked, not yet removed -> queue it came from
        self._ghost: OrderedDict[bytes, None] = OrderedDict()

    # ------------------------------------------------------------ events
    def on_insert(self, entry: EntryInfo, now_s: float) -> None:
        k = entry.key
        if k in self._freq:
            return
        if k in self._ghost:
            del self._ghost[k]
            self._q[_M][k] = None
        else:
            self._q[_S][k] = None
        self._freq[k] = 0

    def on_access(self, entry: EntryInfo, now_s: float) -> None:
        k = entry.key
        if k in self._freq:
            self._freq[k] = min(3, self._freq[k] + 1)

    def on_insert_many(self, keys, entry, now_s: float) -> None:
        freq, ghost, small, main = self._freq, self._ghost, self._q[_S], self._q[_M]
        for k in keys:
            if k in freq:
                continue
            if k in ghost:
                del ghost[k]
                main[k] = None
            else:
                small[k] = None
            freq[k] = 0

    def on_access_many(self, keys, entry, now_s: float) -> None:
        freq = self._freq
        for k in keys:
            v = freq.get(k)
            if v is not None and v < 3:
                freq[k] = v + 1

    def on_remove(self, key: bytes) -> None:
        if key not in self._freq:
            return
        del self._freq[key]
        origin = self._victims.pop(key, None)
        if origin is None:
            self._q[_S].pop(key, None)
            self._q[_M].pop(key, None)
        elif origin == _S:
            self._ghost[key] = None
            limit = max(self.ghost_min_keys, len(self._q[_M]))
            while len(self._ghost) > limit:
                self._ghost.popitem(last=False)

    # ------------------------------------------------------------ victims
    def evict(
        self, n: int, protected: Callable[[bytes], bool], now_s: float = 0.0, max_scan: int | None = None
    ) -> list[bytes]:
        if n <= 0:
            return []
        S, M = self._q[_S], self._q[_M]
        picked: list[bytes] = []
        # Protected keys are skipped without being moved; each queue is scanned
        # through a cursor of skipped keys so every key is examined a bounded
        # number of times (M keys at most 4: freq 3..0).
        skipped: dict[str, dict[bytes, None]] = {_S: {}, _M: {}}
        budget = 5 * (len(S) + len(M)) + 1
        if max_scan is not None:
            budget = min(budget, 5 * max_scan + 1)
        while len(picked) < n and budget > 0:
            budget -= 1
            live_s = len(S) - len(skipped[_S])
            live_m = len(M) - len(skipped[_M])
            if live_s <= 0 and live_m <= 0:
                break
            tracked = len(S) + len(M)
            use_s = live_s > 0 and (len(S) >= self.small_fraction * tracked or live_m <= 0)
            qn = _S if use_s else _M
            q = self._q[qn]
            k = next(iter(q))
            if protected(k):
                q.move_to_end(k)  # look past it; restored to the tail below
                skipped[qn][k] = None
                continue
            f = self._freq[k]
            if qn == _S:
                del S[k]
                if f >= self.main_threshold:
                    M[k] = None
                    self._freq[k] = 0
                else:
                    self._victims[k] = _S
                    picked.append(k)
            else:
                if f > 0:
                    self._freq[k] = f - 1
                    M.move_to_end(k)
                else:
                    del M[k]
                    self._victims[k] = _M
                    picked.append(k)
        for qn, ks in skipped.items():  # protected keys back to the tail, original order
            for k in reversed(list(ks)):
                if k in self._q[qn]:
                    self._q[qn].move_to_end(k, last=False)
        if len(picked) < n:
            for k in reversed(picked):
                qn = self._victims.pop(k)
                self._q[qn][k] = None
                self._q[qn].move_to_end(k, last=False)
            return []
        return picked

    def __len__(self) -> int:
        return len(self._freq)
