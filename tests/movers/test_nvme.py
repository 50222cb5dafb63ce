"""The NVMe handler on an in-memory SegmentStorage: a batch written in one put and read back,
placement tags and namespaces passed through, OSError -> IO_ERROR, reads under the load gate."""

from __future__ import annotations

import pytest
import torch

from tierstore.errors import Status
from tierstore.io.pages import FragmentPlan
from tierstore.movers import LoadGate, NvmeBatch, NvmeHandler

from ..conftest import memory_segment_store


@pytest.fixture
def storage(layout):
    s = memory_segment_store(layout, 8)
    yield s
    s.close()


def key(i: int) -> bytes:
    return bytes([i]) * 32


def block(bb: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (bb,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def batch_of(bb: int, ids, ns: bytes = b"n" * 32) -> NvmeBatch:
    b = NvmeBatch()
    for i in ids:
        b.add(key(i), [block(bb, i)], None, ns)
    return b


def dests(bb: int, n: int):
    out = torch.zeros(n, bb, dtype=torch.uint8)
    return out, [FragmentPlan.of_bytes(r, destination=True) for r in out.unbind(0)]


def test_write_then_read_back(storage, monkeypatch):
    bb = storage.block_bytes
    nvme = NvmeHandler(storage)
    calls = []
    real = storage.put_fragments
    monkeypatch.setattr(storage, "put_fragments", lambda *a: calls.append(a) or real(*a))
    assert nvme.write(batch_of(bb, [1, 2, 3])) == [Status.OK] * 3
    assert len(calls) == 1  # one put per batch
    keys, _frags, placements, nss = calls[0]
    assert keys == [key(1), key(2), key(3)] and placements == [None] * 3 and nss == [b"n" * 32] * 3
    assert nvme.write(batch_of(bb, [2])) == [Status.EXISTS]
    out, plans = dests(bb, 3)
    st, secs = nvme.read([key(3), key(9), key(1)], plans)
    assert st == [Status.OK, Status.MISS, Status.OK] and secs >= 0
    assert torch.equal(out[0], block(bb, 3)) and torch.equal(out[2], block(bb, 1)) and not out[1].any()
    # a prefetch reads into a memory slot: a list of tensors works the same
    slot = torch.zeros(bb, dtype=torch.uint8)
    assert nvme.read([key(2)], [[slot]])[0] == [Status.OK] and torch.equal(slot, block(bb, 2))
    assert {bytes(k) for k in storage.scan().keys} == {key(1), key(2), key(3)}


def test_os_error_is_io_error_for_every_block(storage, monkeypatch):
    bb = storage.block_bytes
    nvme = NvmeHandler(storage)

    def fail(*_a, **_k):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(storage, "put_fragments", fail)
    assert nvme.write(batch_of(bb, [1, 2])) == [Status.IO_ERROR] * 2
    monkeypatch.setattr(storage, "get_fragments", fail)
    out, plans = dests(bb, 2)
    st, _secs = nvme.read([key(1), key(2)], plans)
    assert st == [Status.IO_ERROR] * 2 and not out.any()


def test_reads_run_under_the_gate_with_the_load_positions(storage):
    bb = storage.block_bytes
    nvme = NvmeHandler(storage)
    assert nvme.write(batch_of(bb, [1, 2])) == [Status.OK] * 2
    gate = LoadGate()
    out, plans = dests(bb, 2)
    st, _ = nvme.read([key(1), key(2)], plans, gate.at([5, 7]))  # blocks 5 and 7 of some load
    assert st == [Status.OK] * 2 and gate.delivered == {5, 7}
    gate.close()
    out, plans = dests(bb, 2)
    st, _ = nvme.read([key(1), key(2)], plans, gate.at([5, 7]))  # past the deadline: nothing lands
    assert st == [Status.MISS] * 2 and not out.any()
