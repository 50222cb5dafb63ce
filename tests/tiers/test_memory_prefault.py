"""BlockPool.prefault: a CPU pool's pages are allocated up front, its bytes unchanged (issue 25)."""

from __future__ import annotations

import ctypes
import mmap

import pytest
import torch

from tierstore.tiers.memory import BlockPool

pytestmark = pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mincore"), reason="no mincore(2)")


def resident_fraction(t: torch.Tensor) -> float:
    """Share of the pages under ``t`` (rounded out to whole pages) that are resident, by mincore(2)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    page = mmap.PAGESIZE
    lo = t.data_ptr() // page * page
    hi = -(-(t.data_ptr() + t.numel() * t.element_size()) // page) * page
    vec = (ctypes.c_ubyte * ((hi - lo) // page))()
    assert libc.mincore(lo, hi - lo, vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec) / len(vec)


def test_prefault_makes_every_page_resident_and_keeps_the_bytes():
    # a fresh anonymous mapping: no page resident yet (a torch.empty of 16 MiB may come from
    # memory the allocator reuses, already resident, once earlier tests freed large buffers)
    buf = mmap.mmap(-1, 16 << 20)
    pool = BlockPool.from_tensor("host", torch.frombuffer(buf, dtype=torch.uint8).view(16, 1 << 20))
    assert resident_fraction(pool.data) < 0.5  # what a first copy into each slot would fault in
    pool.data[3].fill_(7)  # a slot in use while the rest is populated
    if not pool.prefault(chunk_bytes=3 << 20):
        pytest.skip("kernel without MADV_POPULATE_WRITE (Linux < 5.14)")
    assert resident_fraction(pool.data) == 1.0
    assert bool((pool.data[3] == 7).all())


def test_prefault_of_rows_apart_covers_the_last_row():
    """A from_tensor pool whose rows are further apart than block_bytes (a node segment's
    page-rounded slots): the range ends at the last row's last byte, not at numel bytes."""
    backing = torch.empty(8 * 3 * (1 << 20), dtype=torch.uint8)
    rows = backing.as_strided((8, 1 << 20), (3 << 20, 1))
    pool = BlockPool.from_tensor("host", rows)
    if not pool.prefault():
        pytest.skip("kernel without MADV_POPULATE_WRITE (Linux < 5.14)")
    assert resident_fraction(rows[7]) == 1.0


def test_prefault_of_a_pool_of_its_own_memory_leaves_it_resident():
    """The daemon's pool (``BlockPool(name, n, block_bytes)``, its memory from torch.empty)."""
    pool = BlockPool("host", 16, 1 << 20)
    if not pool.prefault():
        pytest.skip("kernel without MADV_POPULATE_WRITE (Linux < 5.14)")
    assert resident_fraction(pool.data) == 1.0


def test_prefault_of_an_empty_pool_is_a_no_op():
    assert BlockPool("host", 0, 4096).prefault() is False
