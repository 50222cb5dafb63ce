"""The connector's pieces without an engine: KV cache layout detection over
tensors shaped like vLLM's, and start-up configuration errors."""

from __future__ import annotations

import types

import pytest
import torch

from tierstore import KVStore
from tierstore.errors import ConfigError, LayoutError, Status
from tierstore.identity import Namespace
from tierstore.integrations.vllm import ConnectorSettings, _check_topology, _settings, detect_engine_layout

NB, H, T, D, L = 10, 2, 32, 16, 3


def cpu_caches(dtype=torch.bfloat16, layers=L):
    """vLLM 0.32 CPU backend: one allocation, per layer (blocks, H, T, 2*D), layers at a fixed stride."""
    whole = torch.randn(layers, NB, H, T, 2 * D).to(dtype)
    return {f"model.layers.{i}.self_attn.attn": whole[i] for i in range(layers)}, whole


def roundtrip(eng, src_block: int, dst_block: int) -> None:
    """Store a block from the pool and load it into another block id: bytes must match."""
    store = KVStore(eng.layout, hbm_bytes=4 * eng.layout.bytes_per_block)
    ns = Namespace(model="m")
    keys = store.keys_for(ns, list(range(eng.layout.tokens_per_block)))
    assert store.store_keys(ns, keys, eng.pool.plans([src_block])) == [Status.OK]
    assert store.load_fragments(keys, eng.pool.plans([dst_block], destination=True)) == [Status.OK]
    store.close()


def test_cpu_fused_layout_one_allocation():
    caches, whole = cpu_caches()
    eng = detect_engine_layout(caches, NB, T, H, D)
    assert eng.layout.block_order == "layer_fused"
    assert (eng.layout.num_layers, eng.layout.num_kv_heads, eng.layout.head_dim) == (L, H, D)
    assert eng.layout.tokens_per_block == T and eng.layout.dtype == torch.bfloat16
    assert eng.pool.affine and eng.interior == "HNC"
    roundtrip(eng, 3, 7)
    assert torch.equal(whole[:, 7], whole[:, 3])
    assert not torch.equal(whole[:, 6], whole[:, 3])


def test_layers_are_ordered_by_index_not_by_name():
    caches, whole = cpu_caches(layers=12)
    shuffled = dict(sorted(caches.items()))  # "layers.10" sorts before "layers.2" as text
    eng = detect_engine_layout(shuffled, NB, T, H, D)
    assert eng.pool.layers[2].data_ptr() == whole[2].data_ptr()


def test_tokens_major_interior_is_named():
    nhc = torch.randn(L, NB, T, H, 2 * D)  # physical (blocks, T, H, C), logical (blocks, H, T, C)
    caches = {f"layers.{i}.attn": nhc[i].permute(0, 2, 1, 3) for i in range(L)}
    eng = detect_engine_layout(caches, NB, T, H, D)
    assert eng.interior == "NHC"
    roundtrip(eng, 1, 2)
    assert torch.equal(nhc[:, 2], nhc[:, 1])


def test_kernel_blocks_inside_a_vllm_block():
    whole = torch.randn(L, NB * 2, H, T // 2, 2 * D)  # kernel block of 16 tokens, vLLM block of 32
    eng = detect_engine_layout({f"layers.{i}.attn": whole[i] for i in range(L)}, NB, T, H, D)
    assert eng.interior == "k16/KHNC"
    roundtrip(eng, 0, 4)
    assert torch.equal(whole[:, 8:10], whole[:, 0:2])


@pytest.mark.parametrize("flashinfer", [False, True])
def test_five_dim_gpu_layouts_map_to_layer_kv(flashinfer):
    shape = (NB, 2, T, H, D) if flashinfer else (2, NB, T, H, D)
    caches = {f"layers.{i}.attn": torch.randn(shape) for i in range(L)}  # separate allocations
    eng = detect_engine_layout(caches, NB, T, H, D)
    assert eng.layout.block_order == "layer_kv" and eng.interior == "NHD"
    roundtrip(eng, 5, 9)
    for t in caches.values():
        blk = (lambda b, t=t: t[b]) if flashinfer else (lambda b, t=t: t[:, b])
        assert torch.equal(blk(9), blk(5))


@pytest.mark.parametrize("shape", [(NB, T, H * 2 * D), (NB, H, T, 2 * D + 8), (NB + 1, H, T, 2 * D)])
def test_unknown_layouts_are_refused_naming_the_shape(shape):
    caches = {f"layers.{i}.attn": torch.zeros(shape) for i in range(L)}
    with pytest.raises(LayoutError, match=r"shape \(" + ", ".join(map(str, shape))):
        detect_engine_layout(caches, NB, T, H, D)


def test_unequal_k_and_v_head_sizes_are_refused():
    caches, _ = cpu_caches()
    with pytest.raises(LayoutError, match="K and V head sizes differ"):
        detect_engine_layout(caches, NB, T, H, D, head_size_v=D // 2)


def test_non_contiguous_fragments_are_refused():
    big = torch.zeros(L, NB, H, T, 4 * D)
    caches = {f"layers.{i}.attn": big[i, ..., : 2 * D] for i in range(L)}  # padded channels
    with pytest.raises(LayoutError, match="unsupported KV cache"):
        detect_engine_layout(caches, NB, T, H, D)


def fake_vllm_config(extra, policy="recompute", tp=1, pp=1, dp=1):
    ktc = types.SimpleNamespace(kv_connector_extra_config=extra, kv_load_failure_policy=policy)
    pc = types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp)
    return types.SimpleNamespace(kv_transfer_config=ktc, parallel_config=pc)


def test_extra_config_splits_into_store_config_and_connector_section():
    store_cfg, settings = _settings(
        fake_vllm_config(
            {
                "tiers": {"host": {"capacity_bytes": "1GiB"}},
                "policies": {"eviction": "lru"},
                "connector": {"tenant_from": "none", "system_prompt_blocks": 2, "load_mode": "async"},
            }
        )
    )
    assert store_cfg.tiers.host.capacity_bytes == 1 << 30
    assert settings == ConnectorSettings(tenant_from="none", system_prompt_blocks=2, load_mode="async")


@pytest.mark.parametrize(
    "extra, match",
    [
        ({"tier": {}}, r"unknown key\(s\) \['tier'\]"),
        ({"tiers": {"host": {"capacity": 1}}}, "tiers.host.capacity: unknown key"),
        ({"connector": {"tenant": "x"}}, "tenant: unknown key"),
        ({"connector": {"load_mode": "sometimes"}}, "load_mode"),
        ({"layout": {"preset": "tiny"}}, "derived from the engine"),
    ],
)
def test_bad_extra_config_is_an_error_at_start(extra, match):
    with pytest.raises(ConfigError, match=match):
        _settings(fake_vllm_config(extra))


def test_fail_policy_is_refused():
    with pytest.raises(ConfigError, match="recompute"):
        _settings(fake_vllm_config({}, policy="fail"))


@pytest.mark.parametrize("kw", [{"tp": 2}, {"pp": 2}, {"dp": 2}])
def test_multi_process_setups_are_refused_with_the_embedded_store(kw):
    with pytest.raises(ConfigError, match=r"one process.*store\.url"):
        _check_topology(fake_vllm_config({}, **kw), service=False)


def test_pipeline_stages_of_unequal_layer_counts_are_refused_with_the_node_service():
    """A rank's block is its stage's layers and the service's pool holds one block size: vLLM's
    partition of 3 layers into 2 stages (2 + 1) would get the second stage refused by the service
    in its worker; it is refused at start-up instead, naming the way out."""
    cfg = fake_vllm_config({}, pp=2)
    cfg.model_config = types.SimpleNamespace(get_total_num_hidden_layers=lambda: 3)
    with pytest.raises(ConfigError, match=r"stages hold \[2, 1\] layers.*divides the model's layers"):
        _check_topology(cfg, service=True)
    cfg.model_config = types.SimpleNamespace(get_total_num_hidden_layers=lambda: 4)
    _check_topology(cfg, service=True)  # 2 + 2


def test_the_node_service_runs_tensor_and_pipeline_parallel_and_refuses_data_parallel():
    for kw in ({"tp": 2}, {"pp": 2}, {"tp": 2, "pp": 2}):  # each rank is a client of its own
        _check_topology(fake_vllm_config({}, **kw), service=True)
    for kw in ({"dp": 2}, {"tp": 2, "pp": 2, "dp": 2}):
        with pytest.raises(ConfigError, match=r"node service.*data_parallel_size=2 is not built"):
            _check_topology(fake_vllm_config({}, **kw), service=True)
