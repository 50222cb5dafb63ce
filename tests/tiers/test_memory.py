"""Memory tiers: clear errors without CUDA; the CUDA HBM pool and pinned host
tier round trip on a GPU (``gpu`` marker: skipped where CUDA is absent)."""
import pytest
import torch

from tierstore.errors import ConfigError, Status
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
    store = KVStore(layout, hbm_bytes=2 * layout.bytes_per_block, host_bytes=8 * layout.bytes_per_block,
                    device="cuda")
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
