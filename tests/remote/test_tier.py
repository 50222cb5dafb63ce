"""MooncakeTier logic against an in-memory Mooncake client (runs without the wheel).

The same scenarios run against a real ``mooncake_master`` in
test_mooncake_cluster.py; here the failure knobs are exact and fast.
"""

from __future__ import annotations

import builtins
import socket
import sys
import threading
import time

import pytest
import torch

from tierstore.errors import ConfigError, LayoutError, Status
from tierstore.remote import MooncakeTier, MooncakeTuning, RemoteConfig, parse_remote_options
from tierstore.remote.format import HEADER_BYTES, ObjectNamer
from tierstore.remote.mooncake import load_mooncake_store
from tierstore.schema import parse_model

from .fake_mooncake import FakeCluster, FakeStore

BB = 4096 + 100  # block bytes: not a multiple of the page size on purpose


def key(i: int, tag: bytes = b"k") -> bytes:
    return (tag + i.to_bytes(4, "little")).ljust(32, b"\0")


def block(i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, 256, (BB,), dtype=torch.uint8, generator=g)


@pytest.fixture
def make_tier(cluster, fake_master):
    tiers = []

    def _make(cl: FakeCluster | None = None, **kw) -> MooncakeTier:
        kw.setdefault("master", fake_master)
        kw.setdefault("metadata", "P2PHANDSHAKE")
        kw.setdefault("timeout_s", 0.5)
        kw.setdefault("publish_queue_blocks", 16)
        kw.setdefault("local_buffer_bytes", 8 * (BB + HEADER_BYTES))
        kw.setdefault("reconnect_backoff_s", (0.02, 0.1))
        kw.setdefault("set_env", False)
        c = cl or cluster
        config, tuning = parse_remote_options(kw)
        t = MooncakeTier(config, BB, tuning=tuning, store_factory=lambda: FakeStore(c))
        tiers.append(t)
        return t

    yield _make
    for t in tiers:
        t.close()


def publish(t: MooncakeTier, ids, tag=b"k") -> list[Status]:
    st = t.put([key(i, tag) for i in ids], [block(i) for i in ids])
    assert t.flush(5)
    return st


def test_put_then_get_round_trip_identical_bytes(make_tier):
    a, b = make_tier(), make_tier()
    assert publish(a, range(5)) == [Status.OK] * 5
    assert b.exists_prefix([key(i) for i in range(7)]) == 5
    dests = [torch.zeros(BB, dtype=torch.uint8) for _ in range(6)]
    st = b.get_into([key(i) for i in range(6)], dests)
    assert st == [Status.OK] * 5 + [Status.MISS]
    for i in range(5):
        assert torch.equal(dests[i], block(i))
    assert torch.count_nonzero(dests[5]) == 0  # a miss leaves its destination untouched
    s = b.stats()
    assert s["get_hits"] == 5 and s["get_misses"] == 1 and s["staged_gets"] == 5
    assert a.stats()["published_blocks"] == 5


def test_put_copies_the_block_before_returning(make_tier):
    t = make_tier()
    src = block(1).clone()
    assert t.put([key(1)], [src]) == [Status.OK]
    src.zero_()  # the caller reuses its memory at once
    assert t.flush(5)
    d = torch.zeros(BB, dtype=torch.uint8)
    assert t.get_into([key(1)], [d]) == [Status.OK]
    assert torch.equal(d, block(1))


def test_other_dtypes_and_shapes_of_the_same_size(make_tier):
    t = make_tier()
    src = block(3).view(torch.float32)[: BB // 4] if BB % 4 == 0 else None
    if src is None:  # BB is not a multiple of 4: use int8 of a 2-D shape
        src = block(3).view(torch.int8).reshape(2, BB // 2)
    assert t.put([key(3)], [src]) == [Status.OK]
    assert t.flush(5)
    d = torch.zeros(BB, dtype=torch.uint8)
    assert t.get_into([key(3)], [d]) == [Status.OK]
    assert torch.equal(d, block(3))


def test_duplicate_publish_is_exists(make_tier):
    t = make_tier()
    assert publish(t, [1]) == [Status.OK]
    assert t.put([key(1)], [block(1)]) == [Status.EXISTS]
    assert t.put([key(2), key(2)], [block(2), block(2)]) == [Status.OK, Status.EXISTS]
    assert t.stats()["puts_exists"] == 2


def test_full_queue_drops_and_counts(make_tier, cluster):
    t = make_tier(publish_queue_blocks=4)
    cluster.hang.clear()  # the publisher blocks in its first call
    try:
        st = t.put([key(i) for i in range(10)], [block(i) for i in range(10)])
        time.sleep(0.05)
        st2 = t.put([key(i) for i in range(10, 12)], [block(i) for i in range(10, 12)])
    finally:
        cluster.hang.set()
    assert st[:4] == [Status.OK] * 4
    assert st[4:] == [Status.REJECTED] * 6 and st2 == [Status.REJECTED] * 2
    s = t.stats()
    assert s["dropped_queue_full"] == 8 and s["puts_queued"] == 4


def test_layout_errors(make_tier):
    t = make_tier()
    with pytest.raises(LayoutError, match="bytes"):
        t.put([key(1)], [torch.zeros(BB - 1, dtype=torch.uint8)])
    with pytest.raises(LayoutError, match="keys"):
        t.put([b"short"], [block(1)])
    with pytest.raises(LayoutError):
        t.get_into([key(1), key(2)], [torch.zeros(BB, dtype=torch.uint8)])
    with pytest.raises(LayoutError, match="contiguous"):
        t.get_into([key(1)], [torch.zeros(2 * BB, dtype=torch.uint8)[::2]])


def test_settings_validation():
    """RemoteConfig holds every configured value and check; MooncakeTuning the other knobs."""

    def remote(**kw):
        return parse_model(RemoteConfig, kw, "remote")

    with pytest.raises(ConfigError, match="protocol"):
        remote(protocol="udp")
    with pytest.raises(ConfigError, match="timeout_s"):
        remote(timeout_s=0)
    with pytest.raises(ConfigError, match="master='h': host:port"):
        remote(master="h")
    with pytest.raises(ConfigError, match="metadata"):
        remote(metadata="")
    with pytest.raises(ConfigError, match="16 MiB"):  # Mooncake's setup would refuse it with -600
        remote(segment_bytes=1 << 20)
    with pytest.raises(ConfigError, match="reconnect_backoff_s"):
        MooncakeTuning(reconnect_backoff_s=(1.0, 0.5))
    with pytest.raises(ConfigError, match="call_threads"):
        MooncakeTuning(call_threads=0)
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['segment_size'\]"):
        parse_remote_options({"master": "h:1", "segment_size": 1})
    c, t = parse_remote_options(
        {
            "engine": "mooncake",
            "admission": "reused",
            "master": "h:1",
            "segment_bytes": "16MiB",
            "cluster": "c1",
            "reconnect_backoff_s": [0.5, 1],
        }
    )
    assert c.master == "h:1" and c.cluster == "c1" and c.segment_bytes == 16 << 20 and c.admission == "reused"
    assert t.reconnect_backoff_s == (0.5, 1) and t.call_threads == MooncakeTuning().call_threads
    # one set of defaults: the store's config is the tier's (publish_queue_blocks was 256 in a copy)
    assert RemoteConfig().publish_queue_blocks == 64


def test_mooncake_missing_is_a_config_error_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)
    monkeypatch.setitem(sys.modules, "mooncake.store", None)
    with pytest.raises(ConfigError, match=r"tierstore\[cluster\]") as e:
        load_mooncake_store()
    assert e.value.__cause__ is None and e.value.__suppress_context__
    with pytest.raises(ConfigError, match=r"pip install 'tierstore\[cluster\]'"):
        MooncakeTier(RemoteConfig(), BB, tuning=MooncakeTuning(set_env=False))


def test_native_load_failure_names_apt_packages(monkeypatch):
    real_import = builtins.__import__

    def fake_import(name, *a, **kw):
        if name == "mooncake.store":
            raise ImportError("libibverbs.so.1: cannot open shared object file")
        return real_import(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    with pytest.raises(ConfigError, match="libibverbs1"):
        load_mooncake_store()


def test_master_down_degrades_then_recovers(make_tier, cluster):
    t = make_tier()
    assert publish(t, [1]) == [Status.OK]
    cluster.master_down = True
    assert t.exists_prefix([key(1)]) == 0  # the call that sees -900
    assert t.state == "degraded"
    calls_before = len(cluster.calls)
    cluster.record = True
    assert t.put([key(2)], [block(2)]) == [Status.REJECTED]
    assert t.get_into([key(1)], [torch.zeros(BB, dtype=torch.uint8)]) == [Status.MISS]
    assert t.exists_prefix([key(1)]) == 0
    assert [c for c in cluster.calls[calls_before:] if c[0] != "batch_is_exist"] == []  # only probes
    s = t.stats()
    assert s["dropped_degraded"] == 1 and s["gets_degraded"] == 1 and s["rpc_failures"] >= 1
    assert "-900" in s["degraded_reason"]
    cluster.master_down = False
    assert t.wait_ok(5)
    assert t.stats()["reconnects"] == 1
    assert t.exists_prefix([key(1)]) == 1


def test_unreachable_master_is_not_set_up(make_tier, cluster):
    """``setup`` would hold the GIL while it retries: it is not called until the master answers."""
    cluster.record = True
    free = socket.socket()
    free.bind(("127.0.0.1", 0))
    port = free.getsockname()[1]
    free.close()  # nothing listens there now
    t0 = time.monotonic()
    t = make_tier(master=f"127.0.0.1:{port}")
    assert time.monotonic() - t0 < 2
    assert t.state == "degraded" and "unreachable" in t.stats()["degraded_reason"]
    assert [c for c in cluster.calls if c[0] == "setup"] == []
    lst = socket.socket()
    lst.bind(("127.0.0.1", port))
    lst.listen(4)
    try:
        assert t.wait_ok(5)  # the prober connects once the master answers
        assert [c[0] for c in cluster.calls if c[0] == "setup"] == ["setup"]
    finally:
        lst.close()


def test_setup_failure_starts_degraded_and_the_prober_connects(make_tier, cluster):
    cluster.setup_rc = -1
    t = make_tier()
    assert t.state == "degraded" and "setup" in t.stats()["degraded_reason"]
    assert t.put([key(1)], [block(1)]) == [Status.REJECTED]
    cluster.setup_rc = 0
    assert t.wait_ok(5)
    assert publish(t, [1]) == [Status.OK]


def test_hung_call_times_out_never_hangs_and_quarantines_its_slots(make_tier, cluster):
    t = make_tier(timeout_s=0.3)
    assert publish(t, [1]) == [Status.OK]
    free0 = t.stats()["get_slots_free"]
    cluster.hang.clear()
    try:
        t0 = time.monotonic()
        st = t.get_into([key(1)], [torch.zeros(BB, dtype=torch.uint8)])
        assert time.monotonic() - t0 < 1.5
        assert st == [Status.IO_ERROR]
        s = t.stats()
        assert s["state"] == "degraded" and s["timeouts"] == 1
        assert s["get_slots_free"] == free0 - 1  # the hung call may still write its slot
        t0 = time.monotonic()  # every call returns at once while degraded
        assert t.exists_prefix([key(1)]) == 0
        assert t.put([key(5)], [block(5)]) == [Status.REJECTED]
        assert time.monotonic() - t0 < 0.2
        time.sleep(0.3)
        assert t.state == "degraded"  # no recovery while the call is still out
    finally:
        cluster.hang.set()
    assert t.wait_ok(5)
    assert t.stats()["get_slots_free"] == free0
    d = torch.zeros(BB, dtype=torch.uint8)
    assert t.get_into([key(1)], [d]) == [Status.OK] and torch.equal(d, block(1))


def test_zero_copy_into_registered_memory(make_tier, cluster):
    t = make_tier(timeout_s=0.3)
    pool = torch.zeros(4 * BB, dtype=torch.uint8)
    events = []
    t.register_memory(
        pool, lambda off, n: events.append(("q", off, n)), lambda off, n: events.append(("r", off, n))
    )
    assert publish(t, [1, 2]) == [Status.OK] * 2
    dests = [pool[BB : 2 * BB], pool[3 * BB : 4 * BB]]
    assert t.get_into([key(1), key(2)], dests) == [Status.OK] * 2
    assert torch.equal(dests[0], block(1)) and torch.equal(dests[1], block(2))
    assert t.stats()["zero_copy_gets"] == 2 and t.stats()["staged_gets"] == 0
    # a hung zero-copy load: the owner hears which memory is withheld, and when it is free again
    cluster.hang.clear()
    try:
        assert t.get_into([key(1)], [pool[2 * BB : 3 * BB]]) == [Status.IO_ERROR]
        assert events == [("q", 2 * BB, BB)]
    finally:
        cluster.hang.set()
    assert t.wait_ok(5)
    assert events == [("q", 2 * BB, BB), ("r", 2 * BB, BB)]


def test_zero_copy_publish_from_registered_memory(make_tier, cluster):
    t = make_tier(publish_queue_blocks=2)
    pool = torch.zeros(4 * BB, dtype=torch.uint8)
    events = []
    t.register_memory(
        pool,
        lambda off, n: events.append(("hold", off, n)),
        lambda off, n: events.append(("release", off, n)),
    )
    for i in range(3):
        pool[i * BB : (i + 1) * BB] = block(i)
    cluster.hang.clear()  # hold the publisher: the queue bound applies to zero-copy publishes too
    try:
        st = t.put([key(i) for i in range(3)], [pool[i * BB : (i + 1) * BB] for i in range(3)])
        assert st == [Status.OK, Status.OK, Status.REJECTED]
        assert events == [("hold", 0, BB), ("hold", BB, BB)]  # the owner must keep these bytes
    finally:
        cluster.hang.set()
    assert t.flush(5)
    assert sorted(events) == sorted(
        [("hold", 0, BB), ("hold", BB, BB), ("release", 0, BB), ("release", BB, BB)]
    )
    s = t.stats()
    assert s["zero_copy_puts"] == 2 and s["staged_puts"] == 0 and s["dropped_queue_full"] == 1
    d = torch.zeros(BB, dtype=torch.uint8)
    for i in range(2):
        assert t.get_into([key(i)], [d]) == [Status.OK] and torch.equal(d, block(i))


def test_zero_copy_publish_of_bytes_changed_too_early_is_a_miss(make_tier, cluster):
    """An owner that breaks the hold (rewrites the block before it is sent) costs a miss, not wrong KV."""
    t = make_tier()
    pool = torch.zeros(2 * BB, dtype=torch.uint8)
    t.register_memory(pool, lambda off, n: None, lambda off, n: None)
    pool[:BB] = block(1)
    cluster.hang.clear()
    try:
        assert t.put([key(1)], [pool[:BB]]) == [Status.OK]  # CRC taken now
        pool[:BB] = block(2)  # too early
    finally:
        cluster.hang.set()
    assert t.flush(5)
    d = torch.zeros(BB, dtype=torch.uint8)
    assert t.get_into([key(1)], [d]) == [Status.IO_ERROR]
    assert t.stats()["corrupt_payload_crc"] == 1 and torch.count_nonzero(d) == 0


def corrupt_cases(name: str, good: bytes):
    bad_magic = bytearray(good)
    bad_magic[0] ^= 1
    bad_payload = bytearray(good)
    bad_payload[-1] ^= 1
    return {
        "magic": bytes(bad_magic),
        "payload_crc": bytes(bad_payload),
        "size": good[:-10],
        "garbage": b"\xff" * len(good),
        "larger": good + b"x",
    }


@pytest.mark.parametrize(
    "case,reason",
    [
        ("magic", "magic"),
        ("payload_crc", "payload_crc"),
        ("size", "size"),
        ("garbage", "magic"),
        ("larger", "size"),
    ],
)
def test_corrupt_object_is_a_counted_miss_and_is_removed(make_tier, cluster, case, reason):
    t = make_tier()
    assert publish(t, [1]) == [Status.OK]
    name = ObjectNamer("default")(key(1))
    good = cluster.objects.pop(name)
    FakeStore(cluster).put(name, corrupt_cases(name, good)[case])
    d = torch.zeros(BB, dtype=torch.uint8)
    assert t.get_into([key(1)], [d]) == [Status.IO_ERROR]
    assert torch.count_nonzero(d) == 0  # nothing written from a rejected object
    s = t.stats()
    assert s["corrupt_objects"] == 1 and s[f"corrupt_{reason}"] == 1
    if case != "larger":  # a too-large object is refused by Mooncake itself (-600): not read, not removed
        deadline = time.monotonic() + 5  # the tier counts a removal after the call returns: wait for both
        while (name in cluster.objects or t.stats()["removals_ok"] < 1) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert name not in cluster.objects
        s = t.stats()
        assert s["removal_lease_retries"] >= 1  # the read lease refused the first remove (-706)
        assert s["removals_ok"] == 1


def test_object_of_another_key_is_a_miss(make_tier, cluster):
    """A valid object copied under another name (a misdirected write) fails the key check."""
    t = make_tier()
    assert publish(t, [1]) == [Status.OK]
    namer = ObjectNamer("default")
    FakeStore(cluster).put(namer(key(2)), cluster.objects[namer(key(1))])
    assert t.get_into([key(2)], [torch.zeros(BB, dtype=torch.uint8)]) == [Status.IO_ERROR]
    assert t.stats()["corrupt_key"] == 1


def test_dead_segment_is_io_error_not_degraded(make_tier, cluster):
    t = make_tier()
    assert publish(t, [1]) == [Status.OK]
    cluster.dead = True
    assert t.get_into([key(1)], [torch.zeros(BB, dtype=torch.uint8)]) == [Status.IO_ERROR]
    assert t.state == "ok" and t.stats()["errors"] == {-800: 1}
    cluster.dead = False
    assert t.get_into([key(1)], [torch.zeros(BB, dtype=torch.uint8)]) == [Status.OK]


def test_cluster_full_is_counted(make_tier):
    small = FakeCluster(capacity_bytes=3 * (BB + HEADER_BYTES))
    t = make_tier(small)
    assert publish(t, range(5)) == [Status.OK] * 5  # queued: publication fails later
    s = t.stats()
    assert s["published_blocks"] == 3 and s["put_no_space"] == 2  # sent again twice each, then dropped
    assert s["put_no_space_retries"] == 4 and s["publish_slots_free"] == 16 and s["queued_blocks"] == 0


def test_a_publish_refused_for_space_is_sent_again_after_eviction(make_tier):
    small = FakeCluster(capacity_bytes=3 * (BB + HEADER_BYTES))
    t = make_tier(small)
    assert publish(t, range(3)) == [Status.OK] * 3
    assert t.put([key(i) for i in range(3, 5)], [block(i) for i in range(3, 5)]) == [Status.OK] * 2
    deadline = time.monotonic() + 5  # the first attempt is refused: the cluster is full
    while t.stats()["put_no_space_retries"] < 2 and time.monotonic() < deadline:
        time.sleep(0.002)
    with small.lock:  # the master evicts (Mooncake does so when a put is refused)
        for name in list(small.objects)[:2]:
            del small.objects[name]
    assert t.flush(5)
    s = t.stats()
    assert s["published_blocks"] == 5 and s["put_no_space"] == 0 and s["put_no_space_retries"] >= 2
    d = torch.zeros(BB, dtype=torch.uint8)
    assert t.get_into([key(4)], [d]) == [Status.OK] and torch.equal(d, block(4))


def test_exists_prefix_stops_at_first_gap(make_tier):
    t = make_tier()
    publish(t, [0, 1, 3])
    assert t.exists_prefix([key(0), key(1), key(2), key(3)]) == 2
    assert t.exists_prefix([]) == 0
    assert t.contains(key(3)) and not t.contains(key(2))


def test_tenant_scoped_keys_leave_no_trace_across_tenants(make_tier, cluster):
    """Tenant B's lookups of tokens tenant A stored make the same calls, with the
    same answers, as lookups of tokens nobody stored."""
    from tierstore.identity import Namespace, block_hashes

    a_ns = Namespace(model="m", tenant="A").digest()
    b_ns = Namespace(model="m", tenant="B").digest()
    stored, fresh = list(range(64)), list(range(1000, 1064))
    a_keys = block_hashes(a_ns, stored, 16)
    ta, tb = make_tier(), make_tier()
    ta.put(a_keys, [block(i) for i in range(len(a_keys))])
    assert ta.flush(5) and ta.exists_prefix(a_keys) == 4

    def trace(tokens):
        cluster.calls.clear()
        cluster.record = True
        keys = block_hashes(b_ns, tokens, 16)
        n = tb.exists_prefix(keys)
        st = tb.get_into(keys, [torch.zeros(BB, dtype=torch.uint8) for _ in keys])
        cluster.record = False
        shape = [(c[0], len(c[1][0]) if c[1] and isinstance(c[1][0], tuple) else None) for c in cluster.calls]
        return n, st, shape

    assert (
        trace(stored)
        == trace(fresh)
        == (0, [Status.MISS] * 4, [("batch_is_exist", 4), ("batch_get_into", 4)])
    )


def test_close_is_bounded_with_a_hung_cluster_and_idempotent(make_tier, cluster):
    t = make_tier(timeout_s=0.3)
    publish(t, [1])
    cluster.hang.clear()
    try:
        t.put([key(i) for i in range(2, 6)], [block(i) for i in range(2, 6)])
        t0 = time.monotonic()
        t.close()
        t.close()
        assert time.monotonic() - t0 < 3
        assert t.state == "closed"
        assert t.put([key(9)], [block(9)]) == [Status.REJECTED]
        assert t.get_into([key(1)], [torch.zeros(BB, dtype=torch.uint8)]) == [Status.MISS]
    finally:
        cluster.hang.set()


def test_concurrent_threads_never_see_wrong_bytes(make_tier):
    a, b = make_tier(publish_queue_blocks=8), make_tier(publish_queue_blocks=8)
    errors = []
    stop = time.monotonic() + 1.5

    def worker(t: MooncakeTier, seed: int):
        g = torch.Generator().manual_seed(seed)
        d = torch.zeros(BB, dtype=torch.uint8)
        while time.monotonic() < stop:
            i = int(torch.randint(0, 24, (1,), generator=g))
            op = int(torch.randint(0, 3, (1,), generator=g))
            if op == 0:
                t.put([key(i)], [block(i)])
            elif op == 1:
                t.exists_prefix([key(i), key(i + 1)])
            elif t.get_into([key(i)], [d]) == [Status.OK] and not torch.equal(d, block(i)):
                errors.append(i)

    ths = [threading.Thread(target=worker, args=(t, s)) for s, t in enumerate([a, a, b, b])]
    for th in ths:
        th.start()
    for th in ths:
        th.join()
    assert errors == []
    assert a.stats()["get_hits"] + b.stats()["get_hits"] > 0
