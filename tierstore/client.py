"""A client of the tierstore daemon with the shape of the in-process :class:`~tierstore.api.KVStore`.

An engine switches local <-> remote by constructing one or the other::

    store = RemoteKVStore("http://127.0.0.1:8470", token=os.environ["TIERSTORE_TOKEN"])
    with store.request() as rid:
        hit = store.lookup(ns, prompt_ids, request_id=rid)
        statuses, blocks = store.load(hit)            # or load(hit, dests=engine_buffers)
        n_ok = leading_ok(statuses)
        ...
        store.store(ns, prompt_ids, new_kv_blocks)

Differences from the local store, by design:

* Block keys are computed here (:meth:`keys_for`, the same chained SHA-256 as
  :mod:`tierstore.identity`); the daemon re-scopes them to the caller's tenant,
  so the ``tenant`` field of a :class:`~tierstore.identity.Namespace` does not
  select the scope (the credential does). Use the namespace declared public in
  the daemon config to share blocks across tenants.
* ``lookup(..., request_id=...)`` takes no server-side references (a crashed
  client must not leak them); :meth:`release` returns 0. Hold blocks with
  :meth:`pin` (a lease that expires on its own).
* Key-level calls (:meth:`load`, :meth:`load_fragments`, :meth:`exists`,
  :meth:`lookup_keys`) need the keys' namespace: pass ``ns=`` (keyword-only,
  an addition to :class:`~tierstore.api.KVStore`'s signature) or keys that came
  from :meth:`keys_for`/:meth:`lookup` of this client (remembered).
* :meth:`prefetch` brings blocks up into the *daemon's* memory tiers
  (``tier="host"``); the engine's HBM is not the daemon's to fill.
* A put is acknowledged (``OK``/``EXISTS``) only once durable on the daemon's
  NVMe tier when the daemon runs with ``puts.durable: true`` (``durable`` attribute).
* :meth:`stats` returns the daemon's ``/v1/info``; the counters are
  Prometheus metrics at ``/metrics``.
* Not offered remotely (:data:`NOT_OFFERED`): ``from_config`` (construct with
  a URL and a token instead); the key-level ``pin_keys``, ``prefetch_keys``,
  ``remove``, ``resident``, ``tiers_of``; operations on the store as a whole
  (``flush``, ``evict``, ``clear``, ``drain``); introspection of the local
  index (``block_info``, ``state_of``, ``references``, ``leases``,
  ``namespaces``, ``keys_of_namespace``, ``check_invariants``,
  ``record_events``, ``take_events``); and tier and device figures
  (``bytes_per_tier``, ``capacity_bytes``, ``device_stats``, ``cost_model``,
  ``ftl``, ``placement``, ``tiers``). Calling one is an ``AttributeError``.

Everything else has :class:`~tierstore.api.KVStore`'s signature (checked by
``tests/server/test_client_parity.py``), including ``wait=False`` futures and
the fragment API: :meth:`store_fragments` gathers each block's fragments into
the request body, :meth:`load_fragments` scatters the received bytes. Token ids
passed where keys are expected raise :class:`~tierstore.errors.LayoutError`
before any request.

The HTTP client is aiohttp, driven from one background event-loop thread, so
the methods are synchronous and thread-safe.
"""
from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import json
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .contract import Lease, LookupResult, Tier
from .errors import ConfigError, LayoutError, QuotaExceeded, Status, StoreClosedError, TierStoreError
from .extras import require
from .identity import DigestCache, Namespace, block_hashes
from .io.inputs import plan_block
from .io.pages import check_distinct_destinations
from .layout import KVLayout
from .server.protocol import BLOCKS_CONTENT_TYPE, PREFIX, encode_prefix, keys_to_hex

aiohttp = require("aiohttp", "tierstore.client (the daemon's client)")

#: :class:`~tierstore.api.KVStore`'s public methods and properties this client does not offer, by
#: what they are for (``tests/server/test_client_parity.py`` keeps this equal to the difference of
#: the two classes, and checks that the READMEs name each one)
NOT_OFFERED: dict[str, tuple[str, ...]] = {
    "construction": ("from_config",),
    "key-level variants": ("pin_keys", "prefetch_keys", "remove", "resident", "tiers_of"),
    "operations on the whole store": ("flush", "evict", "clear", "drain"),
    "introspection of the local index": ("block_info", "state_of", "references", "leases", "namespaces",
                                         "keys_of_namespace", "check_invariants", "record_events", "take_events"),
    "tier and device figures": ("bytes_per_tier", "capacity_bytes", "device_stats", "cost_model", "ftl",
                                "placement", "tiers"),
}

_STATUS = {s.value: s for s in Status}
_TIER = {t.label: t for t in Tier}


class RemoteError(TierStoreError):
    """The daemon refused a request (the message carries its status, code and message)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status = status
        self.code = code


class AuthError(RemoteError):
    """Missing or invalid credentials (HTTP 401) or a forbidden namespace (403)."""


class ServerBusy(RemoteError):
    """The daemon stayed overloaded or draining (429/503) through every retry."""


def _check_keys(keys: Any) -> list[bytes]:
    """Block keys as a list of 32-byte ``bytes``, checked before any request.

    Raises
    ------
    LayoutError
        For anything else, e.g. token ids passed where keys are expected (they
        would otherwise become zero-filled keys: a 400 or a 413 from the daemon).
    """
    if isinstance(keys, (bytes, bytearray)):
        raise LayoutError("keys: expected a sequence of 32-byte keys, got one bytes object")
    if isinstance(keys, np.ndarray) and keys.dtype.kind in "iu":
        raise LayoutError(f"keys: got an integer array of shape {keys.shape}: token ids? Keys are 32-byte "
                          "block hashes: use keys_for(ns, token_ids), or the token-id method")
    out = list(keys)
    for i, k in enumerate(out):
        if not isinstance(k, (bytes, bytearray)) or len(k) != 32:
            what = type(k).__name__
            hint = " (token ids? keys are 32-byte block hashes: use keys_for(ns, token_ids))" \
                if isinstance(k, (int, np.integer)) else ""
            raise LayoutError(f"keys[{i}]: expected 32 bytes, got {what}"
                              f"{f' of length {len(k)}' if hasattr(k, '__len__') else ''}{hint}")
    return [bytes(k) for k in out]


def _check_token_ids(token_ids: Any) -> Any:
    """Token ids, with keys passed by mistake refused before any request.

    Raises
    ------
    LayoutError
        When the sequence holds ``bytes`` (block keys) instead of integers.
    """
    if isinstance(token_ids, (bytes, bytearray)):
        raise LayoutError("token_ids: got a bytes object; token ids are integers")
    if not isinstance(token_ids, np.ndarray):
        try:
            first = token_ids[0] if len(token_ids) else None
        except TypeError:
            raise LayoutError(f"token_ids: expected a sequence of integers, got {type(token_ids).__name__}") from None
        if isinstance(first, (bytes, bytearray)):
            raise LayoutError("token_ids: got block keys (bytes); the key-level methods take keys "
                              "(store_keys, lookup_keys, load, exists)")
    return token_ids


class RemoteLookupResult(LookupResult):
    """A :class:`~tierstore.index.LookupResult` that remembers its namespace."""

    ns: bytes = b""


class RemoteKVStore:
    """The daemon's KV-block API with :class:`~tierstore.api.KVStore`'s method names.

    Parameters
    ----------
    url : str
        Daemon base URL, e.g. ``"http://127.0.0.1:8470"``.
    token : str
        Bearer token of the tenant.
    timeout_s : float
        Per-request timeout in seconds.
    retries : int
        Retries of a 429 ``overloaded`` / 503 ``draining`` answer (honouring ``Retry-After``).
    max_retry_wait_s : float
        Cap on one wait between retries, in seconds.
    remember_keys : int
        How many ``key -> namespace`` pairs :meth:`load` remembers for raw keys.

    After :meth:`close`, every call that talks to the daemon raises
    :class:`~tierstore.errors.StoreClosedError` (``digest``, ``keys_for`` and
    the no-op ``release``/``cancel`` still answer).

    Raises
    ------
    ConfigError
        A URL without ``http://`` or ``https://``.
    AuthError
        If the token is refused.
    RemoteError
        If the daemon cannot be reached or answers an error.
    """

    def __init__(self, url: str, token: str, timeout_s: float = 60.0, retries: int = 5,
                 max_retry_wait_s: float = 2.0, remember_keys: int = 1 << 18) -> None:
        parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"url={url!r}: the URL needs a scheme (http:// or https://) and a host, e.g. "
                              "http://127.0.0.1:8470")
        self.url = url.rstrip("/")
        #: open/closed state and the calls in progress (close waits for them)
        self._state = threading.Condition(threading.Lock())
        self._active = 0
        self._closed = False
        self._auth = {"Authorization": f"Bearer {token}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.retries = retries
        self.max_retry_wait_s = max_retry_wait_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tierstore-client", daemon=True)
        self._thread.start()
        self._session: aiohttp.ClientSession | None = None
        self._call(self._open())
        self._key_ns: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._remember_max = remember_keys
        self._rids = itertools.count(1)
        try:
            info = self._call(self._request_json("GET", "/v1/info", None))
        except BaseException:
            self.close()
            raise
        lay = info["layout"]
        self.tenant: str = info["tenant"]
        self.layout = KVLayout(lay["num_layers"], lay["num_kv_heads"], lay["head_dim"], lay["dtype"],
                               lay["tokens_per_block"], lay["name"], lay.get("block_order", "layer_kv"))
        self.block_bytes: int = int(info["block_bytes"])
        self.durable: bool = bool(info["durable"])
        self.max_request_bytes: int = int(info["max_request_bytes"])
        self.max_keys_per_request: int = int(info["max_keys_per_request"])
        self._digests = DigestCache()

    # ------------------------------------------------------------------ plumbing
    async def _open(self) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout,
                                              connector=aiohttp.TCPConnector(limit=64))

    def _enter(self, coro) -> None:
        with self._state:
            if self._closed:
                coro.close()  # never scheduled
                raise StoreClosedError("RemoteKVStore: the client is closed")
            self._active += 1

    def _leave(self) -> None:
        with self._state:
            self._active -= 1
            if not self._active:
                self._state.notify_all()

    def _call(self, coro):
        """Run ``coro`` on the client's loop and wait for it.

        Raises
        ------
        StoreClosedError
            After :meth:`close` began (nothing is sent).
        """
        self._enter(coro)
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        except concurrent.futures.CancelledError:
            raise StoreClosedError("RemoteKVStore: the client was closed during the call") from None
        finally:
            self._leave()

    async def _error(self, resp: aiohttp.ClientResponse) -> RemoteError:
        try:
            err = json.loads(await resp.read())["error"]
            code, msg = str(err["code"]), str(err["message"])
        except (ValueError, KeyError, TypeError):
            code, msg = "http_error", resp.reason or ""
        if resp.status in (401, 403):
            return AuthError(resp.status, code, msg)
        if code in ("quota_exceeded", "pin_quota_exceeded"):
            return QuotaExceeded(f"HTTP {resp.status} {code}: {msg}")
        if resp.status in (429, 503):
            return ServerBusy(resp.status, code, msg)
        return RemoteError(resp.status, code, msg)

    async def _send(self, method: str, path: str, handle, data=None, json_body=None, headers=None):
        """Send with retries of retryable answers; ``handle(resp)`` consumes a 200."""
        hdrs = dict(self._auth)
        if headers:
            hdrs.update(headers)
        for attempt in itertools.count():
            body = data() if callable(data) else data
            try:
                async with self._session.request(method, self.url + path, data=body, json=json_body,
                                                 headers=hdrs) as resp:
                    if resp.status == 200:
                        return await handle(resp)
                    err = await self._error(resp)
                    retry_s = float(resp.headers.get("Retry-After", "0.1") or 0.1)
            except aiohttp.ClientError as e:
                raise RemoteError(0, "connection", f"{method} {path}: {e}") from None
            if not isinstance(err, ServerBusy) or attempt >= self.retries:
                raise err
            await asyncio.sleep(min(self.max_retry_wait_s, retry_s) * (1 + 0.25 * attempt))

    async def _request_json(self, method: str, path: str, body: dict | None):
        async def handle(resp):
            return json.loads(await resp.read())
        return await self._send(method, path, handle, json_body=body)

    def _post(self, path: str, body: dict) -> dict:
        return self._call(self._request_json("POST", path, body))

    # ------------------------------------------------------------------ identity
    def digest(self, ns: Namespace | bytes) -> bytes:
        """Client-side namespace digest (the daemon re-scopes it to the caller's tenant)."""
        return self._digests(ns)

    def keys_for(self, ns: Namespace | bytes, token_ids: Sequence[int] | np.ndarray) -> list[bytes]:
        """Chained hashes of the full blocks of ``token_ids`` under ``ns`` (remembered for :meth:`load`)."""
        d = self.digest(ns)
        keys = block_hashes(d, _check_token_ids(token_ids), self.layout.tokens_per_block)
        self._remember(keys, d)
        return keys

    # ------------------------------------------------------------------ requests
    @contextlib.contextmanager
    def request(self) -> Iterator[object]:
        """A request id (no server-side references are taken, see the module notes)."""
        yield ("remote-req", next(self._rids))

    def release(self, request_id: object) -> int:
        """No-op (remote lookups take no references); returns 0."""
        return 0

    def cancel(self, request_id: object) -> int:
        """No-op (remote lookups take no references); returns 0."""
        return 0

    # ------------------------------------------------------------------ futures
    def _future(self, coro, wait: bool):
        """Run ``coro`` on the client's loop: its result, or with ``wait=False`` a
        :class:`concurrent.futures.Future` of it (as :class:`~tierstore.api.KVStore`)."""
        if wait:
            return self._call(coro)
        self._enter(coro)
        try:  # close() lets a submitted call finish (up to the client's timeout)
            return asyncio.run_coroutine_threadsafe(coro, self._loop)
        finally:
            self._leave()

    # ------------------------------------------------------------------ store
    def _raw_blocks(self, kv_blocks) -> list[torch.Tensor]:
        if isinstance(kv_blocks, torch.Tensor) and kv_blocks.dim() > 1 and \
                tuple(kv_blocks.shape[1:]) == self.layout.block_shape:
            kv_blocks = list(kv_blocks)
        elif isinstance(kv_blocks, torch.Tensor) and kv_blocks.dim() == 2 and kv_blocks.dtype == torch.uint8:
            kv_blocks = list(kv_blocks)
        elif isinstance(kv_blocks, torch.Tensor):
            kv_blocks = [kv_blocks]
        out = []
        for b in kv_blocks:
            if not isinstance(b, torch.Tensor):  # a fragment list or a FragmentPlan: gather it
                out.append(self._gather(b))
                continue
            raw = self.layout.as_bytes(b.cpu() if b.device.type != "cpu" else b)
            if raw.numel() != self.block_bytes:
                raise LayoutError(f"a block must have {self.block_bytes} bytes, got {raw.numel()}")
            out.append(raw.contiguous())
        return out

    def _gather(self, frags) -> torch.Tensor:
        plan = plan_block(frags, self.layout, destination=False)
        blk = torch.empty(self.block_bytes, dtype=torch.uint8)
        plan.gather(blk, 0)
        return blk

    def _batches(self, n: int) -> list[tuple[int, int]]:
        per = max(1, min(self.max_keys_per_request,
                         (self.max_request_bytes - 80 * 1024) // max(1, self.block_bytes + 70)))
        return [(i, min(n, i + per)) for i in range(0, n, per)]

    def store_keys(self, ns: Namespace | bytes, keys: Sequence[bytes], blocks, *, lifetime: str | None = None,
                   first_position: int = 0, wait: bool = True) -> list[Status] | concurrent.futures.Future:
        """Store blocks under explicit client keys (see :meth:`tierstore.api.KVStore.store_keys`),
        batched into requests under the daemon's size limit.

        ``blocks`` holds, per key, a typed block, a raw ``uint8`` block, a list of
        fragments or a :class:`~tierstore.io.pages.FragmentPlan` (gathered here).

        Raises
        ------
        LayoutError
            Malformed keys (token ids included) or blocks, before any request.
        QuotaExceeded
            The tenant's byte quota is exhausted (retry after invalidating).
        """
        keys = _check_keys(keys)
        d = self.digest(ns)
        raw = self._raw_blocks(blocks)
        if len(raw) != len(keys):
            raise LayoutError(f"{len(keys)} keys but {len(raw)} blocks")

        async def run() -> list[Status]:
            out: list[Status] = []
            for a, b in self._batches(len(keys)):
                out += await self._put(d, keys[a:b], raw[a:b], first_position + a, lifetime)
            return out
        return self._future(run(), wait)

    async def _put(self, d: bytes, keys, raw, first_position: int, lifetime) -> list[Status]:
        prefix = encode_prefix({"namespace": d.hex(), "keys": keys_to_hex(keys),
                                "first_position": first_position, "lifetime": lifetime})
        length = len(prefix) + len(raw) * self.block_bytes

        def body():
            async def gen():
                yield prefix
                for t in raw:
                    yield memoryview(t.numpy())
            return gen()

        async def handle(resp):
            return [_STATUS[s] for s in json.loads(await resp.read())["statuses"]]
        return await self._send("PUT", "/v1/blocks", handle, data=body,
                                headers={"Content-Type": BLOCKS_CONTENT_TYPE, "Content-Length": str(length)})

    def _remember(self, keys: Sequence[bytes], d: bytes) -> None:
        for k in keys:
            self._key_ns[k] = d
            self._key_ns.move_to_end(k)
        while len(self._key_ns) > self._remember_max:
            self._key_ns.popitem(last=False)

    def store(self, ns: Namespace | bytes, token_ids, kv_blocks, start_block: int = 0,
              lifetime: str | None = None, *, wait: bool = True) -> list[Status] | concurrent.futures.Future:
        """Store KV of the full blocks of a prompt (see :meth:`tierstore.api.KVStore.store`);
        ``wait=False`` returns a Future (the blocks are copied into the request body first)."""
        keys = self.keys_for(ns, _check_token_ids(token_ids))
        raw = self._raw_blocks(kv_blocks)
        if start_block < 0 or start_block + len(raw) > len(keys):
            raise LayoutError(f"{len(raw)} blocks from block {start_block} exceed the prompt's "
                              f"{len(keys)} full blocks (partial tails are never stored)")
        return self.store_keys(ns, keys[start_block:start_block + len(raw)], raw, lifetime=lifetime,
                               first_position=start_block, wait=wait)

    def store_fragments(self, ns: Namespace | bytes, token_ids, fragments_per_block, start_block: int = 0,
                        lifetime: str | None = None, *, wait: bool = True) -> list[Status] | concurrent.futures.Future:
        """Store blocks given as engine fragments (see :meth:`tierstore.api.KVStore.store_fragments`).

        Each block's fragments (``2 * num_layers`` tensors, or a
        :class:`~tierstore.io.pages.FragmentPlan` from ``KVPagePool.plans``) are
        gathered into one ``block_bytes`` buffer, which is the request body; with
        ``wait=False`` the gather is done before this returns, so the fragments may
        be reused at once.

        Raises
        ------
        LayoutError
            A wrong fragment count or size, or more blocks than the prompt's full blocks.
        """
        keys = self.keys_for(ns, _check_token_ids(token_ids))
        frags = list(fragments_per_block)
        if start_block < 0 or start_block + len(frags) > len(keys):
            raise LayoutError(f"{len(frags)} blocks from block {start_block} exceed the prompt's "
                              f"{len(keys)} full blocks (partial tails are never stored)")
        raw = [self._gather(f) for f in frags]
        return self.store_keys(ns, keys[start_block:start_block + len(raw)], raw, lifetime=lifetime,
                               first_position=start_block, wait=wait)

    # ------------------------------------------------------------------ lookup / load
    def exists(self, keys: Sequence[bytes], *, ns: Namespace | bytes | None = None) -> int:
        """Number of leading ``keys`` present (no recency change; see :meth:`tierstore.api.KVStore.exists`).

        ``ns`` is needed unless the keys came from this client's :meth:`keys_for`.
        """
        keys = _check_keys(keys)
        d = self._ns_of(keys, ns)
        n = 0
        for a, b in self._batches(len(keys)):
            got = self._post("/v1/exists", {"namespace": d.hex(), "keys": keys_to_hex(keys[a:b])})["matched_blocks"]
            n += got
            if got < b - a:
                break
        return n

    def probe(self, ns: Namespace | bytes, token_ids) -> int:
        """Matched tokens, without touching recency."""
        return self.exists(self.keys_for(ns, _check_token_ids(token_ids)), ns=ns) * self.layout.tokens_per_block

    def _lookup_keys(self, d: bytes, keys: list[bytes], request_id, num_keys: int) -> RemoteLookupResult:
        per = self.max_keys_per_request
        matched, useful, tiers, load_s, reason = 0, 0, [], [], None
        for a in range(0, max(1, len(keys)), per):
            chunk = keys[a:a + per]
            r = self._post("/v1/lookup", {"namespace": d.hex(), "keys": keys_to_hex(chunk)})
            matched += r["matched_blocks"]
            tiers += [_TIER[t] for t in r["tiers"]]
            load_s += r["load_s"]
            if useful == a:
                useful += r["useful_blocks"]
                reason = r.get("not_useful_reason")
            if r["matched_blocks"] < len(chunk):
                break
        res = RemoteLookupResult(keys[:matched], tiers, load_s, useful, num_keys, self.layout.tokens_per_block,
                                 request_id, reason if useful < matched else None)
        res.ns = d
        return res

    def lookup(self, ns: Namespace | bytes, token_ids, request_id: object = None) -> RemoteLookupResult:
        """Longest cached prefix of ``token_ids`` (full blocks only); takes no references."""
        keys = self.keys_for(ns, _check_token_ids(token_ids))
        return self._lookup_keys(self.digest(ns), keys, request_id, len(keys))

    def lookup_keys(self, keys: Sequence[bytes], request_id: object = None, *,
                    ns: Namespace | bytes | None = None) -> RemoteLookupResult:
        """Longest cached prefix of ``keys`` (key-level :meth:`lookup`); takes no references.

        Raises
        ------
        LayoutError
            For a key that is not 32 bytes (token ids included), or keys of an unknown namespace.
        """
        keys = _check_keys(keys)
        return self._lookup_keys(self._ns_of(keys, ns), keys, request_id, len(keys))

    def _ns_of(self, keys: Sequence[bytes], ns) -> bytes:
        if ns is not None:
            d = self.digest(ns)
            self._remember(keys, d)
            return d
        if not keys:
            return bytes(32)
        d = self._key_ns.get(keys[0])
        if d is None:
            raise LayoutError("key-level calls of raw keys need ns=... (these keys were not produced by this "
                              "client's keys_for/lookup)")
        return d

    def _load_keys(self, keys, ns) -> tuple[list[bytes], bytes]:
        if self._closed:  # before the load's coroutines exist (_call checks again, race-safe)
            raise StoreClosedError("RemoteKVStore: the client is closed")
        if isinstance(keys, RemoteLookupResult):
            ns = ns if ns is not None else keys.ns
            keys = keys.useful_keys
        elif isinstance(keys, LookupResult):
            keys = keys.useful_keys
        keys = _check_keys(keys)
        return keys, self._ns_of(keys, ns)

    def load(self, keys: Sequence[bytes] | LookupResult, dests: Sequence[torch.Tensor] | None = None,
             promote: bool = True, *, wait: bool = True, timeout_s: float | None = None,
             ns: Namespace | bytes | None = None):
        """Load blocks (default: a lookup's useful keys) into ``dests`` or new tensors.

        Returns per-block statuses and the filled tensors (typed blocks of
        ``layout.block_shape`` when ``dests`` is omitted), or with ``wait=False`` a
        :class:`concurrent.futures.Future` of that pair; use :func:`tierstore.api.leading_ok`.
        ``timeout_s`` is a deadline: batches not received by then are ``MISS``
        and their destinations are left untouched (bytes are received into private
        buffers and copied only when a batch completes in time).

        Raises
        ------
        LayoutError
            Malformed keys (token ids included), unknown namespace, or destinations
            that do not match, before any request.
        """
        keys, d = self._load_keys(keys, ns)
        if dests is not None and len(dests) != len(keys):
            raise LayoutError(f"{len(keys)} keys but {len(dests)} destinations")
        raw_dests = None if dests is None else self._raw_dests(dests)
        statuses: list[Status] = []
        outs: list[torch.Tensor | None] = []

        async def run():
            for a, b in self._batches(len(keys)):
                if timeout_s is None:
                    st, o = await self._get(d, keys[a:b], None if dests is None else dests[a:b],
                                            None if raw_dests is None else raw_dests[a:b], promote)
                else:  # private buffers: a cancelled batch never writes the caller's memory
                    st, o = await self._get(d, keys[a:b], None, None, promote)
                    if raw_dests is not None:
                        for i, (s, got) in enumerate(zip(st, o)):
                            if s is Status.OK:
                                raw_dests[a + i].copy_(got.reshape(-1).view(torch.uint8))
                                o[i] = dests[a + i]
                statuses.extend(st)
                outs.extend(o)
            return statuses, outs
        return self._future(self._deadline(run(), timeout_s, lambda: (
            statuses + [Status.MISS] * (len(keys) - len(statuses)), outs + [None] * (len(keys) - len(outs)))), wait)

    async def _deadline(self, coro, timeout_s: float | None, partial):
        """``coro``, or ``partial()`` when it does not finish within ``timeout_s``."""
        if timeout_s is None:
            return await coro
        if timeout_s <= 0:
            raise ConfigError(f"timeout_s={timeout_s}: must be > 0")
        try:
            return await asyncio.wait_for(coro, timeout_s)
        except asyncio.TimeoutError:
            return partial()

    def load_fragments(self, keys: Sequence[bytes] | LookupResult, dest_fragments_per_block, *,
                       wait: bool = True, timeout_s: float | None = None,
                       ns: Namespace | bytes | None = None) -> list[Status] | concurrent.futures.Future:
        """Load blocks and scatter each into its destination fragments
        (see :meth:`tierstore.api.KVStore.load_fragments`).

        Destinations are checked before any request; a block whose status is not
        ``OK`` leaves its destination untouched. With ``wait=False`` a
        :class:`concurrent.futures.Future` of the statuses (destinations must not be
        read before it resolves).

        Raises
        ------
        LayoutError
            A wrong fragment count or size, not one destination per key, or malformed keys.
        """
        keys, d = self._load_keys(keys, ns)
        dests = list(dest_fragments_per_block)
        if len(dests) != len(keys):
            raise LayoutError(f"{len(keys)} blocks to load but {len(dests)} destinations")
        plans = [plan_block(f, self.layout, destination=True) for f in dests]
        check_distinct_destinations(plans)

        statuses: list[Status] = []

        async def run() -> list[Status]:
            for a, b in self._batches(len(keys)):
                st, outs = await self._get(d, keys[a:b], None, None, True)
                for s, raw, plan in zip(st, outs, plans[a:b]):
                    if s is Status.OK:
                        plan.scatter(raw.reshape(-1).view(torch.uint8), 0)
                statuses.extend(st)
            return statuses
        return self._future(self._deadline(run(), timeout_s,
                                           lambda: statuses + [Status.MISS] * (len(keys) - len(statuses))), wait)

    def _raw_dests(self, dests: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        B = self.block_bytes
        raw = [self.layout.as_bytes(t) if t.dtype != torch.uint8 else t.reshape(-1) for t in dests]
        for t in raw:
            if t.numel() != B or t.device.type != "cpu":
                raise LayoutError(f"each destination must be a CPU block of {B} bytes")
        return raw

    async def _get(self, d: bytes, keys, dests, raw_dests, promote: bool):
        B = self.block_bytes

        async def handle(resp):
            c = resp.content
            (mlen,) = PREFIX.unpack(await c.readexactly(PREFIX.size))
            man = json.loads(await c.readexactly(mlen))
            st = [_STATUS[s] for s in man["statuses"]]
            if len(st) != len(keys) or man["block_bytes"] != B:
                raise RemoteError(200, "bad_response", "manifest does not match the request")
            ok = [i for i, s in enumerate(st) if s is Status.OK]
            outs: list[torch.Tensor | None] = [None] * len(keys)
            if raw_dests is not None:
                # straight into the caller's buffers (contiguous CPU ones), no staging copy
                targets = [memoryview(raw_dests[i].numpy()) if raw_dests[i].is_contiguous() else None for i in ok]
                tmp = [torch.empty(B, dtype=torch.uint8) if t is None else None for t in targets]
                views = [t if t is not None else memoryview(x.numpy()) for t, x in zip(targets, tmp)]
            else:
                buf = torch.empty(len(ok) * B, dtype=torch.uint8)
                whole = memoryview(buf.numpy()) if ok else memoryview(b"")
                views = [whole[j * B:(j + 1) * B] for j in range(len(ok))]
            j, off, got, want = 0, 0, 0, len(ok) * B
            while got < want:
                chunk = await c.readany()
                if not chunk:
                    raise RemoteError(200, "truncated", f"response ended after {got} of {want} bytes")
                cm = memoryview(chunk)
                p = 0
                while p < len(cm) and j < len(views):
                    take = min(len(cm) - p, B - off)
                    views[j][off:off + take] = cm[p:p + take]
                    p += take
                    off += take
                    if off == B:
                        j, off = j + 1, 0
                got += p
                if p < len(cm):
                    raise RemoteError(200, "bad_response", "response is longer than its manifest says")
            for j, i in enumerate(ok):
                if raw_dests is not None:
                    if tmp[j] is not None:
                        raw_dests[i].copy_(tmp[j])
                    outs[i] = dests[i]
                else:
                    outs[i] = self.layout.block_view(buf[j * B:(j + 1) * B])
            return st, outs
        body = {"namespace": d.hex(), "keys": keys_to_hex(keys), "promote": promote}
        return await self._send("POST", "/v1/blocks/get", handle, json_body=body)

    def prefetch(self, ns: Namespace | bytes, token_ids, tier: str = "host") -> concurrent.futures.Future:
        """Bring the resident full blocks of a prefix up into the daemon's memory, before a request
        needs them (see :meth:`tierstore.api.KVStore.prefetch`).

        Parameters
        ----------
        tier : {"host"}
            The daemon's memory tiers; ``"hbm"`` (the engine's GPU memory) is not the
            daemon's to fill and is refused.

        Returns
        -------
        concurrent.futures.Future
            Of the number of blocks brought up from NVMe.

        Raises
        ------
        ConfigError
            For a tier other than ``"host"``.
        LayoutError
            For keys passed instead of token ids.
        """
        if str(tier).lower() != "host":
            raise ConfigError(f"tier={tier!r}: a remote prefetch fills the daemon's memory; accepted values are "
                              "['host'] (the engine's HBM is not the daemon's to fill)")
        keys = self.keys_for(ns, _check_token_ids(token_ids))
        d = self.digest(ns)

        async def run() -> int:
            n = 0
            for a, b in self._batches(len(keys)):
                n += (await self._request_json("POST", "/v1/prefetch", {"namespace": d.hex(),
                                                                        "keys": keys_to_hex(keys[a:b])}))[
                    "promoted_blocks"]
            return n
        return self._future(run(), wait=False)

    # ------------------------------------------------------------------ pins / admin
    def pin(self, ns: Namespace | bytes, token_ids, lease_s: float | None = None) -> Lease:
        """Pin the resident leading full blocks of a prefix for ``lease_s`` seconds.

        Raises
        ------
        QuotaExceeded
            If the daemon's pin quota would be exceeded.
        """
        d = self.digest(ns)
        keys = self.keys_for(ns, token_ids)[:self.max_keys_per_request]
        body = {"namespace": d.hex(), "keys": keys_to_hex(keys)}
        if lease_s is not None:
            body["lease_s"] = float(lease_s)
        r = self._post("/v1/pin", body)
        n = r["pinned_blocks"]
        return Lease(r["lease_id"], d, keys[:n], time.monotonic() + r["lease_s"], n * self.block_bytes)

    def unpin(self, lease: Lease | int) -> bool:
        """End a pin lease early."""
        lid = lease.lease_id if isinstance(lease, Lease) else int(lease)
        return bool(self._post("/v1/unpin", {"lease_id": lid})["unpinned"])

    def invalidate(self, ns: Namespace | bytes) -> int:
        """Drop every block of a namespace (within the caller's tenant scope)."""
        return int(self._post("/v1/invalidate", {"namespace": self.digest(ns).hex()})["removed_blocks"])

    def stats(self) -> dict:
        """The daemon's ``/v1/info`` answer (metrics live at ``/metrics``)."""
        return self._call(self._request_json("GET", "/v1/info", None))

    async def _finish(self) -> None:
        """Let submitted calls finish (up to the client's timeout), then close the session."""
        me = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not me]
        if pending:
            _, late = await asyncio.wait(pending, timeout=self._timeout.total)
            for t in late:
                t.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._closed

    def close(self) -> None:
        """Refuse new calls, let the calls in progress finish, close the HTTP
        session and stop the background loop. Idempotent; every later call
        (``stats`` included: it asks the daemon) raises
        :class:`~tierstore.errors.StoreClosedError`."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            while self._active:
                self._state.wait()
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._finish(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> RemoteKVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["RemoteKVStore", "RemoteLookupResult", "RemoteError", "AuthError", "ServerBusy"]
