"""SGLang's real host pools on CPU and a backend over them, for the tests.

A host pool is built the way SGLang builds it (issue 15, checked on CPU):
``MHATokenToKVPool(...)`` (or ``MLATokenToKVPool``) and then
``MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, ...)`` with
``pin_memory=False``. Page contents are derived from the page hash, so any
page read back can be checked byte for byte.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

from tierstore.integrations.sglang import HiCacheTierStore

CLASS = {
    "backend_name": "tierstore",
    "module_path": "tierstore.integrations.sglang",
    "class_name": "HiCacheTierStore",
    "interface_v1": 1,
}


def host_pool(
    kind: str = "mha",
    layout: str = "page_first",
    *,
    page_size: int = 4,
    layers: int = 3,
    heads: int = 2,
    head_dim: int = 8,
    kv_lora_rank: int = 16,
    rope_dim: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    device_tokens: int = 64,
    ratio: float = 2.0,
):
    """SGLang's host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``) on CPU.

    The pool holds ``device_tokens * ratio`` tokens plus SGLang's padding page.
    """
    common = dict(
        size=device_tokens,
        page_size=page_size,
        dtype=dtype,
        layer_num=layers,
        device="cpu",
        enable_memory_saver=False,
        start_layer=0,
        end_layer=layers,
    )
    if kind == "mha":
        dev = MHATokenToKVPool(head_num=heads, head_dim=head_dim, **common)
        return MHATokenToKVPoolHost(
            dev.get_device_pool_infos()[0].buffer_info,
            ratio,
            0,
            page_size,
            layout,
            pin_memory=False,
            device="cpu",
            device_capacity_tokens=device_tokens,
            start_layer=0,
            end_layer=layers,
        )
    dev = MLATokenToKVPool(kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope_dim, **common)
    return MLATokenToKVPoolHost(
        dev.get_device_pool_infos()[0].buffer_info,
        ratio,
        0,
        page_size,
        layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device_tokens,
        start_layer=0,
        end_layer=layers,
        target_layer_num=layers,
    )


def storage_config(
    extra: dict,
    *,
    model: str | None = "acme/tiny-llama",
    tp_rank: int = 0,
    tp_size: int = 1,
    pp_rank: int = 0,
    pp_size: int = 1,
    is_mla: bool = False,
    metrics: bool = False,
    **more,
) -> HiCacheStorageConfig:
    """SGLang's ``HiCacheStorageConfig`` as ``HiCacheController`` fills it."""
    return HiCacheStorageConfig(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=pp_rank,
        pp_size=pp_size,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=metrics,
        is_page_first_layout=False,
        model_name=model,
        extra_config={**CLASS, **extra},
        **more,
    )


def tiers(tmp_path=None, *, host_bytes: int = 0, nvme_bytes: int = 0, nvme_path=None) -> dict:
    """The ``tiers`` section of the extra config."""
    t: dict = {}
    if host_bytes:
        t["host"] = {"capacity_bytes": host_bytes}
    if nvme_bytes:
        t["nvme"] = {
            "path": str(nvme_path if nvme_path is not None else tmp_path),
            "capacity_bytes": nvme_bytes,
        }
    return {"tiers": t}


def backend(pool, extra: dict, **cfg) -> HiCacheTierStore:
    """A backend as SGLang's dynamic factory makes it, with the host pool registered."""
    b = HiCacheTierStore(storage_config(extra, is_mla=isinstance(pool, MLATokenToKVPoolHost), **cfg), {})
    b.register_mem_pool_host(pool)
    return b


def page_hashes(n: int, salt: str = "") -> list[str]:
    """Chained hex page hashes, like SGLang's ``get_hash_str``."""
    out, prev = [], salt.encode()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(8, "little")).digest()
        out.append(prev.hex())
    return out


def indices(pool, pages: Sequence[int]) -> torch.Tensor:
    """Host token indices of whole pages (as SGLang's page allocator returns them)."""
    p = pool.page_size
    if not pages:
        return torch.empty(0, dtype=torch.int64)
    return torch.cat([torch.arange(g * p, (g + 1) * p, dtype=torch.int64) for g in pages])


def page_bytes_of(pool) -> int:
    return pool.get_size_per_token() * pool.page_size


def content(key: str, nbytes: int) -> torch.Tensor:
    """Deterministic pseudo-random bytes of a page with hash ``key`` (uint8)."""
    seed = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") & ((1 << 63) - 1)
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def write_page(pool, page: int, data: torch.Tensor) -> None:
    """Write one page's flat bytes through SGLang's own ``set_from_flat_data_page``."""
    flat = data.view(pool.dtype) if pool.dtype != torch.uint8 else data
    pool.set_from_flat_data_page(page * pool.page_size, flat.clone())


def read_page(pool, page: int) -> torch.Tensor:
    """One page's flat bytes through SGLang's own ``get_data_page(flat=True)``."""
    return pool.get_data_page(page * pool.page_size, flat=True).contiguous().view(torch.uint8).clone()


def fill(pool, pages: Sequence[int], keys: Sequence[str]) -> None:
    nb = page_bytes_of(pool)
    for g, k in zip(pages, keys):
        write_page(pool, g, content(k, nb))


SENTINEL = 0x5A


def poison(pool, pages: Sequence[int]) -> None:
    """Fill pages with a sentinel byte (a page a failed load must leave as is)."""
    nb = page_bytes_of(pool)
    for g in pages:
        write_page(pool, g, torch.full((nb,), SENTINEL, dtype=torch.uint8))


def holds(pool, page: int, key: str) -> bool:
    return torch.equal(read_page(pool, page), content(key, page_bytes_of(pool)))


def poisoned(pool, page: int) -> bool:
    return bool((read_page(pool, page) == SENTINEL).all())
