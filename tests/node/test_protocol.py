"""The node protocol: every message round-trips through real frames on a UNIX socket; the schema
is closed and bounded (wrong tags, types, bounds, lengths and extra fields are bad frames); frame
limits hold on both sides; a bad frame is answered with one Error("bad_frame") and a close; fds
travel with a frame; the wire codes are pinned to the library's enums."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import msgspec
import numpy as np
import pytest

from tierstore.errors import Status, TierStoreError
from tierstore.node import protocol as P
from tierstore.node.protocol import ErrorCode, ProtocolError

NS = bytes(range(32))
K3 = P.pack_keys([bytes([i]) * 32 for i in range(3)])
GROUP, JOIN = b"g" * 16, b"j" * 32
enc = msgspec.msgpack.Encoder()

EXAMPLES = {
    P.Hello: [
        P.Hello(1, 1, "tok", "leader", "llama8b", 2 << 20, 16, GROUP, JOIN, 0, "vllm 0.32 pid 7"),
        P.Hello(2, 1, "", "rank", None, None, None, GROUP, JOIN, 3, ""),
        P.Hello(3, 1, "", "solo", None, 4096, 16, b"", b"", 0, "sglang"),
    ],
    P.Lookup: [P.Lookup(4, NS, K3, 11, None), P.Lookup(5, NS, b"", None, 30.0)],
    P.Exists: [P.Exists(6, NS, K3)],
    P.Release: [P.Release(7, 11)],
    P.Cancel: [P.Cancel(8, 11)],
    P.PrepareStore: [P.PrepareStore(9, NS, K3, 128, 3, False), P.PrepareStore(10, NS, K3, 0, 0, True)],
    P.CompleteStore: [P.CompleteStore(11, 42, P.pack_flags([True, False, True]))],
    P.PrepareLoad: [P.PrepareLoad(12, NS, K3, 11, True), P.PrepareLoad(13, NS, K3, None, False)],
    P.CompleteLoad: [P.CompleteLoad(14, 43, P.pack_flags([1, 1, 1]))],
    P.Abort: [P.Abort(15, 44)],
    P.Poll: [P.Poll(16)],
    P.Pin: [P.Pin(17, NS, K3, 60.0), P.Pin(18, NS, K3, None)],
    P.Unpin: [P.Unpin(19, 5)],
    P.Invalidate: [P.Invalidate(20, NS)],
    P.Stats: [P.Stats(21)],
    P.Reclaim: [P.Reclaim(22, 9, b"p" * 32)],
    P.Prefetch: [P.Prefetch(24, NS, K3, "host"), P.Prefetch(25, NS, K3)],
    P.Bye: [P.Bye(23, "shutting down"), P.Bye(0)],
    P.Welcome: [
        P.Welcome(
            1,
            session=9,
            pool="llama8b",
            block_bytes=5000,
            slot_bytes=8192,
            host_slots=1024,
            staging_slots=64,
            segment_bytes=(2 << 20) + 1088 * 8192,
            boot_id=b"b" * 16,
            op_timeout_s=2.0,
            max_keys=4096,
        )
    ],
    P.LookupReply: [
        P.LookupReply(
            4,
            3,
            2,
            bytes([1, 1, 2]),
            P.pack_load_s([1e-4, 1e-4, 3e-3]),
            "load slower than recompute",
            ready_ids=P.pack_u64([42, 43]),
            ready_failed=P.pack_failed([(1, 0), (1, 2)]),
        ),
        P.LookupReply(5, 0, 0, b"", b""),
    ],
    P.Count: [P.Count(6, 3), P.Count(7, 0, ready_ids=P.pack_u64([1]))],
    P.TicketReply: [
        P.TicketReply(
            9,
            42,
            P.pack_statuses([Status.OK, Status.EXISTS, Status.NO_SPACE]),
            P.pack_slots([5, -1, -1]),
            P.pack_u64([3, 0, 0]),
            False,
        )
    ],
    P.StoreOutcome: [P.StoreOutcome(11, P.pack_statuses([Status.OK, Status.IO_ERROR]), P.pack_flags([1, 0]))],
    P.Ack: [P.Ack(14), P.Ack(16, ready_ids=P.pack_u64([44]), ready_failed=P.pack_failed([(0, 7)]))],
    P.LeaseReply: [P.LeaseReply(17, 5, 3, 3 * 5000, 59.5)],
    P.StatsReply: [P.StatsReply(21, b'{"blocks": 3}')],
    P.Error: [P.Error(9, ErrorCode.QUOTA, "tenant acme: 800 GiB quota"), P.Error(0, ErrorCode.BAD_FRAME, "")],
}


def _pair(**kw):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return P.FrameSocket(a, P.REPLY_DECODER, **kw), P.FrameSocket(b, P.REQUEST_DECODER, **kw)


@pytest.fixture
def pair():
    client, service = _pair()
    yield client, service
    client.close()
    service.close()


def test_every_message_has_an_example_and_tags_are_unique():
    assert set(EXAMPLES) == set(P.REQUESTS) | set(P.REPLIES)
    tags = [cls.__struct_config__.tag for cls in set(P.REQUESTS) | set(P.REPLIES)]
    assert len(tags) == len(set(tags))
    assert all(isinstance(m, cls) for cls, ms in EXAMPLES.items() for m in ms)


@pytest.mark.parametrize("msg", [m for ms in EXAMPLES.values() for m in ms], ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_a_frame(pair, msg):
    client, service = pair
    if isinstance(msg, P.Request):
        client.send(msg)
        got = service.recv()
    if isinstance(msg, (P.Reply, P.Bye)):
        service.send(msg)
        got = client.recv()
    assert got == msg and type(got) is type(msg)


def test_a_message_of_the_other_direction_is_a_bad_frame(pair):
    client, service = pair
    service.send(P.Count(1, 2))  # fine service -> client ...
    assert client.recv() == P.Count(1, 2)
    client.sock.sendall(_frame(enc.encode(P.Count(1, 2))))  # ... but a client never sends a reply
    with pytest.raises(ProtocolError) as e:
        service.recv()
    assert e.value.code is ErrorCode.BAD_FRAME and "Invalid value 66" in str(e.value)


def _frame(body: bytes) -> bytes:
    return P.FRAME_HEADER.pack(len(body)) + body


def _lookup(**over):
    fields = dict(rid=1, ns=NS, keys=K3, hold=None, pin_s=None)
    fields.update(over)
    return [2, *fields.values()]


BAD_BODIES = {
    "extra field": enc.encode(_lookup() + [1]),
    "missing field": enc.encode(_lookup()[:-1]),
    "unknown tag": enc.encode([99, 1]),
    "tag of a string": enc.encode(["Lookup", 1, NS, K3, None, None]),
    "map not array": enc.encode({"rid": 1}),
    "negative rid": enc.encode(_lookup(rid=-1)),
    "rid past int64": enc.encode(_lookup(rid=2**64 - 1)),
    "bool for int": enc.encode(_lookup(rid=True)),
    "float for int": enc.encode(_lookup(hold=1.0)),
    "str for bytes": enc.encode(_lookup(keys="k" * 32)),
    "keys not a multiple of 32": enc.encode(_lookup(keys=b"k" * 33)),
    "too many keys": enc.encode(_lookup(keys=b"k" * 32 * (P.MAX_KEYS + 1))),
    "short namespace": enc.encode(_lookup(ns=NS[:31])),
    "nan seconds": enc.encode(_lookup(pin_s=float("nan"))),
    "inf seconds": enc.encode(_lookup(pin_s=float("inf"))),
    "negative seconds": enc.encode(_lookup(pin_s=-1.0)),
    "trailing bytes": enc.encode(P.Poll(1)) + b"\x00",
    "ext type": enc.encode(msgspec.msgpack.Ext(1, b"x")),
    "reserved opcode": b"\xc1",
    "truncated msgpack": enc.encode(_lookup())[:-3],
    "lifetime code past long": enc.encode([6, 1, NS, K3, 0, 4, False]),
    "ok flag of 2": enc.encode([7, 1, 42, b"\x01\x02"]),
    "solo with a group": enc.encode([1, 1, 1, "", "solo", None, None, None, GROUP, b"", 0, ""]),
    "leader without join token": enc.encode([1, 1, 1, "", "leader", None, None, None, GROUP, b"", 0, ""]),
    "leader of rank 2": enc.encode([1, 1, 1, "", "leader", None, None, None, GROUP, JOIN, 2, ""]),
    "role unknown": enc.encode([1, 1, 1, "", "admin", None, None, None, b"", b"", 0, ""]),
    "block bytes past a slot": enc.encode([1, 1, 1, "", "solo", None, 1 << 32, None, b"", b"", 0, ""]),
}
BAD_REPLY_BODIES = {
    "useful past matched": enc.encode([65, 1, 1, 2, b"\x01", b"\x00" * 4, None]),
    "tiers of the wrong length": enc.encode([65, 1, 2, 1, b"\x01", b"\x00" * 8, None]),
    "tier code 4": enc.encode([65, 1, 1, 1, b"\x04", b"\x00" * 4, None]),
    "status code 6": enc.encode([67, 1, 2, b"\x06", b"\x00" * 4, b"\x00" * 8, True]),
    "slots of the wrong length": enc.encode([67, 1, 2, b"\x00", b"\x00" * 8, b"\x00" * 8, True]),
    "durable not parallel": enc.encode([68, 1, b"\x00\x00", b"\x01"]),
    "failed index past ready": enc.encode([69, 1, P.pack_u64([7]), P.pack_failed([(1, 0)])]),
    "failed without ready": enc.encode([69, 1, b"", P.pack_failed([(0, 0)])]),
    "ready ids not u64": enc.encode([69, 1, b"\x00" * 7, b""]),
    "unknown error code": enc.encode([72, 1, "teapot", ""]),
    "zero timeout": enc.encode([64, 1, 1, "p", 1, 4096, 1, 0, 4096, b"b" * 16, 0.0, 1]),
    "max keys past the schema": enc.encode(
        [64, 1, 1, "p", 1, 4096, 1, 0, 4096, b"b" * 16, 1.0, P.MAX_KEYS + 1]
    ),
}


@pytest.mark.parametrize("why", sorted(BAD_BODIES))
def test_a_request_outside_the_schema_is_a_bad_frame(pair, why):
    client, service = pair
    # from a thread: a frame larger than the socket buffer ("too many keys") blocks sendall
    # until the service reads it
    sender = threading.Thread(target=client.sock.sendall, args=(_frame(BAD_BODIES[why]),), daemon=True)
    sender.start()
    with pytest.raises(ProtocolError) as e:
        service.recv()
    sender.join(10)
    assert not sender.is_alive()
    assert e.value.code is ErrorCode.BAD_FRAME
    assert service.broken


@pytest.mark.parametrize("why", sorted(BAD_REPLY_BODIES))
def test_a_reply_outside_the_schema_is_a_bad_frame(why):
    with pytest.raises(ProtocolError) as e:
        P.decode_body(P.REPLY_DECODER, BAD_REPLY_BODIES[why])
    assert e.value.code is ErrorCode.BAD_FRAME


def test_cross_field_rules_hold_when_building_messages_too():
    """The checks that decoding applies also refuse a bad message built locally (typed errors)."""
    with pytest.raises(ProtocolError, match="multiple of 32"):
        P.Exists(1, NS, b"k" * 31)
    with pytest.raises(ProtocolError, match="slots"):
        P.TicketReply(1, 2, b"\x00", b"", b"\x00" * 8, True)
    with pytest.raises(ProtocolError, match="solo"):
        P.Hello(1, 1, "", "solo", None, None, None, GROUP, b"", 0, "")
    with pytest.raises(ProtocolError, match="ok"):
        P.CompleteStore(1, 2, b"\x03")
    assert issubclass(ProtocolError, TierStoreError)


def test_a_bad_frame_is_answered_with_one_error_and_a_close(pair):
    client, service = pair
    client.send(P.Poll(1))
    client.sock.sendall(_frame(b"\xc1"))
    client.send(P.Poll(2))  # after the bad frame: never read
    assert service.recv() == P.Poll(1)
    with pytest.raises(ProtocolError) as e:
        service.recv()
    service.fail(e.value)
    err = client.recv()
    assert err == P.Error(0, ErrorCode.BAD_FRAME, e.value.detail) and "invalid opcode" in err.message
    assert client.recv() is None  # then the service closed
    with pytest.raises(ProtocolError) as e2:
        service.recv()
    assert e2.value.code is ErrorCode.CLOSED


@pytest.mark.parametrize("length", [0, 65, 1 << 31, (1 << 32) - 1])
def test_a_frame_length_outside_the_limit_is_refused_before_reading_it(length):
    client, service = _pair(max_frame_bytes=64)
    try:
        client.sock.sendall(P.FRAME_HEADER.pack(length) + b"\x90" * 8)
        with pytest.raises(ProtocolError, match=f"frame of {length} bytes") as e:
            service.recv()
        assert e.value.code is ErrorCode.BAD_FRAME
        assert len(service._buf) <= P.FRAME_HEADER.size + 64  # nothing was allocated for it
    finally:
        client.close()
        service.close()


@pytest.mark.parametrize("cut", [1, 3, 4, 10])
def test_a_connection_closed_inside_a_frame_is_a_bad_frame(cut):
    client, service = _pair()
    try:
        frame = _frame(enc.encode(EXAMPLES[P.Lookup][0]))
        client.sock.sendall(frame[:cut])
        client.sock.shutdown(socket.SHUT_WR)
        with pytest.raises(ProtocolError, match="connection closed after") as e:
            service.recv()
        assert e.value.code is ErrorCode.BAD_FRAME
    finally:
        client.close()
        service.close()


def test_a_closed_connection_between_frames_is_none(pair):
    client, service = pair
    client.send(P.Poll(1))
    client.sock.shutdown(socket.SHUT_WR)
    assert service.recv() == P.Poll(1)
    assert service.recv() is None


def test_a_message_over_the_limit_is_not_sent():
    client, service = _pair(max_frame_bytes=4096)
    try:
        with pytest.raises(ProtocolError, match="exceeds max_frame_bytes=4096") as e:
            client.send(P.Exists(1, NS, b"k" * 32 * 200))
        assert e.value.code is ErrorCode.LIMIT and not client.broken
        client.send(P.Poll(2))  # the connection is still fine
        assert service.recv() == P.Poll(2)
    finally:
        client.close()
        service.close()
    with pytest.raises(ProtocolError, match="max_frame_bytes"):
        P.FrameSocket(
            socket.socket(socket.AF_UNIX), P.REQUEST_DECODER, max_frame_bytes=P.MAX_FRAME_LIMIT_BYTES + 1
        )


def test_the_largest_request_fits_the_default_frame(pair):
    client, service = pair
    big = P.PrepareStore(1, NS, os.urandom(32 * P.MAX_KEYS), 0, 0, True)
    reply = P.TicketReply(
        1,
        2,
        bytes(P.MAX_KEYS),
        bytes(4 * P.MAX_KEYS),
        bytes(8 * P.MAX_KEYS),
        True,
        ready_ids=bytes(8 * P.MAX_READY),
    )
    # each send from a thread: a frame larger than the socket buffer waits for its reader
    for sender, receiver, msg in ((client, service, big), (service, client, reply)):
        t = threading.Thread(target=sender.send, args=(msg,), daemon=True)
        t.start()
        assert receiver.recv() == msg
        t.join(10)
        assert not t.is_alive()


@pytest.mark.parametrize("bound", ["python", "kernel"])
def test_a_timeout_before_a_frame_keeps_the_connection_and_inside_one_breaks_it(pair, bound):
    client, service = pair
    if bound == "python":
        service.sock.settimeout(0.05)
    else:  # SO_RCVTIMEO on a blocking socket: EAGAIN, raised as TimeoutError all the same
        service.set_timeout(0.05)
        assert service.sock.gettimeout() is None
    with pytest.raises(TimeoutError):
        service.recv()
    assert not service.broken
    client.send(P.Poll(3))
    assert service.recv() == P.Poll(3)
    client.sock.sendall(_frame(enc.encode(P.Poll(4)))[:6])
    with pytest.raises(TimeoutError):
        service.recv()
    assert service.broken
    with pytest.raises(ProtocolError, match="broke earlier"):
        service.recv()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_an_fd_travels_with_a_frame_and_extra_fds_are_refused_and_closed(pair, tmp_path):
    client, service = pair
    path = tmp_path / "f"
    path.write_bytes(b"x")
    fd = os.open(path, os.O_RDONLY)
    try:
        welcome = EXAMPLES[P.Welcome][0]
        service.send(welcome, fds=[fd])
        got, fds = client.recv_with_fds(1)
        assert got == welcome and len(fds) == 1 and fds[0] != fd
        assert os.fstat(fds[0]).st_ino == os.fstat(fd).st_ino
        os.close(fds[0])
        before = _open_fds()
        service.send(P.Ack(1), fds=[fd, fd])
        with pytest.raises(ProtocolError, match="more than 1 fds") as e:
            client.recv_with_fds(1)
        assert e.value.code is ErrorCode.BAD_FRAME
        assert _open_fds() == before  # the one fd that did arrive was closed
    finally:
        os.close(fd)


def test_per_key_helpers_round_trip_and_refuse_bad_input():
    keys = [os.urandom(32) for _ in range(5)]
    raw = P.pack_keys(keys)
    assert P.unpack_keys(raw) == keys
    arr = P.keys_view(raw)
    assert arr.shape == (5, 32) and not arr.flags.writeable and P.pack_keys(arr) == raw
    with pytest.raises(ProtocolError, match="key 1 is 31 bytes"):
        P.pack_keys([keys[0], keys[1][:31]])
    with pytest.raises(ProtocolError, match=r"\(n, 32\) uint8"):
        P.pack_keys(np.zeros((2, 16), dtype=np.uint8))
    with pytest.raises(ProtocolError):
        P.keys_view(raw[:-1])
    statuses = list(Status)
    assert P.unpack_statuses(P.pack_statuses(statuses)) == statuses
    with pytest.raises(ProtocolError):
        P.unpack_statuses(b"\x06")
    assert P.unpack_slots(P.pack_slots([0, -1, 2**31 - 1])).tolist() == [0, -1, 2**31 - 1]
    assert P.unpack_u64(P.pack_u64([0, 2**64 - 1])).tolist() == [0, 2**64 - 1]
    assert P.unpack_load_s(P.pack_load_s([0.5, 1e-6])).tolist() == pytest.approx([0.5, 1e-6])
    assert P.unpack_flags(P.pack_flags([True, False])).tolist() == [True, False]
    with pytest.raises(ProtocolError):
        P.unpack_flags(b"\x02")
    assert P.unpack_failed(P.pack_failed([(0, 5), (2, 1)])).tolist() == [[0, 5], [2, 1]]


def test_wire_codes_are_pinned_to_the_library_enums():
    """Statuses, tiers and lifetime classes travel as small integers: the tables here must stay
    in step with the enums (the protocol itself imports nothing of the index)."""
    from tierstore.fdp.lifetime import LifetimeClass
    from tierstore.index import Tier

    assert set(P.WIRE_STATUSES) == set(Status) and len(P.WIRE_STATUSES) == len(Status)
    assert [P.status_code(s) for s in P.WIRE_STATUSES] == list(range(len(Status)))
    assert P.WIRE_STATUSES[:3] == (Status.OK, Status.EXISTS, Status.MISS)  # never reordered
    assert list(P.TIER_NAMES) == [t.label for t in sorted(Tier)] and [int(t) for t in Tier] == [0, 1, 2, 3]
    assert list(P.LIFETIME_NAMES[1:]) == [c.name.lower() for c in sorted(LifetimeClass)]
    assert [int(c) + 1 for c in sorted(LifetimeClass)] == [1, 2, 3]


def test_without_msgspec_the_protocol_names_the_extra():
    script = (
        "import sys; sys.modules['msgspec'] = None\n"
        "from tierstore.errors import ConfigError\n"
        "try:\n    import tierstore.node.protocol\nexcept ConfigError as e:\n    print(e)\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert "pip install 'tierstore[node]'" in p.stdout
    # and the segment half needs no msgspec at all
    script = "import sys; sys.modules['msgspec'] = None\nimport tierstore.node.segment\nprint('ok')\n"
    p = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-2000:]


def test_frames_that_arrive_together_are_decoded_one_by_one_in_order(pair):
    """One recv may take more than a frame: the rest is kept for the next call, also a frame cut
    in the middle of its header."""
    client, service = pair
    service.set_timeout(5.0)
    msgs = [P.Poll(1), P.Lookup(2, NS, K3, None, None), P.Stats(3), P.Poll(4)]
    stream = b"".join(_frame(enc.encode(m)) for m in msgs)
    client.sock.sendall(stream[: len(stream) - 6])  # the last frame: 2 of its 4 header bytes
    assert [service.recv() for _ in range(3)] == msgs[:3]
    threading.Timer(0.1, client.sock.sendall, (stream[len(stream) - 6 :],)).start()
    assert service.recv() == msgs[3] and not service.broken


def test_a_kernel_bounded_send_to_a_peer_that_reads_nothing_times_out_and_breaks(pair):
    client, service = pair
    client.set_timeout(0.05)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        for i in range(100_000):  # fills both socket buffers
            client.send(P.Lookup(i, NS, K3 * 40, None, None))
    assert time.monotonic() - t0 < 5.0 and client.broken
