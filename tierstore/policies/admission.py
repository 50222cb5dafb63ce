"""SSD admission: keep KV that will probably never be reused off flash.

Flash pays for every byte written (endurance, and garbage collection under
FDP); about two thirds of the blocks of a real conversation trace are never
reused (Mooncake, FAST 2025: 182,790 unique of 288,500 block references). An
admission policy decides, when a block is demoted from the last memory tier,
whether it is written to NVMe or dropped. It is separate from eviction (a
policy only picks victims) and plugs into
:attr:`tierstore.index.IndexRuntime.admit` (the index asks it in
``Placement.victimize``, where a victim's fate is decided).

:class:`SecondSightingAdmission` admits a block when

* it has been reused while in memory (``entry.hits >= min_hits``), or
* it was rejected before and has come back (its key is in a bounded FIFO of
  recently rejected keys, a "ghost" set): the second sighting.

This is the "admit on second hit" rule of TinyLFU's doorkeeper (G. Einziger,
R. Friedman and B. Manes, "TinyLFU: A Highly Efficient Cache Admission
Policy", ACM TOS 13(4), 2017, §3.4.2) and of the flash admission in
CacheLib/Flashield (A. Eisenman et al., "Flashield: a Hybrid Key-value Cache
that Controls Flash Write Amplification", NSDI 2019), with an exact bounded
key set instead of a Bloom filter (a 32-byte key per rejected block).

:class:`PredictedReuseAdmission` admits when a reuse predictor's probability
exceeds a threshold.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import ConfigError
from ..keytable import GhostKeys
from .base import EntryInfo


class SecondSightingAdmission:
    """Admit to NVMe on reuse or on the second demotion of the same key.

    Parameters
    ----------
    min_hits : int
        Hits in memory that admit a block at once (>= 1).
    ghost_keys : int
        Rejected keys remembered (FIFO, >= 1); bounds memory to ``32 * ghost_keys`` bytes.

    Attributes
    ----------
    admitted, rejected : int
        Decisions so far.
    """

    def __init__(self, min_hits: int = 1, ghost_keys: int = 1 << 18) -> None:
        if min_hits < 1 or ghost_keys < 1:
            raise ConfigError(
                f"SecondSightingAdmission: min_hits and ghost_keys must be >= 1 "
                f"(got {min_hits}, {ghost_keys})"
            )
        self.min_hits = int(min_hits)
        self.ghost_keys = int(ghost_keys)
        self._ghost = GhostKeys(self.ghost_keys)
        self.admitted = 0
        self.rejected = 0

    def __call__(self, entry: EntryInfo) -> bool:
        """``True``: write ``entry`` to NVMe; ``False``: drop it."""
        k = entry.key
        if self._ghost.take(k) or entry.hits >= self.min_hits:
            self.admitted += 1
            return True
        self._ghost.add(k)
        self.rejected += 1
        return False


class PredictedReuseAdmission:
    """Admit when ``predict(entry) >= threshold``.

    Parameters
    ----------
    predict : callable
        ``f(entry) -> float``, probability of reuse (e.g.
        :meth:`tierstore.policies.lifetime.PrefixLifetimePredictor.reuse_probability`).
    threshold : float
        Admission threshold in [0, 1].
    """

    def __init__(self, predict: Callable[[EntryInfo], float], threshold: float = 0.5) -> None:
        if not 0.0 <= threshold <= 1.0:
            raise ConfigError(f"threshold={threshold}: must be in [0, 1]")
        self.predict = predict
        self.threshold = float(threshold)
        self.admitted = 0
        self.rejected = 0

    def __call__(self, entry: EntryInfo) -> bool:
        ok = self.predict(entry) >= self.threshold
        if ok:
            self.admitted += 1
        else:
            self.rejected += 1
        return ok


def make_admission(name: str | None) -> Callable[[EntryInfo], bool] | None:
    """Admission by name (:data:`tierstore.policies.registry.ADMISSION`).

    ``"all"``/``"none"``/``None`` (admit every block: ``None``), ``"reused"``/``"second"``/
    ``"second_hit"`` (:class:`SecondSightingAdmission`), ``"predicted"``
    (:class:`PredictedReuseAdmission` over
    :meth:`~tierstore.policies.lifetime.PrefixLifetimePredictor.reuse_probability`, threshold 0.5).

    Raises
    ------
    ConfigError
        For an unknown name; the message lists the accepted ones.
    """
    if name is None:
        return None
    from .registry import ADMISSION

    return ADMISSION.make(name)
