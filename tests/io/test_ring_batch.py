"""``Ring.prep_rw_batch`` and ``Ring.reap_results``: many SQEs packed in one call, every CQE reaped in
one, as ``tierstore bench``'s io_uring loop uses them (issue 22, item 8)."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from tierstore.io import alloc_aligned
from tierstore.io import ring as R

pytestmark = pytest.mark.uring

BS = 4096


@pytest.fixture
def direct_fd(tmp_path):
    fd = os.open(tmp_path / "batch.bin", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    os.ftruncate(fd, 64 * BS)
    yield fd
    os.close(fd)


def test_a_batch_of_writes_then_reads_round_trips(direct_fd):
    keep, buf = alloc_aligned(16 * BS)
    try:
        src = torch.arange(16 * BS, dtype=torch.int64).to(torch.uint8)
        buf.copy_(src)
        addrs = [buf.data_ptr() + i * BS for i in range(16)]
        offsets = [(15 - i) * 4 * BS for i in range(16)]  # scattered, out of order
        with R.Ring(16) as ring:
            ring.prep_rw_batch(R.IORING_OP_WRITE, direct_fd, addrs, BS, offsets, list(range(100, 116)))
            assert ring.sq_pending() == 16
            ring.submit(16)
            got = ring.reap_results()
            assert sorted(ud for ud, _, _ in got) == list(range(100, 116)) and {res for _, res, _ in got} == {
                BS
            }
            buf.zero_()
            ops = [R.IORING_OP_READ] * 16
            ring.prep_rw_batch(ops, direct_fd, addrs, BS, offsets, list(range(16)))
            ring.submit(16)
            assert len(ring.reap_results()) == 16
        assert torch.equal(buf, src)
    finally:
        del buf
        keep.close()


def test_reap_results_across_the_end_of_the_cq(direct_fd):
    """The CQ (32 entries for a 16-entry SQ) wraps: completions before and after the end come back in
    order."""
    keep, buf = alloc_aligned(BS)
    try:
        with R.Ring(16) as ring:
            seen = []
            for batch in range(7):  # 7 x 10 = 70 completions: the head wraps twice
                uds = list(range(batch * 10, batch * 10 + 10))
                ring.prep_rw_batch(R.IORING_OP_READ, direct_fd, [buf.data_ptr()] * 10, BS, [0] * 10, uds)
                ring.submit(10)
                got = ring.reap_results()
                assert [res for _, res, _ in got] == [BS] * 10
                seen += [ud for ud, _, _ in got]
            assert sorted(seen) == list(range(70)) and ring.cq_ready() == 0
    finally:
        del buf
        keep.close()


def test_bad_batches_queue_nothing(direct_fd):
    with R.Ring(4) as ring:
        with pytest.raises(R.IoUringError) as busy:
            ring.prep_rw_batch(R.IORING_OP_NOP, -1, [0] * 5, 0, [0] * 5, list(range(5)))
        assert busy.value.errno == errno.EBUSY
        with pytest.raises(R.IoUringError) as bad:
            ring.prep_rw_batch([R.IORING_OP_NOP] * 2, -1, [0] * 3, 0, [0] * 3, list(range(3)))
        assert bad.value.errno == errno.EINVAL
        assert ring.sq_pending() == 0
        ring.prep_rw_batch(R.IORING_OP_NOP, -1, [0] * 4, 0, [0] * 4, [7, 8, 9, 10])
        ring.submit(4)
        assert sorted(ud for ud, _, _ in ring.reap_results()) == [7, 8, 9, 10]
    with pytest.raises(R.IoUringError) as closed:
        ring.prep_rw_batch(R.IORING_OP_NOP, -1, [0], 0, [0], [1])
    assert closed.value.errno == errno.EBADF
    with R.Ring(4, sqe128=True, cqe32=True) as big:
        with pytest.raises(R.IoUringError) as wide:
            big.prep_rw_batch(R.IORING_OP_NOP, -1, [0], 0, [0], [1])
        assert wide.value.errno == errno.EINVAL
