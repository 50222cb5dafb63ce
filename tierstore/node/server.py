"""The node service: one :class:`~tierstore.node.core.NodeCore` served over a UNIX socket.

Engine processes connect to ``node.socket`` (:class:`~tierstore.server.config.NodeConfig`),
say :class:`~tierstore.node.protocol.Hello` and get the pool's segment fd with the
``Welcome`` (``SCM_RIGHTS``); from then on every request is one frame and one reply
(:mod:`tierstore.node.protocol`): lookup, exists, store (prepare → the client gathers into
the slots → complete with its ``ok`` flags), load (prepare, NVMe blocks staged → the client
scatters → complete), pin/unpin, invalidate, stats, release/cancel of a lookup's hold, bye.
One thread per connection; a request is answered before the next is read.

What a session holds (its tickets, holds, leases) is released when it ends. After ``Bye`` the
client copies no more: its tickets are aborted at once. A connection that ends without one
(the process died, or closed the socket mid-call) may still have a thread copying into a
store ticket's slots: its store tickets are quarantined (slots kept) until the peer process
is gone (its ``pidfd`` readable) or ``lease_s`` passed, then aborted; load tickets are aborted
at once (a reader sees the bumped generations: a miss). Bounds: ``max_clients`` sessions,
``max_tickets_per_client`` open tickets each, ``max_keys`` keys a request, ``max_frame_bytes``
a frame, ``op_timeout_s`` for the ``Hello``, for the rest of a frame once its first byte came,
and for a reply.

The socket file gets ``socket_mode`` before the socket listens. Start-up refuses a path that
answers (a live service) or is not a socket; a socket nobody listens on (a stale one) is
removed. Access: a peer whose uid (``SO_PEERCRED``) is not in ``allow_uids`` (default: the
service's own) and whose gid is not in ``allow_gids`` is refused at its ``Hello`` (``AUTH``).
With an ``access`` (:class:`~tierstore.node.access.NodeAccess`, the daemon's tenancy) the
session is bound to a tenant there and every key and namespace is scoped to it as HTTP scopes
them; without one (a bare pool) keys are used as sent and a token is refused. The leader/rank
groups of the protocol are not served yet (a ``Hello`` with one is refused).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import select
import signal
import socket
import stat
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, QuotaExceeded, Status, StoreClosedError, TierStoreError
from ..server.config import DaemonConfig, NodeConfig
from . import protocol as P
from .core import NodeCore
from .tickets import Ready

_log = logging.getLogger(__name__)
_ZERO_NS = bytes(P.NS_BYTES)
#: seconds a session waits for the peer process to exit after an unannounced close
_EXIT_GRACE_S = 2.0


class NodeServiceError(TierStoreError):
    """The service cannot start: the socket path answers (another service listens there), is
    not a socket, or cannot be bound."""


@dataclasses.dataclass(eq=False)
class _Session:
    sid: int
    frames: P.FrameSocket
    pid: int
    pidfd: int | None
    tickets: set = dataclasses.field(default_factory=set)
    holds: set = dataclasses.field(default_factory=set)
    leases: set = dataclasses.field(default_factory=set)
    ready: list = dataclasses.field(default_factory=list)  # Ready notices not told yet
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)
    said_bye: bool = False
    welcomed: bool = False
    uid: int = -1
    gid: int = -1
    tenant: str = ""  # bound at Hello ("" without an access)
    refused: bool = False  # the Hello was refused: close after the answer
    charges: dict = dataclasses.field(default_factory=dict)  # plan id -> (scope, keys charged)


def _peer_creds(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the peer (``struct ucred``, socket(7) ``SO_PEERCRED``)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", creds)
    return pid, uid, gid


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):  # an old kernel or the peer gone already: leases decide
        return None


def _exited(pidfd: int | None, wait_s: float) -> bool:
    """Whether the process of ``pidfd`` exited within ``wait_s`` (a pidfd polls readable then)."""
    if pidfd is None:
        return False
    r, _, _ = select.select([pidfd], [], [], max(wait_s, 0.0))
    return bool(r)


def claim_socket_path(path: str) -> None:
    """Make ``path`` free for a new listening socket: nothing there, or a stale socket (removed).

    Raises
    ------
    NodeServiceError
        When something listens on ``path`` or it is not a socket (nothing is removed then).
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise NodeServiceError(f"{path} exists and is not a socket: refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # stale: nothing listens
        return
    except OSError as e:
        raise NodeServiceError(f"{path}: cannot tell whether a service listens there ({e})") from e
    finally:
        probe.close()
    raise NodeServiceError(f"{path}: another service listens there; stop it or choose another node.socket")


class NodeServer:
    """Serve ``core`` on the UNIX socket of ``config`` (see the module docstring).

    Parameters
    ----------
    core : NodeCore
        The pool; the server does not close it (its owner does, after :meth:`close`).
    config : NodeConfig
        Socket path and mode, the peers admitted, limits and timeouts.
    access : NodeAccess, optional
        The daemon's tenancy (tenant binding, scoping, quotas, lease bounds); ``None``: keys are
        used as sent.
    metrics : NodeMetrics, optional
        Prometheus metrics of this transport (:class:`tierstore.server.metrics.NodeMetrics`).

    Attributes
    ----------
    path : str
        The socket path.
    """

    def __init__(self, core: NodeCore, config: NodeConfig, *, access=None, metrics=None) -> None:
        self.core = core
        self.cfg = config
        self.access = access
        self.metrics = metrics
        if metrics is not None:
            metrics.attach(self)
        self._uids = set(config.peer_uids())
        self._gids = set(config.allow_gids)
        self.path = config.socket
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._sessions: dict[int, _Session] = {}
        self._threads: set[threading.Thread] = set()
        self._next_sid = 1
        self._closing = threading.Event()
        self._accepter: threading.Thread | None = None
        self._handlers: dict[type, Callable[[_Session, Any], P.Reply]] = {
            P.Lookup: self._lookup,
            P.Exists: self._exists,
            P.Release: self._release,
            P.Cancel: self._cancel,
            P.PrepareStore: self._prepare_store,
            P.CompleteStore: self._complete_store,
            P.PrepareLoad: self._prepare_load,
            P.CompleteLoad: self._complete_load,
            P.Abort: self._abort,
            P.Poll: self._poll,
            P.Pin: self._pin,
            P.Unpin: self._unpin,
            P.Invalidate: self._invalidate,
            P.Stats: self._stats,
            P.Reclaim: self._reclaim,
            P.Prefetch: self._prefetch,
        }

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> NodeServer:
        """Claim the socket path, bind, set its mode, listen and start accepting.

        Raises
        ------
        NodeServiceError
            See :func:`claim_socket_path`; or the bind fails.
        """
        claim_socket_path(self.path)
        ls = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            ls.bind(self.path)
            os.chmod(self.path, int(self.cfg.socket_mode, 8))  # before listen: nobody connects earlier
            ls.listen(min(self.cfg.max_clients, socket.SOMAXCONN))
        except OSError as e:
            ls.close()
            raise NodeServiceError(f"cannot listen on {self.path}: {e}") from e
        self._listener = ls
        self._accepter = threading.Thread(target=self._accept_loop, daemon=True, name="tierstore-node-accept")
        self._accepter.start()
        _log.info(
            "node service listening on %s (pool %r, mode %s)", self.path, self.core.name, self.cfg.socket_mode
        )
        return self

    def close(self) -> None:
        """Stop accepting, end every session (their tickets aborted, holds and leases released),
        remove the socket file. Idempotent."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        with self._lock:
            sessions = list(self._sessions.values())
        for s in sessions:
            with contextlib.suppress(OSError):
                s.frames.sock.shutdown(socket.SHUT_RDWR)  # its thread ends the session
        if self._accepter is not None:
            self._accepter.join()
        for t in list(self._threads):
            t.join()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    def __enter__(self) -> NodeServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    def sessions(self) -> int:
        """Sessions open (connected, or ending and still holding slots)."""
        with self._lock:
            return len(self._sessions)

    # ------------------------------------------------------------------ connections
    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._closing.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                if self._closing.is_set():
                    return
                time.sleep(0.05)  # EMFILE and friends: keep serving those connected
                continue
            with self._lock:
                full = len(self._sessions) >= self.cfg.max_clients
                sid = self._next_sid
                self._next_sid += 1
            fs = P.FrameSocket(conn, P.REQUEST_DECODER, max_frame_bytes=self.cfg.max_frame_bytes)
            if full:
                self.core.index.metrics.inc("node_sessions_refused")
                if self.metrics is not None:
                    self.metrics.sessions_refused.labels("busy").inc()
                _log.warning("node session %d refused: node.max_clients=%d open", sid, self.cfg.max_clients)
                conn.settimeout(self.cfg.op_timeout_s)
                fs.fail(P.ProtocolError(P.ErrorCode.BUSY, f"{self.cfg.max_clients} sessions open"))
                continue
            pid, uid, gid = _peer_creds(conn)
            s = _Session(sid, fs, pid, _open_pidfd(pid), uid=uid, gid=gid)
            with self._lock:
                self._sessions[sid] = s
            t = threading.Thread(target=self._serve, args=(s,), daemon=True, name=f"tierstore-node-{sid}")
            self._threads.add(t)
            t.start()

    def _serve(self, s: _Session) -> None:
        try:
            self._serve_frames(s)
        finally:
            s.frames.close()
            self._end_session(s)
            with self._lock:
                self._sessions.pop(s.sid, None)
            self._threads.discard(threading.current_thread())

    def _serve_frames(self, s: _Session) -> None:
        fs = s.frames
        fs.set_timeout(self.cfg.op_timeout_s)
        while not self._closing.is_set():
            try:
                msg = fs.recv()
            except TimeoutError:
                if fs.broken or not s.welcomed:  # stalled inside a frame, or no Hello in time
                    return
                continue  # idle between frames
            except P.ProtocolError as e:
                self.core.index.metrics.inc("node_bad_frames")
                if self.metrics is not None:
                    self.metrics.sessions_refused.labels("bad_frame").inc()
                _log.warning("node session %d (pid %d): %s", s.sid, s.pid, e)
                if e.code is P.ErrorCode.BAD_FRAME:
                    fs.fail(e)
                return
            except OSError:
                return
            if not isinstance(msg, P.Request):  # None: the peer closed between frames
                return
            if isinstance(msg, P.Bye):
                s.said_bye = True
                return
            reply = self._answer(s, msg)
            if reply is None:  # a Welcome, sent with its fd
                continue
            try:
                fs.send(reply)
            except P.ProtocolError as e:  # a reply over max_frame_bytes
                fs.send(e.error(reply.rid))
            except OSError:
                return
            if s.refused:  # a refused Hello: the answer said why
                return

    def _answer(self, s: _Session, msg: P.Request) -> P.Reply | None:
        if self.metrics is None:
            return self._dispatch(s, msg)
        t0 = time.perf_counter()
        reply = self._dispatch(s, msg)
        code = reply.code.value if isinstance(reply, P.Error) else "ok"
        self.metrics.request(type(msg).__name__, code, time.perf_counter() - t0)
        return reply

    def _dispatch(self, s: _Session, msg: P.Request) -> P.Reply | None:
        rid = msg.rid
        try:
            if isinstance(msg, P.Hello):
                return self._hello(s, msg)
            if not s.welcomed:
                return P.Error(rid, P.ErrorCode.BAD_REQUEST, "say Hello first")
            keys = getattr(msg, "keys", b"")
            if len(keys) > self.cfg.max_keys * P.KEY_BYTES:
                return P.Error(
                    rid,
                    P.ErrorCode.LIMIT,
                    f"{len(keys) // P.KEY_BYTES} keys; this service takes {self.cfg.max_keys} a request",
                )
            return self._handlers[type(msg)](s, msg)
        except P.ProtocolError as e:
            return e.error(rid)
        except QuotaExceeded as e:
            return P.Error(rid, P.ErrorCode.QUOTA, str(e)[: P.MAX_TEXT_CHARS])
        except StoreClosedError as e:
            return P.Error(rid, P.ErrorCode.CLOSED, str(e)[: P.MAX_TEXT_CHARS])
        except TierStoreError as e:  # TicketError, ConfigError, LayoutError: the request's fault
            return P.Error(rid, P.ErrorCode.BAD_REQUEST, str(e)[: P.MAX_TEXT_CHARS])
        except Exception as e:  # noqa: BLE001 (logged and counted; the client takes it as a miss)
            self.core.index.metrics.inc("node_internal_errors")
            _log.exception("node session %d: %s failed", s.sid, type(msg).__name__)
            return P.Error(rid, P.ErrorCode.INTERNAL, f"{type(e).__name__}: {e}"[: P.MAX_TEXT_CHARS])

    def _admit(self, s: _Session, m: P.Hello) -> P.Error | None:
        """Why a ``Hello`` is refused (an ``Error``), or ``None``; binds ``s.tenant``."""
        core, lay = self.core, self.core.layout
        if s.welcomed:
            return P.Error(m.rid, P.ErrorCode.BAD_REQUEST, "a session says Hello once")
        if s.uid not in self._uids and s.gid not in self._gids:
            return P.Error(
                m.rid,
                P.ErrorCode.AUTH,
                f"peer uid {s.uid} gid {s.gid} (pid {s.pid}) may not use this socket: "
                f"node.allow_uids={sorted(self._uids)}, node.allow_gids={sorted(self._gids)}",
            )
        why = None
        if m.v != P.PROTOCOL_VERSION:
            why = f"protocol version {m.v}; this service speaks {P.PROTOCOL_VERSION}"
        elif m.role != "solo":
            why = f"role {m.role!r}: leader/rank groups are not served yet; connect each process as 'solo'"
        elif m.token and self.access is None:
            why = "this pool has no tenants: connect without a token (the socket's peers are the boundary)"
        elif m.pool is not None and m.pool != core.name:
            return P.Error(
                m.rid, P.ErrorCode.NOT_FOUND, f"no pool {m.pool!r}; this service serves {core.name!r}"
            )
        elif m.block_bytes != lay.bytes_per_block or m.tokens_per_block != lay.tokens_per_block:
            why = (
                f"block class {m.block_bytes} B / {m.tokens_per_block} tokens; pool {core.name!r} holds "
                f"{lay.bytes_per_block} B / {lay.tokens_per_block} tokens blocks"
            )
        if why is not None:
            return P.Error(m.rid, P.ErrorCode.BAD_REQUEST, why)
        if self.access is not None:
            s.tenant = self.access.bind(m.token)  # ProtocolError(AUTH): _hello answers it
        return None

    def _hello(self, s: _Session, m: P.Hello) -> P.Reply | None:
        core = self.core
        try:
            refusal = self._admit(s, m)
        except P.ProtocolError as e:
            refusal = e.error(m.rid)
        if refusal is not None:
            s.refused = not s.welcomed
            if self.metrics is not None and s.refused:
                reason = "auth" if refusal.code is P.ErrorCode.AUTH else "hello"
                self.metrics.sessions_refused.labels(reason).inc()
            if s.refused:
                _log.warning(
                    "node session %d (pid %d, uid %d): refused: %s", s.sid, s.pid, s.uid, refusal.message
                )
            return refusal
        h = core.segment.header
        w = P.Welcome(
            m.rid,
            session=s.sid,
            pool=core.name,
            block_bytes=core.segment.block_bytes,
            slot_bytes=h.slot_bytes,
            host_slots=h.host_slots,
            staging_slots=h.staging_slots,
            segment_bytes=h.segment_bytes,
            boot_id=h.boot_id,
            op_timeout_s=self.cfg.op_timeout_s,
            max_keys=self.cfg.max_keys,
        )
        assert core.segment.fd is not None
        try:
            s.frames.send(w, fds=[core.segment.fd])
        except OSError as e:  # the client gave up during its handshake: the session ends, no error
            _log.info("node session %d (pid %d): left during its handshake (%s)", s.sid, s.pid, e)
            return None  # the next recv finds the peer gone
        s.welcomed = True
        if self.metrics is not None:
            self.metrics.sessions_opened.labels(s.tenant).inc()
        who = (s.sid, s.pid, s.uid, s.tenant, m.client[:200])
        _log.info("node session %d: pid %d uid %d attached (tenant %r; %s)", *who)
        return None

    # ------------------------------------------------------------------ requests
    def _notices(self, s: _Session, reply):
        """``reply`` with the session's Ready notices not told yet."""
        with s.lock:
            ready, s.ready = s.ready[: P.MAX_READY], s.ready[P.MAX_READY :]
        if not ready:
            return reply
        failed = [(i, k) for i, r in enumerate(ready) for k in r.failed]
        return dataclasses.replace(
            reply,
            ready_ids=P.pack_u64([r.plan_id for r in ready]),
            ready_failed=P.pack_failed(failed) if failed else b"",
        )

    def _hold(self, s: _Session, hold: int | None):
        if hold is None:
            return None
        s.holds.add(hold)
        return ("node", s.sid, hold)

    def _scoped(self, s: _Session, ns: bytes, raw_keys: bytes, write: bool):
        """``(store namespace or None, keys, scope, owner)`` of a request: as sent without an
        access, else scoped to the session's tenant (:meth:`NodeAccess.scoped`)."""
        keys = P.unpack_keys(raw_keys)
        if self.access is None:
            return (None if ns == _ZERO_NS and not write else ns), keys, None, ""
        sc = self.access.scoped(s.tenant, ns, keys, write)
        return sc.ns, sc.keys, sc.scope, sc.owner

    def _namespace(self, s: _Session, ns: bytes, write: bool) -> tuple[bytes, bytes | None]:
        if self.access is None:
            return ns, None
        return self.access.namespace(s.tenant, ns, write)

    def _lease_s(self, lease_s: float | None) -> float | None:
        return lease_s if self.access is None else self.access.lease_s(lease_s)

    def _lookup(self, s: _Session, m: P.Lookup):
        ns, keys, _, _ = self._scoped(s, m.ns, m.keys, write=False)
        pin_s = self._lease_s(m.pin_s)
        res = self.core.lookup(keys, self._hold(s, m.hold), ns)
        if self.metrics is not None:
            self.metrics.count_hits("node_lookup", len(keys), len(res.keys))
        if pin_s is not None and res.keys and ns is not None:
            s.leases.add(self.core.pin(ns, res.keys, pin_s).lease_id)
        return self._notices(
            s,
            P.LookupReply(
                m.rid,
                matched=len(res.keys),
                useful=res.useful_blocks,
                tiers=bytes(res.tiers),
                load_s=P.pack_load_s(res.load_s),
                reason=(res.not_useful_reason or None) and res.not_useful_reason[: P.MAX_TEXT_CHARS],
            ),
        )

    def _exists(self, s: _Session, m: P.Exists):
        _, keys, _, _ = self._scoped(s, m.ns, m.keys, write=False)
        return self._notices(s, P.Count(m.rid, n=self.core.store.exists(keys)))

    def _release(self, s: _Session, m: P.Release):
        s.holds.discard(m.hold)
        return self._notices(s, P.Count(m.rid, n=self.core.store.release(("node", s.sid, m.hold))))

    def _cancel(self, s: _Session, m: P.Cancel):
        s.holds.discard(m.hold)
        return self._notices(s, P.Count(m.rid, n=self.core.store.cancel(("node", s.sid, m.hold))))

    def _room(self, s: _Session, rid: int):
        if len(s.tickets) >= self.cfg.max_tickets_per_client:
            return P.Error(
                rid,
                P.ErrorCode.BUSY,
                f"{len(s.tickets)} tickets open in this session "
                f"(max_tickets_per_client={self.cfg.max_tickets_per_client})",
            )
        return None

    def _on_ready(self, s: _Session):
        def tell(r: Ready) -> None:
            with s.lock:
                s.ready.append(r)

        return tell

    def _ticket_reply(self, s: _Session, rid: int, t) -> P.Reply:
        s.tickets.add(t.plan_id)
        return self._notices(
            s,
            P.TicketReply(
                rid,
                plan_id=t.plan_id,
                statuses=P.pack_statuses(t.statuses),
                slots=P.pack_slots(t.slots),
                gens=P.pack_u64(t.gens),
                ready=bool(t.ready),
            ),
        )

    def _prepare_store(self, s: _Session, m: P.PrepareStore):
        busy = self._room(s, m.rid)
        if busy is not None:
            return busy
        lifetime = P.LIFETIME_NAMES[m.lifetime]
        ns, keys, scope, owner = self._scoped(s, m.ns, m.keys, write=True)
        assert ns is not None
        charged: list[bytes] = []
        if self.access is not None:  # the owner's byte quota, as an HTTP put charges it
            charged = self.access.reserve(owner, scope, keys)
        try:
            t = self.core.prepare_store(
                ns, keys, lifetime, m.first_position, wait=m.wait, on_ready=self._on_ready(s)
            )
        except BaseException:
            if scope is not None:
                self.access.unreserve(scope, charged)
            raise
        if scope is not None:
            s.charges[t.plan_id] = (scope, keys, self.access.settle(scope, charged, keys, t.statuses))
        return self._ticket_reply(s, m.rid, t)

    def _settle(self, s: _Session, plan_id: int, statuses=None) -> None:
        """Return the quota charge of a ticket's keys not kept (all of them: ``statuses`` None)."""
        charge = s.charges.pop(plan_id, None)
        if charge is None or self.access is None:
            return
        scope, keys, charged = charge
        if statuses is None:
            self.access.unreserve(scope, charged)
        else:
            self.access.settle(scope, charged, keys, statuses)

    def _mine(self, s: _Session, plan_id: int) -> None:
        if plan_id not in s.tickets:
            raise P.ProtocolError(P.ErrorCode.FORBIDDEN, f"plan {plan_id} is not a ticket of this session")

    def _complete_store(self, s: _Session, m: P.CompleteStore):
        self._mine(s, m.plan_id)
        try:
            out = self.core.complete_store(m.plan_id, m.ok)
        except BaseException:
            self._settle(s, m.plan_id)
            raise
        s.tickets.discard(m.plan_id)
        if out is None:  # every ticket of a solo session has one rank
            self._settle(s, m.plan_id)
            raise P.ProtocolError(P.ErrorCode.INTERNAL, f"plan {m.plan_id}: no outcome after its one report")
        self._settle(s, m.plan_id, out.statuses)
        if self.metrics is not None:
            self.metrics.count_blocks("put", s.tenant, out.statuses)
            self.metrics.count_bytes("in", s.tenant, m.ok.count(1) * self.core.layout.bytes_per_block)
        durable = bytearray(len(out.statuses))
        for i in out.durable:
            durable[i] = 1
        return self._notices(
            s, P.StoreOutcome(m.rid, statuses=P.pack_statuses(out.statuses), durable=bytes(durable))
        )

    def _prepare_load(self, s: _Session, m: P.PrepareLoad):
        busy = self._room(s, m.rid)
        if busy is not None:
            return busy
        _, keys, _, _ = self._scoped(s, m.ns, m.keys, write=False)
        t = self.core.prepare_load(keys, wait=m.wait, on_ready=self._on_ready(s))
        if self.metrics is not None:
            self.metrics.count_blocks("get", s.tenant, t.statuses)
            self.metrics.count_hits("node_load", len(keys), sum(st is Status.OK for st in t.statuses))
        return self._ticket_reply(s, m.rid, t)

    def _complete_load(self, s: _Session, m: P.CompleteLoad):
        self._mine(s, m.plan_id)
        self.core.complete_load(m.plan_id, m.ok)
        s.tickets.discard(m.plan_id)
        if self.metrics is not None:
            self.metrics.count_bytes("out", s.tenant, m.ok.count(1) * self.core.layout.bytes_per_block)
        return self._notices(s, P.Ack(m.rid))

    def _abort(self, s: _Session, m: P.Abort):
        self._mine(s, m.plan_id)
        self.core.abort(m.plan_id)
        s.tickets.discard(m.plan_id)
        self._settle(s, m.plan_id)
        return self._notices(s, P.Ack(m.rid))

    def _poll(self, s: _Session, m: P.Poll):
        return self._notices(s, P.Ack(m.rid))

    def _pin(self, s: _Session, m: P.Pin):
        ns, keys, _, _ = self._scoped(s, m.ns, m.keys, write=False)
        if ns is None:  # a pin names its namespace (the quota's unit); the zero one too
            ns, _ = self._namespace(s, m.ns, write=False)
        lease = self.core.pin(ns, keys, self._lease_s(m.lease_s))
        s.leases.add(lease.lease_id)
        left = max(0.0, lease.expiry_s - self.core.index.runtime.clock()) if lease.keys else 0.0
        return self._notices(
            s,
            P.LeaseReply(
                m.rid,
                lease_id=lease.lease_id,
                pinned=len(lease.keys),
                lease_bytes=lease.bytes,
                expires_in_s=min(left, P.MAX_SECONDS),
            ),
        )

    def _unpin(self, s: _Session, m: P.Unpin):
        if m.lease_id not in s.leases:
            return self._notices(s, P.Count(m.rid, n=0))
        s.leases.discard(m.lease_id)
        return self._notices(s, P.Count(m.rid, n=int(self.core.store.unpin(m.lease_id))))

    def _invalidate(self, s: _Session, m: P.Invalidate):
        ns, scope = self._namespace(s, m.ns, write=True)
        n = self.core.invalidate(ns)
        if scope is not None:
            self.access.invalidated(scope)
        return self._notices(s, P.Count(m.rid, n=n))

    def _stats(self, s: _Session, m: P.Stats):
        s.leases.intersection_update(self.core.store.leases())  # leases the expiry ended are not held
        session = {
            "id": s.sid,
            "pid": s.pid,
            "open_tickets": len(s.tickets),
            "holds": len(s.holds),
            "leases": len(s.leases),
            "tenant": s.tenant or None,
        }
        if self.access is None or self.access.sees_whole_store(s.tenant):
            out = self.core.stats()
            session["sessions"] = self.sessions()
        else:  # several tenants: the tenant's own figures and the pool's fixed geometry, no counts
            out = self.access.tenant_stats(s.tenant, self.core)
        out["session"] = session
        raw = json.dumps(out, default=str).encode()
        if len(raw) > P.MAX_STATS_BYTES:
            raise P.ProtocolError(P.ErrorCode.LIMIT, f"statistics of {len(raw)} bytes")
        return self._notices(s, P.StatsReply(m.rid, json=raw))

    def _prefetch(self, s: _Session, m: P.Prefetch):
        # the session's thread waits for the copies (the client's future does not block its caller)
        _, keys, _, _ = self._scoped(s, m.ns, m.keys, write=False)
        fut = self.core.store.prefetch_keys(keys, m.tier)
        return self._notices(s, P.Count(m.rid, n=int(fut.result())))

    def _reclaim(self, s: _Session, m: P.Reclaim):
        raise P.ProtocolError(
            P.ErrorCode.BAD_REQUEST,
            "reclaim is not served: a session's quarantined slots "
            "are freed when its process exits or after lease_s",
        )

    # ------------------------------------------------------------------ the end of a session
    def _end_session(self, s: _Session) -> None:
        """Release what ``s`` held (see the module docstring): tickets, holds, leases."""
        core = self.core
        try:
            for hold in list(s.holds):
                core.store.cancel(("node", s.sid, hold))
            for lease_id in list(s.leases):
                core.store.unpin(lease_id)
            open_ids = set(core.tickets.open_ids())
            mine = [p for p in s.tickets if p in open_ids]
            if mine and not s.said_bye and not self._closing.is_set() and not _exited(s.pidfd, _EXIT_GRACE_S):
                self._quarantine_until_gone(s, mine)
            for plan_id in mine:
                core.abort(plan_id)
            for plan_id in list(s.charges):  # charges of tickets aborted or never completed
                self._settle(s, plan_id)
            if mine:
                core.index.metrics.inc("node_session_tickets_aborted", len(mine))
        except StoreClosedError:  # the pool closes: NodeCore.close aborts what is left
            pass
        finally:
            if s.pidfd is not None:
                os.close(s.pidfd)

    def _quarantine_until_gone(self, s: _Session, plan_ids: list[int]) -> None:
        """The peer may still copy into its store tickets' slots: keep them from reuse until it
        exits or ``lease_s`` passed (or the service closes)."""
        for plan_id in plan_ids:
            self.core.tickets.quarantine(plan_id)
        deadline = time.monotonic() + self.cfg.lease_s
        while not self._closing.is_set():
            left = deadline - time.monotonic()
            if left <= 0 or _exited(s.pidfd, min(left, 0.5)):
                return
            if s.pidfd is None:
                self._closing.wait(min(left, 0.5))


def open_node_core(cfg: DaemonConfig) -> NodeCore:
    """The pool of a daemon config with a ``node`` section: its layout, tiers, policies and
    remote tier; puts as the HTTP daemon makes them (``puts.durable``: write-through, every
    acknowledged block on NVMe), its pin quota and default lease; tickets quarantined, not
    aborted, past ``node.lease_s`` (the server frees them once their client is gone). The
    segment is faulted in before this returns, and the ``prefaulted`` log line (INFO) says how
    long it took (``seconds``), how (``method``) and over how many ``bytes``.

    Raises
    ------
    ConfigError
        Without a ``node`` section, or for what :class:`NodeCore` refuses.
    """
    if cfg.node is None:
        raise ConfigError("the config has no 'node' section (node: {socket: /run/tierstore/node.sock})")
    node = cfg.node
    from ..server.tenancy import make_state_dir

    make_state_dir(cfg.state_dir)  # before the store: a bad state_dir leaves no tier file behind
    core = NodeCore(
        node.pool,
        cfg.store_config(),
        cfg.layout.build(),
        staging_blocks=node.staging_blocks,
        lease_s=node.lease_s,
        quarantine_expired=True,
    )
    t0 = time.perf_counter()
    try:
        method = core.segment.prefault()  # host memory allocated now, not by the first copy into each slot
    except TierStoreError:
        core.close()
        raise
    # the HTTP daemon's line for its host pool (tierstore/server/README.md: "says how long")
    fields = {
        "event": "prefaulted",
        "populated": True,
        "seconds": round(time.perf_counter() - t0, 3),
        "method": method,
        "bytes": core.segment.size_bytes,
    }
    _log.info("prefaulted", extra={"fields": fields})
    return core


def _tenancy_and_metrics(cfg: DaemonConfig, core: NodeCore):
    """``tierstore serve --node``'s tenancy (the daemon's: ``state_dir``'s scope registry, usage
    rebuilt from the store), its metrics and, with ``metrics.port``, their HTTP endpoint
    (``/metrics``; the server to shut down, else ``None``). Raises ``OSError`` (the port)."""
    from prometheus_client import start_http_server

    from ..server.metrics import NodeMetrics, ServerMetrics
    from ..server.tenancy import Tenancy
    from .access import NodeAccess

    tenancy = Tenancy(cfg, core.layout.bytes_per_block, core.layout.fingerprint())
    tenancy.adopt(core.store)
    # the daemon's families (tiers, store counters, hit ratio, tenants) as with HTTP, and the node's
    store_metrics = ServerMetrics(None, core.store, tenancy)
    registry = store_metrics.registry
    metrics = NodeMetrics(registry, store_metrics)
    http = None
    if cfg.metrics.port is not None:
        started = start_http_server(cfg.metrics.port, cfg.metrics.host, registry)
        http = started[0] if isinstance(started, tuple) else None  # prometheus-client < 0.20: None
    return NodeAccess(cfg, tenancy, core.store), metrics, http


def run_node(cfg: DaemonConfig) -> int:
    """``tierstore serve --node``: serve the config's pool on ``node.socket`` until SIGTERM or
    SIGINT, then end the sessions and close the store (memory blocks written down as
    :meth:`KVStore.close` does). Returns the exit status: 0, or 1 when it cannot start."""
    try:
        core = open_node_core(cfg)
    except (TierStoreError, OSError) as e:
        _log.error("cannot open the node store: %s", e)
        return 1
    assert cfg.node is not None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        access, metrics, http = _tenancy_and_metrics(cfg, core)
        server = NodeServer(core, cfg.node, access=access, metrics=metrics).start()
    except (NodeServiceError, OSError) as e:
        _log.error("%s", e)
        core.close()
        return 1
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.close()
        if http is not None:
            http.shutdown()
        written = core.close()
        _log.info("node service stopped (%d blocks written down to NVMe)", written)
    return 0


__all__ = ["NodeServer", "NodeServiceError", "claim_socket_path", "open_node_core", "run_node"]
