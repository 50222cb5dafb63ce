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

Continued in ``docs/FORMAT.md`` (``tierstore/io/format.py``): extent layout; durability and
recovery (the extent headers *are* the journal).
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
#: The first page of a tier's file that tierstore created (or found empty) but has not labelled yet:
#: this magic, then zeros to :data:`ALIGN_BYTES`. Written and made durable before the file is grown,
#: so a crash between growing it and writing the label leaves a file provably tierstore's
#: (:func:`tierstore.io.label.inspect_target`); every other label-less file with data is refused.
UNLABELLED_MAGIC = b"TSKVNEW1"
UNLABELLED_PAGE = UNLABELLED_MAGIC + bytes(ALIGN_BYTES - len(UNLABELLED_MAGIC))
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


def blocks_fitting(remaining_bytes: int, want: int, length_bytes: int) -> int:
    """Blocks of ``length_bytes`` (at most ``want``) whose one extent fits in ``remaining_bytes``."""
    k = want
    while k > 0 and extent_bytes_for(k, length_bytes) > remaining_bytes:
        k -= 1
    return k


def blocks_per_extent_for(extent_size_bytes: int, segment_bytes: int, length_bytes: int) -> tuple[int, int]:
    """``(extent bytes, blocks per extent)`` of a tier: the configured extent size aligned up to
    :data:`ALIGN_BYTES`, at least one block's extent and at most a segment, and the most blocks of
    ``length_bytes`` one such extent holds (at least 1)."""
    one = extent_bytes_for(1, length_bytes)
    ext = min(max(-(-extent_size_bytes // ALIGN_BYTES) * ALIGN_BYTES, one), segment_bytes)
    bpe = 1
    while extent_bytes_for(bpe + 1, length_bytes) <= ext:
        bpe += 1
    return ext, bpe


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


def encode_header(
    buf,
    seq: int,
    segment_gen: int,
    extent_offset: int,
    payload_bytes: int,
    placement: int | None,
    entries: list[BlockEntry],
) -> int:
    """Write the header into ``buf`` (a writable ``'B'`` memoryview of at least
    ``header_bytes_for(len(entries))`` bytes); return the header size."""
    hb = header_bytes_for(len(entries))
    used = HEADER_BYTES_FIXED + ENTRY_BYTES * len(entries)
    struct.pack_into(
        HEADER_FMT,
        buf,
        0,
        MAGIC,
        FORMAT_VERSION,
        hb,
        seq,
        segment_gen,
        extent_offset,
        payload_bytes,
        -1 if placement is None else int(placement),
        len(entries),
        0,
    )
    for i, e in enumerate(entries):
        struct.pack_into(
            ENTRY_FMT,
            buf,
            HEADER_BYTES_FIXED + ENTRY_BYTES * i,
            e.key,
            e.ns_digest or _ZERO_NS,
            e.payload_offset,
            e.length_bytes,
            e.payload_crc32c,
            bytes(12),
        )
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
    (_, _, _, seq, gen, ext_off, payload_bytes, placement, n, crc) = struct.unpack_from(HEADER_FMT, buf, 0)
    used = HEADER_BYTES_FIXED + ENTRY_BYTES * n
    if used > hb or len(buf) < hb:
        raise CorruptData(f"n_blocks={n} does not fit header_bytes={hb}")
    tmp = bytearray(buf[:used])
    struct.pack_into("<I", tmp, _CRC_FIELD_OFFSET, 0)
    if crc32c.crc32c(tmp) != crc:
        raise CorruptData("extent header CRC mismatch")
    entries = []
    for i in range(n):
        key, ns, poff, length, pcrc, _ = struct.unpack_from(
            ENTRY_FMT, buf, HEADER_BYTES_FIXED + ENTRY_BYTES * i
        )
        if poff < hb or poff % ALIGN_BYTES or poff + length > hb + payload_bytes:
            raise CorruptData(f"entry {i}: payload range [{poff}, {poff + length}) outside extent")
        entries.append(BlockEntry(key, ns, poff, length, pcrc))
    return ExtentHeader(
        hb, seq, gen, ext_off, payload_bytes, None if placement == -1 else placement, tuple(entries)
    )
