"""tierstore as a secondary tier of vLLM's native offloading (``TieringOffloadingSpec``).

vLLM 0.32 refuses the offloading *worker* on its CPU backend (pinned by
``test_vllm_refuses_the_offloading_worker_on_cpu``), so no engine runs here.
Everything on the scheduler side is vLLM's own: ``TieringOffloadingSpec`` builds
its ``TieringOffloadingManager`` over a real ``SharedOffloadRegion`` (/dev/shm),
with :class:`TierstoreSecondaryTier` loaded by vLLM's ``SecondaryTierFactory``
from the config dict. The tests play the GPU worker only: they write a primary
row where the worker would copy a GPU block, and read one back where it would
load it.
"""

from __future__ import annotations

import hashlib
import os
import time
import uuid

import pytest
import torch

from tierstore.errors import ConfigError

pytestmark = pytest.mark.timeout(300)

CHUNK_BYTES = 32 << 10  # one 32-token block of the tiny test Llama (2 layers x 2 heads x 64 x fp32)
PRIMARY_CHUNKS = 4
MODULE = "tierstore.integrations.vllm_offload"


def offloading_config(
    extra: dict,
    *,
    model: str = "acme/tiny@rev-a",
    dtype: str = "float32",
    tp: int = 1,
    engine_id: str | None = None,
):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=CHUNK_BYTES,
        enable_kv_cache_events=False,
        extra_config=extra,
        engine_id=engine_id or f"ts-test-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=tp,
            tp_size=tp,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def tier_cfg(nvme_dir=None, host_bytes: int = 0, **more) -> dict:
    tiers = {}
    if host_bytes:
        tiers["host"] = {"capacity_bytes": host_bytes}
    if nvme_dir is not None:
        tiers["nvme"] = {"path": str(nvme_dir), "capacity_bytes": "16MiB"}
    return {"type": "TierstoreSecondaryTier", "module_path": MODULE, "tiers": tiers, **more}


class Engine:
    """vLLM's TieringOffloadingManager with one tierstore secondary tier; the test is the worker."""

    def __init__(self, tier: dict, **cfg):
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        # the README's --kv-transfer-config: vLLM's factory picks the spec by name
        extra = {
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": PRIMARY_CHUNKS * CHUNK_BYTES,
            "secondary_tiers": [tier],
        }
        self.spec = OffloadingSpecFactory.create_spec(offloading_config(extra, **cfg))
        assert type(self.spec) is TieringOffloadingSpec
        self.mgr = self.spec.get_manager()
        (self.tier,) = self.mgr.secondary_tiers
        view = self.mgr.primary_tier.get_kv_memoryview()
        self.rows = torch.frombuffer(view.cast("B"), dtype=torch.uint8).view(view.shape[0], -1)
        self.n = 0

    def step(self, new=()) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.mgr.on_schedule_end(ScheduleEndContext(new_req_ids=list(new), preempted_req_ids=[]))

    def settle(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while self.mgr.has_pending_work():
            assert time.monotonic() < deadline, "offloading jobs did not finish"
            time.sleep(0.002)
            self.step()
        self.step()

    def request(self):
        from vllm.v1.kv_offload.base import ReqContext

        self.n += 1
        ctx = ReqContext(req_id=f"r{self.n}")
        self.mgr.on_new_request(ctx)
        return ctx

    def offload(self, keys) -> None:
        """A request's GPU blocks are stored to the primary tier (the worker copies them), then
        cascaded to the secondary tier by vLLM's manager."""
        ctx = self.request()
        out = self.mgr.prepare_store(keys, ctx)
        assert out is not None, "primary tier refused the store"
        for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids):
            self.rows[int(c)].copy_(content(k))  # the worker's GPU -> CPU copy
        self.mgr.complete_store(out.keys_to_store, ctx)
        self.mgr.on_request_finished(ctx)
        self.settle()

    def fetch(self, keys) -> list[bool]:
        """Look keys up as the scheduler does (promotions from the secondary tier first), then
        read each hit's primary row as the worker's CPU -> GPU load would; True if the row holds
        exactly that key's bytes."""
        from vllm.v1.kv_offload.base import LookupResult

        ctx = self.request()
        deadline = time.monotonic() + 30
        while True:
            res = [self.mgr.lookup(k, ctx) for k in keys]
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in res):
                break
            assert time.monotonic() < deadline, f"lookups stuck at {res}"
            self.step()
            time.sleep(0.002)
        hits = [k for k, r in zip(keys, res) if r is LookupResult.HIT]
        ok = {}
        if hits:
            spec = self.mgr.prepare_load(hits, ctx)
            for k, c in zip(hits, spec.chunk_ids):
                ok[k] = torch.equal(self.rows[int(c)], content(k))
            self.mgr.complete_load(hits, ctx)
        self.mgr.on_request_finished(ctx)
        self.step()
        return [ok.get(k, False) for k in keys]

    closed = False

    def close(self) -> None:
        """Settle and shut the manager down; a second call does nothing (the fixture closes every engine)."""
        if self.closed:
            return
        self.closed = True
        self.settle()
        self.mgr.shutdown()


def okey(i: int, salt: str = ""):
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(hashlib.sha256(f"{salt}block{i}".encode()).digest(), 0)


def content(key) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(hashlib.sha256(bytes(key)).digest()[:7], "little"))
    return torch.randint(0, 256, (CHUNK_BYTES,), dtype=torch.uint8, generator=g)


def evict_primary(eng: Engine, salt: str) -> None:
    """Fill the primary tier with other chunks so that earlier ones live only in the secondary tier."""
    eng.offload([okey(i, salt) for i in range(PRIMARY_CHUNKS)])


def no_leaks(tier) -> None:
    assert not tier.store.references()
    tier.store.check_invariants(quiescent=True)
    assert not tier.has_pending_work()


@pytest.fixture
def engines():
    made = []

    def make(*a, **kw):
        e = Engine(*a, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.mark.parametrize("where", ["host", "nvme"])
def test_chunks_cascade_to_tierstore_and_promote_back_bit_exact(tmp_path, engines, where):
    eng = engines(
        tier_cfg(tmp_path if where == "nvme" else None, host_bytes=64 * CHUNK_BYTES if where == "host" else 0)
    )
    keys = [okey(i) for i in range(3)]
    eng.offload(keys)
    assert eng.tier.store.exists([eng.tier._key(k) for k in keys]) == 3
    assert eng.tier.store.stats()["bytes_per_tier"][where] == 3 * CHUNK_BYTES
    evict_primary(eng, "filler")
    from vllm.v1.kv_offload.base import LookupResult

    ctx = eng.request()
    assert eng.mgr.primary_tier.lookup(keys[0], ctx) is LookupResult.MISS  # gone from vLLM's CPU tier
    eng.mgr.on_request_finished(ctx)
    assert eng.fetch(keys) == [True, True, True]  # promoted from tierstore, exact bytes
    assert eng.tier.cache_hit_source.name == ("DISK" if where == "nvme" else "HOST")
    no_leaks(eng.tier)


def test_unknown_chunks_miss(tmp_path, engines):
    eng = engines(tier_cfg(tmp_path))
    assert eng.fetch([okey(99)]) == [False]
    no_leaks(eng.tier)


def test_a_new_engine_on_the_same_nvme_directory_serves_earlier_chunks(tmp_path, engines):
    keys = [okey(i, "persist") for i in range(3)]
    first = engines(tier_cfg(tmp_path))
    first.offload(keys)
    first.close()
    second = engines(tier_cfg(tmp_path))  # a new engine id, a new primary region, nothing in it
    assert second.fetch(keys) == [True, True, True]
    assert second.tier.store.stats()["load_bytes_nvme"] >= 3 * CHUNK_BYTES
    no_leaks(second.tier)


@pytest.mark.parametrize(
    "other", [dict(model="acme/tiny@rev-b"), dict(dtype="bfloat16"), dict(tp=2), dict(tenant="tenant-b")]
)
def test_another_model_dtype_topology_or_tenant_gets_no_reuse(tmp_path, engines, other):
    keys = [okey(i, "iso") for i in range(2)]
    first = engines(tier_cfg(tmp_path, tenant="tenant-a"))
    first.offload(keys)
    first.close()
    tenant = other.pop("tenant", "tenant-a")
    second = engines(tier_cfg(tmp_path, tenant=tenant), **other)
    assert second.fetch(keys) == [False, False]
    no_leaks(second.tier)
    second.close()
    third = engines(tier_cfg(tmp_path, tenant="tenant-a"))  # the original identity still hits
    assert third.fetch(keys) == [True, True]


def test_a_corrupt_chunk_fails_its_promotion_and_is_recomputed(tmp_path, engines):
    keys = [okey(i, "crc") for i in range(3)]
    first = engines(tier_cfg(tmp_path))
    first.offload(keys)
    first.close()
    (path,) = [os.path.join(tmp_path, n) for n in os.listdir(tmp_path) if n.endswith(".nvme")]
    blob = bytearray(open(path, "rb").read())
    pos = blob.find(content(keys[1])[:256].numpy().tobytes())
    assert pos >= 0, "chunk payload not found in the NVMe file"
    with open(path, "r+b") as f:
        f.seek(pos + 100)
        f.write(bytes([blob[pos + 100] ^ 0xFF]))
    second = engines(tier_cfg(tmp_path))
    assert second.fetch(keys) == [True, False, True]  # the promotion of chunk 1 failed: vLLM recomputes it
    assert second.tier.store.stats()["io_errors"] == 1
    assert second.tier.store.exists([second.tier._key(keys[1])]) == 0  # dropped, never served
    no_leaks(second.tier)


def test_secondary_tier_config_is_validated_at_start(tmp_path):
    from tierstore.integrations.vllm_offload import chunk_layout, split_tier_config

    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['tier'\]"):
        split_tier_config({"tier": {}})
    with pytest.raises(ConfigError, match="no GPU access"):
        split_tier_config({"tiers": {"hbm": {"capacity_bytes": "1GiB"}}})
    with pytest.raises(ConfigError, match="no tier configured"):
        split_tier_config({})
    with pytest.raises(ConfigError, match="derived from vLLM's offload chunk"):
        split_tier_config({"layout": {}, "tiers": {"host": {"capacity_bytes": "1GiB"}}})
    assert chunk_layout(CHUNK_BYTES, 32).bytes_per_block == CHUNK_BYTES
    assert chunk_layout(4096 * 3, 64).bytes_per_block == 4096 * 3  # not divisible by 2*64*... still exact


def test_vllm_refuses_the_offloading_worker_on_cpu(tmp_path):
    """Why no engine runs this tier here: vLLM 0.32's CPU offloading worker (inherited by
    TieringOffloadingSpec) is refused on the CPU platform. If a vLLM release lifts this, this
    test fails: then add an engine-level test like tests/integrations/vllm/test_engine.py."""
    from vllm.platforms import current_platform
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    assert not (current_platform.is_cuda_alike() or current_platform.is_xpu())
    extra = {"cpu_bytes_to_use": PRIMARY_CHUNKS * CHUNK_BYTES, "secondary_tiers": [tier_cfg(tmp_path)]}
    spec = TieringOffloadingSpec(offloading_config(extra))
    try:
        with pytest.raises(Exception, match="only supported on CUDA-alike and XPU"):
            spec.get_worker(None)
    finally:
        if spec._manager is not None:
            spec._manager.shutdown()


def test_the_tier_refuses_a_foreign_file_and_calls_after_shutdown(tmp_path, engines):
    """Issue 22 items 1 and 2: an NVMe path holding data tierstore did not write is refused before
    any write; after shutdown every call raises StoreClosedError."""
    from tierstore.errors import ForeignDataError, StoreClosedError

    victim = tmp_path / "data.bin"
    victim.write_bytes(os.urandom(1 << 20))
    before = victim.read_bytes()
    with pytest.raises(ForeignDataError, match="first bytes"):
        engines(tier_cfg(victim))
    assert victim.read_bytes() == before
    eng = engines(tier_cfg(tmp_path))
    keys = [okey(i, "closed") for i in range(2)]
    eng.offload(keys)
    eng.close()
    from vllm.v1.kv_offload.base import ReqContext

    for call in (
        lambda: eng.tier.lookup(keys[0], ReqContext(req_id="late")),
        lambda: eng.tier.submit_store(None),
        lambda: eng.tier.submit_load(None),
    ):
        with pytest.raises(StoreClosedError, match="shut down"):
            call()
    eng.tier.shutdown()  # idempotent


@pytest.fixture
def node_service(tmp_path):
    """An in-process node service whose pool holds this suite's offload chunks (host and NVMe)."""
    from tierstore.integrations.vllm_offload import chunk_layout
    from tierstore.node.core import NodeCore
    from tierstore.node.server import NodeServer
    from tierstore.server.config import NodeConfig

    os.mkdir(tmp_path / "node")
    core = NodeCore(
        f"vo{uuid.uuid4().hex[:8]}",
        {
            "tiers": {
                "host": {"capacity_bytes": 8 * CHUNK_BYTES},
                "nvme": {"path": str(tmp_path / "node") + "/", "capacity_bytes": "8MiB"},
            }
        },
        chunk_layout(CHUNK_BYTES, 32),
        staging_blocks=8,
    )
    server = NodeServer(core, NodeConfig(socket=str(tmp_path / "node.sock"))).start()
    yield core, server, "unix://" + server.path
    server.close()
    core.close()


def node_tier(url: str, **more) -> dict:
    return {
        "type": "TierstoreSecondaryTier",
        "module_path": MODULE,
        "store": {"url": url, "timeout_s": 1},
        **more,
    }


def test_engines_on_one_node_service_share_chunks_and_a_dead_service_gives_misses(
    tmp_path, engines, node_service
):
    """Issue 24 item 3: ``store.url`` makes the tier a client of the node service. Engine B (a new
    engine: another primary region, nothing in it) gets the chunks engine A offloaded, byte-exact;
    an engine of another tenant gets none, one of another topology (another chunk size) is refused
    at start-up; no per-engine NVMe file is made; with the service gone, lookups and promotions
    miss within the client's timeout."""
    from tierstore.node.client import NodeKVStore

    core, server, url = node_service
    keys = [okey(i, "node") for i in range(3)]
    a = engines(node_tier(url))
    assert isinstance(a.tier.store, NodeKVStore) and a.tier.cache_hit_source.name == "DISK"
    a.offload(keys)
    assert core.store.stats()["blocks"] == 3
    b = engines(node_tier(url))
    assert b.fetch(keys) == [True, True, True]  # promoted from the node's store, exact bytes
    other = engines(node_tier(url, tenant="tenant-b"))
    assert other.fetch(keys) == [False, False, False]
    with pytest.raises(ConfigError, match="block class 65536 B / 32 tokens"):
        engines(node_tier(url), tp=2)  # TP=2: 64 KiB chunks, the service's pool holds 32 KiB ones
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".nvme")]  # the service's files only
    assert not core.store.references() and not b.tier.has_pending_work()
    core.check_invariants(quiescent=True)
    server.close()  # the service is gone: its socket refuses
    c = engines(node_tier(url))
    t0 = time.monotonic()
    assert c.fetch(keys) == [False, False, False]
    c.offload([okey(9, "node")])  # the store job fails (REJECTED): the chunk stays in vLLM's CPU tier
    assert time.monotonic() - t0 < 4 * 1.0 + 2.0


def test_the_node_service_key_refuses_the_tiers_it_owns(tmp_path):
    from tierstore.integrations.vllm_offload import split_tier_config

    store_cfg, _ = split_tier_config({"store": {"url": "unix:///run/tierstore/node.sock"}})
    assert store_cfg.store.url == "unix:///run/tierstore/node.sock"
    with pytest.raises(ConfigError, match=r"remove \['tiers'\]"):
        split_tier_config({"store": {"url": "unix:///x.sock"}, "tiers": {"host": {"capacity_bytes": "1MiB"}}})
