"""Flash lifetimes of blocks in a trace replay: what was predicted, and when each copy really died.

A replay (:func:`tierstore.replay.run_replay`) writes blocks to the NVMe tier
with the lifetime class the index's classifier gives them
(``classify(entry, now_s)``, :meth:`tierstore.index.BlockIndex._nvme_lifetime`,
the one place a block's FDP placement is decided). :class:`LifetimeRecorder`

* wraps that classifier (it still decides; the recorder only writes down
  ``(key, write time, class)``), and
* drains the index's event stream after every request
  (:meth:`tierstore.api.KVStore.take_events`) to find when each NVMe copy
  left the tier (``("removed", key, "nvme")``: evicted with its region,
  invalidated, or found corrupt) -- its true death time, in trace seconds.

From these, :meth:`LifetimeRecorder.summary` gives the prediction accuracy
against the true lifetimes split into three classes at their terciles (a
constant guess scores about 1/3 on balanced classes), the confusion matrix and
the Spearman rank correlation of the predicted class with the true lifetime,
and :meth:`LifetimeRecorder.deaths` gives, per key, the death times a second
(oracle) pass can place by. Copies still on NVMe at the end of the replay are
censored: they count as LONG when already older than the upper tercile and are
left out otherwise.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

import numpy as np

from ..fdp.lifetime import LifetimeClass
from ..policies.lifetime import make_classifier, true_class

__all__ = ["LifetimeRecorder", "OracleClassifier", "tercile_bounds"]


class LifetimeRecorder:
    """Record predicted classes and true NVMe death times during one replay.

    Parameters
    ----------
    classify : str or callable
        The classifier that decides (a :func:`~tierstore.policies.lifetime.make_classifier`
        name or ``f(entry, now_s)``).
    clock : callable
        Trace seconds (the replay's store clock); set with :meth:`bind` if
        not known at construction.

    Use ``runtime={"classify": rec}`` in the :class:`~tierstore.replay.ReplayConfig`,
    ``on_open=rec.on_open`` and ``on_sample=rec.on_sample`` with ``sample_every=1``.
    """

    def __init__(self, classify="hint", clock: Callable[[], float] | None = None) -> None:
        self.inner = make_classifier(classify)
        self.clock = clock
        self.writes: list[tuple[bytes, float, int]] = []  # (key, t_s, class)
        self._open: dict[bytes, int] = {}  # key -> index of its live write
        self.death_s: dict[int, float] = {}  # write index -> death time
        self.now_s = 0.0

    def __call__(self, entry, now_s: float) -> LifetimeClass:
        c = self.inner(entry, now_s)
        k = bytes(entry.key)
        if k not in self._open:  # a copy-forward of a live copy is not a new write of the data
            self._open[k] = len(self.writes)
            self.writes.append((k, float(now_s), int(c)))
        return c

    def on_open(self, store) -> None:
        store.record_events(True)

    def on_sample(self, store, sample: dict) -> None:
        t = float(sample.get("t_s", self.now_s))
        self.now_s = t
        for kind, key, tier in store.take_events():
            if tier == "nvme" and kind in ("removed", "invalidated"):
                j = self._open.pop(bytes(key), None)
                if j is not None:
                    self.death_s[j] = t

    # ------------------------------------------------------------ results
    def lifetimes(self, end_s: float | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(lifetime_s, died, predicted_class)`` per recorded write (censored at ``end_s``)."""
        end = self.now_s if end_s is None else end_s
        n = len(self.writes)
        life = np.empty(n)
        died = np.zeros(n, dtype=bool)
        pred = np.empty(n, dtype=np.int64)
        for j, (_, t, c) in enumerate(self.writes):
            d = self.death_s.get(j)
            died[j] = d is not None
            life[j] = (d if d is not None else end) - t
            pred[j] = c
        return life, died, pred

    def summary(self, end_s: float | None = None) -> dict:
        """Accuracy of the predicted classes against the true lifetimes (module doc).

        Returns
        -------
        dict
            ``writes``, ``died``, ``bounds_s`` (terciles of the finite
            lifetimes), ``accuracy``, ``chance`` (accuracy of the best constant
            guess on the same judged writes), ``chance_same_shares`` (expected
            accuracy of a random class assignment with the predicted classes'
            shares on the judged writes: sum over classes of predicted share x
            true share), ``spearman`` (rank correlation of
            predicted class and true lifetime), ``confusion`` (rows: predicted
            SHORT/MEDIUM/LONG, columns: true), ``predicted_share``.
        """
        life, died, pred = self.lifetimes(end_s)
        out: dict[str, Any] = {"writes": int(life.size), "died": int(died.sum())}
        if died.sum() < 3:
            return out | {"accuracy": float("nan")}
        lo, hi = tercile_bounds(life[died])
        judged = died | (life >= hi)
        truth = np.array([int(true_class(x, lo, hi)) for x in life[judged]], dtype=np.int64)
        p = pred[judged]
        conf = np.zeros((3, 3), dtype=np.int64)
        np.add.at(conf, (p, truth), 1)
        true_share = np.bincount(truth, minlength=3) / max(1, truth.size)
        pred_share = np.bincount(p, minlength=3) / max(1, p.size)
        out.update(
            bounds_s=[float(lo), float(hi)],
            judged=int(judged.sum()),
            accuracy=float((p == truth).mean()),
            chance=float(true_share.max()),
            chance_same_shares=float(pred_share @ true_share),
            spearman=_spearman(p.astype(float), life[judged]),
            confusion=conf.tolist(),
            predicted_share=(np.bincount(pred, minlength=3) / max(1, pred.size)).tolist(),
        )
        return out

    def deaths(self) -> dict[bytes, list[float]]:
        """Per key, the death time of its 1st, 2nd, ... recorded write (``inf``: alive at the end)."""
        out: dict[bytes, list[float]] = collections.defaultdict(list)
        for j, (k, _, _) in enumerate(self.writes):
            out[k].append(self.death_s.get(j, float("inf")))
        return dict(out)


def tercile_bounds(lifetimes_s: np.ndarray) -> tuple[float, float]:
    """The 1/3 and 2/3 quantiles (seconds) of the finite lifetimes."""
    q = np.quantile(np.asarray(lifetimes_s, dtype=float), [1 / 3, 2 / 3])
    return float(q[0]), float(q[1])


def _spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation (average ranks for ties)."""

    def rank(x):
        o = np.argsort(x, kind="stable")
        r = np.empty(x.size)
        r[o] = np.arange(x.size)
        # average ranks of ties
        u, inv, cnt = np.unique(x, return_inverse=True, return_counts=True)
        sums = np.bincount(inv, weights=r)
        return (sums / cnt)[inv]

    if a.size < 3 or np.all(a == a[0]) or np.all(b == b[0]):
        return float("nan")
    return float(np.corrcoef(rank(a), rank(b))[0, 1])


class OracleClassifier:
    """Class from the true remaining lifetime a first pass recorded (:meth:`LifetimeRecorder.deaths`).

    The second pass evolves a little differently from the first (placement
    changes which segment a block shares), so the oracle is exact only for the
    first pass. A key the first pass never wrote is SHORT (counted in ``unknown``).

    Parameters
    ----------
    deaths : dict
        Key -> death time (s) of its 1st, 2nd, ... NVMe write in the first pass.
    bounds_s : (float, float)
        Remaining-lifetime bounds: below the first SHORT, below the second MEDIUM, else LONG.
    """

    def __init__(self, deaths: dict[bytes, list[float]], bounds_s) -> None:
        self.deaths = deaths
        self.bounds_s = tuple(bounds_s)
        self.unknown = 0

    def __call__(self, entry, now_s: float) -> LifetimeClass:
        k = bytes(entry.key)
        ds = self.deaths.get(k)
        if not ds:
            self.unknown += 1
            return LifetimeClass.SHORT
        # the first-pass copy alive at this time: its death is the first one not before now
        d = min((x for x in ds if x >= now_s), default=ds[-1])
        rem = d - now_s
        if rem < self.bounds_s[0]:
            return LifetimeClass.SHORT
        if rem < self.bounds_s[1]:
            return LifetimeClass.MEDIUM
        return LifetimeClass.LONG
