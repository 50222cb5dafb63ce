"""The load side of the Mooncake tier: registered memory, ``get_into`` and the checks of a fetched object.

:class:`Loader` is a part of :class:`~tierstore.remote.mooncake.MooncakeTier` (a base class of
it, not a component of its own): it runs on the tier's lock, counters and slots. ``get_into``
loads in batches of ``max_batch_blocks``: a destination in plain memory through registered
staging slots (``batch_get_into``; the payload is copied on only after every check passed), a
destination inside a :meth:`~Loader.register_memory` region zero-copy
(``batch_get_into_multi_buffers``: the header into a registered header slot, the payload in
place; a timed-out call keeps the range held from its owner until it returns). ``_judge``
checks a fetched object's size, header and CRC-32C: a mismatch is ``IO_ERROR``, counted per
reason, and the object is queued for removal. See ARCHITECTURE.md, "The remote tier".
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from ..errors import LayoutError, Status
from .calls import (
    _NO_RESULT,
    INVALID_PARAMS,
    OBJECT_NOT_FOUND,
    RPC_FAIL,
    RegisteredRegion,
    _callback,
    _memcpy,
)
from .format import HEADER_BYTES, ObjectCorrupt, check_header, check_payload

log = logging.getLogger("tierstore.remote.mooncake")  # the tier's one logger


class Loader:
    """``register_memory``, ``get_into`` and the object checks of
    :class:`~tierstore.remote.mooncake.MooncakeTier`.

    Uses the tier's ``_lock``, ``_counters``, ``_errors``, ``_corrupt``, ``_removals``, slots
    (``_get_slots``, ``_hdr_slots``), ``_regions``, ``_namer``, ``_call`` and ``_degrade``.
    """

    def register_memory(self, tensor: torch.Tensor, on_hold: Callable[[int, int], None],
                        on_release: Callable[[int, int], None]) -> RegisteredRegion:
        """Register memory (the host tier's pool) for zero-copy loads and publishes.

        Parameters
        ----------
        tensor : torch.Tensor
            Contiguous CPU tensor; its whole storage is registered with Mooncake
            now and after every reconnect.
        on_hold : callable(offset_bytes, nbytes)
            The tier may still read or write ``[offset, offset + nbytes)`` of the
            region: the owner must neither change those bytes nor hand that
            memory to another block until ``on_release``. Called (a) by
            :meth:`put` for a block published zero-copy, until its publish call
            returns; (b) when a zero-copy load timed out, until the late
            transfer returns.
        on_release : callable(offset_bytes, nbytes)
            The range is the owner's again. Both callbacks may be called from
            the caller's thread or a tier thread, must be quick and thread-safe,
            and must not call back into the tier.

        Returns
        -------
        RegisteredRegion

        Notes
        -----
        :meth:`get_into` loads a destination inside a region zero-copy; for such
        a destination a block whose status is not ``OK`` leaves the destination's
        content undefined (it may hold a rejected object's bytes). The caller
        loads into memory it has not published yet and frees it on failure.

        Raises
        ------
        LayoutError
            For a non-CPU or non-contiguous tensor.
        """
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu" or not tensor.is_contiguous():
            raise LayoutError("register_memory: a contiguous CPU tensor is required")
        region = RegisteredRegion(tensor, on_hold, on_release)
        client = self._usable()
        if client is not None:
            rc = self._call("register_buffer", client.register_buffer, region.base_ptr, region.nbytes)
            if rc is not _NO_RESULT and rc != 0:
                self._degrade(f"register_buffer returned {rc}", code=rc)
        with self._lock:
            self._regions.append(region)
        return region

    def _region_of(self, t: torch.Tensor) -> RegisteredRegion | None:
        ptr, n = t.data_ptr(), self.block_bytes
        for r in self._regions:
            if r.holds(ptr, n):
                return r
        return None

    def set_load_observer(self, fn: Callable[[int, float], None] | None) -> None:
        """Call ``fn(blocks, seconds)`` after every load call that delivered
        blocks: the seconds from the Mooncake call to the end of the checks of
        its blocks, ``blocks`` the verified ones. The store's cost model prices
        remote loads from these (``build`` wires it). ``fn`` runs on the
        caller's thread and must not raise."""
        self._load_observer = fn

    def _observe(self, t0: float, out: list, idx: Sequence[int]) -> None:
        fn = self._load_observer
        if fn is None:
            return
        ok = sum(out[i] is Status.OK for i in idx)
        if ok:
            fn(ok, time.perf_counter() - t0)

    def get_into(self, keys: Sequence[bytes], dests: Sequence[torch.Tensor]) -> list[Status]:
        """Load blocks into ``dests``.

        Parameters
        ----------
        keys : sequence of bytes
            32-byte block keys.
        dests : sequence of torch.Tensor
            Contiguous CPU tensors of ``block_bytes`` bytes. A destination
            inside a :meth:`register_memory` region is loaded zero-copy (see
            there); any other one is written only with bytes that passed every
            check, and left untouched otherwise.

        Returns
        -------
        list of Status
            ``OK`` loaded and verified; ``MISS`` not in the cluster, or the tier
            is degraded; ``IO_ERROR`` the transfer failed, timed out, or the
            object failed a check (counted per reason). Each non-``OK`` block is
            a miss for the engine.

        Raises
        ------
        LayoutError
            For keys or destinations of the wrong size or kind.
        """
        self._check_keys(keys, dests, "dests")
        n = len(keys)
        out = [Status.MISS] * n
        if n == 0:
            return out
        self._bump("gets_requested", n)
        if self._usable() is None:
            self._bump("gets_degraded", n)
            return out
        with self._lock:
            regions = [self._region_of(d) for d in dests]
        zc = [i for i in range(n) if regions[i] is not None]
        staged = [i for i in range(n) if regions[i] is None]
        mb = self.config.max_batch_blocks
        for group, fn in ((staged, self._get_staged), (zc, self._get_zero_copy)):
            for c in range(0, len(group), mb):
                idx = group[c:c + mb]
                client = self._usable()
                if client is None:
                    self._bump("gets_degraded", len(idx))
                    continue
                fn(client, [bytes(keys[i]) for i in idx], [dests[i] for i in idx],
                   [regions[i] for i in idx], idx, out)
        return out

    def _get_staged(self, client, keys, dests, _regions, idx, out) -> None:
        slots, keys, dests, _regions, idx = self._take_slots(self._get_slots, keys, dests, _regions, idx, out)
        if not slots:
            return
        names = [self._namer(k) for k in keys]
        self._bump("get_calls")
        t0 = time.perf_counter()
        rcs = self._call("batch_get_into", client.batch_get_into, names,
                         [self._get_slots.ptr(i) for i in slots], [self.object_bytes] * len(keys),
                         on_late=lambda: self._get_slots.give(slots))
        if rcs is _NO_RESULT:
            self._fail_all(idx, out)
            return
        try:
            for j, (key, rc) in enumerate(zip(keys, rcs)):
                st = self._judge(key, names[j], rc, self._get_slots.view(slots[j], 0, HEADER_BYTES),
                                 self._get_slots.view(slots[j], HEADER_BYTES, self.block_bytes))
                if st is Status.OK:
                    _memcpy(dests[j].data_ptr(), self._get_slots.ptr(slots[j], HEADER_BYTES), self.block_bytes)
                    self._bump("staged_gets")
                out[idx[j]] = st
        finally:
            self._get_slots.give(slots)
        self._observe(t0, out, idx)
        self._after_gets(rcs)

    def _get_zero_copy(self, client, keys, dests, regions, idx, out) -> None:
        slots, keys, dests, regions, idx = self._take_slots(self._hdr_slots, keys, dests, regions, idx, out)
        if not slots:
            return
        names = [self._namer(k) for k in keys]
        ranges = [(r, d.data_ptr() - r.base_ptr) for r, d in zip(regions, dests)]

        quarantined = []

        def quarantine() -> None:
            quarantined.append(True)
            for r, off in ranges:
                _callback(r.on_hold, off, self.block_bytes)

        def late() -> None:
            self._hdr_slots.give(slots)
            if quarantined:
                for r, off in ranges:
                    _callback(r.on_release, off, self.block_bytes)
        self._bump("get_calls")
        t0 = time.perf_counter()
        rcs = self._call("batch_get_into_multi_buffers", client.batch_get_into_multi_buffers, names,
                         [[self._hdr_slots.ptr(i), d.data_ptr()] for i, d in zip(slots, dests)],
                         [[HEADER_BYTES, self.block_bytes]] * len(keys), on_timeout=quarantine, on_late=late)
        if rcs is _NO_RESULT:
            self._fail_all(idx, out)
            return
        try:
            for j, (key, rc) in enumerate(zip(keys, rcs)):
                st = self._judge(key, names[j], rc, self._hdr_slots.view(slots[j], 0, HEADER_BYTES),
                                 dests[j].reshape(-1).view(torch.uint8))
                if st is Status.OK:
                    self._bump("zero_copy_gets")
                out[idx[j]] = st
        finally:
            self._hdr_slots.give(slots)
        self._observe(t0, out, idx)
        self._after_gets(rcs)

    def _take_slots(self, pool, keys, dests, regions, idx, out) -> tuple:
        """Up to ``len(keys)`` slots of ``pool`` (waits at most the call timeout) and the blocks they
        serve: ``(slots, keys, dests, regions, idx)`` cut to ``len(slots)``. The blocks left without
        a slot are ``IO_ERROR`` in ``out`` and counted in ``get_no_slot``."""
        slots = pool.take(len(keys), wait_s=self._timeout_s)
        k = len(slots)
        if k < len(keys):
            self._bump("get_no_slot", len(keys) - k)
            for j in range(k, len(keys)):
                out[idx[j]] = Status.IO_ERROR
        return slots, keys[:k], dests[:k], regions[:k], idx[:k]

    def _fail_all(self, idx, out) -> None:
        for i in idx:
            out[i] = Status.IO_ERROR
        self._bump("get_errors", len(idx))

    def _judge(self, key: bytes, name: str, rc: int, header: torch.Tensor, payload: torch.Tensor) -> Status:
        """Status of one fetched object; checks header and payload."""
        if rc == OBJECT_NOT_FOUND:
            self._bump("get_misses")
            return Status.MISS
        if rc < 0:
            with self._lock:
                self._counters["get_errors"] += 1
                self._errors[rc] += 1
                if rc == INVALID_PARAMS:  # the object is larger than ours: not a block of this store
                    self._counters["corrupt_objects"] += 1
                    self._corrupt["size"] += 1
            return Status.IO_ERROR
        try:
            if rc != self.object_bytes:
                raise ObjectCorrupt("size", f"object of {rc} bytes, expected {self.object_bytes}")
            crc = check_header(header.numpy(), key, self.block_bytes)
            check_payload(key, payload.numpy(), crc)
        except ObjectCorrupt as e:
            with self._lock:
                self._counters["get_errors"] += 1
                self._counters["corrupt_objects"] += 1
                self._corrupt[e.reason] += 1
                self._removals.setdefault(name, [time.monotonic(), 0])
                self._work.notify_all()
            log.warning("mooncake tier: %s (%s); the block is a miss and the object is removed", e, name)
            return Status.IO_ERROR
        with self._lock:
            self._counters["get_hits"] += 1
            self._counters["get_bytes"] += self.block_bytes
        return Status.OK

    def _after_gets(self, rcs) -> None:
        if RPC_FAIL in rcs:
            self._degrade("batch_get_into: master unreachable (-900)", count="rpc_failures")
