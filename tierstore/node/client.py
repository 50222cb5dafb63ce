"""The node service's client: :class:`NodeKVStore`, :class:`~tierstore.api.KVStore`'s calls
served by the node's store (:mod:`tierstore.node.server`) over its UNIX socket.

Control goes over the socket, bytes through the pool's shared segment: a store gathers each
new block straight into the slot the service handed out, a load scatters each block straight
out of its slot (no copy beyond the engine's own gather and scatter), on the process's
:func:`~tierstore.io.copies.shared_copier` (one OpenMP thread per copying thread, as the
embedded store copies). The mapping is faulted in when attached. After a copy the client
re-reads the slots' generations: a slot handed to someone else meanwhile (its ticket was
given up) is reported not copied, so it is a miss, never wrong KV (a load's destination of
such a block may have been written; its status is ``MISS``).

Every call is bounded: a reply is awaited at most ``timeout_s`` (or the call's own
``timeout_s``). A service that is down, restarting or too slow gives misses: ``store`` →
``REJECTED`` per block, ``load`` → ``MISS``, ``lookup`` → nothing matched, ``exists`` → 0,
``pin`` → an empty lease; the connection is dropped and made again, at most once per
``retry_s``, by a later call (a restarted service hands over its new segment). A session found
ended when a call starts (a restarted service) is made again at once and the request sent
once more within the call's time, unless it names the old session's ticket, hold or lease
(:class:`_Ended`). Requests of one client are serialised (one connection, one lock); use one
client per engine thread that needs its own. Keys are computed here as
:class:`~tierstore.api.KVStore` computes them (the namespace digest scoped to the layout), so an
embedded store and the service agree on keys.

Not offered (``AttributeError``): :data:`NOT_OFFERED`; ``promote`` of :meth:`load` is the
service's decision. A forked child makes its own connection and mapping.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ..contract import LOCAL_FIGURES, LOCAL_INDEX_CALLS, Lease, LookupResult, Tier
from ..errors import ConfigError, QuotaExceeded, Status, StoreClosedError, TierStoreError
from ..identity import DigestCache, Namespace, block_hashes
from ..io.copies import shared_copier
from ..io.inputs import check_keys, plan_destinations, plan_fragment_destinations
from ..io.pages import BlockRows
from ..layout import KVLayout
from ..store_calls import CheckedStore, KeyLookup, StoreCalls
from ..units import MAX_DURATION_S, check_duration_s
from . import protocol as P
from .segment import Segment, SegmentError

_log = logging.getLogger("tierstore.node.client")

#: KVStore's public calls this client does not offer, by what they are for
#: The longest wait a client may be given (seconds; a day: float("inf") overflowed the socket's
#: time_t at every call). The one bound of every lease and wait (tierstore.units).
MAX_TIMEOUT_S = MAX_DURATION_S

NOT_OFFERED: dict[str, tuple[str, ...]] = {
    "construction": ("from_config",),
    "tier moves the service decides": ("prefetch_keys", "evict", "flush", "clear", "remove", "MERGE_WAIT_S"),
    "introspection of the service's index": (*LOCAL_INDEX_CALLS, "resident", "tiers_of", "drain"),
    "tier and device figures": LOCAL_FIGURES,
}
#: engine lifetime hints → the wire's lifetime code (:data:`tierstore.node.protocol.LIFETIME_NAMES`:
#: 1 short, 2 medium, 3 long), the hints of ``tierstore.fdp.lifetime.HINTS``
_LIFETIME_CODE = {
    "system": 3,
    "system_prompt": 3,
    "tool": 3,
    "long": 3,
    "conversation": 2,
    "medium": 2,
    "query": 1,
    "single_query": 1,
    "short": 1,
}
_ZERO_NS = bytes(P.NS_BYTES)
_TIERS = tuple(Tier)  # wire code i is Tier(i)
_OK_CODE = P.status_code(Status.OK)


class _Down(Exception):
    """The service cannot answer now (not running, restarting, too slow, the connection broke)."""


class _Waiting(_Down):
    """Not tried: the last attempt failed less than ``retry_s`` ago (its reason is ``last_down``)."""


class _Ended(_Down):
    """The session ended before any byte of the reply came: the send failed (the request never
    reached the service), or the first read met EOF or a reset (the service restarted, stopped
    or dropped the session; what the request started in that session ended with it).

    The client then connects again at once, attaching the new service's new segment, and sends
    the request once more within the call's ``timeout_s`` (a timeout is not this: a slow
    service is never asked twice). Sent again: the requests that start afresh in any session
    and acknowledge nothing kept by themselves, so an ended session's copy of them is void (the
    service ends what a session held with it): ``Lookup``, ``Exists``, ``Stats``, ``Prefetch``,
    ``Pin``, ``Invalidate`` (idempotent), and the first half of a store or load chunk
    (``PrepareStore``, ``PrepareLoad``: a new ticket, slots of the new segment). Never sent
    again: the requests naming what the old session held, void on a new one, whose plan and
    lease ids a new service may give to others: ``CompleteStore`` (a store's commit: once sent,
    the old service may or may not have kept the blocks; they are answered ``REJECTED``, never
    acknowledged from a ticket whose slots were the old segment's), ``CompleteLoad`` (its
    copies came from the old segment: ``MISS``), ``Release``/``Cancel`` of a hold and ``Unpin``
    (they ended with the session: 0 and ``False``).
    """


class _Refused(Exception):
    """The service answered a request with an ``Error`` (the connection stays usable)."""

    def __init__(self, code: P.ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code


def socket_path(url: str) -> str:
    """The socket path of a ``unix:///path`` URL (or a plain absolute path).

    Raises
    ------
    ConfigError
        For another scheme or a relative path.
    """
    path = url[len("unix://") :] if url.startswith("unix://") else url
    if not path.startswith("/") or "://" in path:
        raise ConfigError(f"node service URL {url!r}: expected unix:///absolute/path/node.sock")
    return path


def _lifetime_code(hint: str | None) -> int:
    if hint is None:
        return 0
    code = _LIFETIME_CODE.get(str(hint).strip().lower().replace(" ", "_").replace("-", "_"))
    if code is None:
        raise ConfigError(f"lifetime hint {hint!r}: accepted values are {sorted(_LIFETIME_CODE)}")
    return code


class _Counters(dict[str, int]):
    """The ``client`` section of :meth:`NodeKVStore.stats`: ``calls``, ``down`` (calls answered as
    misses: the service is down or restarting), ``connects``, ``resent`` (requests sent again on a
    new session), ``gen_mismatch`` (copies given up because their slot was reused), ``refused``
    (requests the service refused, e.g. a store past the tenant's byte quota: answered ``REJECTED``
    as a store to a service that is down is, so counted apart) and ``last_refusal`` (its reason),
    ``last_down`` (why the last call found the service down, e.g. ``connect ...: Connection refused``).
    The first call that finds the service down after a session (or since the client was made) logs
    one warning; the next session that opens logs one line."""

    def __init__(self) -> None:
        super().__init__(calls=0, down=0, connects=0, resent=0, gen_mismatch=0, refused=0)
        self.last_refusal: str | None = None
        self.last_down: str | None = None
        self._said_down = False

    def refused_by(self, e: Exception) -> None:
        self["refused"] += 1
        self.last_refusal = str(e)

    def down_by(self, e: Exception, url: str, retry_s: float) -> None:
        self["down"] += 1
        if not isinstance(e, _Waiting):
            self.last_down = str(e)
        if not self._said_down:
            self._said_down = True
            _log.warning(
                "node service %s is down (%s): calls answer misses; reconnecting, at most every %g s",
                url,
                e,
                retry_s,
            )

    def connected(self, url: str) -> None:
        self["connects"] += 1
        if self._said_down:
            self._said_down = False
            _log.info(
                "node service %s: connected again (%d calls answered as misses so far)", url, self["down"]
            )

    def section(self, **more) -> dict:
        return dict(self, last_refusal=self.last_refusal, last_down=self.last_down, **more)


def copy_slots(
    conn: _Connection | None,
    t: P.TicketReply,
    plans: Sequence,
    at: int,
    store: bool,
    block_bytes: int,
    counters,
) -> np.ndarray:
    """Copy the blocks of ticket ``t`` that were handed a slot (status ``OK``) between their slots
    of ``conn``'s segment and ``plans[at + i]`` (into the slots for a ``store``, out of them
    otherwise) on the shared copier; the keys whose copy counts (those, less any whose slot's
    generation changed meanwhile, counted in ``counters['gen_mismatch']``), as bools.

    Keys of a :class:`~tierstore.io.pages.BlockRows` batch whose slots follow each other are
    copied as runs of rows (one slice pair per piece, as the embedded store's one copy per run);
    other plans block by block (``gather``/``scatter`` of each)."""
    slots = P.unpack_slots(t.slots)
    ok = (slots >= 0) & (np.frombuffer(t.statuses, dtype=np.uint8) == _OK_CODE)
    todo = np.flatnonzero(ok)
    assert conn is not None and conn.rows is not None
    rows, seg = conn.rows, conn.segment
    copier = shared_copier()
    if type(plans) is BlockRows:
        pieces = _run_pieces(rows, plans.rows, slots, todo, at, store, block_bytes, copier.chunk_bytes)
    else:
        pieces = [
            functools.partial(plans[at + i].gather if store else plans[at + i].scatter, rows[s], 0)
            for i, s in zip(todo.tolist(), slots[todo].tolist())
        ]
    copier.run(pieces, len(todo) * block_bytes)
    have = slots >= 0
    if todo.size == len(slots):  # every key has a slot (the common case): no masks
        same = seg.gens_of(slots) == P.unpack_u64(t.gens)
    else:
        same = np.zeros(len(slots), dtype=bool)
        if have.any():
            same[have] = seg.gens_of(slots[have]) == P.unpack_u64(t.gens)[have]
    counters["gen_mismatch"] += int((have & ~same).sum())
    return ok & same


def _run_pieces(rows, batch, slots, todo, at: int, store: bool, block_bytes: int, chunk_bytes: int) -> list:
    """Copy pieces (``dst.copy_(src)`` calls) of the keys ``todo`` of a ``(n, block_bytes)`` batch
    (key ``i`` is row ``at + i``): each run of keys whose slots follow each other is one pair
    of row slices, cut into pieces of ~``chunk_bytes``."""
    if not todo.size:
        return []
    s = slots[todo]
    cut = np.flatnonzero((np.diff(todo) != 1) | (np.diff(s) != 1)) + 1
    step = max(1, chunk_bytes // block_bytes)
    pieces = []
    for a, b in zip([0, *cut.tolist()], [*cut.tolist(), len(todo)]):
        i0, s0 = int(todo[a]), int(s[a])
        for k in range(0, b - a, step):
            n = min(step, b - a - k)
            seg_rows = rows[s0 + k : s0 + k + n, :block_bytes]
            own = batch[at + i0 + k : at + i0 + k + n]
            pieces.append(
                functools.partial(seg_rows.copy_ if store else own.copy_, own if store else seg_rows)
            )
    return pieces


class _Connection:
    """One session: the socket, its frames and the attached segment."""

    def __init__(
        self, path: str, layout: KVLayout, pool: str | None, timeout_s: float, client: str, token: str
    ) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(path)
        except PermissionError as e:  # the socket's mode keeps this user out: a refusal, not "down"
            sock.close()
            raise ConfigError(
                f"node service {path}: permission denied for uid {os.getuid()} ({e.strerror}); the "
                "service's node.socket_mode and allow_uids/allow_gids decide who may connect"
            ) from None
        except OSError as e:
            sock.close()
            raise _Down(f"connect {path}: {e}") from e
        self.frames = P.FrameSocket(sock, P.REPLY_DECODER)
        self.pid = os.getpid()
        try:
            self.frames.send(
                P.Hello(
                    0,
                    v=P.PROTOCOL_VERSION,
                    token=token,
                    role="solo",
                    pool=pool,
                    block_bytes=layout.bytes_per_block,
                    tokens_per_block=layout.tokens_per_block,
                    group=b"",
                    join_token=b"",
                    world_rank=0,
                    client=client,
                )
            )
            msg, fds = self.frames.recv_with_fds(1)
        except (OSError, P.ProtocolError) as e:
            self.frames.close()
            raise _Down(f"hello: {e}") from e
        if isinstance(msg, P.Error):
            self.frames.close()
            if msg.code in (P.ErrorCode.BUSY, P.ErrorCode.CLOSED, P.ErrorCode.INTERNAL):
                raise _Down(f"hello: {msg.code.value}: {msg.message}")  # try again later
            raise ConfigError(f"node service {path} refused this client: {msg.code.value}: {msg.message}")
        if not isinstance(msg, P.Welcome) or len(fds) != 1:
            for fd in fds:
                os.close(fd)
            self.frames.close()
            raise _Down(f"hello: expected a Welcome with the segment's fd, got {type(msg).__name__}")
        try:
            self.segment = Segment.attach(fds[0], block_bytes=msg.block_bytes, boot_id=msg.boot_id)
        except SegmentError as e:
            self.frames.close()
            raise _Down(f"attach: {e}") from e
        try:
            self.segment.prefault()  # this mapping's page tables now, not on the first copy of each slot
        except SegmentError as e:
            self.segment.close()
            self.frames.close()
            raise _Down(f"prefault: {e}") from e
        self.welcome = msg
        self.rows: torch.Tensor | None = self.segment.rows()
        self.rids = itertools.count(1)

    def call(self, msg_of, timeout_s: float):
        """Send ``msg_of(rid)`` and return its reply; :class:`_Down` when the connection fails or
        the service is closing, :class:`_Refused` for any other ``Error`` reply."""
        rid = next(self.rids)
        try:
            self.frames.set_timeout(timeout_s)
            self.frames.send(msg_of(rid))
        except (TimeoutError, P.ProtocolError) as e:
            raise _Down(f"send: {type(e).__name__}: {e}") from e
        except OSError as e:  # EPIPE/ECONNRESET: the peer had closed; nothing of it was read
            raise _Ended(f"send: {type(e).__name__}: {e}") from e
        try:
            reply = self.frames.recv()
        except (ConnectionResetError, ConnectionAbortedError) as e:
            raise _Ended(f"recv: {type(e).__name__}: {e}") from e
        except (OSError, P.ProtocolError) as e:
            raise _Down(f"{type(e).__name__}: {e}") from e
        if reply is None:
            raise _Ended("the service closed the connection")
        if not isinstance(reply, P.Reply) or reply.rid != rid:
            raise _Down(f"a reply to another request ({type(reply).__name__}) for request {rid}")
        if isinstance(reply, P.Error):
            if reply.code in (P.ErrorCode.CLOSED, P.ErrorCode.BAD_FRAME):
                raise _Down(f"{reply.code.value}: {reply.message}")
            raise _Refused(reply.code, reply.message)
        return reply

    def forget(self) -> None:
        """In a forked child: close this process's copies of the socket and the mapping, leaving
        the parent's session as it is (no ``Bye``, no shutdown: those act on the shared socket)."""
        self.frames.broken = True
        self.frames.sock.close()
        self.rows = None
        self.segment.close()  # an inherited mapping is only forgotten

    def close(self, bye: bool) -> None:
        if bye and not self.frames.broken:
            with contextlib.suppress(OSError, P.ProtocolError):
                self.frames.set_timeout(0.5)
                self.frames.send(P.Bye(0, reason="client closed"))
        self.frames.close()
        self.rows = None
        if self.pid == os.getpid():
            self.segment.close()


class NodeKVStore(StoreCalls, KeyLookup):
    """:class:`~tierstore.api.KVStore`'s calls served by the node service (see the module docstring).

    Parameters
    ----------
    url : str
        ``unix:///path/node.sock`` (the service's ``node.socket``).
    layout : KVLayout
        The engine's block layout; the service's pool must hold blocks of the same bytes and tokens.
    timeout_s : float
        Longest wait for a reply (and for connecting), seconds.
    pool : str, optional
        The pool to attach to (default: the service's only one).
    retry_s : float
        Seconds between connection attempts while the service is down.
    token : str, optional
        A tenant's bearer token (the daemon's ``tenants`` credentials, as for HTTP): the session
        is that tenant's. ``None``: the ``TIERSTORE_TOKEN`` environment variable, else no token
        (the service's ``node.tenant``, when it has one).

    Raises
    ------
    ConfigError
        For a bad URL or timeout. A service that is down is not an error: calls miss until it is up.
        A service that refuses this client (its uid, its token, another block class, pool or
        protocol version) raises :class:`ConfigError` from the call that connects.

    Notes
    -----
    A call that finds its session ended (a restarted service) connects again at once and sends
    its request once more within its ``timeout_s``; which requests are sent again and why:
    :class:`_Ended`.
    """

    def __init__(
        self,
        url: str,
        layout: KVLayout,
        *,
        timeout_s: float = 5.0,
        pool: str | None = None,
        retry_s: float = 0.5,
        token: str | None = None,
    ) -> None:
        check_duration_s(timeout_s, "timeout_s")
        if retry_s != 0:
            check_duration_s(retry_s, "retry_s")
        self.url = url
        self.path = socket_path(url)
        self.layout = layout
        self.timeout_s = float(timeout_s)
        self.retry_s = float(retry_s)
        self.pool = pool
        self._token = os.environ.get("TIERSTORE_TOKEN", "") if token is None else str(token)
        self._digests = DigestCache(scope=layout.fingerprint())  # as KVStore: other layouts never match
        self._lock = threading.Lock()
        self._conn: _Connection | None = None
        self._last_fail = -float("inf")
        self._holds: dict[object, int] = {}
        self._next_hold = itertools.count(1)
        self._rids = itertools.count(1)
        self._closed = False
        self._pool_exec: concurrent.futures.ThreadPoolExecutor | None = None
        self.counters = _Counters()

    # ------------------------------------------------------------------ connection
    @property
    def closed(self) -> bool:
        return self._closed

    def _connection(self, timeout_s: float | None = None) -> _Connection:
        """The session, connecting when there is none (not within ``retry_s`` of a failure)."""
        c = self._conn
        if c is not None and c.pid != os.getpid():  # inherited across fork: the parent's session
            c.forget()
            self._conn = c = None
        if c is not None:
            return c
        if time.monotonic() - self._last_fail < self.retry_s:
            age_s = time.monotonic() - self._last_fail
            raise _Waiting(f"the service was down {age_s:.2f} s ago ({self.counters.last_down})")
        return self._connect(self.timeout_s if timeout_s is None else timeout_s)

    def _connect(self, timeout_s: float) -> _Connection:
        """A new session (handshake, the service's segment mapped), connecting and waiting at
        most ``timeout_s``; a failure starts the ``retry_s`` window."""
        try:
            self._conn = _Connection(
                self.path, self.layout, self.pool, timeout_s, f"tierstore pid {os.getpid()}", self._token
            )
        except _Down as e:
            self._last_fail = time.monotonic()
            self.counters.last_down = str(e)  # whoever tried (a call, or _chunks sizing one)
            raise
        self.counters.connected(self.url)
        self._holds.clear()  # holds were the old session's: released by the service
        return self._conn

    def _drop(self, ended: bool = False) -> None:
        """Close a connection that failed; the retry window starts now, unless the session only
        ``ended`` (the next call connects at once: a restarted service is likely up; if not,
        that connect fails fast and starts the window). Without a connection (the call was
        refused inside the window, or the connect failed and set it), the window is left as it
        is: restarting it on every refused call kept a client calling faster than ``retry_s``
        from ever reconnecting."""
        c, self._conn = self._conn, None
        if c is not None:
            c.close(bye=False)
            if not ended:
                self._last_fail = time.monotonic()

    def _call(self, msg_of, timeout_s: float | None = None, *, session: _Connection | None = None):
        """One request and its reply (the caller holds ``_lock``), within ``timeout_s``.

        ``session=None``: a request a new session may be sent (:class:`_Ended` says which); when the
        session is found ended (:class:`_Ended`) it is sent once more on a new connection within
        the time left. ``session=conn``: a request naming what ``conn``'s session holds (a
        ticket, a hold, a lease), sent on that session only, never again.
        """
        if self._closed:
            raise StoreClosedError("NodeKVStore is closed")
        self.counters["calls"] += 1
        t = self.timeout_s if timeout_s is None else max(min(timeout_s, self.timeout_s), 1e-3)
        deadline = time.monotonic() + t
        conn: _Connection | None = None
        try:
            conn = self._connection(t)  # a failed attempt starts the retry interval; a skipped one does not
            if session is not None and conn is not session:
                conn = None  # that session is gone; this one is fine
                raise _Down("the session that held this request's ticket, hold or lease has ended")
            try:
                return conn.call(msg_of, t)
            except _Ended:
                self._drop(ended=True)
                conn = None
                left = deadline - time.monotonic()
                if session is not None or left <= 0:
                    raise
            self.counters["resent"] += 1  # the session ended before the request was served
            conn = self._connect(left)
            return conn.call(msg_of, max(deadline - time.monotonic(), 1e-3))
        except _Down as e:
            self.counters.down_by(e, self.url, self.retry_s)
            if conn is not None and self._conn is conn:
                self._drop()
            raise
        except _Refused as e:  # answered as a miss or REJECTED by the caller: say why in stats()
            self.counters.refused_by(e)
            raise

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        """``[a, b)`` ranges of at most the service's ``max_keys`` (the caller holds ``_lock``;
        one range when the service is down: its call then misses)."""
        try:
            step = self._connection().welcome.max_keys if not self._closed else max(n, 1)
        except _Down:
            step = max(n, 1)
        return [(i, min(i + step, n)) for i in range(0, n, step)] or [(0, 0)]

    # ------------------------------------------------------------------ identity
    def digest(self, ns: Namespace | bytes) -> bytes:
        """The namespace's 32-byte digest, scoped to the layout (as :meth:`KVStore.digest`)."""
        return self._digests(ns)

    def keys_for(self, ns: Namespace | bytes, token_ids) -> list[bytes]:
        """Chained hashes of the full blocks of ``token_ids`` under ``ns`` (as :meth:`KVStore.keys_for`)."""
        return block_hashes(self.digest(ns), token_ids, self.layout.tokens_per_block)

    @contextlib.contextmanager
    def request(self) -> Iterator[object]:
        """A request id whose lookup references are released on exit."""
        rid = ("node-request", next(self._rids))
        try:
            yield rid
        finally:
            self.release(rid)

    def release(self, request_id: object) -> int:
        """Drop the references a lookup took under ``request_id``; returns how many."""
        return self._end_hold(request_id, P.Release)

    def cancel(self, request_id: object) -> int:
        """As :meth:`release` (abandoning the request)."""
        return self._end_hold(request_id, P.Cancel)

    def _hold_of(self, request_id: object) -> int | None:
        """The current session's hold number of ``request_id`` (a new one on first use)."""
        if request_id is None:
            return None
        return self._holds.setdefault(request_id, next(self._next_hold))

    def _end_hold(self, request_id: object, kind) -> int:
        with self._lock:
            hold = self._holds.pop(request_id, None)
            if hold is None or self._closed or self._conn is None:
                return 0
            try:
                return int(self._call(lambda rid: kind(rid, hold=hold), session=self._conn).n)
            except (_Down, _Refused):
                return 0  # the session ended: the service released them

    # ------------------------------------------------------------------ store
    def _store_checked(self, call: CheckedStore):
        """Store through tickets of the service's slots (:meth:`StoreCalls._store_checked`): each
        block is gathered straight into its segment slot; ``REJECTED`` per block while the service
        is down."""
        code = _lifetime_code(call.lifetime)
        return self._later(
            call.wait, self._store, call.ns, call.keys, call.sources, code, call.first_position
        )

    def _later(self, wait: bool, fn, *args):
        if wait:
            return fn(*args)
        if self._pool_exec is None:
            self._pool_exec = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="tierstore-node-client"
            )
        return self._pool_exec.submit(fn, *args)

    def _store(self, ns: bytes, keys: list[bytes], sources, lifetime: int, first: int) -> list[Status]:
        out: list[Status] = []
        with self._lock:
            for a, b in self._chunks(len(keys)):
                try:
                    out += self._store_chunk(ns, keys[a:b], sources, a, lifetime, first + a)
                except (_Down, _Refused):  # the ticket (if any) ends with the session or its lease
                    out += [Status.REJECTED] * (len(keys) - len(out))
                    break
        return out

    def _store_chunk(self, ns: bytes, keys, sources, at: int, lifetime: int, first: int) -> list[Status]:
        if not keys:
            return []
        t = self._call(
            lambda rid: P.PrepareStore(
                rid, ns=ns, keys=b"".join(keys), first_position=first, lifetime=lifetime, wait=True
            )
        )
        conn = self._conn  # the session that handed out the ticket's slots
        ok = copy_slots(conn, t, sources, at, True, self.layout.bytes_per_block, self.counters)
        out = self._call(
            lambda rid: P.CompleteStore(rid, plan_id=t.plan_id, ok=P.pack_flags(ok)), session=conn
        )
        return P.unpack_statuses(out.statuses)

    # ------------------------------------------------------------------ lookup
    def lookup(self, ns: Namespace | bytes, token_ids, request_id: object = None) -> LookupResult:
        """Longest cached prefix of ``token_ids`` (as :meth:`KVStore.lookup`); nothing matched
        while the service is down."""
        return self._lookup_checked(self.keys_for(ns, token_ids), request_id, None, self.digest(ns))

    def _lookup_checked(
        self, keys: list[bytes], request_id: object, num_prompt_tokens: int | None, ns: bytes | None
    ) -> LookupResult:
        """A ``Lookup`` of ``keys`` (:meth:`KeyLookup._lookup_checked`; the service counts no
        partial tails: ``num_prompt_tokens`` is not sent)."""
        tpb = self.layout.tokens_per_block
        miss = LookupResult([], [], [], 0, len(keys), tpb, request_id)
        if not keys:
            return miss
        with self._lock:
            try:
                r = self._call(  # the hold is taken when sent: a new session starts without any
                    lambda rid: P.Lookup(
                        rid,
                        ns=ns or _ZERO_NS,
                        keys=b"".join(keys),
                        hold=self._hold_of(request_id),
                        pin_s=None,
                    )
                )
            except (_Down, _Refused):
                return miss
        m = r.matched
        return LookupResult(
            keys[:m],
            [_TIERS[c] for c in r.tiers],
            P.unpack_load_s(r.load_s).tolist(),
            r.useful,
            len(keys),
            tpb,
            request_id,
            r.reason,
        )

    def probe(self, ns: Namespace | bytes, token_ids) -> int:
        """Matched tokens, no references taken (0 while the service is down)."""
        return self._exists(self.keys_for(ns, token_ids), self.digest(ns)) * self.layout.tokens_per_block

    def exists(self, keys: Sequence[bytes]) -> int:
        """Leading ``keys`` resident (0 while the service is down)."""
        return self._exists(check_keys(keys), _ZERO_NS)

    def _exists(self, keys: list[bytes], ns: bytes) -> int:
        if not keys:
            return 0
        with self._lock:
            try:
                return int(self._call(lambda rid: P.Exists(rid, ns=ns, keys=b"".join(keys))).n)
            except (_Down, _Refused):
                return 0

    # ------------------------------------------------------------------ load
    def load(
        self, keys, dests=None, promote: bool = True, *, wait: bool = True, timeout_s: float | None = None
    ):
        """Load blocks (default: a lookup's useful keys) into ``dests`` or new CPU tensors (as
        :meth:`KVStore.load`): ``(statuses, tensors)``; ``MISS`` while the service is down."""
        if isinstance(keys, LookupResult):
            keys = keys.useful_keys
        keys = check_keys(keys)
        timeout_s = None if timeout_s is None else check_duration_s(timeout_s, "timeout_s")
        plans, finish = plan_destinations(len(keys), dests, self.layout)
        return self._later(wait, lambda: finish(self._load(keys, plans, timeout_s)))

    def load_fragments(
        self, keys, dest_fragments_per_block, *, wait: bool = True, timeout_s: float | None = None
    ):
        """Load blocks and scatter each straight out of its slot into its destination fragments
        (as :meth:`KVStore.load_fragments`); per-block statuses."""
        if isinstance(keys, LookupResult):
            keys = keys.useful_keys
        keys = check_keys(keys)
        timeout_s = None if timeout_s is None else check_duration_s(timeout_s, "timeout_s")
        plans = plan_fragment_destinations(len(keys), dest_fragments_per_block, self.layout)
        return self._later(wait, self._load, keys, plans, timeout_s)

    def _load(self, keys: list[bytes], plans, timeout_s: float | None) -> list[Status]:
        out: list[Status] = []
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            for a, b in self._chunks(len(keys)):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    break
                try:
                    got = self._load_chunk(keys[a:b], plans, a, left)
                except (_Down, _Refused):
                    break
                out += got
                if any(s is not Status.OK for s in got):
                    break  # a hole ends the usable prefix
        return out + [Status.MISS] * (len(keys) - len(out))

    def _load_chunk(self, keys, plans, at: int, timeout_s: float | None) -> list[Status]:
        if not keys:
            return []
        t = self._call(
            lambda rid: P.PrepareLoad(rid, ns=_ZERO_NS, keys=b"".join(keys), hold=None, wait=True), timeout_s
        )
        conn = self._conn
        ok = copy_slots(conn, t, plans, at, False, self.layout.bytes_per_block, self.counters)
        self._call(
            lambda rid: P.CompleteLoad(rid, plan_id=t.plan_id, ok=P.pack_flags(ok)), timeout_s, session=conn
        )
        return [Status.OK if k else Status.MISS for k in ok.tolist()]

    # ------------------------------------------------------------------ pins, invalidation, stats
    def prefetch(self, ns: Namespace | bytes, token_ids, tier: str = "host") -> concurrent.futures.Future:
        """Bring the resident full blocks of a prefix up to ``tier`` of the service's store in the
        background (as :meth:`KVStore.prefetch`).

        Returns
        -------
        concurrent.futures.Future
            Resolves to the number of blocks brought up (0 while the service is down).

        Raises
        ------
        StoreClosedError
            After :meth:`close`.
        ConfigError
            ``tier`` is not ``"host"`` or ``"hbm"`` (at once); the future raises it for a tier
            the service's store does not have.

        The service's session thread waits for the copies, within this client's ``timeout_s``.
        """
        if self._closed:
            raise StoreClosedError("NodeKVStore is closed")
        if tier not in ("host", "hbm"):
            raise ConfigError(f"tier={tier!r}: accepted values are ['hbm', 'host']")
        keys = self.keys_for(ns, token_ids)
        d = self.digest(ns)

        def run() -> int:
            with self._lock:
                try:
                    return int(
                        self._call(lambda rid: P.Prefetch(rid, ns=d, keys=b"".join(keys), tier=tier)).n
                    )
                except _Down:
                    return 0
                except _Refused as e:
                    raise ConfigError(f"node service {self.url} refused the prefetch: {e}") from None

        if not keys:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(0)
            return done
        return self._later(False, run)

    def pin(self, ns: Namespace | bytes, token_ids, lease_s: float | None = None) -> Lease:
        """Pin the resident blocks of a prefix (as :meth:`KVStore.pin`); an empty lease (id 0)
        while the service is down."""
        return self.pin_keys(ns, self.keys_for(ns, token_ids), lease_s)

    def pin_keys(self, ns: Namespace | bytes, keys: Sequence[bytes], lease_s: float | None = None) -> Lease:
        """Pin the resident leading ``keys`` of ``ns`` (as :meth:`KVStore.pin_keys`); an empty
        lease (id 0) while the service is down.

        Raises
        ------
        QuotaExceeded
            Past the namespace's pin quota (nothing is pinned).
        ConfigError
            For a lease that is not a finite number of seconds in ``(0, MAX_DURATION_S]``, and
            for a pin the service refuses as a bad request (a lease past its ``limits.max_lease_s``,
            more keys than its limit), with the service's reason.
        """
        d = self.digest(ns)
        keys = check_keys(keys)
        lease_s = None if lease_s is None else check_duration_s(lease_s, "lease_s")
        with self._lock:
            try:
                r = self._call(lambda rid: P.Pin(rid, ns=d, keys=b"".join(keys), lease_s=lease_s))
            except _Refused as e:
                if e.code is P.ErrorCode.QUOTA:
                    raise QuotaExceeded(str(e)) from None
                if e.code in (P.ErrorCode.BAD_REQUEST, P.ErrorCode.LIMIT):  # the request, not the service
                    raise ConfigError(f"the node service refused the pin: {e}") from None
                return Lease(0, d, [], 0.0, 0)
            except _Down:
                return Lease(0, d, [], 0.0, 0)
        return Lease(r.lease_id, d, keys[: r.pinned], time.monotonic() + r.expires_in_s, r.lease_bytes)

    def unpin(self, lease: Lease | int) -> bool:
        """End a lease of this session; ``False`` if it was not live (or the service is down)."""
        lid = lease.lease_id if isinstance(lease, Lease) else int(lease)
        if lid <= 0:
            return False
        with self._lock:
            if self._conn is None:
                return False  # no session: its leases ended with it
            try:
                return bool(self._call(lambda rid: P.Unpin(rid, lease_id=lid), session=self._conn).n)
            except (_Down, _Refused):
                return False

    def invalidate(self, ns: Namespace | bytes) -> int:
        """Drop every block of a namespace in the service's store; returns blocks dropped.

        Raises
        ------
        StoreClosedError
            When the service is down (an invalidation must not be lost silently).
        """
        d = self.digest(ns)
        with self._lock:
            try:
                return int(self._call(lambda rid: P.Invalidate(rid, ns=d)).n)
            except _Down as e:
                raise StoreClosedError(
                    f"node service {self.url} is down; nothing was invalidated ({e})"
                ) from e
            except _Refused as e:
                raise TierStoreError(f"node service {self.url} refused the invalidation: {e}") from None

    def stats(self) -> dict:
        """The service's statistics (its store, pool and this session; on a daemon of several
        tenants the tenant's own ``usage_bytes`` and the pool's geometry only) with a ``client``
        section (``connected``, ``url`` and :class:`_Counters`)."""
        import json

        out: dict = {}
        with self._lock:
            if not self._closed:
                try:
                    out = json.loads(self._call(lambda rid: P.Stats(rid)).json)
                except (_Down, _Refused):
                    out = {}
            out["client"] = self.counters.section(connected=self._conn is not None, url=self.url)
        return out

    def close(self) -> None:
        """Say ``Bye`` and close the connection and mapping (idempotent); calls then raise
        :class:`StoreClosedError`."""
        if self._closed:
            return
        if self._pool_exec is not None:  # calls with wait=False finish first
            self._pool_exec.shutdown(wait=True)
        with self._lock:
            if self._closed:
                return
            self._closed = True
            c, self._conn = self._conn, None
        if c is not None and c.pid == os.getpid():
            c.close(bye=True)
        elif c is not None:
            c.forget()

    def __enter__(self) -> NodeKVStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["NOT_OFFERED", "NodeKVStore", "socket_path"]
