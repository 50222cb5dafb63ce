"""On-disk format of the NVMe tier: self-describing extents in segments.

Device layout
-------------
The device (file or block device) is cut into ``n_segments`` *segments* of
``segment_size_bytes`` (the reclaim unit: one FDP reclaim unit / erase-block
multiple; CacheLib Navy calls them regions). Segment ``s`` starts at byte
``s * segment_size_bytes``. A segment is written strictly sequentially as a
chain of *extents* starting at its byte 0 -- except segment 0 of a tier kept
in a file or on a device, whose first 4096 bytes hold the tier's label
(:mod:`tierstore.io.label`: the geometry it was formatted with) and whose
chain starts at byte 4096 -- and is reclaimed only as a whole
(fallocate(2) ``FALLOC_FL_PUNCH_HOLE|FALLOC_FL_KEEP_SIZE`` on files, BLKDISCARD
/ NVMe Deallocate on raw devices), after which it reads back as zeros.

Extent layout
-------------
``[header: header_bytes][block 0][pad][block 1][pad] ...``; every block starts
at a multiple of 4096 bytes from the extent start (so single blocks can be
read with O_DIRECT), ``header_bytes`` is a multiple of 4096, and the next
extent of the chain starts at ``extent_offset + header_bytes + payload_bytes``.

Header (little-endian; ``struct`` format ``HEADER_FMT``), 64 bytes:

====== ==== ================= ==============================================
offset size field             meaning
====== ==== ================= ==============================================
0      8    magic             ``b"TSKVEXT1"`` (identifies an extent header)
8      4    format_version    ``FORMAT_VERSION`` (1); other values: not served
12     4    header_bytes      bytes of header incl. entries, multiple of 4096
16     8    seq               global extent sequence number, strictly
                              increasing (newest copy of a key wins)
24     8    segment_gen       ``seq`` of the first extent written to this
                              segment since it was last reclaimed; every
                              extent of a chain carries the same value, so
                              stale extents of an earlier use end the chain
32     8    extent_offset     absolute device byte offset of this extent
                              (catches misdirected or stale reads)
40     8    payload_bytes     bytes after the header (blocks + padding)
48     8    placement         stream tag (int64; -1 = None)
56     4    n_blocks          number of block entries that follow
60     4    header_crc32c     CRC-32C of bytes [0, 64 + 96 * n_blocks) with
                              this field zeroed
====== ==== ================= ==============================================

Block entry ``i`` at header offset ``64 + 96 * i`` (``ENTRY_FMT``), 96 bytes:

====== ==== ================= ==============================================
0      32   key               32-byte block hash
32     32   ns_digest         32-byte namespace digest (zeros if none)
64     8    payload_offset    offset of the block from the extent start
                              (multiple of 4096)
72     8    length_bytes      block length in bytes
80     4    payload_crc32c    CRC-32C of the payload, seeded with the
                              CRC-32C of ``key`` (binds bytes to their key)
84     12   reserved          zeros
====== ==== ================= ==============================================

Durability and recovery (the extent headers *are* the journal)
--------------------------------------------------------------
A put is acknowledged only after its extents are written with O_DIRECT and
fdatasync(2) returned. Recovery reads every segment's chain from byte 0 and
stops at the first header that fails: magic, version, header CRC, a
``segment_gen`` different from the chain's, a non-increasing ``seq``, an
``extent_offset`` different from its position, or lengths running past the
segment. Each entry's payload CRC is verified on every read (lazily), or at
recovery when ``verify_on_recovery=True``; a block that fails is never served,
only reported (``IO_ERROR``) and dropped (a later ``get`` is a ``MISS``).
Since fdatasync orders all earlier writes of the file, every acknowledged
extent precedes the torn tail of its chain and is found again after kill -9.
A recovered segment is never appended to (it stays sealed until reclaimed as
a whole): complete extents of a dead writer can lie beyond a torn one, and
appending at the chain end could splice them back in. An exclusive flock(2)
on the device file, held by the open store, makes a new opener wait until
every in-flight io_uring write of a killed predecessor has landed (and
refuses it at once while the holder lives: ``io._fileops.lock_exclusive``).
When a key is found in two extents (a GC copy-forward cut short by a
crash), the newer copy wins only if its payload CRC verifies at recovery.
Deletes are volatile (a restart may bring back a deleted but not yet reclaimed
block; keys are content hashes, so the bytes are still the right ones).
CRC-32C: the ``crc32c`` package (Castagnoli polynomial, as iSCSI/ext4/NVMe).
"""
from __future__ import annotations

import dataclasses
import struct

import crc32c

from ..errors import CorruptData

MAGIC = b"TSKVEXT1"
FORMAT_VERSION = 1
#: O_DIRECT alignment of headers and block payloads (open(2)).
ALIGN_BYTES = 4096
HEADER_FMT = "<8sIIQQQQqII"
HEADER_BYTES_FIXED = struct.calcsize(HEADER_FMT)  # 64
ENTRY_FMT = "<32s32sQQI12s"
ENTRY_BYTES = struct.calcsize(ENTRY_FMT)  # 96
KEY_BYTES = 32
_CRC_FIELD_OFFSET = 60
_ZERO_NS = bytes(32)


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def header_bytes_for(n_blocks: int) -> int:
    """Header size (multiple of 4096) of an extent of ``n_blocks`` entries."""
    return _align(HEADER_BYTES_FIXED + ENTRY_BYTES * n_blocks)


def block_slot_bytes(length_bytes: int) -> int:
    """Payload bytes one block occupies (length rounded up to 4096)."""
    return _align(max(length_bytes, 1))


def extent_bytes_for(n_blocks: int, length_bytes: int) -> int:
    """Total bytes of an extent of ``n_blocks`` blocks of ``length_bytes``."""
    return header_bytes_for(n_blocks) + n_blocks * block_slot_bytes(length_bytes)


def payload_crc(key: bytes, payload) -> int:
    """CRC-32C of ``payload`` seeded with CRC-32C of ``key``."""
    return crc32c.crc32c(payload, crc32c.crc32c(key))


@dataclasses.dataclass(frozen=True)
class BlockEntry:
    """One block of an extent (see the module table)."""

    key: bytes
    ns_digest: bytes
    payload_offset: int
    length_bytes: int
    payload_crc32c: int


@dataclasses.dataclass(frozen=True)
class ExtentHeader:
    """Decoded extent header (see the module table)."""

    header_bytes: int
    seq: int
    segment_gen: int
    extent_offset: int
    payload_bytes: int
    placement: int | None
    entries: tuple[BlockEntry, ...]

    @property
    def total_bytes(self) -> int:
        """Header plus payload: distance to the next extent of the chain."""
        return self.header_bytes + self.payload_bytes


def encode_header(buf, seq: int, segment_gen: int, extent_offset: int, payload_bytes: int,
                  placement: int | None, entries: list[BlockEntry]) -> int:
    """Write the header into ``buf`` (a writable ``'B'`` memoryview of at least
    ``header_bytes_for(len(entries))`` bytes); return the header size."""
    hb = header_bytes_for(len(entries))
    used = HEADER_BYTES_FIXED + ENTRY_BYTES * len(entries)
    struct.pack_into(HEADER_FMT, buf, 0, MAGIC, FORMAT_VERSION, hb, seq, segment_gen,
                     extent_offset, payload_bytes, -1 if placement is None else int(placement),
                     len(entries), 0)
    for i, e in enumerate(entries):
        struct.pack_into(ENTRY_FMT, buf, HEADER_BYTES_FIXED + ENTRY_BYTES * i, e.key,
                         e.ns_digest or _ZERO_NS, e.payload_offset, e.length_bytes,
                         e.payload_crc32c, bytes(12))
    buf[used:hb] = bytes(hb - used)
    crc = crc32c.crc32c(buf[:used])
    struct.pack_into("<I", buf, _CRC_FIELD_OFFSET, crc)
    return hb


def peek_header_bytes(first_page) -> int:
    """``header_bytes`` of the header starting in ``first_page`` (4096 bytes).

    Raises
    ------
    CorruptData
        Wrong magic or version, or an impossible size.
    """
    magic, version, hb = struct.unpack_from("<8sII", first_page, 0)
    if magic != MAGIC:
        raise CorruptData("bad extent magic")
    if version != FORMAT_VERSION:
        raise CorruptData(f"unsupported format_version {version}")
    if hb < ALIGN_BYTES or hb % ALIGN_BYTES:
        raise CorruptData(f"bad header_bytes {hb}")
    return hb


def decode_header(buf) -> ExtentHeader:
    """Parse and verify a header (``buf`` holds at least ``header_bytes``).

    Raises
    ------
    CorruptData
        Bad magic, version, sizes or header CRC.
    """
    hb = peek_header_bytes(buf)
    (_, _, _, seq, gen, ext_off, payload_bytes, placement, n,
     crc) = struct.unpack_from(HEADER_FMT, buf, 0)
    used = HEADER_BYTES_FIXED + ENTRY_BYTES * n
    if used > hb or len(buf) < hb:
        raise CorruptData(f"n_blocks={n} does not fit header_bytes={hb}")
    tmp = bytearray(buf[:used])
    struct.pack_into("<I", tmp, _CRC_FIELD_OFFSET, 0)
    if crc32c.crc32c(tmp) != crc:
        raise CorruptData("extent header CRC mismatch")
    entries = []
    for i in range(n):
        key, ns, poff, length, pcrc, _ = struct.unpack_from(ENTRY_FMT, buf, HEADER_BYTES_FIXED + ENTRY_BYTES * i)
        if poff < hb or poff % ALIGN_BYTES or poff + length > hb + payload_bytes:
            raise CorruptData(f"entry {i}: payload range [{poff}, {poff + length}) outside extent")
        entries.append(BlockEntry(key, ns, poff, length, pcrc))
    return ExtentHeader(hb, seq, gen, ext_off, payload_bytes, None if placement == -1 else placement,
                        tuple(entries))
