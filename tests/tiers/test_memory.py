"""Memory tiers: clear errors without CUDA; the CUDA HBM pool and pinned host
tier round trip on a GPU (``gpu`` marker: skipped where CUDA is absent)."""

import pytest
import torch

from tierstore.errors import ConfigError, LayoutError, Status
from tierstore.tiers.memory import BlockPool

CUDA = torch.cuda.is_available()


@pytest.mark.skipif(CUDA, reason="checks the no-CUDA errors")
def test_without_cuda_pinned_and_cuda_pools_are_config_errors():
    with pytest.raises(ConfigError, match="pinned host"):
        BlockPool("host", 4, 4096, pin_memory=True)
    from tierstore import KVStore, get_layout

    with pytest.raises(ConfigError, match="CUDA is not available"):
        KVStore(get_layout("tiny"), hbm_bytes=1 << 20, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_hbm_and_pinned_host_round_trip():
    from tierstore import KVStore, Namespace, get_layout

    layout = get_layout("tiny")
    store = KVStore(
        layout, hbm_bytes=2 * layout.bytes_per_block, host_bytes=8 * layout.bytes_per_block, device="cuda"
    )
    ns = Namespace(model="m")
    tokens = list(range(6 * layout.tokens_per_block))
    g = torch.Generator(device="cuda").manual_seed(0)
    blocks = torch.randn((6,) + layout.block_shape, generator=g, device="cuda").to(layout.dtype)
    assert store.store(ns, tokens, blocks) == [Status.OK] * 6  # 4 of them demoted to pinned host
    from tierstore.index import Tier

    pools = store._parts.pools  # what build_store wired
    assert pools[Tier.HBM].data.device.type == "cuda"
    assert pools[Tier.HOST].data.is_pinned()
    hit = store.lookup(ns, tokens)
    dests = [torch.empty(layout.block_shape, dtype=layout.dtype, device="cuda") for _ in range(6)]
    st, _ = store.load(hit.keys, dests)
    assert st == [Status.OK] * 6
    for a, b in zip(blocks, dests):
        assert torch.equal(a, b)


def test_from_tensor_wraps_strided_rows_and_the_movers_copies_stay_in_them():
    """A pool over rows ``stride`` bytes apart (a segment's slots) aliases them, and the copies
    the mover makes (slice copies, ``index_copy_``, ``index_select``) never touch the gaps."""
    backing = torch.zeros(4 * 8192, dtype=torch.uint8)
    rows = backing.as_strided((4, 5000), (8192, 1))
    pool = BlockPool.from_tensor("host", rows)
    assert (pool.name, pool.num_blocks, pool.block_bytes, pool.device.type) == ("host", 4, 5000, "cpu")
    assert pool.data.data_ptr() == backing.data_ptr()
    pool.view(1).fill_(1)
    pool.data[2:4].copy_(torch.full((2, 5000), 2, dtype=torch.uint8))
    pool.data.index_copy_(0, torch.tensor([0]), torch.full((1, 5000), 3, dtype=torch.uint8))
    grid = backing.view(4, 8192)
    assert grid[:, :5000].tolist() == [[3] * 5000, [1] * 5000, [2] * 5000, [2] * 5000]
    assert int(grid[:, 5000:].count_nonzero()) == 0
    assert pool.data.index_select(0, torch.tensor([1, 0]))[:, 0].tolist() == [1, 3]


@pytest.mark.parametrize(
    "rows,why",
    [
        (torch.zeros((4, 16), dtype=torch.float16), "2-D uint8"),
        (torch.zeros(64, dtype=torch.uint8), "2-D uint8"),
        (torch.zeros((4, 0), dtype=torch.uint8), "rows of 0 bytes"),
        (torch.zeros((16, 4), dtype=torch.uint8).t(), "contiguous"),
        (torch.zeros(96, dtype=torch.uint8).as_strided((4, 32), (16, 1)), "overlap"),
    ],
)
def test_from_tensor_refuses_rows_that_are_not_separate_blocks(rows, why):
    with pytest.raises(LayoutError, match=why):
        BlockPool.from_tensor("host", rows)
