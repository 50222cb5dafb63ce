#!/usr/bin/env python
"""Offline simulator of the NVMe tier's eviction on the FTL model: region vs per-block (issue 26, P0a).

Question it answers before the store is touched: does **per-block eviction** on
the NVMe tier, with some FDP placement, save as much prefill as one flat LRU
cache of the same bytes at end-to-end write amplification <= 1.10, and what does
the same configuration cost on a conventional (one-handle) SSD?

What is simulated (a trace of chained block keys, no bytes; every rule below
mirrors the real store and cites where it lives, so a region-mode run can be
checked against :func:`tierstore.replay.run_replay`, see ``--validate``):

* **Requests** (:mod:`tierstore.replay`): per request in trace order, look up
  the full blocks (the longest resident leading run is the hit; hits take a
  request reference), load them (every hit is loaded: at the trace's scaled
  block size loading always beats recomputing, and the replay confirms
  ``useful == matched``), promote the loaded blocks into HBM
  (``promotion: top``), write cold memory-only blocks to NVMe when a promotion
  found no clean victim (the store's background clean), store the missed blocks,
  release the references. Blocks are the integer chain keys of
  :func:`tierstore.bench.references.chain_keys`.
* **Memory tiers** (:class:`tierstore.index.BlockIndex`): an LRU per tier; new
  blocks into HBM (then host, then NVMe when everything is protected), victims
  in batches of ``evict_batch_blocks`` (8), an HBM victim without a lower copy
  demoted to host, a host victim without an NVMe copy written to NVMe, one with
  a lower copy dropped; a promotion takes only a victim that leaves without an
  NVMe write among the coldest 64 (``CHEAP_SCAN_BLOCKS``).  Blocks of the
  request, of the plan and the plan's victims are protected.
* **NVMe segments** (:class:`tierstore.io.segments.SegmentStorage`): segment =
  RU, one open segment per placement stream, the lowest FREE segment is opened
  next, one segment kept as GC reserve, a put's blocks packed into extents of
  :func:`tierstore.io.format.extent_bytes_for` (header + 4 KiB-aligned slots)
  written at their real offsets, so the FTL model sees the store's exact layout.
  Two modes:

  - ``region`` (today's store): when no segment is free, evict a whole sealed
    segment in ``region_policy`` order (``lru``: touched on write and hit;
    ``fifo``: sealed order; ``min_live``); the blocks the index keeps
    (protected, or the reinsertion rule ``clock``: hit since written) are copied
    forward into the open segment of their stream, the rest are dropped; the
    segment is trimmed whole.
  - ``block`` (issue 26): the NVMe tier keeps its own LRU over the blocks it
    holds (a hit on any tier refreshes the NVMe copy) and a **live budget**
    (``live_fraction`` x the blocks its usable segments hold); before a put,
    blocks are evicted one by one in LRU order to fit the budget, each evicted
    block's slot is deallocated at once (page-aligned slots: the trim is exact
    in the model), and a segment whose last live block goes is reset (trimmed
    whole, FREE).  Holes are never rewritten: writes only go into FREE
    segments.  When none is free (beyond the reserve), **host GC**: the sealed
    segment chosen by ``gc_victim`` (``min_live``; ``cost_benefit``:
    max ``(1 - u) age / (1 + u)``, Rosenblum and Ousterhout, ACM TOCS 10(1),
    1992) is emptied: each live block is kept (protected, or ``survivors``:
    ``clock`` hit since written, ``all``) and copied forward into the
    **survivor stream** (its own handle with ``survivor_stream``) or evicted
    now (``none``).

* **Placement**: ``fdp`` on: each write carries the PID of its lifetime class
  (the device's RUH Status table, :meth:`tierstore.fdp.simdevice.SimFdpDevice.placement_policy`),
  and a RUH Update is sent when a handle's writes enter another segment
  (:class:`tierstore.fdp.device.RuhUpdateShim`: segment = RU).  Classifiers:
  ``one`` (every write one class), ``hint``/``reuse``/``prefix`` (the store's,
  :func:`tierstore.policies.lifetime.make_classifier`; the trace has no engine
  hint), ``survivor`` (fresh writes SHORT, GC copies LONG), ``oracle``
  (two passes: the first, with one class, records whether each NVMe write was
  hit on NVMe before it left; the second places reused writes LONG, the rest
  SHORT) and ``oracle3`` (the same first pass; classes by the terciles of each
  copy's NVMe lifetime, counted in NVMe block writes).  ``fdp`` off: the
  conventional SSD, every write on one handle, no RUH Update.
* **Eviction orders** (``nvme_order``, ``memory_order``; :data:`ORDERS`): LRU (the store's),
  S3-FIFO, class by hits, the engine's lifetime class (``hints: engine``, a perfect engine's
  labels from the whole trace, :func:`engine_classes`, with ``hint_error`` noise) and two oracles
  (``dead``: blocks past their last lookup first; ``next``: Belady's order).
* **Exclusive tiers** (``promotion: move``, an experiment the store does not
  have): a promoted block's lower copies are dropped (in block mode its NVMe
  slot is deallocated), and its HBM slot may cost demotions down to NVMe.
* **Device** (:class:`tierstore.fdp.ftl.FTLModel`): sized as ``device: sim``
  sizes it (:func:`tierstore.build.assemble`): device = NVMe bytes /
  utilisation, RU = device / 60 (whole MiB), OP 7 %, greedy GC, 8 RUHs, 4 KiB
  pages.  ``lba: device`` (the plan's ``d-eq``) gives block mode the whole
  device's LBA space and a live budget of the NVMe tier's nominal blocks.

Outputs per configuration: hit ratio, saved prefill tokens (hits x 512), hits
per tier, bytes written, **host WA** = (payload bytes written, copy-forward
included) / (payload bytes the index asked to keep), **device WAF** (MBMW /
HBMW of the model), **e2e WA** = MBMW / payload bytes the index asked to keep
(extent headers and padding included), trims, GC counts, the placement's ROC
AUC for "hit on NVMe before it left" (chance = 0.5), and the flat-LRU / Belady
references of the same total blocks.  **Every WA figure is the FTL model's,
not an SSD's.**

Usage (from a clone, with ``tierstore`` importable: ``pip install -e .`` or
``PYTHONPATH=.``)::

    python bench/frontier_sim.py --workload excerpt --configs a --validate
    python bench/frontier_sim.py --workload conv10 --configs a,b,c,d0,d-surv --utils 0.9,1.0 --json out.jsonl
    python bench/frontier_sim.py --list-configs
    python bench/frontier_sim.py --report out.jsonl --out DIR     # tables, go/no-go, PNGs
    python bench/frontier_sim.py --workload conv10 --flat-orders --configs d-eng-all   # flat bounds

bench/README_frontier.md has the sweep, its commands and what it showed.

Results are appended to ``--json`` one JSON object per line as each
configuration finishes (a sweep can be stopped and resumed: rows already there
are skipped with ``--resume``).
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import heapq
import json
import math
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np

from tierstore.bench.lifetimes import _spearman, tercile_bounds
from tierstore.bench.references import chain_keys, references
from tierstore.fdp.device import RuhUpdateShim
from tierstore.fdp.ftl import FTLModel
from tierstore.fdp.lifetime import LifetimeClass
from tierstore.fdp.simdevice import SimFdpDevice
from tierstore.index.placement import choose_victims
from tierstore.io import format as fmt
from tierstore.policies import S3FIFOPolicy
from tierstore.policies.lifetime import make_classifier, true_class
from tierstore.trace import MOONCAKE_BLOCK_TOKENS, read_mooncake
from tierstore.units import parse_size

HERE = os.path.dirname(os.path.abspath(__file__))
CONVERSATION = "/work/shared/traces/mooncake_conversation_trace.jsonl"
#: Tier split of a capacity fraction, as bench/policy_grid.py (the replay's 2/8/30 % = 5/20/75 % of 40 %).
SPLIT = (0.05, 0.20, 0.75)
#: Index constants the simulator mirrors (tierstore.index.BlockIndex.CHEAP_SCAN_BLOCKS, PoliciesConfig).
CHEAP_SCAN_BLOCKS = 64
EVICT_BATCH_BLOCKS = 8
HBM, HOST = 0, 1
_FREE, _OPEN, _SEALED, _RECLAIMING = 0, 1, 2, 3
_SIMULATED = "every WA/WAF figure is the FTL model's (tierstore/fdp/ftl.py), not an SSD's"


# ============================================================== eviction orders
#: Eviction orders of single blocks (a tier's victims, coldest first). ``lru``: the store's LRU
#: (an ``OrderedDict``, as before); ``s3fifo``: :class:`tierstore.policies.S3FIFOPolicy` with its
#: defaults (small FIFO 10 %, ghost FIFO, 2-bit frequency; Yang et al., SOSP 2023), a hit on any
#: tier counting as an access; the others evict by class, lowest class first, LRU within a class:
#: ``hits`` the store's predicted reuse (``default_classify`` without a hint: hits 0 / 1 / >= 2,
#: re-classified on every hit), ``engine`` the engine's lifetime class (query, then conversation,
#: then system prefix: :func:`engine_classes`), ``engine2`` query blocks first, then the rest in one LRU;
#: ``next`` an oracle, the block whose next lookup is furthest first (Belady's MIN order; reads the
#: future; sorts the tier per call, so only for small tiers); ``dead`` blocks whose last lookup
#: has passed first, then LRU (an engine that marks one-off queries and says when a session ends;
#: the class is set at each access, which is when a block's last lookup passes).
ORDERS = {
    "lru": "LRU",
    "s3fifo": "S3-FIFO",
    "hits": "class by hits (0, 1, >=2), LRU within",
    "engine": "engine class (query, conversation, system), LRU within",
    "engine2": "engine query blocks first, then LRU",
    "next": "oracle: furthest next lookup first (Belady's order)",
    "dead": "blocks looked up for the last time first, then LRU",
}


def engine_classes(
    keys: list[list[int]], n_blocks: int, error: float = 0.0, seed: int = 0, per_request: bool = False
) -> list[int]:
    """The engine's lifetime class of every block, as a perfect engine would label it
    (:class:`LifetimeClass` values), from the whole trace (it reads the future).

    A block whose chain continues with >= 2 distinct next blocks over the trace is a shared
    prefix (LONG, ``"system"``: system prompt, tool definitions, a context that branches); one
    that appears in >= 2 requests otherwise is extended by a later turn (MEDIUM,
    ``"conversation"``); one that appears in a single request is a one-off (SHORT, ``"query"``).
    ``error``: that share of blocks gets a uniformly random class instead
    (``numpy.random.default_rng(seed)``); with ``per_request`` that share of requests labels every
    block it is the first to hold with one random class (an engine wrong about a whole request).
    Blocks never looked up are SHORT.
    """
    count = [0] * n_blocks
    nxt: list = [None] * n_blocks  # first next block seen, or True once two differ
    for ks in keys:
        for i, k in enumerate(ks):
            count[k] += 1
            if i + 1 < len(ks):
                cur = nxt[k]
                if cur is None:
                    nxt[k] = ks[i + 1]
                elif cur is not True and cur != ks[i + 1]:
                    nxt[k] = True
    L, M, S = int(LifetimeClass.LONG), int(LifetimeClass.MEDIUM), int(LifetimeClass.SHORT)
    out = [L if nxt[k] is True else (M if count[k] >= 2 else S) for k in range(n_blocks)]
    if error > 0.0 and per_request:
        rng = np.random.default_rng(seed)
        wrong = rng.random(len(keys)) < error
        cls = rng.integers(0, 3, len(keys))
        seen = [False] * n_blocks
        for i, ks in enumerate(keys):
            for k in ks:
                if not seen[k]:
                    seen[k] = True
                    if wrong[i]:
                        out[k] = int(cls[i])
    elif error > 0.0:
        rng = np.random.default_rng(seed)
        flip = rng.random(n_blocks) < error
        rnd = rng.integers(0, 3, n_blocks)
        out = [int(r) if f else c for c, f, r in zip(out, flip.tolist(), rnd.tolist())]
    return out


class ClassLRU:
    """Keys evicted by class, lowest first, LRU within a class; the ``OrderedDict`` calls the
    simulator makes on an LRU (``in``, ``len``, iteration coldest first, ``d[k] = None`` to insert
    or refresh, ``move_to_end``, ``pop``). ``class_of(key)`` is asked on every insert and refresh."""

    def __init__(self, n_classes: int, class_of: Callable[[int], int]) -> None:
        self.q: list[OrderedDict] = [OrderedDict() for _ in range(n_classes)]
        self.where: dict[int, int] = {}
        self.class_of = class_of

    def __contains__(self, k: object) -> bool:
        return k in self.where

    def __len__(self) -> int:
        return len(self.where)

    def __iter__(self):
        for q in self.q:
            yield from q

    def __setitem__(self, k: int, _v: None) -> None:
        if k not in self.where:  # as an OrderedDict: a key already there keeps its place
            self.move_to_end(k)

    def move_to_end(self, k: int) -> None:
        old = self.where.get(k)
        if old is not None:
            del self.q[old][k]
        c = self.class_of(k)
        self.q[c][k] = None
        self.where[k] = c

    def pop(self, k: int, default=None):
        c = self.where.pop(k, None)
        if c is not None:
            del self.q[c][k]
        return default

    def victims(self, n: int, protected: Callable[[int], bool]) -> list[int]:
        """Up to ``n`` unprotected keys, coldest first (changes nothing)."""
        out: list[int] = []
        for k in self:
            if not protected(k):
                out.append(k)
                if len(out) == n:
                    break
        return out


class NextUseOrder:
    """The oracle order: the block whose next lookup (request index, ``occurrences``) is furthest
    comes first (never again: first of all; ties: the larger key). Recomputed per call from
    ``now()``, the current request index, so a copy left unrefreshed never goes stale."""

    def __init__(self, occurrences: list[list[int]], now: Callable[[], int]) -> None:
        self.occ, self.now = occurrences, now
        self.keys: set = set()

    def next_use(self, k: int) -> float:
        o = self.occ[k]
        j = bisect.bisect_right(o, self.now())
        return o[j] if j < len(o) else math.inf

    def __contains__(self, k: object) -> bool:
        return k in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self):
        return iter(sorted(self.keys, key=lambda k: (-self.next_use(k), -k)))

    def __setitem__(self, k: int, _v: None) -> None:
        self.keys.add(k)

    def move_to_end(self, k: int) -> None:
        self.keys.add(k)

    def pop(self, k: int, default=None):
        self.keys.discard(k)
        return default

    victims = ClassLRU.victims


class _Key:
    __slots__ = ("key",)

    def __init__(self, k: int) -> None:
        self.key = k


class S3FIFOOrder:
    """:class:`tierstore.policies.S3FIFOPolicy` behind the calls :class:`ClassLRU` answers
    (``move_to_end`` is an access); :meth:`victims` takes what the policy picks, and the caller
    removes them (``pop``), as the store's index does."""

    def __init__(self) -> None:
        self.p = S3FIFOPolicy()
        self.keys: set = set()

    def __contains__(self, k: object) -> bool:
        return k in self.keys

    def __len__(self) -> int:
        return len(self.keys)

    def __iter__(self):
        return iter(self.keys)

    def __setitem__(self, k: int, _v: None) -> None:
        if k not in self.keys:
            self.keys.add(k)
            self.p.on_insert(_Key(k), 0.0)

    def move_to_end(self, k: int) -> None:
        self.p.on_access(_Key(k), 0.0)

    def pop(self, k: int, default=None):
        if k in self.keys:
            self.keys.discard(k)
            self.p.on_remove(k)
        return default

    def victims(self, n: int, protected: Callable[[int], bool]) -> list[int]:
        """``n`` victims in S3-FIFO's order, or as many as it can give (``evict_upto``)."""
        return self.p.evict(n, protected) or self.p.evict_upto(n, protected)


def flat_order_hit_ratio(keys: list[list[int]], capacity_blocks: int, order) -> float:
    """Block hit ratio of one flat cache of ``capacity_blocks`` evicting in ``order`` (an empty
    ``OrderedDict``, :class:`ClassLRU` or :class:`S3FIFOOrder`), with the store's per-request rules:
    the leading resident run hits and is refreshed in chain order, then room is made for the
    request's missing blocks (its hits protected) and they are inserted in chain order (blocks
    resident after the first miss are left alone). The reference the block mode is checked against
    with the memory tiers off (``tests/bench/test_frontier_sim.py``)."""
    hit = total = 0
    for ks in keys:
        m = 0
        for k in ks:
            if k not in order:
                break
            m += 1
        hit += m
        total += len(ks)
        for k in ks[:m]:
            order.move_to_end(k)
        new = [k for k in dict.fromkeys(ks[m:]) if k not in order]
        need = len(order) + len(new) - capacity_blocks
        if need > 0:
            prot = set(ks[:m])
            if isinstance(order, OrderedDict):
                out = [k for k in order if k not in prot][:need]
            else:
                out = order.victims(need, prot.__contains__)
            for k in out:
                order.pop(k, None)
        for k in new[: capacity_blocks - len(order)]:
            order[k] = None
    return hit / total if total else 0.0


# ============================================================== configuration
@dataclasses.dataclass(frozen=True)
class SimConfig:
    """One configuration of the NVMe tier and its device (module doc).

    Parameters
    ----------
    name : str
        Label of the row.
    granularity : {"region", "block"}
        Whole-segment eviction (today's store) or per-block eviction.
    region_policy : {"lru", "fifo", "min_live"}
        Region mode: which sealed segment is evicted.
    survivors : {"none", "clock", "all"}
        Which unprotected live blocks of an evicted segment (region) or GC
        victim (block) are copied forward: none, those hit since written, all.
    promotion : {"top", "none", "move"}
        Loaded blocks are copied into HBM, or served where they are; ``move``
        (an experiment, not in the store) copies them into HBM and drops their
        lower copies (exclusive tiers).
    live_fraction : float
        Block mode: live budget as a fraction of the blocks the usable segments hold.
    gc_victim : {"min_live", "cost_benefit"}
        Block mode: which sealed segment host GC empties.
    survivor_stream : bool
        Block mode: GC copies go to their own stream (the LONG handle with FDP).
    classifier : {"one", "hint", "reuse", "prefix", "survivor", "oracle"}
        Lifetime class of each NVMe write (placement with ``fdp``).
    fdp : bool
        Placement by class and RUH Update on segment open (an FDP SSD); off:
        one handle, no update (a conventional SSD).
    lba : {"tier", "device"}
        Block mode's LBA space: the NVMe tier's bytes (live budget = fraction of
        it) or the whole device (live budget = the tier's nominal blocks).
    nvme_order : {"lru", "s3fifo", "hits", "engine", "engine2"}
        Block mode: the order in which single NVMe blocks are evicted (:data:`ORDERS`).
    memory_order : {"lru", "hits", "engine", "engine2"}
        The HBM and host tiers' eviction order (:data:`ORDERS`).
    hints : {"none", "engine"}
        ``engine``: every block carries the engine's lifetime class
        (:func:`engine_classes`), seen by the ``hint``/``prefix`` classifiers and
        needed by the ``engine*`` orders.
    hint_error : float
        Share of blocks whose engine class is replaced by a uniformly random one
        (seeded), to measure how wrong a hint may be.
    hint_error_unit : {"block", "request"}
        ``request``: ``hint_error`` is the share of requests whose new blocks all get
        one random class (:func:`engine_classes`).
    """

    name: str
    granularity: str = "region"
    region_policy: str = "lru"
    survivors: str = "none"
    promotion: str = "top"
    live_fraction: float = 0.9
    gc_victim: str = "min_live"
    survivor_stream: bool = False
    classifier: str = "one"
    fdp: bool = False
    lba: str = "tier"
    nvme_order: str = "lru"
    memory_order: str = "lru"
    hints: str = "none"
    hint_error: float = 0.0
    hint_error_unit: str = "block"

    def __post_init__(self) -> None:
        checks = {
            "granularity": ("region", "block"),
            "region_policy": ("lru", "fifo", "min_live"),
            "survivors": ("none", "clock", "all"),
            "promotion": ("top", "none", "move"),
            "gc_victim": ("min_live", "cost_benefit"),
            "classifier": ("one", "hint", "reuse", "prefix", "survivor", "oracle", "oracle3"),
            "lba": ("tier", "device"),
            "nvme_order": tuple(ORDERS),
            "memory_order": tuple(o for o in ORDERS if o != "s3fifo"),
            "hints": ("none", "engine"),
            "hint_error_unit": ("block", "request"),
        }
        for f, ok in checks.items():
            if getattr(self, f) not in ok:
                raise ValueError(f"{self.name}: {f}={getattr(self, f)!r}: accepted {ok}")
        if not 0.0 < self.live_fraction <= 1.0:
            raise ValueError(f"{self.name}: live_fraction={self.live_fraction}: must be in (0, 1]")
        if self.nvme_order != "lru" and self.granularity != "block":
            raise ValueError(f"{self.name}: nvme_order={self.nvme_order!r} needs granularity='block'")
        if "engine" in (self.nvme_order + self.memory_order) and self.hints != "engine":
            raise ValueError(f"{self.name}: the engine orders need hints='engine'")
        if not 0.0 <= self.hint_error <= 1.0:
            raise ValueError(f"{self.name}: hint_error={self.hint_error}: must be in [0, 1]")


#: The configurations of the sweep (README_frontier.md). ``a``/``b``: region mode, today's store;
#: ``c``/``d*``: per-block eviction as the plan specifies it (promotion top, survivors by ``clock``);
#: ``m*``: per-block eviction with exclusive tiers (``promotion: move``) and an exact per-block LRU
#: (GC keeps every live block, ``survivors: all``). ``c*`` run on the conventional (one-handle) device.
_B = dict(granularity="block", survivors="clock")
_M = dict(granularity="block", survivors="all", promotion="move")
CONFIGS: dict[str, SimConfig] = {
    c.name: c
    for c in [
        SimConfig("a"),  # today's default
        SimConfig("a-class", classifier="hint", fdp=True),
        SimConfig("a-excl", promotion="none"),
        SimConfig("a-move", promotion="move"),
        SimConfig("b", region_policy="fifo", survivors="clock"),
        SimConfig("b-excl", region_policy="fifo", survivors="clock", promotion="none"),
        SimConfig("c", **_B),  # per-block, conventional SSD
        SimConfig("d0", fdp=True, **_B),
        SimConfig("d-surv", survivor_stream=True, classifier="survivor", fdp=True, **_B),
        SimConfig("d-hint", survivor_stream=True, classifier="hint", fdp=True, **_B),
        SimConfig("d-reuse", survivor_stream=True, classifier="reuse", fdp=True, **_B),
        SimConfig("d-prefix", survivor_stream=True, classifier="prefix", fdp=True, **_B),
        SimConfig("d-oracle", survivor_stream=True, classifier="oracle", fdp=True, **_B),
        SimConfig("d-oracle3", survivor_stream=True, classifier="oracle3", fdp=True, **_B),
        SimConfig("d-eq", survivor_stream=True, classifier="survivor", fdp=True, lba="device", **_B),
        SimConfig("mc", **_M),  # exclusive tiers, conventional SSD
        SimConfig("m0", fdp=True, **_M),
        SimConfig("m-surv", survivor_stream=True, classifier="survivor", fdp=True, **_M),
        SimConfig("m-hint", survivor_stream=True, classifier="hint", fdp=True, **_M),
        SimConfig("m-reuse", survivor_stream=True, classifier="reuse", fdp=True, **_M),
        SimConfig("m-prefix", survivor_stream=True, classifier="prefix", fdp=True, **_M),
        SimConfig("m-oracle", survivor_stream=True, classifier="oracle", fdp=True, **_M),
        SimConfig("m-oracle3", survivor_stream=True, classifier="oracle3", fdp=True, **_M),
        SimConfig(
            "mc-oracle", survivor_stream=True, classifier="oracle", **_M
        ),  # m-oracle's conventional twin
        SimConfig("m-eq-oracle3", survivor_stream=True, classifier="oracle3", fdp=True, lba="device", **_M),
        # eviction orders beyond LRU (2026-12-03): store-visible (S3-FIFO, class by hits) and the
        # engine's lifetime class (a perfect engine's hint, engine_classes), placed by that class
        SimConfig("d-s3", survivor_stream=True, classifier="survivor", fdp=True, nvme_order="s3fifo", **_B),
        SimConfig("m-s3", survivor_stream=True, classifier="survivor", fdp=True, nvme_order="s3fifo", **_M),
        SimConfig("d-hits", survivor_stream=True, classifier="hint", fdp=True, nvme_order="hits", **_B),
        SimConfig("m-hits", survivor_stream=True, classifier="hint", fdp=True, nvme_order="hits", **_M),
        SimConfig(
            "d-eng",
            survivor_stream=True,
            classifier="hint",
            fdp=True,
            hints="engine",
            nvme_order="engine",
            **_B,
        ),
        SimConfig(
            "m-eng",
            survivor_stream=True,
            classifier="hint",
            fdp=True,
            hints="engine",
            nvme_order="engine",
            **_M,
        ),
        SimConfig(
            "d-eng-all",
            survivor_stream=True,
            classifier="hint",
            fdp=True,
            hints="engine",
            nvme_order="engine",
            memory_order="engine",
            **_B,
        ),
        SimConfig(
            "m-eng-all",
            survivor_stream=True,
            classifier="hint",
            fdp=True,
            hints="engine",
            nvme_order="engine",
            memory_order="engine",
            **_M,
        ),
        SimConfig(
            "m-eng2-all",
            survivor_stream=True,
            classifier="hint",
            fdp=True,
            hints="engine",
            nvme_order="engine2",
            memory_order="engine2",
            **_M,
        ),
    ]
}


def config_from_spec(spec: str) -> SimConfig:
    """A named configuration, or ``name:field=value,...`` on top of one (``d0:live_fraction=0.8``)."""
    base, _, over = spec.partition(":")
    if base not in CONFIGS:
        raise ValueError(f"configuration {base!r}: known are {sorted(CONFIGS)}")
    if not over:
        return CONFIGS[base]
    kw: dict = {}
    for item in over.split(";"):
        k, _, v = item.partition("=")
        f = {x.name: x for x in dataclasses.fields(SimConfig)}.get(k)
        if f is None:
            raise ValueError(f"{spec}: unknown field {k!r}")
        cur = getattr(CONFIGS[base], k)
        kw[k] = (v.lower() in ("1", "true", "yes")) if isinstance(cur, bool) else type(cur)(v)
    return dataclasses.replace(CONFIGS[base], name=spec, **kw)


@dataclasses.dataclass
class Workload:
    """A trace as chain keys plus the tier capacities of one capacity point.

    ``keys[i]`` are request ``i``'s full blocks (chain keys, ints), ``times_s[i]``
    its arrival (trace seconds, the store's clock in the replay).
    """

    name: str
    keys: list[list[int]]
    times_s: list[float]
    n_blocks: int
    block_bytes: int
    hbm_bytes: int
    host_bytes: int
    nvme_bytes: int
    trace: str | None
    requests: list = dataclasses.field(repr=False, default_factory=list)
    limit: int | None = None

    @property
    def capacity_blocks(self) -> int:
        """Total blocks of the three tiers (the references' capacity;
        cache_reference.replay_capacity_blocks)."""
        bb = self.block_bytes
        return self.hbm_bytes // bb + self.host_bytes // bb + self.nvme_bytes // bb


def load_workload(
    name: str,
    trace: str | None = None,
    limit: int | None = None,
    block_bytes: int = 32 << 10,
    agent_trace: str | None = None,
) -> Workload:
    """The named capacity points: ``excerpt`` (packaged 1,000 requests, the replay's default
    2/8/30 % sizing), ``conv10`` (28m/112m/420m, the issue's row), ``conv40`` (40 % split
    5/20/75 %), ``agent10`` (10 % of ``agent_trace``, made by ``bench/agent_workload.py
    --sessions 200 --seed 0``)."""
    from tierstore.replay import unique_full_blocks

    if name == "excerpt":
        path = trace
    elif name.startswith("conv"):
        path = trace or CONVERSATION
    elif name.startswith("agent"):
        path = agent_trace or trace
        if path is None:
            raise ValueError(
                "agent workloads need --agent-trace (python bench/agent_workload.py --out F "
                "--sessions 200 --seed 0)"
            )
    else:
        raise ValueError(f"workload {name!r}: known are excerpt, conv10, conv40, agent10, agent40")
    reqs = read_mooncake(path, limit)
    uniq = unique_full_blocks(reqs)
    bb = block_bytes
    if name == "excerpt":  # tierstore.replay.ReplaySession's cap(): int(unique_bytes * frac) // bb * bb
        h, c, n = (int(uniq * bb * f) // bb * bb for f in (0.02, 0.08, 0.30))
    elif name == "conv10":
        h, c, n = (parse_size(x, "size") for x in ("28m", "112m", "420m"))
    else:  # bench/policy_grid.py tier_sizes
        frac = int(name[-2:]) / 100
        h, c, n = (int(uniq * frac * f) * bb for f in SPLIT)
    ks = chain_keys(reqs)
    n_blocks = 1 + max((k for r in ks for k in r), default=-1)
    return Workload(name, ks, [r.timestamp_s for r in reqs], n_blocks, bb, h, c, n, path, reqs, limit)


# ============================================================== the device
def default_ru_bytes(device_bytes: int, page_bytes: int) -> int:
    """RU = device / 60 in whole MiB (pages below 4 MiB): the rule of ``device: sim``
    (``tierstore.devices._default_ru``; restated here, checked by ``--validate``)."""
    ru = device_bytes // 60
    unit = 1 << 20 if ru >= 4 << 20 else page_bytes
    return max(page_bytes, ru // unit * unit)


@dataclasses.dataclass
class Geometry:
    """Device and segment sizes of one run (``device: sim`` rules, tierstore.build)."""

    device_bytes: int
    ru_bytes: int
    tier_bytes: int
    lba_bytes: int
    n_segments: int
    op_fraction: float
    util: float


def sim_geometry(
    nvme_bytes: int, util: float, lba: str, page_bytes: int = 4096, op: float = 0.07
) -> Geometry:
    """Sizes as ``tiers.nvme.device: sim`` with ``capacity_bytes=nvme_bytes`` and
    ``model.utilization=util``: device = nvme / util rounded down to whole RUs, tier =
    whole RUs of nvme; ``lba="device"`` gives the whole device to the tier."""
    dev = int(nvme_bytes / util)
    ru = default_ru_bytes(dev, page_bytes)
    dev = dev // ru * ru
    tier = nvme_bytes // ru * ru
    lba_b = dev if lba == "device" else tier
    return Geometry(dev, ru, tier, lba_b, lba_b // ru, op, tier / dev)


# ============================================================== the simulator
class _Plan:
    """What one store/promote plan decided (tierstore.index.StorePlan, without slots)."""

    __slots__ = ("evicting", "copies", "frees", "nvme_demote", "protect", "avail")

    def __init__(self, protect: set, avail: list[int]) -> None:
        self.evicting: tuple[set, set] = (set(), set())  # victims per memory tier (EVICT flags)
        self.copies: list[int] = []  # HBM victims copied into host
        self.frees: list[tuple[int, int]] = []  # (block, tier) leaving that tier
        self.nvme_demote: list[int] = []  # victims written to NVMe
        self.protect = protect
        self.avail = avail  # free slots per memory tier not yet taken


class Simulator:
    """One run of one configuration on one workload (module doc).

    Parameters
    ----------
    wl : Workload
    cfg : SimConfig
    util : float
        NVMe tier bytes / device bytes (0.9 or 1.0 in the issue).
    isolation : {"initial", "persistent"}
        RUH type of the model.
    device : {"sim", "file"}
        ``sim``: the FTL model sized as ``device: sim``; ``file``: the replay's
        default NVMe file (segment from ``choose_segment_size``, no model), only
        for ``--validate``.
    oracle : dict, optional
        ``(block, n-th fresh NVMe write) -> reused`` from a first pass
        (classifier ``oracle``).
    """

    def __init__(
        self,
        wl: Workload,
        cfg: SimConfig,
        util: float = 0.9,
        isolation: str = "initial",
        device: str = "sim",
        oracle: dict | None = None,
        page_bytes: int = 4096,
    ) -> None:
        self.wl, self.cfg = wl, cfg
        bb = self.bb = wl.block_bytes
        self.block_mode = cfg.granularity == "block"
        # ---- device and segments
        if device == "file":
            from tierstore.io.segments import choose_segment_size

            seg = choose_segment_size(wl.nvme_bytes, bb, None)
            tier = wl.nvme_bytes // seg * seg
            self.geo = Geometry(tier, seg, tier, tier, tier // seg, 0.0, 1.0)
            self.ftl = None
            self._sink = None
            self.policy = None
        else:
            self.geo = sim_geometry(wl.nvme_bytes, util, cfg.lba if self.block_mode else "tier", page_bytes)
            g = self.geo
            self.ftl = FTLModel(
                g.device_bytes,
                g.ru_bytes,
                g.op_fraction,
                num_ruh=8,
                isolation=isolation,
                gc="greedy",
                page_bytes=page_bytes,
            )
            dev = SimFdpDevice(self.ftl)
            self.policy = dev.placement_policy() if cfg.fdp else None
            self._sink = RuhUpdateShim(self.ftl, g.ru_bytes) if cfg.fdp else self.ftl
        self.isolation = isolation
        # Streams: with FDP one per lifetime class (the real store groups a put by PID); in block mode
        # also without FDP when survivors or classes get their own segments (LBA streams only).
        self.multi_stream = cfg.fdp or (self.block_mode and (cfg.survivor_stream or cfg.classifier != "one"))
        self.S = self.geo.ru_bytes
        self.n_seg = self.geo.n_segments
        self.reserve = 1
        self.slot = fmt.block_slot_bytes(bb)
        one = fmt.extent_bytes_for(1, bb)
        ext = min(max(-(-(16 << 20) // 4096) * 4096, one), self.S)
        self.bpe = max(k for k in range(1, 4096) if fmt.extent_bytes_for(k, bb) <= ext)
        self.ext_bytes = [fmt.extent_bytes_for(k, bb) if k else 0 for k in range(self.bpe + 1)]
        self.hdr_bytes = [fmt.header_bytes_for(k) for k in range(self.bpe + 1)]
        n = self.n_seg
        self.state = [_FREE] * n
        self.wp = [0] * n
        self.written = [0] * n
        self.live = [0] * n
        self.seg_pl = [None] * n
        self.touched = [0] * n
        self.sealed_at = [0] * n
        self.members: list[list[int]] = [[] for _ in range(n)]
        self.header_bytes_in = [0] * n  # extent header bytes written into each segment since it was FREE
        self.open: dict = {}
        self.next_seq = 1
        self.ticks = 0
        self._to_reclaim: list[int] = []
        # ---- per block (index rows and NVMe location)
        nb = wl.n_blocks
        self.seg_of = [-1] * nb
        self.off_of = [0] * nb
        self.row = [-1] * nb
        self.hits = [0] * nb
        self.last_s = [0.0] * nb
        self.created_s = [0.0] * nb
        self.nvme_at = [0.0] * nb
        self.pos = [0] * nb
        self._free_rows: list[int] = []
        self._next_row = [0, 0]
        # the segment store's own key-table rows: a victim segment's blocks are visited in this order
        self.srow = [-1] * nb
        self._free_srows: list[int] = []
        self.eng: list[int] | None = (
            engine_classes(wl.keys, wl.n_blocks, cfg.hint_error, per_request=cfg.hint_error_unit == "request")
            if cfg.hints == "engine"
            else None
        )
        self.req_i = 0  # the request being replayed (the oracle order's clock)
        self._occ: list[list[int]] | None = None
        self.lru = (self._make_order(cfg.memory_order), self._make_order(cfg.memory_order))
        self.cap = (wl.hbm_bytes // bb, wl.host_bytes // bb)
        self.nvme_lru = self._make_order(cfg.nvme_order)
        self._memonly: list = []  # lazy heap (last_s, row, block) of blocks in memory only (flush order)
        self.refs: set = set()
        self.protect_put: set = set()
        self.now = 0.0
        self.clean_wanted = 0
        # ---- block mode budget
        self.n_streams = self._n_streams()
        per = 0
        rem = self.S
        while True:
            k = self._fit(rem, self.bpe)
            if not k:
                break
            per += k
            rem -= self.ext_bytes[k]
        self.blocks_per_segment = per
        usable = max(0, self.n_seg - self.reserve - self.n_streams) * per
        if cfg.lba == "device" and self.block_mode:
            self.live_budget = min(wl.nvme_bytes // bb, usable)
        else:
            self.live_budget = int(cfg.live_fraction * usable)
        self.live_blocks = 0
        # ---- classifier
        self._oracle = oracle
        self._nth_write: dict[int, int] = {}
        self.oracle_unknown = 0
        self._classify = None
        if cfg.classifier in ("hint", "reuse", "prefix"):
            self._classify = make_classifier(cfg.classifier)
        # ---- write records (placement accuracy; oracle truth)
        self.w_block: list[int] = []
        self.w_class: list[int] = []
        self.w_gc: list[bool] = []
        self.w_reused: list[bool] = []
        self.w_nth: list[int] = []
        self.w_t0: list[int] = []  # write clock (NVMe block writes so far) at the write
        self.w_t1: list[int] = []  # write clock when the copy left NVMe (-1: still there)
        self.w_s0: list[float] = []  # trace seconds at the write
        self.w_s1: list[float] = []  # trace seconds when the copy left NVMe (-1.0: still there)
        self.wclock = 0
        self.cur_w = [-1] * nb
        # ---- counters
        self.c = dict.fromkeys(
            (
                "lookup_blocks",
                "hit_blocks",
                "hit_hbm",
                "hit_host",
                "hit_nvme",
                "user_blocks",
                "gc_blocks",
                "engine_write_bytes",
                "extents",
                "trim_ranges",
                "trim_calls",
                "trimmed_bytes",
                "region_evictions",
                "region_evicted_blocks",
                "region_kept_blocks",
                "lru_evicted_blocks",
                "gc_runs",
                "gc_copied_blocks",
                "gc_evicted_blocks",
                "segments_reset_clean",
                "segments_reset_gc",
                "no_space_blocks",
                "promotions",
                "flushed_blocks",
                "store_no_space",
                "dropped_blocks",
                "evictions_hbm",
                "evictions_host",
                "evictions_nvme",
                "store_exists",
                "stuck_evictions",
                "nvme_copies_dropped",
            ),
            0,
        )

    # ---------------------------------------------------------------- helpers
    def _make_order(self, name: str):
        """A tier's eviction order (:data:`ORDERS`); ``lru`` is a plain ``OrderedDict``."""
        if name == "lru":
            return OrderedDict()
        if name == "s3fifo":
            return S3FIFOOrder()
        if name == "hits":
            hits = self.hits
            return ClassLRU(3, lambda b: min(hits[b], 2))
        if name in ("next", "dead"):
            if self._occ is None:
                occ: list[list[int]] = [[] for _ in range(self.wl.n_blocks)]
                for i, ks in enumerate(self.wl.keys):
                    for k in ks:
                        occ[k].append(i)
                self._occ = occ
            nxt = NextUseOrder(self._occ, lambda: self.req_i)
            if name == "next":
                return nxt
            return ClassLRU(2, lambda b: 0 if nxt.next_use(b) == math.inf else 1)
        eng = self.eng
        assert eng is not None  # SimConfig requires hints="engine"
        if name == "engine":
            return ClassLRU(3, eng.__getitem__)
        return ClassLRU(2, lambda b: min(eng[b], 1))

    def _n_streams(self) -> int:
        """Open segments the tier may hold at once: one per stream (lifetime class;
        GC survivors share the LONG class's stream)."""
        if not self.multi_stream:
            return 1
        if self.cfg.classifier == "one":
            return 2 if self.cfg.survivor_stream else 1
        return 2 if self.cfg.classifier in ("survivor", "oracle") else 3  # oracle3, hint, reuse, prefix: 3

    def _stream_of(self, cls: int) -> int:
        """Stream key of a write of class ``cls`` (one stream unless placement or block-mode
        streams separate them); the PID follows from the key (:meth:`_pid`)."""
        return cls if self.multi_stream else 0

    def _fit(self, remaining: int, want: int) -> int:
        k = min(want, self.bpe)
        while k > 0 and self.ext_bytes[k] > remaining:
            k -= 1
        return k

    def _pid(self, stream: int):
        """PID of a stream (the device's class -> PID table); ``None`` without FDP."""
        if self.policy is None:
            return None
        return self.policy.placement_for(LifetimeClass(stream))

    def _class_of(self, b: int, gc: bool) -> int:
        """Lifetime class of an NVMe write of ``b`` (tierstore.index.BlockIndex._nvme_lifetime)."""
        c = self.cfg.classifier
        if c == "one" or c == "survivor":
            return int(LifetimeClass.SHORT)
        if c in ("oracle", "oracle3"):
            r = self._oracle.get((b, self._nth_write.get(b, 0))) if self._oracle is not None else None
            if r is None:
                self.oracle_unknown += 1
                return int(LifetimeClass.SHORT)
            return r
        return int(self._classify(_View(self, b), self.now))

    def _resident(self, b: int) -> bool:
        return b in self.lru[HBM] or b in self.lru[HOST] or self.seg_of[b] >= 0

    def _new_row(self, b: int) -> None:
        """An index KeyTable row (tierstore.keytable: freed rows are reused last-freed first)."""
        self.row[b] = self._free_rows.pop() if self._free_rows else self._bump_row(0)

    def _bump_row(self, which: int) -> int:
        r = self._next_row[which]
        self._next_row[which] += 1
        return r

    def _free_srow(self, b: int) -> None:
        self._free_srows.append(self.srow[b])
        self.srow[b] = -1

    def _forget_if_empty(self, b: int) -> None:
        if self.row[b] < 0 or self._resident(b):
            return
        self._free_rows.append(self.row[b])
        self.row[b] = -1
        self.c["dropped_blocks"] += 1

    def _mark_memonly(self, b: int) -> None:
        heapq.heappush(self._memonly, (self.last_s[b], self.row[b], b))

    # ================================================================= request
    def run(self, progress: Callable[[int, int], None] | None = None) -> dict:
        """Replay the workload; returns the result row."""
        t0 = time.perf_counter()
        n = len(self.wl.keys)
        for i, (ks, t) in enumerate(zip(self.wl.keys, self.wl.times_s)):
            self.req_i = i
            self._request(ks, t)
            if progress is not None and i % 1000 == 0:
                progress(i, n)
        self.check_invariants()
        return self._result(time.perf_counter() - t0)

    def _request(self, keys: list[int], t: float) -> None:
        self.now = t
        c = self.c
        m = 0
        for b in keys:
            if not self._resident(b):
                break
            m += 1
        c["lookup_blocks"] += len(keys)
        c["hit_blocks"] += m
        hbm, host = self.lru
        nv_top: list[int] = []
        for b in keys[:m]:
            self.hits[b] += 1
            self.last_s[b] = t
            if b in hbm:
                hbm.move_to_end(b)
                c["hit_hbm"] += 1
            elif b in host:
                host.move_to_end(b)
                c["hit_host"] += 1
            else:
                nv_top.append(b)
                c["hit_nvme"] += 1
            if self.seg_of[b] >= 0:
                w = self.cur_w[b]
                if w >= 0:
                    self.w_reused[w] = True
                if self.block_mode:
                    self.nvme_lru.move_to_end(b)
            elif b in hbm or b in host:
                self._mark_memonly(b)
        if nv_top and not self.block_mode:  # SegmentStorage.touch: one tick per lookup
            self.ticks += 1
            for b in nv_top:
                self.touched[self.seg_of[b]] = self.ticks
        self.refs = set(keys[:m])
        if self.cfg.promotion != "none":  # every matched block is loaded (useful == matched, see module doc)
            promos = [b for b in keys[:m] if b not in hbm]
            if promos:
                self._promote(promos)
        if self.clean_wanted:
            n, self.clean_wanted = self.clean_wanted, 0
            self._flush(max(n, EVICT_BATCH_BLOCKS))
        tail = keys[m:]
        todo = []
        for j, b in enumerate(tail):
            if self._resident(b):
                c["store_exists"] += 1
                continue
            self._new_row(b)
            self.hits[b] = 0
            self.created_s[b] = self.last_s[b] = t
            self.pos[b] = m + j
            todo.append(b)
        if todo:
            self._store(todo, set(tail))
        self.refs = set()

    # ------------------------------------------------------- memory tiers
    def _evict_lru(self, tier: int, n: int, prot: Callable[[int], bool], scan: int | None) -> list[int]:
        """LRUPolicy.evict: the ``n`` coldest unprotected keys (all or nothing)."""
        out: list[int] = []
        for i, b in enumerate(self.lru[tier]):
            if scan is not None and i >= scan:
                break
            if not prot(b):
                out.append(b)
                if len(out) == n:
                    return out
        return []

    def _has_lower(self, b: int, tier: int, plan: _Plan) -> bool:
        if tier == HBM and b in self.lru[HOST] and b not in plan.evicting[HOST]:
            return True
        return self.seg_of[b] >= 0

    def _reserve(self, tier: int, n: int, plan: _Plan, cheap: bool) -> int:
        take = min(n, plan.avail[tier])
        plan.avail[tier] -= take
        need = n - take
        if need <= 0:
            return n
        v = self._victimize(tier, need, plan, cheap, 1 if cheap else EVICT_BATCH_BLOCKS)
        return take + min(len(v), need)

    def _victimize(self, tier: int, n: int, plan: _Plan, cheap: bool, batch: int) -> list[int]:
        """BlockIndex._victimize: choose, then decide each victim's fate."""
        protect, refs = plan.protect, self.refs
        lower = HOST if tier == HBM else None
        scan = None
        if cheap and lower is None:
            seg_of = self.seg_of
            prot = lambda b: b in protect or b in refs or seg_of[b] < 0  # noqa: E731
            scan = CHEAP_SCAN_BLOCKS
        else:
            prot = lambda b: b in protect or b in refs  # noqa: E731
        victims = choose_victims(lambda m, p, s: self._evict_lru(tier, m, p, s), n, batch, prot, scan)
        if not victims:
            return []
        demote = []
        for b in victims:
            plan.evicting[tier].add(b)
            protect.add(b)
            if not self._has_lower(b, tier, plan):
                demote.append(b)
        if demote and lower is not None:
            got = self._reserve(lower, len(demote), plan, cheap)
            plan.copies.extend(demote[:got])
            demote = demote[got:]
            if cheap and demote:
                back = set(demote)
                for b in demote:
                    plan.evicting[tier].discard(b)
                    protect.discard(b)
                victims = [b for b in victims if b not in back]
                demote = []
        self.c["evictions_hbm" if tier == HBM else "evictions_host"] += len(victims)
        plan.frees.extend((b, tier) for b in victims)
        plan.nvme_demote.extend(demote)
        return victims

    def _apply_memory(self, plan: _Plan) -> None:
        """complete_store / complete_promote: copies down, victims leave their tier."""
        host = self.lru[HOST]
        for b in plan.copies:
            host[b] = None
            host.move_to_end(b)
        for b, tier in plan.frees:
            self.lru[tier].pop(b, None)
        for b, _tier in plan.frees:
            self._forget_if_empty(b)

    def _promote(self, promos: list[int]) -> None:
        """complete_load -> _plan_promotions (promotion: top) -> complete_promote.

        ``promotion: move`` (not in the store; an experiment): the promoted block's
        lower copies are dropped (exclusive tiers, so the three tiers act as one LRU
        stack); its HBM slot may then cost a cascade of demotions down to NVMe."""
        move = self.cfg.promotion == "move"
        hbm, host = self.lru
        plan = _Plan(set(promos), [self.cap[HBM] - len(hbm), self.cap[HOST] - len(host)])
        items = []
        for j, b in enumerate(promos):
            if not self._reserve(HBM, 1, plan, cheap=not move):
                if not move:
                    # BlockIndex._plan_promotions: this and every later block of the load (which skip
                    # HBM) each ask for one background clean
                    self.clean_wanted += len(promos) - j
                break
            items.append(b)
        if plan.nvme_demote:
            self.protect_put = plan.evicting[HBM] | plan.evicting[HOST] | set(plan.nvme_demote) | set(promos)
            self._nvme_put(plan.nvme_demote, [self._class_of(b, False) for b in plan.nvme_demote], gc=False)
            self.protect_put = set()
        self._apply_memory(plan)
        for b in items:
            hbm[b] = None
            hbm.move_to_end(b)
            if move:
                host.pop(b, None)
                if self.seg_of[b] >= 0:
                    self._drop_nvme_copy(b)
        self.c["promotions"] += len(items)

    def _flush(self, max_blocks: int) -> None:
        """Transfers.clean_in_background -> prepare_flush(coldest_first): the coldest
        memory-only blocks (by last access, then row) are written to NVMe."""
        heap = self._memonly
        hbm, host = self.lru
        out: list[int] = []
        seen: set = set()
        while heap and len(out) < max_blocks:
            last, row, b = heapq.heappop(heap)
            if (
                b in seen
                or self.seg_of[b] >= 0
                or not (b in hbm or b in host)
                or self.row[b] != row
                or self.last_s[b] != last
            ):
                continue
            seen.add(b)
            out.append(b)
        if not out:
            return
        classes = [self._class_of(b, False) for b in out]
        self.protect_put = set(out)
        ok = self._nvme_put(out, classes, gc=False)
        self.protect_put = set()
        for b, good in zip(out, ok):
            if good:
                self.c["flushed_blocks"] += 1
            else:
                self._mark_memonly(b)

    def _store(self, todo: list[int], plan_keys: set) -> None:
        """prepare_store (write back) -> Mover.run_store -> complete_store."""
        hbm, host = self.lru
        plan = _Plan(set(plan_keys), [self.cap[HBM] - len(hbm), self.cap[HOST] - len(host)])
        mem: list[tuple[int, int]] = []
        left = todo
        for t in (HBM, HOST):
            if not left:
                break
            got = self._reserve(t, len(left), plan, cheap=False)
            mem.extend((b, t) for b in left[:got])
            left = left[got:]
        nvme_new = left
        writes = plan.nvme_demote + nvme_new
        first_bad = len(todo)
        if writes:
            classes = [self._class_of(b, False) for b in writes]
            # what BlockIndex._protected_row sees during the put: the plan's victims (EVICT flags),
            # its NVMe writes (NVME_WRITING) and its new blocks (PENDING); not the plan's other keys
            self.protect_put = plan.evicting[HBM] | plan.evicting[HOST] | set(writes) | set(todo)
            ok = self._nvme_put(writes, classes, gc=False)
            self.protect_put = set()
            k = len(plan.nvme_demote)
            where = {b: j for j, b in enumerate(todo)}
            bad = [where[b] for b, g in zip(nvme_new, ok[k:]) if not g]
            if bad:  # BlockIndex._complete_failed: the first failure and the rest of the chain are lost
                first_bad = min(bad)
                self.c["store_no_space"] += len(todo) - first_bad
                for b in todo[first_bad:]:
                    if self.seg_of[b] >= 0:  # written, but the chain before it failed: forgotten
                        self._drop_nvme_copy(b)
        self._apply_memory(plan)
        for j, (b, t) in enumerate(mem):  # mem holds todo's leading blocks in order
            if j < first_bad:
                self.lru[t][b] = None
                self._mark_memonly(b)
        for b in todo:
            self._forget_if_empty(b)

    # ----------------------------------------------------------- NVMe tier
    def _nvme_put(self, blocks: list[int], classes: list[int], gc: bool) -> list[bool]:
        """SegmentStorage.put of ``blocks`` (statuses as bools); block mode keeps the
        live budget first."""
        if self.block_mode and not gc:
            need = self.live_blocks + len(blocks) - self.live_budget
            if need > 0:
                self._evict_blocks(need)
        ok = self._put(blocks, [self._stream_of(cl) for cl in classes], gc)
        now = self.now
        for b, good, cl in zip(blocks, ok, classes):
            if not good:
                continue
            if not gc:
                self.nvme_at[b] = now
                self._record_write(b, cl, False)
                if self.block_mode:
                    self.nvme_lru[b] = None
        return ok

    def _record_write(self, b: int, cl: int, gc: bool) -> None:
        """One NVMe write of ``b``; a fresh write's record collects the block's NVMe hits
        until the copy leaves (GC copies are recorded, the fresh record stays current)."""
        n = self._nth_write.get(b, 0)
        if not gc:
            self._nth_write[b] = n + 1
            self.cur_w[b] = len(self.w_block)
        self.w_block.append(b)
        self.w_class.append(cl)
        self.w_gc.append(gc)
        self.w_reused.append(False)
        self.w_nth.append(n)
        self.w_t0.append(self.wclock)
        self.w_t1.append(-1)
        self.w_s0.append(self.now)
        self.w_s1.append(-1.0)
        self.wclock += 1

    def _died(self, b: int) -> None:
        w = self.cur_w[b]
        if w >= 0:
            self.w_t1[w] = self.wclock
            self.w_s1[w] = self.now
        self.cur_w[b] = -1

    def _left_nvme(self, b: int) -> None:
        """The NVMe copy of ``b`` is gone (BlockIndex.on_dropped)."""
        self._died(b)
        self.c["evictions_nvme"] += 1
        if self.block_mode:
            self.nvme_lru.pop(b, None)
        if b in self.lru[HBM] or b in self.lru[HOST]:
            self._mark_memonly(b)
        else:
            self._forget_if_empty(b)

    def _drop_nvme_copy(self, b: int) -> None:
        """Forget an NVMe copy the index does not keep (its slot becomes dead)."""
        si = self.seg_of[b]
        self.seg_of[b] = -1
        self._free_srow(b)
        self.live[si] -= 1
        self.live_blocks -= 1
        if self.block_mode:
            self._trim(self.off_of[b], self.slot)
            self.c["trim_calls"] += 1
            self.nvme_lru.pop(b, None)
        self._died(b)
        self.c["nvme_copies_dropped"] += 1
        if self.live[si] == 0 and self.state[si] == _SEALED:
            self.state[si] = _RECLAIMING
            self._finish_reclaim(si)

    def _protected(self, b: int) -> bool:
        """BlockIndex._protected_row during an NVMe put: the request's references, and what
        the plan in flight marked (``protect_put``)."""
        return b in self.refs or b in self.protect_put

    def _put(self, blocks: list[int], placements: list, gc: bool) -> list[bool]:
        """SegmentStorage._put_locked: plan extents per placement stream, write, commit;
        when a stream finds no free segment, make room (region eviction or host GC) and retry."""
        n = len(blocks)
        status: list[bool | None] = [None] * n
        groups: dict = {}
        seen: set = set()
        for i, b in enumerate(blocks):
            if not gc and (self.seg_of[b] >= 0 or b in seen):
                status[i] = True  # EXISTS
                continue
            seen.add(b)
            groups.setdefault(placements[i], []).append(i)
        while groups:
            plans, leftover = self._plan(groups, gc)
            self._write(plans, blocks, status, gc)
            if leftover and not gc and self._make_room():
                groups = leftover
                continue
            for idx in leftover.values():
                for i in idx:
                    status[i] = False
                self.c["no_space_blocks"] += len(idx)
            break
        return [bool(s) for s in status]

    def _take_free(self, allow_reserve: bool) -> int | None:
        free = [s for s in range(self.n_seg) if self.state[s] == _FREE]
        floor = 0 if allow_reserve else self.reserve
        return free[0] if len(free) > floor else None

    def _seal(self, si: int, planned: set) -> None:
        self.state[si] = _SEALED
        self.sealed_at[si] = self.next_seq
        self.open.pop(self.seg_pl[si], None)
        if self.live[si] == 0 and si not in planned and self.written[si] > 0:
            self.state[si] = _RECLAIMING
            self._to_reclaim.append(si)

    def _open_for(self, pl, allow_reserve: bool, planned: set) -> int | None:
        si = self.open.get(pl)
        if si is not None:
            if self._fit(self.S - self.wp[si], 1):
                return si
            self._seal(si, planned)
        si = self._take_free(allow_reserve)
        if si is None:
            return None
        self.state[si] = _OPEN
        self.seg_pl[si] = pl
        self.wp[si] = self.written[si] = self.live[si] = 0
        self.members[si] = []
        self.open[pl] = si
        return si

    def _plan(self, groups: dict, allow_reserve: bool) -> tuple[list, dict]:
        plans = []
        leftover: dict = {}
        planned: set = set()
        self._to_reclaim = []
        for pl, idx in groups.items():
            pending = list(idx)
            while pending:
                si = self._open_for(pl, allow_reserve, planned)
                if si is None:
                    leftover[pl] = pending
                    break
                planned.add(si)
                k = self._fit(self.S - self.wp[si], len(pending))
                take, pending = pending[:k], pending[k:]
                self.next_seq += 1
                ext_off = si * self.S + self.wp[si]
                self.wp[si] += self.ext_bytes[k]
                plans.append((si, ext_off, pl, take))
        return plans, leftover

    def _write(self, plans: list, blocks: list[int], status: list, gc: bool) -> None:
        to_reclaim = self._to_reclaim
        self._to_reclaim = []
        slot, c = self.slot, self.c
        for si, ext_off, pl, take in plans:
            k = len(take)
            nbytes = self.ext_bytes[k]
            if self._sink is not None:
                self._sink.on_write(ext_off, nbytes, self._pid(pl) if self.cfg.fdp else None)
            c["engine_write_bytes"] += nbytes
            c["extents"] += 1
            self.header_bytes_in[si] += self.hdr_bytes[k]
            self.written[si] += k
            self.ticks += 1
            self.touched[si] = self.ticks
            base = ext_off + self.hdr_bytes[k]
            for j, i in enumerate(take):
                b = blocks[i]
                old = self.seg_of[b]
                if old >= 0:  # a copy-forward retires the old copy
                    self.live[old] -= 1
                else:
                    self.live_blocks += 1
                    self.srow[b] = self._free_srows.pop() if self._free_srows else self._bump_row(1)
                self.seg_of[b] = si
                self.off_of[b] = base + j * slot
                status[i] = True
            self.live[si] += k
            self.members[si].extend(blocks[i] for i in take)
            c["gc_blocks" if gc else "user_blocks"] += k
        for si, _, _, _ in plans:
            if self.state[si] == _SEALED and self.live[si] == 0:
                self.state[si] = _RECLAIMING
                to_reclaim.append(si)
        for si in to_reclaim:
            self._finish_reclaim(si)

    def _live_blocks(self, si: int) -> list[int]:
        """SegmentStorage._live_rows: the blocks whose current copy lies in ``si``, by store row."""
        seg_of = self.seg_of
        out = [b for b in dict.fromkeys(self.members[si]) if seg_of[b] == si]
        out.sort(key=self.srow.__getitem__)
        return out

    def _finish_reclaim(self, si: int, gc: bool = False) -> None:
        """Trim the whole segment and return it to the clean pool."""
        if self.live[si]:
            raise RuntimeError(f"reclaiming segment {si} with {self.live[si]} live blocks")
        self._trim(si * self.S, self.S)
        self.c["trim_calls"] += 1
        if self.block_mode:
            self.c["segments_reset_gc" if gc else "segments_reset_clean"] += 1
        self.state[si] = _FREE
        self.wp[si] = self.written[si] = self.header_bytes_in[si] = 0
        self.members[si] = []

    def _trim(self, off: int, nbytes: int) -> None:
        if self._sink is not None:
            self._sink.on_trim(off, nbytes)
        self.c["trim_ranges"] += 1
        self.c["trimmed_bytes"] += nbytes

    def _keep(self, blocks: list[int]) -> list[bool]:
        """BlockIndex.on_reclaim: protected blocks, then the survivor rule (``clock``
        restarts the reference bit of a kept block)."""
        rule = self.cfg.survivors
        out = []
        now = self.now
        for b in blocks:
            k = self._protected(b)
            if not k:
                if rule == "all":
                    k = True
                elif rule == "clock" and self.last_s[b] > self.nvme_at[b]:
                    k = True
                    self.nvme_at[b] = now
            out.append(k)
        return out

    def _make_room(self) -> bool:
        return self._gc_one() if self.block_mode else self._evict_region()

    def _victim_order(self) -> list[int]:
        sealed = [s for s in range(self.n_seg) if self.state[s] == _SEALED]
        if self.block_mode:
            if self.cfg.gc_victim == "min_live":
                return sorted(sealed, key=lambda s: self.live[s])
            now = self.next_seq

            def benefit(s: int) -> float:
                u = self.live[s] / max(1, self.written[s])
                return -(1.0 - u) * (now - self.sealed_at[s] + 1) / (1.0 + u)

            return sorted(sealed, key=benefit)
        pol = self.cfg.region_policy
        if pol == "min_live":
            return sorted(sealed, key=lambda s: self.live[s])
        if pol == "lru":
            return sorted(sealed, key=lambda s: self.touched[s])
        return sorted(sealed, key=lambda s: self.sealed_at[s])

    def _evict_region(self) -> bool:
        """SegmentStorage._evict_region / _evict_segment."""
        for si in self._victim_order():
            if self.state[si] != _SEALED:
                continue
            blocks = self._live_blocks(si)
            keep = self._keep(blocks)
            if sum(keep) >= self.written[si]:
                continue
            self.state[si] = _RECLAIMING
            if self._empty_segment(si, blocks, keep, self.seg_pl[si], gc=False):
                self.c["region_evictions"] += 1
                return True
        return False

    def _gc_one(self) -> bool:
        """Block mode's host GC: empty one sealed segment (``gc_victim`` order)."""
        for si in self._victim_order():
            if self.state[si] != _SEALED:
                continue
            blocks = self._live_blocks(si)
            keep = self._keep(blocks)
            if sum(keep) >= self.written[si]:
                continue
            self.state[si] = _RECLAIMING
            pl = self._stream_of(int(LifetimeClass.LONG)) if self.cfg.survivor_stream else self.seg_pl[si]
            if self._empty_segment(si, blocks, keep, pl, gc=True):
                self.c["gc_runs"] += 1
                return True
        return False

    def _empty_segment(self, si: int, blocks: list[int], keep: list[bool], pl, gc: bool) -> bool:
        kept = [b for b, k in zip(blocks, keep) if k]
        moved: set = set()
        for a in range(0, len(kept), self.bpe):  # SegmentStorage._evict_segment: one put per extent's worth
            ck = kept[a : a + self.bpe]
            ok = self._put(ck, [pl] * len(ck), gc=True)
            for b, good in zip(ck, ok):
                if good:
                    moved.add(b)
                    self._record_write(b, pl if pl is not None else -1, True)
        dropped = []
        for b in blocks:
            if b in moved or self.seg_of[b] != si:
                continue
            if b in kept:
                continue
            self.seg_of[b] = -1
            self._free_srow(b)
            self.live[si] -= 1
            self.live_blocks -= 1
            dropped.append(b)
        c = self.c
        if gc:
            c["gc_copied_blocks"] += len(moved)
            c["gc_evicted_blocks"] += len(dropped)
        else:
            c["region_kept_blocks"] += len(moved)
            c["region_evicted_blocks"] += len(dropped)
        stuck = self.live[si] > 0
        if stuck:
            self.state[si] = _SEALED
            c["stuck_evictions"] += 1
        for b in dropped:
            self._left_nvme(b)
        if stuck:
            return False
        self._finish_reclaim(si, gc=True)
        return True

    def _evict_blocks(self, need: int) -> None:
        """Block mode: evict ``need`` unprotected blocks in NVMe-LRU order, deallocate their
        slots (adjacent slots of one call coalesced into one range), reset emptied segments."""
        if isinstance(self.nvme_lru, OrderedDict):
            out = []
            for b in self.nvme_lru:
                if not self._protected(b):
                    out.append(b)
                    if len(out) == need:
                        break
        else:
            out = self.nvme_lru.victims(need, self._protected)
        dead: list[int] = []
        emptied = []
        for b in out:
            si = self.seg_of[b]
            dead.append(self.off_of[b])
            self.seg_of[b] = -1
            self._free_srow(b)
            self.live[si] -= 1
            self.live_blocks -= 1
            if self.live[si] == 0 and self.state[si] == _SEALED:
                self.state[si] = _RECLAIMING
                emptied.append(si)
        self.c["lru_evicted_blocks"] += len(out)
        for b in out:
            self._left_nvme(b)
        if dead:
            dead.sort()
            slot = self.slot
            start = prev = dead[0]
            runs = 0
            for off in dead[1:]:
                if off != prev + slot:
                    self._trim(start, prev + slot - start)
                    runs += 1
                    start = off
                prev = off
            self._trim(start, prev + slot - start)
            self.c["trim_calls"] += 1  # one IOEngine.trim_many per flush
        for si in emptied:
            self._finish_reclaim(si)

    # ============================================================ results
    def check_invariants(self) -> None:
        """Cross-check the bookkeeping (segments, tiers, budget); raises RuntimeError."""
        live = [0] * self.n_seg
        for _b, s in enumerate(self.seg_of):
            if s >= 0:
                live[s] += 1
        if live != self.live:
            raise RuntimeError("per-segment live counts disagree with block locations")
        if sum(live) != self.live_blocks:
            raise RuntimeError("live_blocks disagrees")
        for t in (HBM, HOST):
            if len(self.lru[t]) > self.cap[t]:
                raise RuntimeError(f"tier {t} over capacity")
        if self.block_mode:
            if self.live_blocks > self.live_budget:
                raise RuntimeError(f"live {self.live_blocks} > budget {self.live_budget}")
            if set(self.nvme_lru) != {b for b, s in enumerate(self.seg_of) if s >= 0}:
                raise RuntimeError("NVMe LRU and NVMe residency disagree")
        if self.ftl is not None:
            self.ftl.check_invariants()
            if self.block_mode and self.ftl.page_bytes <= fmt.ALIGN_BYTES:
                # cross-layer: with page-aligned slots every dead slot is deallocated at once, so
                # the device maps exactly the headers of non-free segments and the live slots
                want = sum(self.header_bytes_in) + self.live_blocks * self.slot
                got = self.ftl.stats()["valid_bytes"]
                if got != want:
                    raise RuntimeError(f"FTL maps {got} B, the tier holds {want} B (headers + live slots)")

    def _result(self, wall_s: float) -> dict:
        c, bb, wl, cfg = self.c, self.bb, self.wl, self.cfg
        user_b = c["user_blocks"] * bb
        gc_b = c["gc_blocks"] * bb
        out = {
            "workload": wl.name,
            "config": cfg.name,
            **{f"cfg_{k}": v for k, v in dataclasses.asdict(cfg).items() if k != "name"},
            "util": round(self.geo.util, 4),
            "isolation": self.isolation,
            "device_bytes": self.geo.device_bytes,
            "ru_bytes": self.geo.ru_bytes,
            "tier_bytes": self.geo.tier_bytes,
            "lba_bytes": self.geo.lba_bytes,
            "n_segments": self.n_seg,
            "blocks_per_segment": self.blocks_per_segment,
            "capacity_blocks": wl.capacity_blocks,
            "nvme_blocks_nominal": wl.nvme_bytes // bb,
            "live_budget_blocks": self.live_budget if self.block_mode else None,
            "nvme_live_blocks_end": self.live_blocks,
            "requests": len(wl.keys),
            "lookup_blocks": c["lookup_blocks"],
            "hit_blocks": c["hit_blocks"],
            "hit_ratio": c["hit_blocks"] / max(1, c["lookup_blocks"]),
            "saved_prefill_tokens": c["hit_blocks"] * MOONCAKE_BLOCK_TOKENS,
            "hit_blocks_hbm": c["hit_hbm"],
            "hit_blocks_host": c["hit_host"],
            "hit_blocks_nvme": c["hit_nvme"],
            "nvme_user_bytes": user_b,
            "nvme_gc_bytes": gc_b,
            "host_wa": (user_b + gc_b) / user_b if user_b else float("nan"),
            "format_overhead": c["engine_write_bytes"] / max(1, user_b + gc_b),
            **{
                k: v
                for k, v in c.items()
                if k not in ("lookup_blocks", "hit_blocks", "hit_hbm", "hit_host", "hit_nvme")
            },
            "oracle_unknown_writes": self.oracle_unknown,
            "wall_s": round(wall_s, 1),
            "simulated": _SIMULATED,
        }
        if self.ftl is not None:
            s = self.ftl.stats()
            out.update(
                hbmw_bytes=s["hbmw_bytes"],
                mbmw_bytes=s["mbmw_bytes"],
                device_waf=s["waf"],
                e2e_wa=s["mbmw_bytes"] / user_b if user_b else float("nan"),
                device_gc_runs=s["gc_runs"],
                ruh_host_bytes=s["ruh_host_bytes"],
                ruh_gc_bytes=s["ruh_gc_bytes"],
                ruh_updates=getattr(self._sink, "ruh_updates", 0),
            )
        out.update(self.placement_accuracy())
        return out

    def placement_accuracy(self) -> dict:
        """ROC AUC of the fresh writes' class for "hit on NVMe before it left"
        (Mann-Whitney U with ties; chance = 0.5), and the reused share."""
        cls = np.asarray(self.w_class, dtype=np.int64)
        gc = np.asarray(self.w_gc, dtype=bool)
        y = np.asarray(self.w_reused, dtype=bool)
        sel = ~gc
        cls, y = cls[sel], y[sel]
        out = {
            "nvme_fresh_writes": int(sel.sum()),
            "nvme_reused_share": float(y.mean()) if y.size else float("nan"),
        }
        out["placement_auc"] = auc(cls.astype(np.float64), y)
        out.update(self.tercile_accuracy())
        return out

    def tercile_accuracy(self) -> dict:
        """The fresh writes' class against their true NVMe lifetime in trace seconds, as
        :meth:`tierstore.bench.lifetimes.LifetimeRecorder.summary` scores it (bench/frontier_store.py's
        table 3): tercile classes of the finite lifetimes, copies alive at the end judged LONG when
        older than the upper tercile and left out otherwise; chance = a random assignment with the
        predicted classes' shares."""
        fresh = ~np.asarray(self.w_gc, dtype=bool)
        pred = np.asarray(self.w_class, dtype=np.int64)[fresh]
        s0 = np.asarray(self.w_s0)[fresh]
        s1 = np.asarray(self.w_s1)[fresh]
        died = s1 >= 0
        life = np.where(died, s1, self.now) - s0
        if died.sum() < 3:
            return {"tercile_accuracy": float("nan"), "tercile_chance": float("nan")}
        lo, hi = tercile_bounds(life[died])
        judged = died | (life >= hi)
        truth = np.array([int(true_class(x, lo, hi)) for x in life[judged]], dtype=np.int64)
        p = np.clip(pred[judged], 0, 2)
        true_share = np.bincount(truth, minlength=3) / max(1, truth.size)
        pred_share = np.bincount(p, minlength=3) / max(1, p.size)
        return {
            "tercile_accuracy": float((p == truth).mean()),
            "tercile_chance": float(pred_share @ true_share),
            "tercile_bounds_s": [float(lo), float(hi)],
            "tercile_spearman": _spearman(p.astype(float), life[judged]),
        }

    def oracle_truth(self) -> dict:
        """``(block, n-th fresh write) -> class`` for a second, oracle-placed pass: ``oracle``
        LONG when the copy was hit on NVMe before it left, else SHORT; ``oracle3`` the
        tercile of its NVMe lifetime (in NVMe block writes; still there at the end: LONG)."""
        fresh = [i for i, g in enumerate(self.w_gc) if not g]
        t0 = np.asarray([self.w_t0[i] for i in fresh], dtype=np.int64)
        t1 = np.asarray([self.w_t1[i] for i in fresh], dtype=np.int64)
        died = t1 >= 0
        life = np.where(died, t1 - t0, np.iinfo(np.int64).max)
        lo, hi = np.quantile(life[died], [1 / 3, 2 / 3]) if died.sum() >= 3 else (0, 0)
        L, M, S = int(LifetimeClass.LONG), int(LifetimeClass.MEDIUM), int(LifetimeClass.SHORT)
        out = {}
        for j, i in enumerate(fresh):
            key = (self.w_block[i], self.w_nth[i])
            if self.cfg.classifier == "oracle3":
                out[key] = S if life[j] < lo else (M if life[j] < hi else L)
            else:
                out[key] = L if self.w_reused[i] else S
        return out


class _View:
    """The EntryInfo a classifier reads (tierstore.index.EntryView) for one block."""

    __slots__ = ("_s", "_b")

    def __init__(self, sim: Simulator, b: int) -> None:
        self._s, self._b = sim, b

    key = property(lambda self: self._b)
    size_bytes = property(lambda self: self._s.bb)
    hits = property(lambda self: self._s.hits[self._b])
    last_access_s = property(lambda self: self._s.last_s[self._b])
    created_s = property(lambda self: self._s.created_s[self._b])
    position = property(lambda self: self._s.pos[self._b])
    ns = b"mooncake-trace"

    @property
    def lifetime(self) -> LifetimeClass | None:
        eng = self._s.eng
        return None if eng is None else LifetimeClass(eng[self._b])

    nvme_written_s = property(lambda self: self._s.nvme_at[self._b])


def auc(score: np.ndarray, label: np.ndarray) -> float:
    """ROC AUC of ``score`` for the positive ``label`` (Mann-Whitney U / (n1 n0), average ranks for ties)."""
    n1 = int(label.sum())
    n0 = int(label.size - n1)
    if not n1 or not n0:
        return float("nan")
    order = np.argsort(score, kind="stable")
    s = score[order]
    ranks = np.empty(s.size, dtype=np.float64)
    i = 0
    while i < s.size:
        j = i
        while j + 1 < s.size and s[j + 1] == s[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    u = ranks[label].sum() - n1 * (n1 + 1) / 2.0
    return float(u / (n1 * n0))


# ============================================================== driver
def run_config(
    wl: Workload, cfg: SimConfig, util: float, isolation: str = "initial", device: str = "sim"
) -> dict:
    """One row; the ``oracle`` classifier runs its first pass (the same config with one class) first."""
    oracle = None
    if cfg.classifier in ("oracle", "oracle3"):
        first = Simulator(
            wl, dataclasses.replace(cfg, classifier="one", name=cfg.name + "/pass1"), util, isolation, device
        )
        first.run()
        first.cfg = cfg  # the truth is cut by the second pass's classifier
        oracle = first.oracle_truth()
    sim = Simulator(wl, cfg, util, isolation, device, oracle=oracle)
    return sim.run()


def flat_orders(wl: Workload, specs: list[str], util: float) -> list[dict]:
    """Hit ratios of one flat cache in each order (:func:`flat_order_hit_ratio`; LRU and Belady from
    :mod:`tierstore.bench.references`) at the flat LRU's blocks and at the blocks each configuration
    in ``specs`` keeps (memory tiers + NVMe live budget): what an order can win back of the capacity
    per-block eviction costs. ``engine*`` use :func:`engine_classes` without error."""
    from tierstore.bench.references import belady_hit_ratio, flat_lru_hit_ratio

    eng = engine_classes(wl.keys, wl.n_blocks)
    sizes = [("flat LRU's blocks", wl.capacity_blocks)]
    for spec in specs:
        sim = Simulator(wl, config_from_spec(spec), util)
        sizes.append((spec, sim.cap[HBM] + sim.cap[HOST] + sim.live_budget))
    out = []
    for label, n in sizes:
        out.append(
            {
                "workload": wl.name,
                "blocks": n,
                "of_flat": n / wl.capacity_blocks,
                "sized_as": label,
                "lru": flat_lru_hit_ratio(wl.keys, n),
                "s3fifo": flat_order_hit_ratio(wl.keys, n, S3FIFOOrder()),
                "engine": flat_order_hit_ratio(wl.keys, n, ClassLRU(3, eng.__getitem__)),
                "engine2": flat_order_hit_ratio(wl.keys, n, ClassLRU(2, lambda b: min(eng[b], 1))),
                "belady": belady_hit_ratio(wl.keys, n),
            }
        )
    return out


def reference_row(wl: Workload) -> dict:
    """Flat LRU / Belady of the same total blocks (tierstore.bench.references)."""
    ref = references(wl.requests, wl.capacity_blocks, wl.keys)
    tok = MOONCAKE_BLOCK_TOKENS
    return {
        **ref,
        "flat_lru_saved_tokens": round(ref["flat_lru"] * ref["lookup_blocks"]) * tok,
        "belady_saved_tokens": round(ref["belady"] * ref["lookup_blocks"]) * tok,
    }


def validate(wl: Workload, device: str, name: str = "a", util: float = 0.9) -> dict:
    """A region-mode configuration in the simulator vs the real store
    (:func:`tierstore.replay.run_replay` with the same policies) on ``wl``."""
    from tierstore.replay import ReplayConfig, run_replay

    cfg = CONFIGS[name]
    if cfg.promotion == "move" or (
        cfg.granularity == "block"
        and (cfg.survivor_stream or cfg.lba != "tier" or cfg.gc_victim != "min_live")
    ):
        raise ValueError(
            f"--validate: {name} is not a configuration the store has (promotion top/none; block mode "
            "with one stream, LBA = the tier, GC victim min_live)"
        )
    sim = Simulator(wl, cfg, util, "initial", device).run()
    nv = {"region_policy": cfg.region_policy}
    if cfg.granularity == "block":  # every dead slot deallocated at once, as the simulator does
        nv.update(
            eviction_granularity="block",
            live_fraction=cfg.live_fraction,
            trim_min_bytes=-(-wl.block_bytes // 4096) * 4096,
        )
    if device == "sim":
        nv.update(device="sim", engine="memory", model={"utilization": util}, fdp={"enabled": cfg.fdp})
    pol = {
        "promotion": cfg.promotion,
        "reinsert": cfg.survivors,
        "classifier": cfg.classifier if cfg.classifier != "one" else "hint",
    }
    t0 = time.perf_counter()
    rep = run_replay(
        ReplayConfig(
            trace=wl.trace,
            limit=wl.limit,
            block_bytes=wl.block_bytes,
            hbm_bytes=wl.hbm_bytes,
            host_bytes=wl.host_bytes,
            nvme_bytes=wl.nvme_bytes,
            nvme_options=nv,
            policies=pol,
        )
    )
    real_wall = time.perf_counter() - t0
    kv, d = rep.kv, rep.device
    real = {
        "hit_ratio": kv["lookup_hit_ratio"],
        "hit_blocks_hbm": kv["hit_blocks_hbm"],
        "hit_blocks_host": kv["hit_blocks_host"],
        "hit_blocks_nvme": kv["hit_blocks_nvme"],
        "nvme_user_bytes": kv["nvme_write_bytes"],
        "promotions": kv["promotions"],
        "flushed_blocks": int(rep.final_stats.get("flushed_blocks", 0)),
        "evictions_nvme": kv["evictions_nvme"],
        "host_wa": d.get("host_write_amplification"),
        "segment_bytes": d.get("segment_size_bytes"),
        "device_bytes": d.get("device_bytes"),
        "device_waf": d.get("waf"),
        "e2e_wa": d.get("e2e_wa"),
        "wall_s": round(real_wall, 1),
    }
    mine = {k: sim.get(k) for k in real if k not in ("segment_bytes",)}
    mine["segment_bytes"] = sim["ru_bytes"]
    mine["wall_s"] = sim["wall_s"]
    return {
        "workload": wl.name,
        "device": device,
        "config": name,
        "util": util,
        "real": real,
        "sim": mine,
        "hit_ratio_gap": sim["hit_ratio"] - real["hit_ratio"],
    }


def _fmt(v, nd=4) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.{nd}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def print_rows(rows: list[dict], ref: dict | None) -> None:
    """Markdown table (FTL model, not an SSD)."""
    print(
        f"\n(FTL model, not an SSD) flat LRU {_fmt(ref and ref['flat_lru'])} "
        f"({_fmt(ref and ref['flat_lru_saved_tokens'])} tokens), Belady {_fmt(ref and ref['belady'])}, "
        f"{_fmt(ref and ref['capacity_blocks'])} blocks"
        if ref
        else ""
    )
    print(
        "| workload | config | util | iso | hit ratio | saved prefill tokens | vs flat LRU | host WA | "
        "device WAF "
        "(model) | e2e WA (model) | GC copied | GC evicted | AUC | s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        vs = (
            f"{100 * (r['saved_prefill_tokens'] / ref['flat_lru_saved_tokens'] - 1):+.2f}%"
            if ref and ref.get("flat_lru_saved_tokens")
            else "-"
        )
        gcc = r["gc_copied_blocks"] if r["cfg_granularity"] == "block" else r["region_kept_blocks"]
        gce = r["gc_evicted_blocks"] if r["cfg_granularity"] == "block" else r["region_evicted_blocks"]
        print(
            f"| {r['workload']} | {r['config']} | {r.get('cfg_util_req', r['util']):.2f} | "
            f"{r['isolation'][:4]} | {r['hit_ratio']:.4f} | "
            f"{r['saved_prefill_tokens']:,} | {vs} | {r['host_wa']:.4f} | {_fmt(r.get('device_waf'))} | "
            f"{_fmt(r.get('e2e_wa'))} | {gcc:,} | {gce:,} | {_fmt(r.get('placement_auc'), 3)} | "
            f"{r['wall_s']} |"
        )


#: One line per configuration family, for the report.
FAMILY = {
    "a": "region LRU (today's default)",
    "b": "region FIFO + clock copy-forward",
    "c": "per-block, promotion top, conventional SSD",
    "d": "per-block, promotion top, FDP",
    "mc": "per-block, exclusive tiers, conventional SSD",
    "m": "per-block, exclusive tiers, FDP",
}


def _family(r: dict) -> str:
    if r["cfg_granularity"] == "region":
        return "a" if r["cfg_region_policy"] == "lru" else "b"
    if r["cfg_promotion"] == "move":
        return "m" if r["cfg_fdp"] else "mc"
    return "d" if r["cfg_fdp"] else "c"


def describe(r: dict) -> str:
    """One line naming a result row's configuration."""
    g = r["cfg_granularity"]
    nv = r.get("cfg_nvme_order", "lru")
    parts = [f"region {r['cfg_region_policy']}" if g == "region" else f"per-block {ORDERS[nv]}"]
    mo = r.get("cfg_memory_order", "lru")
    if mo != "lru":
        parts.append(f"memory tiers {ORDERS[mo]}")
    parts.append(
        {"top": "promotion top", "none": "no promotion", "move": "exclusive tiers (move)"}[r["cfg_promotion"]]
    )
    if g == "region":
        if r["cfg_survivors"] != "none":
            parts.append(f"{r['cfg_survivors']} copy-forward")
    else:
        parts.append(
            {"none": "GC evicts all", "clock": "GC keeps hit (clock)", "all": "GC keeps all"}[
                r["cfg_survivors"]
            ]
        )
        parts.append(f"live {r['cfg_live_fraction']:.2f}" if r["cfg_lba"] == "tier" else "LBA = device")
        if r["cfg_survivor_stream"]:
            parts.append("survivor stream")
    if r["cfg_classifier"] not in ("one", "survivor"):
        parts.append(f"class: {r['cfg_classifier']}")
    if r.get("cfg_hints", "none") != "none":
        err = r.get("cfg_hint_error", 0.0)
        parts.append(f"engine hints{f' ({err:.0%} random)' if err else ''}")
    parts.append("FDP" if r["cfg_fdp"] else "one handle")
    return ", ".join(parts)


#: What ``--slim`` keeps of a row: enough for ``--report`` and the README's tables.
SLIM_FIELDS = (
    "workload config cfg_spec cfg_util_req util isolation capacity_blocks nvme_blocks_nominal "
    "live_budget_blocks n_segments blocks_per_segment hit_ratio saved_prefill_tokens hit_blocks_hbm "
    "hit_blocks_host hit_blocks_nvme host_wa device_waf e2e_wa mbmw_bytes nvme_user_bytes nvme_gc_bytes "
    "gc_copied_blocks gc_evicted_blocks region_kept_blocks region_evicted_blocks lru_evicted_blocks "
    "trim_ranges placement_auc tercile_accuracy tercile_chance tercile_spearman nvme_reused_share flat_lru "
    "flat_lru_saved_tokens belady belady_saved_tokens loadavg_start loadavg_end wall_s simulated source"
).split()


def slim(src: str, dst: str) -> int:
    """Copy ``src``'s result rows (the last per key) with :data:`SLIM_FIELDS` and every ``cfg_``
    field, and its references, to ``dst``; returns the rows written."""
    rows, refs = load_rows(src)
    with open(dst, "w") as f:
        for r in rows:
            f.write(
                json.dumps({k: v for k, v in r.items() if k in SLIM_FIELDS or k.startswith("cfg_")}) + "\n"
            )
        for wl, ref in refs.items():
            f.write(json.dumps({"reference": ref, "workload": wl}) + "\n")
    return len(rows)


def load_rows(path: str) -> tuple[list[dict], dict]:
    """Result rows and references (per workload) of a ``--json`` file (the last row per key wins)."""
    rows: dict = {}
    refs: dict = {}
    with open(path) as f:
        for line in f:
            r = json.loads(line)
            if "reference" in r:
                refs[r["workload"]] = r["reference"]
            elif "config" in r:
                rows[(r["workload"], r["config"], r["cfg_util_req"], r["isolation"])] = r
    return list(rows.values()), refs


def report(path: str, out_dir: str, wa_max: float = 1.10) -> str:
    """Markdown tables and one PNG per workload (saved prefill vs e2e WA) from a ``--json`` file;
    returns the markdown (also written to ``out_dir/frontier.md``)."""
    rows, refs = load_rows(path)
    os.makedirs(out_dir, exist_ok=True)
    md: list[str] = [f"(Every WA figure: FTL model, not an SSD. {_SIMULATED}.)", ""]
    md += go_no_go(rows, wa_max)
    for wl in sorted(
        {r["workload"] for r in rows},
        key=lambda w: ("conv10", "conv40", "agent10").index(w) if w in ("conv10", "conv40", "agent10") else 9,
    ):
        ref = refs.get(wl) or {}
        sel = [r for r in rows if r["workload"] == wl]
        flat = sel[0]["flat_lru_saved_tokens"]
        md.append(
            f"### {wl}: flat LRU {sel[0]['flat_lru']:.4f} ({flat:,} tokens), Belady {sel[0]['belady']:.4f} "
            f"({sel[0]['belady_saved_tokens']:,}), {ref.get('capacity_blocks', sel[0]['capacity_blocks']):,} "
            "blocks in all tiers"
        )
        md.append("")
        md.append(
            "| config | what | util | isolation | hit ratio | saved prefill tokens | vs flat LRU | host WA | "
            "device WAF (FTL model, not an SSD) | e2e WA (FTL model, not an SSD) | NAND GiB (model) | "
            "GC / region copies | GC / region evictions | NVMe live budget | placement AUC |"
        )
        md.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        order = {k: i for i, k in enumerate(CONFIGS)}
        for r in sorted(
            sel,
            key=lambda r: (
                r["cfg_util_req"],
                r["isolation"] != "initial",
                order.get(r["config"].split(":")[0], 99),
                r["config"],
            ),
        ):
            blk = r["cfg_granularity"] == "block"
            md.append(
                f"| `{r['config']}` | {describe(r)} | {r['cfg_util_req']:.2f} | {r['isolation']} | "
                f"{r['hit_ratio']:.4f} | "
                f"{r['saved_prefill_tokens']:,} | {100 * (r['saved_prefill_tokens'] / flat - 1):+.2f} % | "
                f"{r['host_wa']:.4f} | {r['device_waf']:.4f} | {r['e2e_wa']:.4f} | "
                f"{r['mbmw_bytes'] / 2**30:.2f} | "
                f"{(r['gc_copied_blocks'] if blk else r['region_kept_blocks']):,} | "
                f"{(r['gc_evicted_blocks'] if blk else r['region_evicted_blocks']):,} | "
                f"{r['live_budget_blocks'] if blk else '-'} | "
                f"{'-' if math.isnan(r['placement_auc']) else format(r['placement_auc'], '.3f')} |"
            )
        md.append("")
        _plot(sel, wl, os.path.join(out_dir, f"frontier_{wl}.png"), wa_max)
    text = "\n".join(md) + "\n"
    with open(os.path.join(out_dir, "frontier.md"), "w") as f:
        f.write(text)
    return text


_CFG_FIELDS = [f.name for f in dataclasses.fields(SimConfig) if f.name not in ("name", "fdp")]
_DEFAULT = {f.name: f.default for f in dataclasses.fields(SimConfig)}  # rows written before a field existed


def twin(rows: list[dict], r: dict) -> dict | None:
    """The same configuration with ``fdp`` flipped (same workload, utilisation, isolation), if it ran."""
    for o in rows:
        if (
            (o["workload"], o["cfg_util_req"], o["isolation"])
            == (r["workload"], r["cfg_util_req"], r["isolation"])
            and o["cfg_fdp"] != r["cfg_fdp"]
            and all(o.get("cfg_" + f, _DEFAULT[f]) == r.get("cfg_" + f, _DEFAULT[f]) for f in _CFG_FIELDS)
        ):
            return o
    return None


def _reads_future(r: dict) -> bool:
    """Oracle placement, the perfect engine's hints (:func:`engine_classes`) and the ``next`` and
    ``dead`` orders read the future."""
    return (
        r["cfg_classifier"].startswith("oracle")
        or r.get("cfg_hints", "none") == "engine"
        or bool({"next", "dead"} & {r.get("cfg_nvme_order"), r.get("cfg_memory_order")})
    )


def go_no_go(rows: list[dict], wa_max: float = 1.10) -> list[str]:
    """The decision table: per workload and utilisation, the flat LRU's saved prefill against the
    best configurations at e2e WA <= ``wa_max`` (FTL model), and the best per-block FDP
    configuration's cost on the conventional one-handle device."""

    def best(sel):
        ok = [r for r in sel if r["e2e_wa"] <= wa_max]
        return max(ok, key=lambda r: (r["saved_prefill_tokens"], -r["e2e_wa"])) if ok else None

    def cell(r, flat):
        if r is None:
            return "none at this WA | - | -"
        return (
            f"`{r['config']}` | {r['saved_prefill_tokens']:,} "
            f"({100 * (r['saved_prefill_tokens'] / flat - 1):+.2f} %)"
            f" | {r['e2e_wa']:.4f}"
        )

    out = [
        f'Best configurations at e2e WA <= {wa_max} (FTL model, not an SSD); "store-visible" excludes the '
        'oracle placements and the perfect engine\'s hints (they need the future); "conventional twin" '
        "is the same per-block configuration on the one-handle model without RUH Update.",
        "",
        "| workload | util | flat LRU saved tokens | today's default `a`: saved (e2e WA, FTL model) | best "
        "region | "
        "saved (vs flat LRU) | e2e WA (FTL model, not an SSD) | best per-block FDP, store-visible | saved "
        "(vs flat "
        "LRU) | e2e WA (FTL model, not an SSD) | its conventional twin: e2e WA (device WAF), FTL model, not "
        "an SSD | "
        "best per-block FDP, oracle or engine hints | saved (vs flat LRU) | "
        "e2e WA (FTL model, not an SSD) | per-block FDP "
        ">= flat "
        "LRU at this WA? |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    init = [r for r in rows if r["isolation"] == "initial"]
    for wl in sorted(
        {r["workload"] for r in init},
        key=lambda w: ("conv10", "conv40", "agent10").index(w) if w in ("conv10", "conv40", "agent10") else 9,
    ):
        for u in sorted({r["cfg_util_req"] for r in init if r["workload"] == wl}):
            sel = [r for r in init if r["workload"] == wl and r["cfg_util_req"] == u]
            flat = sel[0]["flat_lru_saved_tokens"]
            a = next((r for r in sel if r["config"] == "a"), None)
            reg = best([r for r in sel if r["cfg_granularity"] == "region"])
            blk = [r for r in sel if r["cfg_granularity"] == "block" and r["cfg_fdp"]]
            vis = best([r for r in blk if not _reads_future(r)])
            orc = best([r for r in blk if _reads_future(r)])
            tw = twin(rows, vis) if vis is not None else None
            twc = "not run" if tw is None else f"{tw['e2e_wa']:.4f} ({tw['device_waf']:.4f})"
            reach = any(r is not None and r["saved_prefill_tokens"] >= flat for r in (vis, orc))
            out.append(
                f"| {wl} | {u:.2f} | {flat:,} | "
                f"{'-' if a is None else format(a['saved_prefill_tokens'], ',')} "
                f"({'-' if a is None else format(a['e2e_wa'], '.4f')}) | {cell(reg, flat)} | "
                f"{cell(vis, flat)} | "
                f"{twc} | {cell(orc, flat)} | {'yes' if reach else '**no**'} |"
            )
    return out + [""]


def _plot(rows: list[dict], wl: str, path: str, wa_max: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "a": "tab:blue",
        "b": "tab:cyan",
        "c": "tab:orange",
        "d": "tab:red",
        "mc": "tab:olive",
        "m": "tab:green",
    }
    fig, ax = plt.subplots(figsize=(8, 5.5))
    for r in rows:
        if r["isolation"] != "initial":
            continue
        fam = _family(r)
        filled = r["cfg_util_req"] < 0.95
        ax.scatter(
            r["e2e_wa"],
            r["saved_prefill_tokens"] / 1e6,
            s=28,
            marker="o" if filled else "s",
            facecolors=colors[fam] if filled else "none",
            edgecolors=colors[fam],
        )
        ax.annotate(
            r["config"].replace("live_fraction", "lf"),
            (r["e2e_wa"], r["saved_prefill_tokens"] / 1e6),
            fontsize=5,
            xytext=(2, 2),
            textcoords="offset points",
        )
    flat, opt = rows[0]["flat_lru_saved_tokens"] / 1e6, rows[0]["belady_saved_tokens"] / 1e6
    ys = [r["saved_prefill_tokens"] / 1e6 for r in rows] + [flat]
    ax.axhline(flat, color="k", ls="--", lw=1, label="flat LRU, same blocks")
    top = max(ys) + 0.15 * (max(ys) - min(ys) + 1e-9)
    if opt <= top:
        ax.axhline(opt, color="k", ls=":", lw=1, label="Belady MIN, same blocks")
    else:  # far above every point: named, not drawn (the points would be squeezed)
        ax.plot(
            [], [], color="k", ls=":", lw=1, label=f"Belady MIN, same blocks: {opt:.1f} M (off the chart)"
        )
        ax.set_ylim(min(ys) - 0.05 * (max(ys) - min(ys) + 1e-9), top)
    ax.axvspan(1.0, wa_max, color="0.9", zorder=0, label=f"e2e WA <= {wa_max}")
    for fam, c in colors.items():
        ax.scatter([], [], color=c, label=FAMILY[fam])
    ax.scatter([], [], marker="o", color="0.5", label="utilisation 0.90")
    ax.scatter([], [], marker="s", facecolors="none", edgecolors="0.5", label="utilisation 1.00")
    ax.set_xlabel("end-to-end WA (NAND bytes / bytes the index wrote) - FTL model, not an SSD")
    ax.set_ylabel("saved prefill tokens (millions)")
    ax.set_title(f"{wl}: saved prefill vs write amplification (bench/frontier_sim.py; simulated device)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="excerpt", help="excerpt, conv10, conv40, agent10, agent40")
    ap.add_argument(
        "--trace",
        default=None,
        help="Mooncake JSONL (excerpt: the packaged one; conv*: the "
        f"conversation trace, default {CONVERSATION})",
    )
    ap.add_argument("--agent-trace", default=None, help="agent workload JSONL (bench/agent_workload.py)")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--block-bytes", default="32k")
    ap.add_argument(
        "--configs", default="a", help="comma-separated names (--list-configs) or name:field=value;..."
    )
    ap.add_argument("--utils", default="0.9", help="comma-separated NVMe tier / device utilisations")
    ap.add_argument(
        "--isolations",
        default="initial",
        help="initial, persistent (multi-handle configs only differ; one-handle configs run once)",
    )
    ap.add_argument("--json", default=None, help="append one JSON row per configuration to this file")
    ap.add_argument("--resume", action="store_true", help="skip rows already in --json")
    ap.add_argument(
        "--validate",
        choices=("file", "sim"),
        default=None,
        help="run --configs (region mode) here and through the real store (run_replay) and compare "
        "(file: the replay's default NVMe file; sim: the FTL model at the first --utils)",
    )
    ap.add_argument("--list-configs", action="store_true")
    ap.add_argument(
        "--flat-orders",
        action="store_true",
        help="one flat cache per order at the flat LRU's blocks and at the blocks each --configs keeps",
    )
    ap.add_argument(
        "--report", default=None, metavar="JSONL", help="tables and plots of a --json file into --out"
    )
    ap.add_argument("--out", default=".", help="directory of --report's frontier.md and PNGs")
    ap.add_argument(
        "--slim", default=None, metavar="JSONL", help="copy its rows with SLIM_FIELDS only to the file --out"
    )
    a = ap.parse_args(argv)
    if a.list_configs:
        for c in CONFIGS.values():
            print(c)
        return 0
    if a.report:
        print(report(a.report, a.out))
        return 0
    if a.slim:
        print(f"{slim(a.slim, a.out)} rows -> {a.out}")
        return 0
    wl = load_workload(a.workload, a.trace, a.limit, parse_size(a.block_bytes, "block_bytes"), a.agent_trace)
    print(
        f"{wl.name}: {len(wl.keys)} requests, {wl.n_blocks} unique blocks, tiers "
        f"{wl.hbm_bytes}/{wl.host_bytes}/"
        f"{wl.nvme_bytes} B ({wl.capacity_blocks} blocks); load average {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
    )
    if a.flat_orders:
        print(
            "| workload | blocks (of the flat LRU's) | sized as | LRU | S3-FIFO | engine | engine2 | Belady |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in flat_orders(wl, a.configs.split(","), float(a.utils.split(",")[0])):
            print(
                f"| {r['workload']} | {r['blocks']:,} ({r['of_flat']:.3f}) | `{r['sized_as']}` | "
                + " | ".join(f"{r[k]:.4f}" for k in ("lru", "s3fifo", "engine", "engine2", "belady"))
                + " |"
            )
        return 0
    if a.validate:
        for name in a.configs.split(","):
            v = validate(wl, a.validate, name, float(a.utils.split(",")[0]))
            v["loadavg"] = round(os.getloadavg()[0], 2)
            print(json.dumps(v, indent=1))
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps({"validation": v}) + "\n")
        return 0
    ref = reference_row(wl)
    done: set = set()
    if a.resume and a.json and os.path.exists(a.json):
        with open(a.json) as f:
            for line in f:
                r = json.loads(line)
                if "config" in r:
                    done.add((r["workload"], r["config"], r["cfg_util_req"], r["isolation"]))
    rows = []
    for spec in a.configs.split(","):
        cfg = config_from_spec(spec)
        multi = cfg.fdp and cfg.classifier not in ("one",)
        for u in (float(x) for x in a.utils.split(",")):
            for iso in a.isolations.split(",") if multi else ["initial"]:
                if (wl.name, cfg.name, u, iso) in done:
                    continue
                load0 = os.getloadavg()[0]
                r = run_config(wl, cfg, u, iso)
                r.update(
                    cfg_util_req=u,
                    cfg_spec=spec,
                    loadavg_start=round(load0, 2),
                    loadavg_end=round(os.getloadavg()[0], 2),
                    flat_lru=ref["flat_lru"],
                    flat_lru_saved_tokens=ref["flat_lru_saved_tokens"],
                    belady=ref["belady"],
                    belady_saved_tokens=ref["belady_saved_tokens"],
                )
                rows.append(r)
                print_rows([r], None)
                if a.json:
                    with open(a.json, "a") as f:
                        f.write(json.dumps(r) + "\n")
    if rows:
        print_rows(rows, ref)
    if a.json and ref:
        with open(a.json, "a") as f:
            f.write(json.dumps({"reference": dict(ref.items()), "workload": wl.name}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
