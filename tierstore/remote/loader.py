"""The load side of the Mooncake tier: registered memory, ``get_into`` and the checks of a fetched object.

:class:`Loader` is a part that :class:`~tierstore.remote.mooncake.MooncakeTier` builds and owns:
it keeps the registered regions and the load observer, and reaches the tier's lock, counters,
state and calls only through :class:`~tierstore.remote.calls.TierLink`. ``get_into``
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
from typing import Any

import torch

from ..errors import LayoutError, Status
from .calls import (
    _NO_RESULT,
    INVALID_PARAMS,
    OBJECT_NOT_FOUND,
    RPC_FAIL,
    RegisteredRegion,
    TierLink,
    _memcpy,
    _Slots,
)
from .format import HEADER_BYTES, ObjectCorrupt, check_header, check_payload

log = logging.getLogger("tierstore.remote.mooncake")  # the tier's one logger


class Loader:
    """``register_memory``, ``get_into`` and the object checks: the load part of a
    :class:`~tierstore.remote.mooncake.MooncakeTier`, which builds it.

    Parameters
    ----------
    tier : TierLink
        The tier's lock, counters, state and Mooncake calls.
    get_slots : _Slots
        Registered staging slots of ``object_bytes`` (loads into plain memory).
    hdr_slots : _Slots
        Registered header slots (zero-copy loads; shared with the publisher).

    Owns the registered regions and the load observer.
    """

    def __init__(self, tier: TierLink, get_slots: _Slots, hdr_slots: _Slots) -> None:
        self._tier = tier
        self._get_slots = get_slots
        self._hdr_slots = hdr_slots
        self._regions: list[RegisteredRegion] = []  # under the tier's lock
        self._load_observer: Callable[[int, float], None] | None = None

    def register_memory(
        self,
        tensor: torch.Tensor,
        on_hold: Callable[[int, int], None],
        on_release: Callable[[int, int], None],
    ) -> RegisteredRegion:
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
            ``put`` for a block published zero-copy, until its publish call
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
        tier = self._tier
        client = tier._usable()
        if client is not None:
            rc = tier._call("register_buffer", client.register_buffer, region.base_ptr, region.nbytes)
            if rc is not _NO_RESULT and rc != 0:
                tier._degrade(f"register_buffer returned {rc}", code=rc)
        with tier._lock:
            self._regions.append(region)
        return region

    def free_slots(self) -> int:
        """Free staging slots for loads into plain memory."""
        return self._get_slots.free_count()

    def regions(self) -> list[tuple[int, int]]:
        """``(base_ptr, nbytes)`` of every registered region (what a new client registers)."""
        with self._tier._lock:
            return [(r.base_ptr, r.nbytes) for r in self._regions]

    def region_of(self, t: torch.Tensor) -> RegisteredRegion | None:
        """The registered region holding block ``t``, or ``None``. Under the tier's lock."""
        ptr, n = t.data_ptr(), self._tier.block_bytes
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

    def _observe(self, t0: float, out: list[Status], idx: Sequence[int]) -> None:
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
        tier = self._tier
        tier._check_keys(keys, dests, "dests")
        n = len(keys)
        out = [Status.MISS] * n
        if n == 0:
            return out
        tier._bump("gets_requested", n)
        if tier._usable() is None:
            tier._bump("gets_degraded", n)
            return out
        with tier._lock:
            regions = [self.region_of(d) for d in dests]
        mb = tier.config.max_batch_blocks
        for zero_copy in (False, True):
            group = [i for i in range(n) if (regions[i] is not None) == zero_copy]
            for c in range(0, len(group), mb):
                idx = group[c : c + mb]
                client = tier._usable()
                if client is None:
                    tier._bump("gets_degraded", len(idx))
                    continue
                self._get_batch(
                    client,
                    zero_copy,
                    [bytes(keys[i]) for i in idx],
                    [dests[i] for i in idx],
                    [regions[i] for i in idx],
                    idx,
                    out,
                )
        return out

    def _get_batch(
        self,
        client: Any,
        zero_copy: bool,
        keys: list[bytes],
        dests: list[torch.Tensor],
        regions: list[Any],
        idx: list[int],
        out: list[Status],
    ) -> None:
        """One Mooncake load call: staged (``batch_get_into`` into staging slots, each payload
        copied on once it passed every check) or zero-copy (``batch_get_into_multi_buffers``:
        the header into a header slot, the payload into its destination)."""
        tier, bb = self._tier, self._tier.block_bytes
        pool = self._hdr_slots if zero_copy else self._get_slots
        slots, keys, dests, regions, idx = self._take_slots(pool, keys, dests, regions, idx, out)
        if not slots:
            return
        names = [tier._namer(k) for k in keys]
        tier._bump("get_calls")
        t0 = time.perf_counter()
        if zero_copy:
            rcs = self._call_zero_copy(client, names, slots, dests, regions)
        else:
            rcs = tier._call(
                "batch_get_into",
                client.batch_get_into,
                names,
                [pool.ptr(i) for i in slots],
                [tier.object_bytes] * len(keys),
                on_late=lambda: pool.give(slots),
            )
        if rcs is _NO_RESULT:
            for i in idx:
                out[i] = Status.IO_ERROR
            tier._bump("get_errors", len(idx))
            return
        try:
            for j, (key, rc) in enumerate(zip(keys, rcs)):
                payload = (
                    dests[j].reshape(-1).view(torch.uint8)
                    if zero_copy
                    else pool.view(slots[j], HEADER_BYTES, bb)
                )
                st = self._judge(key, names[j], rc, pool.view(slots[j], 0, HEADER_BYTES), payload)
                if st is Status.OK:
                    if not zero_copy:
                        _memcpy(dests[j].data_ptr(), pool.ptr(slots[j], HEADER_BYTES), bb)
                    tier._bump("zero_copy_gets" if zero_copy else "staged_gets")
                out[idx[j]] = st
        finally:
            pool.give(slots)
        self._observe(t0, out, idx)
        if RPC_FAIL in rcs:
            tier._degrade("batch_get_into: master unreachable (-900)", count="rpc_failures")

    def _call_zero_copy(
        self,
        client: Any,
        names: list[str],
        slots: list[int],
        dests: list[torch.Tensor],
        regions: list[RegisteredRegion],
    ) -> Any:
        """``batch_get_into_multi_buffers``; after a timeout the destinations stay held from their
        owner (``on_hold``) and the header slots taken, until the late call returns."""
        bb = self._tier.block_bytes
        ranges = [(r, d.data_ptr() - r.base_ptr) for r, d in zip(regions, dests)]
        quarantined = []

        def quarantine() -> None:
            quarantined.append(True)
            for r, off in ranges:
                r.hold(off, bb)

        def late() -> None:
            self._hdr_slots.give(slots)
            if quarantined:
                for r, off in ranges:
                    r.release(off, bb)

        return self._tier._call(
            "batch_get_into_multi_buffers",
            client.batch_get_into_multi_buffers,
            names,
            [[self._hdr_slots.ptr(i), d.data_ptr()] for i, d in zip(slots, dests)],
            [[HEADER_BYTES, bb]] * len(names),
            on_timeout=quarantine,
            on_late=late,
        )

    def _take_slots(
        self,
        pool: _Slots,
        keys: list[bytes],
        dests: list[torch.Tensor],
        regions: list[Any],
        idx: list[int],
        out: list[Status],
    ) -> tuple:
        """Up to ``len(keys)`` slots of ``pool`` (waits at most the call timeout) and the blocks they
        serve: ``(slots, keys, dests, regions, idx)`` cut to ``len(slots)``. The blocks left without
        a slot are ``IO_ERROR`` in ``out`` and counted in ``get_no_slot``."""
        slots = pool.take(len(keys), wait_s=self._tier._timeout_s)
        k = len(slots)
        if k < len(keys):
            self._tier._bump("get_no_slot", len(keys) - k)
            for j in range(k, len(keys)):
                out[idx[j]] = Status.IO_ERROR
        return slots, keys[:k], dests[:k], regions[:k], idx[:k]

    def _judge(self, key: bytes, name: str, rc: int, header: torch.Tensor, payload: torch.Tensor) -> Status:
        """Status of one fetched object; checks header and payload."""
        tier = self._tier
        if rc == OBJECT_NOT_FOUND:
            tier._bump("get_misses")
            return Status.MISS
        if rc < 0:
            with tier._lock:
                tier._counters["get_errors"] += 1
                tier._errors[rc] += 1
                if rc == INVALID_PARAMS:  # the object is larger than ours: not a block of this store
                    tier._counters["corrupt_objects"] += 1
                    tier._corrupt["size"] += 1
            return Status.IO_ERROR
        try:
            if rc != tier.object_bytes:
                raise ObjectCorrupt("size", f"object of {rc} bytes, expected {tier.object_bytes}")
            crc = check_header(header.numpy(), key, tier.block_bytes)
            check_payload(key, payload.numpy(), crc)
        except ObjectCorrupt as e:
            with tier._lock:
                tier._counters["get_errors"] += 1
                tier._counters["corrupt_objects"] += 1
                tier._corrupt[e.reason] += 1
            tier._remove_later([name])
            log.warning("mooncake tier: %s (%s); the block is a miss and the object is removed", e, name)
            return Status.IO_ERROR
        with tier._lock:
            tier._counters["get_hits"] += 1
            tier._counters["get_bytes"] += tier.block_bytes
        return Status.OK
