"""InvalidationLog (io/invalidation_log.py): the on-disk bytes of the ``<path>.invalidations``
format, a torn tail, a CRC mismatch, and a store that reopens over each."""

import errno
import os
import struct

import crc32c
import pytest
import torch

from tierstore.errors import Status
from tierstore.io.engine import alloc_aligned
from tierstore.io.invalidation_log import (
    LABEL_TAIL_OFFSET,
    LABEL_TAIL_RECORDS,
    NS_RECORD,
    InvalidationLog,
    LabelInvalidationLog,
    is_invalidated,
)
from tierstore.io.journal import read_legacy_invalidations
from tierstore.io.segments import SegmentStorage

A, B, C = b"A" * 32, b"B" * 32, b"C" * 32


def record(ns: bytes, seq: int) -> bytes:
    """The record as io/segments.py wrote it before the split (88f2af8: ``_append_invalidation``)."""
    return struct.pack("<32sQI", ns, seq, crc32c.crc32c(ns + seq.to_bytes(8, "little")))


def test_bytes_on_disk_are_the_format_of_before(tmp_path):
    log = InvalidationLog(str(tmp_path / "x.invalidations"))
    assert log.read() == {}
    log.append(A, 5)
    log.append(B, 2**64 - 1)
    log.append(A, 3)
    assert NS_RECORD.size == 44
    assert (tmp_path / "x.invalidations").read_bytes() == record(A, 5) + record(B, 2**64 - 1) + record(A, 3)
    assert log.read() == {A: 5, B: 2**64 - 1}  # the largest sequence number per namespace
    assert read_legacy_invalidations(log.path) == log.read()


@pytest.mark.parametrize("cut", [1, 20, 40, 43])
def test_a_torn_tail_is_ignored(tmp_path, cut):
    p = tmp_path / "x.invalidations"
    p.write_bytes(record(A, 4) + record(B, 6) + record(C, 9)[:cut])
    assert InvalidationLog(str(p)).read() == {A: 4, B: 6}


@pytest.mark.parametrize("flip", [0, 31, 32, 39, 40, 43])
def test_reading_stops_at_a_crc_mismatch(tmp_path, flip):
    bad = bytearray(record(B, 6))
    bad[flip] ^= 0x01
    p = tmp_path / "x.invalidations"
    p.write_bytes(record(A, 4) + bytes(bad) + record(C, 9))
    assert InvalidationLog(str(p)).read() == {A: 4}


def test_an_append_after_a_torn_tail_is_not_read_back(tmp_path):
    """Appends go after whatever is there: a torn tail hides what follows (as before the split)."""
    p = tmp_path / "x.invalidations"
    p.write_bytes(record(A, 4) + record(B, 6)[:10])
    log = InvalidationLog(str(p))
    log.append(C, 9)
    assert log.read() == {A: 4}


def _store(path: str) -> SegmentStorage:
    return SegmentStorage(path, 2 << 20, 4096, segment_size_bytes=256 << 10, extent_size_bytes=64 << 10)


def test_a_store_reopens_over_a_torn_log_and_still_drops_the_invalidated_namespace(tmp_path):
    path = str(tmp_path / "tier.bin")
    s = _store(path)
    keys = [os.urandom(32) for _ in range(4)]
    blocks = [torch.full((4096,), i, dtype=torch.uint8) for i in range(4)]
    assert s.put(keys, blocks, ns_digests=[A, A, B, B]) == [Status.OK] * 4
    assert s.invalidate_namespace(A) == 2
    s.close()
    with open(path + ".invalidations", "ab") as f:  # a crash during a second append
        f.write(record(B, 10**6)[:30])
    s = _store(path)
    assert sorted(s.keys()) == sorted(keys[2:])
    assert s.stats()["recovery_invalidated_blocks"] == 2
    s.close()


def test_the_label_page_log_refuses_a_namespace_past_its_room_and_drops_no_other(tmp_path):
    """A device's records (LabelInvalidationLog) live after the label, one per namespace. Past the
    page's room an invalidation of a new namespace is refused (ENOSPC) with nothing written: the
    oldest were once folded into one record for every namespace, which dropped every tenant's
    acknowledged blocks at the next start (fresh-user trial 12). A recorded namespace still updates."""
    s = _store(str(tmp_path / "tier.bin"))
    log = LabelInvalidationLog(s.engine, None)
    label = bytes(log._page()[:LABEL_TAIL_OFFSET])
    for i in range(LABEL_TAIL_RECORDS):
        log.append(i.to_bytes(32, "big"), 100 + i)
    before = bytes(log._page())
    with pytest.raises(OSError) as err:
        log.append(C, 10**6)
    assert err.value.errno == errno.ENOSPC and "reformat" in str(err.value)
    assert bytes(log._page()) == before  # nothing written
    got = log.read()
    assert len(got) == LABEL_TAIL_RECORDS and C not in got
    assert not is_invalidated(got, C, 5) and not is_invalidated(got, B, 5)  # no other namespace dropped
    assert is_invalidated(got, (1).to_bytes(32, "big"), 100) and not is_invalidated(
        got, (1).to_bytes(32, "big"), 101
    )
    log.append((1).to_bytes(32, "big"), 500)  # a recorded namespace invalidated again: updated in place
    assert log.read()[(1).to_bytes(32, "big")] == 500 and len(log.read()) == LABEL_TAIL_RECORDS
    assert bytes(log._page()[:LABEL_TAIL_OFFSET]) == label  # the label itself unchanged
    s.close()


def test_a_torn_record_in_the_label_page_loses_only_itself(tmp_path):
    """A torn rewrite of the label page (a crash mid-write) can leave one record's bytes bad; the
    records after it were lost too when reading stopped at the first bad CRC."""
    s = _store(str(tmp_path / "tier.bin"))
    log = LabelInvalidationLog(s.engine, None)
    for i in range(10):
        log.append(i.to_bytes(32, "big"), 100 + i)
    page = log._page()
    page[LABEL_TAIL_OFFSET + 3 * 44 + 5] ^= 0xFF  # record 3's digest damaged
    keep, buf = alloc_aligned(len(page))
    memoryview(keep)[: len(page)] = page
    s.engine.write(0, buf[: len(page)], None).get()
    got = log.read()
    assert sorted(got) == [i.to_bytes(32, "big") for i in range(10) if i != 3]
    assert all(got[i.to_bytes(32, "big")] == 100 + i for i in range(10) if i != 3)
    s.close()
