"""Prometheus metrics of the daemon: request counters and latencies, and scrape-time store gauges.

Every metric lives in the daemon's private :class:`~prometheus_client.CollectorRegistry`
(:class:`ServerMetrics`); :class:`_StoreCollector` reads the store, the
segment store and the tenancy at scrape time. :class:`NodeMetrics` adds the node socket's
``tierstore_node_*`` families beside HTTP's (same scheme: requests by operation and outcome,
latency, blocks and payload bytes by tenant). The names are listed in ``tierstore/server/README.md``.
"""

from __future__ import annotations

import math
import threading
from typing import TYPE_CHECKING, NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..errors import Status
from .config import NO_QUOTA_BYTES

if TYPE_CHECKING:
    from ..api import KVStore
    from .service import Service
    from .tenancy import Tenancy

__all__ = ["ServerMetrics", "NodeMetrics"]

_LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


def _int_counters(name: str, documentation: str, counters: dict) -> CounterMetricFamily:
    """A counter family ``name{counter=...}`` of the ``int`` values of ``counters`` (a stats dict)."""
    family = CounterMetricFamily(name, documentation, labels=["counter"])
    for k, v in counters.items():
        if isinstance(v, int):
            family.add_metric([k], v)
    return family


_STATUSES = tuple(Status)

#: The segment store's counts that ``tierstore_nvme_events_total{counter}`` exports (its
#: ``stats()`` keys; the rest of its stats are gauges or nested)
NVME_EVENTS = (
    "recovered_blocks",
    "recovery_damaged_extents",
    "recovery_dropped_blocks",
    "recovery_invalidated_blocks",
    "corrupt_blocks",
    "get_io_errors",
    "put_no_space",
    "trim_errors",
    "gc_evicted_blocks",
    "region_evicted_blocks",
    "preallocate_errors",
)


class _TrafficHelp(NamedTuple):
    """The help texts of the families :class:`_Traffic` declares."""

    requests: str
    request_s: str
    blocks: str
    payload_bytes: str


#: :class:`_Traffic`'s help texts, by prefix: HTTP's (``tierstore``) and the node socket's
_TRAFFIC_HELP = {
    "tierstore": _TrafficHelp(
        "API requests by operation and HTTP status",
        "API request latency",
        "Blocks by operation, tenant and status",
        "Block payload bytes by direction and tenant",
    ),
    "tierstore_node": _TrafficHelp(
        "Node socket requests by message type and outcome (ok, or the error code)",
        "Node socket request latency (service side)",
        "Blocks by operation (put: store outcomes, get: load tickets), tenant and status",
        "Block payload bytes copied through the shared segment, by direction and tenant",
    ),
}


class _Traffic:
    """``<prefix>_requests`` (requests by operation and outcome), ``<prefix>_request_seconds``
    (their latency by operation), ``<prefix>_blocks`` (blocks by operation, tenant and status)
    and ``<prefix>_payload_bytes`` (payload bytes by direction and tenant): the scheme HTTP's and
    the node socket's share (help texts: :data:`_TRAFFIC_HELP`)."""

    def __init__(self, r: CollectorRegistry, prefix: str) -> None:
        doc = _TRAFFIC_HELP[prefix]
        self.requests = Counter(f"{prefix}_requests", doc.requests, ["op", "code"], registry=r)
        self.request_s = Histogram(
            f"{prefix}_request_seconds", doc.request_s, ["op"], registry=r, buckets=_LATENCY_BUCKETS_S
        )
        self.blocks = Counter(f"{prefix}_blocks", doc.blocks, ["op", "tenant", "status"], registry=r)
        self.bytes = Counter(
            f"{prefix}_payload_bytes", doc.payload_bytes, ["direction", "tenant"], registry=r
        )
        self._children: dict[tuple, Counter] = {}  # labels() costs a lock and a tuple per call

    def _child(self, family: Counter, *labels: str) -> Counter:
        key = (id(family), labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*labels)
        return child

    def count_blocks(self, op: str, tenant: str, statuses) -> None:
        """Count blocks of a store outcome or load (ticket) by status."""
        statuses = statuses if isinstance(statuses, list) else list(statuses)
        if statuses and statuses.count(Status.OK) == len(
            statuses
        ):  # every block OK: one count, not one a status
            self._child(self.blocks, op, tenant, Status.OK.value).inc(len(statuses))
            return
        for st in _STATUSES:  # list.count compares by identity in C: no Enum hash or .value per block
            n = statuses.count(st)
            if n:
                self._child(self.blocks, op, tenant, st.value).inc(n)

    def count_bytes(self, direction: str, tenant: str, n: int) -> None:
        """Count ``n`` payload bytes moved in ``direction`` (``in``: stored, ``out``: loaded)."""
        self._child(self.bytes, direction, tenant).inc(n)


class _StoreCollector:
    """Scrape-time gauges: bytes per tier, store counters, WAF, tenant usage; with an HTTP
    service (``svc``), its requests in flight."""

    def __init__(self, metrics: ServerMetrics, store: KVStore, tenancy: Tenancy, svc: Service | None) -> None:
        self.metrics, self.store, self.tenancy, self.svc = metrics, store, tenancy, svc

    def collect(self):
        store = self.store
        g = GaugeMetricFamily("tierstore_tier_bytes", "Resident bytes per tier", labels=["tier"])
        for tier, b in store.bytes_per_tier().items():
            g.add_metric([tier], b)
        yield g
        cap = GaugeMetricFamily("tierstore_tier_capacity_bytes", "Capacity per tier", labels=["tier"])
        for tier, b in store.capacity_bytes().items():
            cap.add_metric([tier], b)
        yield cap
        snap = store.stats()
        yield _int_counters("tierstore_manager_events", "Store counters (see tierstore.metrics)", snap)
        ratio = GaugeMetricFamily(
            "tierstore_block_hit_ratio",
            "Blocks found / blocks asked for, over gets (OK blocks) and lookups (matched "
            "blocks); 0 before any; see tierstore_block_hits_total{op}",
        )
        ratio.add_metric([], self.metrics.hit_ratio())
        yield ratio
        if store.nvme is not None:
            st = snap["nvme_backend"]
            waf = GaugeMetricFamily(
                "tierstore_nvme_host_write_amplification",
                "(user + GC bytes written) / user bytes written, from the segment store",
            )
            waf.add_metric([], float(st.get("host_write_amplification", 1.0)))
            yield waf
            usable = GaugeMetricFamily(
                "tierstore_nvme_usable_bytes",
                'KV bytes the NVMe tier can hold, as tierstore_tier_capacity_bytes{tier="nvme"}: '
                "that, or once its file system filled (preallocate_errors) the share of the segments "
                "that held space then (tierstore.io.segment_manager)",
            )
            # SegmentStorage.stats has usable_bytes only while the tier is short of its capacity
            usable.add_metric([], float(st.get("usable_bytes", store.capacity_bytes().get("nvme", 0))))
            yield usable
            yield _int_counters(
                "tierstore_nvme_events",
                "NVMe tier counters: blocks recovered, dropped and damaged extents at the last open, "
                "corrupt and failed reads, refused writes, evictions (tierstore.io.segments)",
                {k: st[k] for k in NVME_EVENTS if k in st},
            )
            dev = st.get("engine", {}).get("device_waf") if isinstance(st.get("engine"), dict) else None
            if dev is not None:
                dw = GaugeMetricFamily(
                    "tierstore_nvme_device_write_amplification", "WAF reported by the device"
                )
                dw.add_metric([], float(dev))
                yield dw
        if store.remote is not None:  # the shared remote tier (Mooncake Store)
            rs = snap["remote"]
            up = GaugeMetricFamily(
                "tierstore_remote_up",
                "Whether the shared remote tier is connected (1) or degraded (0; local tiers keep serving)",
            )
            up.add_metric([], 1.0 if rs["state"] == "ok" else 0.0)
            yield up
            yield _int_counters(
                "tierstore_remote_events", "Remote tier counters (tierstore.remote.mooncake)", rs
            )
        use = GaugeMetricFamily(
            "tierstore_tenant_usage_bytes", "Resident bytes per tenant (owner)", labels=["tenant"]
        )
        quota = GaugeMetricFamily(
            "tierstore_tenant_quota_bytes", "Byte quota per tenant (owner); +Inf: none", labels=["tenant"]
        )
        for owner, b in self.tenancy.usage_bytes(store).items():
            use.add_metric([owner], b)
            q = self.tenancy.quota_bytes.get(owner, 0)
            quota.add_metric([owner], math.inf if q >= NO_QUOTA_BYTES else q)
        yield use
        yield quota
        if self.svc is not None:
            inf = GaugeMetricFamily("tierstore_inflight_requests", "API requests in progress")
            inf.add_metric([], self.svc.inflight)
            yield inf


class ServerMetrics(_Traffic):
    """Prometheus metrics of the daemon (private registry).

    Parameters
    ----------
    svc : Service or None
        The HTTP service; ``None`` for ``tierstore serve --node`` (no HTTP listener), which
        then gives ``store`` and ``tenancy``: every family above but
        ``tierstore_inflight_requests``, the HTTP request families staying at zero.
    store, tenancy : optional
        The store and tenancy the scrape-time gauges read (default: ``svc``'s).
    """

    def __init__(
        self, svc: Service | None, store: KVStore | None = None, tenancy: Tenancy | None = None
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        super().__init__(r, "tierstore")
        self.load_s = Histogram(
            "tierstore_load_latency_seconds",
            "Store load (get) latency per request",
            registry=r,
            buckets=(
                0.0001,
                0.00025,
                0.0005,
                0.001,
                0.0025,
                0.005,
                0.01,
                0.025,
                0.05,
                0.1,
                0.25,
                0.5,
                1,
                2.5,
            ),
        )
        self.rejected = Counter(
            "tierstore_rejected_requests", "Requests refused for backpressure", ["reason"], registry=r
        )
        self.block_requests = Counter(
            "tierstore_block_requests", "Blocks asked for, by get and lookup", ["op"], registry=r
        )
        self.block_hits = Counter(
            "tierstore_block_hits",
            "Blocks found: OK blocks of a get, matched blocks of a lookup",
            ["op"],
            registry=r,
        )
        self._hits_lock = threading.Lock()
        self._asked = 0
        self._found = 0
        if svc is not None:
            store, tenancy = svc.store, svc.tenancy
        if store is None or tenancy is None:
            raise TypeError("ServerMetrics needs svc, or store and tenancy")
        r.register(_StoreCollector(self, store, tenancy, svc))

    def count_hits(self, op: str, asked: int, found: int) -> None:
        """Count ``asked`` blocks of a get or lookup, ``found`` of them present (OK / matched)."""
        self.block_requests.labels(op).inc(asked)
        self.block_hits.labels(op).inc(found)
        with self._hits_lock:
            self._asked += asked
            self._found += found

    def hit_ratio(self) -> float:
        """``tierstore_block_hit_ratio``: found / asked over gets and lookups (0.0 before any)."""
        with self._hits_lock:
            return self._found / self._asked if self._asked else 0.0


class _SessionsCollector:
    """``tierstore_node_sessions``: node sessions open, read from the server at scrape time."""

    def __init__(self) -> None:
        self.server = None

    def collect(self):
        g = GaugeMetricFamily("tierstore_node_sessions", "Node socket sessions open")
        g.add_metric([], self.server.sessions() if self.server is not None else 0)
        yield g


class NodeMetrics(_Traffic):
    """The node transport's Prometheus metrics, in the daemon's registry beside HTTP's.

    Parameters
    ----------
    registry : CollectorRegistry
        The daemon's (:attr:`ServerMetrics.registry`), or a registry of its own (``--node``).
    server_metrics : ServerMetrics, optional
        HTTP's metrics: node lookups and loads then count in ``tierstore_block_requests`` /
        ``tierstore_block_hits`` (ops ``node_lookup``, ``node_load``) and the hit ratio.
    """

    def __init__(self, registry: CollectorRegistry, server_metrics: ServerMetrics | None = None) -> None:
        r = registry
        self.server_metrics = server_metrics
        super().__init__(r, "tierstore_node")
        self.sessions_opened = Counter(
            "tierstore_node_sessions_opened", "Node sessions welcomed, by tenant", ["tenant"], registry=r
        )
        self.sessions_refused = Counter(
            "tierstore_node_sessions_refused",
            "Node sessions refused at connect (auth, busy, hello) or closed for a bad frame",
            ["reason"],
            registry=r,
        )
        self._sessions = _SessionsCollector()
        r.register(self._sessions)
        self._request_children: dict[tuple[str, str], tuple] = {}

    def attach(self, server) -> None:
        """Read ``tierstore_node_sessions`` from ``server`` (a ``NodeServer``)."""
        self._sessions.server = server

    def request(self, op: str, code: str, seconds: float) -> None:
        """Count one request of message type ``op`` answered with ``code``."""
        children = self._request_children.get((op, code))
        if children is None:  # labels() costs a lock and a tuple per call: once per pair
            children = self._request_children[(op, code)] = (
                self.requests.labels(op, code),
                self.request_s.labels(op),
            )
        children[0].inc()
        children[1].observe(seconds)

    def count_hits(self, op: str, asked: int, found: int) -> None:
        """As :meth:`ServerMetrics.count_hits` (a no-op without HTTP's metrics)."""
        if self.server_metrics is not None:
            self.server_metrics.count_hits(op, asked, found)
