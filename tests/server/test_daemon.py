"""The real daemon on loopback: concurrent clients, tenancy/auth, limits, ops endpoints, SIGTERM drain."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
import urllib.request

import pytest
import torch

from tierstore import Namespace
from tierstore.api import leading_ok
from tierstore.client import AuthError, RemoteKVStore, ServerBusy
from tierstore.errors import QuotaExceeded, Status
from tierstore.server.protocol import BLOCKS_CONTENT_TYPE, encode_prefix

from .conftest import PUBLIC_NS, TOKENS, Daemon, make_config
from .helpers import block_for


def _client(d, tenant="acme", **kw) -> RemoteKVStore:
    return RemoteKVStore(d.url, TOKENS[tenant], **kw)


def _raw(d, method, path, body=b"", headers=None):
    req = urllib.request.Request(d.url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_concurrent_clients_byte_exact(daemon):
    errors: list[str] = []

    def worker(w: int) -> None:
        with _client(daemon) as c:
            ns = Namespace(model=f"model-{w % 2}", tokenizer="t")
            for r in range(6):
                toks = [w * 100_000 + r * 1000 + i for i in range(c.layout.tokens_per_block * 24)]
                keys = c.keys_for(ns, toks)
                blocks = torch.stack([block_for(k, c.block_bytes) for k in keys])
                st = c.store(ns, toks, blocks)
                if any(s not in (Status.OK, Status.EXISTS) for s in st):
                    errors.append(f"store {st}")
                hit = c.lookup(ns, toks)
                if hit.matched_blocks != len(keys):
                    errors.append(f"lookup {hit.matched_blocks}")
                stt, outs = c.load(hit.keys)
                if leading_ok(stt) != len(keys):
                    errors.append(f"load {stt}")
                for k, o in zip(keys, outs):
                    if not torch.equal(c.layout.as_bytes(o), block_for(k, c.block_bytes)):
                        errors.append("bytes differ")
                # into caller buffers, typed
                dests = [torch.empty(c.layout.block_shape, dtype=c.layout.dtype) for _ in keys[:3]]
                stt, _ = c.load(keys[:3], dests=dests)
                if not all(
                    torch.equal(c.layout.as_bytes(x), block_for(k, c.block_bytes))
                    for x, k in zip(dests, keys)
                ):
                    errors.append("dest bytes differ")

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []


def test_auth_rejects_missing_and_wrong_tokens(daemon):
    body = json.dumps({"namespace": "00" * 32, "keys": []}).encode()
    for hdrs in (
        {},
        {"Authorization": "Bearer nope-nope-nope-nope"},
        {"Authorization": TOKENS["acme"]},
        {"Authorization": "Basic " + TOKENS["acme"]},
    ):
        status, h, raw = _raw(
            daemon, "POST", "/v1/exists", body, {"Content-Type": "application/json", **hdrs}
        )
        assert status == 401
        assert json.loads(raw)["error"]["code"] == "unauthorized"
        assert h.get("WWW-Authenticate", "").startswith("Bearer")
    with pytest.raises(AuthError):
        RemoteKVStore(daemon.url, "wrong-token-wrong-token")


@pytest.mark.parametrize("owner,other", [("acme", "bravo"), ("bravo", "acme")])
def test_tenant_cannot_read_or_detect_other_tenant(daemon, owner, other):
    with _client(daemon, owner) as a, _client(daemon, other) as b:
        ns = Namespace(model=f"secret-{owner}", tenant=other)  # even claiming the other's tenant field
        toks = list(range(a.layout.tokens_per_block * 4))
        keys = a.keys_for(ns, toks)
        assert a.store(ns, toks, torch.stack([block_for(k, a.block_bytes) for k in keys])) == [Status.OK] * 4
        assert a.probe(ns, toks) == len(toks)
        # same namespace, same tokens, same client keys: nothing visible to the other tenant
        assert b.probe(ns, toks) == 0
        assert b.lookup(ns, toks).matched_blocks == 0
        st, outs = b.load(keys, ns=ns)
        assert st == [Status.MISS] * 4 and outs == [None] * 4
        assert b.pin(ns, toks, 5).keys == []
        assert b.prefetch(ns, toks).result() == 0
        assert b.invalidate(ns) == 0
        # the other tenant's store is a new, separate copy (OK, not EXISTS: no dedupe signal)
        assert b.store(ns, toks, torch.zeros(4, b.block_bytes, dtype=torch.uint8)) == [Status.OK] * 4
        # ...and does not change the owner's bytes; a lease id of the owner cannot be ended by the other
        lease = a.pin(ns, toks, 30)
        assert not b.unpin(lease)
        assert a.unpin(lease)
        st, outs = a.load(keys, ns=ns)
        assert all(torch.equal(a.layout.as_bytes(o), block_for(k, a.block_bytes)) for k, o in zip(keys, outs))
        assert b.invalidate(ns) == 4
        assert a.probe(ns, toks) == len(toks)
        assert a.invalidate(ns) == 4


def test_public_namespace_shared_only_as_declared(daemon):
    pub = Namespace(**PUBLIC_NS)
    with _client(daemon, "acme") as a, _client(daemon, "bravo") as b:
        toks = list(range(7, 7 + a.layout.tokens_per_block * 3))
        keys = a.keys_for(pub, toks)
        assert a.store(pub, toks, torch.stack([block_for(k, a.block_bytes) for k in keys])) == [Status.OK] * 3
        st, outs = b.load(b.keys_for(pub, toks))
        assert leading_ok(st) == 3
        assert all(torch.equal(b.layout.as_bytes(o), block_for(k, b.block_bytes)) for k, o in zip(keys, outs))
        with pytest.raises(AuthError) as ei:  # bravo is a reader, not a writer
            b.store(pub, toks, torch.zeros(3, b.block_bytes, dtype=torch.uint8))
        assert ei.value.status == 403
        with pytest.raises(AuthError):
            b.invalidate(pub)
        # a namespace with the same fields but another tenant value is private, not public
        priv = Namespace(model=PUBLIC_NS["model"], tenant="bravo")
        assert b.probe(priv, toks) == 0


def test_load_of_a_lookup_result_hits_in_a_public_and_a_private_namespace(daemon):
    """Fresh-user trial 9: ``load(lookup(pub, toks))`` missed every block of a public namespace (the
    hit's namespace digest, already scoped to the layout, was scoped a second time by the client),
    while ``load(keys)`` and the node client's ``load(hit)`` hit; the README's own usage."""
    pub = Namespace(**PUBLIC_NS)
    priv = Namespace(model="trial9", tenant="acme")
    with _client(daemon, "acme") as a, _client(daemon, "bravo") as b:
        for ns, readers in ((pub, (a, b)), (priv, (a,))):
            toks = list(range(11, 11 + a.layout.tokens_per_block * 4))
            keys = a.keys_for(ns, toks)
            blocks = torch.stack([block_for(k, a.block_bytes) for k in keys])
            assert a.store(ns, toks, blocks) == [Status.OK] * 4
            for c in readers:
                hit = c.lookup(ns, toks)
                assert hit.useful_blocks == 4
                st, outs = c.load(hit)
                assert st == [Status.OK] * 4, (ns.tenant, st)
                assert all(torch.equal(c.layout.as_bytes(o), blk) for o, blk in zip(outs, blocks))


def test_quota_is_a_retryable_429(daemon):
    with _client(daemon, "carol") as c:  # carol: 64 KiB = 8 blocks
        ns = Namespace(model="q")
        toks = list(range(c.layout.tokens_per_block * 12))
        blocks = torch.zeros(12, c.block_bytes, dtype=torch.uint8)
        assert c.store(ns, toks[: c.layout.tokens_per_block * 8], blocks[:8]) == [Status.OK] * 8
        with pytest.raises(QuotaExceeded):
            c.store(ns, toks, blocks[8:], start_block=8)
        status, hdrs, raw = _raw(
            daemon,
            "PUT",
            "/v1/blocks",
            encode_prefix({"namespace": c.digest(ns).hex(), "keys": [c.keys_for(ns, toks)[9].hex()]})
            + bytes(c.block_bytes),
            {"Authorization": f"Bearer {TOKENS['carol']}", "Content-Type": BLOCKS_CONTENT_TYPE},
        )
        assert status == 429 and int(hdrs["Retry-After"]) >= 1
        assert json.loads(raw)["error"]["code"] == "quota_exceeded"
        assert c.invalidate(ns) == 8
        assert c.store(ns, toks[: c.layout.tokens_per_block * 4], blocks[:4]) == [Status.OK] * 4


def test_oversized_and_malformed(daemon):
    auth = {"Authorization": f"Bearer {TOKENS['acme']}"}
    big = make_config("/x")["limits"]["max_request_bytes"]
    assert big == "4MiB"
    n = (4 << 20) // 8192 + 1
    man = encode_prefix({"namespace": "ab" * 32, "keys": [f"{i:064x}" for i in range(n)]})
    status, _, raw = _raw(
        daemon, "PUT", "/v1/blocks", man + bytes(n * 8192), {**auth, "Content-Type": BLOCKS_CONTENT_TYPE}
    )
    assert status == 413
    status, _, raw = _raw(
        daemon, "POST", "/v1/exists", b"{not json", {**auth, "Content-Type": "application/json"}
    )
    assert status == 400 and json.loads(raw)["error"]["code"] == "bad_json"
    js = {**auth, "Content-Type": "application/json"}
    status, _, raw = _raw(daemon, "POST", "/v1/exists", json.dumps({"namespace": 5, "keys": []}).encode(), js)
    assert status == 400
    status, _, raw = _raw(
        daemon, "POST", "/v1/exists", json.dumps({"namespace": "zz", "keys": []}).encode(), js
    )
    assert status == 400 and "namespace" in json.loads(raw)["error"]["message"]
    # a JSON body sent as a form (urllib's default Content-Type) is refused as the OpenAPI document says
    status, _, raw = _raw(
        daemon, "POST", "/v1/exists", json.dumps({"namespace": "zz", "keys": []}).encode(), auth
    )
    assert status == 415 and json.loads(raw)["error"]["code"] == "unsupported_media_type"
    # put whose payload is one block short
    man = encode_prefix({"namespace": "ab" * 32, "keys": ["cd" * 32, "ef" * 32]})
    status, _, raw = _raw(
        daemon, "PUT", "/v1/blocks", man + bytes(8192), {**auth, "Content-Type": BLOCKS_CONTENT_TYPE}
    )
    assert status == 400 and json.loads(raw)["error"]["code"] == "bad_length"


def test_ops_endpoints(daemon):
    assert daemon.get("/healthz")[0] == 200
    assert daemon.get("/readyz")[0] == 200
    status, body = daemon.get("/metrics")
    text = body.decode()
    assert status == 200
    for name in (
        'tierstore_tier_bytes{tier="host"}',
        "tierstore_load_latency_seconds_bucket",
        "tierstore_nvme_host_write_amplification",
        'tierstore_nvme_events_total{counter="recovery_damaged_extents"} 0.0',  # trial 10: not shown
        'tierstore_nvme_events_total{counter="recovered_blocks"}',
        'tierstore_nvme_events_total{counter="preallocate_errors"} 0.0',  # trial 11: not exported
        "tierstore_nvme_usable_bytes ",  # trial 11: a tier shrunk by a full file system looked whole
        'tierstore_tenant_usage_bytes{tenant="acme"}',
        'tierstore_tenant_quota_bytes{tenant="acme"} 6.7108864e+07',
        'tierstore_tenant_quota_bytes{tenant="bravo"} +Inf',  # no quota; was 4.611686018427388e+18
        "tierstore_blocks_total",
        "tierstore_manager_events_total",
    ):
        assert name in text
    # access logs are off in this config; the startup lines are JSON
    assert any(r.get("event") == "listening" for r in daemon.records())


def test_overload_429_then_sigterm_drains_and_restart_serves(tmp_path):
    cfg = make_config(str(tmp_path), metrics={"host": "127.0.0.1", "port": 0})
    cfg["limits"]["max_inflight_requests"] = 1
    d = Daemon(str(tmp_path), cfg).start()
    with _client(d) as c:
        ns = Namespace(model="drain")
        toks = list(range(c.layout.tokens_per_block * 40))
        keys = c.keys_for(ns, toks)
        assert c.store(ns, toks, torch.stack([block_for(k, c.block_bytes) for k in keys])) == [Status.OK] * 40
    # overload: 6 clients without retries against max_inflight_requests=1
    outcomes: list[str] = []

    hammers = [_client(d) for _ in range(6)]
    for h in hammers:
        h.retries = 0

    def hammer(h: RemoteKVStore) -> None:
        with h:
            for _ in range(10):
                try:
                    st, outs = h.load(keys, ns=ns)
                except ServerBusy as e:
                    outcomes.append(e.code)
                    continue
                ok = st == [Status.OK] * 40 and all(
                    torch.equal(h.layout.as_bytes(o), block_for(k, h.block_bytes)) for k, o in zip(keys, outs)
                )
                outcomes.append("ok" if ok else "corrupt")

    ths = [threading.Thread(target=hammer, args=(h,)) for h in hammers]
    for t in ths:
        t.start()
    for t in ths:
        t.join(60)
    assert set(outcomes) <= {"ok", "overloaded"} and "ok" in outcomes
    assert "overloaded" in outcomes  # 60 concurrent loads against a limit of 1
    with _client(d) as c:
        inv = Namespace(model="gone")
        assert c.store(inv, toks[:64], torch.zeros(2, c.block_bytes, dtype=torch.uint8)) == [Status.OK] * 2
        assert c.invalidate(inv) == 2
    # a put in flight when SIGTERM arrives: its body is half sent; the drain lets it finish
    late_key = os.urandom(32)
    body = encode_prefix({"namespace": c.digest(ns).hex(), "keys": [late_key.hex()]}) + bytes(
        block_for(late_key, c.block_bytes).numpy()
    )
    sock = socket.create_connection(("127.0.0.1", d.port), timeout=20)
    sock.sendall(
        (
            f"PUT /v1/blocks HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKENS['acme']}\r\n"
            f"Content-Type: {BLOCKS_CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        + body[: len(body) // 2]
    )
    time.sleep(0.3)
    d.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    sock.sendall(body[len(body) // 2 :])
    resp = b""
    while b"\r\n\r\n" not in resp or not resp.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        resp += chunk
    sock.close()
    assert resp.startswith(b"HTTP/1.1 200") and b'"ok"' in resp, resp[:300]
    assert d.proc.wait(30) == 0
    assert any(r.get("event") == "stopped" for r in d.records())
    d.start()
    with _client(d) as c:
        st, outs = c.load(keys + [late_key], ns=ns)
        assert leading_ok(st) == 41
        assert torch.equal(c.layout.as_bytes(outs[40]), block_for(late_key, c.block_bytes))
        assert all(torch.equal(c.layout.as_bytes(o), block_for(k, c.block_bytes)) for k, o in zip(keys, outs))
        assert c.probe(Namespace(model="gone"), toks[:64]) == 0  # invalidation survived the restart
    assert d.stop() == 0


def test_bad_config_exit_code(tmp_path, capsys):
    from tierstore.server.daemon import main

    p = tmp_path / "bad.yaml"
    cfg = make_config(str(tmp_path))
    cfg["tiers"]["host"]["capacity_bytes"] = "lots"
    cfg["limits"]["frobnicate"] = 1
    import yaml

    p.write_text(yaml.safe_dump(cfg))
    assert main(["--config", str(p)]) == 2
    err = capsys.readouterr().err
    assert "tiers.host.capacity_bytes='lots'" in err and "16MiB" in err
    assert "limits.frobnicate: unknown key" in err and "max_request_bytes" in err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert main([]) == 2


def test_shipped_example_configs_are_valid():
    """Both shipped configs validate; whether they fit this machine is tests/server/test_check.py's part."""
    from tierstore.server.config import load_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for name in ("daemon.yaml", "daemon-small.yaml"):
        load_config(os.path.join(root, "configs", name))


def test_the_systemd_unit_gives_the_shipped_config_every_path_it_writes():
    """Fresh-user trial 8: configs/tierstore.service (ProtectSystem=strict, PrivateTmp) had no
    RuntimeDirectory, so configs/daemon.yaml's node socket in /run/tierstore failed the unit's
    ExecStartPre --check (exit 2, no restart) and a directory made by hand went with a reboot."""
    import configparser

    from tierstore.server.config import load_config

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]  # systemd keys are case-sensitive
    unit.read(os.path.join(root, "configs", "tierstore.service"))
    svc = unit["Service"]
    writable = ["/run/" + d for d in svc.get("RuntimeDirectory", "").split()]
    writable += ["/var/lib/" + d for d in svc.get("StateDirectory", "").split()]
    writable += svc.get("ReadWritePaths", "").split()
    cfg = load_config(os.path.join(root, "configs", "daemon.yaml"))

    def inside(path: str) -> bool:
        return any(os.path.commonpath([path, w]) == w for w in writable)

    assert cfg.node is not None and inside(os.path.dirname(cfg.node.socket)), (cfg.node, writable)
    assert inside(cfg.state_dir), (cfg.state_dir, writable)
    assert inside(cfg.tiers.nvme.path), (cfg.tiers.nvme.path, writable)


def test_openapi_document_matches_routes(tmp_path):
    import yaml

    from tierstore.server.config import parse_config
    from tierstore.server.service import Service

    cfg = make_config(str(tmp_path))
    cfg["tiers"] = {"host": {"capacity_bytes": "1MiB"}}
    cfg["puts"] = {"durable": False}
    svc = Service(parse_config(cfg))
    try:
        routes = {
            (r.method.lower(), r.resource.canonical)
            for r in svc.make_app().router.routes()
            if r.method != "HEAD"
        }
    finally:
        svc.close()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with open(os.path.join(root, "tierstore", "server", "openapi.yaml")) as f:
        doc = yaml.safe_load(f)
    assert doc["openapi"].startswith("3.")
    documented = {(m, p) for p, ops in doc["paths"].items() for m in ops}
    assert documented == routes


def test_host_tier_is_prefaulted_at_start(tmp_path):
    """The daemon faults its host tier in before serving (issue 25): a put's copy into a slot
    touched for the first time took 1.2 ms of a 2 MiB put's 2 ms host copy in the profile."""
    from tierstore.contract import Tier
    from tierstore.server.config import parse_config
    from tierstore.server.service import Service

    from ..tiers.test_memory_prefault import resident_fraction

    cfg = make_config(str(tmp_path))
    cfg["tiers"]["host"] = {"capacity_bytes": "64MiB"}  # over glibc's largest mmap threshold: fresh pages
    svc = Service(parse_config(cfg))
    try:
        pool = svc.store._parts.pools[Tier.HOST]  # the pool the store copies into
        assert resident_fraction(pool.data) == 1.0
    finally:
        svc.close()


def test_restart_with_another_layout_serves_nothing_old_and_charges_nothing(tmp_path):
    """Same block size, other geometry: the old blocks are unaddressable, so they are not served
    and not charged to their owner's quota; they are kept (not removed) and leave by eviction."""
    cfg = make_config(str(tmp_path))
    d = Daemon(str(tmp_path), cfg).start()
    try:
        with _client(d, "carol") as c:  # carol: 64 KiB = 8 blocks, all used
            ns = Namespace(model="relayout")
            toks = list(range(c.layout.tokens_per_block * 8))
            assert c.store(ns, toks, torch.ones(8, c.block_bytes, dtype=torch.uint8)) == [Status.OK] * 8
    finally:
        assert d.stop() == 0
    cfg["layout"] = dict(cfg["layout"], num_kv_heads=2, head_dim=32)  # same 8 KiB blocks
    d = Daemon(str(tmp_path), cfg).start()
    try:
        rec = [r for r in d.records() if r.get("event") == "recovered"][-1]
        assert rec["blocks"] == 8 and rec["unaddressable"] == 8
        with _client(d, "carol") as c:
            ns = Namespace(model="relayout")
            toks = list(range(c.layout.tokens_per_block * 8))
            assert c.lookup(ns, toks).matched_blocks == 0
            assert c.store(ns, toks, torch.zeros(8, c.block_bytes, dtype=torch.uint8)) == [Status.OK] * 8
            st, outs = c.load(c.keys_for(ns, toks))
            assert st == [Status.OK] * 8 and all(int(o.sum()) == 0 for o in outs)
    finally:
        assert d.stop() == 0


def test_a_start_with_a_fresh_state_dir_keeps_the_durable_blocks_and_charges_them_again(tmp_path):
    """One start with a new (or replaced, or damaged) ``state_dir`` removed every recovered block as
    unaddressable: acknowledged durable blocks lost for good (fresh-user trial 11). They are kept:
    their tenant finds them (storage keys do not depend on state_dir), exact; they count against its
    quota again from its first put in their namespace; the original state_dir serves them too."""
    cfg = make_config(str(tmp_path))
    data = torch.randint(0, 255, (8, 8192), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    ns = Namespace(model="keep")
    d = Daemon(str(tmp_path), cfg).start()
    try:
        with _client(d, "carol") as c:  # carol: 64 KiB = 8 blocks
            assert c.block_bytes == 8192
            toks = list(range(c.layout.tokens_per_block * 8))
            assert c.store(ns, toks, data) == [Status.OK] * 8
    finally:
        assert d.stop() == 0
    original = cfg["state_dir"]
    cfg["state_dir"] = str(tmp_path / "state-new")
    d = Daemon(str(tmp_path), cfg).start()
    try:
        rec = [r for r in d.records() if r.get("event") == "recovered"][-1]
        assert rec["blocks"] == 8 and rec["unaddressable"] == 8
        warn = [r for r in d.records() if r.get("event") == "unaddressable"]
        assert warn and warn[-1]["blocks"] == 8 and warn[-1]["namespaces"] == 1
        with _client(d, "carol") as c:
            st, outs = c.load(c.lookup(ns, toks))
            assert st == [Status.OK] * 8 and all(
                torch.equal(c.layout.as_bytes(o), data[i]) for i, o in enumerate(outs)
            )
            more = list(range(10**6, 10**6 + c.layout.tokens_per_block))
            with pytest.raises(QuotaExceeded):  # the 8 kept blocks are carol's 64 KiB again
                c.store(ns, more, data[:1])
    finally:
        assert d.stop() == 0
    cfg["state_dir"] = original
    d = Daemon(str(tmp_path), cfg).start()
    try:
        rec = [r for r in d.records() if r.get("event") == "recovered"][-1]
        assert rec["blocks"] == 8 and rec["unaddressable"] == 0
        with _client(d, "carol") as c:
            st, outs = c.load(c.lookup(ns, toks))
            assert st == [Status.OK] * 8 and all(
                torch.equal(c.layout.as_bytes(o), data[i]) for i, o in enumerate(outs)
            )
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("which", ["listen", "metrics"])
def test_a_taken_port_fails_start_up_before_the_store_opens(tmp_path, monkeypatch, which):
    """Fresh-user trial 7: with its port taken, the daemon recovered its NVMe tier first (minutes on
    a large tier) and only then failed to bind. The ports are bound first now: exit 1 at once, the
    store never built (its NVMe file not even created)."""
    import asyncio

    from tierstore.server import daemon, service
    from tierstore.server.config import parse_config

    def no_store(cfg):
        raise AssertionError("the store was opened before the ports were bound")

    monkeypatch.setattr(service, "Service", no_store)
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = taken.getsockname()[1]
        cfg = make_config(str(tmp_path))
        if which == "listen":
            cfg["listen"] = {"host": "127.0.0.1", "port": port}
        else:
            cfg["metrics"] = {"host": "127.0.0.1", "port": port}
        assert asyncio.run(daemon.serve(parse_config(cfg))) == 1
    finally:
        taken.close()
    assert not os.path.exists(tmp_path / "nvme")
