"""The KV-block service: an aiohttp application over a :class:`~tierstore.api.KVStore`.

Tenancy and key scoping
-----------------------
A bearer token (``Authorization: Bearer <token>``) maps to one tenant; tokens
are compared as SHA-256 digests with :func:`hmac.compare_digest`, against every
configured credential (no early exit). Clients send the 32-byte digest of their
:class:`~tierstore.identity.Namespace` and the chained block keys they computed
(``KVStore.keys_for``). The server never uses these as storage keys. It derives::

    owner = tenant name                     (or "public:<name>" for a declared public namespace)
    scope = SHA-256("tierstore/scope/v2" 0x00 owner 0x00 client_namespace_digest || layout_fingerprint)
    key   = SHA-256("tierstore/server-key/v1" || scope || client_key)

``layout_fingerprint`` is :meth:`~tierstore.layout.KVLayout.fingerprint` of the
daemon's layout: a daemon restarted with another layout never serves the old
bytes. ``owner`` comes from the credential, so a client cannot name another tenant's
scope: equal namespaces and keys of two tenants map to unrelated storage keys,
and no request of tenant B can address, probe, pin, load or invalidate a block
of tenant A. Only namespaces declared in ``public_namespaces`` (matched by the
client's namespace digest) map to a shared owner, readable by their
``readers`` and writable by their ``writers``. Every answer about keys is
computed inside the caller's scopes, so responses and errors never depend on
another tenant's blocks. ``scope`` is the manager's namespace digest (the unit
of :meth:`~tierstore.api.KVStore.invalidate`, pin quotas and tenant usage).

Durability
----------
With ``puts.durable`` (default) a put is answered only after each block with
status ``ok``/``exists`` is on NVMe (O_DIRECT + fdatasync, :mod:`tierstore.io.segments`);
after SIGTERM, a crash or kill -9, a restart serves it again unless it was
evicted or invalidated before. Invalidations are logged (fsync'ed) in
``state_dir/invalidations.jsonl`` because segment deletes are volatile.
``state_dir/scopes.jsonl`` maps scopes to owners so tenant usage is known
again after a restart.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import hmac
import json
import logging
import math
import os
import re
import threading
import time
from typing import Any, Sequence

import torch
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, CounterMetricFamily
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

from ..api import KVStore, open_nvme_storage
from ..errors import QuotaExceeded, Status, TierStoreError
from ..manager import Tier
from .config import DaemonConfig
from .durable import durable_store, nvme_next_seq, repair_after_restart
from .protocol import BLOCKS_CONTENT_TYPE, PREFIX

log = logging.getLogger("tierstore.server")
_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
_SCOPE_DOMAIN = b"tierstore/scope/v2"
_KEY_DOMAIN = b"tierstore/server-key/v1"
_WRITE_CHUNK_BYTES = 4 << 20
_UNAUTH = {"WWW-Authenticate": 'Bearer realm="tierstore"'}


# ============================================================== errors / logging
class ApiError(Exception):
    """An HTTP error answered as ``{"error": {"code", "message"}}``."""

    def __init__(self, status: int, code: str, message: str, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


def error_response(status: int, code: str, message: str, headers: dict | None = None) -> web.Response:
    """A JSON error response."""
    return web.json_response({"error": {"code": code, "message": message}}, status=status, headers=headers)


class JsonFormatter(logging.Formatter):
    """One JSON object per log line (``ts``, ``level``, ``logger``, ``msg`` + extra fields)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": round(record.created, 6), "level": record.levelname, "logger": record.name,
               "msg": record.getMessage()}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str) -> None:
    """Route every logger to stderr as JSON lines."""
    h = logging.StreamHandler()
    h.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(level)


class JsonAccessLogger(AbstractAccessLogger):
    """aiohttp access log as JSON (method, path, status, bytes, duration, tenant)."""

    def log(self, request, response, time_s: float) -> None:  # noqa: A003 (aiohttp API name)
        self.logger.info("request", extra={"fields": {
            "event": "access", "method": request.method, "path": request.path, "status": response.status,
            "resp_bytes": response.body_length, "duration_s": round(time_s, 6),
            "tenant": request.get("tenant"), "remote": request.remote}})


# ============================================================== request models
class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class KeysRequest(_Req):
    """Body of get / exists / lookup / prefetch."""

    namespace: StrictStr
    keys: list[StrictStr]
    promote: StrictBool = True


class PutManifest(_Req):
    """Manifest of a put."""

    namespace: StrictStr
    keys: list[StrictStr]
    first_position: StrictInt = Field(0, ge=0)
    lifetime: StrictStr | None = None


class PinRequest(_Req):
    """Body of a pin."""

    namespace: StrictStr
    keys: list[StrictStr]
    lease_s: StrictFloat | StrictInt | None = None


class UnpinRequest(_Req):
    """Body of an unpin."""

    lease_id: StrictInt


class InvalidateRequest(_Req):
    """Body of an invalidate."""

    namespace: StrictStr


def _hex32(value: str, what: str) -> bytes:
    if not _HEX64.match(value):
        raise ApiError(400, "bad_request", f"{what}: expected 64 hex digits (32 bytes)")
    return bytes.fromhex(value)


def _validation_message(err: ValidationError) -> str:
    parts = []
    for e in err.errors()[:5]:
        key = ".".join(str(p) for p in e["loc"]) or "(body)"
        parts.append(f"{key}: {e['msg']}")
    return "; ".join(parts)


# ============================================================== tenancy
class Tenancy:
    """Credentials, scopes, the scope registry, tombstones and per-owner usage.

    Parameters
    ----------
    cfg : DaemonConfig
        The daemon config (tenants, public namespaces, state_dir).
    block_bytes : int
        Bytes per block (usage accounting).
    layout_fingerprint : bytes
        :meth:`KVLayout.fingerprint` of the daemon's layout, mixed into every scope.
    """

    def __init__(self, cfg: DaemonConfig, block_bytes: int, layout_fingerprint: bytes = b"") -> None:
        self.block_bytes = block_bytes
        self.layout_fingerprint = layout_fingerprint
        self._creds: list[tuple[bytes, str]] = [(d, t.name) for t in cfg.tenants for d in t.token_digests()]
        self.quota_bytes: dict[str, int] = {t.name: t.quota_bytes for t in cfg.tenants}
        self.public: dict[bytes, Any] = {}
        for p in cfg.public_namespaces:
            self.public[p.ns_digest()] = p
            self.quota_bytes[f"public:{p.name}"] = p.quota_bytes
        os.makedirs(cfg.state_dir, exist_ok=True)
        self._scopes_path = os.path.join(cfg.state_dir, "scopes.jsonl")
        self._tomb_path = os.path.join(cfg.state_dir, "invalidations.jsonl")
        self.scope_owner: dict[bytes, str] = {}
        self.tombstones: dict[bytes, int] = {}
        for rec in self._read_jsonl(self._scopes_path):
            # a scope recorded under another layout (or before layouts were
            # recorded) is unreachable now: its blocks are dropped at start
            if rec.get("layout") == layout_fingerprint.hex():
                self.scope_owner[bytes.fromhex(rec["scope"])] = rec["owner"]
        for rec in self._read_jsonl(self._tomb_path):
            self.tombstones[bytes.fromhex(rec["scope"])] = int(rec["seq"])
        self._lock = threading.Lock()
        self._file_lock = threading.Lock()
        self._keys: dict[bytes, set] = {}           # scope -> server keys put (pruned lazily)
        self._owner_scopes: dict[str, set] = {}     # owner -> scopes

    @staticmethod
    def _read_jsonl(path: str) -> list[dict]:
        out = []
        if not os.path.exists(path):
            return out
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    log.warning("skipping a torn line of %s", path)  # the tail of a crash
                    continue
                out.append(rec)
        return out

    def _append(self, path: str, rec: dict) -> None:
        with self._file_lock:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, (json.dumps(rec) + "\n").encode())
                os.fsync(fd)
            finally:
                os.close(fd)

    # -- auth -------------------------------------------------------------
    def authenticate(self, header: str | None) -> str | None:
        """Tenant of an ``Authorization`` header, or ``None``. Constant time per credential."""
        if not header or not header.startswith("Bearer "):
            return None
        digest = hashlib.sha256(header[7:].strip().encode("utf-8", "surrogateescape")).digest()
        found = None
        for d, name in self._creds:
            if hmac.compare_digest(d, digest):
                found = name
        return found

    # -- scopes -----------------------------------------------------------
    def resolve(self, tenant: str, client_ns: bytes, write: bool) -> tuple[bytes, str]:
        """``(scope digest, owner)`` of a client namespace for ``tenant``.

        Raises
        ------
        ApiError
            403 for a write to a public namespace the tenant may not write, or a
            read of one it may not read.
        """
        pub = self.public.get(client_ns)
        if pub is not None:
            if write and tenant not in pub.writers:
                raise ApiError(403, "forbidden", f"public namespace {pub.name!r} is not writable by this tenant")
            if not write and pub.readers != "*" and tenant not in pub.readers and tenant not in pub.writers:
                raise ApiError(403, "forbidden", f"public namespace {pub.name!r} is not readable by this tenant")
            owner = f"public:{pub.name}"
        else:
            owner = tenant
        scope = hashlib.sha256(_SCOPE_DOMAIN + b"\0" + owner.encode() + b"\0" + client_ns
                               + self.layout_fingerprint).digest()
        if write and scope not in self.scope_owner:  # reads of unknown scopes leave no state behind
            with self._lock:
                known = scope in self.scope_owner
                self.scope_owner[scope] = owner
            if not known:
                self._append(self._scopes_path, {"scope": scope.hex(), "owner": owner,
                                                 "layout": self.layout_fingerprint.hex()})
        return scope, owner

    @staticmethod
    def server_keys(scope: bytes, client_keys: Sequence[bytes]) -> list[bytes]:
        """Storage keys of client keys within ``scope``."""
        return [hashlib.sha256(_KEY_DOMAIN + scope + k).digest() for k in client_keys]

    # -- usage / quota ----------------------------------------------------
    def adopt(self, index: dict) -> None:
        """Rebuild usage from the manager index after a restart."""
        with self._lock:
            for k, e in index.items():
                owner = self.scope_owner.get(e.ns)
                if owner is None:
                    continue
                self._keys.setdefault(e.ns, set()).add(k)
                self._owner_scopes.setdefault(owner, set()).add(e.ns)

    def _used_blocks(self, owner: str) -> int:
        return sum(len(self._keys.get(s, ())) for s in self._owner_scopes.get(owner, ()))

    def _prune(self, owner: str, index: dict) -> None:
        for s in self._owner_scopes.get(owner, ()):
            ks = self._keys.get(s)
            if ks:
                self._keys[s] = {k for k in ks if k in index}

    def reserve(self, owner: str, scope: bytes, keys: Sequence[bytes], index: dict) -> list[bytes]:
        """Charge ``keys`` to ``owner``'s quota; returns the newly charged keys.

        Raises
        ------
        ApiError
            429 when the owner's quota would be exceeded (nothing is charged then).
        """
        quota = self.quota_bytes.get(owner, 1 << 62)
        with self._lock:
            have = self._keys.setdefault(scope, set())
            new = [k for k in dict.fromkeys(keys) if k not in have]
            if (self._used_blocks(owner) + len(new)) * self.block_bytes > quota:
                self._prune(owner, index)
                have = self._keys[scope]
                new = [k for k in dict.fromkeys(keys) if k not in have]
                if (self._used_blocks(owner) + len(new)) * self.block_bytes > quota:
                    raise ApiError(429, "quota_exceeded",
                                   f"storing {len(new)} new blocks would exceed the quota of {quota} bytes "
                                   f"(in use: {self._used_blocks(owner) * self.block_bytes} bytes); "
                                   "retry after invalidating or when blocks are evicted")
            have.update(new)
            self._owner_scopes.setdefault(owner, set()).add(scope)
            return new

    def unreserve(self, scope: bytes, keys: Sequence[bytes]) -> None:
        """Return the charge of keys that were not stored."""
        with self._lock:
            self._keys.get(scope, set()).difference_update(keys)

    def usage_bytes(self, index: dict) -> dict[str, int]:
        """Bytes resident per owner (prunes evicted keys)."""
        with self._lock:
            out = {}
            for owner in set(self.quota_bytes) | set(self._owner_scopes):
                self._prune(owner, index)
                out[owner] = self._used_blocks(owner) * self.block_bytes
            return out

    def invalidated(self, scope: bytes, seq: int) -> None:
        """Record (durably) that ``scope`` was invalidated at NVMe sequence ``seq``."""
        self._append(self._tomb_path, {"scope": scope.hex(), "seq": seq})
        with self._lock:
            self.tombstones[scope] = seq
            self._keys.pop(scope, None)


# ============================================================== metrics
class _StoreCollector:
    """Scrape-time gauges: bytes per tier, manager counters, WAF, tenant usage."""

    def __init__(self, svc: "Service") -> None:
        self.svc = svc

    def collect(self):
        m = self.svc.store.manager
        g = GaugeMetricFamily("tierstore_tier_bytes", "Resident bytes per tier", labels=["tier"])
        for tier, b in m.bytes_per_tier().items():
            g.add_metric([tier], b)
        yield g
        cap = GaugeMetricFamily("tierstore_tier_capacity_bytes", "Capacity per tier", labels=["tier"])
        for t, p in m.pools.items():
            cap.add_metric([t.label], p.num_blocks * m.block_bytes)
        if m.nvme is not None:
            cap.add_metric(["nvme"], m.nvme.capacity_blocks() * m.block_bytes)
        yield cap
        c = CounterMetricFamily("tierstore_manager_events", "Tier manager counters (see tierstore.metrics)",
                                labels=["counter"])
        for k, v in m.metrics.snapshot().items():
            if isinstance(v, int):
                c.add_metric([k], v)
        yield c
        ratio = GaugeMetricFamily("tierstore_block_hit_ratio", "Matched / looked-up blocks")
        ratio.add_metric([], m.metrics.snapshot()["block_hit_ratio"])
        yield ratio
        if m.nvme is not None:
            st = m.nvme.stats()
            waf = GaugeMetricFamily("tierstore_nvme_host_write_amplification",
                                    "(user + GC bytes written) / user bytes written, from the segment store")
            waf.add_metric([], float(st.get("host_write_amplification", 1.0)))
            yield waf
            dev = st.get("engine", {}).get("device_waf") if isinstance(st.get("engine"), dict) else None
            if dev is not None:
                dw = GaugeMetricFamily("tierstore_nvme_device_write_amplification", "WAF reported by the device")
                dw.add_metric([], float(dev))
                yield dw
        use = GaugeMetricFamily("tierstore_tenant_usage_bytes", "Resident bytes per tenant (owner)",
                                labels=["tenant"])
        quota = GaugeMetricFamily("tierstore_tenant_quota_bytes", "Byte quota per tenant (owner)", labels=["tenant"])
        for owner, b in self.svc.tenancy.usage_bytes(m.index).items():
            use.add_metric([owner], b)
            quota.add_metric([owner], self.svc.tenancy.quota_bytes.get(owner, 0))
        yield use
        yield quota
        inf = GaugeMetricFamily("tierstore_inflight_requests", "API requests in progress")
        inf.add_metric([], self.svc.inflight)
        yield inf


class ServerMetrics:
    """Prometheus metrics of the daemon (private registry)."""

    def __init__(self, svc: "Service") -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("tierstore_requests", "API requests by operation and HTTP status",
                                ["op", "code"], registry=r)
        self.request_s = Histogram("tierstore_request_seconds", "API request latency", ["op"], registry=r,
                                   buckets=(.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
        self.load_s = Histogram("tierstore_load_latency_seconds", "Store load (get) latency per request",
                                registry=r, buckets=(.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1,
                                                     .25, .5, 1, 2.5))
        self.blocks = Counter("tierstore_blocks", "Blocks by operation, tenant and status",
                              ["op", "tenant", "status"], registry=r)
        self.bytes = Counter("tierstore_payload_bytes", "Block payload bytes by direction and tenant",
                             ["direction", "tenant"], registry=r)
        self.rejected = Counter("tierstore_rejected_requests", "Requests refused for backpressure",
                                ["reason"], registry=r)
        r.register(_StoreCollector(svc))


# ============================================================== buffers
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


# ============================================================== service
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
        tiers = cfg.tiers
        nvme = None
        if tiers.nvme is not None:
            n = tiers.nvme
            path = n.path
            if not path.startswith("/dev/"):
                os.makedirs(path if not os.path.splitext(path)[1] else os.path.dirname(path) or ".",
                            exist_ok=True)
            kw: dict[str, Any] = {"engine": n.engine, "extent_size_bytes": n.extent_size_bytes, "iodepth": n.iodepth}
            if n.segment_size_bytes is not None:
                kw["segment_size_bytes"] = n.segment_size_bytes
            nvme = open_nvme_storage(path, n.capacity_bytes, self.block_bytes, "segment", **kw)
        opts: dict[str, Any] = {"eviction": cfg.policies.eviction, "promotion": cfg.policies.promotion,
                                "pin_quota_bytes": cfg.limits.pin_quota_bytes,
                                "default_lease_s": cfg.limits.default_lease_s}
        if tiers.nvme is not None and tiers.nvme.fdp.enabled:
            f = tiers.nvme.fdp
            from ..fdp.lifetime import LifetimeClass
            pids = {LifetimeClass.LONG: f.long_pid, LifetimeClass.MEDIUM: f.medium_pid,
                    LifetimeClass.SHORT: f.short_pid}
            opts["placement_of"] = lambda c: f.default_pid if c is None else pids[c]
        if cfg.policies.admission == "reused":
            opts["admit_to_nvme"] = lambda e: e.hits >= 1
        self.store = KVStore(self.layout, hbm_bytes=tiers.hbm.capacity_bytes, host_bytes=tiers.host.capacity_bytes,
                             nvme=nvme, **opts)
        self.durable = cfg.puts.durable and nvme is not None
        self.tenancy = Tenancy(cfg, self.block_bytes, self.layout.fingerprint())
        dropped = repair_after_restart(self.store.manager, self.tenancy.tombstones) if nvme is not None else 0
        # Blocks of scopes not registered under this layout (a daemon restarted
        # with another layout, or state from before layouts were recorded) can
        # never be addressed again: drop them rather than charge their owners.
        orphans = [k for k, e in self.store.manager.index.items() if e.ns not in self.tenancy.scope_owner]
        dropped_orphans = self.store.manager.remove(orphans) if orphans else 0
        self.tenancy.adopt(self.store.manager.index)
        self.recovered_blocks = len(self.store.manager.index)
        if nvme is not None:
            log.info("recovered", extra={"fields": {"event": "recovered", "blocks": self.recovered_blocks,
                                                    "dropped_invalidated": dropped,
                                                    "dropped_unaddressable": dropped_orphans}})
        self.executor = concurrent.futures.ThreadPoolExecutor(cfg.limits.worker_threads,
                                                              thread_name_prefix="tierstore-io")
        self.leases: dict[int, str] = {}
        self.inflight = 0
        self.draining = False
        self.ready = False
        self.metrics = ServerMetrics(self)
        self.buffers = BufferPool(4 * cfg.limits.max_request_bytes)
        self._busy_bufs: set[int] = set()
        self._closed = False

    # ---------------------------------------------------------------- app
    def make_app(self) -> web.Application:
        """The API application (``/v1/*``, health and metrics)."""
        app = web.Application(client_max_size=self.cfg.limits.max_manifest_bytes,
                              middlewares=[self._middleware])
        app.add_routes([
            web.get("/healthz", self.healthz), web.get("/readyz", self.readyz), web.get("/metrics", self.metrics_h),
            web.get("/v1/info", self.info),
            web.put("/v1/blocks", self.put_blocks),
            web.post("/v1/blocks/get", self.get_blocks),
            web.post("/v1/exists", self.exists), web.post("/v1/lookup", self.lookup),
            web.post("/v1/pin", self.pin), web.post("/v1/unpin", self.unpin),
            web.post("/v1/prefetch", self.prefetch), web.post("/v1/invalidate", self.invalidate),
        ])
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
                resp = error_response(503, "draining", "the daemon is shutting down; retry on another replica "
                                      "or after restart", retry)
            elif api and self.inflight >= lim.max_inflight_requests:
                self.metrics.rejected.labels("overloaded").inc()
                resp = error_response(429, "overloaded", f"{self.inflight} requests in flight "
                                      f"(limit {lim.max_inflight_requests}); retry later", retry)
            elif request.headers.get("Content-Encoding", "identity").lower() != "identity":
                resp = error_response(415, "unsupported_encoding", "request bodies must not be compressed "
                                      "(Content-Encoding: identity only)")
                resp.force_close()  # do not decode (drain) the rejected body
            else:
                if api:
                    self.inflight += 1
                    counted = True
                try:
                    async with asyncio.timeout(lim.request_timeout_s):
                        resp = await handler(request)
                except ApiError as e:
                    hdrs = dict(e.headers)
                    if e.status == 429:
                        hdrs.update(retry)
                        self.metrics.rejected.labels(e.code).inc()
                    resp = error_response(e.status, e.code, e.message, hdrs)
                except TimeoutError:
                    resp = error_response(408, "timeout", f"request not completed within {lim.request_timeout_s} s")
                except web.HTTPException as e:
                    if e.status >= 400 and e.content_type != "application/json":
                        resp = error_response(e.status, e.reason.lower().replace(" ", "_"),
                                              e.text or e.reason, {k: v for k, v in e.headers.items()
                                                                   if k.lower() in ("allow", "retry-after")})
                    else:
                        raise
                except (ConnectionResetError, asyncio.IncompleteReadError, HttpProcessingError) as e:
                    resp = error_response(400, "truncated", f"the request body ended early: {type(e).__name__}")
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
            raise ApiError(401, "unauthorized", "missing or invalid bearer token", _UNAUTH)
        request["tenant"] = tenant
        return tenant

    async def _json(self, request: web.Request, model: type[BaseModel]) -> Any:
        if request.content_length is not None and request.content_length > self.cfg.limits.max_manifest_bytes:
            raise ApiError(413, "too_large", f"JSON body of {request.content_length} bytes exceeds "
                           f"{self.cfg.limits.max_manifest_bytes} bytes")
        raw = await request.read()
        return self._parse(raw, model)

    def _parse(self, raw: bytes, model: type[BaseModel]) -> Any:
        try:
            doc = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ApiError(400, "bad_json", f"body is not valid JSON: {e}") from None
        if not isinstance(doc, dict):
            raise ApiError(400, "bad_json", "body must be a JSON object")
        try:
            return model.model_validate(doc)
        except ValidationError as e:
            raise ApiError(400, "bad_request", _validation_message(e)) from None

    def _keys(self, hex_keys: list[str]) -> list[bytes]:
        if len(hex_keys) > self.cfg.limits.max_keys_per_request:
            raise ApiError(413, "too_many_keys", f"{len(hex_keys)} keys exceed max_keys_per_request="
                           f"{self.cfg.limits.max_keys_per_request}")
        return [_hex32(k, f"keys[{i}]") for i, k in enumerate(hex_keys)]

    def _scoped(self, tenant: str, ns_hex: str, hex_keys: list[str], write: bool) -> tuple[bytes, str, list[bytes]]:
        client_ns = _hex32(ns_hex, "namespace")
        keys = self._keys(hex_keys)
        scope, owner = self.tenancy.resolve(tenant, client_ns, write)
        return scope, owner, self.tenancy.server_keys(scope, keys)

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
        return web.json_response({"tenant": tenant, "layout": self.layout.to_dict(), "block_bytes": self.block_bytes,
                                  "durable": self.durable, "max_request_bytes": lim.max_request_bytes,
                                  "max_keys_per_request": lim.max_keys_per_request,
                                  "max_manifest_bytes": lim.max_manifest_bytes})

    async def put_blocks(self, request: web.Request) -> web.Response:
        """Batched put: manifest + raw blocks, streamed into one pre-allocated tensor."""
        tenant = self._auth(request)
        lim = self.cfg.limits
        if request.content_type != BLOCKS_CONTENT_TYPE:
            raise ApiError(415, "unsupported_media_type", f"Content-Type must be {BLOCKS_CONTENT_TYPE}")
        cl = request.content_length
        if cl is not None and cl > lim.max_request_bytes:
            raise ApiError(413, "too_large", f"body of {cl} bytes exceeds max_request_bytes={lim.max_request_bytes}")
        body = request.content
        head = await body.read(PREFIX.size)
        while len(head) < PREFIX.size:
            more = await body.read(PREFIX.size - len(head))
            if not more:
                raise ApiError(400, "truncated", "body ends before the 4-byte manifest length")
            head += more
        (mlen,) = PREFIX.unpack(head)
        if mlen > lim.max_manifest_bytes:
            raise ApiError(413, "too_large", f"manifest of {mlen} bytes exceeds max_manifest_bytes="
                           f"{lim.max_manifest_bytes}")
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
            raise ApiError(413, "too_large", f"{len(keys)} blocks of {self.block_bytes} bytes make a body of {total} "
                           f"bytes, over max_request_bytes={lim.max_request_bytes}")
        if cl is not None and cl != total:
            raise ApiError(400, "bad_length", f"Content-Length {cl} != {total} (4 + manifest {mlen} + "
                           f"{len(keys)} blocks x {self.block_bytes} bytes)")
        if len(set(keys)) != len(keys):
            raise ApiError(400, "bad_request", "keys must be distinct within one put")
        if man.lifetime is not None:
            from ..fdp.lifetime import HINTS
            if man.lifetime not in HINTS:
                raise ApiError(400, "bad_request", f"lifetime={man.lifetime!r}: accepted values are {sorted(HINTS)}")
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
            mv[pos:pos + take] = chunk[:take]
            pos += take
            if take < len(chunk):
                raise ApiError(400, "bad_length", f"body is longer than the {len(keys)} blocks the manifest lists")
        if pos < payload:
            raise ApiError(400, "truncated", f"body ends after {pos} of {payload} payload bytes")
        if await body.read(1):
            raise ApiError(400, "bad_length", f"body is longer than the {len(keys)} blocks the manifest lists")
        m = self.store.manager
        charged = self.tenancy.reserve(owner, scope, keys, m.index)
        blocks = [buf[i * self.block_bytes:(i + 1) * self.block_bytes] for i in range(len(keys))]
        try:
            if self.durable:
                st = await self._run_on(buf, durable_store, m, scope, keys, blocks, man.lifetime,
                                        man.first_position)
            else:
                st = await self._run_on(buf, m.store, scope, keys, blocks, None, man.lifetime, man.first_position)
        except BaseException:
            self.tenancy.unreserve(scope, charged)
            raise
        failed = [k for k, s in zip(keys, st) if s not in (Status.OK, Status.EXISTS)]
        if failed:
            self.tenancy.unreserve(scope, [k for k in failed if k in set(charged)])
        for s in st:
            self.metrics.blocks.labels("put", tenant, s.value).inc()
        self.metrics.bytes.labels("in", tenant).inc(payload)
        return web.json_response({"statuses": [s.value for s in st], "durable": self.durable})

    async def get_blocks(self, request: web.Request) -> web.StreamResponse:
        """Batched get: binary response (manifest + the OK blocks), written in chunks."""
        tenant = self._auth(request)
        req = await self._json(request, KeysRequest)
        scope, owner, keys = self._scoped(tenant, req.namespace, req.keys, write=False)
        total = len(keys) * self.block_bytes
        if total > self.cfg.limits.max_request_bytes:
            raise ApiError(413, "too_large", f"{len(keys)} blocks of {self.block_bytes} bytes exceed "
                           f"max_request_bytes={self.cfg.limits.max_request_bytes}; split the batch")
        buf = self.buffers.take(total)
        try:
            return await self._get_body(request, tenant, req, keys, buf)
        finally:
            self._give(buf)

    async def _get_body(self, request, tenant, req, keys, buf) -> web.StreamResponse:
        total = buf.numel()
        dests = [buf[i * self.block_bytes:(i + 1) * self.block_bytes] for i in range(len(keys))]
        t0 = time.perf_counter()
        st, _ = await self._run_on(buf, self.store.manager.load, keys, dests, req.promote)
        self.metrics.load_s.observe(time.perf_counter() - t0)
        ok = [i for i, s in enumerate(st) if s is Status.OK]
        for s in st:
            self.metrics.blocks.labels("get", tenant, s.value).inc()
        man = json.dumps({"statuses": [s.value for s in st], "block_bytes": self.block_bytes},
                         separators=(",", ":")).encode()
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
                    await resp.write(mv[off:min(hi, off + _WRITE_CHUNK_BYTES)])
            await resp.write_eof()
        except ConnectionError as e:  # the client went away mid-response; nothing left to answer
            log.info("client disconnected", extra={"fields": {"event": "disconnect", "error": type(e).__name__}})
            return resp
        self.metrics.bytes.labels("out", tenant).inc(len(ok) * self.block_bytes)
        return resp

    async def exists(self, request: web.Request) -> web.Response:
        """Longest prefix present: number of leading keys resident (no recency change)."""
        tenant = self._auth(request)
        req = await self._json(request, KeysRequest)
        _, _, keys = self._scoped(tenant, req.namespace, req.keys, write=False)
        n = self.store.manager.probe(keys)
        return web.json_response({"matched_blocks": n})

    async def lookup(self, request: web.Request) -> web.Response:
        """Longest prefix with tiers and the cost model's useful count (touches recency, no references)."""
        tenant = self._auth(request)
        req = await self._json(request, KeysRequest)
        _, _, keys = self._scoped(tenant, req.namespace, req.keys, write=False)
        res = self.store.manager.lookup(keys, None, None)
        return web.json_response({"matched_blocks": res.matched_blocks, "useful_blocks": res.useful_blocks,
                                  "tiers": [t.label for t in res.tiers], "load_s": res.load_s})

    async def pin(self, request: web.Request) -> web.Response:
        """Pin the resident leading blocks for a lease."""
        tenant = self._auth(request)
        req = await self._json(request, PinRequest)
        scope, _, keys = self._scoped(tenant, req.namespace, req.keys, write=False)
        lim = self.cfg.limits
        lease_s = float(req.lease_s) if req.lease_s is not None else lim.default_lease_s
        if not 0 < lease_s <= lim.max_lease_s:
            raise ApiError(400, "bad_request", f"lease_s={lease_s}: must be in (0, {lim.max_lease_s}]")
        n = self.store.manager.probe(keys)
        try:
            lease = self.store.manager.pin(scope, keys[:n], lease_s)
        except QuotaExceeded as e:
            raise ApiError(429, "pin_quota_exceeded", str(e)) from None
        if len(self.leases) >= 4096:  # forget leases that expired or ended inside the manager
            live = self.store.manager.leases
            self.leases = {lid: t for lid, t in self.leases.items() if lid in live}
        self.leases[lease.lease_id] = tenant
        return web.json_response({"lease_id": lease.lease_id, "pinned_blocks": len(lease.keys), "lease_s": lease_s})

    async def unpin(self, request: web.Request) -> web.Response:
        """End a lease early (only the tenant that took it)."""
        tenant = self._auth(request)
        req = await self._json(request, UnpinRequest)
        ok = False
        if self.leases.get(req.lease_id) == tenant:
            ok = self.store.manager.unpin(req.lease_id)
            self.leases.pop(req.lease_id, None)
        return web.json_response({"unpinned": ok})

    async def prefetch(self, request: web.Request) -> web.Response:
        """Bring blocks whose fastest copy is on NVMe up to the memory tiers."""
        tenant = self._auth(request)
        req = await self._json(request, KeysRequest)
        _, _, keys = self._scoped(tenant, req.namespace, req.keys, write=False)
        m = self.store.manager
        cold = [k for k in keys if (t := m.tiers_of(k)) and min(t) == Tier.NVME]
        promoted = 0
        if cold and len(m.tiers) > 1:
            st, _ = await self._run(m.load, cold, None, True)
            promoted = sum(1 for s in st if s is Status.OK)
        return web.json_response({"promoted_blocks": promoted,
                                  "resident_blocks": sum(1 for k in keys if k in m.index)})

    async def invalidate(self, request: web.Request) -> web.Response:
        """Drop every block of the caller's namespace (durably)."""
        tenant = self._auth(request)
        req = await self._json(request, InvalidateRequest)
        scope, _ = self.tenancy.resolve(tenant, _hex32(req.namespace, "namespace"), write=True)
        m = self.store.manager

        def work() -> int:
            n = m.invalidate(scope)
            if m.nvme is not None:
                self.tenancy.invalidated(scope, nvme_next_seq(m))
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
        self.store.close()
