"""The pin quota (``limits.pin_quota_bytes``, the index's per-namespace cap on bytes its leases
hold) charges a block once however many leases of the namespace hold it: an overlapping pin (two
requests sharing a prefix) or a renewal (pin again, then unpin the old lease) holds no more
bytes, so it is not refused; the quota still refuses new bytes past it."""

from __future__ import annotations

import time
import uuid

import pytest
import torch

from tierstore.api import KVStore
from tierstore.errors import QuotaExceeded, Status
from tierstore.layout import KVLayout
from tierstore.node.client import NodeKVStore
from tierstore.node.core import NodeCore
from tierstore.node.server import NodeServer
from tierstore.server.config import NodeConfig

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float16, tokens_per_block=16)
BB = LAYOUT.bytes_per_block
NS, OTHER = b"q" * 32, b"o" * 32
TOKS = list(range(48))  # three blocks; the quota is two


def _blocks(n: int) -> torch.Tensor:
    return torch.arange(n * BB, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(n, BB)


def _overlapping_pins_and_a_renewal(store) -> None:
    assert store.store(NS, TOKS, _blocks(3)) == [Status.OK] * 3
    two = TOKS[:32]
    a = store.pin(NS, two, lease_s=60)
    b = store.pin(NS, two, lease_s=60)  # the same two blocks: nothing more is held
    assert len(a.keys) == len(b.keys) == 2
    c = store.pin(NS, TOKS[:16], lease_s=60)  # one of them again
    with pytest.raises(QuotaExceeded):
        store.pin(NS, TOKS, lease_s=60)  # the third block would be a third block's bytes
    assert store.unpin(a) and store.unpin(c)
    renewed = store.pin(NS, two, lease_s=120)  # renewal: pin again, then end the old lease
    assert store.unpin(b)
    with pytest.raises(QuotaExceeded):
        store.pin(NS, TOKS, lease_s=60)
    assert store.unpin(renewed)
    third = store.keys_for(NS, TOKS)[2:]
    assert len(store.pin_keys(NS, third, lease_s=60).keys) == 1  # every charge was returned:
    assert len(store.pin(NS, TOKS[:16], lease_s=60).keys) == 1  # two blocks fit again
    assert store.store(OTHER, TOKS, _blocks(3)) == [Status.OK] * 3
    assert len(store.pin(OTHER, two, lease_s=60).keys) == 2  # another namespace: its own quota


def test_an_embedded_store_charges_a_block_pinned_twice_once():
    s = KVStore(LAYOUT, hbm_bytes=0, host_bytes=8 * BB, pin_quota_bytes=2 * BB)
    try:
        _overlapping_pins_and_a_renewal(s)
        s.check_invariants()
    finally:
        s.close(flush=False)


def test_a_client_re_pinning_through_the_socket_is_charged_once(tmp_path):
    core = NodeCore(
        f"q{uuid.uuid4().hex[:8]}",
        {"tiers": {"host": {"capacity_bytes": 8 * BB}}, "policies": {"pin_quota_bytes": 2 * BB}},
        LAYOUT,
    )
    try:
        with NodeServer(core, NodeConfig(socket=str(tmp_path / "q.sock"))) as server:
            with NodeKVStore("unix://" + server.path, LAYOUT, timeout_s=5) as c:
                _overlapping_pins_and_a_renewal(c)
    finally:
        core.close()


def test_a_sessions_stats_count_only_its_live_leases(tmp_path):
    core = NodeCore(f"q{uuid.uuid4().hex[:8]}", {"tiers": {"host": {"capacity_bytes": 8 * BB}}}, LAYOUT)
    try:
        with NodeServer(core, NodeConfig(socket=str(tmp_path / "q.sock"))) as server:
            with NodeKVStore("unix://" + server.path, LAYOUT, timeout_s=5) as c:
                assert c.store(NS, TOKS, torch.zeros(3, BB, dtype=torch.uint8)) == [Status.OK] * 3
                short = c.pin(NS, TOKS[:16], lease_s=0.2)
                c.pin(NS, TOKS, lease_s=60)
                assert c.stats()["session"]["leases"] == 2
                time.sleep(0.3)  # the short lease ends by itself
                assert c.stats()["session"]["leases"] == 1  # as the store's own count says
                assert c.unpin(short) is False
    finally:
        core.close()
