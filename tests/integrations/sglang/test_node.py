"""The SGLang backend on the node service (issue 24 item 3): ``store: {url: unix://...}`` in the
extra config makes every server and rank on the node a client of one store; ranks stay apart; a
service that is stopped or killed gives misses within the client's timeout."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
import torch
import yaml

from tierstore.errors import ConfigError
from tierstore.integrations.sglang import HostPoolView
from tierstore.node.client import NodeKVStore
from tierstore.node.core import NodeCore
from tierstore.node.server import NodeServer
from tierstore.server.config import NodeConfig

from .harness import (
    backend,
    content,
    fill,
    holds,
    host_pool,
    indices,
    page_bytes_of,
    page_hashes,
    poison,
    poisoned,
    write_page,
)

pytestmark = pytest.mark.timeout(300)
MiB = 1 << 20
TOKEN = "sglang-test-token"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def node(url: str, timeout_s: float = 5.0) -> dict:
    """The extra config's one key that selects the node service's store."""
    return {"store": {"url": url, "timeout_s": timeout_s}}


@pytest.fixture
def service(tmp_path):
    """An in-process node service whose pool holds the harness's MHA pages (host and NVMe)."""
    layout = HostPoolView(host_pool("mha", "page_first")).layout
    core = NodeCore(
        f"sg{uuid.uuid4().hex[:8]}",
        {
            "tiers": {
                "host": {"capacity_bytes": 64 * layout.bytes_per_block},
                "nvme": {"path": str(tmp_path) + "/", "capacity_bytes": "8m", "segment_size_bytes": "256k"},
            }
        },
        layout,
        staging_blocks=16,
    )
    server = NodeServer(core, NodeConfig(socket=str(tmp_path / "node.sock"), lease_s=30)).start()
    yield core, "unix://" + server.path
    server.close()
    core.close()


def test_a_second_server_gets_the_pages_the_first_stored_byte_exact(service, caplog):
    core, url = service
    pool_a, pool_b = host_pool("mha", "page_first"), host_pool("mha", "page_first")
    with caplog.at_level(logging.INFO, logger="tierstore.integrations.sglang"):
        a, b = backend(pool_a, node(url)), backend(pool_b, node(url))
    try:
        assert isinstance(a.store, NodeKVStore) and isinstance(b.store, NodeKVStore)
        opened = [r.getMessage() for r in caplog.records if "tierstore opened" in r.getMessage()]
        assert len(opened) == 2 and all(f"node service at {url}, pool " in m for m in opened)
        keys = page_hashes(6, "shared")
        fill(pool_a, [1, 2, 3, 4, 5, 6], keys)
        assert a.batch_set_v1(keys, indices(pool_a, [1, 2, 3, 4, 5, 6])) == [True] * 6
        assert core.store.stats()["blocks"] == 6  # one copy on the node, not one per server
        dst = [10, 11, 12, 13, 14, 15]
        poison(pool_b, dst)
        assert b.batch_exists(keys) == 6
        assert b.batch_get_v1(keys, indices(pool_b, dst)) == [True] * 6
        assert all(holds(pool_b, g, k) for g, k in zip(dst, keys))
        # the copying path (interface_v1=0) reads the same blocks
        flat = b.batch_get(keys[:2], [pool_b.get_dummy_flat_data_page() for _ in range(2)])
        assert all(
            torch.equal(f.view(torch.uint8), content(k, page_bytes_of(pool_b))) for f, k in zip(flat, keys)
        )
        # B's own pages after A's chain extend it; A stores nothing twice
        more = page_hashes(8, "shared")
        fill(pool_b, [20, 21], more[6:])
        assert b.batch_set_v1(more[6:], indices(pool_b, [20, 21])) == [True, True]
        assert a.batch_exists(more) == 8 and core.store.stats()["blocks"] == 8
        assert not core.store.references()
        core.check_invariants(quiescent=True)
    finally:
        a.close()
        b.close()


def test_tp_ranks_on_one_service_never_get_each_others_pages(service):
    """The same page hashes on TP ranks 0 and 1 (each its own shard: other bytes) are other
    keys: each rank reads back its own bytes, and a TP=1 server shares with neither."""
    core, url = service
    pool0, pool1, solo = (host_pool("mha", "page_first") for _ in range(3))
    r0 = backend(pool0, node(url), tp_rank=0, tp_size=2)
    r1 = backend(pool1, node(url), tp_rank=1, tp_size=2)
    s = backend(solo, node(url))
    try:
        keys = page_hashes(4, "ranks")
        fill(pool0, [1, 2, 3, 4], keys)
        assert r0.batch_set_v1(keys, indices(pool0, [1, 2, 3, 4])) == [True] * 4
        assert r1.batch_exists(keys) == 0 and s.batch_exists(keys) == 0
        poison(pool1, [1, 2, 3, 4])
        assert r1.batch_get_v1(keys, indices(pool1, [1, 2, 3, 4])) == [False] * 4
        assert all(poisoned(pool1, g) for g in [1, 2, 3, 4])
        # rank 1 stores its shard under the same hashes: other bytes
        shard1 = [torch.full((page_bytes_of(pool1),), 17 + i, dtype=torch.uint8) for i in range(4)]
        for g, d in zip([1, 2, 3, 4], shard1):
            write_page(pool1, g, d)
        assert r1.batch_set_v1(keys, indices(pool1, [1, 2, 3, 4])) == [True] * 4
        assert core.store.stats()["blocks"] == 8
        poison(pool0, [8, 9, 10, 11])
        poison(pool1, [8, 9, 10, 11])
        assert r0.batch_get_v1(keys, indices(pool0, [8, 9, 10, 11])) == [True] * 4
        assert r1.batch_get_v1(keys, indices(pool1, [8, 9, 10, 11])) == [True] * 4
        assert all(holds(pool0, g, k) for g, k in zip([8, 9, 10, 11], keys))
        got1 = [pool1.get_data_page(g * pool1.page_size, flat=True).view(torch.uint8) for g in [8, 9, 10, 11]]
        assert all(torch.equal(x.reshape(-1), d) for x, d in zip(got1, shard1))
        # clear drops this rank's pages only
        assert r1.clear() is True
        assert r1.batch_exists(keys) == 0 and r0.batch_exists(keys) == 4
    finally:
        for b in (r0, r1, s):
            b.close()


def test_mla_pages_written_by_rank_0_are_read_by_rank_1_through_the_service(tmp_path):
    """SGLang writes replicated MLA pages from TP rank 0 only (``is_storage_writer``): with the
    node service every rank reads them, so MLA with tp_size > 1 is accepted there."""
    pool0, pool1 = host_pool("mla", "page_first"), host_pool("mla", "page_first")
    layout = HostPoolView(pool0).layout
    core = NodeCore(
        f"sg{uuid.uuid4().hex[:8]}",
        {"tiers": {"host": {"capacity_bytes": 32 * layout.bytes_per_block}}},
        layout,
    )
    with NodeServer(core, NodeConfig(socket=str(tmp_path / "mla.sock"))) as server:
        url = "unix://" + server.path
        r0 = backend(pool0, node(url), tp_rank=0, tp_size=2)
        r1 = backend(pool1, node(url), tp_rank=1, tp_size=2)
        try:
            keys = page_hashes(3, "mla")
            fill(pool0, [1, 2, 3], keys)
            assert r0.batch_set_v1(keys, indices(pool0, [1, 2, 3])) == [True] * 3
            poison(pool1, [5, 6, 7])
            assert r1.batch_get_v1(keys, indices(pool1, [5, 6, 7])) == [True] * 3
            assert all(holds(pool1, g, k) for g, k in zip([5, 6, 7], keys))
        finally:
            r0.close()
            r1.close()
    core.close()


def test_a_service_of_another_page_class_fails_the_start_up(service):
    _, url = service
    other = host_pool("mha", "page_first", page_size=8)  # 8-token pages; the service holds 4-token ones
    with pytest.raises(ConfigError, match="block class"):
        backend(other, node(url))


def _serve(cfg_path: str, sock: str, log: str) -> subprocess.Popen:
    """``tierstore serve --node`` in its own process, once its socket answers."""
    with open(log, "ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tierstore.cli", "serve", "--node", "--config", cfg_path],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=dict(os.environ, PYTHONPATH=ROOT),
            cwd=ROOT,
        )
    t_end = time.monotonic() + 60
    while time.monotonic() < t_end:
        assert proc.poll() is None, open(log).read()[-2000:]
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.connect(sock)
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise AssertionError("the node service did not start")


def _node_config(tmp_path, pool) -> str:
    """A node service config whose pool holds ``pool``'s pages (fp16 of the same bytes as bf16)."""
    cfg = {
        "state_dir": str(tmp_path / "state"),
        "layout": {
            "num_layers": int(pool.layer_num),
            "num_kv_heads": int(pool.head_num),
            "head_dim": int(pool.head_dim),
            "dtype": "fp16",
            "tokens_per_block": int(pool.page_size),
        },
        "tiers": {
            "host": {"capacity_bytes": 64 * page_bytes_of(pool)},
            "nvme": {
                "path": str(tmp_path / "node.nvme"),
                "capacity_bytes": "8MiB",
                "segment_size_bytes": "256KiB",
            },
        },
        "tenants": [{"name": "acme", "token_sha256": [hashlib.sha256(TOKEN.encode()).hexdigest()]}],
        "node": {"socket": str(tmp_path / "node.sock"), "staging_blocks": 16},
    }
    path = str(tmp_path / "node.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _wait_stopped(pid: int, wait_s: float = 10.0) -> None:
    """Until every thread of ``pid`` is in the stopped state (``T`` in ``/proc/<pid>/task/*/stat``)."""
    t_end = time.monotonic() + wait_s
    while time.monotonic() < t_end:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(FileNotFoundError):
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        if states and all(st == "T" for st in states):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} did not stop within {wait_s} s: {states}")


def _misses_within(b, pool, keys, timeout_s: float) -> float:
    """Every call of a server whose service is gone answers a miss; returns the seconds taken."""
    t0 = time.monotonic()
    poison(pool, [20, 21, 22])
    assert b.batch_exists(keys) == 0
    assert b.batch_get_v1(keys, indices(pool, [20, 21, 22])) == [False] * 3
    assert all(poisoned(pool, g) for g in [20, 21, 22])
    assert b.batch_get(keys[:1], [pool.get_dummy_flat_data_page()]) == [None]
    fill(pool, [23], page_hashes(1, "late"))
    assert b.batch_set_v1(page_hashes(1, "late"), indices(pool, [23])) == [False]
    assert b.clear() is False
    dt = time.monotonic() - t0
    assert dt < 6 * timeout_s + 1.0, f"{dt:.1f} s for six calls with a {timeout_s} s timeout"
    return dt


def test_a_stopped_or_killed_service_gives_misses_within_the_timeout(tmp_path, monkeypatch):
    """SIGSTOP (a hung service: each call waits at most ``timeout_s``), then kill -9 (calls
    answer at once), then a restart: the servers reconnect by themselves and find every page
    acknowledged before the kill (the service's puts are durable: written through to NVMe).
    The servers' sessions are the tenant of ``TIERSTORE_TOKEN``, as a deployment sets it."""
    monkeypatch.setenv("TIERSTORE_TOKEN", TOKEN)
    pool_a, pool_b = host_pool("mha", "page_first"), host_pool("mha", "page_first")
    cfg_path = _node_config(tmp_path, pool_a)
    sock, log = str(tmp_path / "node.sock"), str(tmp_path / "node.log")
    proc = _serve(cfg_path, sock, log)
    timeout_s = 1.0
    a = backend(pool_a, node("unix://" + sock, timeout_s))
    b = backend(pool_b, node("unix://" + sock, timeout_s))
    try:
        keys = page_hashes(3, "kill")
        fill(pool_a, [1, 2, 3], keys)
        assert a.batch_set_v1(keys, indices(pool_a, [1, 2, 3])) == [True] * 3
        assert b.batch_exists(keys) == 3
        os.kill(proc.pid, signal.SIGSTOP)
        _wait_stopped(proc.pid)  # kill() returns before every thread has stopped (seen on a busy host)
        _misses_within(b, pool_b, keys, timeout_s)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        time.sleep(0.6)  # past the client's retry interval: each call tries to connect again
        assert _misses_within(b, pool_b, keys, timeout_s) < 2.0  # a dead socket refuses at once
        proc = _serve(cfg_path, sock, log)
        t_end = time.monotonic() + 10
        while b.batch_exists(keys) < 3 and time.monotonic() < t_end:
            time.sleep(0.2)
        poison(pool_b, [5, 6, 7])
        assert b.batch_get_v1(keys, indices(pool_b, [5, 6, 7])) == [True] * 3
        assert all(holds(pool_b, g, k) for g, k in zip([5, 6, 7], keys))
    finally:
        a.close()
        b.close()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0


def test_a_server_starts_while_the_service_is_down_and_uses_it_once_it_is_up(tmp_path, caplog):
    pool = host_pool("mha", "page_first")
    sock = tmp_path / "late.sock"
    with caplog.at_level(logging.INFO, logger="tierstore.integrations.sglang"):
        b = backend(pool, node(f"unix://{sock}", 1.0))
    try:
        assert any("not answering (misses until it is up)" in r.getMessage() for r in caplog.records)
        keys = page_hashes(2, "late")
        fill(pool, [1, 2], keys)
        assert b.batch_set_v1(keys, indices(pool, [1, 2])) == [False, False]
        assert b.batch_exists(keys) == 0
        layout = HostPoolView(pool).layout
        core = NodeCore(
            f"sg{uuid.uuid4().hex[:8]}",
            {"tiers": {"host": {"capacity_bytes": 16 * layout.bytes_per_block}}},
            layout,
        )
        with NodeServer(core, NodeConfig(socket=str(sock))):
            t_end = time.monotonic() + 10
            while b.batch_set_v1(keys, indices(pool, [1, 2])) != [True, True]:
                assert time.monotonic() < t_end, "the backend never reconnected"
                time.sleep(0.2)
            poison(pool, [5, 6])
            assert b.batch_get_v1(keys, indices(pool, [5, 6])) == [True, True]
            assert holds(pool, 5, keys[0]) and holds(pool, 6, keys[1])
        core.close()
    finally:
        b.close()
