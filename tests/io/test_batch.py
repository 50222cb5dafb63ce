import pytest
import torch

from tierstore.io.batch import (ExtentPipeline, read_fragments_raw, scatter_fragments,
                                write_fragments_raw, gather_fragments)
from tierstore.io.engine import alloc_aligned

from .conftest import make_engine

EXT = 64 << 10  # small extent keeps the test fast; same code path as 16 MiB


@pytest.mark.parametrize("sizes", [
    [1], [4095], [4096], [4097], [EXT - 1], [EXT], [32 << 10] * 9,
    [1, 4095, 4096, 4097, EXT - 1, EXT, 3, 32 << 10, 7],
])
def test_fragments_round_trip(engine_kind, tmp_path, sizes):
    eng = make_engine(engine_kind, tmp_path, 4 << 20, max_io_bytes=16 << 10)
    pipe = ExtentPipeline(eng, EXT)
    g = torch.Generator().manual_seed(len(sizes))
    frags = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    written = write_fragments_raw(pipe, 8192, frags, placement=2)
    assert written % 4096 == 0 and written >= sum(sizes)
    outs = [torch.empty_like(f) for f in frags]
    read_fragments_raw(pipe, 8192, outs)
    for a, b in zip(frags, outs):
        assert torch.equal(a, b)
    eng.close()


def test_mixed_dtypes_and_non_contiguous_destinations():
    keep, staging = alloc_aligned(1 << 16)
    a = torch.randn(4, 8, dtype=torch.bfloat16)
    b = torch.arange(10, dtype=torch.int32)
    c = torch.randn(6, 5).t()  # non-contiguous source: gathered through a copy
    n = gather_fragments([a, b, c], staging, 100)
    assert n == a.numel() * 2 + 40 + 30 * 4
    da, db = torch.empty_like(a), torch.empty_like(b)
    dc = torch.empty(6, 5).t()  # non-contiguous destination
    scatter_fragments(staging, 100, [da, db, dc])
    assert torch.equal(a, da) and torch.equal(b, db) and torch.equal(c, dc)


def test_extent_size_validated(tmp_path):
    from tierstore.errors import ConfigError
    eng = make_engine("memory", tmp_path, 1 << 20)
    with pytest.raises(ConfigError):
        ExtentPipeline(eng, 5000)
