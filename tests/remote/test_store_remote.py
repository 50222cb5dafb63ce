"""KVStore with the shared remote tier, against the in-memory Mooncake client
(runs without the wheel; the same paths run against a real master in
test_store_sharing.py).

What is checked here: the remote tier behind the core's contract (lookup asks
the remote tier for the blocks after the local match, a load fills them into
the host tier zero-copy and indexes them, stores publish asynchronously), the
failure cases at the store level (corrupt objects, a hung cluster, the master
down: misses, never wrong bytes, local tiers keep serving), tenant isolation
both ways, and the three ways to configure the tier.
"""

from __future__ import annotations

import time

import pytest
import torch

from tierstore import KVStore, Namespace, Status
from tierstore.api import leading_ok
from tierstore.config import StoreConfig
from tierstore.errors import ConfigError
from tierstore.index import Tier
from tierstore.remote.format import ObjectNamer

from .fake_mooncake import FakeStore
from .prompts import LAYOUT, NS, prompt


def load_checked(store: KVStore, ns, seed: int, n: int, key_level: bool = False):
    """Lookup + load of prompt ``seed``; returns (lookup, loaded blocks, wrong blocks)."""
    tokens, kv = prompt(seed, n)
    hit = (
        store.lookup_keys(store.keys_for(ns, tokens), ns=ns if key_level == "ns" else None)
        if key_level
        else store.lookup(ns, tokens)
    )
    st, blocks = store.load(hit.keys)
    k = leading_ok(st)
    wrong = sum(not torch.equal(blocks[i], kv[i]) for i in range(k))
    return hit, k, wrong


def test_b_hits_what_a_stored_and_fills_its_host_tier_zero_copy(make_store):
    a, b = make_store(), make_store()
    tokens, kv = prompt(1, 5)
    assert a.store(NS, tokens, kv) == [Status.OK] * 5
    assert a.remote.flush(5)
    hit, k, wrong = load_checked(b, NS, 1, 5)
    assert hit.tiers == [Tier.REMOTE] * 5 and k == 5 and wrong == 0
    rs = b.remote.stats()
    assert rs["zero_copy_gets"] == 5 and rs["staged_gets"] == 0  # straight into registered host-tier slots
    s = b.stats()
    assert s["remote_fill_blocks"] == 5 and s["remote_loaded_blocks"] == 5
    hit, k, wrong = load_checked(b, NS, 1, 5)  # now local: no remote call
    assert hit.tiers == [Tier.HOST] * 5 and k == 5 and wrong == 0
    assert b.remote.stats()["exists_calls"] == 1
    b.check_invariants(quiescent=True)
    # a local match is extended remotely: a stores 3 more blocks of a longer prompt
    tokens8, kv8 = prompt(1, 8)
    assert torch.equal(kv8[:5], kv) and a.store(NS, tokens8, kv8) == [Status.EXISTS] * 5 + [Status.OK] * 3
    assert a.remote.flush(5) and a.stats()["remote_published_blocks"] == 8
    hit, k, wrong = load_checked(b, NS, 1, 8)
    assert hit.tiers == [Tier.HOST] * 5 + [Tier.REMOTE] * 3 and k == 8 and wrong == 0
    b.check_invariants(quiescent=True)


def test_fill_without_host_tier_room_goes_to_the_destination_only(make_store):
    a, b = make_store(), make_store(host_blocks=1)
    tokens, kv = prompt(2, 3)
    a.store(NS, tokens, kv)
    assert a.remote.flush(5)
    mine, my_kv = prompt(99, 1)
    b.store(NS, mine, my_kv)
    with b.request() as rid:
        assert b.lookup(NS, mine, request_id=rid).matched_blocks == 1  # referenced: not a victim
        hit, k, wrong = load_checked(b, NS, 2, 3)
        assert k == 3 and wrong == 0 and len(b._index) == 1  # no room to fill: delivered, not kept
    assert b.remote.stats()["staged_gets"] == 3


def test_key_level_lookup_fills_only_with_a_namespace(make_store):
    a, b = make_store(), make_store()
    tokens, kv = prompt(3, 4)
    a.store(NS, tokens, kv)
    assert a.remote.flush(5)
    hit, k, wrong = load_checked(b, NS, 3, 4, key_level=True)
    assert k == 4 and wrong == 0 and len(b._index) == 0  # unknown namespace: stays remote
    hit, k, wrong = load_checked(b, NS, 3, 4, key_level="ns")
    assert k == 4 and wrong == 0 and len(b._index) == 4
    assert b.keys_of_namespace(b.digest(NS)) == hit.keys


def test_corrupt_remote_object_is_a_counted_miss_never_wrong_kv(make_store, cluster):
    a, b = make_store(), make_store()
    tokens, kv = prompt(4, 4)
    a.store(NS, tokens, kv)
    assert a.remote.flush(5)
    keys = a.keys_for(NS, tokens)
    name = ObjectNamer("default")(keys[2])
    raw = FakeStore(cluster)
    obj = bytearray(cluster.objects.pop(name))
    obj[-1] ^= 0x55
    assert raw.put(name, bytes(obj)) == 0  # a raw client overwrites block 2 with a flipped payload byte
    hit, k, wrong = load_checked(b, NS, 4, 4)
    assert hit.matched_blocks == 4 and k == 2 and wrong == 0
    s = b.stats()
    assert s["remote_load_errors"] == 1 and s["remote"]["corrupt_payload_crc"] == 1
    assert len(b._index) == 2  # blocks 0 and 1 were filled; not the corrupt one, nor block 3 behind the gap
    b.check_invariants(quiescent=True)


def test_hung_cluster_load_is_bounded_and_the_late_transfer_never_lands_in_a_live_slot(make_store, cluster):
    a, b = make_store(), make_store(host_blocks=4)
    tokens, kv = prompt(5, 2)
    a.store(NS, tokens, kv)
    assert a.remote.flush(5)
    hit = b.lookup(NS, tokens)
    assert hit.matched_blocks == 2
    cluster.hang.clear()  # the next Mooncake call blocks
    try:
        t0 = time.monotonic()
        st, _ = b.load(hit.keys)
        assert time.monotonic() - t0 < 3 and st == [Status.IO_ERROR] * 2
        assert b.remote.state == "degraded"
        # the fill's two host slots stay reserved while the late transfer may write them:
        # local stores get the other two slots only
        assert len(b._mover.remote.held) == 2 and b._index.in_flight() == 1
        t2, kv2 = prompt(6, 4)
        assert b.store(NS, t2, kv2) == [Status.OK] * 2 + [Status.NO_SPACE] * 2
    finally:
        cluster.hang.set()  # the late transfer returns (into the withheld slots), then the fill completes
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and b._index.in_flight():
        time.sleep(0.05)
    assert not b._mover.remote.held
    b.check_invariants(quiescent=True)
    assert load_checked(b, NS, 6, 2)[1:] == (2, 0)  # the stored blocks were never overwritten
    assert b.remote.wait_ok(5)
    assert load_checked(b, NS, 5, 2)[1:] == (2, 0)  # and the remote blocks load once the tier is back


def test_master_down_degrades_and_local_tiers_keep_serving(make_store, cluster):
    a = make_store()
    tokens, kv = prompt(7, 3)
    a.store(NS, tokens, kv)
    assert a.remote.flush(5)
    cluster.master_down = True
    t2, kv2 = prompt(8, 3)
    t0 = time.monotonic()
    assert a.store(NS, t2, kv2) == [Status.OK] * 3  # local store acknowledged; the publish may be dropped
    assert a.remote.flush(5)
    hit, k, wrong = load_checked(a, NS, 8, 3)
    assert k == 3 and wrong == 0 and set(hit.tiers) == {Tier.HOST}
    miss, k, _ = load_checked(a, NS, 9, 3)  # a local miss asks the remote tier: degraded, so 0 at once
    assert miss.matched_blocks == 0 and time.monotonic() - t0 < 5
    assert a.stats()["remote"]["state"] == "degraded"
    cluster.master_down = False
    assert a.remote.wait_ok(5) and a.stats()["remote"]["reconnects"] >= 1


def test_tenants_never_see_each_other_both_ways(make_store, cluster):
    x, y = Namespace(model="m@1", tenant="x"), Namespace(model="m@1", tenant="y")
    sx, sy = make_store(), make_store()
    tokens, kv = prompt(10, 4)
    other, kv_other = prompt(11, 4)
    assert sx.store(x, tokens, kv) == [Status.OK] * 4 and sy.store(y, other, kv_other) == [Status.OK] * 4
    assert sx.remote.flush(5) and sy.remote.flush(5)

    def probe(store, ns, toks):
        cluster.calls.clear()
        cluster.record = True
        hit = store.lookup(ns, toks)
        st, _ = store.load(hit.keys)
        cluster.record = False
        calls = [(c[0], len(c[1][0]) if c[1] and isinstance(c[1][0], tuple) else None) for c in cluster.calls]
        return hit.matched_blocks, st, calls

    never, _ = prompt(12, 4)
    fresh_x, fresh_y = make_store(), make_store()
    # y asks for x's tokens: the same calls and answers as for tokens nobody stored; and x for y's
    assert probe(fresh_y, y, tokens) == probe(fresh_y, y, never) == (0, [], [("batch_is_exist", 4)])
    assert probe(fresh_x, x, other) == probe(fresh_x, x, never) == (0, [], [("batch_is_exist", 4)])
    # each still gets its own
    assert load_checked(fresh_x, x, 10, 4)[1:] == (4, 0) and load_checked(fresh_y, y, 11, 4)[1:] == (4, 0)
    assert fresh_y.exists(sx.keys_for(x, tokens)) == 0  # exists() is local only: no remote signal at all


def test_publish_queue_full_drops_and_counts_and_never_blocks_the_store(make_store, cluster):
    a = make_store(publish_queue_blocks=2)
    cluster.hang.clear()
    try:
        tokens, kv = prompt(13, 8)
        t0 = time.monotonic()
        assert a.store(NS, tokens, kv) == [Status.OK] * 8
        assert time.monotonic() - t0 < 1.0
        s = a.stats()
        assert s["remote_publish_dropped"] >= 5 and s["remote"]["dropped_queue_full"] >= 5
    finally:
        cluster.hang.set()


def test_invalidated_namespace_is_never_served_from_the_remote_tier(make_store):
    a, b = make_store(), make_store()
    tokens, kv = prompt(14, 3)
    a.store(NS, tokens, kv)
    assert a.remote.flush(5)
    hit = b.lookup(NS, tokens)
    assert hit.matched_blocks == 3
    b.invalidate(NS)
    st, _ = b.load(hit.keys)
    assert st == [Status.MISS] * 3 and b.lookup(NS, tokens).matched_blocks == 0


def test_three_ways_to_configure(remote_cfg, tmp_path):
    y = tmp_path / "store.yaml"
    y.write_text(
        "layout: {num_layers: 2, num_kv_heads: 2, head_dim: 16, dtype: float16, tokens_per_block: 16}\n"
        "tiers: {host: {capacity_bytes: 1MiB}}\n"
        "remote: {engine: mooncake, master: '%s', metadata: P2PHANDSHAKE, segment_bytes: 0,"
        " protocol: tcp, timeout_s: 500ms}\n" % remote_cfg["master"]
    )
    with KVStore.from_config(StoreConfig.from_yaml(str(y))) as s:
        assert s.remote is not None and s.remote.config.timeout_s == 0.5 and s.remote.wait_ok(5)
    with KVStore(LAYOUT, host_bytes=1 << 20, remote=remote_cfg) as s:  # KVStore options
        assert s.remote.config.master == remote_cfg["master"]
    with pytest.raises(ConfigError, match="segment_byte"):
        KVStore(LAYOUT, host_bytes=1 << 20, remote={**remote_cfg, "segment_byte": 1})
    with pytest.raises(ConfigError, match="protocol"):
        KVStore(LAYOUT, host_bytes=1 << 20, remote={**remote_cfg, "protocol": "udp"})


def test_engine_extra_config_remote_section(remote_cfg):
    """An engine connector's extra-config dict (vLLM ``kv_connector_extra_config``) carries the
    same ``remote`` section; it is validated into the typed config the store is built from."""
    import pydantic

    from tierstore.integrations._common import split_extra_config

    class Own(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        tenant: str = "default"

    extra = {
        "tiers": {"host": {"capacity_bytes": "1MiB"}},
        "connector": {"tenant": "acme"},
        "remote": {
            "engine": "mooncake",
            "master": remote_cfg["master"],
            "metadata": "P2PHANDSHAKE",
            "segment_bytes": "0",
            "local_buffer_bytes": "1MiB",
            "protocol": "tcp",
            "timeout_s": "2s",
            "admission": "reused",
        },
    }
    cfg, own = split_extra_config(extra, "connector", Own, "kv_connector_extra_config")
    assert own.tenant == "acme" and cfg.remote.segment_bytes == 0 and cfg.remote.timeout_s == 2.0
    with KVStore.from_config(cfg, LAYOUT) as s:
        assert s.remote.wait_ok(5) and s._planner.share.mode == "reused"
    bad = dict(extra, remote={**extra["remote"], "rdma_device": "mlx5_0"})
    with pytest.raises(ConfigError, match="rdma_device"):
        split_extra_config(bad, "connector", Own, "kv_connector_extra_config")


def test_reused_admission_keeps_blocks_seen_once_local(make_store):
    a, b = make_store(admission="reused"), make_store()
    tokens, kv = prompt(15, 3)
    assert a.store(NS, tokens, kv) == [Status.OK] * 3
    assert a.remote.flush(5) and a.stats().get("remote_published_blocks", 0) == 0  # seen once: stays local
    assert b.lookup(NS, tokens).matched_blocks == 0
    assert load_checked(a, NS, 15, 3)[1:] == (3, 0)  # a local hit: now worth sharing
    assert a.remote.flush(5) and a.stats()["remote_published_blocks"] == 3
    assert load_checked(b, NS, 15, 3)[1:] == (3, 0)


def test_evict_publish_mode_is_a_victim_cache(make_store):
    """``publish: evict``: a stored block is not published; when it leaves A's host tier it is,
    before its slot is reused; then A gets it back from the shared tier, and so does B."""
    a, b = make_store(host_blocks=4, publish="evict"), make_store()
    tokens, kv = prompt(16, 4)
    assert a.store(NS, tokens, kv) == [Status.OK] * 4
    assert a.remote.flush(5) and a.remote.stats()["puts_offered"] == 0  # nothing shared yet
    more, kv_more = prompt(17, 4)
    assert a.store(NS, more, kv_more) == [Status.OK] * 4  # evicts the first prompt's 4 blocks
    assert a.remote.flush(5) and a.remote.stats()["published_blocks"] == 4
    assert a.remote.stats()["staged_puts"] == 4  # copied out of the slots, never published from them
    hit, k, wrong = load_checked(a, NS, 16, 4)
    assert hit.tiers == [Tier.REMOTE] * 4 and k == 4 and wrong == 0
    assert load_checked(b, NS, 16, 4)[1:] == (4, 0)
    a.check_invariants(quiescent=True)


def test_a_chain_split_remote_then_local_is_matched_whole(make_store):
    """LRU evicts a chain's first blocks first: with ``publish: evict`` they are remote while
    the later ones are still local; the lookup matches remote, then local again."""
    a = make_store(host_blocks=6, publish="evict")
    tokens, kv = prompt(18, 6)
    assert a.store(NS, tokens, kv) == [Status.OK] * 6
    other, kv_other = prompt(19, 3)
    assert a.store(NS, other, kv_other) == [Status.OK] * 3  # evicts blocks 0-2 of the first prompt
    assert a.remote.flush(5) and a.remote.stats()["published_blocks"] == 3
    hit, k, wrong = load_checked(a, NS, 18, 6)
    assert hit.tiers == [Tier.REMOTE] * 3 + [Tier.HOST] * 3, hit.tiers
    assert k == 6 and wrong == 0
    a.check_invariants(quiescent=True)
