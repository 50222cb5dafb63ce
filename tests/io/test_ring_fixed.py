"""``Ring.fix_rw_slots`` / ``Ring.prep_fixed`` / ``Ring.submit_reap_results``: SQE ``i`` fixed to buffer
slot ``i``, an I/O queued by its offset (and opcode), as ``tierstore bench``'s io_uring loop drives
its ring (issue 22, item 8)."""

from __future__ import annotations

import errno
import os
import struct

import pytest
import torch

from tierstore.io import alloc_aligned
from tierstore.io import ring as R

pytestmark = pytest.mark.uring

BS = 4096
_SQE = struct.Struct("<BBHiQQIIQHHiQQ")


@pytest.fixture
def direct_fd(tmp_path):
    fd = os.open(tmp_path / "fixed.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.ftruncate(fd, 64 * BS)
    yield fd
    os.close(fd)


@pytest.fixture
def slots8():
    keep, buf = alloc_aligned(8 * BS)
    yield buf, [buf.data_ptr() + i * BS for i in range(8)]
    del buf
    keep.close()


def _pattern(block: int) -> torch.Tensor:
    return torch.full((BS,), block % 251 + 1, dtype=torch.uint8)


def test_fixed_slots_write_then_read_back_the_same_bytes(direct_fd, slots8):
    """Writes through fixed slots, in turns that reuse slots out of order, then reads back into the same
    slots: every block read equals the block written at that offset."""
    buf, addrs = slots8
    with R.Ring(8) as ring:
        ring.fix_rw_slots(R.IORING_OP_WRITE, direct_fd, addrs, BS)
        for turn in range(8):  # 8 turns x 8 blocks = the whole file
            slots = [7, 2, 5, 0, 3, 6, 1, 4] if turn % 2 else list(range(8))
            offsets = [(turn * 8 + i) * BS for i in range(8)]
            for slot, off in zip(slots, offsets):
                buf[slot * BS : (slot + 1) * BS] = _pattern(off // BS)
            ring.prep_fixed(slots, offsets)
            got = []
            while len(got) < 8:
                got += ring.submit_reap_results(8 - len(got))
            assert sorted(ud for ud, _, _ in got) == list(range(8)) and {res for _, res, _ in got} == {BS}
        buf.zero_()
        for turn in range(8):
            offsets = [(63 - turn * 8 - i) * BS for i in range(8)]  # the file backwards
            ring.prep_fixed(list(range(8)), offsets, [R.IORING_OP_READ] * 8)
            got = []
            while len(got) < 8:
                got += ring.submit_reap_results(1)
            assert {res for _, res, _ in got} == {BS}
            for slot, off in enumerate(offsets):
                assert torch.equal(buf[slot * BS : (slot + 1) * BS], _pattern(off // BS)), (turn, slot)


def test_prep_fixed_queues_the_slot_sqe_with_its_offset_and_opcode(direct_fd, slots8):
    _, addrs = slots8
    with R.Ring(8) as ring:
        ring.fix_rw_slots(R.IORING_OP_READ, direct_fd, addrs, BS)
        ring.prep_fixed([5, 1], [3 * BS, 9 * BS], [R.IORING_OP_WRITE, R.IORING_OP_READ])
        assert ring.sq_pending() == 2
        op, _, _, fd, off, addr, nbytes, _, ud, *_ = _SQE.unpack(ring.sqe_bytes_at(-2))
        assert (op, fd, off, addr, nbytes, ud) == (R.IORING_OP_WRITE, direct_fd, 3 * BS, addrs[5], BS, 5)
        op, _, _, fd, off, addr, nbytes, _, ud, *_ = _SQE.unpack(ring.sqe_bytes_at(-1))
        assert (op, off, addr, ud) == (R.IORING_OP_READ, 9 * BS, addrs[1], 1)
        assert sorted(ring.unpublish()) == [1, 5]  # the SQ index array, not the ring position, names them


def test_a_fixed_ring_refuses_what_would_break_the_slot_mapping(direct_fd, slots8):
    _, addrs = slots8
    with R.Ring(8) as ring:
        with pytest.raises(R.IoUringError) as e:
            ring.prep_fixed([0], [0])  # not fixed yet
        assert e.value.errno == errno.EINVAL
        with pytest.raises(R.IoUringError) as e:
            ring.fix_rw_slots(R.IORING_OP_READ, direct_fd, addrs + addrs, BS)  # 16 slots, 8 SQEs
        assert e.value.errno == errno.EINVAL
        ring.fix_rw_slots(R.IORING_OP_READ, direct_fd, addrs, BS)
        for call in (
            lambda: ring.prep_read(direct_fd, addrs[0], BS, 0, 1),
            lambda: ring.prep_rw_batch(R.IORING_OP_READ, direct_fd, addrs[:1], BS, [0], [1]),
            lambda: ring.fix_rw_slots(R.IORING_OP_READ, direct_fd, addrs, BS),
            lambda: ring.prep_fixed([0, 1], [0]),
            lambda: ring.prep_fixed([8], [0]),
            lambda: ring.prep_fixed([-1], [0]),
        ):  # 8 slots: 0..7
            with pytest.raises(R.IoUringError) as e:
                call()
            assert e.value.errno == errno.EINVAL
        ring.prep_fixed(list(range(8)), [0] * 8)
        with pytest.raises(R.IoUringError) as e:
            ring.prep_fixed([0], [0])  # the SQ is full
        assert e.value.errno == errno.EBUSY and ring.sq_pending() == 8
        got = []
        while len(got) < 8:
            got += ring.submit_reap_results(1)
    assert ring.fd == -1  # closed with its views of the SQ released


def test_submit_reap_results_without_anything_to_do_returns_nothing():
    with R.Ring(4) as ring:
        assert ring.submit_reap_results(0) == []
        ring.prep_nop(7)
        assert ring.submit_reap_results(1) == [(7, 0, 0)]
