"""Protocol details of the daemon (issue 19, items 12 and 15): huge integers, Content-Type, UTF-8,
the Authorization scheme, and what the block hit ratio counts."""

from __future__ import annotations

import json
import os
import re
import urllib.error
import urllib.request

import pytest
import torch
import yaml

from tierstore import Namespace
from tierstore.client import RemoteKVStore
from tierstore.server.protocol import BLOCKS_CONTENT_TYPE, PREFIX

from .conftest import ROOT, TOKENS
from .helpers import block_for

AUTH = {"Authorization": f"Bearer {TOKENS['acme']}"}
JSON = {**AUTH, "Content-Type": "application/json"}
NS = "ab" * 32
KEY = "cd" * 32
#: every JSON endpoint with a body that its model accepts
JSON_ENDPOINTS = {
    "/v1/blocks/get": {"namespace": NS, "keys": [KEY]},
    "/v1/exists": {"namespace": NS, "keys": [KEY]},
    "/v1/lookup": {"namespace": NS, "keys": [KEY]},
    "/v1/pin": {"namespace": NS, "keys": [KEY], "lease_s": 5},
    "/v1/unpin": {"lease_id": 1},
    "/v1/prefetch": {"namespace": NS, "keys": [KEY]},
    "/v1/invalidate": {"namespace": NS},
}
HUGE = b"1" * 5000  # more digits than int() converts by default (sys.get_int_max_str_digits() = 4300)


def _raw(d, method, path, body=b"", headers=None):
    req = urllib.request.Request(d.url + path, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=20) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def _with_huge(doc: dict, field: str) -> bytes:
    """``doc`` as JSON with ``field`` set to a 5,000-digit integer (json.dumps cannot write one)."""
    text = json.dumps({**doc, field: 0})
    return text.replace(f'"{field}": 0', f'"{field}": {HUGE.decode()}').encode()


@pytest.mark.parametrize("path", sorted(JSON_ENDPOINTS))
def test_huge_json_integer_is_a_400_on_every_json_endpoint(daemon, path):
    """json.loads raises ValueError for > 4,300 digits; the daemon answered 500."""
    doc = JSON_ENDPOINTS[path]
    for field in [*doc, "promote", "first_position"]:
        status, _, raw = _raw(daemon, "POST", path, _with_huge(doc, field), JSON)
        assert status == 400, (field, raw[:300])
        err = json.loads(raw)["error"]
        assert err["code"] == "bad_json" and "4300" in err["message"]
    status, _, raw = _raw(daemon, "POST", path, b"[" * 200_000 + b"]" * 200_000, JSON)
    assert status in (400, 413) and json.loads(raw)["error"]["code"] in ("bad_json", "too_large")
    status, _, raw = _raw(daemon, "POST", path, b'{"a":' * 50_000 + b"1" + b"}" * 50_000, JSON)
    assert status == 400 and "nested too deeply" in json.loads(raw)["error"]["message"]


@pytest.mark.parametrize("field", ["first_position", "namespace", "lifetime", "keys"])
def test_huge_integer_in_a_put_manifest_is_a_400(daemon, field):
    man = _with_huge({"namespace": NS, "keys": [KEY]}, field)
    body = PREFIX.pack(len(man)) + man + bytes(8192)
    status, _, raw = _raw(daemon, "PUT", "/v1/blocks", body, {**AUTH, "Content-Type": BLOCKS_CONTENT_TYPE})
    assert status == 400 and json.loads(raw)["error"]["code"] == "bad_json"


@pytest.mark.parametrize("path", sorted(JSON_ENDPOINTS))
def test_json_endpoints_require_application_json(daemon, path):
    body = json.dumps(JSON_ENDPOINTS[path]).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", BLOCKS_CONTENT_TYPE, None):
        hdrs = dict(AUTH) if ctype is None else {**AUTH, "Content-Type": ctype}
        status, _, raw = _raw(daemon, "POST", path, body, hdrs)
        assert status == 415, (ctype, raw[:200])
        assert json.loads(raw)["error"]["code"] == "unsupported_media_type"
    status, _, _ = _raw(
        daemon, "POST", path, body, {**AUTH, "Content-Type": "application/json; charset=utf-8"}
    )
    assert status < 300


def test_openapi_lists_415_for_every_json_request_body():
    with open(os.path.join(ROOT, "tierstore", "server", "openapi.yaml")) as f:
        doc = yaml.safe_load(f)
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            content = op.get("requestBody", {}).get("content", {})
            if content:
                assert "415" in op["responses"], (method, path)
    assert "case-insensitive" in doc["info"]["description"]


def test_non_utf8_bodies_are_a_400_that_says_utf8(daemon):
    """A non-UTF-8 manifest gave an error about utf-16-le (json.loads guesses the encoding of bytes),
    and a UTF-16 JSON body was accepted."""
    man = b'{"namespace": "\xff\xfe", "keys": []}'
    body = PREFIX.pack(len(man)) + man
    status, _, raw = _raw(daemon, "PUT", "/v1/blocks", body, {**AUTH, "Content-Type": BLOCKS_CONTENT_TYPE})
    msg = json.loads(raw)["error"]["message"]
    assert status == 400 and "not UTF-8" in msg and "0xff at offset 15" in msg and "utf-16" not in msg.lower()
    utf16 = json.dumps(JSON_ENDPOINTS["/v1/exists"]).encode("utf-16")
    status, _, raw = _raw(daemon, "POST", "/v1/exists", utf16, JSON)
    assert status == 400 and "not UTF-8" in json.loads(raw)["error"]["message"]


def test_bearer_scheme_is_case_insensitive(daemon):
    """RFC 7235 section 2.1: the auth-scheme is case-insensitive; 'bearer <token>' got 401."""
    for header in (
        f"bearer {TOKENS['acme']}",
        f"BEARER {TOKENS['acme']}",
        f"Bearer  {TOKENS['acme']}",
        f"bEaReR {TOKENS['acme']} ",
    ):
        status, _, raw = _raw(daemon, "GET", "/v1/info", None, {"Authorization": header})
        assert status == 200 and json.loads(raw)["tenant"] == "acme", header
    for header in (
        f"Bearerx {TOKENS['acme']}",
        f"Basic {TOKENS['acme']}",
        "bearer",
        "bearer ",
        TOKENS["acme"],
    ):
        status, hdrs, _ = _raw(daemon, "GET", "/v1/info", None, {"Authorization": header})
        assert status == 401 and hdrs["WWW-Authenticate"].startswith("Bearer"), header


def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, flags=re.M)
    return float(m.group(1)) if m else 0.0


def test_block_hit_ratio_counts_gets(daemon):
    """tierstore_block_hit_ratio read 0.0 after hundreds of successful gets and no lookups."""

    def scrape():
        return daemon.get("/metrics")[1].decode()

    before = scrape()
    with RemoteKVStore(daemon.url, TOKENS["acme"]) as c:
        ns = Namespace(model="hit-ratio")
        toks = list(range(c.layout.tokens_per_block * 6))
        keys = c.keys_for(ns, toks)
        c.store(ns, toks, torch.stack([block_for(k, c.block_bytes) for k in keys]))
        for _ in range(5):
            st, _ = c.load(keys)  # 6 OK each
        c.load(c.keys_for(Namespace(model="hit-ratio-missing"), toks))  # 6 misses
    after = scrape()
    d_req = _metric(after, "tierstore_block_requests_total", '{op="get"}') - _metric(
        before, "tierstore_block_requests_total", '{op="get"}'
    )
    d_hit = _metric(after, "tierstore_block_hits_total", '{op="get"}') - _metric(
        before, "tierstore_block_hits_total", '{op="get"}'
    )
    assert (d_req, d_hit) == (36, 30)
    asked = sum(
        _metric(after, "tierstore_block_requests_total", f'{{op="{op}"}}') for op in ("get", "lookup")
    )
    found = sum(_metric(after, "tierstore_block_hits_total", f'{{op="{op}"}}') for op in ("get", "lookup"))
    assert found / asked > 0
    assert _metric(after, "tierstore_block_hit_ratio") == pytest.approx(found / asked)


BAD_LEASES = [float("nan"), float("inf"), 1e12, 0, -1]


def test_a_lease_that_is_not_a_finite_bounded_number_of_seconds_is_refused(daemon):
    """Fresh-user trial: lease_s=nan was accepted by the embedded store; the daemon and its client
    share one check (tierstore.units.check_duration_s): a 400 naming lease_s on the wire, a
    ConfigError in the client before any request."""
    from tierstore.errors import ConfigError

    for bad in BAD_LEASES:
        body = json.dumps({"namespace": NS, "keys": [KEY], "lease_s": bad}).encode()  # NaN, Infinity
        status, _, raw = _raw(daemon, "POST", "/v1/pin", body, JSON)
        assert status == 400 and b"lease_s=" in raw and b"finite" in raw, (bad, raw)
    with RemoteKVStore(daemon.url, TOKENS["acme"]) as c:
        ns = Namespace(model="leases")
        toks = list(range(c.layout.tokens_per_block))
        for bad in BAD_LEASES:
            with pytest.raises(ConfigError, match="lease_s="):
                c.pin(ns, toks, lease_s=bad)
            with pytest.raises(ConfigError, match="timeout_s="):
                c.load(c.keys_for(ns, toks), timeout_s=bad)
        assert c.pin(ns, toks, lease_s=5).lease_id > 0


def test_overlapping_load_destinations_are_refused_before_any_request(daemon):
    """Fresh-user trial: load(keys, dests=[t] * 8) returned all OK, each block overwriting the last."""
    from tierstore.errors import LayoutError

    with RemoteKVStore(daemon.url, TOKENS["acme"]) as c:
        keys = c.keys_for(Namespace(model="dests"), list(range(2 * c.layout.tokens_per_block)))
        t = torch.empty(c.block_bytes, dtype=torch.uint8)
        with pytest.raises(LayoutError, match="same memory|overlap"):
            c.load(keys, dests=[t, t])
        raw = torch.empty(2 * c.block_bytes - 1, dtype=torch.uint8)
        with pytest.raises(LayoutError, match="overlap"):
            c.load(keys, dests=[raw[: c.block_bytes], raw[c.block_bytes - 1 :]])


@pytest.mark.parametrize("first_position", [10**30, 2**31])
def test_a_chain_position_past_int32_in_a_put_manifest_is_a_400(daemon, first_position):
    """``"first_position": 10**30`` answered 500 (numpy's OverflowError in the index): trial 4a."""
    man = json.dumps({"namespace": NS, "keys": [KEY], "first_position": first_position}).encode()
    body = PREFIX.pack(len(man)) + man + bytes(8192)
    status, _, raw = _raw(daemon, "PUT", "/v1/blocks", body, {**AUTH, "Content-Type": BLOCKS_CONTENT_TYPE})
    assert status == 400, raw[:300]
    assert "first_position" in json.loads(raw)["error"]["message"]
