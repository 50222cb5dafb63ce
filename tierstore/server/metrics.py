"""Prometheus metrics of the daemon: request counters and latencies, and scrape-time store gauges.

Every metric lives in the daemon's private :class:`~prometheus_client.CollectorRegistry`
(:class:`ServerMetrics`); :class:`_StoreCollector` reads the store, the
segment store and the tenancy at scrape time. The names are listed in
``tierstore/server/README.md``.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from .service import Service

__all__ = ["ServerMetrics"]


def _int_counters(name: str, documentation: str, counters: dict) -> CounterMetricFamily:
    """A counter family ``name{counter=...}`` of the ``int`` values of ``counters`` (a stats dict)."""
    family = CounterMetricFamily(name, documentation, labels=["counter"])
    for k, v in counters.items():
        if isinstance(v, int):
            family.add_metric([k], v)
    return family


class _StoreCollector:
    """Scrape-time gauges: bytes per tier, store counters, WAF, tenant usage."""

    def __init__(self, svc: Service) -> None:
        self.svc = svc

    def collect(self):
        store = self.svc.store
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
        ratio.add_metric([], self.svc.metrics.hit_ratio())
        yield ratio
        if store.nvme is not None:
            st = snap["nvme_backend"]
            waf = GaugeMetricFamily(
                "tierstore_nvme_host_write_amplification",
                "(user + GC bytes written) / user bytes written, from the segment store",
            )
            waf.add_metric([], float(st.get("host_write_amplification", 1.0)))
            yield waf
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
            "tierstore_tenant_quota_bytes", "Byte quota per tenant (owner)", labels=["tenant"]
        )
        for owner, b in self.svc.tenancy.usage_bytes(store).items():
            use.add_metric([owner], b)
            quota.add_metric([owner], self.svc.tenancy.quota_bytes.get(owner, 0))
        yield use
        yield quota
        inf = GaugeMetricFamily("tierstore_inflight_requests", "API requests in progress")
        inf.add_metric([], self.svc.inflight)
        yield inf


class ServerMetrics:
    """Prometheus metrics of the daemon (private registry)."""

    def __init__(self, svc: Service) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "tierstore_requests", "API requests by operation and HTTP status", ["op", "code"], registry=r
        )
        self.request_s = Histogram(
            "tierstore_request_seconds",
            "API request latency",
            ["op"],
            registry=r,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )
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
        self.blocks = Counter(
            "tierstore_blocks",
            "Blocks by operation, tenant and status",
            ["op", "tenant", "status"],
            registry=r,
        )
        self.bytes = Counter(
            "tierstore_payload_bytes",
            "Block payload bytes by direction and tenant",
            ["direction", "tenant"],
            registry=r,
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
        r.register(_StoreCollector(svc))

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
