"""The node service and its client (issue 24, N5-N6): engine processes share one store through a
UNIX socket and a shared segment; dead clients leak nothing; a dead service gives misses."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import socket
import stat
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest
import torch
import yaml

from tierstore.contract import Tier
from tierstore.errors import ConfigError, LayoutError, Status
from tierstore.layout import KVLayout
from tierstore.node import protocol as P
from tierstore.node.client import NodeKVStore
from tierstore.node.core import NodeCore
from tierstore.node.server import NodeServer, NodeServiceError, claim_socket_path
from tierstore.server.config import NodeConfig

from ..server.conftest import ROOT, TOKENS, Daemon, make_config

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16, tokens_per_block=16)
BB = LAYOUT.bytes_per_block
NS = b"n" * 32
SPAWN = multiprocessing.get_context("spawn")


def _tokens(base: int, n_blocks: int) -> list[int]:
    return list(range(base, base + n_blocks * LAYOUT.tokens_per_block))


def _data(seed: int, n: int, bb: int = BB) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, bb), dtype=np.uint8))


def _sha(rows) -> list[str]:
    return [hashlib.sha256(r.reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest() for r in rows]


@pytest.fixture
def service(tmp_path):
    core = NodeCore(
        f"t{uuid.uuid4().hex[:8]}",
        {
            "tiers": {
                "host": {"capacity_bytes": 8 * BB},
                "nvme": {"path": str(tmp_path) + "/", "capacity_bytes": "4m", "segment_size_bytes": "256k"},
            }
        },
        LAYOUT,
        staging_blocks=4,
        quarantine_expired=True,
    )
    server = NodeServer(core, NodeConfig(socket=str(tmp_path / "node.sock"), lease_s=30)).start()
    yield core, server, "unix://" + server.path
    server.close()
    core.close()


# -- child processes (spawned: they import this module) -----------------------------------------


def child_store(url: str, seed: int, base: int, n: int) -> list[str]:
    with NodeKVStore(url, LAYOUT, timeout_s=10) as c:
        return [s.value for s in c.store(NS, _tokens(base, n), _data(seed, n))]


def child_lookup_load(url: str, base: int, n: int) -> tuple[int, list[str]]:
    with NodeKVStore(url, LAYOUT, timeout_s=10) as c:
        hit = c.lookup(NS, _tokens(base, n))
        st, out = c.load(hit)
        return hit.matched_blocks, [
            h if s is Status.OK else ""
            for s, h in zip(st, _sha(o if o is not None else torch.zeros(1) for o in out))
        ]


def child_hang_mid_store(url: str, base: int, ready) -> None:
    """Take what a client can hold (a store ticket with slots, a lookup's references, a pin),
    write half of the slots, then wait to be killed."""
    c = NodeKVStore(url, LAYOUT, timeout_s=10)
    with c._lock:
        keys = c.keys_for(NS, _tokens(base + 10_000, 4))
        t = c._call(
            lambda rid: P.PrepareStore(
                rid, ns=c.digest(NS), keys=P.pack_keys(keys), first_position=0, lifetime=0, wait=True
            )
        )
        rows = c._conn.rows
        for s in P.unpack_slots(t.slots)[:2]:
            rows[int(s)].fill_(0xEE)
    c.lookup(NS, _tokens(base, 2), request_id="held")
    c.pin(NS, _tokens(base, 2), lease_s=600)
    ready.set()
    time.sleep(600)


def _run(fn, *args):
    with SPAWN.Pool(1) as pool:
        return pool.apply(fn, args)


# -- tests ---------------------------------------------------------------------------------------


def test_a_block_stored_by_one_process_is_loaded_byte_exact_by_another(service):
    core, _, url = service
    assert _run(child_store, url, 7, 0, 5) == ["ok"] * 5
    matched, shas = _run(child_lookup_load, url, 0, 5)
    assert matched == 5 and shas == _sha(_data(7, 5))
    # the pool's own store sees the same keys the clients computed (one key scheme)
    with NodeKVStore(url, LAYOUT) as c:
        keys = c.keys_for(NS, _tokens(0, 5))
        assert core.store.exists(keys) == 5 and c.exists(keys) == 5 and c.probe(NS, _tokens(0, 5)) == 80
        # past the host tier: the rest goes through NVMe and staging slots, still byte-exact
        assert c.store(NS, _tokens(500, 12), _data(8, 12)) == [Status.OK] * 12
        core.store.evict(Tier.HOST, 8)  # host slots free: a prefetch may take them
        on_nvme = [
            k for k in c.keys_for(NS, _tokens(500, 12)) if core.store.block_info(k)["tiers"] == [Tier.NVME]
        ]
        assert on_nvme
        # a prefetch brings NVMe blocks up to the service's host tier; the future resolves to how many
        up = c.prefetch(NS, _tokens(500, 12)).result(timeout=10)
        assert up >= 1 and up == sum(Tier.HOST in core.store.block_info(k)["tiers"] for k in on_nvme)
        with pytest.raises(ConfigError):
            c.prefetch(NS, _tokens(500, 12), tier="disk")
        hit = c.lookup(NS, _tokens(500, 12))
        st, out = c.load(hit)
        assert st == [Status.OK] * 12 and _sha(out) == _sha(_data(8, 12))
    core.check_invariants(quiescent=True)


def test_fragments_references_pins_and_invalidation_through_the_service(service):
    core, server, url = service
    with NodeKVStore(url, LAYOUT) as c:
        pages = torch.zeros(
            LAYOUT.num_layers,
            2,
            4,
            LAYOUT.tokens_per_block,
            LAYOUT.num_kv_heads,
            LAYOUT.head_dim,
            dtype=LAYOUT.dtype,
        )
        pages.view(torch.uint8).copy_(
            torch.from_numpy(
                np.random.default_rng(3).integers(0, 256, pages.view(torch.uint8).shape, dtype=np.uint8)
            )
        )
        frags = [
            [pages[layer, kv, b] for layer in range(LAYOUT.num_layers) for kv in range(2)] for b in range(3)
        ]
        assert c.store_fragments(NS, _tokens(0, 3), frags) == [Status.OK] * 3
        back = torch.zeros_like(pages)
        dst = [
            [back[layer, kv, b] for layer in range(LAYOUT.num_layers) for kv in range(2)] for b in range(3)
        ]
        with c.request() as rid:
            hit = c.lookup(NS, _tokens(0, 3), request_id=rid)
            assert sum(core.store.references().values()) == 3
            assert c.load_fragments(hit, dst) == [Status.OK] * 3
        assert core.store.references() == {}
        assert torch.equal(
            back.view(torch.uint8)[:, :, :3], pages.view(torch.uint8)[:, :, :3]
        )  # bytes: NaNs too
        lease = c.pin(NS, _tokens(0, 3), lease_s=60)
        assert len(lease.keys) == 3 and core.store.leases() and c.unpin(lease) and not core.store.leases()
        assert c.invalidate(NS) == 3 and c.lookup(NS, _tokens(0, 3)).matched_blocks == 0
        assert c.stats()["session"]["open_tickets"] == 0
    core.check_invariants(quiescent=True)


def test_kill9_of_a_client_mid_store_leaks_nothing(service):
    core, server, url = service
    with NodeKVStore(url, LAYOUT) as c:
        assert c.store(NS, _tokens(0, 2), _data(1, 2)) == [Status.OK] * 2
    host = core.index.placement.alloc[Tier.HOST]
    free0, staging0 = host.free, core.tickets.staging.free
    ready = SPAWN.Event()
    p = SPAWN.Process(target=child_hang_mid_store, args=(url, 0, ready))
    p.start()
    try:
        assert ready.wait(60)
        assert core.tickets.open_tickets() == 1 and host.free < free0
        assert core.store.references() and core.store.leases()
        held = core.stats()["node"]  # what the node soak's leak check reads through Stats
        assert held["references"] == 2 and held["leases"] == 1 and held["host_free"] == host.free
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.join()
    t_end = time.monotonic() + 10  # the session ends at EOF; the pidfd says the peer is gone
    while time.monotonic() < t_end and (server.sessions() or core.tickets.open_tickets()):
        time.sleep(0.05)
    assert server.sessions() == 0 and core.tickets.open_tickets() == 0
    core.check_invariants(quiescent=True)
    assert host.free == free0 and core.tickets.staging.free == staging0
    assert core.store.references() == {} and core.store.leases() == {}
    held = core.stats()["node"]
    assert held["references"] == 0 and held["leases"] == 0 and held["host_free"] == free0
    with NodeKVStore(url, LAYOUT) as c:  # the blocks stored before are intact
        st, out = c.load(c.lookup(NS, _tokens(0, 2)))
        assert st == [Status.OK] * 2 and _sha(out) == _sha(_data(1, 2))


def test_a_connection_closed_without_bye_quarantines_its_store_slots_until_the_process_exits(
    service, monkeypatch
):
    core, server, url = service
    import tierstore.node.server as srv

    monkeypatch.setattr(srv, "_EXIT_GRACE_S", 0.2)
    host = core.index.placement.alloc[Tier.HOST]
    free0 = host.free
    server.cfg = server.cfg.model_copy(update={"lease_s": 5.0})
    c = NodeKVStore(url, LAYOUT)
    with c._lock:
        keys = c.keys_for(NS, _tokens(0, 3))
        c._call(
            lambda rid: P.PrepareStore(
                rid, ns=c.digest(NS), keys=P.pack_keys(keys), first_position=0, lifetime=0, wait=True
            )
        )
        c._conn.frames.close()  # this process lives on: it might still write into the slots
    t_end = time.monotonic() + 4  # the service sees the end, waits 0.2 s for an exit, then quarantines
    while time.monotonic() < t_end and not core.tickets.quarantined_slots():
        time.sleep(0.02)
    assert core.tickets.quarantined_slots() == 3 and host.free == free0 - 3
    t_end = time.monotonic() + 15
    while time.monotonic() < t_end and core.tickets.open_tickets():
        time.sleep(0.05)
    core.check_invariants(quiescent=True)
    assert host.free == free0
    c.close()


def _write_config(tmp_path) -> str:
    cfg = make_config(
        str(tmp_path), node={"socket": str(tmp_path / "node.sock"), "staging_blocks": 24, "tenant": "acme"}
    )
    cfg["layout"] = {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 32,
        "dtype": "fp16",
        "tokens_per_block": 16,
    }
    cfg["tiers"]["host"] = {"capacity_bytes": 8 * BB}
    path = str(tmp_path / "daemon.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def _start_service(cfg_path: str, sock: str, log: str) -> subprocess.Popen:
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


def test_kill9_of_the_service_gives_misses_in_time_and_a_restart_recovers_every_acknowledged_block(tmp_path):
    cfg_path = _write_config(tmp_path)
    sock, log = str(tmp_path / "node.sock"), str(tmp_path / "node.log")
    proc = _start_service(cfg_path, sock, log)
    c = NodeKVStore("unix://" + sock, LAYOUT, timeout_s=2.0, retry_s=0.2)
    try:
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o600
        data = _data(5, 20)
        assert c.store(NS, _tokens(0, 20), data) == [Status.OK] * 20  # puts.durable: write-through
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        assert c.lookup(NS, _tokens(0, 20)).matched_blocks == 0
        st, _ = c.load(c.keys_for(NS, _tokens(0, 20)))
        assert st == [Status.MISS] * 20
        assert c.store(NS, _tokens(900, 2), _data(6, 2)) == [Status.REJECTED] * 2
        assert c.exists(c.keys_for(NS, _tokens(0, 20))) == 0
        assert time.monotonic() - t0 < 2.0 * 4
        proc = _start_service(cfg_path, sock, log)  # the stale socket file is replaced
        t_end = time.monotonic() + 10
        hit = c.lookup(NS, _tokens(0, 20))
        while hit.matched_blocks < 20 and time.monotonic() < t_end:
            time.sleep(0.2)
            hit = c.lookup(NS, _tokens(0, 20))
        assert hit.matched_blocks == 20 and c.stats()["client"]["connects"] == 2
        st, out = c.load(hit)
        assert st == [Status.OK] * 20 and _sha(out) == _sha(data)
    finally:
        c.close()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


def test_malformed_frames_get_an_error_reply_and_the_service_goes_on(service):
    core, server, url = service
    for raw in (
        b"\x05\x00\x00\x00hello",
        b"\x00\x00\x00\x00",
        b"\xff\xff\xff\x7f",
        b"\x03\x00\x00\x00\x93\x01\x02",
    ):
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(5)
            s.connect(server.path)
            s.sendall(raw)
            fs = P.FrameSocket(s, P.REPLY_DECODER)
            reply = fs.recv()
            assert isinstance(reply, P.Error) and reply.code is P.ErrorCode.BAD_FRAME
            assert fs.recv() is None  # then the service closes
    with socket.socket(socket.AF_UNIX) as s:  # a request before Hello: an error, the connection stays
        s.settimeout(5)
        s.connect(server.path)
        fs = P.FrameSocket(s, P.REPLY_DECODER)
        fs.send(P.Exists(4, ns=NS, keys=b"k" * 32))
        reply = fs.recv()
        assert isinstance(reply, P.Error) and reply.code is P.ErrorCode.BAD_REQUEST and reply.rid == 4
        fs.send(P.Poll(5))
        assert fs.recv().rid == 5
    assert core.index.metrics.snapshot().get("node_bad_frames", 0) == 4
    with NodeKVStore(url, LAYOUT) as c:
        assert c.store(NS, _tokens(0, 1), _data(2, 1)) == [Status.OK]
    core.check_invariants(quiescent=True)


def test_a_client_of_another_block_class_is_refused_and_a_dead_path_gives_misses(service, tmp_path):
    _, _, url = service
    other = KVLayout(num_layers=1, num_kv_heads=2, head_dim=32, dtype=torch.float16, tokens_per_block=16)
    with NodeKVStore(url, other) as c, pytest.raises(ConfigError, match="block class"):
        c.lookup(NS, _tokens(0, 1))
    with NodeKVStore("unix://" + str(tmp_path / "nobody.sock"), LAYOUT, timeout_s=0.5) as c:
        t0 = time.monotonic()
        assert c.lookup(NS, _tokens(0, 2)).matched_blocks == 0
        assert c.store(NS, _tokens(0, 1), _data(1, 1)) == [Status.REJECTED]
        assert time.monotonic() - t0 < 1.0 and c.stats()["client"]["down"] >= 1
    with pytest.raises(ConfigError, match="unix://"):
        NodeKVStore("http://127.0.0.1:1/node.sock", LAYOUT)


def test_the_socket_path_is_claimed_only_from_a_stale_socket(service, tmp_path):
    _, server, _ = service
    assert stat.S_IMODE(os.stat(server.path).st_mode) == 0o600
    with pytest.raises(NodeServiceError, match="another service listens"):
        claim_socket_path(server.path)
    stale = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)
    s.close()
    claim_socket_path(stale)
    assert not os.path.exists(stale)
    (tmp_path / "file").write_text("not ours")
    with pytest.raises(NodeServiceError, match="not a socket"):
        claim_socket_path(str(tmp_path / "file"))
    assert (tmp_path / "file").read_text() == "not ours"


def test_tickets_per_client_are_bounded(tmp_path):
    core = NodeCore(
        f"t{uuid.uuid4().hex[:8]}", {"tiers": {"host": {"capacity_bytes": 8 * BB}}}, LAYOUT, staging_blocks=0
    )
    with NodeServer(core, NodeConfig(socket=str(tmp_path / "n.sock"), max_tickets_per_client=2)) as server:
        c = NodeKVStore("unix://" + server.path, LAYOUT)
        with c._lock:
            for i in range(2):
                c._call(
                    lambda rid, i=i: P.PrepareStore(
                        rid, ns=NS, keys=bytes([i]) * 32, first_position=0, lifetime=0, wait=True
                    )
                )
        assert c.store(NS, _tokens(0, 1), _data(1, 1)) == [Status.REJECTED]  # BUSY: not stored
        c.close()  # Bye: its tickets are aborted at once
        t_end = time.monotonic() + 5
        while time.monotonic() < t_end and core.tickets.open_tickets():
            time.sleep(0.05)
        core.check_invariants(quiescent=True)
    core.close()


def test_the_one_config_key_selects_the_node_service_and_unset_keeps_the_embedded_store(service):
    from pydantic import BaseModel

    from tierstore.api import KVStore
    from tierstore.integrations._common import open_store, split_extra_config

    class Section(BaseModel, extra="forbid"):
        knob: int = 0

    _, _, url = service
    cfg, _ = split_extra_config(
        {"store": {"url": url, "timeout_s": "2s"}},
        "connector",
        Section,
        "extra",
        secondary="the engine owns HBM",
    )
    with open_store(cfg, LAYOUT) as store:
        assert isinstance(store, NodeKVStore) and store.timeout_s == 2.0
        assert store.store(NS, _tokens(0, 2), _data(4, 2)) == [Status.OK] * 2
    with pytest.raises(ConfigError, match="remove \\['tiers'\\]"):
        split_extra_config(
            {"store": {"url": url}, "tiers": {"host": {"capacity_bytes": "1m"}}},
            "connector",
            Section,
            "extra",
        )
    with pytest.raises(ConfigError, match="unix:///"):
        split_extra_config({"store": {"url": "http://h:1"}}, "connector", Section, "extra")
    with pytest.raises(ConfigError, match="open_store"):
        KVStore.from_config(cfg, LAYOUT)
    cfg, _ = split_extra_config(
        {"tiers": {"host": {"capacity_bytes": 4 * BB}}}, "connector", Section, "extra"
    )
    with open_store(cfg, LAYOUT) as store:
        assert isinstance(store, KVStore)


def test_the_daemon_serves_one_store_over_http_and_the_node_socket(tmp_path):
    from tierstore.client import RemoteKVStore

    cfg_path = _write_config(tmp_path)
    with open(cfg_path) as f:
        cfg = yaml.safe_load(f)
    d = Daemon(str(tmp_path), cfg).start()
    try:
        sock = cfg["node"]["socket"]
        assert any(r.get("node_socket") == sock for r in d.records())
        with NodeKVStore("unix://" + sock, LAYOUT) as c:
            assert c.store(NS, _tokens(0, 3), _data(9, 3)) == [Status.OK] * 3
            st, out = c.load(c.lookup(NS, _tokens(0, 3)))
            assert st == [Status.OK] * 3 and _sha(out) == _sha(_data(9, 3))
            before = c.stats()["tenant"]["usage_bytes"]  # a daemon of several tenants: its own
        http = RemoteKVStore(d.url, TOKENS["acme"], timeout_s=20)  # the node sessions' tenant
        try:
            assert (
                http.store(NS, _tokens(0, 2), _data(10, 2)) == [Status.EXISTS] * 2
            )  # stored over the socket
            assert http.store(NS, _tokens(100, 2), _data(10, 2)) == [Status.OK] * 2
            assert http.lookup(NS, _tokens(0, 3)).matched_blocks == 3
        finally:
            http.close()
        with NodeKVStore("unix://" + sock, LAYOUT) as c:  # one store: the HTTP blocks count there too
            assert c.stats()["tenant"]["usage_bytes"] == before + 2 * BB
    finally:
        assert d.stop() == 0


def test_check_names_a_node_socket_that_cannot_be_taken(service, tmp_path):
    from tierstore.server.check import preflight
    from tierstore.server.config import parse_config

    _, server, _ = service

    def errors(sock: str) -> list[str]:
        cfg = make_config(str(tmp_path), node={"socket": sock})
        return preflight(parse_config(cfg), ports=False).errors

    assert any("another service listens" in e for e in errors(server.path))
    (tmp_path / "plain").write_text("x")
    assert any("not a socket" in e for e in errors(str(tmp_path / "plain")))
    assert any("does not exist" in e for e in errors(str(tmp_path / "no" / "node.sock")))
    assert not [e for e in errors(str(tmp_path / "free.sock")) if "node.socket" in e]


def test_the_client_has_kvstores_signatures_for_what_it_offers():
    import inspect

    from tierstore.api import KVStore, KVStoreProtocol
    from tierstore.node.client import NOT_OFFERED

    local = {n for n, _ in inspect.getmembers(KVStore) if not n.startswith("_")}
    mine = {n for n, _ in inspect.getmembers(NodeKVStore) if not n.startswith("_")}
    assert local - mine == {n for names in NOT_OFFERED.values() for n in names} and not mine - local - {
        "closed"
    }
    for name in sorted(mine & local):
        member = getattr(KVStore, name)
        if not callable(member) or isinstance(member, type):
            continue
        want = [(p.name, p.kind, p.default) for p in inspect.signature(member).parameters.values()]
        got = [
            (p.name, p.kind, p.default)
            for p in inspect.signature(getattr(NodeKVStore, name)).parameters.values()
        ]
        if name == "close":  # KVStore.close takes flush=; the service decides what it writes down
            want = [w for w in want if w[0] != "flush"]
        assert got == want, name
    protocol = {n for n, m in vars(KVStoreProtocol).items() if not n.startswith("_") and callable(m)}
    assert protocol <= mine, protocol - mine


def test_a_service_at_its_session_limit_gives_misses_not_errors(tmp_path):
    core = NodeCore(
        f"t{uuid.uuid4().hex[:8]}", {"tiers": {"host": {"capacity_bytes": 8 * BB}}}, LAYOUT, staging_blocks=0
    )
    with NodeServer(core, NodeConfig(socket=str(tmp_path / "n.sock"), max_clients=1)) as server:
        a = NodeKVStore("unix://" + server.path, LAYOUT)
        b = NodeKVStore("unix://" + server.path, LAYOUT, retry_s=0)
        assert a.store(NS, _tokens(0, 1), _data(1, 1)) == [Status.OK]
        assert b.lookup(NS, _tokens(0, 1)).matched_blocks == 0 and b.stats()["client"]["down"] >= 1
        a.close()
        t_end = time.monotonic() + 5
        while server.sessions() and time.monotonic() < t_end:
            time.sleep(0.05)
        assert b.lookup(NS, _tokens(0, 1)).matched_blocks == 1  # it connects once there is room
        b.close()
    core.close()


def test_a_connection_that_never_says_hello_is_closed_after_op_timeout(tmp_path):
    core = NodeCore(
        f"t{uuid.uuid4().hex[:8]}", {"tiers": {"host": {"capacity_bytes": 8 * BB}}}, LAYOUT, staging_blocks=0
    )
    with NodeServer(core, NodeConfig(socket=str(tmp_path / "n.sock"), op_timeout_s=0.3)) as server:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(server.path)
            t_end = time.monotonic() + 5
            while time.monotonic() < t_end and not server.sessions():
                time.sleep(0.01)
            while time.monotonic() < t_end and server.sessions():
                time.sleep(0.05)
            assert server.sessions() == 0
            s.settimeout(5)
            assert s.recv(1) == b""  # closed by the service
    core.close()


def _forked_lookup(c: NodeKVStore, q) -> None:
    q.put(c.lookup(NS, _tokens(0, 2)).matched_blocks)
    c.close()


def test_a_forked_child_makes_its_own_session_and_leaves_the_parents_alone(service):
    core, server, url = service
    c = NodeKVStore(url, LAYOUT)
    assert c.store(NS, _tokens(0, 2), _data(3, 2)) == [Status.OK] * 2
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_forked_lookup, args=(c, q))
    p.start()
    assert q.get(timeout=60) == 2
    p.join(60)
    assert p.exitcode == 0
    st, out = c.load(c.lookup(NS, _tokens(0, 2)))  # the parent's session still works
    assert st == [Status.OK] * 2 and _sha(out) == _sha(_data(3, 2)) and c.stats()["client"]["connects"] == 1
    c.close()
    core.check_invariants(quiescent=True)


def test_a_client_calling_faster_than_retry_s_reconnects_once_the_service_is_back(tmp_path):
    """Fresh-user trial: a client storing back to back never reconnected after the service came back
    (each refused call inside the retry window restarted the window, so the window never ended)."""
    sock = str(tmp_path / "n.sock")
    c = NodeKVStore("unix://" + sock, LAYOUT, retry_s=0.3, timeout_s=2)
    t_end = time.monotonic() + 1.0
    while time.monotonic() < t_end:  # the service is down: misses, a call every 20 ms
        assert c.store(NS, _tokens(0, 1), _data(1, 1)) == [Status.REJECTED]
        time.sleep(0.02)
    core = NodeCore(
        f"t{uuid.uuid4().hex[:8]}", {"tiers": {"host": {"capacity_bytes": 8 * BB}}}, LAYOUT, staging_blocks=0
    )
    with NodeServer(core, NodeConfig(socket=sock)):
        t_up = time.monotonic()
        got = []
        while time.monotonic() - t_up < 5 and got != [Status.OK]:
            got = c.store(NS, _tokens(0, 1), _data(1, 1))
            time.sleep(0.02)
        assert got == [Status.OK] and time.monotonic() - t_up < 0.3 + 2.0, c.stats()["client"]
        c.close()
    core.close()


def test_a_user_the_socket_keeps_out_is_refused_not_taken_for_a_service_that_is_down(service):
    """Second fresh-user trial: a process of another uid got EACCES at connect, which the client took
    for a service that is down: every call missed and nothing said why (an engine ran with no cache)."""
    _, server, url = service
    if os.getuid() != 0:
        pytest.skip("needs root to run a child as another uid")
    pid = os.fork()
    if pid == 0:  # the child: another user, this process's modules already imported
        code = 3
        try:
            os.setgid(65534)
            os.setuid(65534)
            c = NodeKVStore(url, LAYOUT, timeout_s=2)
            try:
                c.exists(c.keys_for(NS, _tokens(0, 1)))
                code = 1  # answered as a miss: the old behaviour
            except ConfigError as e:
                code = 0 if "permission denied" in str(e) else 2
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_client_timeout_past_a_day_is_refused_at_construction():
    """Second fresh-user trial: timeout_s=float('inf') was accepted, then every call raised
    OverflowError (timestamp out of range for platform time_t)."""
    for bad in (float("inf"), 1e12, float("nan"), 0):
        with pytest.raises(ConfigError, match="timeout_s"):
            NodeKVStore("unix:///tmp/x.sock", LAYOUT, timeout_s=bad)
    NodeKVStore("unix:///tmp/x.sock", LAYOUT, timeout_s=86400).close()


def test_a_lease_or_wait_that_is_not_finite_is_refused_before_any_call():
    """Fresh-user trial: pin(lease_s=nan) was accepted by the embedded store; the node client
    checks leases and load deadlines as KVStore does (one check, tierstore.units)."""
    c = NodeKVStore("unix:///tmp/x.sock", LAYOUT, timeout_s=1)
    try:
        for bad in (float("nan"), float("inf"), 1e12, 0, -1):
            with pytest.raises(ConfigError, match="lease_s="):
                c.pin_keys(NS, [bytes(32)], lease_s=bad)
            with pytest.raises(ConfigError, match="timeout_s="):
                c.load([bytes(32)], timeout_s=bad)
            with pytest.raises(ConfigError, match="retry_s="):
                NodeKVStore("unix:///tmp/x.sock", LAYOUT, retry_s=bad if bad != 0 else -1)
    finally:
        c.close()


def test_a_client_that_leaves_during_its_handshake_is_no_internal_error(service, monkeypatch, caplog):
    core, _server, url = service
    send = P.FrameSocket.send

    def gone_before_the_welcome(self, msg, *a, **kw):
        if isinstance(msg, P.Welcome):
            raise BrokenPipeError(32, "Broken pipe")  # what send(2) says once the client has closed
        return send(self, msg, *a, **kw)

    monkeypatch.setattr(P.FrameSocket, "send", gone_before_the_welcome)
    with caplog.at_level("INFO", logger="tierstore.node.server"):
        with NodeKVStore(url, LAYOUT, timeout_s=0.5) as c:
            assert c.lookup(NS, _tokens(0, 1)).matched_blocks == 0  # a miss: no session
    assert core.index.metrics.counters["node_internal_errors"] == 0
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert any("left during its handshake" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "bad, error",
    [
        ({"first_position": -1}, "first_position"),
        ({"first_position": 2**40}, "first_position"),
        ({"first_position": 1.0}, "must be an int"),
        ({"lifetime": "forever"}, "lifetime hint"),
    ],
)
def test_a_bad_store_keys_argument_raises_before_anything_is_sent_and_the_session_goes_on(
    service, bad, error
):
    """``store_keys(first_position=-1)`` was sent: the service could not decode the frame, ended the
    session, and the client answered REJECTED as if the service were down, for that call and every
    call within ``retry_s`` (fresh-user trial 4b). Every store checks it first, as KVStore does."""
    core, _, url = service
    c = NodeKVStore(url, LAYOUT, timeout_s=5.0)
    try:
        keys = [bytes([i]) * 32 for i in range(1, 5)]
        data = _data(7, 4)
        with pytest.raises((ConfigError, LayoutError), match=error):
            c.store_keys(NS, keys, list(data), **bad)
        with pytest.raises((ConfigError, LayoutError), match=error):
            c.store_keys(NS, keys, list(data), wait=False, **bad)  # at the call, not in the Future
        assert c.store_keys(NS, keys, list(data)) == [Status.OK] * 4  # the session is fine
        assert c.counters["down"] == 0 and c.counters["connects"] == 1
    finally:
        c.close()


def test_the_node_service_logs_how_long_prefaulting_its_segment_took(tmp_path, caplog):
    """tierstore/server/README.md: "the `prefaulted` log line says how long"; with a node section
    the node service prefaulted its shared segment without any line (fresh-user trial 9)."""
    import logging

    from tierstore.node.server import open_node_core
    from tierstore.server.config import parse_config

    cfg = parse_config(make_config(str(tmp_path), node={"socket": str(tmp_path / "node.sock")}))
    with caplog.at_level(logging.INFO, logger="tierstore.node.server"):
        core = open_node_core(cfg)
    try:
        said = [r for r in caplog.records if r.getMessage() == "prefaulted"]
        assert len(said) == 1, [r.getMessage() for r in caplog.records]
        fields = said[0].fields
        assert fields["event"] == "prefaulted" and fields["seconds"] >= 0
        assert fields["method"] in ("madvise", "touch") and fields["bytes"] == core.segment.size_bytes
    finally:
        core.close()
