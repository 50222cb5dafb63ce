"""A node pool (issue 24, N4): a KVStore over a shared segment's host slots, its tickets, and the
background thread that expires abandoned tickets and keeps victims clean."""

from __future__ import annotations

import threading
import time
import uuid

import numpy as np
import pytest
import torch

from tierstore.build import assemble
from tierstore.config import StoreConfig
from tierstore.contract import Tier
from tierstore.errors import ConfigError, Status, StoreClosedError
from tierstore.layout import KVLayout
from tierstore.node.core import NodeCore
from tierstore.tiers.memory import BlockPool

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16, tokens_per_block=16)
BB = LAYOUT.bytes_per_block
NS = b"m" * 32
RNG = np.random.default_rng(11)


def _cfg(tmp_path, host: int = 8, **policies) -> dict:
    return {
        "tiers": {
            "host": {"capacity_bytes": host * BB},
            "nvme": {"path": str(tmp_path) + "/", "capacity_bytes": "4m", "segment_size_bytes": "256k"},
        },
        "policies": policies,
    }


def _core(tmp_path, host: int = 8, policies=None, **kw) -> NodeCore:
    return NodeCore(
        f"p{uuid.uuid4().hex[:10]}", _cfg(tmp_path, host, **(policies or {})), LAYOUT, staging_blocks=4, **kw
    )


def _blocks(n):
    return [RNG.bytes(32) for _ in range(n)], [
        torch.from_numpy(RNG.integers(0, 256, BB, dtype=np.uint8)) for _ in range(n)
    ]


def put(core: NodeCore, keys, data, wait: bool = True):
    t = core.prepare_store(NS, keys, wait=wait)
    assert core.tickets.wait_ready(t.plan_id, 10)
    rows = core.segment.rows()
    for i, s in enumerate(t.slots):
        if s >= 0:
            rows[s, :BB].copy_(data[i])
    return core.complete_store(t.plan_id, [True] * len(keys))


def get(core: NodeCore, keys):
    t = core.prepare_load(keys, wait=True)
    rows = core.segment.rows()
    out = [rows[s, :BB].clone() if st is Status.OK else None for s, st in zip(t.slots, t.statuses)]
    same = core.segment.gens_of(np.maximum(t.slots, 0)) == t.gens
    return core.complete_load(t.plan_id, [o is not None and g for o, g in zip(out, same)]), out


def test_a_pool_stores_and_loads_through_tickets_and_its_store_sees_them(tmp_path):
    core = _core(tmp_path)
    keys, data = _blocks(3)
    res = put(core, keys, data)
    assert res.statuses == [Status.OK] * 3
    assert core.store.lookup_keys(keys).matched_blocks == 3 and core.store.exists(keys) == 3
    st, out = get(core, keys)
    assert st == [Status.OK] * 3 and all(torch.equal(o, d) for o, d in zip(out, data))
    node = core.stats()["node"]
    assert node["open_tickets"] == 0 and node["host_slots"] == 8 and node["staging_free"] == 4
    core.check_invariants(quiescent=True)
    thread = core._thread
    core.close()
    assert not thread.is_alive() and core.close() == 0
    with pytest.raises(StoreClosedError):
        core.prepare_load(keys)


def _dirty_victims_ready_at_once(tmp_path, clean_below: float) -> bool:
    tmp_path.mkdir()
    core = _core(tmp_path, clean_below=clean_below, tick_s=0.02)
    try:
        keys, data = _blocks(8)
        put(core, keys, data)
        end = time.monotonic() + 10
        while clean_below and time.monotonic() < end:  # the cleaner writes the coldest to NVMe
            core.store.drain()
            if sum(Tier.NVME in core.store.tiers_of(k) for k in keys) >= 8:
                break
            time.sleep(0.02)
        if not clean_below:
            time.sleep(0.2)  # ten ticks: the cleaner is off
        t = core.prepare_store(NS, _blocks(1)[0])
        ready = t.ready
        assert core.tickets.wait_ready(t.plan_id, 10)
        core.abort(t.plan_id)
        core.check_invariants(quiescent=True)
        return ready
    finally:
        core.close(flush=False)


def test_the_cleaner_keeps_victims_clean_so_store_tickets_are_ready_at_once(tmp_path):
    assert _dirty_victims_ready_at_once(tmp_path / "on", clean_below=0.5)
    assert not _dirty_victims_ready_at_once(tmp_path / "off", clean_below=0.0)


def test_an_abandoned_ticket_is_expired_by_the_background_thread(tmp_path):
    core = _core(tmp_path, lease_s=0.2, tick_s=0.02)
    try:
        keys, data = _blocks(2)
        t = core.prepare_store(NS, keys)
        core.segment.rows()[int(t.slots[0]), : BB // 2].copy_(data[0][: BB // 2])  # half a copy, then gone
        end = time.monotonic() + 10
        while core.tickets.open_tickets() and time.monotonic() < end:
            time.sleep(0.02)
        assert core.tickets.open_tickets() == 0
        assert core.store.exists(keys) == 0 and core.index.placement.alloc[Tier.HOST].used == 0
        assert core.index.metrics.counters["tickets_expired"] == 1
        assert core.complete_store(t.plan_id, [True, True]).statuses == [Status.IO_ERROR] * 2
        core.check_invariants(quiescent=True)
    finally:
        core.close()


@pytest.mark.parametrize("policy,flush", [("write_through", False), ("write_back", True)])
def test_acknowledged_blocks_survive_a_restart(tmp_path, policy, flush):
    core = _core(tmp_path, policies={"write_policy": policy})
    keys, data = _blocks(3)
    res = put(core, keys, data)
    assert res.statuses == [Status.OK] * 3
    assert res.durable == (frozenset(range(3)) if policy == "write_through" else frozenset())
    core.close(flush=flush)
    again = _core(tmp_path, policies={"write_policy": policy})
    try:
        st, out = get(again, keys)  # from NVMe, through staging slots
        assert st == [Status.OK] * 3 and all(torch.equal(o, d) for o, d in zip(out, data))
        again.check_invariants(quiescent=True)
    finally:
        again.close()


def test_close_aborts_the_open_tickets(tmp_path):
    core = _core(tmp_path)
    keys, data = _blocks(2)
    put(core, keys, data)
    t = core.prepare_load(keys)
    s = core.prepare_store(NS, _blocks(2)[0])
    core.close(flush=False)
    assert core.tickets.open_tickets() == 0
    assert core.complete_load(t.plan_id, [True, True]) == [Status.MISS] * 2
    assert core.complete_store(s.plan_id, [True, True]).statuses == [Status.IO_ERROR] * 2


def test_what_a_pool_refuses(tmp_path):
    cfg = _cfg(tmp_path)
    cfg["tiers"]["hbm"] = {"capacity_bytes": 4 * BB}
    with pytest.raises(ConfigError, match="no HBM tier"):
        NodeCore("x", cfg, LAYOUT)
    with pytest.raises(ConfigError, match="at least one"):
        NodeCore("x", _cfg(tmp_path, host=0), LAYOUT)
    with pytest.raises(ConfigError, match="clean_below"):
        NodeCore("x", _cfg(tmp_path), LAYOUT, clean_below=2)
    wrong = BlockPool.from_tensor("host", torch.zeros(7, BB, dtype=torch.uint8))
    with pytest.raises(ConfigError, match="host_pool of 7 blocks"):
        assemble(StoreConfig.from_dict(_cfg(tmp_path)), LAYOUT, host_pool=wrong)
    with pytest.raises(ConfigError, match="unknown run-time option"):  # after the segment was made
        NodeCore("refused-pool", _cfg(tmp_path), LAYOUT, bogus=1)
    with open("/proc/self/maps") as f:
        assert not [line for line in f if "memfd:tierstore-refused-pool " in line]  # unmapped again


def test_the_background_thread_does_not_outlive_close(tmp_path):
    before = {t.name for t in threading.enumerate()}
    core = _core(tmp_path, tick_s=0.01)
    assert any(t.name.startswith("tierstore-node-") for t in threading.enumerate())
    core.close()
    assert not [
        t for t in threading.enumerate() if t.name.startswith("tierstore-node-") and t.name not in before
    ]


def test_a_store_ticket_during_an_invalidation_of_its_namespace_is_refused_and_holds_nothing(tmp_path):
    """Between the index's invalidation and the NVMe tier's durable record a store of the
    namespace is refused (it would be acknowledged and then dropped); the ticket holds no slot."""
    core = _core(tmp_path)
    try:
        keys, data = _blocks(2)
        host_free = core.index.placement.alloc[Tier.HOST].free
        core.index.invalidate(NS)  # what Transfers.invalidate does before the durable record
        res = put(core, keys, data)
        assert res.statuses == [Status.REJECTED] * 2 and core.store.exists(keys) == 0
        assert core.index.placement.alloc[Tier.HOST].free == host_free
        core.index.end_invalidate(NS)
        assert put(core, keys, data).statuses == [Status.OK] * 2
        core.check_invariants(quiescent=True)
    finally:
        core.close()


def test_a_ticket_flag_wakes_every_waiter_once_and_honours_timeouts():
    """The tickets' one-shot :class:`~tierstore.node.tickets.Flag` (a lock in place of a
    ``threading.Event``): a wait times out while unset, every waiter wakes on ``set``, a
    repeated or racing ``set`` does nothing, and waits after it return at once."""
    from tierstore.node.tickets import Flag

    f = Flag()
    assert not f.is_set()
    t0 = time.monotonic()
    assert f.wait(0.05) is False
    assert time.monotonic() - t0 >= 0.04
    assert f.wait(0) is False
    woke: list[bool] = []
    waiters = [threading.Thread(target=lambda: woke.append(f.wait(10))) for _ in range(4)]
    for w in waiters:
        w.start()
    time.sleep(0.05)
    assert woke == []
    setters = [threading.Thread(target=f.set) for _ in range(3)]  # racing sets: one releases the lock
    for s in setters:
        s.start()
    for th in setters + waiters:
        th.join(10)
    assert woke == [True] * 4 and f.is_set()
    f.set()
    assert f.wait() and f.wait(0) and f.wait(1)
