"""A client of the tierstore daemon with the shape of the in-process :class:`~tierstore.api.KVStore`.

An engine switches local <-> remote by constructing one or the other::

    store = RemoteKVStore("http://127.0.0.1:8470", token=os.environ["TIERSTORE_TOKEN"])
    with store.request() as rid:
        hit = store.lookup(ns, prompt_ids, request_id=rid)
        statuses, blocks = store.load(hit)            # or load(hit, dests=engine_buffers)
        n_ok = leading_ok(statuses)
        ...
        store.store(ns, prompt_ids, new_kv_blocks)

Everything has :class:`~tierstore.api.KVStore`'s signature (``tests/server/test_client_parity.py``)
except what :data:`NOT_OFFERED` lists: ``from_config``; ``pin_keys``, ``prefetch_keys``,
``remove``, ``resident``, ``tiers_of``; ``flush``, ``evict``, ``clear``, ``drain``;
``block_info``, ``state_of``, ``references``, ``leases``, ``namespaces``,
``keys_of_namespace``, ``check_invariants``, ``record_events``, ``take_events``; and
``bytes_per_tier``, ``capacity_bytes``, ``device_stats``, ``cost_model``, ``ftl``,
``placement``, ``tiers`` (an ``AttributeError``). Keys are computed here and re-scoped to the
caller's tenant by the daemon; lookups take no server-side references (use :meth:`pin`);
key-level calls need ``ns=`` or keys of this client's :meth:`keys_for`. The HTTP side is
:class:`tierstore.client_wire.DaemonConnection` (one aiohttp loop thread: the methods are
synchronous and thread-safe).

Continued in ``docs/SERVER.md`` (``tierstore/client.py``): every difference from the local store.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from .client_wire import AuthError, DaemonConnection, RemoteError, ServerBusy, with_deadline
from .closing import Closing
from .contract import LOCAL_FIGURES, LOCAL_INDEX_CALLS, Lease, LookupResult, Tier
from .errors import ConfigError, LayoutError, Status, StoreClosedError
from .identity import DigestCache, Namespace, block_hashes
from .io.inputs import destination_bytes, plan_block, plan_fragment_destinations
from .io.pages import FragmentPlan, check_distinct_destinations
from .layout import KVLayout
from .server.protocol import keys_to_hex
from .store_calls import CheckedStore, StoreCalls
from .units import check_duration_s

#: :class:`~tierstore.api.KVStore`'s public methods and properties this client does not offer, by
#: what they are for (``tests/server/test_client_parity.py`` keeps this equal to the difference of
#: the two classes, and checks that the READMEs name each one)
NOT_OFFERED: dict[str, tuple[str, ...]] = {
    "construction": ("from_config",),
    "key-level variants": ("pin_keys", "prefetch_keys", "remove", "resident", "tiers_of"),
    "operations on the whole store": ("flush", "evict", "clear", "drain"),
    "introspection of the local index": LOCAL_INDEX_CALLS,
    "tier and device figures": LOCAL_FIGURES,
}

_TIER = {t.label: t for t in Tier}


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
        raise LayoutError(
            f"keys: got an integer array of shape {keys.shape}: token ids? Keys are 32-byte "
            "block hashes: use keys_for(ns, token_ids), or the token-id method"
        )
    out = list(keys)
    for i, k in enumerate(out):
        if not isinstance(k, (bytes, bytearray)) or len(k) != 32:
            what = type(k).__name__
            hint = (
                " (token ids? keys are 32-byte block hashes: use keys_for(ns, token_ids))"
                if isinstance(k, (int, np.integer))
                else ""
            )
            raise LayoutError(
                f"keys[{i}]: expected 32 bytes, got {what}"
                f"{f' of length {len(k)}' if hasattr(k, '__len__') else ''}{hint}"
            )
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
            raise LayoutError(
                f"token_ids: expected a sequence of integers, got {type(token_ids).__name__}"
            ) from None
        if isinstance(first, (bytes, bytearray)):
            raise LayoutError(
                "token_ids: got block keys (bytes); the key-level methods take keys "
                "(store_keys, lookup_keys, load, exists)"
            )
    return token_ids


class RemoteLookupResult(LookupResult):
    """A :class:`~tierstore.index.LookupResult` that remembers its namespace."""

    ns: bytes = b""


class _ConnectionSetting:
    """A setting of the client's :class:`~tierstore.client_wire.DaemonConnection`, read and set
    as an attribute of the client (``client.retries = 0`` sends no retry)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, client, owner=None):
        return self if client is None else getattr(client._wire, self.name)

    def __set__(self, client, value) -> None:
        setattr(client._wire, self.name, value)


class RemoteKVStore(Closing, StoreCalls):
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

    #: retries of a 429/503 answer and the cap on one wait between them (settable)
    retries = _ConnectionSetting()
    max_retry_wait_s = _ConnectionSetting()

    def __init__(
        self,
        url: str,
        token: str,
        timeout_s: float = 60.0,
        retries: int = 5,
        max_retry_wait_s: float = 2.0,
        remember_keys: int = 1 << 18,
    ) -> None:
        #: the HTTP session, its loop thread, the open/closed state, retries (:mod:`tierstore.client_wire`)
        self._wire = DaemonConnection(url, token, timeout_s, retries, max_retry_wait_s)
        self.url = self._wire.url
        self._key_ns: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()
        self._remember_max = remember_keys
        self._rids = itertools.count(1)
        try:
            info = self._wire.call(self._wire.request_json("GET", "/v1/info", None))
        except BaseException:
            self._wire.close()
            raise
        lay = info["layout"]
        self.tenant: str = info["tenant"]
        self.layout = KVLayout(
            lay["num_layers"],
            lay["num_kv_heads"],
            lay["head_dim"],
            lay["dtype"],
            lay["tokens_per_block"],
            lay["name"],
            lay.get("block_order", "layer_kv"),
        )
        self.block_bytes: int = int(info["block_bytes"])
        self.durable: bool = bool(info["durable"])
        self.max_request_bytes: int = int(info["max_request_bytes"])
        self.max_keys_per_request: int = int(info["max_keys_per_request"])
        # scoped to the layout as KVStore and NodeKVStore scope it: the three compute the same keys
        self._digests = DigestCache(scope=self.layout.fingerprint())

    # ------------------------------------------------------------------ identity
    def digest(self, ns: Namespace | bytes) -> bytes:
        """Client-side namespace digest, scoped to the layout as :meth:`KVStore.digest` (the
        daemon re-scopes it to the caller's tenant)."""
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

    # ------------------------------------------------------------------ store
    def _sources(self, kv_blocks) -> list[torch.Tensor]:
        """Each block as its ``block_bytes`` raw bytes, the request body (fragments gathered)."""
        if (
            isinstance(kv_blocks, torch.Tensor)
            and kv_blocks.dim() > 1
            and tuple(kv_blocks.shape[1:]) == self.layout.block_shape
        ):
            kv_blocks = list(kv_blocks)
        elif isinstance(kv_blocks, torch.Tensor) and kv_blocks.dim() == 2 and kv_blocks.dtype == torch.uint8:
            kv_blocks = list(kv_blocks)
        elif isinstance(kv_blocks, torch.Tensor):  # as plan_sources: 1-D is one block, else each row
            kv_blocks = [kv_blocks] if kv_blocks.dim() <= 1 else list(kv_blocks)
        out = []
        for b in kv_blocks:
            if not isinstance(b, torch.Tensor):  # a fragment list or a FragmentPlan: gather it
                out.append(self._gather(b))
                continue
            raw = self.layout.as_bytes(b.cpu() if b.device.type != "cpu" else b)
            if raw.numel() != self.block_bytes:
                raise LayoutError(
                    f"block of {raw.numel()} bytes; the layout's blocks are {self.block_bytes} bytes"
                )
            out.append(raw.contiguous())
        return out

    def _gather(self, frags) -> torch.Tensor:
        plan = plan_block(frags, self.layout, destination=False)
        blk = torch.empty(self.block_bytes, dtype=torch.uint8)
        plan.gather(blk, 0)
        return blk

    def _fragment_sources(self, fragments_per_block) -> list[torch.Tensor]:
        """Each block's fragments gathered into one ``block_bytes`` buffer, the request body."""
        return [self._gather(f) for f in fragments_per_block]

    def _checked_keys(self, keys) -> list[bytes]:
        return _check_keys(keys)

    def _batches(self, n: int) -> list[tuple[int, int]]:
        per = max(
            1,
            min(
                self.max_keys_per_request,
                (self.max_request_bytes - 80 * 1024) // max(1, self.block_bytes + 70),
            ),
        )
        return [(i, min(n, i + per)) for i in range(0, n, per)]

    def _store_checked(self, call: CheckedStore) -> list[Status] | concurrent.futures.Future:
        """Store the raw blocks ``call.sources`` in requests under the daemon's size limit
        (:meth:`StoreCalls._store_checked`); the blocks are already copied into the request
        bodies, so with ``wait=False`` the caller's memory may be reused at once.

        Raises
        ------
        QuotaExceeded
            The tenant's byte quota is exhausted (retry after invalidating).
        """

        d, keys, raw, lifetime, first, _, wait = call

        async def run() -> list[Status]:
            out: list[Status] = []
            for a, b in self._batches(len(keys)):
                out += await self._wire.put_blocks(
                    d, keys[a:b], raw[a:b], first + a, lifetime, self.block_bytes
                )
            return out

        return self._wire.future(run(), wait)

    def _remember(self, keys: Sequence[bytes], d: bytes) -> None:
        for k in keys:
            self._key_ns[k] = d
            self._key_ns.move_to_end(k)
        while len(self._key_ns) > self._remember_max:
            self._key_ns.popitem(last=False)

    # ------------------------------------------------------------------ lookup / load
    def exists(self, keys: Sequence[bytes], *, ns: Namespace | bytes | None = None) -> int:
        """Number of leading ``keys`` present (no recency change; see :meth:`tierstore.api.KVStore.exists`).

        ``ns`` is needed unless the keys came from this client's :meth:`keys_for`.
        """
        keys = _check_keys(keys)
        d = self._ns_of(keys, ns)
        n = 0
        for a, b in self._batches(len(keys)):
            body = {"namespace": d.hex(), "keys": keys_to_hex(keys[a:b])}
            got = self._wire.post("/v1/exists", body)["matched_blocks"]
            n += got
            if got < b - a:
                break
        return n

    def probe(self, ns: Namespace | bytes, token_ids) -> int:
        """Matched tokens, without touching recency."""
        return (
            self.exists(self.keys_for(ns, _check_token_ids(token_ids)), ns=ns) * self.layout.tokens_per_block
        )

    def _lookup_keys(self, d: bytes, keys: list[bytes], request_id, num_keys: int) -> RemoteLookupResult:
        per = self.max_keys_per_request
        matched, useful, tiers, load_s, reason = 0, 0, [], [], None
        for a in range(0, max(1, len(keys)), per):
            chunk = keys[a : a + per]
            r = self._wire.post("/v1/lookup", {"namespace": d.hex(), "keys": keys_to_hex(chunk)})
            matched += r["matched_blocks"]
            tiers += [_TIER[t] for t in r["tiers"]]
            load_s += r["load_s"]
            if useful == a:
                useful += r["useful_blocks"]
                reason = r.get("not_useful_reason")
            if r["matched_blocks"] < len(chunk):
                break
        res = RemoteLookupResult(
            keys[:matched],
            tiers,
            load_s,
            useful,
            num_keys,
            self.layout.tokens_per_block,
            request_id,
            reason if useful < matched else None,
        )
        res.ns = d
        return res

    def lookup(self, ns: Namespace | bytes, token_ids, request_id: object = None) -> RemoteLookupResult:
        """Longest cached prefix of ``token_ids`` (full blocks only); takes no references."""
        keys = self.keys_for(ns, _check_token_ids(token_ids))
        return self._lookup_keys(self.digest(ns), keys, request_id, len(keys))

    def lookup_keys(
        self, keys: Sequence[bytes], request_id: object = None, *, ns: Namespace | bytes | None = None
    ) -> RemoteLookupResult:
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
            raise LayoutError(
                "key-level calls of raw keys need ns=... (these keys were not produced by this "
                "client's keys_for/lookup)"
            )
        return d

    def _load_keys(self, keys, ns) -> tuple[list[bytes], bytes]:
        if self._wire.closed:  # before the load's coroutines exist (the connection checks again)
            raise StoreClosedError("RemoteKVStore: the client is closed")
        if isinstance(keys, RemoteLookupResult) and ns is None:
            # the hit's namespace is a digest already scoped to the layout (by _lookup_keys's
            # caller): scoping it again named another namespace, and every public block missed
            keys, d = _check_keys(keys.useful_keys), keys.ns
            self._remember(keys, d)
            return keys, d
        if isinstance(keys, LookupResult):
            keys = keys.useful_keys
        keys = _check_keys(keys)
        return keys, self._ns_of(keys, ns)

    def load(
        self,
        keys: Sequence[bytes] | LookupResult,
        dests: Sequence[torch.Tensor] | None = None,
        promote: bool = True,
        *,
        wait: bool = True,
        timeout_s: float | None = None,
        ns: Namespace | bytes | None = None,
    ):
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
        timeout_s = None if timeout_s is None else check_duration_s(timeout_s, "timeout_s")
        if dests is not None and len(dests) != len(keys):
            raise LayoutError(f"{len(keys)} keys but {len(dests)} destinations")
        raw_dests = None if dests is None else self._raw_dests(dests)
        statuses: list[Status] = []
        outs: list[torch.Tensor | None] = []

        async def run():
            for a, b in self._batches(len(keys)):
                if timeout_s is None:
                    st, o = await self._wire.get_blocks(
                        d,
                        keys[a:b],
                        None if dests is None else dests[a:b],
                        None if raw_dests is None else raw_dests[a:b],
                        promote,
                        self.layout,
                        self.block_bytes,
                    )
                else:  # private buffers: a cancelled batch never writes the caller's memory
                    st, o = await self._wire.get_blocks(
                        d, keys[a:b], None, None, promote, self.layout, self.block_bytes
                    )
                    if raw_dests is not None:
                        for i, (s, got) in enumerate(zip(st, o)):
                            if s is Status.OK:
                                raw_dests[a + i].copy_(got.reshape(-1).view(torch.uint8))
                                o[i] = dests[a + i]
                statuses.extend(st)
                outs.extend(o)
            return statuses, outs

        return self._wire.future(
            with_deadline(
                run(),
                timeout_s,
                lambda: (
                    statuses + [Status.MISS] * (len(keys) - len(statuses)),
                    outs + [None] * (len(keys) - len(outs)),
                ),
            ),
            wait,
        )

    def load_fragments(
        self,
        keys: Sequence[bytes] | LookupResult,
        dest_fragments_per_block,
        *,
        wait: bool = True,
        timeout_s: float | None = None,
        ns: Namespace | bytes | None = None,
    ) -> list[Status] | concurrent.futures.Future:
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
        timeout_s = None if timeout_s is None else check_duration_s(timeout_s, "timeout_s")
        plans = plan_fragment_destinations(len(keys), dest_fragments_per_block, self.layout)

        statuses: list[Status] = []

        async def run() -> list[Status]:
            for a, b in self._batches(len(keys)):
                st, outs = await self._wire.get_blocks(
                    d, keys[a:b], None, None, True, self.layout, self.block_bytes
                )
                for s, raw, plan in zip(st, outs, plans[a:b]):
                    if s is Status.OK:
                        plan.scatter(raw.reshape(-1).view(torch.uint8), 0)
                statuses.extend(st)
            return statuses

        return self._wire.future(
            with_deadline(run(), timeout_s, lambda: statuses + [Status.MISS] * (len(keys) - len(statuses))),
            wait,
        )

    def _raw_dests(self, dests: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        B = self.block_bytes
        for t in dests:
            if t.device.type != "cpu":
                raise LayoutError(f"each destination must be a CPU block of {B} bytes")
        raw = [destination_bytes(t, self.layout) for t in dests]
        check_distinct_destinations([FragmentPlan.of_bytes(t, destination=True) for t in raw])
        return raw

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
            raise ConfigError(
                f"tier={tier!r}: a remote prefetch fills the daemon's memory; accepted values are "
                "['host'] (the engine's HBM is not the daemon's to fill)"
            )
        keys = self.keys_for(ns, _check_token_ids(token_ids))
        d = self.digest(ns)

        async def run() -> int:
            n = 0
            for a, b in self._batches(len(keys)):
                n += (
                    await self._wire.request_json(
                        "POST", "/v1/prefetch", {"namespace": d.hex(), "keys": keys_to_hex(keys[a:b])}
                    )
                )["promoted_blocks"]
            return n

        return self._wire.future(run(), wait=False)

    # ------------------------------------------------------------------ pins / admin
    def pin(self, ns: Namespace | bytes, token_ids, lease_s: float | None = None) -> Lease:
        """Pin the resident leading full blocks of a prefix for ``lease_s`` seconds.

        Raises
        ------
        QuotaExceeded
            If the daemon's pin quota would be exceeded.
        ConfigError
            For a lease that is not a finite number of seconds in ``(0, MAX_DURATION_S]``
            (the daemon bounds it further by its ``limits.max_lease_s``).
        """
        d = self.digest(ns)
        keys = self.keys_for(ns, token_ids)[: self.max_keys_per_request]
        body = {"namespace": d.hex(), "keys": keys_to_hex(keys)}
        if lease_s is not None:
            body["lease_s"] = check_duration_s(lease_s, "lease_s")
        r = self._wire.post("/v1/pin", body)
        n = r["pinned_blocks"]
        return Lease(r["lease_id"], d, keys[:n], time.monotonic() + r["lease_s"], n * self.block_bytes)

    def unpin(self, lease: Lease | int) -> bool:
        """End a pin lease early."""
        lid = lease.lease_id if isinstance(lease, Lease) else int(lease)
        return bool(self._wire.post("/v1/unpin", {"lease_id": lid})["unpinned"])

    def invalidate(self, ns: Namespace | bytes) -> int:
        """Drop every block of a namespace (within the caller's tenant scope)."""
        return int(self._wire.post("/v1/invalidate", {"namespace": self.digest(ns).hex()})["removed_blocks"])

    def stats(self) -> dict:
        """The daemon's ``/v1/info`` answer (metrics live at ``/metrics``)."""
        return self._wire.call(self._wire.request_json("GET", "/v1/info", None))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._wire.closed

    def close(self) -> None:
        """Refuse new calls, let the calls in progress finish, close the HTTP
        session and stop the background loop. Idempotent; every later call
        (``stats`` included: it asks the daemon) raises
        :class:`~tierstore.errors.StoreClosedError`."""
        self._wire.close()


__all__ = ["RemoteKVStore", "RemoteLookupResult", "RemoteError", "AuthError", "ServerBusy"]
