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
* :meth:`load` of raw keys needs their namespace: pass ``ns=`` or keys that
  came from :meth:`keys_for`/:meth:`lookup` of this client (remembered).
* A put is acknowledged (``OK``/``EXISTS``) only once durable on the daemon's
  NVMe tier when the daemon runs with ``puts.durable: true`` (``durable`` attribute).

The HTTP client is aiohttp, driven from one background event-loop thread, so
the methods are synchronous and thread-safe.
"""
from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import threading
import time
from typing import Iterator, Sequence

import aiohttp
import numpy as np
import torch

from .errors import LayoutError, QuotaExceeded, Status, TierStoreError
from .identity import DigestCache, Namespace, block_hashes
from .layout import KVLayout
from .manager import Lease, LookupResult, Tier
from .server.protocol import BLOCKS_CONTENT_TYPE, PREFIX, encode_prefix, keys_to_hex

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


class RemoteLookupResult(LookupResult):
    """A :class:`~tierstore.manager.LookupResult` that remembers its namespace."""

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

    Raises
    ------
    AuthError
        If the token is refused.
    RemoteError
        If the daemon cannot be reached or answers an error.
    """

    def __init__(self, url: str, token: str, timeout_s: float = 60.0, retries: int = 5,
                 max_retry_wait_s: float = 2.0, remember_keys: int = 1 << 18) -> None:
        self.url = url.rstrip("/")
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
        self._remember = remember_keys
        self._rids = itertools.count(1)
        try:
            info = self._call(self._request_json("GET", "/v1/info", None))
        except BaseException:
            self.close()
            raise
        lay = info["layout"]
        self.tenant: str = info["tenant"]
        self.layout = KVLayout(lay["num_layers"], lay["num_kv_heads"], lay["head_dim"], lay["dtype"],
                               lay["tokens_per_block"], lay["name"])
        self.block_bytes: int = int(info["block_bytes"])
        self.durable: bool = bool(info["durable"])
        self.max_request_bytes: int = int(info["max_request_bytes"])
        self.max_keys_per_request: int = int(info["max_keys_per_request"])
        self._digests = DigestCache()

    # ------------------------------------------------------------------ plumbing
    async def _open(self) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout,
                                              connector=aiohttp.TCPConnector(limit=64))

    def _call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

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
        keys = block_hashes(d, token_ids, self.layout.tokens_per_block)
        for k in keys:
            self._key_ns[k] = d
            self._key_ns.move_to_end(k)
        while len(self._key_ns) > self._remember:
            self._key_ns.popitem(last=False)
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
            raw = self.layout.as_bytes(b.cpu() if b.device.type != "cpu" else b)
            if raw.numel() != self.block_bytes:
                raise LayoutError(f"a block must have {self.block_bytes} bytes, got {raw.numel()}")
            out.append(raw.contiguous())
        return out

    def _batches(self, n: int) -> list[tuple[int, int]]:
        per = max(1, min(self.max_keys_per_request,
                         (self.max_request_bytes - 80 * 1024) // max(1, self.block_bytes + 70)))
        return [(i, min(n, i + per)) for i in range(0, n, per)]

    def store_keys(self, ns: Namespace | bytes, keys: Sequence[bytes], blocks, first_position: int = 0,
                   lifetime: str | None = None) -> list[Status]:
        """Store blocks under explicit client keys (batched into requests under the daemon's size limit).

        Raises
        ------
        QuotaExceeded
            The tenant's byte quota is exhausted (retry after invalidating).
        """
        d = self.digest(ns)
        raw = self._raw_blocks(blocks)
        if len(raw) != len(keys):
            raise LayoutError(f"{len(keys)} keys but {len(raw)} blocks")
        out: list[Status] = []
        for a, b in self._batches(len(keys)):
            out += self._call(self._put(d, keys[a:b], raw[a:b], first_position + a, lifetime))
        return out

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

    def store(self, ns: Namespace | bytes, token_ids, kv_blocks, start_block: int = 0,
              lifetime: str | None = None) -> list[Status]:
        """Store KV of the full blocks of a prompt (see :meth:`tierstore.api.KVStore.store`)."""
        keys = self.keys_for(ns, token_ids)
        raw = self._raw_blocks(kv_blocks)
        if start_block < 0 or start_block + len(raw) > len(keys):
            raise LayoutError(f"{len(raw)} blocks from block {start_block} exceed the prompt's "
                              f"{len(keys)} full blocks (partial tails are never stored)")
        return self.store_keys(ns, keys[start_block:start_block + len(raw)], raw, start_block, lifetime)

    # ------------------------------------------------------------------ lookup / load
    def exists(self, ns: Namespace | bytes, keys: Sequence[bytes]) -> int:
        """Number of leading ``keys`` present (no recency change)."""
        d = self.digest(ns)
        n = 0
        for a, b in self._batches(len(keys)):
            got = self._post("/v1/exists", {"namespace": d.hex(), "keys": keys_to_hex(keys[a:b])})["matched_blocks"]
            n += got
            if got < b - a:
                break
        return n

    def probe(self, ns: Namespace | bytes, token_ids) -> int:
        """Matched tokens, without touching recency."""
        return self.exists(ns, self.keys_for(ns, token_ids)) * self.layout.tokens_per_block

    def lookup(self, ns: Namespace | bytes, token_ids, request_id: object = None) -> RemoteLookupResult:
        """Longest cached prefix of ``token_ids`` (full blocks only); takes no references."""
        d = self.digest(ns)
        keys = self.keys_for(ns, token_ids)
        per = self.max_keys_per_request
        matched, useful, tiers, load_s = 0, 0, [], []
        for a in range(0, max(1, len(keys)), per):
            chunk = keys[a:a + per]
            r = self._post("/v1/lookup", {"namespace": d.hex(), "keys": keys_to_hex(chunk)})
            matched += r["matched_blocks"]
            tiers += [_TIER[t] for t in r["tiers"]]
            load_s += r["load_s"]
            if useful == a:
                useful += r["useful_blocks"]
            if r["matched_blocks"] < len(chunk):
                break
        res = RemoteLookupResult(keys[:matched], tiers, load_s, useful, len(keys), self.layout.tokens_per_block,
                                 request_id)
        res.ns = d
        return res

    def _ns_of(self, keys: Sequence[bytes], ns) -> bytes:
        if ns is not None:
            return self.digest(ns)
        if not keys:
            return bytes(32)
        d = self._key_ns.get(keys[0])
        if d is None:
            raise LayoutError("load() of raw keys needs ns=... (these keys were not produced by this client)")
        return d

    def load(self, keys: Sequence[bytes] | LookupResult, dests: Sequence[torch.Tensor] | None = None,
             promote: bool = True, ns: Namespace | bytes | None = None
             ) -> tuple[list[Status], list[torch.Tensor | None]]:
        """Load blocks (default: a lookup's useful keys) into ``dests`` or new tensors.

        Returns per-block statuses and the filled tensors (typed blocks of
        ``layout.block_shape`` when ``dests`` is omitted); use
        :func:`tierstore.api.leading_ok`.
        """
        if isinstance(keys, RemoteLookupResult):
            ns = ns if ns is not None else keys.ns
            keys = keys.useful_keys
        elif isinstance(keys, LookupResult):
            keys = keys.useful_keys
        keys = list(keys)
        d = self._ns_of(keys, ns)
        if dests is not None and len(dests) != len(keys):
            raise LayoutError(f"{len(keys)} keys but {len(dests)} destinations")
        statuses: list[Status] = []
        outs: list[torch.Tensor | None] = []
        for a, b in self._batches(len(keys)):
            dd = None if dests is None else dests[a:b]
            st, o = self._call(self._get(d, keys[a:b], dd, promote))
            statuses += st
            outs += o
        return statuses, outs

    async def _get(self, d: bytes, keys, dests, promote: bool):
        B = self.block_bytes
        raw_dests = None
        if dests is not None:
            raw_dests = [self.layout.as_bytes(t) if t.dtype != torch.uint8 else t.reshape(-1) for t in dests]
            for t in raw_dests:
                if t.numel() != B or t.device.type != "cpu":
                    raise LayoutError(f"each destination must be a CPU block of {B} bytes")

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

    def prefetch(self, ns: Namespace | bytes, keys: Sequence[bytes]) -> int:
        """Promote blocks whose fastest copy is on NVMe into memory; returns blocks promoted."""
        d = self.digest(ns)
        n = 0
        for a, b in self._batches(len(keys)):
            n += self._post("/v1/prefetch", {"namespace": d.hex(), "keys": keys_to_hex(keys[a:b])})["promoted_blocks"]
        return n

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

    def close(self) -> None:
        """Close the HTTP session and stop the background loop (idempotent)."""
        if self._loop.is_closed():
            return
        if self._session is not None:
            self._call(self._session.close())
            self._session = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> "RemoteKVStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["RemoteKVStore", "RemoteLookupResult", "RemoteError", "AuthError", "ServerBusy"]
