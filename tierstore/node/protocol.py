"""The node service's control protocol: frames, the closed message schema, limits and codes.

Transport: an ``AF_UNIX`` stream socket (``SCM_RIGHTS`` hands the segment's memfd over with the
``Welcome``). A frame is ``u32 length (little-endian) ‖ body`` with ``0 < length <=
max_frame_bytes`` (default :data:`DEFAULT_MAX_FRAME_BYTES`); the body is one msgpack message
that msgspec decodes into a tagged union of array-like structs: ``[tag, field, ...]``, every
field typed and bounded, unknown fields and trailing bytes refused, no ``ext`` types, no
pickle. Per-key data travels as one ``bytes`` field each, never one object per key: keys
(32 bytes each, :data:`MAX_KEYS` at most), statuses, tiers and ok flags (``u8``), slots
(``<i4``), gens and plan ids (``<u8``), load estimates (``<f4``); see the ``pack_*`` and
``unpack_*`` helpers. Every field's bound is checked while decoding, so a frame allocates at
most about its own size.

A client sends :data:`REQUESTS`; the service answers each with one of :data:`REPLIES` carrying
the request's ``rid`` (replies may come out of order). Every reply also carries
``ready_ids`` (plan ids whose tickets became ready since the last reply) and
``ready_failed`` (``(index into ready_ids, key index)`` pairs, ``<u4`` each, of keys a load
could not stage), so the vLLM leader learns of ready tickets without a round trip. Failures
of a request are values (:class:`Error` with an :class:`ErrorCode`). A frame that is too long,
short, or does not decode raises :class:`ProtocolError` with ``ErrorCode.BAD_FRAME``: the
receiver answers one ``Error`` and closes (:meth:`FrameSocket.fail`), since a stream cannot be
resynchronised. Either side may send :class:`Bye` before closing.

Tags: requests 1-18 (``Bye`` is 17 both ways), replies 64-72. Version :data:`PROTOCOL_VERSION`.
"""

from __future__ import annotations

import enum
import functools
import os
import socket
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Literal, Union

import numpy as np

from ..errors import Status, TierStoreError
from ..extras import require

if TYPE_CHECKING:  # the checker reads msgspec's classes; at run time a missing extra is a clear error
    import msgspec
else:
    msgspec = require("msgspec", "the node service protocol (tierstore.node.protocol)")
Meta = msgspec.Meta

PROTOCOL_VERSION = 1
FRAME_HEADER = struct.Struct("<I")
DEFAULT_MAX_FRAME_BYTES = 4 << 20
#: the largest max_frame_bytes a side may configure (the length field is a u32)
MAX_FRAME_LIMIT_BYTES = 1 << 30
KEY_BYTES = 32
NS_BYTES = 32
#: keys (and statuses, slots, ...) in one message, whatever the service's own max_keys
MAX_KEYS = 1 << 16
#: plan ids in one reply's ready_ids
MAX_READY = 4096
MAX_TEXT_CHARS = 4096
MAX_NAME_CHARS = 128
MAX_STATS_BYTES = 1 << 20
#: seconds fields are finite and at most this (about 31 years): NaN and inf are refused
MAX_SECONDS = 1e9
#: a block fits a segment slot (slot_bytes is a u32 there, tierstore.node.segment)
MAX_BLOCK_BYTES = (1 << 32) - 4096
MAX_TOKENS_PER_BLOCK = 1 << 20
MAX_WORLD_RANK = (1 << 16) - 1
_I63 = (1 << 63) - 1  # msgspec bounds fit an int64
_U32 = (1 << 32) - 1

Id = Annotated[int, Meta(ge=0, le=_I63)]
U32 = Annotated[int, Meta(ge=0, le=_U32)]
Seconds = Annotated[float, Meta(ge=0.0, le=MAX_SECONDS)]
Ns = Annotated[bytes, Meta(min_length=NS_BYTES, max_length=NS_BYTES)]
Keys = Annotated[bytes, Meta(max_length=MAX_KEYS * KEY_BYTES)]
Codes = Annotated[bytes, Meta(max_length=MAX_KEYS)]
Text = Annotated[str, Meta(max_length=MAX_TEXT_CHARS)]
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS)]
BlockBytes = Annotated[int, Meta(ge=1, le=MAX_BLOCK_BYTES)]

#: wire code ``i`` of a status is its position here (pinned: never reorder, only append)
WIRE_STATUSES = (Status.OK, Status.EXISTS, Status.MISS, Status.NO_SPACE, Status.REJECTED, Status.IO_ERROR)
_STATUS_CODE = {s: i for i, s in enumerate(WIRE_STATUSES)}
#: wire code ``i`` of a tier is ``tierstore.index.Tier(i)`` (this module imports nothing of the index)
TIER_NAMES = ("hbm", "host", "nvme", "remote")
#: wire lifetime code: 0 = none given (the service's classifier decides), ``c + 1`` for
#: ``tierstore.fdp.lifetime.LifetimeClass`` value ``c``
LIFETIME_NAMES = (None, "short", "medium", "long")
_ALLOWED = {n: bytes(range(n)) for n in (2, len(WIRE_STATUSES), len(TIER_NAMES))}


class ErrorCode(enum.Enum):
    """Why a request failed (the ``code`` of :class:`Error`).

    Values
    ------
    AUTH         no or a wrong token.
    FORBIDDEN    the tenant may not do this (another tenant's pool, a rank without the group's
                 join token, a plan of another group).
    QUOTA        a byte or pin quota would be exceeded.
    BAD_REQUEST  a well-formed request the service cannot take (unknown plan, ``ok`` of the
                 wrong length, keys of an unbound pool).
    BUSY         a per-session or per-tenant ceiling is reached (in-flight slots, sessions).
    CLOSED       the service or the connection is shutting down.
    NOT_FOUND    no such pool, lease or session.
    LIMIT        a message exceeds a limit (keys per call, frame bytes).
    BAD_FRAME    a frame too long, short or not of the schema; the connection is closed.
    INTERNAL     the service failed for a reason that is not the request's; the client takes
                 it as a miss.
    """

    AUTH = "auth"
    FORBIDDEN = "forbidden"
    QUOTA = "quota"
    BAD_REQUEST = "bad_request"
    BUSY = "busy"
    CLOSED = "closed"
    NOT_FOUND = "not_found"
    LIMIT = "limit"
    BAD_FRAME = "bad_frame"
    INTERNAL = "internal"


class ProtocolError(TierStoreError, ValueError):
    """A frame or message violates the protocol (``code``, an :class:`ErrorCode`: ``BAD_FRAME``
    for what the receiver must close on, ``LIMIT`` or ``BAD_REQUEST`` for a message refused
    before it was sent, ``CLOSED`` for a connection that broke earlier)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.detail = message

    def error(self, rid: int = 0) -> Error:
        """This error as the :class:`Error` reply to request ``rid`` (0: not known)."""
        return Error(rid, self.code, self.detail[:MAX_TEXT_CHARS])


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_REQUEST, message)


def _multiple(field: str, raw: bytes, unit: int) -> int:
    if len(raw) % unit:
        raise _bad(f"{field}: {len(raw)} bytes is not a multiple of {unit}")
    return len(raw) // unit


def _codes(field: str, raw: bytes, n_codes: int) -> None:
    if raw.translate(None, _ALLOWED[n_codes]):
        raise _bad(f"{field}: a code outside [0, {n_codes})")


def _length(field: str, raw: bytes, expect: int) -> None:
    if len(raw) != expect:
        raise _bad(f"{field}: {len(raw)} bytes, expected {expect}")


class Message(msgspec.Struct, array_like=True, forbid_unknown_fields=True, frozen=True, gc=False):
    """Base of every message: an array-like struct, ``[tag, fields...]`` on the wire."""


class Request(Message):
    """Base of what a client sends; ``rid`` (request id, chosen by the client) comes back in
    the reply."""

    rid: Id


class Reply(Message):
    """Base of what the service sends; ``rid`` is the request's."""

    rid: Id


class _Notices(Reply, kw_only=True):
    # ready_ids and ready_failed ride on every reply but Error (see the module docstring)
    ready_ids: Annotated[bytes, Meta(max_length=MAX_READY * 8)] = b""
    ready_failed: Annotated[bytes, Meta(max_length=MAX_KEYS * 8)] = b""

    def __post_init__(self) -> None:
        n = _multiple("ready_ids", self.ready_ids, 8)
        if _multiple("ready_failed", self.ready_failed, 8) and n:
            if int(unpack_failed(self.ready_failed)[:, 0].max()) >= n:
                raise _bad("ready_failed: an index past ready_ids")
        elif self.ready_failed:
            raise _bad("ready_failed without ready_ids")


# -- requests --------------------------------------------------------------------------------


class Hello(Request, tag=1):
    """Open a session (the first request). Answered by :class:`Welcome` with the segment's fd.

    Attributes
    ----------
    v : int
        The client's :data:`PROTOCOL_VERSION`.
    token : str
        Bearer token (empty when the service needs none).
    role : {"leader", "rank", "solo"}
        ``leader``: decides for a multi-process engine (group and join token it drew);
        ``rank``: one worker of a leader's group (copies its column only, sends no plan
        operations); ``solo``: a group of one (no group, no join token, world rank 0).
    pool : str or None
        Pool to attach to (None: the service's only pool).
    block_bytes, tokens_per_block : int or None
        The engine's block class; a pool without one is bound by the first leader or solo.
    group : bytes
        16 bytes (leader, rank) or empty (solo).
    join_token : bytes
        32 bytes (leader, rank) or empty (solo).
    world_rank : int
        The rank in its engine (0 for leader and solo).
    client : str
        Free text for logs and metrics (engine, version, pid).
    """

    v: Annotated[int, Meta(ge=0, le=0xFFFF)]
    token: Text
    role: Literal["leader", "rank", "solo"]
    pool: Name | None
    block_bytes: BlockBytes | None
    tokens_per_block: Annotated[int, Meta(ge=1, le=MAX_TOKENS_PER_BLOCK)] | None
    group: Annotated[bytes, Meta(max_length=16)]
    join_token: Annotated[bytes, Meta(max_length=32)]
    world_rank: Annotated[int, Meta(ge=0, le=MAX_WORLD_RANK)]
    client: Text

    def __post_init__(self) -> None:
        if self.role == "solo":
            if self.group or self.join_token or self.world_rank:
                raise _bad("a solo session has no group, join token or world rank")
        else:
            _length("group", self.group, 16)
            _length("join_token", self.join_token, 32)
            if self.role == "leader" and self.world_rank:
                raise _bad("a leader has world_rank 0")


class _KeysRequest(Request):
    ns: Ns
    keys: Keys

    def __post_init__(self) -> None:
        _multiple("keys", self.keys, KEY_BYTES)


class Lookup(_KeysRequest, tag=2):
    """Longest resident prefix of ``keys`` in namespace ``ns`` → :class:`LookupReply`.

    Attributes
    ----------
    ns : bytes
        32-byte namespace digest.
    keys : bytes
        ``n * 32`` bytes: the chained block keys, in order.
    hold : int or None
        Hold references on the matched blocks under this id (a request) until
        :class:`Release`, :class:`Cancel`, a load's completion or the session's end.
    pin_s : float or None
        Also pin the matched blocks for this many seconds.
    """

    hold: Id | None
    pin_s: Seconds | None


class Exists(_KeysRequest, tag=3):
    """How many leading ``keys`` of ``ns`` are resident (no recency change) → :class:`Count`.

    ``ns`` scopes the keys to the session's tenant, as the HTTP transport's ``exists`` does.
    """


class Release(Request, tag=4):
    """Drop the references held under ``hold`` → :class:`Count` (references dropped)."""

    hold: Id


class Cancel(Request, tag=5):
    """Drop the references held under ``hold`` and abandon its pending loads → :class:`Count`."""

    hold: Id


class PrepareStore(_KeysRequest, tag=6):
    """Plan a store of ``keys`` → :class:`TicketReply` (a slot per key to gather into).

    Attributes
    ----------
    first_position : int
        Block position of the first key in its sequence (eviction and lifetime hints).
    lifetime : int
        Lifetime code (:data:`LIFETIME_NAMES`; 0: the service classifies).
    wait : bool
        False: answer at once, ``ready=False`` when victims must be written first (the
        ticket's id arrives later in ``ready_ids``); True: answer when ready.
    """

    first_position: Id
    lifetime: Annotated[int, Meta(ge=0, le=len(LIFETIME_NAMES) - 1)]
    wait: bool


class CompleteStore(Request, tag=7):
    """Report a store ticket's copies → :class:`StoreOutcome`.

    Attributes
    ----------
    plan_id : int
        The ticket (of this session or its group).
    ok : bytes
        One byte per key of the ticket: 1 when every rank's shard is in the slot, else 0.
    """

    plan_id: Id
    ok: Codes

    def __post_init__(self) -> None:
        _codes("ok", self.ok, 2)


class PrepareLoad(_KeysRequest, tag=8):
    """Plan a load of ``keys`` (normally a lookup's useful prefix) → :class:`TicketReply`.

    Attributes
    ----------
    hold : int or None
        The lookup's hold (its references become the load's readers).
    wait : bool
        As for :class:`PrepareStore` (NVMe sources are staged before the ticket is ready).
    """

    hold: Id | None
    wait: bool


class CompleteLoad(Request, tag=9):
    """Report a load ticket's copies (``ok``: one byte per key, 1 = scattered) → :class:`Ack`."""

    plan_id: Id
    ok: Codes

    def __post_init__(self) -> None:
        _codes("ok", self.ok, 2)


class Abort(Request, tag=10):
    """Abandon a ticket before completing it (its slots are freed once no copy can run) →
    :class:`Ack`."""

    plan_id: Id


class Poll(Request, tag=11):
    """Nothing but the notices (``ready_ids``, ``ready_failed``) → :class:`Ack`."""


class Pin(_KeysRequest, tag=12):
    """Pin the resident leading ``keys`` of ``ns`` → :class:`LeaseReply`.

    Attributes
    ----------
    lease_s : float or None
        Lease length in seconds (None: the service's default); bounded by its ``max_lease_s``.
    """

    lease_s: Seconds | None


class Unpin(Request, tag=13):
    """End a lease → :class:`Count` (1 if it was live, else 0)."""

    lease_id: Id


class Invalidate(Request, tag=14):
    """Drop every block of namespace ``ns`` (32 bytes) → :class:`Count` (blocks dropped)."""

    ns: Ns


class Stats(Request, tag=15):
    """The pool's and session's statistics → :class:`StatsReply`: the whole store's for a
    session of the only tenant (or without tenancy), else the tenant's own usage and the pool's
    fixed geometry (no figure another tenant's activity moves)."""


class Reclaim(Request, tag=16):
    """Free the quarantined slots of an earlier session of this process → :class:`Ack`.

    Attributes
    ----------
    old_session : int
        The session id its :class:`Welcome` gave.
    proof : bytes
        At most 64 bytes the service gave that session.
    """

    old_session: Id
    proof: Annotated[bytes, Meta(max_length=64)]


class Prefetch(_KeysRequest, tag=18):
    """Bring the resident ``keys`` of ``ns`` up to a faster tier of the service's store in the
    background → :class:`Count` (blocks brought up, when it is done).

    Attributes
    ----------
    tier : str
        ``"host"`` or ``"hbm"`` (as :meth:`tierstore.api.KVStore.prefetch`); a tier the service's
        store does not have is refused (``BAD_REQUEST``).
    """

    tier: Annotated[str, Meta(max_length=8)] = "host"


class Bye(Request, tag=17):
    """The sender closes the connection after this (either direction); ``reason`` for logs."""

    reason: Text = ""


# -- replies ---------------------------------------------------------------------------------


class Welcome(_Notices, tag=64):
    """The answer to :class:`Hello`; the segment's memfd comes with this frame (``SCM_RIGHTS``).

    Attributes
    ----------
    session : int
        This session's id (for :class:`Reclaim` after a reconnect).
    pool : str
        The pool attached.
    block_bytes, slot_bytes : int
        Bytes of a logical block and the segment's slot stride.
    host_slots, staging_slots : int
        Slots of the segment (host tier first).
    segment_bytes : int
        Size of the memfd.
    boot_id : bytes
        16 bytes: the segment's (:class:`tierstore.node.segment.SegmentHeader`).
    op_timeout_s : float
        Seconds the client should wait for a reply (> 0).
    max_keys : int
        Keys per request this service takes (``<= MAX_KEYS``).
    """

    session: Id
    pool: Name
    block_bytes: BlockBytes
    slot_bytes: BlockBytes
    host_slots: Id
    staging_slots: Id
    segment_bytes: Id
    boot_id: Annotated[bytes, Meta(min_length=16, max_length=16)]
    op_timeout_s: Annotated[float, Meta(gt=0.0, le=MAX_SECONDS)]
    max_keys: Annotated[int, Meta(ge=1, le=MAX_KEYS)]


class LookupReply(_Notices, tag=65):
    """The answer to :class:`Lookup`.

    Attributes
    ----------
    matched : int
        Leading keys resident.
    useful : int
        Leading keys worth loading (``<= matched``).
    tiers : bytes
        ``matched`` tier codes (:data:`TIER_NAMES`).
    load_s : bytes
        ``matched`` estimated load seconds, ``<f4``.
    reason : str or None
        Why ``useful < matched`` (the cost model's explanation).
    """

    matched: Annotated[int, Meta(ge=0, le=MAX_KEYS)]
    useful: Annotated[int, Meta(ge=0, le=MAX_KEYS)]
    tiers: Codes
    load_s: Annotated[bytes, Meta(max_length=MAX_KEYS * 4)]
    reason: Text | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.useful > self.matched:
            raise _bad(f"useful={self.useful} > matched={self.matched}")
        _length("tiers", self.tiers, self.matched)
        _length("load_s", self.load_s, 4 * self.matched)
        _codes("tiers", self.tiers, len(TIER_NAMES))


class Count(_Notices, tag=66):
    """A number: blocks present, references or blocks dropped, leases ended."""

    n: Id


class TicketReply(_Notices, tag=67):
    """The answer to :class:`PrepareStore` and :class:`PrepareLoad`.

    Attributes
    ----------
    plan_id : int
        The ticket.
    statuses : bytes
        One status code per key asked (:data:`WIRE_STATUSES`): for a store ``OK`` (a slot to
        gather into), ``EXISTS``, ``NO_SPACE``, ``REJECTED``; for a load ``OK`` or ``MISS``.
    slots : bytes
        ``<i4`` per key: its segment slot, -1 where the status is not ``OK``.
    gens : bytes
        ``<u8`` per key: the slot's generation when handed out (0 without a slot).
    ready : bool
        Whether the slots are usable now; else the ``plan_id`` arrives in a later reply's
        ``ready_ids``.
    """

    plan_id: Id
    statuses: Codes
    slots: Annotated[bytes, Meta(max_length=MAX_KEYS * 4)]
    gens: Annotated[bytes, Meta(max_length=MAX_KEYS * 8)]
    ready: bool

    def __post_init__(self) -> None:
        super().__post_init__()
        n = len(self.statuses)
        _codes("statuses", self.statuses, len(WIRE_STATUSES))
        _length("slots", self.slots, 4 * n)
        _length("gens", self.gens, 8 * n)


class StoreOutcome(_Notices, tag=68):
    """The answer to :class:`CompleteStore`: per key a status code and whether it is on NVMe
    (``durable``: one byte per key, 1 = durable)."""

    statuses: Codes
    durable: Codes

    def __post_init__(self) -> None:
        super().__post_init__()
        _codes("statuses", self.statuses, len(WIRE_STATUSES))
        _codes("durable", self.durable, 2)
        _length("durable", self.durable, len(self.statuses))


class Ack(_Notices, tag=69):
    """Done (and the notices)."""


class LeaseReply(_Notices, tag=70):
    """The answer to :class:`Pin`.

    Attributes
    ----------
    lease_id : int
        For :class:`Unpin`.
    pinned : int
        Leading blocks pinned.
    lease_bytes : int
        Bytes the lease charges to the tenant's pin quota.
    expires_in_s : float
        Seconds until the lease ends by itself.
    """

    lease_id: Id
    pinned: Annotated[int, Meta(ge=0, le=MAX_KEYS)]
    lease_bytes: Id
    expires_in_s: Seconds


class StatsReply(_Notices, tag=71):
    """The answer to :class:`Stats`: a UTF-8 JSON object (``json``, at most 1 MiB)."""

    json: Annotated[bytes, Meta(max_length=MAX_STATS_BYTES)]


class Error(Reply, tag=72):
    """A request failed: ``code`` (:class:`ErrorCode`) and a message for people. ``rid`` is 0
    when the failing request's id is not known (a bad frame)."""

    code: ErrorCode
    message: Text


#: what a client may send, in tag order
REQUESTS = (
    Hello,
    Lookup,
    Exists,
    Release,
    Cancel,
    PrepareStore,
    CompleteStore,
    PrepareLoad,
    CompleteLoad,
    Abort,
    Poll,
    Pin,
    Unpin,
    Invalidate,
    Stats,
    Reclaim,
    Prefetch,
    Bye,
)
#: what the service may send
REPLIES = (Welcome, LookupReply, Count, TicketReply, StoreOutcome, Ack, LeaseReply, StatsReply, Error, Bye)
ClientMessage = Union[REQUESTS]  # type: ignore[valid-type]  # noqa: UP007 (a tuple built above)
ServerMessage = Union[REPLIES]  # type: ignore[valid-type]  # noqa: UP007 (a tuple built above)
#: decoders of each side (thread-safe, shareable)
REQUEST_DECODER = msgspec.msgpack.Decoder(ClientMessage)
REPLY_DECODER = msgspec.msgpack.Decoder(ServerMessage)


# -- per-key fields --------------------------------------------------------------------------


def pack_keys(keys: Sequence[bytes] | np.ndarray) -> bytes:
    """Keys as one field: 32-byte keys (a sequence, or a ``(n, 32)`` ``uint8`` array) concatenated.

    Raises
    ------
    ProtocolError
        ``BAD_REQUEST`` for a key that is not 32 bytes.
    """
    if isinstance(keys, np.ndarray):
        if keys.dtype != np.uint8 or keys.ndim != 2 or keys.shape[1] != KEY_BYTES:
            raise _bad(f"keys array must be (n, {KEY_BYTES}) uint8, got {keys.shape} {keys.dtype}")
        return keys.tobytes()
    for i, k in enumerate(keys):
        if len(k) != KEY_BYTES:
            raise _bad(f"key {i} is {len(k)} bytes, expected {KEY_BYTES}")
    return b"".join(bytes(k) for k in keys)


def keys_view(raw: bytes) -> np.ndarray:
    """A keys field as a read-only ``(n, 32)`` ``uint8`` array (no copy).

    Raises
    ------
    ProtocolError
        ``BAD_REQUEST`` when the length is not a multiple of 32.
    """
    n = _multiple("keys", raw, KEY_BYTES)
    return np.frombuffer(raw, dtype=np.uint8).reshape(n, KEY_BYTES)


def unpack_keys(raw: bytes) -> list[bytes]:
    """A keys field as a list of 32-byte keys.

    Raises
    ------
    ProtocolError
        ``BAD_REQUEST`` when the length is not a multiple of 32.
    """
    n = _multiple("keys", raw, KEY_BYTES)
    return list(_keys_struct(n).unpack(raw)) if n else []


@functools.lru_cache(maxsize=256)
def _keys_struct(n: int) -> struct.Struct:
    """``n`` 32-byte strings: splits a keys field in C (a seventh of a slicing loop's time)."""
    return struct.Struct(f"{KEY_BYTES}s" * n)


def pack_statuses(statuses: Sequence[Status]) -> bytes:
    """Statuses as ``u8`` codes (:data:`WIRE_STATUSES`)."""
    return bytes(map(WIRE_STATUSES.index, statuses))  # an Enum's hash is Python code; == is identity


def unpack_statuses(raw: bytes) -> list[Status]:
    """``u8`` status codes as :class:`~tierstore.errors.Status` values.

    Raises
    ------
    ProtocolError
        ``BAD_REQUEST`` for a code outside :data:`WIRE_STATUSES`.
    """
    _codes("statuses", raw, len(WIRE_STATUSES))
    return [WIRE_STATUSES[c] for c in raw]


def pack_flags(flags: Sequence[bool] | np.ndarray) -> bytes:
    """Booleans (``ok``, ``durable``) as one byte each, 0 or 1."""
    return np.asarray(flags, dtype=bool).astype(np.uint8).tobytes()


def unpack_flags(raw: bytes) -> np.ndarray:
    """One-byte flags as a ``bool`` array.

    Raises
    ------
    ProtocolError
        ``BAD_REQUEST`` for a byte other than 0 or 1.
    """
    _codes("flags", raw, 2)
    return np.frombuffer(raw, dtype=np.uint8).astype(bool)


def pack_slots(slots: Sequence[int] | np.ndarray) -> bytes:
    """Segment slots as ``<i4``."""
    return np.asarray(slots, dtype="<i4").tobytes()


def unpack_slots(raw: bytes) -> np.ndarray:
    """``<i4`` slots as a read-only ``int32`` array."""
    _multiple("slots", raw, 4)
    return np.frombuffer(raw, dtype="<i4")


def pack_u64(values: Sequence[int] | np.ndarray) -> bytes:
    """Gens or plan ids as ``<u8``."""
    return np.asarray(values, dtype="<u8").tobytes()


def unpack_u64(raw: bytes) -> np.ndarray:
    """``<u8`` gens or plan ids as a read-only ``uint64`` array."""
    _multiple("u64 field", raw, 8)
    return np.frombuffer(raw, dtype="<u8")


def pack_load_s(seconds: Sequence[float] | np.ndarray) -> bytes:
    """Estimated load seconds as ``<f4``."""
    return np.asarray(seconds, dtype="<f4").tobytes()


def unpack_load_s(raw: bytes) -> np.ndarray:
    """``<f4`` load seconds as a read-only ``float32`` array."""
    _multiple("load_s", raw, 4)
    return np.frombuffer(raw, dtype="<f4")


def pack_failed(pairs: Sequence[tuple[int, int]] | np.ndarray) -> bytes:
    """``ready_failed``: ``(index into ready_ids, key index)`` pairs as ``<u4`` each."""
    return np.asarray(pairs, dtype="<u4").reshape(-1, 2).tobytes()


def unpack_failed(raw: bytes) -> np.ndarray:
    """``ready_failed`` as a read-only ``(n, 2)`` ``uint32`` array."""
    n = _multiple("ready_failed", raw, 8)
    return np.frombuffer(raw, dtype="<u4").reshape(n, 2)


def status_code(status: Status) -> int:
    """The wire code of ``status``."""
    return _STATUS_CODE[status]


# -- frames on a socket ----------------------------------------------------------------------

#: ``struct timeval`` (``time_t`` seconds, ``suseconds_t`` microseconds: two C longs on Linux)
_TIMEVAL = struct.Struct("@ll")


def decode_body(decoder, body: bytes | memoryview) -> Message:
    """Decode one frame's body against a side's schema (:data:`REQUEST_DECODER` or
    :data:`REPLY_DECODER`). Bytes fields are copied out: ``body`` may be reused afterwards.

    Raises
    ------
    ProtocolError
        ``BAD_FRAME`` for a body that is not exactly one message of the schema (malformed
        msgpack, wrong tag, type, bound or length, unknown field, trailing bytes).
    """
    try:
        return decoder.decode(body)
    except msgspec.DecodeError as e:  # ValidationError included
        raise ProtocolError(ErrorCode.BAD_FRAME, f"{len(body)}-byte frame: {e}") from e


class FrameSocket:
    """One end of a node connection: whole messages out, whole messages in.

    Sending encodes into a reused buffer and writes one frame with one ``send`` call; receiving
    reads whatever has arrived into a reused buffer (usually a whole frame, header and body, in
    one ``recv``), refuses a frame over ``max_frame_bytes`` before allocating for it (the buffer
    grows up to ``4 + max_frame_bytes``, never beyond), decodes it against this side's schema
    and keeps any bytes of the next frame for the next call. Not thread-safe: one thread sends
    and one receives at a time (the caller serialises senders). A timeout raised before any
    byte of a frame arrived leaves the connection usable; any other failure marks it ``broken``.

    Parameters
    ----------
    sock : socket.socket
        A connected ``AF_UNIX`` stream socket (blocking, or with the caller's timeout; or bounded
        by :meth:`set_timeout`).
    decoder : msgspec.msgpack.Decoder
        :data:`REQUEST_DECODER` on the service side, :data:`REPLY_DECODER` on the client side.
    max_frame_bytes : int
        Largest body accepted and sent, in ``[64, MAX_FRAME_LIMIT_BYTES]``.

    Raises
    ------
    ProtocolError
        ``LIMIT`` for a ``max_frame_bytes`` out of range.
    """

    def __init__(
        self, sock: socket.socket, decoder, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    ) -> None:
        if not 64 <= max_frame_bytes <= MAX_FRAME_LIMIT_BYTES:
            raise ProtocolError(
                ErrorCode.LIMIT,
                f"max_frame_bytes={max_frame_bytes}: must be in [64, {MAX_FRAME_LIMIT_BYTES}]",
            )
        self.sock = sock
        self.max_frame_bytes = int(max_frame_bytes)
        self.broken = False
        #: a write failed (maybe inside a frame): nothing more may be written
        self._out_broken = False
        self._dec = decoder
        self._enc = msgspec.msgpack.Encoder()
        self._out = bytearray(FRAME_HEADER.size)
        self._buf = bytearray(min(64 << 10, FRAME_HEADER.size + self.max_frame_bytes))
        self._start = 0  # the bytes received and not decoded yet: _buf[_start:_end]
        self._end = 0
        self._timeout_s: float | None = None

    def set_timeout(self, timeout_s: float) -> None:
        """Bound every later ``send`` and ``recv`` call on the socket at ``timeout_s`` seconds
        (> 0) by the kernel (``SO_RCVTIMEO``/``SO_SNDTIMEO``, socket(7), on a blocking socket):
        one system call per transfer and no ``poll`` before it, as a Python-level socket timeout
        makes. A timed-out call raises :class:`TimeoutError`, as a Python-level timeout does.
        The bound is per call: a peer that keeps a frame moving is not cut off."""
        if timeout_s == self._timeout_s:
            return
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}: must be > 0 (0 would mean no bound)")
        us = max(1, round(timeout_s * 1e6))
        tv = _TIMEVAL.pack(us // 1_000_000, us % 1_000_000)
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        self._timeout_s = timeout_s

    # sending

    def send(self, msg: Message, fds: Sequence[int] = ()) -> None:
        """Send one message as one frame; ``fds`` ride along (``SCM_RIGHTS``, the receiver uses
        :meth:`recv_with_fds`). The caller keeps its fds (the kernel duplicates them).

        Raises
        ------
        ProtocolError
            ``LIMIT`` when the body would exceed ``max_frame_bytes`` (nothing is sent);
            ``CLOSED`` on a broken connection.
        OSError
            From the socket (peer gone, ``TimeoutError``); the connection is then ``broken``.
        """
        if self.broken:
            raise ProtocolError(ErrorCode.CLOSED, "the connection broke earlier")
        out = self._out
        self._enc.encode_into(msg, out, FRAME_HEADER.size)
        n = len(out) - FRAME_HEADER.size
        if n > self.max_frame_bytes:
            del out[FRAME_HEADER.size :]
            raise ProtocolError(
                ErrorCode.LIMIT,
                f"{type(msg).__name__} of {n} bytes exceeds max_frame_bytes={self.max_frame_bytes}",
            )
        FRAME_HEADER.pack_into(out, 0, n)
        view = memoryview(out)
        try:
            sent = socket.send_fds(self.sock, [view], list(fds)) if fds else 0
            self.sock.sendall(view[sent:])
        except BlockingIOError:  # SO_SNDTIMEO ran out
            self.broken = self._out_broken = True
            raise TimeoutError("send timed out") from None
        except OSError:
            self.broken = self._out_broken = True
            raise
        finally:
            view.release()

    # receiving

    def recv(self) -> Message | None:
        """The next message, or None when the peer closed between frames.

        Raises
        ------
        ProtocolError
            ``BAD_FRAME`` for a length of 0 or over ``max_frame_bytes``, a connection closed
            inside a frame, or a body that does not decode (wrong tag, type, bound, length,
            unknown field, trailing bytes); ``CLOSED`` on a broken connection.
        OSError
            From the socket (``TimeoutError`` for a socket timeout).
        """
        msg, _ = self._recv(0)
        return msg

    def recv_with_fds(self, max_fds: int = 1) -> tuple[Message | None, list[int]]:
        """:meth:`recv` for a frame that carries fds (the ``Welcome``): the message and the fds
        received with it (the caller owns and closes them; none after a failure).

        Raises
        ------
        ProtocolError
            As :meth:`recv`, and ``BAD_FRAME`` when more than ``max_fds`` fds came (all closed).
        """
        return self._recv(max_fds)

    def _recv(self, max_fds: int) -> tuple[Message | None, list[int]]:
        if self.broken:
            raise ProtocolError(ErrorCode.CLOSED, "the connection broke earlier")
        fds: list[int] = []
        try:
            if max_fds and self._end == self._start:  # the fds come with the frame's first bytes
                data, fds, flags, _ = socket.recv_fds(self.sock, FRAME_HEADER.size, max_fds)
                if flags & socket.MSG_CTRUNC:
                    raise ProtocolError(ErrorCode.BAD_FRAME, f"more than {max_fds} fds with one frame")
                if not data:
                    return None, fds
                self._buf[: len(data)] = data
                self._start, self._end = 0, len(data)
            if not self._fill(FRAME_HEADER.size, "frame header"):
                return None, fds
            (n,) = FRAME_HEADER.unpack_from(self._buf, self._start)
            if not 0 < n <= self.max_frame_bytes:
                raise ProtocolError(
                    ErrorCode.BAD_FRAME, f"frame of {n} bytes: allowed 1 to {self.max_frame_bytes}"
                )
            self._fill(FRAME_HEADER.size + n, f"{n}-byte frame")
            a = self._start + FRAME_HEADER.size
            msg = decode_body(self._dec, memoryview(self._buf)[a : a + n])
            self._start = a + n
            if self._start == self._end:
                self._start = self._end = 0
            return msg, fds
        except (TimeoutError, BlockingIOError):  # BlockingIOError: SO_RCVTIMEO ran out
            if self._end > self._start:
                self.broken = True
            for fd in fds:
                os.close(fd)
            raise TimeoutError("receive timed out") from None
        except ConnectionResetError:
            # the peer closed with our frames unread (AF_UNIX resets then): at a frame
            # boundary that is the end of the connection, as EOF is
            self.broken = True
            for fd in fds:
                os.close(fd)
            if self._end == self._start:
                return None, []
            raise ProtocolError(ErrorCode.CLOSED, "the peer reset the connection inside a frame") from None
        except BaseException:
            self.broken = True
            for fd in fds:
                os.close(fd)
            raise

    def _fill(self, need: int, what: str) -> bool:
        """Receive until ``need`` bytes are buffered; ``False`` for EOF with nothing buffered.
        The buffer is replaced, never resized (a decoded view of it may still be alive)."""
        while self._end - self._start < need:
            if len(self._buf) - self._start < need:
                have = self._end - self._start
                buf = bytearray(max(len(self._buf), need))
                buf[:have] = self._buf[self._start : self._end]
                self._buf, self._start, self._end = buf, 0, have
            k = self.sock.recv_into(memoryview(self._buf)[self._end :])
            if k == 0:
                got = self._end - self._start
                if got == 0:
                    return False
                raise ProtocolError(
                    ErrorCode.BAD_FRAME, f"connection closed after {got} of {need} bytes of a {what}"
                )
            self._end += k
        return True

    # ending

    def fail(self, exc: ProtocolError, rid: int = 0) -> None:
        """Answer ``exc`` with one :class:`Error` and close: what a receiver does on
        ``BAD_FRAME``. A peer that is gone already does not get it (the close still happens)."""
        try:
            if not self._out_broken:  # a bad frame breaks reading; the stream out is whole
                self.broken = False
                self.send(exc.error(rid))
        except (OSError, ProtocolError):  # the peer left first; it learns from the close
            self.broken = True
        finally:
            self.close()

    def close(self) -> None:
        """Shut the socket down both ways and close it (idempotent)."""
        self.broken = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # not connected any more
            self.broken = True
        self.sock.close()
