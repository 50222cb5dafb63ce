"""KVStore fragment API: engine fragments in and out, through the strided
(one copy per block) and the per-fragment paths, bit-exact, with misuse refused."""

import pytest
import torch

from tierstore.api import KVStore
from tierstore.errors import ConfigError, LayoutError, Status
from tierstore.identity import Namespace
from tierstore.io import KVPagePool
from tierstore.io.pages import plan_fragments
from tierstore.layout import KVLayout

LAYOUT = KVLayout(4, 2, 8, torch.bfloat16, 16, "api-test")  # 4 layers, 16-token blocks
NS = Namespace(model="m", tokenizer="t", tenant="a")


def paged_pool(num_blocks, seed):
    """A vLLM-like pool: (layers, 2, num_blocks, tokens, heads, dim)."""
    g = torch.Generator().manual_seed(seed)
    shape = (LAYOUT.num_layers, 2, num_blocks) + LAYOUT.fragment_shape
    return torch.randn(shape, generator=g).to(LAYOUT.dtype)


def block_fragments(pool, b):
    return [pool[layer, kv, b] for layer in range(LAYOUT.num_layers) for kv in (0, 1)]


@pytest.mark.parametrize("dest_kind", ["pool", "separate", "non_contiguous"])
def test_fragments_round_trip(dest_kind):
    store = KVStore(LAYOUT, host_bytes=64 * LAYOUT.bytes_per_block)
    tokens = list(range(3 * LAYOUT.tokens_per_block + 5))
    src = paged_pool(6, seed=1)
    frags = [block_fragments(src, b) for b in (4, 1, 2)]  # any block ids
    assert plan_fragments(frags[0]).strided is not None  # one strided copy per block
    assert store.store_fragments(NS, tokens, frags) == [Status.OK] * 3
    hit = store.lookup(NS, tokens)
    assert hit.matched_tokens == 3 * LAYOUT.tokens_per_block
    if dest_kind == "pool":
        dst = torch.zeros_like(src)
        dests = [block_fragments(dst, b) for b in (0, 5, 3)]
    elif dest_kind == "separate":
        dests = [
            [torch.zeros(LAYOUT.fragment_shape, dtype=LAYOUT.dtype) for _ in range(LAYOUT.num_fragments)]
            for _ in range(3)
        ]
    else:  # transposed views: scatter must honour their strides
        dests = [
            [
                torch.zeros(LAYOUT.fragment_shape[::-1], dtype=LAYOUT.dtype).permute(2, 1, 0)
                for _ in range(LAYOUT.num_fragments)
            ]
            for _ in range(3)
        ]
    assert store.load_fragments(hit.keys, dests) == [Status.OK] * 3
    for want, got in zip(frags, dests):
        for a, b in zip(want, got):
            assert torch.equal(a, b)


def test_fragment_misuse_is_refused():
    store = KVStore(LAYOUT, host_bytes=16 * LAYOUT.bytes_per_block)
    tokens = list(range(LAYOUT.tokens_per_block))
    src = paged_pool(2, seed=2)
    with pytest.raises(LayoutError, match="fragments"):
        store.store_fragments(NS, tokens, [block_fragments(src, 0)[:-1]])
    bad = block_fragments(src, 0)
    bad[3] = bad[3][:8]  # half a fragment
    with pytest.raises(LayoutError, match="fragment 3"):
        store.store_fragments(NS, tokens, [bad])
    assert store.lookup(NS, tokens).matched_tokens == 0  # nothing was stored
    assert store.store_fragments(NS, tokens, [block_fragments(src, 0)]) == [Status.OK]
    hit = store.lookup(NS, tokens)
    with pytest.raises(LayoutError, match="destinations"):
        store.load_fragments(hit.keys, [])


def test_page_pool_plans_round_trip_through_the_store():
    from tierstore.io import KVPagePool

    store = KVStore(LAYOUT, host_bytes=64 * LAYOUT.bytes_per_block)
    tokens = list(range(2 * LAYOUT.tokens_per_block))
    src = paged_pool(5, seed=3)
    pages = KVPagePool(src)
    assert pages.affine and pages.block_bytes == LAYOUT.bytes_per_block
    assert store.store_fragments(NS, tokens, pages.plans([3, 0])) == [Status.OK] * 2
    dst = torch.zeros_like(src)
    hit = store.lookup(NS, tokens)
    assert store.load_fragments(hit.keys, KVPagePool(dst).plans([1, 4], destination=True)) == [Status.OK] * 2
    assert torch.equal(dst[:, :, 1], src[:, :, 3]) and torch.equal(dst[:, :, 4], src[:, :, 0])
    assert int(dst[:, :, [0, 2, 3]].float().abs().sum()) == 0  # other blocks untouched
    with pytest.raises(LayoutError, match="block id"):
        pages.plan(5)
    small = KVPagePool(paged_pool(2, seed=4)[:2])  # 2 layers: wrong block size
    with pytest.raises(LayoutError, match="bytes"):
        store.store_fragments(NS, tokens[:16], small.plans([0]))


def test_a_store_with_another_layout_never_sees_the_old_kv(tmp_path):
    """Same namespace (its kv_dtype left at the default), same NVMe file, same
    block size, other dtype: the second store must miss, not serve the bytes."""
    fp16 = KVLayout(4, 2, 8, torch.float16, 16, "api-test-fp16")
    assert fp16.bytes_per_block == LAYOUT.bytes_per_block
    path = str(tmp_path / "nvme.bin")
    tokens = list(range(2 * LAYOUT.tokens_per_block))
    a = KVStore(LAYOUT, host_bytes=0, nvme_path=path, nvme_bytes=8 << 20)
    blocks = paged_pool(2, seed=5)
    assert a.store_fragments(NS, tokens, KVPagePool(blocks).plans([0, 1])) == [Status.OK] * 2
    assert a.lookup(NS, tokens).matched_tokens == len(tokens)
    a.close()
    same = KVStore(LAYOUT, host_bytes=0, nvme_path=path, nvme_bytes=8 << 20)
    assert same.lookup(NS, tokens).matched_tokens == len(tokens)  # recovered under its own layout
    same.close()
    b = KVStore(fp16, host_bytes=0, nvme_path=path, nvme_bytes=8 << 20)
    assert b.lookup(NS, tokens).matched_tokens == 0
    b.close()


def test_fragments_of_another_dtype_or_geometry_are_refused():
    import numpy as np

    store = KVStore(LAYOUT, host_bytes=16 * LAYOUT.bytes_per_block)
    tokens = list(range(LAYOUT.tokens_per_block))
    fp32 = torch.zeros((LAYOUT.num_layers, 2, 2, 16, 2, 4), dtype=torch.float32)  # same bytes, fp32
    with pytest.raises(LayoutError, match="dtype"):
        store.store_fragments(NS, tokens, KVPagePool(fp32).plans([0]))
    with pytest.raises(LayoutError, match="dtype"):
        store.store_fragments(NS, tokens, [block_fragments(fp32, 0)])
    two_layers = torch.zeros((2, 2, 2, 32, 2, 8), dtype=LAYOUT.dtype)  # same block bytes, 4 fragments
    with pytest.raises(LayoutError, match="fragments"):
        store.store_fragments(NS, tokens, KVPagePool(two_layers).plans([0]))
    as_numpy = [np.zeros(LAYOUT.fragment_shape, dtype=np.float16) for _ in range(LAYOUT.num_fragments)]
    with pytest.raises(LayoutError, match="numpy arrays are not accepted"):
        store.store_fragments(NS, tokens, [as_numpy])
    raw = paged_pool(1, seed=9).view(torch.uint8)  # raw bytes of the right size are accepted
    assert store.store_fragments(NS, tokens, [block_fragments(raw, 0)]) == [Status.OK]
    assert store.lookup(NS, tokens).matched_tokens == LAYOUT.tokens_per_block


def test_malformed_keys_are_refused():
    store = KVStore(LAYOUT, host_bytes=4 * LAYOUT.bytes_per_block)
    with pytest.raises(LayoutError, match="32-byte"):
        store.load([b"short"])
    with pytest.raises(LayoutError, match="32-byte"):
        store.load_fragments(["ab" * 32], [block_fragments(paged_pool(1, seed=1), 0)])


def test_destinations_must_be_planned_as_such_and_distinct():
    store = KVStore(LAYOUT, host_bytes=8 * LAYOUT.bytes_per_block)
    tokens = list(range(2 * LAYOUT.tokens_per_block))
    src = paged_pool(4, seed=11)
    pages = KVPagePool(src)
    assert store.store_fragments(NS, tokens, pages.plans([0, 1])) == [Status.OK] * 2
    keys = store.lookup(NS, tokens).keys
    with pytest.raises(LayoutError, match="reading"):
        store.load_fragments(keys, pages.plans([2, 3]))  # plans made for reading
    with pytest.raises(LayoutError, match="same memory"):
        store.load_fragments(keys, [pages.plan(3, destination=True), pages.plan(3, destination=True)])
    with pytest.raises(LayoutError, match="not an integer"):
        pages.plan(True)
    with pytest.raises(LayoutError, match="no blocks"):
        KVPagePool(paged_pool(0, seed=1))


def test_key_level_api_and_async_calls():
    """store_keys / lookup_keys / exists work on caller keys; wait=False returns futures
    with the same outcome as the blocking calls; exists() touches nothing."""
    from tierstore.identity import scoped_key

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype=torch.float16)
    store = KVStore(layout, host_bytes=8 * layout.bytes_per_block)
    d = store.digest(NS)
    keys = [scoped_key(d, f"page-{i}") for i in range(3)]
    assert scoped_key(store.digest(Namespace(model="other")), "page-0") != keys[0]
    blocks = [torch.randn(layout.block_shape).to(layout.dtype) for _ in keys]
    fut = store.store_keys(NS, keys, blocks, wait=False)
    assert fut.result(timeout=30) == [Status.OK] * 3
    before = store.stats()
    assert store.exists(keys) == 3 and store.exists([keys[0], bytes(32), keys[2]]) == 1
    after = store.stats()
    assert after.get("lookups", 0) == before.get("lookups", 0)
    hit = store.lookup_keys(keys)
    assert hit.matched_blocks == 3
    st, outs = store.load(keys, wait=False).result(timeout=30)
    assert st == [Status.OK] * 3 and all(torch.equal(a, b) for a, b in zip(outs, blocks))
    with pytest.raises(LayoutError):
        store.store_keys(NS, keys[:2], blocks)
    store.close()


def test_fused_kv_layout_round_trip_and_never_matches_layer_kv():
    """vLLM's CPU layout (K and V fused per layer) stores and loads through
    KVPagePool plans; a store of another block order never serves it."""
    L, H, T, D = 2, 2, 4, 8
    fused = KVLayout(
        num_layers=L,
        num_kv_heads=H,
        head_dim=D,
        tokens_per_block=T,
        dtype=torch.float16,
        block_order="layer_fused",
    )
    plain = KVLayout(num_layers=L, num_kv_heads=H, head_dim=D, tokens_per_block=T, dtype=torch.float16)
    assert fused.fingerprint() != plain.fingerprint() and fused.bytes_per_block == plain.bytes_per_block
    src = torch.randn(L, 6, H, T, 2 * D).to(torch.float16)  # one allocation, per layer (blocks, H, T, 2D)
    dst = torch.zeros_like(src)
    store = KVStore(fused, host_bytes=8 * fused.bytes_per_block)
    tokens = list(range(2 * T))
    pages = KVPagePool(src, block_dim=0, kv_dim=None)
    assert store.store_fragments(NS, tokens, pages.plans([3, 1])) == [Status.OK] * 2
    hit = store.lookup(NS, tokens)
    assert hit.matched_blocks == 2
    dpages = KVPagePool(dst, block_dim=0, kv_dim=None)
    assert store.load_fragments(hit.keys, dpages.plans([0, 5], destination=True)) == [Status.OK] * 2
    assert torch.equal(dst[:, 0], src[:, 3]) and torch.equal(dst[:, 5], src[:, 1])
    with pytest.raises(LayoutError, match="layer_fused"):  # a layer_kv pool's plans do not fit this layout
        store.store_fragments(
            NS, tokens, KVPagePool(torch.zeros(L, 2, 6, T, H, D, dtype=torch.float16)).plans([0])
        )
    other = KVStore(plain, host_bytes=8 * plain.bytes_per_block)
    assert other.keys_for(NS, tokens) != store.keys_for(NS, tokens)
    store.close()
    other.close()


def test_from_config_validates_the_engine_dict(tmp_path):
    """One typed config for every way in: unknown keys are errors naming the accepted ones."""
    from tierstore.errors import ConfigError

    cfg = {
        "layout": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "fp16", "tokens_per_block": 4},
        "tiers": {"host": {"capacity_bytes": "64k"}, "nvme": {"path": str(tmp_path), "capacity_bytes": "8m"}},
    }
    store = KVStore.from_config(cfg)
    assert store.layout.tokens_per_block == 4 and store.nvme is not None
    store.close()
    with pytest.raises(ConfigError, match="accepted keys here are"):
        KVStore.from_config({"tiers": {"host": {"capacity": 1}}}, layout=store.layout)
    with pytest.raises(ConfigError, match="no 'layout'"):
        KVStore.from_config({})


@pytest.mark.parametrize("form", ["typed", "uint8_rows", "list"])
def test_batched_blocks_land_in_scattered_slots_and_come_back(form):
    """A tensor of blocks is copied into each memory tier with one copy (free
    slots need not be consecutive: evictions and removals scatter them), and a
    load without destinations fills one buffer the same way; the bytes match."""
    bb = LAYOUT.bytes_per_block
    store = KVStore(LAYOUT, hbm_bytes=5 * bb, host_bytes=7 * bb, device="cpu")
    g = torch.Generator().manual_seed(3)
    old = torch.randn((12, *LAYOUT.block_shape), generator=g).to(LAYOUT.dtype)
    ok = store.store_keys(NS, [bytes([9, i]) + bytes(30) for i in range(12)], old)
    assert ok == [Status.OK] * 12
    store.remove([bytes([9, i]) + bytes(30) for i in (1, 4, 6, 10)])  # free slots here and there
    new = torch.randn((6, *LAYOUT.block_shape), generator=g).to(LAYOUT.dtype)
    blocks = {"typed": new, "uint8_rows": new.view(6, -1).view(torch.uint8), "list": list(new.unbind(0))}[
        form
    ]
    keys = [bytes([7, i]) + bytes(30) for i in range(6)]
    assert store.store_keys(NS, keys, blocks) == [Status.OK] * 6
    tiers = {t for k in keys for t in store.tiers_of(k)}
    assert len(tiers) == 2  # the batch spans both memory tiers
    st, out = store.load(keys)
    assert st == [Status.OK] * 6
    assert all(torch.equal(o, n) for o, n in zip(out, new.unbind(0)))
    st, out = store.load(keys[::-1] + [bytes(32)])  # reversed, and a miss at the end
    assert st == [Status.OK] * 6 + [Status.MISS] and out[-1] is None
    assert all(torch.equal(o, n) for o, n in zip(out, new.unbind(0)[::-1]))
    store.check_invariants(quiescent=True)
    store.close()


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 1e12, 0, -1, True, "60"])
def test_a_lease_or_wait_that_is_not_a_finite_bounded_number_of_seconds_is_refused(bad):
    """Fresh-user trial: pin(lease_s=nan) returned a Lease expiring at nan that leases() listed and
    that protected nothing; inf and 1e12 were accepted too (a pin is a lease that expires)."""
    store = KVStore(LAYOUT, host_bytes=4 * LAYOUT.bytes_per_block)
    tokens = list(range(2 * LAYOUT.tokens_per_block))
    blocks = [torch.randn(LAYOUT.block_shape).to(LAYOUT.dtype) for _ in range(2)]
    assert store.store(NS, tokens, blocks) == [Status.OK] * 2
    with pytest.raises(ConfigError, match="lease_s="):
        store.pin(NS, tokens, lease_s=bad)
    assert store.leases() == {}
    with pytest.raises(ConfigError, match="timeout_s="):
        store.load(store.lookup(NS, tokens), timeout_s=bad)
    lease = store.pin(NS, tokens, lease_s=86400)  # the bound itself: a day
    assert len(lease.keys) == 2 and list(store.leases()) == [lease.lease_id]
    store.close()


def test_overlapping_whole_block_destinations_are_refused_before_any_copy():
    """Fresh-user trial: load(hit, dests=[t] * 8) returned all OK, each block overwriting the last."""
    bb = LAYOUT.bytes_per_block
    store = KVStore(LAYOUT, host_bytes=4 * bb)
    tokens = list(range(3 * LAYOUT.tokens_per_block))
    blocks = [torch.randn(LAYOUT.block_shape).to(LAYOUT.dtype) for _ in range(3)]
    assert store.store(NS, tokens, blocks) == [Status.OK] * 3
    hit = store.lookup(NS, tokens)
    t = torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype)
    with pytest.raises(LayoutError, match="same memory"):
        store.load(hit, dests=[t] * 3)
    assert not t.any()  # nothing copied
    raw = torch.zeros(3 * bb, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="overlap"):  # the second starts inside the first
        store.load(hit, dests=[raw[:bb], raw[bb - 2 : 2 * bb - 2], raw[2 * bb :]])
    assert not raw.any()
    st, out = store.load(hit, dests=[raw[2 * bb :], raw[:bb], raw[bb : 2 * bb]])  # adjacent is fine
    assert st == [Status.OK] * 3 and all(torch.equal(LAYOUT.block_view(o), b) for o, b in zip(out, blocks))
    store.close()


def test_meta_destinations_are_not_memory_and_never_overlap():
    """The replay loads into ``meta`` tensors (a load that copies nothing, for its counts): they all
    report address 0, hold no memory and must not be refused as "the same memory"."""
    store = KVStore(LAYOUT, host_bytes=4 * LAYOUT.bytes_per_block)
    tokens = list(range(3 * LAYOUT.tokens_per_block))
    blocks = [torch.randn(LAYOUT.block_shape).to(LAYOUT.dtype) for _ in range(3)]
    assert store.store(NS, tokens, blocks) == [Status.OK] * 3
    metas = [torch.empty(LAYOUT.bytes_per_block, dtype=torch.uint8, device="meta") for _ in range(3)]
    st, _ = store.load(store.lookup(NS, tokens), dests=metas)
    assert st == [Status.OK] * 3
    store.close()


def test_a_strided_destination_is_refused_not_filled_through_a_copy():
    """Fresh-user trial: load into a non-contiguous view of the right shape and dtype answered OK
    and left the view all zeros (flattening it made a contiguous copy, and the copy was filled)."""
    store = KVStore(LAYOUT, host_bytes=4 * LAYOUT.bytes_per_block)
    tokens = list(range(2 * LAYOUT.tokens_per_block))
    blocks = [torch.randn(LAYOUT.block_shape).to(LAYOUT.dtype) for _ in range(2)]
    assert store.store(NS, tokens, blocks) == [Status.OK] * 2
    hit = store.lookup(NS, tokens)
    shape = LAYOUT.block_shape
    wide = torch.zeros((2, *shape[:-1], 2 * shape[-1]), dtype=LAYOUT.dtype)
    views = list(wide[..., : shape[-1]])  # each of block_shape, strided
    with pytest.raises(LayoutError, match="contiguous"):
        store.load(hit, dests=views)
    raw = torch.zeros(2 * LAYOUT.bytes_per_block, dtype=torch.uint8)
    with pytest.raises(LayoutError, match="contiguous"):  # a uint8 block every other byte
        store.load(hit, dests=[raw[0::2], raw[1::2]])
    assert not wide.any() and not raw.any()
    store.close()
