import pytest
import torch

from tierstore.errors import LayoutError
from tierstore.io.batch import ExtentPipeline, read_fragments_raw, write_fragments_raw
from tierstore.io.engine import alloc_aligned
from tierstore.io.pages import gather_fragments, scatter_fragments

from .conftest import make_engine

EXT = 64 << 10  # small extent keeps the test fast; same code path as 16 MiB


@pytest.mark.parametrize(
    "sizes",
    [
        [1],
        [4095],
        [4096],
        [4097],
        [EXT - 1],
        [EXT],
        [32 << 10] * 9,
        [1, 4095, 4096, 4097, EXT - 1, EXT, 3, 32 << 10, 7],
    ],
)
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


@pytest.mark.parametrize("kind", ["one_tensor", "layers_one_allocation", "separate_layers", "bf16"])
def test_page_pool_plans_match_the_per_fragment_path(kind):
    from tierstore.io.pages import KVPagePool, plan_fragments

    g = torch.Generator().manual_seed(7)
    if kind == "one_tensor":
        layers = torch.randn(3, 2, 6, 4, 8, generator=g)
    elif kind == "layers_one_allocation":  # per-layer views of one buffer, with gaps
        big = torch.randn(3, 2, 2, 6, 4, 8, generator=g)
        layers = [big[i, 1] for i in range(3)]  # layer stride != 2 x K/V stride
    elif kind == "separate_layers":
        layers = [torch.randn(2, 6, 4, 8, generator=g) for _ in range(3)]
    else:
        layers = torch.randn(3, 2, 6, 4, 8, generator=g).to(torch.bfloat16)
    pages = KVPagePool(layers)
    assert pages.affine == (kind != "separate_layers")
    keep, staging = alloc_aligned(1 << 16)
    keep2, ref = alloc_aligned(1 << 16)
    for b in range(pages.num_blocks):
        n = pages.plan(b).gather(staging, 4096)
        assert n == plan_fragments(pages.fragments(b)).gather(ref, 4096) == pages.block_bytes
        assert torch.equal(staging[4096 : 4096 + n], ref[4096 : 4096 + n])
    dst = [torch.zeros_like(t) for t in (layers.unbind(0) if isinstance(layers, torch.Tensor) else layers)]
    dpages = KVPagePool(dst)
    pages.plan(2).gather(staging, 0)
    dpages.plan(5, destination=True).scatter(staging, 0)
    for d, s in zip(dst, (layers.unbind(0) if isinstance(layers, torch.Tensor) else layers)):
        assert torch.equal(d[:, 5], s[:, 2])
        assert int(d[:, :5].float().abs().sum()) == 0


def test_page_pool_rejects_bad_layouts():
    from tierstore.errors import LayoutError
    from tierstore.io.pages import KVPagePool

    with pytest.raises(LayoutError):
        KVPagePool(torch.zeros(3, 3, 4, 8))  # K/V axis of 3
    with pytest.raises(LayoutError):
        KVPagePool([torch.zeros(2, 4, 8), torch.zeros(2, 5, 8)])
    with pytest.raises(LayoutError):
        KVPagePool(torch.zeros(2, 2, 4, 8, 6).transpose(3, 4))  # fragments not contiguous
    with pytest.raises(LayoutError):
        KVPagePool([])


def test_page_pool_refuses_to_scatter_into_overlapping_fragments():
    from tierstore.errors import LayoutError
    from tierstore.io.pages import KVPagePool

    buf = torch.zeros(1 << 12)
    frag = 8
    # layer l's V is layer l+1's K: K/V stride == layer stride == one fragment pair... overlapping
    a = buf.as_strided((3, 2, 4, frag), (2 * frag * 4 // 2, frag * 4, 2 * frag, 1))
    # blocks overlap each other: block stride half a fragment pair
    b = buf.as_strided((3, 2, 4, frag), (1000, 500, frag // 2, 1))
    for pool in (a, b):
        pages = KVPagePool(pool)
        pages.plan(0)  # reading from it is fine
        with pytest.raises(LayoutError, match="overlap"):
            pages.plan(0, destination=True)
    ok = KVPagePool(torch.zeros(3, 2, 4, frag))
    with pytest.raises(LayoutError, match="more than once"):
        ok.plans([1, 2, 1], destination=True)
    assert len(ok.plans([1, 2, 1])) == 3  # reading a block twice is fine
    for bad in (1.7, "2", None):
        with pytest.raises(LayoutError, match="not an integer"):
            ok.plan(bad)
    assert ok.plan(torch.tensor(2).item()).nbytes == ok.block_bytes


def test_page_pool_reversed_layer_list_falls_back_and_round_trips():
    from tierstore.io.pages import KVPagePool

    pool = torch.randn(3, 2, 5, 16)
    layers = list(pool.unbind(0))[::-1]  # one allocation, negative layer stride
    pages = KVPagePool(layers)
    assert not pages.affine
    keep, staging = alloc_aligned(1 << 14)
    n = pages.plan(4).gather(staging, 0)
    assert torch.equal(staging[:n], torch.cat([f.reshape(-1).view(torch.uint8) for f in pages.fragments(4)]))


@pytest.mark.parametrize("ids", [[0, 1, 2, 3, 4, 5], [0, 1, 2, 5, 6, 3], [5, 4, 3, 2, 1, 0]])
def test_blocks_merge_into_one_copy_and_match_block_by_block(ids):
    """Consecutive pool blocks at consecutive staging offsets move as one copy;
    broken runs (other ids, a gap in staging) fall back; bytes are the same."""
    from tierstore.io.memory import MemoryEngine
    from tierstore.io.pages import KVPagePool, _merged_runs

    pipe = ExtentPipeline(MemoryEngine(1 << 20), 64 << 10, 1)
    src = torch.randn(3, 2, 8, 4, 8)
    pages = KVPagePool(src)
    bb = pages.block_bytes
    offsets = [k * bb for k in range(len(ids))]
    offsets[4:] = [o + 4096 for o in offsets[4:]]  # a gap in staging breaks a run
    plans = pages.plans(ids)
    runs = [(i, j) for i, j, _ in _merged_runs(plans, offsets, destination=False)]
    if ids == [0, 1, 2, 3, 4, 5]:
        assert runs == [(0, 4), (4, 6)]
    keep, staging = alloc_aligned(1 << 16)
    keep2, ref = alloc_aligned(1 << 16)
    pipe.gather_blocks(plans, staging, offsets)
    for p, o in zip(plans, offsets):
        p.gather(ref, o)
    assert torch.equal(staging, ref)
    dst = torch.zeros_like(src)
    dpages = KVPagePool(dst)
    pipe.scatter_blocks(staging, offsets, dpages.plans(ids, destination=True))
    for b in ids:
        assert torch.equal(dst[:, :, b], src[:, :, b])
    pipe.close()


def test_overlapping_destination_blocks_are_not_merged():
    from tierstore.io.pages import _merged_runs, plan_fragments

    buf = torch.zeros(4096, dtype=torch.uint8)
    # block i's 4 fragments of 64 bytes at buf[i*32 + r*512]: blocks overlap by half a fragment
    blocks = [[buf[i * 32 + r * 512 : i * 32 + r * 512 + 64] for r in range(4)] for i in range(3)]
    plans = [plan_fragments(b, destination=True) for b in blocks]
    assert all(p.strided is not None for p in plans)
    runs = list(_merged_runs(plans, [0, 256, 512], destination=True))
    assert [(i, j) for i, j, _ in runs] == [(0, 1), (1, 2), (2, 3)]
    assert len(list(_merged_runs(plans, [0, 256, 512], destination=False))) == 1  # reading may merge


def test_blocks_from_a_smaller_view_of_the_same_memory_do_not_merge_past_it():
    """Plans from a pool that is a slice of a bigger buffer: a merged view may
    not reach past the slice's storage; it falls back, it does not raise."""
    import numpy as np

    from tierstore.io.memory import MemoryEngine
    from tierstore.io.pages import KVPagePool

    a = np.random.default_rng(0).integers(0, 256, (1, 2, 8, 4096), dtype=np.uint8)
    small = KVPagePool(torch.from_numpy(a[:, :, :2]))  # a copy-free slice: its own, shorter storage view
    big = KVPagePool(torch.from_numpy(a))
    plans = [small.plan(0), small.plan(1), big.plan(2)]
    pipe = ExtentPipeline(MemoryEngine(1 << 20), 64 << 10, 1)
    keep, staging = alloc_aligned(1 << 16)
    pipe.gather_blocks(plans, staging, [0, 8192, 16384])
    want = torch.cat([torch.from_numpy(a[0, :, b].reshape(-1).copy()) for b in (0, 1, 2)])
    assert torch.equal(staging[: 3 * 8192], want)
    pipe.close()


@pytest.mark.parametrize(
    "shape,block_dim,kv_dim",
    [
        ((6, 3, 4, 2 * 8), 0, None),  # vLLM CPU backend: (blocks, H, T, 2*D), K and V fused
        ((6, 2, 4, 3, 8), 0, 1),  # vLLM FlashInfer: (blocks, 2, T, H, D)
        ((2, 6, 4, 3, 8), 1, 0),  # vLLM FlashAttention / SGLang layer_first: (2, blocks, T, H, D)
    ],
)
def test_page_pool_engine_layouts_round_trip(shape, block_dim, kv_dim):
    """Every engine layout: a block's plan gathers exactly its fragments in
    layer-major order, and scatters back bit-exactly into another pool,
    touching no other block."""
    from tierstore.io.pages import KVPagePool

    layers = 3
    g = torch.Generator().manual_seed(7)
    src = torch.randn((layers, *shape), generator=g).to(torch.bfloat16)  # one allocation, fixed layer stride
    pool = KVPagePool(src, block_dim=block_dim, kv_dim=kv_dim)
    assert pool.affine and pool.num_blocks == 6 and pool.num_kv == (1 if kv_dim is None else 2)
    for b in (0, 5):
        stage = torch.empty(pool.block_bytes, dtype=torch.uint8)
        pool.plan(b).gather(stage, 0)
        want = torch.cat([f.reshape(-1).view(torch.uint8) for f in pool.fragments(b)])
        assert torch.equal(stage, want)
        dst = torch.zeros_like(src)
        dpool = KVPagePool(dst, block_dim=block_dim, kv_dim=kv_dim)
        dpool.plan(b, destination=True).scatter(stage, 0)
        for fs, fd in zip(pool.fragments(b), dpool.fragments(b)):
            assert torch.equal(fs, fd)
        others = [o for o in range(6) if o != b]
        assert all(not f.any() for o in others for f in dpool.fragments(o))


def test_page_pool_fused_separate_layers_fall_back():
    """Per-layer tensors in separate allocations plan fragment by fragment and still round-trip."""
    from tierstore.io.pages import KVPagePool

    layers = [torch.randn(5, 2, 4, 16) for _ in range(3)]
    pool = KVPagePool(layers, block_dim=0, kv_dim=None)
    stage = torch.empty(pool.block_bytes, dtype=torch.uint8)
    assert pool.plan(3).gather(stage, 0) == pool.block_bytes == 3 * 2 * 4 * 16 * 4
    dst = [torch.zeros(5, 2, 4, 16) for _ in range(3)]
    KVPagePool(dst, block_dim=0, kv_dim=None).plan(3, destination=True).scatter(stage, 0)
    assert all(torch.equal(a[3], b[3]) for a, b in zip(layers, dst))


def test_page_pool_rejects_non_leading_axes():
    from tierstore.io.pages import KVPagePool

    with pytest.raises(LayoutError, match="leading axes"):
        KVPagePool(torch.zeros(2, 4, 3, 8), block_dim=2, kv_dim=0)
    with pytest.raises(LayoutError, match="2 entries"):
        KVPagePool(torch.zeros(2, 4, 3, 8), block_dim=0, kv_dim=1)
