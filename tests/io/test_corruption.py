"""Bit flips, deleted and truncated segments: never wrong bytes, only misses."""

import os
import random

import pytest
import torch

from tierstore.errors import Status
from tierstore.io import SegmentStorage
from tierstore.io import format as fmt
from tierstore.io._fileops import punch_hole
from tierstore.io.label import LABEL_BYTES
from tierstore.io.memory import MemoryEngine

from .test_segments import content

BB = 5000  # odd block size: payload slots have padding
SEG = 64 << 10
CAP = 4 * SEG


def _store(eng, **kw):
    return SegmentStorage(None, CAP, BB, segment_size_bytes=SEG, engine=eng, extent_size_bytes=32 << 10, **kw)


def _check_all(eng, keys, expect_bad=()):
    s = _store(eng)
    outcome = {}
    for k in keys:
        d = torch.full((BB,), 0xAB, dtype=torch.uint8)
        st = s.get([k], [d])[0]
        if st is Status.OK:
            assert torch.equal(d, content(k, BB)), "wrong bytes served"
        outcome[k] = st
    s.close()
    for k in expect_bad:
        assert outcome[k] is not Status.OK, "corruption not detected"
    return outcome


def test_every_sampled_bit_flip_is_detected():
    eng = MemoryEngine(CAP)
    s = _store(eng)
    keys = [os.urandom(32) for _ in range(5)]
    assert s.put(keys[:3], [content(k, BB) for k in keys[:3]]) == [Status.OK] * 3
    assert s.put(keys[3:], [content(k, BB) for k in keys[3:]]) == [Status.OK] * 2
    first_offset = s.locate(keys[0])[1]
    s.close()
    raw = eng.raw()
    hb = fmt.header_bytes_for(3)
    used_header = fmt.HEADER_BYTES_FIXED + 3 * fmt.ENTRY_BYTES
    rng = random.Random(1234)
    bits = [("header", b) for b in range(fmt.HEADER_BYTES_FIXED * 8)]
    bits += [("header", b) for b in range(fmt.HEADER_BYTES_FIXED * 8, used_header * 8)]  # every bit
    bits += [("header-pad", rng.randrange(used_header * 8, hb * 8)) for _ in range(20)]
    bits += [("payload", rng.randrange(hb * 8, (hb + 3 * fmt.block_slot_bytes(BB)) * 8)) for _ in range(400)]
    assert first_offset == hb
    for where, bit in bits:
        byte, mask = bit // 8, 1 << (bit % 8)
        raw[byte] ^= mask
        try:
            if where == "header":
                _check_all(eng, keys, expect_bad=keys[:3])
            elif where == "header-pad":
                _check_all(eng, keys)
            else:
                rel = byte - hb
                i = rel // fmt.block_slot_bytes(BB)
                in_data = rel % fmt.block_slot_bytes(BB) < BB
                _check_all(eng, keys, expect_bad=[keys[i]] if in_data else [])
        finally:
            raw[byte] ^= mask
    assert set(_check_all(eng, keys).values()) == {Status.OK}


def test_verify_on_recovery_drops_corrupt_blocks():
    eng = MemoryEngine(CAP)
    s = _store(eng)
    keys = [os.urandom(32) for _ in range(3)]
    assert s.put(keys, [content(k, BB) for k in keys]) == [Status.OK] * 3
    off = s.locate(keys[1])[1]
    s.close()
    eng.raw()[off + 17] ^= 0x10
    s = _store(eng, verify_on_recovery=True)
    assert sorted(s.keys()) == sorted([keys[0], keys[2]])
    assert s.stats()["recovery_dropped_blocks"] == 1


@pytest.mark.parametrize("engine", ["posix", "uring"])
def test_deleted_and_truncated_segments_miss(tmp_path, engine):
    path = str(tmp_path / "store.bin")
    bb = 16 << 10

    def mk():
        return SegmentStorage(
            path, 8 * SEG * 2, bb, segment_size_bytes=2 * SEG, engine=engine, extent_size_bytes=32 << 10
        )

    s = mk()
    keys = [os.urandom(32) for _ in range(20)]
    assert s.put(keys, [content(k, bb) for k in keys]) == [Status.OK] * 20
    seg_of = {k: s.locate(k)[0] for k in keys}
    assert len(set(seg_of.values())) >= 3
    s.close()
    # "delete" segment 0's blocks behind the store's back (its label stays), truncate away the last used one
    fd = os.open(path, os.O_RDWR)
    punch_hole(fd, LABEL_BYTES, 2 * SEG - LABEL_BYTES, False)
    last = max(seg_of.values())
    os.ftruncate(fd, last * 2 * SEG)
    os.close(fd)
    s = mk()
    for k in keys:
        d = torch.empty(bb, dtype=torch.uint8)
        st = s.get([k], [d])[0]
        if seg_of[k] in (0, last):
            assert st is Status.MISS
        else:
            assert st is Status.OK and torch.equal(d, content(k, bb))
    s.close()


def test_truncation_under_a_live_store_is_io_error_then_miss(tmp_path):
    path = str(tmp_path / "store.bin")
    bb = 16 << 10
    s = SegmentStorage(
        path, 8 * SEG, bb, segment_size_bytes=2 * SEG, engine="posix", extent_size_bytes=32 << 10
    )
    keys = [os.urandom(32) for _ in range(4)]
    assert s.put(keys, [content(k, bb) for k in keys]) == [Status.OK] * 4
    os.truncate(path, 4096)
    d = torch.empty(bb, dtype=torch.uint8)
    assert s.get(keys[:1], [d]) == [Status.IO_ERROR]
    assert s.get(keys[:1], [d]) == [Status.MISS]
    s.close()


def test_a_corrupt_block_found_by_a_load_is_said_once_in_the_log(caplog):
    """The engine recomputes a block whose CRC fails, and the store counts it; it also says so
    (a new-user trial flipped bytes under vLLM: the request was recomputed, tierstore said nothing)."""
    eng = MemoryEngine(CAP)
    s = _store(eng)
    keys = [os.urandom(32) for _ in range(3)]
    assert s.put(keys, [content(k, BB) for k in keys]) == [Status.OK] * 3
    off = s.locate(keys[1])[1]
    eng.raw()[off + 7] ^= 0xFF
    with caplog.at_level("WARNING", logger="tierstore.io.segments"):
        dests = [torch.zeros(BB, dtype=torch.uint8) for _ in keys]
        st = s.get(keys, dests)
    assert st[1] is Status.IO_ERROR and st[0] is st[2] is Status.OK
    lines = [r.getMessage() for r in caplog.records if "CRC-32C" in r.getMessage()]
    assert len(lines) == 1 and "1 NVMe block(s) of this read" in lines[0]
    assert "1 since the tier opened (corrupt_blocks)" in lines[0]
    s.close()


def test_a_damaged_extent_header_at_recovery_is_said_and_counted(caplog):
    """One flipped bit in an extent header dropped every block of the extent at reopen with no
    log line and no counter (re-trial of issue 22): a miss, as it must be, but said."""
    eng = MemoryEngine(CAP)
    s = _store(eng)
    keys = [os.urandom(32) for _ in range(3)]
    assert s.put(keys, [content(k, BB) for k in keys]) == [Status.OK] * 3
    hdr = s.locate(keys[0])[1] - fmt.header_bytes_for(3)
    s.close()
    eng.raw()[hdr + 20] ^= 0x01
    with caplog.at_level("WARNING", logger="tierstore.io.segments"):
        s = _store(eng)
    try:
        assert [s.get([k], [torch.zeros(BB, dtype=torch.uint8)])[0] for k in keys] == [Status.MISS] * 3
        assert s.stats()["recovery_damaged_extents"] == 1
        assert any("extent header(s) were unreadable" in r.getMessage() for r in caplog.records)
    finally:
        s.close()


def test_an_extent_header_whose_magic_is_destroyed_at_a_chain_start_is_said_and_counted(caplog):
    """Fresh-user trial 7: XOR of the first 64 bytes of a segment's first extent header dropped its
    blocks silently (``recovery_damaged_extents=0``, no log line), where one flipped bit was said."""
    eng = MemoryEngine(CAP)
    s = _store(eng)
    keys = [os.urandom(32) for _ in range(3)]
    assert s.put(keys, [content(k, BB) for k in keys]) == [Status.OK] * 3
    hdr = s.locate(keys[0])[1] - fmt.header_bytes_for(3)
    s.close()
    raw = eng.raw()
    assert bytes(raw[hdr : hdr + 8]) == fmt.MAGIC  # the segment's first extent
    for i in range(hdr, hdr + 64):
        raw[i] ^= 0xFF
    with caplog.at_level("WARNING", logger="tierstore.io.segments"):
        s = _store(eng)
    try:
        assert [s.get([k], [torch.zeros(BB, dtype=torch.uint8)])[0] for k in keys] == [Status.MISS] * 3
        assert s.stats()["recovery_damaged_extents"] == 1
        assert any("extent header(s) were unreadable" in r.getMessage() for r in caplog.records)
    finally:
        s.close()


def test_a_read_error_on_an_extent_header_at_recovery_is_said_and_counted(caplog):
    """An EIO reading an extent header at reopen ended its segment's chain with no log line and no
    counter: the extent's blocks, and every later extent's, were lost silently (misses, but unsaid)."""
    eng = MemoryEngine(CAP)
    s = _store(eng)
    keys = [os.urandom(32) for _ in range(6)]
    assert s.put(keys[:3], [content(k, BB) for k in keys[:3]]) == [Status.OK] * 3
    assert s.put(keys[3:], [content(k, BB) for k in keys[3:]]) == [Status.OK] * 3
    seg0, off0 = divmod(s.locate(keys[0])[1], SEG)
    seg1, off1 = divmod(s.locate(keys[3])[1], SEG)
    assert seg0 == seg1 and off1 > off0, "the test wants two extents of one chain"
    hdr = s.locate(keys[3])[1] - fmt.header_bytes_for(3)
    s.close()
    eng.read_errors.append((hdr, 1))
    with caplog.at_level("WARNING", logger="tierstore.io.segments"):
        s = _store(eng)
    try:
        got = [s.get([k], [torch.zeros(BB, dtype=torch.uint8)])[0] for k in keys]
        assert got == [Status.OK] * 3 + [Status.MISS] * 3
        assert s.stats()["recovery_damaged_extents"] == 1
        assert any("extent header(s) were unreadable" in r.getMessage() for r in caplog.records)
    finally:
        s.close()


def _big(eng):  # segments of 128 KiB: three 3-block extents in one chain
    return SegmentStorage(None, CAP, BB, segment_size_bytes=2 * SEG, engine=eng, extent_size_bytes=32 << 10)


@pytest.mark.parametrize("damage", ["magic destroyed", "read error", "zeroed"])
def test_a_damaged_extent_header_mid_chain_loses_that_extent_only_and_is_said(caplog, damage):
    """An extent header mid-chain whose magic was destroyed ended the segment's chain at reopen with
    no log line and no counter: that extent's blocks and every later extent's were lost unsaid.
    Now the damage is counted and the chain goes on at the next extent of the same generation."""
    eng = MemoryEngine(CAP)
    s = _big(eng)
    keys = [os.urandom(32) for _ in range(9)]
    for i in range(0, 9, 3):
        assert s.put(keys[i : i + 3], [content(k, BB) for k in keys[i : i + 3]]) == [Status.OK] * 3
    segs = {s.locate(k)[1] // (2 * SEG) for k in keys}
    assert len(segs) == 1, "the test wants three extents of one chain"
    hdr = s.locate(keys[3])[1] - fmt.header_bytes_for(3)
    s.close()
    raw = eng.raw()
    assert bytes(raw[hdr : hdr + 8]) == fmt.MAGIC
    if damage == "read error":
        eng.read_errors.append((hdr, 1))
    elif damage == "zeroed":  # fresh-user trial 10: zeros looked like the chain's normal end
        raw[hdr : hdr + fmt.ALIGN_BYTES] = bytes(fmt.ALIGN_BYTES)
    else:
        for i in range(hdr, hdr + 64):
            raw[i] ^= 0xFF
    with caplog.at_level("WARNING", logger="tierstore.io.segments"):
        s = _big(eng)
    try:
        got = [s.get([k], [torch.full((BB,), 7, dtype=torch.uint8)])[0] for k in keys]
        assert got == [Status.OK] * 3 + [Status.MISS] * 3 + [Status.OK] * 3
        for k in keys[:3] + keys[6:]:
            d = torch.zeros(BB, dtype=torch.uint8)
            assert s.get([k], [d]) == [Status.OK] and torch.equal(d, content(k, BB))
        assert s.stats()["recovery_damaged_extents"] == 1
        assert any("extent header(s) were unreadable" in r.getMessage() for r in caplog.records)
    finally:
        s.close()
