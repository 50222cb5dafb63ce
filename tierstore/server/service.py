"""The KV-block service: an aiohttp application over a :class:`~tierstore.api.KVStore`.

:class:`Service` assembles the store from the daemon config, owns the worker
threads that run store calls (a store call never runs on the event loop), and
serves the routes of ``openapi.yaml``. Tenancy and key scoping are in
:mod:`tierstore.server.tenancy`, metrics in :mod:`tierstore.server.metrics`,
errors, request models and parsing in :mod:`tierstore.server.http`.

Durability
----------
With ``puts.durable`` (default) a put is answered only after each block with
status ``ok``/``exists`` is on NVMe (O_DIRECT + fdatasync, :mod:`tierstore.io.segments`);
after SIGTERM, a crash or kill -9, a restart serves it again unless it was
evicted or invalidated before. Segment deletes are volatile, so the NVMe tier
records invalidations itself (fsync'ed, :mod:`tierstore.io.invalidation_log`):
``<nvme path>.invalidations`` beside a file tier, the label page of a device.
A ``state_dir/invalidations.jsonl`` an older daemon wrote is read, never
written (:mod:`tierstore.server.durable`). ``state_dir/scopes.jsonl`` maps
scopes to owners so tenant usage is known again after a restart.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import json
import logging
import math
import os
import sys
import threading
import time
from typing import Any

import torch
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import generate_latest
from pydantic import BaseModel

from ..build import build_store, open_host_pool
from ..contract import Tier
from ..errors import ConfigError, QuotaExceeded, Status, TierStoreError
from ..units import check_duration_s
from .config import DaemonConfig
from .durable import repair_after_restart
from .http import (
    UNAUTHORIZED_HEADERS,
    ApiError,
    InvalidateRequest,
    KeysRequest,
    PinRequest,
    PutManifest,
    UnpinRequest,
    error_response,
    hex32,
    parse_json,
    require_json,
)
from .metrics import ServerMetrics
from .protocol import BLOCKS_CONTENT_TYPE, PREFIX
from .tenancy import Tenancy, make_state_dir

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # asyncio.timeout is 3.11's; aiohttp requires async-timeout, the same context manager, below 3.11
    from async_timeout import timeout as _timeout

__all__ = ["Service", "BufferPool"]

log = logging.getLogger("tierstore.server")
_WRITE_CHUNK_BYTES = 4 << 20


class BufferPool:
    """Reusable CPU ``uint8`` body buffers.

    A fresh multi-MiB ``torch.empty`` per request is page-faulted (and zeroed
    by the kernel) on first touch, which costs about as much as the copy into
    it; buffers of recently used sizes are kept instead.

    Parameters
    ----------
    max_cached_bytes : int
        Bytes of idle buffers kept at most.
    """

    def __init__(self, max_cached_bytes: int) -> None:
        self.max_cached_bytes = max_cached_bytes
        self._free: dict[int, list[torch.Tensor]] = {}
        self._cached_bytes = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of exactly ``nbytes`` (contents unspecified)."""
        with self._lock:
            lst = self._free.get(nbytes)
            if lst:
                self._cached_bytes -= nbytes
                return lst.pop()
        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        """Return a buffer taken with :meth:`take` (no view of it may be used afterwards)."""
        n = buf.numel()
        with self._lock:
            if n and self._cached_bytes + n <= self.max_cached_bytes:
                self._free.setdefault(n, []).append(buf)
                self._cached_bytes += n


class Service:
    """The daemon's state: store, tenancy, executor, metrics, and the aiohttp handlers.

    Parameters
    ----------
    cfg : DaemonConfig
        Validated configuration.
    """

    def __init__(self, cfg: DaemonConfig) -> None:
        self.cfg = cfg
        self.layout = cfg.layout.build()
        self.block_bytes = self.layout.bytes_per_block
        make_state_dir(cfg.state_dir)  # before the store: a bad state_dir leaves no tier file behind
        #: with a ``node`` section the store is the node service's pool (one store, two transports)
        self.node_core = None
        if cfg.node is not None:
            from ..node.server import open_node_core

            self.node_core = open_node_core(cfg)
            self.store = self.node_core.store
        else:
            # tiers.nvme.path: the one path rule (tierstore.io.label); no directory is created
            self.store = self._open_store(cfg)
        self.durable = cfg.puts.durable and self.store.nvme is not None
        self.tenancy = Tenancy(cfg, self.block_bytes, self.layout.fingerprint())
        dropped = repair_after_restart(self.store, self.tenancy.tombstones)
        # Recovered blocks of namespaces no scope of state_dir names under this layout are KEPT: a
        # daemon restarted with another layout never finds them (storage keys derive from the
        # owner's key scope, which holds the layout) and they leave by eviction; after a fresh,
        # replaced or damaged state_dir their tenant still finds them (the keys do not depend on
        # state_dir) and is charged for them at its scope's first put. (They were removed here
        # once: one start with an empty state_dir deleted every acknowledged durable block for
        # good; fresh-user trial 11.) The node socket scopes namespaces as HTTP does.
        unaddressable = self._unaddressable(cfg.state_dir)
        self.tenancy.adopt(self.store)
        self.recovered_blocks = sum(self.store.namespaces().values())
        if self.store.nvme is not None:
            log.info(
                "recovered",
                extra={
                    "fields": {
                        "event": "recovered",
                        "blocks": self.recovered_blocks,
                        "dropped_invalidated": dropped,
                        "unaddressable": unaddressable,
                    }
                },
            )
        self.executor = concurrent.futures.ThreadPoolExecutor(
            cfg.limits.worker_threads, thread_name_prefix="tierstore-io"
        )
        self.leases: dict[int, str] = {}
        self.inflight = 0
        self.draining = False
        self.ready = False
        self.metrics = ServerMetrics(self)
        #: the node socket's tenancy and metrics: the same Tenancy object and registry as HTTP's
        self.node_access = self.node_metrics = None
        if self.node_core is not None:
            from ..node.access import NodeAccess
            from .metrics import NodeMetrics

            self.node_access = NodeAccess(cfg, self.tenancy, self.store)
            self.node_metrics = NodeMetrics(self.metrics.registry, self.metrics)
        self.buffers = BufferPool(4 * cfg.limits.max_request_bytes)
        self._busy_bufs: set[int] = set()
        self._closed = False

    def _unaddressable(self, state_dir: str) -> int:
        """Blocks the store holds whose namespace no scope of ``state_dir/scopes.jsonl`` names under
        this layout (kept; charged to no tenant at start); a warning says how many, and why."""
        known = {self.store.digest(sc) for sc in self.tenancy.scope_owner}  # the store's digest of each scope
        orphans = {d: n for d, n in self.store.namespaces().items() if d not in known}
        n_blocks = sum(orphans.values())
        if n_blocks:
            log.warning(
                f"{n_blocks} recovered blocks of {len(orphans)} namespaces are named by no scope of "
                f"{os.path.join(state_dir, 'scopes.jsonl')} under this layout (the daemon ran with another "
                "layout before, or this state_dir is new, replaced or damaged). They are kept: blocks of "
                "another layout are never served and leave by eviction; their own tenant still finds "
                "its blocks and is charged for them from its first put in their namespace",
                extra={"fields": {"event": "unaddressable", "blocks": n_blocks, "namespaces": len(orphans)}},
            )
        return n_blocks

    def _open_store(self, cfg: DaemonConfig):
        """The store, its host tier's pages faulted in first (:meth:`BlockPool.prefault
        <tierstore.tiers.memory.BlockPool.prefault>`; the node service prefaults its shared
        segment itself): a put's copy into a host slot touched for the first time took 1.16 ms
        per 2 MiB, one into a touched slot 0.14 ms (2-core VM, 2026-12-04,
        ``bench/README_server.md``). Costs about 0.5 s per GiB at start, once."""
        scfg = cfg.store_config()
        pool = open_host_pool(scfg.tiers, self.block_bytes)
        if pool is None:
            return build_store(scfg, self.layout)
        t0 = time.perf_counter()
        done = pool.prefault()
        fields = {"event": "prefaulted", "populated": done, "seconds": round(time.perf_counter() - t0, 3)}
        log.info("prefaulted", extra={"fields": fields})
        return build_store(scfg, self.layout, host_pool=pool)

    # ---------------------------------------------------------------- app
    def make_app(self) -> web.Application:
        """The API application (``/v1/*``, health and metrics)."""
        app = web.Application(
            client_max_size=self.cfg.limits.max_manifest_bytes, middlewares=[self._middleware]
        )
        app.add_routes(
            [
                web.get("/healthz", self.healthz),
                web.get("/readyz", self.readyz),
                web.get("/metrics", self.metrics_h),
                web.get("/v1/info", self.info),
                web.put("/v1/blocks", self.put_blocks),
                web.post("/v1/blocks/get", self.get_blocks),
                web.post("/v1/exists", self.exists),
                web.post("/v1/lookup", self.lookup),
                web.post("/v1/pin", self.pin),
                web.post("/v1/unpin", self.unpin),
                web.post("/v1/prefetch", self.prefetch),
                web.post("/v1/invalidate", self.invalidate),
            ]
        )
        return app

    def make_metrics_app(self) -> web.Application:
        """A separate app serving only ``/metrics`` (for ``metrics.port``)."""
        app = web.Application()
        app.add_routes([web.get("/metrics", self.metrics_h)])
        return app

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        api = request.path.startswith("/v1/")
        op = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        t0 = time.perf_counter()
        lim = self.cfg.limits
        retry = {"Retry-After": str(max(1, math.ceil(lim.retry_after_s)))}
        counted = False
        try:
            if api and self.draining:
                self.metrics.rejected.labels("draining").inc()
                resp = error_response(
                    503,
                    "draining",
                    "the daemon is shutting down; retry on another replica or after restart",
                    retry,
                )
            elif api and self.inflight >= lim.max_inflight_requests:
                self.metrics.rejected.labels("overloaded").inc()
                resp = error_response(
                    429,
                    "overloaded",
                    f"{self.inflight} requests in flight (limit {lim.max_inflight_requests}); retry later",
                    retry,
                )
            elif request.headers.get("Content-Encoding", "identity").lower() != "identity":
                resp = error_response(
                    415,
                    "unsupported_encoding",
                    "request bodies must not be compressed (Content-Encoding: identity only)",
                )
                resp.force_close()  # do not decode (drain) the rejected body
            else:
                if api:
                    self.inflight += 1
                    counted = True
                try:
                    async with _timeout(lim.request_timeout_s):
                        resp = await handler(request)
                except ApiError as e:
                    hdrs = dict(e.headers)
                    if e.status == 429:
                        hdrs.update(retry)
                        self.metrics.rejected.labels(e.code).inc()
                    resp = error_response(e.status, e.code, e.message, hdrs)
                except asyncio.TimeoutError:  # TimeoutError from 3.11; async-timeout's below
                    resp = error_response(
                        408, "timeout", f"request not completed within {lim.request_timeout_s} s"
                    )
                except web.HTTPException as e:
                    if e.status >= 400 and e.content_type != "application/json":
                        resp = error_response(
                            e.status,
                            e.reason.lower().replace(" ", "_"),
                            e.text or e.reason,
                            {k: v for k, v in e.headers.items() if k.lower() in ("allow", "retry-after")},
                        )
                    else:
                        raise
                except (ConnectionResetError, asyncio.IncompleteReadError, HttpProcessingError) as e:
                    resp = error_response(
                        400, "truncated", f"the request body ended early: {type(e).__name__}"
                    )
                except TierStoreError as e:
                    resp = error_response(400, "bad_request", str(e))
        except web.HTTPException:
            raise
        except Exception:  # the daemon answers 500 and keeps serving; the traceback is logged
            log.exception("unhandled error", extra={"fields": {"event": "error", "path": request.path}})
            resp = error_response(500, "internal", "internal error (logged)")
        finally:
            if counted:
                self.inflight -= 1
        self.metrics.requests.labels(op, str(resp.status)).inc()
        self.metrics.request_s.labels(op).observe(time.perf_counter() - t0)
        return resp

    # ---------------------------------------------------------------- helpers
    def _auth(self, request: web.Request) -> str:
        tenant = self.tenancy.authenticate(request.headers.get("Authorization"))
        if tenant is None:
            raise ApiError(401, "unauthorized", "missing or invalid bearer token", UNAUTHORIZED_HEADERS)
        request["tenant"] = tenant
        return tenant

    async def _json(self, request: web.Request, model: type[BaseModel]) -> Any:
        require_json(request.content_type)
        if request.content_length is not None and request.content_length > self.cfg.limits.max_manifest_bytes:
            raise ApiError(
                413,
                "too_large",
                f"JSON body of {request.content_length} bytes exceeds "
                f"{self.cfg.limits.max_manifest_bytes} bytes",
            )
        raw = await request.read()
        return self._parse(raw, model)

    def _parse(self, raw: bytes, model: type[BaseModel]) -> Any:
        return parse_json(raw, model)

    def _keys(self, hex_keys: list[str]) -> list[bytes]:
        if len(hex_keys) > self.cfg.limits.max_keys_per_request:
            raise ApiError(
                413,
                "too_many_keys",
                f"{len(hex_keys)} keys exceed max_keys_per_request={self.cfg.limits.max_keys_per_request}",
            )
        return [hex32(k, f"keys[{i}]") for i, k in enumerate(hex_keys)]

    def _scoped(
        self, tenant: str, ns_hex: str, hex_keys: list[str], write: bool
    ) -> tuple[bytes, str, list[bytes]]:
        client_ns = hex32(ns_hex, "namespace")
        keys = self._keys(hex_keys)
        return self.tenancy.scoped(tenant, client_ns, keys, write)

    async def _run(self, fn, *args):
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    async def _run_on(self, buf: torch.Tensor, fn, *args):
        """Run ``fn`` in a worker thread that uses ``buf``. If the request is cancelled
        (timeout, disconnect) meanwhile, ``buf`` goes back to the pool only once the
        thread is done with it."""
        fut = asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            self._busy_bufs.add(id(buf))

            def done(_f, buf=buf) -> None:
                self._busy_bufs.discard(id(buf))
                self.buffers.give(buf)

            fut.add_done_callback(done)
            raise

    def _give(self, buf: torch.Tensor) -> None:
        if id(buf) not in self._busy_bufs:
            self.buffers.give(buf)

    # ---------------------------------------------------------------- ops
    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness: the event loop answers."""
        return web.json_response({"status": "ok"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness: recovered and not draining."""
        if self.ready and not self.draining:
            return web.json_response({"status": "ready", "recovered_blocks": self.recovered_blocks})
        return error_response(503, "not_ready", "draining" if self.draining else "starting")

    async def metrics_h(self, request: web.Request) -> web.Response:
        """Prometheus text exposition."""
        body = await self._run(generate_latest, self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def info(self, request: web.Request) -> web.Response:
        """The caller's tenant, the layout and the limits."""
        tenant = self._auth(request)
        lim = self.cfg.limits
        return web.json_response(
            {
                "tenant": tenant,
                "layout": self.layout.to_dict(),
                "block_bytes": self.block_bytes,
                "durable": self.durable,
                "max_request_bytes": lim.max_request_bytes,
                "max_keys_per_request": lim.max_keys_per_request,
                "max_manifest_bytes": lim.max_manifest_bytes,
            }
        )

    async def put_blocks(self, request: web.Request) -> web.Response:
        """Batched put: manifest + raw blocks, streamed into one pre-allocated tensor."""
        tenant = self._auth(request)
        lim = self.cfg.limits
        if request.content_type != BLOCKS_CONTENT_TYPE:
            raise ApiError(415, "unsupported_media_type", f"Content-Type must be {BLOCKS_CONTENT_TYPE}")
        cl = request.content_length
        if cl is not None and cl > lim.max_request_bytes:
            raise ApiError(
                413, "too_large", f"body of {cl} bytes exceeds max_request_bytes={lim.max_request_bytes}"
            )
        body = request.content
        head = await body.read(PREFIX.size)
        while len(head) < PREFIX.size:
            more = await body.read(PREFIX.size - len(head))
            if not more:
                raise ApiError(400, "truncated", "body ends before the 4-byte manifest length")
            head += more
        (mlen,) = PREFIX.unpack(head)
        if mlen > lim.max_manifest_bytes:
            raise ApiError(
                413,
                "too_large",
                f"manifest of {mlen} bytes exceeds max_manifest_bytes={lim.max_manifest_bytes}",
            )
        if cl is not None and PREFIX.size + mlen > cl:
            raise ApiError(400, "bad_length", f"manifest length {mlen} runs past Content-Length {cl}")
        try:
            raw = await body.readexactly(mlen)
        except asyncio.IncompleteReadError:
            raise ApiError(400, "truncated", f"body ends inside the {mlen}-byte manifest") from None
        man = self._parse(raw, PutManifest)
        scope, owner, keys = self._scoped(tenant, man.namespace, man.keys, write=True)
        payload = len(keys) * self.block_bytes
        total = PREFIX.size + mlen + payload
        if total > lim.max_request_bytes:
            raise ApiError(
                413,
                "too_large",
                f"{len(keys)} blocks of {self.block_bytes} bytes make a body of {total} "
                f"bytes, over max_request_bytes={lim.max_request_bytes}",
            )
        if cl is not None and cl != total:
            raise ApiError(
                400,
                "bad_length",
                f"Content-Length {cl} != {total} (4 + manifest {mlen} + "
                f"{len(keys)} blocks x {self.block_bytes} bytes)",
            )
        if len(set(keys)) != len(keys):
            raise ApiError(400, "bad_request", "keys must be distinct within one put")
        if man.lifetime is not None:
            from ..fdp.lifetime import HINTS

            if man.lifetime not in HINTS:
                raise ApiError(
                    400, "bad_request", f"lifetime={man.lifetime!r}: accepted values are {sorted(HINTS)}"
                )
        buf = self.buffers.take(payload)
        try:
            return await self._put_body(request, tenant, man, scope, owner, keys, buf)
        finally:
            self._give(buf)

    async def _put_body(self, request, tenant, man, scope, owner, keys, buf) -> web.Response:
        body = request.content
        payload = buf.numel()
        mv = memoryview(buf.numpy()) if payload else memoryview(b"")
        pos = 0
        while pos < payload:
            chunk = await body.readany()
            if not chunk:
                break
            take = min(len(chunk), payload - pos)
            mv[pos : pos + take] = chunk[:take]
            pos += take
            if take < len(chunk):
                raise ApiError(
                    400, "bad_length", f"body is longer than the {len(keys)} blocks the manifest lists"
                )
        if pos < payload:
            raise ApiError(400, "truncated", f"body ends after {pos} of {payload} payload bytes")
        if await body.read(1):
            raise ApiError(
                400, "bad_length", f"body is longer than the {len(keys)} blocks the manifest lists"
            )
        charged = self.tenancy.reserve(owner, scope, keys, self.store)
        blocks = [buf[i * self.block_bytes : (i + 1) * self.block_bytes] for i in range(len(keys))]
        try:
            st = await self._run_on(
                buf,
                lambda: self.store.store_keys(
                    scope, keys, blocks, lifetime=man.lifetime, first_position=man.first_position
                ),
            )
        except BaseException:
            self.tenancy.unreserve(scope, charged)
            raise
        failed = [k for k, s in zip(keys, st) if s not in (Status.OK, Status.EXISTS)]
        if failed:
            self.tenancy.unreserve(scope, [k for k in failed if k in set(charged)])
        self.metrics.count_blocks("put", tenant, st)
        self.metrics.bytes.labels("in", tenant).inc(payload)
        return web.json_response({"statuses": [s.value for s in st], "durable": self.durable})

    async def get_blocks(self, request: web.Request) -> web.StreamResponse:
        """Batched get: binary response (manifest + the OK blocks), written in chunks."""
        tenant = self._auth(request)
        req = await self._json(request, KeysRequest)
        scope, owner, keys = self._scoped(tenant, req.namespace, req.keys, write=False)
        total = len(keys) * self.block_bytes
        if total > self.cfg.limits.max_request_bytes:
            raise ApiError(
                413,
                "too_large",
                f"{len(keys)} blocks of {self.block_bytes} bytes exceed "
                f"max_request_bytes={self.cfg.limits.max_request_bytes}; split the batch",
            )
        buf = self.buffers.take(total)
        try:
            return await self._get_body(request, tenant, req, keys, buf)
        finally:
            self._give(buf)

    async def _get_body(self, request, tenant, req, keys, buf) -> web.StreamResponse:
        total = buf.numel()
        dests = [buf[i * self.block_bytes : (i + 1) * self.block_bytes] for i in range(len(keys))]
        t0 = time.perf_counter()
        st, _ = await self._run_on(buf, lambda: self.store.load(keys, dests, req.promote))
        self.metrics.load_s.observe(time.perf_counter() - t0)
        ok = [i for i, s in enumerate(st) if s is Status.OK]
        self.metrics.count_blocks("get", tenant, st)
        self.metrics.count_hits("get", len(keys), len(ok))
        man = json.dumps(
            {"statuses": [s.value for s in st], "block_bytes": self.block_bytes}, separators=(",", ":")
        ).encode()
        prefix = PREFIX.pack(len(man)) + man
        resp = web.StreamResponse(headers={"Content-Type": BLOCKS_CONTENT_TYPE})
        resp.content_length = len(prefix) + len(ok) * self.block_bytes
        await resp.prepare(request)
        mv = memoryview(buf.numpy()) if total else memoryview(b"")
        runs: list[tuple[int, int]] = []
        for i in ok:
            if runs and runs[-1][1] == i:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
        try:
            await resp.write(prefix)
            for a, b in runs:
                lo, hi = a * self.block_bytes, b * self.block_bytes
                for off in range(lo, hi, _WRITE_CHUNK_BYTES):
                    await resp.write(mv[off : min(hi, off + _WRITE_CHUNK_BYTES)])
            await resp.write_eof()
        except ConnectionError as e:  # the client went away mid-response; nothing left to answer
            log.info(
                "client disconnected", extra={"fields": {"event": "disconnect", "error": type(e).__name__}}
            )
            return resp
        self.metrics.bytes.labels("out", tenant).inc(len(ok) * self.block_bytes)
        return resp

    async def exists(self, request: web.Request) -> web.Response:
        """Longest prefix present: number of leading keys resident (no recency change)."""
        tenant = self._auth(request)
        req = await self._json(request, KeysRequest)
        _, _, keys = self._scoped(tenant, req.namespace, req.keys, write=False)
        n = self.store.exists(keys)
        return web.json_response({"matched_blocks": n})

    async def lookup(self, request: web.Request) -> web.Response:
        """Longest prefix with tiers and the cost model's useful count (touches recency, no references)."""
        tenant = self._auth(request)
        req = await self._json(request, KeysRequest)
        scope, _, keys = self._scoped(tenant, req.namespace, req.keys, write=False)
        res = self.store.lookup_keys(
            keys, ns=scope
        )  # ns: blocks found in the shared remote tier are kept when loaded
        self.metrics.count_hits("lookup", len(keys), res.matched_blocks)
        return web.json_response(
            {
                "matched_blocks": res.matched_blocks,
                "useful_blocks": res.useful_blocks,
                "tiers": [t.label for t in res.tiers],
                "load_s": res.load_s,
                "not_useful_reason": res.not_useful_reason,
            }
        )

    async def pin(self, request: web.Request) -> web.Response:
        """Pin the resident leading blocks for a lease."""
        tenant = self._auth(request)
        req = await self._json(request, PinRequest)
        scope, _, keys = self._scoped(tenant, req.namespace, req.keys, write=False)
        lim = self.cfg.limits
        try:
            lease_s = check_duration_s(
                lim.default_lease_s if req.lease_s is None else req.lease_s, "lease_s", lim.max_lease_s
            )
        except ConfigError as e:
            raise ApiError(400, "bad_request", str(e)) from None
        n = self.store.exists(keys)
        try:
            lease = self.store.pin_keys(scope, keys[:n], lease_s)
        except QuotaExceeded as e:
            raise ApiError(429, "pin_quota_exceeded", str(e)) from None
        if len(self.leases) >= 4096:  # forget leases that expired or ended inside the manager
            live = self.store.leases()
            self.leases = {lid: t for lid, t in self.leases.items() if lid in live}
        self.leases[lease.lease_id] = tenant
        return web.json_response(
            {"lease_id": lease.lease_id, "pinned_blocks": len(lease.keys), "lease_s": lease_s}
        )

    async def unpin(self, request: web.Request) -> web.Response:
        """End a lease early (only the tenant that took it)."""
        tenant = self._auth(request)
        req = await self._json(request, UnpinRequest)
        ok = False
        if self.leases.get(req.lease_id) == tenant:
            ok = self.store.unpin(req.lease_id)
            self.leases.pop(req.lease_id, None)
        return web.json_response({"unpinned": ok})

    async def prefetch(self, request: web.Request) -> web.Response:
        """Bring blocks whose fastest copy is on NVMe up to the memory tiers."""
        tenant = self._auth(request)
        req = await self._json(request, KeysRequest)
        _, _, keys = self._scoped(tenant, req.namespace, req.keys, write=False)
        store = self.store
        promoted = 0
        if len(store.tiers) > 1 and Tier.NVME in store.tiers:
            top = Tier.HOST if Tier.HOST in store.tiers else Tier.HBM
            promoted = await asyncio.wrap_future(store.prefetch_keys(keys, top.label))
        return web.json_response({"promoted_blocks": promoted, "resident_blocks": sum(store.resident(keys))})

    async def invalidate(self, request: web.Request) -> web.Response:
        """Drop every block of the caller's namespace (durably)."""
        tenant = self._auth(request)
        req = await self._json(request, InvalidateRequest)
        scope, _ = self.tenancy.resolve(tenant, hex32(req.namespace, "namespace"), write=True)

        def work() -> int:
            try:
                n = self.store.invalidate(scope)  # durable: the store logs it
            except OSError as e:
                if e.errno == errno.ENOSPC:  # a device tier's invalidation log is full
                    raise ApiError(507, "invalidation_log_full", str(e)) from e
                raise
            self.tenancy.invalidated(scope)
            return n

        n = await self._run(work)
        return web.json_response({"removed_blocks": n})

    # ---------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Wait for store work in flight, then close the store (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.executor.shutdown(wait=True)
        if self.node_core is not None:
            self.node_core.close()
        else:
            self.store.close()
