"""Tenancy, auth, quotas and metrics on both transports of one daemon (issue 24 item 2): a node
session is admitted by its peer's uid/gid, bound to a tenant by its token (or ``node.tenant``),
scoped as HTTP scopes, charged on the same quota book and counted beside HTTP's metrics."""

from __future__ import annotations

import os
import re
import time
import uuid

import numpy as np
import pytest
import torch
import yaml

from tierstore.errors import ConfigError, QuotaExceeded, Status
from tierstore.layout import KVLayout
from tierstore.node.client import NodeKVStore
from tierstore.node.core import NodeCore
from tierstore.node.server import NodeServer
from tierstore.server.config import NodeConfig, parse_config

from ..server.conftest import PUBLIC_NS, TOKENS, Daemon, make_config

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16, tokens_per_block=16)
BB = LAYOUT.bytes_per_block  # 8 KiB: carol's 64 KiB quota is 8 blocks
NS = b"t" * 32


def _tokens(base: int, n_blocks: int) -> list[int]:
    return list(range(base, base + n_blocks * LAYOUT.tokens_per_block))


def _data(seed: int, n: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, BB), dtype=np.uint8))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """One daemon, HTTP and the node socket; sessions without a token are bravo's."""
    tmp = str(tmp_path_factory.mktemp("tenancy"))
    sock = os.path.join(tmp, "node.sock")
    cfg = make_config(tmp, node={"socket": sock, "staging_blocks": 8, "tenant": "bravo"})
    cfg["layout"] = {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 32,
        "dtype": "fp16",
        "tokens_per_block": 16,
    }
    cfg["limits"]["max_lease_s"] = "10m"
    d = Daemon(tmp, cfg).start()
    yield d, "unix://" + sock
    assert d.stop() == 0


def _same(rows, data: torch.Tensor) -> bool:
    return torch.equal(torch.stack([r.reshape(-1).view(torch.uint8) for r in rows]), data)


def _node(url: str, tenant: str | None) -> NodeKVStore:
    return NodeKVStore(url, LAYOUT, timeout_s=5.0, token=TOKENS[tenant] if tenant else "")


def _http(d: Daemon, tenant: str):
    from tierstore.client import RemoteKVStore

    return RemoteKVStore(d.url, TOKENS[tenant], timeout_s=20)


def _metric(d: Daemon, name: str, **labels) -> float:
    status, body = d.get("/metrics")
    assert status == 200
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in body.decode().splitlines():
        m = re.match(rf"^{name}(?:\{{(.*)\}})? (\S+)$", line)
        if m and ",".join(sorted((m.group(1) or "").split(","))) == want:
            return float(m.group(2))
    return 0.0


def test_a_tenant_sees_its_blocks_over_both_transports_and_another_tenant_never(daemon):
    d, url = daemon
    ns = b"x" * 32
    acme_http, bravo_http = _http(d, "acme"), _http(d, "bravo")
    acme, bravo, tokenless = _node(url, "acme"), _node(url, "bravo"), _node(url, None)
    try:
        assert acme_http.store(ns, _tokens(0, 3), _data(1, 3)) == [Status.OK] * 3  # HTTP, tenant A
        keys = bravo.keys_for(ns, _tokens(0, 3))
        assert keys == acme_http.keys_for(ns, _tokens(0, 3))  # the clients compute the same keys
        assert bravo.lookup(ns, _tokens(0, 3)).matched_blocks == 0  # socket, tenant B: a miss
        assert bravo.exists(keys) == 0 and bravo.load(keys)[0] == [Status.MISS] * 3
        assert tokenless.lookup(ns, _tokens(0, 3)).matched_blocks == 0  # node.tenant: bravo
        hit = acme.lookup(ns, _tokens(0, 3))  # socket, tenant A: a hit, byte-exact
        assert hit.matched_blocks == 3 and acme.exists(keys) == 3
        st, out = acme.load(hit)
        assert st == [Status.OK] * 3 and _same(out, _data(1, 3))
        # the reverse: stored over the socket by B, missed over HTTP by A, hit over HTTP by B
        assert bravo.store(ns, _tokens(500, 2), _data(2, 2)) == [Status.OK] * 2
        assert acme_http.lookup(ns, _tokens(500, 2)).matched_blocks == 0
        assert acme.lookup(ns, _tokens(500, 2)).matched_blocks == 0
        assert bravo_http.lookup(ns, _tokens(500, 2)).matched_blocks == 2
        assert tokenless.lookup(ns, _tokens(500, 2)).matched_blocks == 2
        st, out = bravo_http.load(bravo_http.lookup(ns, _tokens(500, 2)))
        assert st == [Status.OK] * 2 and _same(out, _data(2, 2))
        # B's invalidation over the socket drops B's namespace, not A's equal one
        assert bravo.invalidate(ns) == 2
        assert acme_http.lookup(ns, _tokens(0, 3)).matched_blocks == 3
        assert bravo_http.lookup(ns, _tokens(500, 2)).matched_blocks == 0
        assert acme.stats()["session"]["tenant"] == "acme"
    finally:
        for c in (acme_http, bravo_http, acme, bravo, tokenless):
            c.close()


def test_public_namespaces_are_shared_over_both_transports_by_their_rules(daemon):
    d, url = daemon
    from tierstore.identity import Namespace

    pub = Namespace(**PUBLIC_NS)
    acme, bravo, bravo_http = _node(url, "acme"), _node(url, "bravo"), _http(d, "bravo")
    try:
        assert bravo.store(pub, _tokens(0, 2), _data(3, 2)) == [Status.REJECTED] * 2  # not a writer
        assert acme.store(pub, _tokens(0, 2), _data(3, 2)) == [Status.OK] * 2  # writers: [acme]
        assert bravo.lookup(pub, _tokens(0, 2)).matched_blocks == 2  # readers: "*"
        assert bravo_http.lookup(pub, _tokens(0, 2)).matched_blocks == 2
    finally:
        for c in (acme, bravo, bravo_http):
            c.close()


def test_key_level_reads_reach_a_public_namespace_as_the_embedded_store_does(daemon):
    """A block stored under a public namespace hits on key-level calls (load, exists and
    lookup_keys send no namespace), as it hits through an embedded KVStore; a tenant's private
    blocks still miss for another tenant."""
    d, url = daemon
    from tierstore.identity import Namespace

    pub = Namespace(**PUBLIC_NS)
    acme, bravo = _node(url, "acme"), _node(url, "bravo")
    try:
        assert acme.store(pub, _tokens(9000, 3), _data(11, 3)) == [Status.OK] * 3
        keys = bravo.keys_for(pub, _tokens(9000, 3))
        for c in (acme, bravo):  # the writer and a reader
            hit = c.lookup(pub, _tokens(9000, 3))
            assert hit.matched_blocks == 3
            st, out = c.load(hit)  # a LookupResult's keys: a key-level load
            assert st == [Status.OK] * 3 and _same(out, _data(11, 3))
            assert c.exists(keys) == 3 and c.lookup_keys(keys).matched_blocks == 3
            st, out = c.load(keys)
            assert st == [Status.OK] * 3 and _same(out, _data(11, 3))
        # a private block of acme's next to them: bravo's key-level calls still miss it
        assert acme.store(NS, _tokens(9100, 1), _data(12, 1)) == [Status.OK]
        mine = acme.keys_for(NS, _tokens(9100, 1))
        assert acme.exists(mine) == 1 and bravo.exists(mine) == 0
        assert bravo.load(keys + mine)[0] == [Status.OK] * 3 + [Status.MISS]
    finally:
        acme.close()
        bravo.close()


def _numbers(tree, path=()) -> dict:
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in _numbers(sub, (*path, key)).items()}
    return {path: tree} if isinstance(tree, (int, float)) and not isinstance(tree, bool) else {}


def test_a_tenants_stats_over_the_socket_show_its_own_figures_only(daemon):
    """Stats through the socket of a daemon of several tenants: a tenant sees its own usage, and
    no figure of its reply moves when another tenant stores, looks up and loads."""
    d, url = daemon
    acme, bravo = _node(url, "acme"), _node(url, "bravo")
    try:
        before, acme_before = bravo.stats(), acme.stats()
        assert before["tenant"]["name"] == "bravo" and acme_before["tenant"]["name"] == "acme"
        # bravo has no quota: None, not the config's 2**62 (fresh-user trial 9); acme's is 64 MiB
        assert before["tenant"]["quota_bytes"] is None and acme_before["tenant"]["quota_bytes"] == 64 << 20
        assert "blocks" not in before and "bytes_per_tier" not in before and "node" not in before
        assert acme.store(NS, _tokens(9500, 3), _data(13, 3)) == [Status.OK] * 3
        st, _ = acme.load(acme.lookup(NS, _tokens(9500, 3)))
        assert st == [Status.OK] * 3
        after = bravo.stats()
        moved = {
            k: (before_v, _numbers(after).get(k))
            for k, before_v in _numbers(before).items()
            if k[0] not in ("client",) and _numbers(after).get(k) != before_v
        }
        assert not moved, moved  # nothing of acme's activity shows in bravo's figures
        assert acme.stats()["tenant"]["usage_bytes"] == acme_before["tenant"]["usage_bytes"] + 3 * BB
        from tierstore.integrations._common import store_summary  # an engine's start line

        assert "tenant 'bravo'" in store_summary(bravo) and "not answering" not in store_summary(bravo)
    finally:
        acme.close()
        bravo.close()


def test_the_tenants_byte_quota_is_one_book_for_both_transports(daemon):
    d, url = daemon
    ns = b"q" * 32
    carol, carol_http = _node(url, "carol"), _http(d, "carol")  # 64 KiB: 8 blocks of 8 KiB
    try:
        assert carol.store(ns, _tokens(0, 9), _data(4, 9)) == [Status.REJECTED] * 9  # over: nothing charged
        client = carol.stats()["client"]  # REJECTED as when the service is down, but said apart
        assert client["refused"] == 1 and client["down"] == 0 and "quota" in client["last_refusal"]
        assert carol.store(ns, _tokens(0, 6), _data(4, 6)) == [Status.OK] * 6
        with pytest.raises(QuotaExceeded):  # the socket's 6 blocks count over HTTP
            carol_http.store(ns, _tokens(100, 3), _data(5, 3))
        assert carol_http.store(ns, _tokens(100, 2), _data(5, 2)) == [Status.OK] * 2
        assert carol.store(ns, _tokens(200, 1), _data(6, 1)) == [Status.REJECTED]  # and HTTP's here
        assert _metric(d, "tierstore_tenant_usage_bytes", tenant="carol") == 8 * BB
        assert carol.invalidate(ns) == 8  # the usage goes with it
        assert carol.store(ns, _tokens(200, 1), _data(6, 1)) == [Status.OK]
        with pytest.raises(ConfigError, match="lease_s"):  # past limits.max_lease_s: said, not an empty lease
            carol.pin(ns, _tokens(200, 1), lease_s=3600)
        assert len(carol.pin(ns, _tokens(200, 1), lease_s=60).keys) == 1
    finally:
        carol.close()
        carol_http.close()


def test_a_wrong_token_is_refused_at_connect_with_the_reason_and_counted(daemon):
    d, url = daemon
    before = _metric(d, "tierstore_node_sessions_refused_total", reason="auth")
    c = NodeKVStore(url, LAYOUT, timeout_s=5.0, token="not-a-token-of-anyone-0123")
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="auth: invalid token"):
        c.lookup(NS, _tokens(0, 1))
    assert time.monotonic() - t0 < 5.0
    c.close()
    assert _metric(d, "tierstore_node_sessions_refused_total", reason="auth") == before + 1


def test_the_prometheus_endpoint_shows_the_node_transport_beside_http(daemon):
    d, url = daemon
    ns = b"m" * 32
    with _node(url, "acme") as c:
        assert c.store(ns, _tokens(0, 2), _data(7, 2)) == [Status.OK] * 2
        st, _ = c.load(c.lookup(ns, _tokens(0, 2)))
        assert st == [Status.OK] * 2
        assert _metric(d, "tierstore_node_sessions") >= 1
        assert _metric(d, "tierstore_node_requests_total", op="Lookup", code="ok") >= 1
        assert _metric(d, "tierstore_node_requests_total", op="CompleteStore", code="ok") >= 1
        assert _metric(d, "tierstore_node_request_seconds_count", op="PrepareLoad") >= 1
        assert _metric(d, "tierstore_node_payload_bytes_total", direction="in", tenant="acme") >= 2 * BB
        assert _metric(d, "tierstore_node_payload_bytes_total", direction="out", tenant="acme") >= 2 * BB
        assert _metric(d, "tierstore_node_blocks_total", op="put", tenant="acme", status="ok") >= 2
        assert _metric(d, "tierstore_node_sessions_opened_total", tenant="acme") >= 1
        assert _metric(d, "tierstore_block_requests_total", op="node_lookup") >= 2
        assert c.prefetch(ns, _tokens(0, 2), tier="hbm").exception(timeout=10) is not None  # no HBM tier
        assert _metric(d, "tierstore_node_requests_total", op="Prefetch", code="bad_request") >= 1
    assert _metric(d, "tierstore_requests_total", op="/metrics", code="200") >= 1  # HTTP's, beside


def test_a_peer_outside_the_allow_lists_is_refused_at_connect(tmp_path):
    core = NodeCore(f"t{uuid.uuid4().hex[:8]}", {"tiers": {"host": {"capacity_bytes": 4 * BB}}}, LAYOUT)
    sock = str(tmp_path / "n.sock")
    others = NodeConfig(socket=sock, allow_uids=[os.getuid() + 1])
    try:
        with NodeServer(core, others), NodeKVStore("unix://" + sock, LAYOUT, timeout_s=2.0) as c:
            t0 = time.monotonic()
            with pytest.raises(
                ConfigError, match=f"auth: peer uid {os.getuid()} .*allow_uids=\\[{os.getuid() + 1}\\]"
            ):
                c.lookup(NS, _tokens(0, 1))
            assert time.monotonic() - t0 < 2.0
        group = NodeConfig(socket=sock, allow_uids=[os.getuid() + 1], allow_gids=[os.getgid()])
        with NodeServer(core, group), NodeKVStore("unix://" + sock, LAYOUT, timeout_s=2.0) as c:
            assert c.store(NS, _tokens(0, 1), _data(8, 1)) == [Status.OK]  # admitted by its gid
        with (
            NodeServer(core, NodeConfig(socket=sock)),
            NodeKVStore(  # default: the service's own uid
                "unix://" + sock, LAYOUT, timeout_s=2.0, token="a-token-0123456789abcdef"
            ) as c,
        ):
            with pytest.raises(ConfigError, match="this pool has no tenants"):
                c.lookup(NS, _tokens(0, 1))
    finally:
        core.close()


def test_node_tenant_must_name_a_tenant_and_ids_are_checked():
    cfg = make_config("/tmp/unused", node={"socket": "/tmp/n.sock", "tenant": "nobody"})
    with pytest.raises(ConfigError, match="node.tenant 'nobody' is not a tenant"):
        parse_config(cfg)
    with pytest.raises(ConfigError, match="allow_uids"):
        parse_config(make_config("/tmp/unused", node={"socket": "/tmp/n.sock", "allow_uids": [-1]}))


def test_blocks_stored_over_the_socket_survive_a_daemon_restart_for_their_tenant_only(tmp_path):
    """The node socket's namespaces are registered scopes now: a restarted daemon keeps them
    (before, a daemon without its node section dropped them as unaddressable)."""
    sock = str(tmp_path / "node.sock")
    cfg = make_config(str(tmp_path), node={"socket": sock, "staging_blocks": 8})
    cfg["layout"] = {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 32,
        "dtype": "fp16",
        "tokens_per_block": 16,
    }
    d = Daemon(str(tmp_path), cfg).start()
    try:
        with _node("unix://" + sock, "acme") as c:
            assert c.store(NS, _tokens(0, 4), _data(9, 4)) == [Status.OK] * 4  # durable: on NVMe
    finally:
        assert d.stop() == 0
    del cfg["node"]  # HTTP only: the socket's blocks are still addressable (by their tenant)
    d = Daemon(str(tmp_path), cfg).start()
    try:
        rec = [r for r in d.records() if r.get("event") == "recovered"][-1]
        assert rec["blocks"] == 4 and rec["unaddressable"] == 0
        acme, bravo = _http(d, "acme"), _http(d, "bravo")
        try:
            st, out = acme.load(acme.lookup(NS, _tokens(0, 4)))
            assert st == [Status.OK] * 4 and _same(out, _data(9, 4))
            assert bravo.lookup(NS, _tokens(0, 4)).matched_blocks == 0
        finally:
            acme.close()
            bravo.close()
    finally:
        assert d.stop() == 0


def test_serve_node_alone_applies_the_same_tenancy_and_serves_its_metrics_on_metrics_port(tmp_path):
    import socket
    import urllib.request

    from .test_service import _start_service

    with socket.socket() as probe:  # a free port for metrics.port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sock = str(tmp_path / "node.sock")
    cfg = make_config(str(tmp_path), node={"socket": sock, "staging_blocks": 8})
    cfg["layout"] = {
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 32,
        "dtype": "fp16",
        "tokens_per_block": 16,
    }
    cfg["metrics"] = {"host": "127.0.0.1", "port": port}
    path = str(tmp_path / "node.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    proc = _start_service(path, sock, str(tmp_path / "node.log"))
    try:
        with _node("unix://" + sock, "acme") as a, _node("unix://" + sock, "bravo") as b:
            assert a.store(NS, _tokens(0, 2), _data(1, 2)) == [Status.OK] * 2
            assert b.lookup(NS, _tokens(0, 2)).matched_blocks == 0
            assert a.lookup(NS, _tokens(0, 2)).matched_blocks == 2
            with pytest.raises(ConfigError, match="needs a tenant's token"):  # no node.tenant here
                _node("unix://" + sock, None).lookup(NS, _tokens(0, 1))
            t_end = time.monotonic() + 10
            while True:  # the refused session's thread ends after its reply: the gauge follows
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
                    text = r.read().decode()
                if re.search(r"^tierstore_node_sessions 2\.0$", text, re.M) or time.monotonic() > t_end:
                    break
                time.sleep(0.1)
        assert re.search(r"^tierstore_node_sessions 2\.0$", text, re.M)
        assert re.search(r'^tierstore_node_requests_total\{code="ok",op="Lookup"\} 2\.0$', text, re.M)
        assert re.search(r'^tierstore_node_requests_total\{code="auth",op="Hello"\} 1\.0$', text, re.M)
        assert re.search(r'^tierstore_node_sessions_refused_total\{reason="auth"\} 1\.0$', text, re.M)
        # the daemon's own families too (fresh-user trial 8: --node exported only tierstore_node_*,
        # while server/README says node lookups count in tierstore_block_requests/hits): 2 lookups
        # of 2 blocks, one by each tenant, 2 matched
        assert re.search(r'^tierstore_block_requests_total\{op="node_lookup"\} 4\.0$', text, re.M), text
        assert re.search(r'^tierstore_block_hits_total\{op="node_lookup"\} 2\.0$', text, re.M)
        assert re.search(r"^tierstore_block_hit_ratio 0\.5$", text, re.M)
        assert re.search(r'^tierstore_tier_bytes\{tier="host"\} [1-9]', text, re.M)
        assert re.search(r'^tierstore_tenant_usage_bytes\{tenant="acme"\} [1-9]', text, re.M)
        assert "tierstore_inflight_requests" not in text  # HTTP's, and there is no HTTP listener
    finally:
        proc.terminate()
        assert proc.wait(timeout=60) == 0


def test_an_engine_connector_passes_its_token_through_tierstore_token(daemon, monkeypatch):
    """The connectors build NodeKVStore(url, layout) without a token: TIERSTORE_TOKEN supplies it."""
    _, url = daemon
    monkeypatch.setenv("TIERSTORE_TOKEN", TOKENS["carol"])
    with NodeKVStore(url, LAYOUT, timeout_s=5.0) as c:
        assert c.stats()["session"]["tenant"] == "carol"
    with NodeKVStore(url, LAYOUT, timeout_s=5.0, token="") as c:  # an explicit "" wins: node.tenant
        assert c.stats()["session"]["tenant"] == "bravo"


def test_storage_keys_are_the_documented_formula_per_owner_through_the_cache(tmp_path, monkeypatch):
    import hashlib

    from tierstore.server import tenancy as T

    cfg = parse_config(make_config(str(tmp_path)))
    fp = LAYOUT.fingerprint()
    ten = T.Tenancy(cfg, BB, fp)
    keys = [bytes([i]) * 32 for i in range(10)]

    def formula(owner: str) -> list[bytes]:
        ks = hashlib.sha256(b"tierstore/owner-keys/v1\0" + owner.encode() + b"\0" + fp).digest()
        return [hashlib.sha256(b"tierstore/server-key/v2" + ks + k).digest() for k in keys]

    monkeypatch.setattr(T, "KEY_CACHE_ENTRIES", 4)  # started over twice on the way
    for _ in range(2):
        assert ten.server_keys("acme", keys) == formula("acme")
        assert ten.server_keys("bravo", keys) == formula("bravo")
    assert not set(formula("acme")) & set(formula("bravo"))
    scope, owner, skeys = ten.scoped("acme", NS, keys[:3], write=False)
    assert owner == "acme" and skeys == formula("acme")[:3] and scope not in ten.scope_owner


def test_several_tenants_on_one_node_socket_need_an_explicit_opt_in():
    """Second fresh-user trial: a session of tenant B read tenant A's blocks out of its mapping of the
    shared segment and overwrote them, and A then loaded the wrong bytes with status OK. Every session
    maps the host tier read-write, so key scoping cannot keep tenants apart there: a daemon of several
    tenants with a node socket is refused unless they are declared to share that memory."""
    cfg = make_config("/tmp/unused", node={"socket": "/tmp/n.sock"})
    cfg["node"].pop("tenants_share_memory")
    with pytest.raises(ConfigError, match="tenants_share_memory"):
        parse_config(cfg)
    one = dict(cfg, tenants=cfg["tenants"][:1], public_namespaces=[])
    assert parse_config(one).node is not None  # one tenant: its own processes only
    assert parse_config(
        dict(cfg, node=dict(cfg["node"], tenants_share_memory=True))
    ).node.tenants_share_memory
    with pytest.raises(ConfigError, match="absolute"):
        parse_config(dict(one, node={"socket": "rel.sock"}))


def test_no_staging_slots_beside_an_nvme_tier_is_refused():
    """Second fresh-user trial: node.staging_blocks: 0 passed serve --check and started, and every
    NVMe-resident block was then a miss (lookups said useful, loads missed)."""
    cfg = make_config("/tmp/unused", node={"socket": "/tmp/n.sock", "staging_blocks": 0})
    assert cfg["tiers"].get("nvme") is not None
    with pytest.raises(ConfigError, match="staging_blocks"):
        parse_config(cfg)
    no_nvme = dict(cfg, tiers={k: v for k, v in cfg["tiers"].items() if k != "nvme"}, puts={"durable": False})
    assert parse_config(no_nvme).node.staging_blocks == 0
