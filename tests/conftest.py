"""Shared fixtures: a tiny layout, a fake clock, stores with all three tiers."""
from __future__ import annotations


import numpy as np
import pytest
import torch

from tierstore import KVStore, Namespace, get_layout
from tierstore.tiers.nvme import SlotFileStorage


class FakeClock:
    """Manually advanced clock (seconds)."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, s: float) -> None:
        self.now_s += s


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def layout():
    return get_layout("tiny")


@pytest.fixture
def ns():
    return Namespace(model="tiny-llama@rev1", tokenizer="tok@1")


def make_blocks(layout, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *layout.block_shape), generator=g, dtype=torch.float32).to(layout.dtype)


def tokens(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


@pytest.fixture
def make_store(tmp_path, layout, clock):
    stores = []

    def _make(hbm=4, host=4, nvme=16, **kw):
        bb = layout.bytes_per_block
        nv = None
        if nvme:
            nv = SlotFileStorage(str(tmp_path / f"nvme{len(stores)}.bin"),
                                 nvme * ((bb + 128 + 4095) // 4096 * 4096), bb)
        s = KVStore(layout, hbm_bytes=hbm * bb, host_bytes=host * bb, nvme=nv, clock=clock, **kw)
        stores.append(s)
        return s

    yield _make
    for s in stores:
        s.close()
