"""Wire format of a block in the remote tier, and remote object names.

Object layout
-------------
A remote object is ``[header: 64 bytes][payload: payload_bytes]``, stored
under one Mooncake key (:class:`ObjectNamer`). Mooncake Store does not verify
payloads (its ``put``/``get`` move bytes between DRAM segments by RDMA or TCP),
and a key can be written by any client of the cluster, so every reader checks
everything below before a byte reaches KV memory. A failed check is a miss.

Continued in ``docs/FORMAT.md`` (``tierstore/remote/format.py``): object names.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import struct

import crc32c

from ..errors import ConfigError, CorruptData, LayoutError
from ..io.format import KEY_BYTES, payload_crc

MAGIC = b"TSKVOBJ1"
FORMAT_VERSION = 1
HEADER_FMT = "<8sII32sQII"
HEADER_BYTES = struct.calcsize(HEADER_FMT)  # 64
_HEADER_CRC_OFFSET = 60
_CLUSTER_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")

#: Reasons :func:`check_header` reports (the remote tier counts each).
CORRUPT_REASONS = ("magic", "version", "header_crc", "key", "length", "payload_crc", "size")


class ObjectCorrupt(CorruptData):
    """A remote object failed a check. ``reason`` is one of :data:`CORRUPT_REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"remote object {reason} check failed: {detail}")
        self.reason = reason


def object_bytes(block_bytes: int) -> int:
    """Size of the remote object of a ``block_bytes`` block (header + payload)."""
    return HEADER_BYTES + int(block_bytes)


def encode_header(buf, key: bytes, payload_bytes: int, crc: int) -> None:
    """Write the 64-byte header into ``buf``.

    Parameters
    ----------
    buf : writable buffer
        At least :data:`HEADER_BYTES` bytes (a ``'B'`` memoryview or numpy view).
    key : bytes
        32-byte block key.
    payload_bytes : int
        Payload length in bytes.
    crc : int
        :func:`tierstore.io.format.payload_crc` of ``key`` and the payload.
    """
    struct.pack_into(HEADER_FMT, buf, 0, MAGIC, FORMAT_VERSION, HEADER_BYTES, key, payload_bytes, crc, 0)
    struct.pack_into("<I", buf, _HEADER_CRC_OFFSET, crc32c.crc32c(bytes(buf[:_HEADER_CRC_OFFSET])))


def check_header(buf, key: bytes, payload_bytes: int) -> int:
    """Verify a header against the key and length the reader expects.

    Parameters
    ----------
    buf : buffer
        The first :data:`HEADER_BYTES` bytes of the object.
    key : bytes
        The 32-byte key that was asked for.
    payload_bytes : int
        The block length the reader expects.

    Returns
    -------
    int
        The header's ``payload_crc32c`` (check it with :func:`check_payload`).

    Raises
    ------
    ObjectCorrupt
        With ``reason`` ``magic``, ``version``, ``header_crc``, ``key`` or ``length``.
    """
    raw = bytes(buf[:HEADER_BYTES])
    if len(raw) < HEADER_BYTES:
        raise ObjectCorrupt("size", f"{len(raw)} header bytes")
    magic, version, hb, hkey, plen, pcrc, hcrc = struct.unpack_from(HEADER_FMT, raw, 0)
    if magic != MAGIC:
        raise ObjectCorrupt("magic", repr(magic))
    if version != FORMAT_VERSION or hb != HEADER_BYTES:
        raise ObjectCorrupt("version", f"format_version={version} header_bytes={hb}")
    if crc32c.crc32c(raw[:_HEADER_CRC_OFFSET]) != hcrc:
        raise ObjectCorrupt("header_crc", "header CRC mismatch")
    if hkey != key:
        raise ObjectCorrupt("key", f"object holds key {hkey.hex()[:16]}..., asked {key.hex()[:16]}...")
    if plen != payload_bytes:
        raise ObjectCorrupt("length", f"payload_bytes={plen}, expected {payload_bytes}")
    return pcrc


def check_payload(key: bytes, payload, crc: int) -> None:
    """Raise :class:`ObjectCorrupt` (``payload_crc``) unless ``payload`` matches ``crc``."""
    got = payload_crc(key, payload)
    if got != crc:
        raise ObjectCorrupt("payload_crc", f"crc32c {got:#010x} != {crc:#010x}")


class ObjectNamer:
    """Maps 32-byte block keys to Mooncake object names (see the module docstring).

    Parameters
    ----------
    cluster : str
        Deployment name, ``[A-Za-z0-9_.-]{1,64}``.
    secret : bytes, optional
        Name secret shared by the deployment's instances. With it, names are
        ``HMAC-SHA256(secret, key)``: a party that can reach Mooncake but lacks
        the secret cannot compute the name of any block, even from public
        namespace fields (model, tenant name) and tokens.

    Raises
    ------
    ConfigError
        For a bad cluster name or a secret shorter than 16 bytes.
    """

    def __init__(self, cluster: str = "default", secret: bytes | None = None) -> None:
        if not isinstance(cluster, str) or not _CLUSTER_RE.match(cluster):
            raise ConfigError(f"remote cluster={cluster!r}: 1-64 characters of [A-Za-z0-9_.-]")
        if secret is not None and (not isinstance(secret, (bytes, bytearray)) or len(secret) < 16):
            raise ConfigError("remote name secret: at least 16 bytes")
        self.prefix = f"tierstore/v{FORMAT_VERSION}/{cluster}/"
        self._secret = bytes(secret) if secret is not None else None

    def __call__(self, key: bytes) -> str:
        """The object name of ``key`` (a 32-byte block key; :class:`LayoutError` otherwise)."""
        if len(key) != KEY_BYTES:
            raise LayoutError(f"block key of {len(key)} bytes; keys are {KEY_BYTES} bytes")
        if self._secret is None:
            return self.prefix + key.hex()
        return self.prefix + hmac.new(self._secret, key, hashlib.sha256).hexdigest()
