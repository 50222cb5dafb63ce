"""Remote object header, checks and names (tierstore.remote.format)."""

from __future__ import annotations

import hashlib
import hmac
import struct

import numpy as np
import pytest

from tierstore.errors import ConfigError, CorruptData, LayoutError
from tierstore.io.format import payload_crc
from tierstore.remote.admission import ShareAdmission
from tierstore.remote.format import (
    HEADER_BYTES,
    HEADER_FMT,
    MAGIC,
    ObjectCorrupt,
    ObjectNamer,
    check_header,
    check_payload,
    encode_header,
    object_bytes,
)

KEY = bytes(range(32))


def make_object(key: bytes = KEY, n: int = 1000, seed: int = 1) -> bytearray:
    payload = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()
    buf = bytearray(object_bytes(n))
    buf[HEADER_BYTES:] = payload
    encode_header(memoryview(buf), key, n, payload_crc(key, payload))
    return buf


def test_header_is_64_bytes_and_round_trips():
    assert HEADER_BYTES == struct.calcsize(HEADER_FMT) == 64
    obj = make_object()
    assert obj[:8] == MAGIC
    crc = check_header(obj, KEY, 1000)
    check_payload(KEY, bytes(obj[HEADER_BYTES:]), crc)


@pytest.mark.parametrize(
    "offset,reason",
    [
        (0, "magic"),
        (8, "version"),
        (12, "version"),
        (20, "header_crc"),
        (50, "header_crc"),
        (61, "header_crc"),
    ],
)
def test_any_flipped_header_byte_is_caught(offset, reason):
    obj = make_object()
    obj[offset] ^= 0x01
    with pytest.raises(ObjectCorrupt) as e:
        check_header(obj, KEY, 1000)
    assert e.value.reason == reason
    assert isinstance(e.value, CorruptData)


def test_other_key_and_length_are_misses():
    obj = make_object()
    with pytest.raises(ObjectCorrupt) as e:
        check_header(obj, bytes(32), 1000)
    assert e.value.reason == "key"
    with pytest.raises(ObjectCorrupt) as e:
        check_header(obj, KEY, 999)
    assert e.value.reason == "length"


@pytest.mark.parametrize("pos", [0, 1, 499, 999])
def test_flipped_payload_byte_is_caught(pos):
    obj = make_object()
    crc = check_header(obj, KEY, 1000)
    obj[HEADER_BYTES + pos] ^= 0x80
    with pytest.raises(ObjectCorrupt) as e:
        check_payload(KEY, bytes(obj[HEADER_BYTES:]), crc)
    assert e.value.reason == "payload_crc"


def test_payload_crc_binds_the_key():
    """The same bytes under another key fail: the CRC is seeded with the key."""
    a = make_object(KEY)
    other = bytes(31) + b"\x01"
    assert payload_crc(KEY, bytes(a[64:])) != payload_crc(other, bytes(a[64:]))


def test_short_buffer_is_a_size_error():
    with pytest.raises(ObjectCorrupt) as e:
        check_header(b"TSKVOBJ1", KEY, 10)
    assert e.value.reason == "size"


def test_names_plain_and_secret():
    plain = ObjectNamer("prod-a")
    assert plain(KEY) == "tierstore/v1/prod-a/" + KEY.hex()
    sec = ObjectNamer("prod-a", secret=b"s" * 32)
    want = hmac.new(b"s" * 32, KEY, hashlib.sha256).hexdigest()
    assert sec(KEY) == "tierstore/v1/prod-a/" + want
    assert KEY.hex() not in sec(KEY)
    assert ObjectNamer("prod-b")(KEY) != plain(KEY)
    with pytest.raises(LayoutError):
        plain(b"short")


@pytest.mark.parametrize("cluster", ["", "a/b", "x" * 65, "sp ace", None])
def test_bad_cluster_names(cluster):
    with pytest.raises(ConfigError):
        ObjectNamer(cluster)


def test_short_secret_refused():
    with pytest.raises(ConfigError, match="16 bytes"):
        ObjectNamer("c", secret=b"short")


def test_admission_all_and_reused():
    a = ShareAdmission("all")
    assert a.admit(KEY) and a.admitted == 1
    r = ShareAdmission("reused", min_hits=2, ghost_keys=2)
    assert not r.admit(b"a" * 32, hits=1)  # seen once, not hit enough: stays local
    assert r.admit(b"a" * 32, hits=0)  # second sighting
    assert r.admit(b"b" * 32, hits=2)  # hit locally
    assert not r.admit(b"c" * 32)
    assert not r.admit(b"d" * 32)
    assert not r.admit(b"e" * 32)  # ghost FIFO of 2 forgets c
    assert not r.admit(b"c" * 32)
    assert (r.admitted, r.declined) == (2, 5)
    with pytest.raises(ConfigError, match="accepted all, reused"):
        ShareAdmission("sometimes")
    with pytest.raises(ConfigError):
        ShareAdmission("reused", ghost_keys=0)
