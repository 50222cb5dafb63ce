"""Fuzz the daemon with >= 10,000 malformed requests (hypothesis): no 5xx, no hang, clear 4xx."""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import socket
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import TOKENS

ENDPOINTS = [
    ("PUT", "/v1/blocks"),
    ("POST", "/v1/blocks/get"),
    ("POST", "/v1/exists"),
    ("POST", "/v1/lookup"),
    ("POST", "/v1/pin"),
    ("POST", "/v1/unpin"),
    ("POST", "/v1/prefetch"),
    ("POST", "/v1/invalidate"),
    ("GET", "/v1/info"),
    ("GET", "/v1/blocks"),
    ("DELETE", "/v1/exists"),
    ("POST", "/v1/nope"),
    ("PATCH", "/v1/blocks"),
    ("POST", "/v1/blocks"),
]
AUTH = st.sampled_from(
    [
        None,
        f"Bearer {TOKENS['acme']}",
        f"Bearer {TOKENS['bravo']}",
        "Bearer ",
        "Bearer x",
        TOKENS["acme"],
        f"Basic {TOKENS['acme']}",
        f"Bearer {TOKENS['acme']}x",
    ]
)
CTYPE = st.sampled_from(
    [
        None,
        "application/json",
        "application/x-tierstore-blocks",
        "text/plain",
        "multipart/form-data; boundary=x",
        "application/x-tierstore-blocks; charset=utf-8",
    ]
)
# Cheap draws keep 10k examples fast: values come from a pool of valid and wrong-typed
# values, picked by index; only lengths and a few bytes are drawn freely.
_HEX = [hashlib.sha256(bytes([i])).hexdigest() for i in range(4)]
VALUES = [
    None,
    True,
    False,
    0,
    -1,
    1,
    2**31,
    2**64,
    -(2**63),
    1.5,
    -0.0,
    1e308,
    float("inf"),
    "",
    "x",
    "ok",
    "\u00e9\u0000",
    [],
    [1],
    ["a"],
    {},
    {"a": 1},
    [[]],
    {"keys": []},
    "0" * 64,
    "g" * 64,
    "0" * 63,
    "0" * 65,
    _HEX[0],
    _HEX[1].upper(),
    [_HEX[0]],
    [_HEX[1], _HEX[2]],
    [_HEX[0], _HEX[0]],
    _HEX,
    [_HEX[0], 5],
    [_HEX[0][:-1]],
    "system",
    "query",
    30,
    0.001,
    1e9,
    10**30,
    1,
    2,
    3,
]
FIELDS = ["namespace", "keys", "promote", "lease_s", "lease_id", "first_position", "lifetime", "surprise"]
BLOCK = 8192
N_EXAMPLES = int(os.environ.get("TIERSTORE_FUZZ_EXAMPLES", "10000"))


#: JSON that json.loads refuses with ValueError / RecursionError rather than JSONDecodeError: integers
#: of more digits than int() converts (4300 by default), nesting deeper than the parser recurses
_HUGE_INTS = [b"1" * 4301, b"-" + b"9" * 5000]


@st.composite
def bodies(draw):
    kind = draw(st.integers(0, 9))
    if kind >= 8:  # parser limits (issue 19 item 12: these were 500s), as a JSON body or a put manifest
        if kind == 8:
            field = FIELDS[draw(st.integers(0, len(FIELDS) - 1))]
            raw = b'{"namespace": "%s", "keys": [], "%s": %s}' % (
                _HEX[0].encode(),
                field.encode(),
                draw(st.sampled_from(_HUGE_INTS)),
            )
        else:
            depth = draw(st.sampled_from([1_100, 5_000]))
            raw = b'{"keys":' + b"[" * depth + b"]" * depth + b"}"
        if draw(st.booleans()):
            return struct.pack("<I", len(raw)) + raw + b"\x5a" * BLOCK * draw(st.integers(0, 1))
        return raw
    if kind == 0:
        return b""
    if kind == 1:
        return draw(st.binary(max_size=24))
    mask = draw(st.integers(0, 255))
    picks = draw(st.lists(st.integers(0, len(VALUES) - 1), min_size=len(FIELDS), max_size=len(FIELDS)))
    doc = {f: VALUES[i] for b, (f, i) in enumerate(zip(FIELDS, picks)) if mask >> b & 1}
    if kind == 2:
        doc = VALUES[picks[0]]
    raw = json.dumps(doc).encode()
    cut = draw(st.integers(0, len(raw) + 2))
    if kind <= 4:
        return raw if cut >= len(raw) else raw[:cut]
    how = draw(st.integers(0, 3))
    mlen = {0: len(raw), 1: cut, 2: draw(st.integers(0, 2**32 - 1)), 3: len(raw) + 1}[how]
    payload = b"\x5a" * max(0, draw(st.integers(0, 2)) * BLOCK + draw(st.integers(-3, 3)))
    return struct.pack("<I", mlen) + raw + payload


class Conn:
    """One keep-alive connection, reopened when the server closes it."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

    def request(self, method, path, body, headers):
        for attempt in range(2):
            try:
                self.c.request(method, path, body=body, headers=headers)
                r = self.c.getresponse()
                data = r.read()
                if r.getheader("Connection", "").lower() == "close":
                    self.c.close()
                return r.status, r.getheader("Content-Type", ""), data
            except (
                http.client.RemoteDisconnected,
                BrokenPipeError,
                ConnectionResetError,
                http.client.CannotSendRequest,
                http.client.ResponseNotReady,
            ):
                self.c.close()
                self.c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
                if attempt:
                    raise
        raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def conn(daemon):
    c = Conn(daemon.port)
    yield c
    c.c.close()


def _check(status: int, ctype: str, data: bytes, path: str) -> None:
    assert status < 500, (status, data[:300])
    if status >= 400:
        if ctype.startswith("application/json"):
            err = json.loads(data)["error"]
            assert err["code"] and err["message"]
        else:  # malformed HTTP itself (e.g. a control character in a header): aiohttp's parser answers
            assert status == 400, (status, data[:200])


REQUEST = st.tuples(
    st.sampled_from(ENDPOINTS),
    AUTH,
    CTYPE,
    bodies(),
    st.sampled_from(
        [
            {},
            {},
            {"Accept": "*/*"},
            {"X-Junk": "\x7f~!"},
            {"Range": "bytes=0-1"},
            {"Expect": "100-continue"},
            {"Content-Encoding": "gzip"},
            {"Accept": "text/html"},
        ]
    ),
)
PER_EXAMPLE = 4  # requests per hypothesis example (amortises the engine's per-example cost)
SENT = {"requests": 0}


@settings(
    max_examples=-(-N_EXAMPLES // PER_EXAMPLE),
    deadline=None,
    database=None,
    derandomize=True,
    suppress_health_check=list(HealthCheck),
)
@given(reqs=st.lists(REQUEST, min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
def test_fuzz_requests(daemon, conn, reqs):
    for (method, path), auth, ctype, body, junk in reqs:
        headers = dict(junk)
        if auth is not None:
            headers["Authorization"] = auth
        if ctype is not None:
            headers["Content-Type"] = ctype
        status, rtype, data = conn.request(method, path, body if method != "GET" or body else None, headers)
        SENT["requests"] += 1
        _check(status, rtype, data, path)


def test_fuzz_sent_enough():
    """The first fuzz test really sent >= N_EXAMPLES malformed requests (10,000 by default)."""
    assert SENT["requests"] >= N_EXAMPLES


@settings(
    max_examples=150, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
)
@given(
    path=st.sampled_from(["/v1/blocks", "/v1/exists", "/v1/blocks/get"]),
    body=bodies(),
    claimed_extra=st.integers(1, 1 << 20),
    garbage_header=st.booleans(),
)
def test_fuzz_truncated_and_lying_lengths(daemon, path, body, claimed_extra, garbage_header):
    """Content-Length larger than the bytes sent, then half-close: an answer or a close, never a hang."""
    method = "PUT" if path == "/v1/blocks" else "POST"
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKENS['acme']}\r\n"
        f"Content-Type: application/x-tierstore-blocks\r\nContent-Length: {len(body) + claimed_extra}\r\n"
    )
    if garbage_header:
        head += "X-Bad: \x01\x02\r\nContent-Length: 3\r\n"
    s = socket.create_connection(("127.0.0.1", daemon.port), timeout=10)
    try:
        s.sendall(head.encode() + b"\r\n" + body)
        s.shutdown(socket.SHUT_WR)
        resp = b""
        while True:
            chunk = s.recv(65536)  # socket.timeout here = a hang = failure
            if not chunk:
                break
            resp += chunk
    finally:
        s.close()
    if resp:
        status = int(resp.split(b" ", 2)[1])
        assert 400 <= status < 500, resp[:300]


def test_daemon_still_serves_after_fuzz(daemon):
    import torch

    from tierstore import Namespace
    from tierstore.client import RemoteKVStore

    assert daemon.get("/healthz")[0] == 200
    with RemoteKVStore(daemon.url, TOKENS["acme"]) as c:
        ns = Namespace(model="after-fuzz")
        toks = list(range(c.layout.tokens_per_block * 2))
        blocks = torch.arange(2 * c.block_bytes, dtype=torch.int64).remainder(251).to(torch.uint8).view(2, -1)
        c.store(ns, toks, blocks)
        st, outs = c.load(c.keys_for(ns, toks))
        assert torch.equal(c.layout.as_bytes(outs[1]), blocks[1])
    # aiohttp logs malformed HTTP (BadHttpMessage, answered 400 or closed) at ERROR; anything else is a bug
    errors = [
        r for r in daemon.records() if r.get("level") == "ERROR" and "BadHttpMessage" not in r.get("exc", "")
    ]
    assert not errors, [(e["msg"], e.get("exc", "")[-1200:]) for e in errors[:2]]
