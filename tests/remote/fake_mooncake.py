"""An in-memory stand-in for ``mooncake.store.MooncakeDistributedStore``.

It keeps the return codes the real client gives (checked against
``mooncake-transfer-engine-non-cuda==0.3.13.post1`` in test_mooncake_cluster.py):
``batch_put_from`` 0 also for an existing key (the first object stays), -200
when the cluster is full; ``batch_get_into`` the object size, -704 missing,
-600 buffer too small; ``batch_is_exist`` 1/0; a read or exists grants a read
lease during which ``remove`` returns -706. Knobs make it fail like a cluster
does: ``master_down`` (-900 everywhere), ``hang`` (calls block until the event
is set), ``dead`` (transfers fail with -800).

Memory moves with ``ctypes.memmove`` between the caller's pointers and Python
``bytes``, as the real client moves it between registered buffers and segments.
"""

from __future__ import annotations

import ctypes
import threading
import time


class FakeCluster:
    """Objects and failure knobs shared by every :class:`FakeStore` of one test."""

    def __init__(self, capacity_bytes: int = 1 << 30, lease_s: float = 0.2) -> None:
        self.objects: dict[str, bytes] = {}
        self.leases: dict[str, float] = {}
        self.capacity_bytes = capacity_bytes
        self.lease_s = lease_s
        self.lock = threading.Lock()
        self.master_down = False
        self.dead = False  # transfers fail (-800)
        self.setup_rc = 0
        self.hang = threading.Event()
        self.hang.set()  # set = calls proceed
        self.calls: list[tuple[str, tuple]] = []
        self.record = False

    def used(self) -> int:
        return sum(len(v) for v in self.objects.values())


class FakeStore:
    """The client calls :class:`tierstore.remote.mooncake.MooncakeTier` uses."""

    def __init__(self, cluster: FakeCluster) -> None:
        self.c = cluster
        self.registered: list[tuple[int, int]] = []
        self.closed = False

    def _enter(self, name: str, *args) -> None:
        self.c.hang.wait()
        if self.c.record:
            with self.c.lock:
                self.c.calls.append((name, args))

    def _lease(self, name: str) -> None:
        self.c.leases[name] = time.monotonic() + self.c.lease_s

    def _registered(self, ptr: int, n: int) -> bool:
        return any(b <= ptr and ptr + n <= b + m for b, m in self.registered)

    def setup(
        self,
        local_hostname,
        metadata_server,
        global_segment_size,
        local_buffer_size,
        protocol,
        rdma_devices,
        master_server_addr,
        tenant_id="default",
    ) -> int:
        self._enter("setup")
        return -900 if self.c.master_down else self.c.setup_rc

    def register_buffer(self, ptr: int, size: int) -> int:
        self.registered.append((ptr, size))
        return 0

    def health_check(self) -> int:
        return 1 if self.closed else (2 if self.c.master_down else 0)

    def batch_put_from(self, keys, ptrs, sizes) -> list[int]:
        self._enter("batch_put_from", tuple(keys))
        if self.c.master_down:
            return [-900] * len(keys)
        out = []
        for k, p, n in zip(keys, ptrs, sizes):
            if not self._registered(p, n):
                out.append(-600)
                continue
            with self.c.lock:
                if k in self.c.objects:
                    out.append(0)
                elif self.c.used() + n > self.c.capacity_bytes:
                    out.append(-200)
                elif self.c.dead:
                    out.append(-800)
                else:
                    self.c.objects[k] = ctypes.string_at(p, n)
                    out.append(0)
        return out

    def batch_put_from_multi_buffers(self, keys, all_ptrs, all_sizes) -> list[int]:
        self._enter("batch_put_from_multi_buffers", tuple(keys))
        if self.c.master_down:
            return [-900] * len(keys)
        out = []
        for k, ps, ns in zip(keys, all_ptrs, all_sizes):
            if not all(self._registered(p, n) for p, n in zip(ps, ns)):
                out.append(-600)
                continue
            with self.c.lock:
                if k in self.c.objects:
                    out.append(0)
                elif self.c.used() + sum(ns) > self.c.capacity_bytes:
                    out.append(-200)
                else:
                    self.c.objects[k] = b"".join(ctypes.string_at(p, n) for p, n in zip(ps, ns))
                    out.append(0)
        return out

    def put(self, key: str, value: bytes) -> int:
        """Raw put (a foreign or hostile writer)."""
        with self.c.lock:
            self.c.objects.setdefault(key, bytes(value))
        return 0

    def _get(self, k: str, bufs: list[tuple[int, int]]) -> int:
        with self.c.lock:
            obj = self.c.objects.get(k)
            if obj is None:
                return -704
            if self.c.dead:
                return -800
            if len(obj) > sum(n for _p, n in bufs):
                return -600
            self._lease(k)
        off = 0
        for p, n in bufs:
            chunk = obj[off : off + n]
            ctypes.memmove(p, chunk, len(chunk))
            off += len(chunk)
            if off >= len(obj):
                break
        return len(obj)

    def batch_get_into(self, keys, ptrs, sizes) -> list[int]:
        self._enter("batch_get_into", tuple(keys))
        if self.c.master_down:
            return [-900] * len(keys)
        return [self._get(k, [(p, n)]) for k, p, n in zip(keys, ptrs, sizes)]

    def batch_get_into_multi_buffers(self, keys, all_ptrs, all_sizes) -> list[int]:
        self._enter("batch_get_into_multi_buffers", tuple(keys))
        if self.c.master_down:
            return [-900] * len(keys)
        return [self._get(k, list(zip(ps, ns))) for k, ps, ns in zip(keys, all_ptrs, all_sizes)]

    def batch_is_exist(self, keys) -> list[int]:
        self._enter("batch_is_exist", tuple(keys))
        if self.c.master_down:
            return [-900] * len(keys)
        out = []
        with self.c.lock:
            for k in keys:
                if k in self.c.objects:
                    self._lease(k)
                    out.append(1)
                else:
                    out.append(0)
        return out

    def remove(self, key: str, force: bool = False) -> int:
        self._enter("remove", key)
        if self.c.master_down:
            return -900
        with self.c.lock:
            if key not in self.c.objects:
                return -704
            if not force and self.c.leases.get(key, 0) > time.monotonic():
                return -706
            del self.c.objects[key]
        return 0

    def close(self) -> int:
        self.closed = True
        return 0
