"""RemotePlanner (tierstore/planner.py): the remote tier's decisions, on stores sharing the
in-memory Mooncake client (tests/remote/fake_mooncake.FakeStore).

Checked: a chain split remote / local / remote / ... is matched with at most
``REMOTE_ROUNDS`` (4) remote calls and loads byte-exact; a namespace this store
invalidated is never looked up or loaded remotely again (other namespaces still are);
publish admission (``all``, ``reused`` with its second sighting, ``publish: evict``).
"""

from __future__ import annotations

import pytest
import torch

from tierstore import KVStore, Namespace, Status
from tierstore.api import leading_ok
from tierstore.index import Tier
from tierstore.planner import RemotePlanner

from .prompts import NS, prompt


@pytest.fixture
def remote_cfg(remote_cfg):
    return {**remote_cfg, "publish_queue_blocks": 64}


@pytest.fixture
def host_blocks():
    return 64


def exists_calls(store: KVStore) -> int:
    return store.remote.stats()["exists_calls"]


def test_a_chain_split_remote_local_remote_is_matched_in_at_most_four_remote_calls(make_store):
    """Blocks 0-1 remote, 2-3 here, 4-5 remote, ... (18 blocks): the lookup alternates one
    remote call and one local probe, stops after REMOTE_ROUNDS remote calls (16 blocks),
    and the load returns each block's own bytes."""
    a, b = make_store(), make_store(publish="evict")  # b publishes nothing when it stores
    assert b._planner.REMOTE_ROUNDS == 4
    tokens, kv = prompt(1, 18)
    keys = a.keys_for(NS, tokens)
    for i in range(0, 18, 4):
        assert a.store_keys(NS, keys[i : i + 2], kv[i : i + 2], first_position=i) == [Status.OK] * 2
        if i + 2 < 18:
            assert (
                b.store_keys(NS, keys[i + 2 : i + 4], kv[i + 2 : i + 4], first_position=i + 2)
                == [Status.OK] * 2
            )
    assert a.remote.flush(5)
    before = exists_calls(b)
    hit = b.lookup(NS, tokens)
    assert exists_calls(b) - before == 4
    assert hit.tiers == ([Tier.REMOTE] * 2 + [Tier.HOST] * 2) * 4
    assert hit.keys == keys[:16]
    st, blocks = b.load(hit.keys)
    assert leading_ok(st) == 16
    assert all(torch.equal(blocks[i], kv[i]) for i in range(16))
    assert b.stats()["remote_hit_blocks"] == 8


def test_a_chain_that_ends_remotely_takes_one_call(make_store):
    a, b = make_store(), make_store()
    tokens, kv = prompt(2, 6)
    assert a.store(NS, tokens, kv) == [Status.OK] * 6
    assert a.remote.flush(5)
    before = exists_calls(b)
    hit = b.lookup(NS, tokens)
    assert exists_calls(b) - before == 1 and hit.tiers == [Tier.REMOTE] * 6


def test_an_invalidated_namespace_is_never_looked_up_or_loaded_remotely_again(make_store):
    a, b = make_store(), make_store()
    other = Namespace(model="m@1", tenant="other")
    tokens, kv = prompt(3, 4)
    assert a.store(NS, tokens, kv) == [Status.OK] * 4
    assert a.store(other, tokens, kv) == [Status.OK] * 4
    assert a.remote.flush(5)
    hit = b.lookup(NS, tokens)  # remembered under NS: a load would be a cache fill
    assert hit.tiers == [Tier.REMOTE] * 4
    d = b.digest(NS)
    assert b._planner.plan_load(hit.keys, [0, 1]).fill == {d: [0, 1]}
    b.invalidate(NS)
    assert b._planner.barred(d) and not b._planner.barred(b.digest(other))
    plan = b._planner.plan_load(hit.keys, [0, 1, 2, 3])
    assert plan.barred == [0, 1, 2, 3] and plan.fill == {} and plan.staged == []
    st, _ = b.load(hit.keys)  # the lookup from before the invalidation
    assert st == [Status.MISS] * 4
    before = exists_calls(b)
    assert b.lookup(NS, tokens).matched_blocks == 0
    assert exists_calls(b) == before  # no remote call for a barred namespace
    hit = b.lookup(other, tokens)
    assert hit.tiers == [Tier.REMOTE] * 4 and exists_calls(b) == before + 1
    st, blocks = b.load(hit.keys)
    assert leading_ok(st) == 4 and all(torch.equal(blocks[i], kv[i]) for i in range(4))


def test_publish_admission_all_reused_and_evict(make_store):
    keys = [bytes([i]) * 32 for i in range(4)]
    every = make_store()._planner
    assert isinstance(every, RemotePlanner)
    assert every.publishable(keys, hits=0) == [0, 1, 2, 3] and not every.publishes_reused
    assert every.publishable([], hits=0) == []

    reused = make_store(admission="reused")._planner
    assert reused.publishes_reused
    assert reused.publishable(keys, hits=0) == []  # first sighting: kept local
    assert reused.publishable(keys[:2], hits=0) == [0, 1]  # second sighting (the ghost set)
    assert reused.publishable(keys[2:], hits=1) == [0, 1]  # a local hit admits at once
    assert (reused.share.admitted, reused.share.declined) == (4, 4)

    evict = make_store(publish="evict", admission="reused")._planner
    assert evict.publishable(keys, hits=1) == []
    assert (evict.share.admitted, evict.share.declined) == (0, 0)  # the rule is not even asked


def test_a_store_publishes_what_admission_takes(make_store):
    s = make_store(admission="reused")
    tokens, kv = prompt(4, 3)
    assert s.store(NS, tokens, kv) == [Status.OK] * 3
    assert s.stats().get("remote_published_blocks", 0) == 0  # seen once: local only
    st, _ = s.load(s.lookup(NS, tokens))  # a local hit is offered again
    assert leading_ok(st) == 3
    assert s.remote.flush(5) and s.stats()["remote_published_blocks"] == 3
