"""The publish side of the Mooncake tier: ``put``, the publish queue and its publisher threads.

:class:`Publisher` is a part that :class:`~tierstore.remote.mooncake.MooncakeTier` builds and
owns: it keeps the publish queue, its threads and its slots, and reaches the tier's lock,
counters, state and calls only through :class:`~tierstore.remote.calls.TierLink`. ``put``
copies a block and its header (CRC-32C of the copied bytes) into a slot of the registered
publish queue, or, for a block inside a registered region, writes only the header into a small
registered slot and holds the block's range from its owner; it returns at once. Publisher
threads take up to ``max_batch_blocks`` queued blocks and send them with one
``batch_put_from`` (``batch_put_from_multi_buffers`` zero-copy); a slot returns to its free
list only when the call has returned. A publish refused for space (-200) is sent again after
:data:`SPACE_RETRY_S`, then dropped and counted. See ARCHITECTURE.md, "The remote tier".
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import Status
from ..io.format import payload_crc
from .calls import (
    _NO_RESULT,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    RPC_FAIL,
    RegisteredRegion,
    TierLink,
    _memcpy,
    _Slots,
)
from .format import HEADER_BYTES, encode_header

#: Delays before a publish refused for space (-200) is sent again: a refused put makes the
#: master evict (``eviction_ratio`` of the objects, 5% by default; measured here: within
#: about 20 ms), so a burst that outruns eviction loses fewer blocks. Then it is dropped.
SPACE_RETRY_S = (0.03, 0.1)


@dataclasses.dataclass(frozen=True)
class _Pub:
    """A queued publish: staged (``region is None``: ``slot`` is a publish-queue slot
    holding header + payload) or zero-copy (``slot`` is a header slot, the payload
    stays at ``ptr``, ``offset`` bytes into ``region``)."""

    key: bytes
    name: str
    slot: int
    region: RegisteredRegion | None
    offset: int
    ptr: int
    attempts: int = 0  #: times refused for space so far


class Publisher:
    """``put``, the publish loop and ``flush``: the publish part of a
    :class:`~tierstore.remote.mooncake.MooncakeTier`, which builds it.

    Parameters
    ----------
    tier : TierLink
        The tier's lock (and the condition its threads wait on), counters, state and calls.
    put_slots : _Slots
        Registered publish-queue slots of ``object_bytes`` (staged publishes).
    hdr_slots : _Slots
        Registered header slots (zero-copy publishes; shared with the loader).
    region_of : callable
        ``region_of(block)``: the registered region holding a block, or ``None`` (the
        loader's; called under the tier's lock).

    Owns the queue state (under the tier's lock) and the ``publish_threads`` publisher
    threads (:meth:`start`, :meth:`join`).
    """

    def __init__(
        self,
        tier: TierLink,
        put_slots: _Slots,
        hdr_slots: _Slots,
        region_of: Callable[[torch.Tensor], RegisteredRegion | None],
    ) -> None:
        self._tier = tier
        self._put_slots = put_slots
        self._hdr_slots = hdr_slots
        self._region_of = region_of
        self._queue: collections.deque[_Pub] = collections.deque()
        self._retry: list[list[Any]] = []  # [due_s, _Pub]: refused for space, sent again (SPACE_RETRY_S)
        self._queued_keys: set[bytes] = set()
        self._recent: collections.OrderedDict[bytes, float] = collections.OrderedDict()
        self._recent_max = 1 << 16
        self._publishing = 0
        self._zc_queued = 0  # zero-copy publishes queued or in flight (bounded like the staged queue)
        # publish_threads publishers: while one call is in flight, the next batch
        # is sent, so checksumming and copying overlap the network
        self._threads = [
            threading.Thread(target=self._publish_loop, name=f"tierstore-mooncake-publish-{i}", daemon=True)
            for i in range(tier.tuning.publish_threads)
        ]

    def start(self) -> None:
        """Start the publisher threads."""
        for th in self._threads:
            th.start()

    def join(self, deadline: float) -> None:
        """Wait for the publisher threads to end (the tier is closed), until ``deadline`` (monotonic s)."""
        for th in self._threads:
            th.join(max(0.0, deadline - time.monotonic()))

    def free_slots(self) -> int:
        """Free publish-queue slots."""
        return self._put_slots.free_count()

    def queued_blocks(self) -> int:
        """Blocks queued or waiting to be sent again. Under the tier's lock."""
        return len(self._queue) + len(self._retry)

    def take_queued(self) -> list[_Pub]:
        """Empty the queue (the tier is closing; under its lock, with its closed flag set):
        the blocks dropped, counted ``dropped_closed``; hand them to :meth:`give_back`."""
        dropped = list(self._queue) + [b for _t, b in self._retry]
        self._queue.clear()
        self._retry.clear()
        self._tier._counters["dropped_closed"] += len(dropped)
        for b in dropped:
            self._queued_keys.discard(b.key)
        self._zc_queued -= sum(b.region is not None for b in dropped)
        return dropped

    def give_back(self, dropped: list[_Pub]) -> None:
        """Give the memory of dropped blocks back (their owner's too). Without the tier's lock."""
        for b in dropped:
            if b.region is None:
                self._put_slots.give([b.slot])
            else:
                self._hdr_slots.give([b.slot])
                b.region.release(b.offset, self._tier.block_bytes)

    def put(
        self, keys: Sequence[bytes], blocks: Sequence[torch.Tensor], copy: bool, recent: bool
    ) -> list[Status]:
        """Queue blocks for publication (asynchronous): the tier's ``_put``, which
        :meth:`RemoteBlockTier.put <tierstore.tiers.storage.RemoteBlockTier.put>` calls with its
        defaults applied (``copy=False``, ``recent=True``).

        Parameters
        ----------
        keys : sequence of bytes
            32-byte block keys.
        blocks : sequence of torch.Tensor
            Contiguous CPU tensors of ``block_bytes`` bytes each (any dtype).
            A block in plain memory is copied into the publish queue before
            ``put`` returns: the caller may reuse it at once. A block inside a
            :meth:`register_memory` region is published zero-copy: the region's
            ``on_hold`` is called for it now and ``on_release`` when its publish
            call has returned; the owner must not change those bytes in between
            (if it does, the object fails its CRC check on every reader: a miss,
            never wrong KV).
        copy : bool
            Copy into the publish queue even from a registered region (the
            owner reuses the memory as soon as ``put`` returns: an evicted slot).
        recent : bool
            Skip a key published within ``republish_after_s`` (``EXISTS``): for
            re-offers of blocks that are probably still there (local hits).
            ``False`` for blocks the caller knows the cluster may lack (a
            store after a remote miss, an evicted victim): Mooncake may have
            evicted the earlier copy (a put of a key still present returns
            0 and the first object stays).

        Returns
        -------
        list of Status
            Per block: ``OK`` queued; ``EXISTS`` already queued (or, with
            ``recent``, published within ``republish_after_s``); ``REJECTED`` dropped (queue full,
            tier degraded or closed; counted). Publication itself can still fail
            later (no segment space, a transfer error): it is counted, and the
            block is simply absent remotely.

        Raises
        ------
        LayoutError
            For keys or blocks of the wrong size, or non-CPU / non-contiguous blocks.

        Notes
        -----
        The header and CRC-32C are computed here, on the caller's thread (about
        0.1 ms per 2 MiB), so that the publish worker only moves bytes.
        """
        self._tier._check_keys(keys, blocks, "blocks")
        now = time.monotonic()
        return [
            self._offer(bytes(key), block, now, copy=copy, recent=recent) for key, block in zip(keys, blocks)
        ]

    def _offer(self, key: bytes, block: torch.Tensor, now: float, *, copy: bool, recent: bool) -> Status:
        """Admit one block (under the lock), then stage it: its status for :meth:`put`."""
        with self._tier._lock:
            self._tier._counters["puts_offered"] += 1
            if self._tier._closed:
                self._tier._counters["dropped_closed"] += 1
                return Status.REJECTED
            if self._tier._state != "ok":
                self._tier._counters["dropped_degraded"] += 1
                return Status.REJECTED
            t = self._recent.get(key)
            if key in self._queued_keys or (
                recent and t is not None and now - t < self._tier.tuning.republish_after_s
            ):
                self._tier._counters["puts_exists"] += 1
                return Status.EXISTS
            region = None if copy else self._region_of(block)
            if region is not None and self._zc_queued >= self._tier.config.publish_queue_blocks:
                self._tier._counters["dropped_queue_full"] += 1
                return Status.REJECTED
            self._queued_keys.add(key)
            if region is not None:
                self._zc_queued += 1
        return self._enqueue(key, block, region)

    def _enqueue(self, key: bytes, block: torch.Tensor, region: RegisteredRegion | None) -> Status:
        """Copy an admitted block (or, zero-copy, its header) into a slot and queue it."""
        slots = (self._hdr_slots if region is not None else self._put_slots).take(1)
        if not slots:
            with self._tier._lock:
                self._queued_keys.discard(key)
                self._zc_queued -= region is not None
                self._tier._counters["dropped_queue_full"] += 1
            return Status.REJECTED
        i = slots[0]
        if region is None:
            _memcpy(self._put_slots.ptr(i, HEADER_BYTES), block.data_ptr(), self._tier.block_bytes)
            payload = self._put_slots.view(i, HEADER_BYTES, self._tier.block_bytes)
            header = self._put_slots.view(i, 0, HEADER_BYTES)
            item = _Pub(key, self._tier._namer(key), i, None, 0, 0)
        else:
            off = block.data_ptr() - region.base_ptr
            region.hold(off, self._tier.block_bytes)
            payload = block.reshape(-1).view(torch.uint8)
            header = self._hdr_slots.view(i, 0, HEADER_BYTES)
            item = _Pub(key, self._tier._namer(key), i, region, off, block.data_ptr())
        encode_header(header.numpy(), key, self._tier.block_bytes, payload_crc(key, payload.numpy()))
        with self._tier._lock:
            self._queue.append(item)
            self._tier._counters["puts_queued"] += 1
            self._tier._counters["zero_copy_puts" if region is not None else "staged_puts"] += 1
            # a publisher sends what is ready while later blocks are checksummed
            self._tier._work.notify_all()
        return Status.OK

    def _publish_loop(self) -> None:
        s = self._tier.config
        while True:
            with self._tier._lock:
                while not self._queue and not self._tier._closed:
                    if self._retry:
                        left = min(t for t, _b in self._retry) - time.monotonic()
                        if left <= 0:
                            break
                        self._tier._work.wait(left)
                    else:
                        self._tier._work.wait()
                if not self._queue and not self._retry and self._tier._closed:
                    return
                now = time.monotonic()
                due = [b for t, b in self._retry if t <= now or self._tier._closed][: s.max_batch_blocks]
                if due:
                    ids = {id(b) for b in due}
                    self._retry = [e for e in self._retry if id(e[1]) not in ids]
                n = min(len(self._queue), s.max_batch_blocks - len(due))
                batch = due + [self._queue.popleft() for _ in range(n)]
                if not batch:
                    continue
                client = self._tier._client if self._tier._state == "ok" else None
                self._publishing += 1
            try:
                staged = [b for b in batch if b.region is None]
                zc = [b for b in batch if b.region is not None]
                if staged:
                    self._publish(staged, client, zero_copy=False)
                if zc:
                    self._publish(zc, client, zero_copy=True)
            finally:
                with self._tier._lock:
                    self._publishing -= 1
                    self._tier._work.notify_all()

    def _forget(self, keys: list[bytes], status_by_key: dict[bytes, bool | None]) -> None:
        """The sent ``keys`` leave the queued set (a key retried, ``None``, stays); those published
        (``True``) are remembered as recent, the oldest forgotten past ``_recent_max``."""
        now = time.monotonic()
        with self._tier._lock:
            for k in keys:
                if k in status_by_key and status_by_key[k] is None:
                    continue  # retried: still queued
                self._queued_keys.discard(k)
                if status_by_key.get(k):
                    self._recent[k] = now
                    self._recent.move_to_end(k)
            while len(self._recent) > self._recent_max:
                self._recent.popitem(last=False)

    def _tally(
        self, batch: list[_Pub], rcs: list[int], zero_copy: bool, kept: set[int]
    ) -> dict[bytes, bool | None]:
        """Count a put's return codes: ``key -> True`` published (or there already), ``None`` refused
        for space and queued to be sent again (its slot added to ``kept``); failures are counted."""
        ok: dict[bytes, bool | None] = {}
        now = time.monotonic()
        with self._tier._lock:
            for b, rc in zip(batch, rcs):
                if rc == 0 or rc == OBJECT_ALREADY_EXISTS:
                    ok[b.key] = True
                    self._tier._counters["published_blocks"] += 1
                    self._tier._counters["published_bytes"] += self._tier.block_bytes
                elif (
                    rc == NO_AVAILABLE_HANDLE
                    and not zero_copy
                    and b.attempts < len(SPACE_RETRY_S)
                    and not self._tier._closed
                ):
                    ok[b.key] = None  # the slot keeps the object; sent again after the master evicts
                    kept.add(b.slot)
                    again = dataclasses.replace(b, attempts=b.attempts + 1)
                    self._retry.append([now + SPACE_RETRY_S[b.attempts], again])
                    self._tier._counters["put_no_space_retries"] += 1
                elif rc == NO_AVAILABLE_HANDLE:
                    self._tier._counters["put_no_space"] += 1
                else:
                    self._tier._counters["put_failed"] += 1
                    self._tier._errors[rc] += 1
            if kept:
                self._tier._work.notify_all()
        return ok

    def _publish(self, batch: list[_Pub], client: Any, zero_copy: bool) -> None:
        keys = [b.key for b in batch]
        pool = self._hdr_slots if zero_copy else self._put_slots
        kept: set[int] = set()  # slots of blocks sent again later (refused for space)

        def done() -> None:  # the memory of this batch is free again
            pool.give([b.slot for b in batch if b.slot not in kept])
            if zero_copy:
                with self._tier._lock:
                    self._zc_queued -= len(batch)
                for b in batch:
                    if b.region is not None:  # every block of a zero-copy batch has one
                        b.region.release(b.offset, self._tier.block_bytes)

        if client is None:
            with self._tier._lock:
                self._tier._counters["dropped_degraded" if not self._tier._closed else "dropped_closed"] += (
                    len(batch)
                )
            done()
            self._forget(keys, {})
            return
        names = [b.name for b in batch]
        self._tier._bump("put_calls")
        if zero_copy:
            rcs = self._tier._call_here(
                "batch_put_from_multi_buffers",
                client.batch_put_from_multi_buffers,
                names,
                [[self._hdr_slots.ptr(b.slot), b.ptr] for b in batch],
                [[HEADER_BYTES, self._tier.block_bytes]] * len(batch),
            )
        else:
            rcs = self._tier._call_here(
                "batch_put_from",
                client.batch_put_from,
                names,
                [self._put_slots.ptr(b.slot) for b in batch],
                [self._tier.object_bytes] * len(batch),
            )
        if rcs is _NO_RESULT:
            done()  # the call has returned: its memory is free (also after a timeout the watchdog reported)
            self._tier._bump("put_failed", len(batch))
            self._forget(keys, {})
            return
        ok = self._tally(batch, rcs, zero_copy, kept)
        done()
        self._forget(keys, ok)
        if RPC_FAIL in rcs:
            self._tier._degrade("batch_put_from: master unreachable (-900)", count="rpc_failures")

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued block has been published (or dropped).

        Returns ``False`` if blocks are still queued after ``timeout_s``
        (default: ``timeout_s`` per queued batch, at least ``timeout_s``).
        """
        if timeout_s is None:
            with self._tier._lock:
                n = len(self._queue) // self._tier.config.max_batch_blocks + 1
            timeout_s = self._tier._timeout_s * (n + 1)
        deadline = time.monotonic() + timeout_s
        with self._tier._lock:
            while self._queue or self._publishing or self._retry:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._tier._work.wait(min(left, 0.1))
        return True
