"""The NVMe tier's journal (tierstore/io/journal.py): records, torn tails, corruption, compaction,
the legacy invalidation log."""

from __future__ import annotations

import os

import pytest

from tierstore.errors import CorruptData, ForeignDataError, LayoutError
from tierstore.io import journal as jr
from tierstore.io.journal import Journal, JournalRecord, JournalState, RecordKind, live_records, read_records

K = RecordKind
NS_A, NS_B = bytes([1]) * 32, bytes([2]) * 32


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def _fill(j: Journal) -> list[JournalRecord]:
    j.append(K.NS_INVALIDATE, value=10, digest=NS_A)
    j.append(K.BLOCK_DEAD, segment=3, segment_gen=7, value=3 * 8192 + 4096, digest=key(1))
    j.append(K.BLOCK_DEAD, segment=3, segment_gen=7, value=3 * 8192 + 36864, digest=key(2))
    j.append(K.SEGMENT_RESET, segment=5, segment_gen=2**40)
    j.append(K.BLOCK_DEAD, segment=2**32 - 1, segment_gen=2**64 - 1, value=2**64 - 1, digest=key(3))
    j.commit()
    return list(j.records)


def test_round_trip_every_kind_and_extreme_field(tmp_path):
    p = str(tmp_path / "j")
    with Journal(p) as j:
        recs = _fill(j)
        assert [r.seq for r in recs] == [1, 2, 3, 4, 5] and j.committed_seq == 5
    assert os.path.getsize(p) == jr.HEADER_BYTES + 5 * jr.RECORD_BYTES
    j2 = Journal(p)
    assert j2.records == recs and j2.opened.tail_bytes == 0
    assert j2.append(K.NS_INVALIDATE, value=11, digest=NS_B) == 6
    j2.commit()
    j2.close()
    again = read_records(p).records
    assert again[:5] == recs and again[5] == JournalRecord(K.NS_INVALIDATE, 0, 0, 11, NS_B, 6)
    st = JournalState.of(again)
    assert st.invalidated == {NS_A: 10, NS_B: 11}
    assert st.reset_gen == {5: 2**40}
    assert st.dead == {
        (3, 7): {3 * 8192 + 4096: key(1), 3 * 8192 + 36864: key(2)},
        (2**32 - 1, 2**64 - 1): {2**64 - 1: key(3)},
    }


def test_nothing_is_durable_before_commit_and_memory_journal_has_the_same_api(tmp_path):
    p = str(tmp_path / "j")
    j = Journal(p)
    j.append(K.BLOCK_DEAD, segment=1, segment_gen=1, value=4096, digest=key(9))
    assert read_records(p).records == [] and j.committed_seq == 0  # buffered only
    j.commit()
    assert len(read_records(p).records) == 1
    m = Journal(None)
    recs = _fill(m)
    assert [r.seq for r in recs] == [1, 2, 3, 4, 5] and m.state().reset_gen == {5: 2**40}


@pytest.mark.parametrize("bad", [dict(digest=b"x"), dict(segment=-1), dict(segment=2**32), dict(value=2**64)])
def test_bad_fields_are_refused_and_buffer_nothing(tmp_path, bad):
    j = Journal(str(tmp_path / "j"))
    with pytest.raises(LayoutError):
        j.append(K.BLOCK_DEAD, **bad)
    assert j.commit() == 0 and j.next_seq == 1


def test_torn_tail_at_every_byte_of_the_last_record_keeps_the_earlier_ones(tmp_path):
    p = str(tmp_path / "j")
    with Journal(p) as j:
        recs = _fill(j)
    full = open(p, "rb").read()
    last = len(full) - jr.RECORD_BYTES
    for cut in range(last, len(full)):
        with open(p, "wb") as f:
            f.write(full[:cut])
        j = Journal(p)
        assert j.records == recs[:-1], cut
        assert j.opened.tail_bytes == cut - last and os.path.getsize(p) == last  # the torn bytes are cut off
        assert j.append(K.NS_INVALIDATE, value=99, digest=NS_B) == 5  # the chain continues
        j.close()
        back = read_records(p)
        assert back.records[:4] == recs[:4] and back.records[4].value == 99 and back.tail_bytes == 0


def test_garbage_after_the_last_record_is_a_torn_tail(tmp_path):
    p = str(tmp_path / "j")
    with Journal(p) as j:
        recs = _fill(j)
    with open(p, "ab") as f:
        f.write(os.urandom(100))
    j = Journal(p)
    assert j.records == recs and j.stats["torn_tail_bytes"] == 100
    j.close()


def test_crc_flip_stops_reading_there(tmp_path):
    p = str(tmp_path / "j")
    with Journal(p) as j:
        recs = _fill(j)
    data = bytearray(open(p, "rb").read())
    # a flipped bit in record 2 (the middle): reading stops before it, and since good records follow,
    # opening refuses (damage, not a tear) and changes nothing
    at = jr.HEADER_BYTES + 2 * jr.RECORD_BYTES + 20
    data[at] ^= 0x10
    with open(p, "wb") as f:
        f.write(data)
    res = read_records(p)
    assert res.records == recs[:2] and res.good_after_bad == 2
    with pytest.raises(CorruptData, match="damaged") as ei:
        Journal(p)
    assert "move this file aside" in str(ei.value)  # the remedy (fresh-user trial 10: none was said)
    assert open(p, "rb").read() == bytes(data)
    # the same flip in the last record is a torn tail: cut, the rest kept
    data[at] ^= 0x10
    data[jr.HEADER_BYTES + 4 * jr.RECORD_BYTES + 3] ^= 0x01
    with open(p, "wb") as f:
        f.write(data)
    j = Journal(p)
    assert j.records == recs[:4]
    j.close()


def test_a_stale_record_with_the_wrong_sequence_number_is_the_end(tmp_path):
    """A well-formed record whose seq32 is not its position's (left from another file) is not read."""
    p = str(tmp_path / "j")
    with Journal(p) as j:
        recs = _fill(j)
    stale = jr._pack(JournalRecord(K.NS_INVALIDATE, value=5, digest=NS_B), 77)
    with open(p, "ab") as f:
        f.write(stale)
    assert read_records(p).records == recs
    assert Journal(p).records == recs


def test_refuses_a_file_it_did_not_create(tmp_path):
    """A user's file is foreign data (ForeignDataError, as every other refused file of the user's),
    not a damaged journal (fresh-user trial: CorruptData read as if tierstore's journal broke)."""
    p = tmp_path / "j"
    for data in (b"user data, not a journal" * 10, b"short"):
        p.write_bytes(data)
        with pytest.raises(ForeignDataError, match="not a tierstore journal"):
            Journal(str(p))
        assert p.read_bytes() == data
    good = tmp_path / "good"
    Journal(str(good)).close()
    head = bytearray(good.read_bytes())
    head[-1] ^= 0xFF  # tierstore's magic with a wrong header CRC: damaged, not foreign
    p.write_bytes(bytes(head))
    with pytest.raises(CorruptData) as e:
        Journal(str(p))
    assert not isinstance(e.value, ForeignDataError)


def _hand_sequence() -> tuple[list[tuple], list[int]]:
    """Records (kind, segment, gen, value, digest) and the indices compaction must keep."""
    recs = [
        (K.NS_INVALIDATE, 0, 0, 5, NS_A),  # 0: superseded by 6 (larger write_seq)
        (K.BLOCK_DEAD, 1, 10, 4096, key(1)),  # 1: gen 10 of segment 1 is reset by 4: dropped
        (K.BLOCK_DEAD, 2, 20, 4096, key(2)),  # 2: kept (segment 2 never reset)
        (K.BLOCK_DEAD, 1, 10, 36864, key(3)),  # 3: dropped (reset by 4)
        (K.SEGMENT_RESET, 1, 10, 0, bytes(32)),  # 4: superseded by 8 (larger gen)
        (K.BLOCK_DEAD, 1, 30, 4096, key(4)),  # 5: gen 30 > reset 10... but 8 resets 30: dropped
        (K.NS_INVALIDATE, 0, 0, 9, NS_A),  # 6: kept (largest for NS_A)
        (K.NS_INVALIDATE, 0, 0, 3, NS_B),  # 7: kept (only one for NS_B)
        (K.SEGMENT_RESET, 1, 30, 0, bytes(32)),  # 8: kept (latest reset of segment 1)
        (K.BLOCK_DEAD, 1, 40, 4096, key(5)),  # 9: kept (gen 40 after the reset of 30)
        (K.BLOCK_DEAD, 2, 20, 4096, key(6)),  # 10: the same slot as 2 again: the last one is kept, 2 goes
        (K.NS_INVALIDATE, 0, 0, 9, NS_A),  # 11: equal to 6: the first is kept
    ]
    return recs, [6, 7, 8, 9, 10]


def test_compaction_keeps_exactly_the_live_set(tmp_path):
    p = str(tmp_path / "j")
    j = Journal(p)
    recs, keep = _hand_sequence()
    for r in recs:
        j.append(*r)
    j.commit()
    before = j.state()
    assert [r.seq for r in live_records(j.records)] == [k + 1 for k in keep]
    assert j.compact() == len(keep)
    back = read_records(p)
    assert [(r.kind, r.segment, r.segment_gen, r.value, r.digest) for r in back.records] == [
        recs[i] for i in keep
    ]
    assert [r.seq for r in back.records] == [8, 9, 10, 11, 12]  # renumbered to end before next_seq (13)
    assert JournalState.of(back.records) == before == j.state()
    assert not os.path.exists(p + ".tmp")
    assert j.append(K.NS_INVALIDATE, value=1, digest=key(7)) == 13
    j.close()
    again = Journal(p)
    assert len(again.records) == 6 and again.records[-1].seq == 13 and again.records[-1].digest == key(7)
    again.close()


def test_compaction_is_tmp_sync_rename_then_directory_sync(tmp_path, monkeypatch):
    p = str(tmp_path / "j")
    j = Journal(p)
    for r in _hand_sequence()[0]:
        j.append(*r)
    j.commit()
    log: list = []
    real = {n: getattr(os, n) for n in ("open", "fdatasync", "fsync", "rename")}
    names: dict = {}

    def op(name):
        def f(*a, **kw):
            if name == "open":
                fd = real["open"](*a, **kw)
                names[fd] = a[0]
                return fd
            log.append((name, names.get(a[0], a[0]) if name != "rename" else a))
            return real[name](*a, **kw)

        return f

    for n in real:
        monkeypatch.setattr(os, n, op(n))
    j.compact()
    monkeypatch.undo()
    assert log == [("fdatasync", p + ".tmp"), ("rename", (p + ".tmp", p)), ("fsync", str(tmp_path))]
    j.close()


def test_a_crash_before_the_rename_keeps_the_old_journal_and_removes_the_tmp(tmp_path, monkeypatch):
    p = str(tmp_path / "j")
    j = Journal(p)
    for r in _hand_sequence()[0]:
        j.append(*r)
    j.commit()
    old = open(p, "rb").read()

    def crash(*a):
        raise OSError(5, "simulated crash before the rename")

    monkeypatch.setattr(os, "rename", crash)
    with pytest.raises(OSError):
        j.compact()
    monkeypatch.undo()
    assert open(p, "rb").read() == old and os.path.exists(p + ".tmp")  # what a crash leaves
    assert len(j.records) == 12  # still the old journal
    j.append(K.NS_INVALIDATE, value=1, digest=key(8))
    j.close()
    reopened = Journal(p)  # the next open removes the .tmp
    assert not os.path.exists(p + ".tmp") and len(reopened.records) == 13
    reopened.close()


def test_a_failed_commit_leaves_nothing_half_written(tmp_path, monkeypatch):
    p = str(tmp_path / "j")
    j = Journal(p)
    j.append(K.NS_INVALIDATE, value=1, digest=NS_A)
    j.commit()
    size = os.path.getsize(p)
    j.append(K.BLOCK_DEAD, segment=1, segment_gen=1, value=4096, digest=key(1))

    def eio(fd):
        raise OSError(5, "simulated EIO")

    monkeypatch.setattr(os, "fdatasync", eio)
    with pytest.raises(OSError):
        j.commit()
    monkeypatch.undo()
    assert os.path.getsize(p) == size and j.committed_seq == 1
    assert j.commit() == 2  # retried: now durable
    j.close()
    assert [r.seq for r in Journal(p).records] == [1, 2]


def _legacy_log(tmp_path, invalidations) -> str:
    """A legacy ``.invalidations`` file written by the segment store itself."""
    from tierstore.io.segments import SegmentStorage

    path = str(tmp_path / "store.nvme")
    st = SegmentStorage(path, 8 * (1 << 20), 4096, segment_size_bytes=1 << 20, engine="posix")
    try:
        for ns in invalidations:
            st.invalidate_namespace(ns)
    finally:
        st.close()
    return path + ".invalidations"


def test_reads_the_legacy_invalidation_log(tmp_path):
    legacy = _legacy_log(tmp_path, [NS_A, NS_B, NS_A])
    got = jr.read_legacy_invalidations(legacy)
    assert set(got) == {NS_A, NS_B} and all(v >= 1 for v in got.values())
    assert os.path.getsize(legacy) == 3 * 44
    with open(legacy, "ab") as f:  # a torn legacy tail (a whole record's bytes, bad CRC) is ignored
        f.write(b"\x07" * (44 + 30))
    assert jr.read_legacy_invalidations(legacy) == got
    assert jr.read_legacy_invalidations(str(tmp_path / "absent")) == {}
    j = Journal(str(tmp_path / "j"))
    assert j.import_legacy_invalidations(legacy) == 2
    assert j.state().invalidated == got
    assert j.import_legacy_invalidations(legacy) == 0  # already covered
    assert JournalState.of([], legacy=got).invalidated == got
    j.close()
