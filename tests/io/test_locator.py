"""BlockLocator (io/locator.py): key -> (segment, offset, length), the extents remove() frees,
copy-forward replacement, namespaces, and growth past the initial rows."""

import numpy as np
import pytest

from tierstore.errors import LayoutError
from tierstore.io import format as fmt
from tierstore.io.locator import BlockLocator

SEG = 1 << 20
SLOT = 8192
NS_A, NS_B = b"a" * 32, b"b" * 32


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def entries(keys, ns=NS_A, first_offset=4096):
    return [fmt.BlockEntry(k, ns, first_offset + j * SLOT, 5000, 1000 + j) for j, k in enumerate(keys)]


def test_commit_then_locate_find_and_scan():
    loc = BlockLocator(16, SEG, SLOT)
    ks = [key(i) for i in range(3)]
    rows, replaced = loc.commit(3 * SEG + 8192, 7, entries(ks))
    assert replaced.size == 0 and len(loc) == 3
    assert loc.locate(ks[1]) == (3, 3 * SEG + 8192 + 4096 + SLOT, SLOT)
    assert loc.locate(key(99)) is None
    found = loc.find([key(99), ks[2], ks[0]])
    assert found == [(3 * SEG + 8192 + 4096 + 2 * SLOT, 1, 1002), (3 * SEG + 8192 + 4096, 2, 1000)]
    got = loc.scan()
    assert sorted(got.keys) == sorted(ks) and set(got.ns_digests) == {NS_A}
    assert got.write_seqs.tolist() == [7, 7, 7]
    assert loc.entries() == dict.fromkeys(ks, (NS_A, 7))


def test_a_newer_copy_reports_the_offsets_it_replaces():
    loc = BlockLocator(16, SEG, SLOT)
    ks = [key(i) for i in range(4)]
    loc.commit(0, 1, entries(ks))
    old = [loc.locate(k)[1] for k in ks[1:3]]
    rows, replaced = loc.commit(5 * SEG, 2, entries([ks[1], key(50), ks[2]]))
    assert sorted(replaced.tolist()) == sorted(old)
    assert len(loc) == 5
    assert loc.locate(ks[1])[0] == 5 and loc.locate(ks[0])[0] == 0


def test_remove_returns_the_freed_extents_in_key_order_and_skips_absent_keys():
    loc = BlockLocator(16, SEG, SLOT)
    ks = [key(i) for i in range(4)]
    loc.commit(2 * SEG, 1, entries(ks))
    offs = {k: loc.locate(k)[1] for k in ks}
    freed = loc.remove([ks[3], key(77), ks[0], ks[3]])
    assert freed == [(offs[ks[3]], SLOT), (offs[ks[0]], SLOT)]
    assert len(loc) == 2 and loc.row(ks[0]) < 0
    assert loc.remove([]) == []


def test_remove_at_forgets_a_key_only_when_its_copy_lies_in_the_range():
    loc = BlockLocator(16, SEG, SLOT)
    k = key(1)
    loc.commit(SEG, 1, entries([k]))
    off = loc.locate(k)[1]
    assert not loc.remove_at(k, 2 * SEG, 3 * SEG)  # another segment: the copy stays
    assert not loc.remove_at(k, off + 1, off + 2)
    assert loc.row(k) >= 0
    assert loc.remove_at(k, off, off + 1)
    assert loc.row(k) < 0 and not loc.remove_at(k, 0, 10 * SEG)


def test_namespaces_are_interned_and_listed():
    loc = BlockLocator(16, SEG, SLOT)
    a = [key(i) for i in range(3)]
    b = [key(i) for i in range(10, 12)]
    loc.commit(0, 1, entries(a, NS_A))
    loc.commit(SEG, 2, entries(a[:1], NS_A) + entries(b, NS_B, first_offset=4096 + SLOT))
    assert loc.rows_of_namespace(b"z" * 32) is None
    assert sorted(loc.keys_of(loc.rows_of_namespace(NS_B))) == sorted(b)
    assert sorted(loc.keys_of(loc.rows_of_namespace(NS_A))) == sorted(a)
    assert loc.namespace_of(loc.row(b[0])) == NS_B
    assert loc.namespaces.digests.count(NS_B) == 1


def test_rows_in_selects_live_rows_of_a_device_range():
    loc = BlockLocator(16, SEG, SLOT)
    ks = [key(i) for i in range(3)]
    rows, _ = loc.commit(SEG, 1, entries(ks))
    loc.remove([ks[1]])
    assert loc.rows_in(np.unique(rows), SEG, 2 * SEG).tolist() == sorted([loc.row(ks[0]), loc.row(ks[2])])
    assert loc.rows_in(np.unique(rows), 0, SEG).size == 0


def test_grows_past_its_initial_rows_and_keeps_every_location():
    loc = BlockLocator(4, SEG, SLOT)
    before = loc.nbytes
    n = 3000
    for a in range(0, n, 100):
        loc.commit(a * SLOT, a + 1, entries([key(i) for i in range(a, a + 100)], first_offset=0))
    assert len(loc) == n and loc.nbytes > before
    assert all(loc.locate(key(i))[1] == i * SLOT for i in range(0, n, 7))
    assert loc.place(key(5), 123 * 4096, 9, 99, NS_B) == loc.row(key(5))
    assert loc.locate(key(5))[1] == 123 * 4096 and loc.entries()[key(5)] == (NS_B, 99)


def test_offsets_are_4096_units_in_uint32_below_16_tib_and_int64_bytes_above():
    small = BlockLocator(16, SEG, SLOT, device_bytes=64 * SEG)
    big = BlockLocator(16, SEG, SLOT, device_bytes=(4096 << 32) + SEG)
    assert small.nbytes < big.nbytes  # 4 bytes a row fewer
    ks = [key(i) for i in range(3)]
    small.commit(63 * SEG, 1, entries(ks))
    assert small.locate(ks[2]) == (63, 63 * SEG + 4096 + 2 * SLOT, SLOT)
    assert small.offsets(small.rows_of(ks)).tolist() == [63 * SEG + 4096 + j * SLOT for j in range(3)]
    top = (4096 << 32) + 4096  # past uint32 counts of 4096: the wide column keeps it exactly
    big.place(ks[0], top, 7, 1, NS_A)
    assert big.locate(ks[0]) == (top // SEG, top, SLOT)


def test_an_offset_a_narrow_column_cannot_hold_is_refused_and_nothing_is_stored():
    loc = BlockLocator(16, SEG, SLOT, device_bytes=4 * SEG)
    loc.commit(0, 1, entries([key(1)]))
    with pytest.raises(LayoutError, match="multiples of 4096"):
        loc.place(key(1), SEG + 512, 1, 2, NS_A)
    with pytest.raises(LayoutError):
        loc.commit(4 * SEG, 3, entries([key(2)]))  # at the device's end
    assert loc.locate(key(1)) == (0, 4096, SLOT)


def test_seqs_are_exact_across_rebases_and_widen_when_live_seqs_span_2_to_the_32():
    loc = BlockLocator(16, SEG, SLOT, device_bytes=64 * SEG)
    first = 5 << 40
    seqs = [first, first - 3, first + (1 << 31) + 9, first + (1 << 32) - 5]  # the last two rebase the column
    for i, s in enumerate(seqs):
        loc.place(key(i), i * SEG, 0, s, NS_A)
    assert loc.seqs(loc.rows_of([key(i) for i in range(4)])).tolist() == seqs
    assert loc._seq.dtype == np.uint32
    loc.remove([key(1)])  # the oldest left is `first`: the next spans more than 2**32 with it
    loc.place(key(9), 9 * SEG, 0, first + (1 << 32), NS_A)
    assert loc._seq.dtype == np.int64
    assert sorted(loc.scan().write_seqs.tolist()) == sorted([*seqs[:1], *seqs[2:], first + (1 << 32)])
    assert loc.entries()[key(0)] == (NS_A, first) and loc.entries()[key(9)] == (NS_A, first + (1 << 32))


def test_namespace_ids_widen_past_uint16():
    loc = BlockLocator(16, SEG, SLOT)
    for i in range(1 << 16):  # ids 1..65536 with the zero digest's 0
        loc.namespaces.intern(i.to_bytes(32, "little") if i else b"\xff" * 32)
    ns = (1 << 16).to_bytes(32, "little")
    assert loc.ns_id.dtype == np.uint16
    loc.commit(0, 1, entries([key(1)], ns))
    assert loc.ns_id.dtype == np.int32 and loc.namespace_of(loc.row(key(1))) == ns


def test_scan_and_copy_forward_keep_the_locator_s_own_row_order_in_a_shared_table():
    """The block index holds keys in the locator's table (rows numbered by both sides'
    history); scan (the index's adoption order at open, invalidation) and a reclaimed
    segment's copy-forward (SegmentManager.live_rows) still list the locator's blocks in the
    order of a table of its own: its ascending rows, freed rows reused last freed first."""
    import hashlib
    from types import SimpleNamespace

    from tierstore.io.segment_manager import SegmentManager
    from tierstore.keytable import INDEX

    def h(i: int) -> bytes:  # digests, as block keys are: key order is no age order
        return hashlib.sha256(i.to_bytes(8, "little")).digest()

    def run(shared: bool):
        loc = BlockLocator(16, SEG, SLOT)
        members = []
        for i in range(8):
            if shared:  # the index takes rows between the locator's, and frees some
                loc.key_table.add_absent([h(1000 + 3 * i + j) for j in range(3)], INDEX)
                if i % 2:
                    loc.key_table.remove(h(1000 + 3 * i - 3), holder=INDEX)
            rows, _ = loc.commit(
                i % 2 * SEG, i, entries([h(4 * i + j) for j in range(4)], first_offset=i * 4 * SLOT)
            )
            members += rows.tolist()
            if i % 3 == 2:
                loc.remove([h(4 * i - 3), h(4 * i)])
        segs = SimpleNamespace(members=[np.array(members, dtype=np.int32).tobytes()] * 2, segment_bytes=SEG)
        forward = [loc.keys_of(SegmentManager.live_rows(segs, si, loc).tolist()) for si in (0, 1)]  # type: ignore[arg-type]
        return loc, loc.scan().keys, forward

    own, keys, forward = run(False)
    assert len(keys) == 32 - 4 and keys == sorted(keys, key=own.row)  # its rows, ascending
    assert forward == [[k for k in keys if own.locate(k)[0] == si] for si in (0, 1)]
    _, keys2, forward2 = run(True)
    assert keys2 == keys and forward2 == forward
