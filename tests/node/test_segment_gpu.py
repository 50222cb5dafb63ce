"""The segment registered with CUDA (``cudaHostRegister`` on the mapping, the ``gpu`` path): rank
columns become page-locked, device copies into and out of them are exact, and unregistering
undoes it. Without CUDA only the refusal runs here; the GPU tests skip, saying why."""

from __future__ import annotations

import os
import uuid

import pytest
import torch

from tierstore.node.segment import Segment, SegmentError

CUDA = torch.cuda.is_available()


def _segment(**kw) -> Segment:
    return Segment.create(f"g{uuid.uuid4().hex[:12]}", **kw)


@pytest.mark.skipif(CUDA, reason="checks the refusal without CUDA")
def test_registering_without_cuda_is_a_clear_error():
    with _segment(block_bytes=4096, host_slots=2) as seg:
        with pytest.raises(SegmentError, match="needs a CUDA device"):
            seg.register_cuda()
        assert not seg.cuda_registered
        seg.unregister_cuda()  # nothing to undo


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_registered_columns_are_pinned_and_device_copies_are_exact():
    with _segment(block_bytes=2 << 20, host_slots=4, staging_slots=2) as seg:
        rank0, rank1 = seg.column(0, 1 << 20), seg.column(1 << 20, 1 << 20)
        assert not rank0.view(0).is_pinned()
        seg.register_cuda()
        seg.register_cuda()  # idempotent
        assert seg.cuda_registered and rank0.view(0).is_pinned() and rank1.data.is_pinned()
        g = torch.Generator(device="cuda").manual_seed(0)
        shard = torch.randint(0, 256, (1 << 20,), dtype=torch.uint8, device="cuda", generator=g)
        rank1.view(5).copy_(shard, non_blocking=True)  # D2H straight into the slot (a gather)
        back = torch.empty_like(shard)
        back.copy_(rank1.view(5), non_blocking=True)  # H2D from it (a scatter)
        torch.cuda.synchronize()
        assert torch.equal(back, shard)
        assert torch.equal(rank1.view(5).to("cuda"), shard)
        assert int(rank0.view(5).count_nonzero()) == 0  # the other rank's column is untouched
        seg.unregister_cuda()
        assert not seg.cuda_registered and not rank0.view(0).is_pinned()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_a_readonly_mapping_registers_read_only_and_serves_loads():
    with _segment(block_bytes=1 << 20, host_slots=2) as seg:
        seg.column(0, 1 << 20).view(1).fill_(0x5C)
        peer = Segment.attach(seg.readonly_fd(), block_bytes=1 << 20)
        try:
            peer.register_cuda()  # cudaHostRegisterReadOnly: a PROT_READ range
            col = peer.column(0, 1 << 20)
            assert col.view(1).is_pinned()
            dev = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
            dev.copy_(col.view(1), non_blocking=True)
            torch.cuda.synchronize()
            assert bool((dev == 0x5C).all())
        finally:
            peer.close()  # unregisters before unmapping
        assert not peer.cuda_registered
        assert os.fstat(seg.fd).st_size == seg.size_bytes
