"""The node client's reconnection under steady traffic: a call skipped inside the retry interval
does not start the interval again (else a client called more often than ``retry_s`` never
reconnects to a service that came back)."""

from __future__ import annotations

import time
import uuid

import torch

from tierstore.errors import Status
from tierstore.layout import KVLayout
from tierstore.node.client import NodeKVStore
from tierstore.node.core import NodeCore
from tierstore.node.server import NodeServer
from tierstore.server.config import NodeConfig

LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float16, tokens_per_block=16)
NS = b"r" * 32


def test_a_client_called_more_often_than_retry_s_reconnects_when_the_service_comes_up(tmp_path):
    sock = tmp_path / "late.sock"
    c = NodeKVStore(f"unix://{sock}", LAYOUT, timeout_s=1.0, retry_s=0.5)
    keys = c.keys_for(NS, list(range(32)))
    try:
        assert c.exists(keys) == 0  # nothing listens: a failed attempt
        core = NodeCore(f"r{uuid.uuid4().hex[:8]}", {"tiers": {"host": {"capacity_bytes": "64KiB"}}}, LAYOUT)
        with NodeServer(core, NodeConfig(socket=str(sock))):
            t_end = time.monotonic() + 5
            while c.exists(keys) == 0 and c.stats()["client"]["connects"] == 0:
                assert time.monotonic() < t_end, "calls every 0.1 s never let the client reconnect"
                time.sleep(0.1)  # steady traffic: a call every 0.1 s, retry_s 0.5 s
            data = torch.zeros(2, LAYOUT.bytes_per_block, dtype=torch.uint8)
            assert c.store(NS, list(range(32)), data) == [Status.OK] * 2
            assert c.exists(keys) == 2
        core.close()
    finally:
        c.close()
