"""Class-first eviction (``class_lru``): the engine's shortest lifetime class first, LRU within a
class, plain LRU when no block carries a hint; in a memory tier and as the NVMe block mode's order."""

from __future__ import annotations

import random

import numpy as np
import torch

from tierstore import KVStore, Namespace, Status
from tierstore.fdp.lifetime import LifetimeClass
from tierstore.layout import KVLayout
from tierstore.policies import ClassLRUPolicy, make_policy
from tierstore.policies.lru import LRUPolicy

from ..conftest import FakeEntry as E

S, M, L = LifetimeClass.SHORT, LifetimeClass.MEDIUM, LifetimeClass.LONG


def k(i: int) -> bytes:
    return i.to_bytes(32, "little")


def test_evicts_the_shortest_class_first_and_lru_within_it():
    p = make_policy("class_lru")
    assert isinstance(p, ClassLRUPolicy)
    cls = {0: L, 1: M, 2: S, 3: M, 4: S, 5: L, 6: None}  # None: no hint, counts as conversation
    for i, c in cls.items():
        p.on_insert(E(k(i), lifetime=c), float(i))
    p.on_access(E(k(2), lifetime=S), 10.0)  # the older query block is now the younger one
    p.on_access(E(k(1), lifetime=M), 11.0)
    p.on_access(E(k(0), lifetime=L), 12.0)
    want = [k(4), k(2), k(3), k(6), k(1), k(5), k(0)]
    assert p.evict(7, lambda key: False, 20.0) == want
    assert p.evict_upto(9, lambda key: False, 20.0) == want
    assert p.evict(2, lambda key: key == k(4), 20.0) == [k(2), k(3)]  # protected ones are skipped
    assert p.evict(1, lambda key: key != k(0), 20.0, max_scan=6) == []  # max_scan counts across classes
    p.on_remove(k(2))
    p.on_remove(k(2))  # unknown now: ignored
    assert len(p) == 6 and p.evict(1, lambda key: False, 20.0) == [k(4)]
    p.on_insert(E(k(4), lifetime=L), 21.0)  # re-inserted while tracked: it keeps its class (query)
    assert p.evict(2, lambda key: False, 21.0) == [k(4), k(3)]


def test_without_hints_it_is_lru():
    rng = random.Random(1)
    lru, cls = LRUPolicy(), ClassLRUPolicy()
    live: list[int] = []
    for step in range(400):
        op = rng.random()
        if op < 0.5 or not live:
            i = rng.randrange(60)
            batch = [k(i + j) for j in range(rng.randrange(1, 4))]
            for p in (lru, cls):
                p.on_insert_many(batch, lambda j, b=batch: E(b[j]), float(step))
            live.extend(i + j for j in range(len(batch)))
        elif op < 0.8:
            batch = [k(rng.choice(live)) for _ in range(3)] + [k(999)]  # one absent key
            for p in (lru, cls):
                p.on_access_many(batch, lambda j, b=batch: E(b[j]), float(step))
        else:
            v = lru.evict(2, lambda key: key[0] % 3 == 0, float(step))
            assert cls.evict(2, lambda key: key[0] % 3 == 0, float(step)) == v
            for key in v:
                lru.on_remove(key)
                cls.on_remove(key)
        assert len(lru) == len(cls)
        assert cls.evict_upto(10**6, lambda key: False) == list(lru._order)


LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16, tokens_per_block=16)
NS = Namespace(model="m@1", tenant="acme")


def _prompt(i: int, blocks: int = 4):
    toks = np.arange(i * 1000, i * 1000 + blocks * LAYOUT.tokens_per_block)
    kv = torch.from_numpy(
        np.random.default_rng(i).standard_normal((blocks, *LAYOUT.block_shape)).astype(np.float16)
    )
    return toks, kv


def test_memory_tier_and_nvme_block_mode_evict_queries_first(tmp_path):
    """Through KVStore: the host tier and the NVMe tier's per-block eviction both evict the
    ``query`` prompts before older ``conversation`` ones, and every block served is the one stored."""
    bb = LAYOUT.bytes_per_block
    s = KVStore(
        LAYOUT,
        hbm_bytes=0,
        host_bytes=8 * bb,
        nvme_path=str(tmp_path),
        nvme_bytes=1 << 20,
        eviction_granularity="block",
        eviction="class_lru",
    )
    try:
        n = 30
        hint = ["conversation" if i % 3 == 0 else "query" for i in range(n)]
        for i in range(n):
            assert s.store(NS, *_prompt(i), lifetime=hint[i]) == [Status.OK] * 4
        s.check_invariants(quiescent=True)
        assert s.stats()["nvme_backend"]["block_evictions"] > 0
        kept = {}
        for i in range(n):
            toks, kv = _prompt(i)
            hit = s.lookup(NS, toks)
            st, out = s.load(hit.keys)
            assert all(torch.equal(a, b) for a, b in zip(out[: hit.matched_blocks], kv))
            kept[i] = hit.matched_blocks
        conv = [kept[i] for i in range(n) if hint[i] == "conversation"]
        query = [kept[i] for i in range(n - 6) if hint[i] == "query"]  # the last few may be in host
        assert conv == [4] * len(conv), conv  # no conversation prompt lost a block
        assert sum(query) < 4 * len(query) // 2, query  # the queries paid for them
    finally:
        s.close()
