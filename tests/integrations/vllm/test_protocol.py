"""The connector's scheduler/worker protocol without an engine: scenario tests with
deterministic block ids (fake requests and scheduler outputs, a real store over a
fake CPU KV cache). They pin down what vLLM relies on: what is offered, which
blocks are loaded and stored, when blocks may be freed, and that references end."""

from __future__ import annotations

import dataclasses
import types

import pytest
import torch

from tierstore import KVStore
from tierstore.integrations import vllm as tv

NB, H, T, D, L = 16, 2, 32, 16, 2


class FakeRequest(types.SimpleNamespace):
    def __init__(self, req_id, tokens, prompt_len=None, **kw):
        super().__init__(
            request_id=req_id,
            all_token_ids=list(tokens),
            num_computed_tokens=0,
            num_prompt_tokens=prompt_len or len(tokens),
            cache_salt=None,
            lora_request=None,
            kv_transfer_params=None,
            mm_features=[],
            prompt_embeds=None,
            num_preemptions=0,
            status=None,
            **kw,
        )

    @property
    def num_tokens(self):
        return len(self.all_token_ids)


def sched_output(scheduled: dict, block_ids: dict, preempted=()):
    state = types.SimpleNamespace(get_block_ids=lambda r: (block_ids[r],) if r in block_ids else None)
    return types.SimpleNamespace(
        num_scheduled_tokens=scheduled, preempted_req_ids=set(preempted), kv_connector_block_state=state
    )


@pytest.fixture
def sides():
    """A scheduler side and a worker side of one fake engine, sharing a memory-tier store."""
    whole = torch.randn(L, NB, H, T, 2 * D)
    eng = tv.detect_engine_layout({f"layers.{i}.attn": whole[i] for i in range(L)}, NB, T, H, D)
    store = KVStore(eng.layout, hbm_bytes=64 * eng.layout.bytes_per_block)
    eid = "fake-engine"
    settings = tv.ConnectorSettings()
    tv._REGISTRY[eid] = tv._EngineStore(store, eng, tv.Namespace(model="fake@1"), settings)
    conn = types.SimpleNamespace(
        _kv_transfer_config=types.SimpleNamespace(engine_id=eid), _connector_metadata=None
    )
    sched = tv._SchedulerSide(conn, settings)
    worker = tv._WorkerSide(conn, None, None, None, settings)
    worker._shared = tv._REGISTRY[eid]
    yield sched, worker, store, whole
    worker._saver.shutdown(wait=True)
    worker._loader.shutdown(wait=True)
    del tv._REGISTRY[eid]
    store.close()


def step(sched, worker, so, finished=()):
    """One engine step: metadata, the worker's hooks in vLLM's order, finished transfers."""
    meta = sched.build_connector_meta(so)
    worker._ingest(meta)  # handle_preemptions
    worker.start_load_kv(meta)
    worker.wait_for_save(meta)
    worker._saver.submit(lambda: None).result()  # let this step's transfers finish (deterministic)
    worker._loader.submit(lambda: None).result()
    return meta, worker.get_finished(set(finished))


def prefill(sched, worker, req, block_ids):
    """Admit and prefill ``req`` in one step (no hit); return the step's metadata."""
    n, _ = sched.get_num_new_matched_tokens(req, 0)
    assert n == 0
    meta, _ = step(sched, worker, sched_output({req.request_id: req.num_tokens}, {req.request_id: block_ids}))
    req.num_computed_tokens = req.num_tokens
    return meta


def test_stores_full_blocks_then_offers_all_but_the_last_token(sides):
    sched, worker, store, whole = sides
    toks = list(range(1, 3 * T + 1))  # exactly 3 blocks
    r1 = FakeRequest("r1", toks)
    meta = prefill(sched, worker, r1, [1, 2, 3])
    assert [(j.block_ids, j.first_position, j.lifetime) for j in meta.stores] == [
        ([1, 2, 3], 0, "conversation")
    ]
    assert store.exists(store.keys_for(tv.engine_namespace("fake-engine"), toks)) == 3
    delay, _ = sched.request_finished(r1, [1, 2, 3])
    assert delay  # its stores were not fenced: vLLM must keep the blocks until finished_sending
    meta, (sending, recving) = step(sched, worker, sched_output({}, {}), finished={"r1"})
    assert meta.await_saves == {"r1"} and sending == {"r1"} and recving is None

    r2 = FakeRequest("r2", toks)  # the same 3 full blocks: at most 2 are offered (vLLM computes >= 1 token)
    n, is_async = sched.get_num_new_matched_tokens(r2, 0)
    assert (n, is_async) == (2 * T, False)
    sched.update_state_after_alloc(r2, types.SimpleNamespace(get_block_ids=lambda: ([7, 8, 9],)), n)
    r2.num_computed_tokens = n  # as vLLM sets it before building the metadata
    meta, _ = step(sched, worker, sched_output({"r2": T}, {"r2": [7, 8, 9]}))
    assert [
        (j.keys == store.keys_for(tv.engine_namespace("fake-engine"), toks)[:2], j.block_ids)
        for j in meta.sync_loads
    ] == [(True, [7, 8])]
    assert torch.equal(whole[:, 7:9], whole[:, 1:3])
    assert not meta.stores  # block 3 is in the store already
    assert sched.request_finished(r2, [7, 8, 9]) == (False, None)
    assert not store.references()


def test_repeated_lookups_hold_one_set_of_references(sides):
    sched, worker, store, _ = sides
    toks = list(range(1, 2 * T + 2))
    prefill(sched, worker, FakeRequest("a", toks), [1, 2, 3])
    r = FakeRequest("b", toks)
    for _ in range(3):  # vLLM asks again while the request cannot be scheduled
        assert sched.get_num_new_matched_tokens(r, 0) == (2 * T, False)
    assert list(store.references().values()) == [2]
    sched.request_finished(r, [])
    assert not store.references()


def test_offer_beyond_vllms_own_hit_and_none_when_it_covers_everything(sides):
    sched, worker, store, _ = sides
    toks = list(range(1, 4 * T + 1))
    prefill(sched, worker, FakeRequest("a", toks), [1, 2, 3, 4])
    r = FakeRequest("b", toks + [5])
    assert sched.get_num_new_matched_tokens(r, 2 * T) == (2 * T, False)  # blocks 2-3 beyond vLLM's 0-1
    r2 = FakeRequest("c", toks)
    assert sched.get_num_new_matched_tokens(r2, 3 * T) == (0, False)  # vLLM holds all it may skip
    assert "c" not in {rid[1] for rid in store.references()}


def test_a_shortened_allocation_loads_only_what_vllm_accepted(sides):
    sched, worker, store, _ = sides
    toks = list(range(1, 4 * T + 2))
    prefill(sched, worker, FakeRequest("a", toks), [1, 2, 3, 4, 5])
    r = FakeRequest("b", toks)
    assert sched.get_num_new_matched_tokens(r, 0) == (4 * T, False)
    sched.update_state_after_alloc(
        r, types.SimpleNamespace(get_block_ids=lambda: ([9, 10, 11, 12, 13],)), 2 * T
    )
    r.num_computed_tokens = 2 * T
    meta, _ = step(sched, worker, sched_output({"b": 3 * T}, {"b": [9, 10, 11, 12, 13]}))
    assert [j.block_ids for j in meta.sync_loads] == [[9, 10]]


def test_preemption_fences_stores_and_releases_references(sides):
    sched, worker, store, _ = sides
    toks = list(range(1, 3 * T + 1))
    prefill(sched, worker, FakeRequest("a", toks), [1, 2, 3])
    r = FakeRequest("b", toks + list(range(500, 500 + 2 * T)))
    assert sched.get_num_new_matched_tokens(r, 0) == (3 * T, False)
    sched.update_state_after_alloc(r, types.SimpleNamespace(get_block_ids=lambda: ([4, 5, 6, 7, 8],)), 3 * T)
    r.num_computed_tokens = 3 * T
    meta, _ = step(sched, worker, sched_output({"b": 2 * T}, {"b": [4, 5, 6, 7, 8]}))
    assert [j.block_ids for j in meta.sync_loads] == [[4, 5, 6]]
    assert [(j.block_ids, j.first_position) for j in meta.stores] == [([7, 8], 3)]
    assert store.references()
    meta, _ = step(sched, worker, sched_output({}, {}, preempted={"b"}))
    assert meta.preempted == {"b"} and not store.references()
    # finished later without running again: its stores were fenced, no delayed free
    assert sched.request_finished(r, []) == (False, None)
    meta, (sending, _) = step(sched, worker, sched_output({}, {}), finished={"b"})
    assert not meta.await_saves and sending is None and "b" not in worker._saves


def test_failed_blocks_are_reported_by_vllm_block_id(sides):
    sched, worker, store, _ = sides
    toks = list(range(1, 3 * T + 2))
    prefill(sched, worker, FakeRequest("a", toks), [1, 2, 3, 4])
    r = FakeRequest("b", toks)
    assert sched.get_num_new_matched_tokens(r, 0) == (3 * T, False)
    keys = store.keys_for(tv.engine_namespace("fake-engine"), toks)
    store.remove([keys[1]])  # evicted between lookup and load
    sched.update_state_after_alloc(r, types.SimpleNamespace(get_block_ids=lambda: ([9, 10, 11, 12],)), 3 * T)
    r.num_computed_tokens = 3 * T
    step(sched, worker, sched_output({"b": 1}, {"b": [9, 10, 11, 12]}))
    assert worker.get_block_ids_with_load_errors() == {10}  # vLLM recomputes from the first failed block
    assert worker.get_block_ids_with_load_errors() == set()


def test_async_load_reports_finished_recving(sides):
    sched, worker, store, _ = sides
    sched._settings = tv.ConnectorSettings(load_mode="async")
    toks = list(range(1, 2 * T + 2))
    prefill(sched, worker, FakeRequest("a", toks), [1, 2, 3])
    r = FakeRequest("b", toks)
    assert sched.get_num_new_matched_tokens(r, 0) == (2 * T, True)
    sched.update_state_after_alloc(r, types.SimpleNamespace(get_block_ids=lambda: ([5, 6],)), 2 * T)
    meta, finished = step(sched, worker, sched_output({}, {}))
    assert [j.block_ids for j in meta.async_loads] == [[5, 6]]
    assert finished == (None, {"b"})
    assert worker.get_block_ids_with_load_errors() == set()


def test_lifetime_runs(sides):
    sched, worker, store, _ = sides
    sched._settings = tv.ConnectorSettings(system_prompt_blocks=1, default_lifetime="query")
    r = FakeRequest("a", list(range(1, 4 * T + 1)))
    sched.get_num_new_matched_tokens(r, 2 * T)  # vLLM's own prefix cache shared 2 blocks
    st = sched._reqs["a"]
    assert list(sched._lifetime_runs(st, 0, 4)) == [(0, 2, "system"), (2, 4, "query")]
    assert list(sched._lifetime_runs(st, 3, 4)) == [(3, 4, "query")]
    r2 = FakeRequest("b", list(range(1, 4 * T + 1)))
    r2.kv_transfer_params = {"tierstore_lifetime": "conversation"}
    sched.get_num_new_matched_tokens(r2, 0)
    assert list(sched._lifetime_runs(sched._reqs["b"], 0, 4)) == [(0, 1, "system"), (1, 4, "conversation")]


# ---------------------------------------------------------------- the node service, TP / PP > 1
TP = 2


def _step_ranks(sched, workers, so, finished=()):
    """One engine step with one worker side per rank (each runs the same metadata)."""
    meta = sched.build_connector_meta(so)
    out = []
    for w in workers:
        w._ingest(meta)
        w.start_load_kv(meta)
        w.wait_for_save(meta)
        w._saver.submit(lambda: None).result()
        w._loader.submit(lambda: None).result()
        out.append(w.get_finished(set(finished)))
    return meta, out


def _rank_sides(tmp_path, pp: int, tp: int):
    """A scheduler side and ``pp x tp`` worker sides of one fake engine, in rank order
    ``pp_rank * tp + tp_rank``, each with its own client of one node service (in this process)
    and its own fake KV cache: its KV heads of its stage's ``L // pp`` layers (global layer names).
    Yields ``(sched, workers, core, wholes)``; ``wholes[r]`` is rank ``r``'s cache."""
    from tierstore.config import StoreConfig
    from tierstore.node.client import NodeKVStore
    from tierstore.node.core import NodeCore
    from tierstore.node.server import NodeServer
    from tierstore.server.config import NodeConfig

    per_stage = L // pp
    wholes = [torch.randn(per_stage, NB, H, T, 2 * D) for _ in range(pp * tp)]
    engs = [
        tv.detect_engine_layout(
            {f"layers.{r // tp * per_stage + i}.attn": w[i] for i in range(per_stage)}, NB, T, H, D
        )
        for r, w in enumerate(wholes)
    ]
    core = NodeCore(
        "ranks", {"tiers": {"host": {"capacity_bytes": 64 * engs[0].layout.bytes_per_block}}}, engs[0].layout
    )
    server = NodeServer(core, NodeConfig(socket=str(tmp_path / "node.sock"), lease_s=30)).start()
    url = "unix://" + server.path
    store_cfg = StoreConfig.from_dict({"store": {"url": url}})
    settings = tv.ConnectorSettings()
    pc = types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    conn = types.SimpleNamespace(
        _kv_transfer_config=types.SimpleNamespace(engine_id="ranks-engine"),
        _connector_metadata=None,
        _vllm_config=types.SimpleNamespace(parallel_config=pc),
    )
    workers = []
    for r, eng in enumerate(engs):
        w = tv._WorkerSide(conn, None, None, store_cfg, settings)
        ns = tv.Namespace(model="fake@1", tp_rank=r % tp, tp_size=tp, pp_rank=r // tp, pp_size=pp)
        w._shared = tv._EngineStore(NodeKVStore(url, eng.layout), eng, ns, settings)
        w._pp_rank, w._tp_rank, w._rank = r // tp, r % tp, r
        workers.append(w)
    sched = tv._SchedulerSide(conn, settings, store_cfg)
    sched.set_ranks({(w._pp_rank, w._tp_rank): w.handshake() for w in workers})
    yield sched, workers, core, wholes
    for w in workers:
        w.shutdown()
    sched.shutdown()
    server.close()
    core.close()


@pytest.fixture
def tp_sides(tmp_path):
    """:func:`_rank_sides` of a TP=2 engine (one pipeline stage)."""
    yield from _rank_sides(tmp_path, 1, TP)


@pytest.fixture(params=[(2, 1), (2, 2)], ids=["pp2", "pp2tp2"])
def pp_sides(tmp_path, request):
    """:func:`_rank_sides` of a PP=2 engine, with TP=1 and TP=2."""
    yield from _rank_sides(tmp_path, *request.param)


def test_each_tp_rank_stores_and_loads_its_own_shard_through_the_node_service(tp_sides):
    sched, workers, core, wholes = tp_sides
    toks = list(range(1, 3 * T + 1))
    r1 = FakeRequest("r1", toks)
    assert sched.get_num_new_matched_tokens(r1, 0) == (0, False)
    meta, _ = _step_ranks(sched, workers, sched_output({"r1": 3 * T}, {"r1": [1, 2, 3]}))
    r1.num_computed_tokens = 3 * T
    (job,) = meta.stores
    assert len(job.rank_keys) == TP and job.keys == job.rank_keys[0] != job.rank_keys[1]  # ranks never share
    for r, w in enumerate(workers):
        assert w.shared.store.exists(job.keys_of(r)) == 3
    sched.request_finished(r1, [1, 2, 3])
    _step_ranks(sched, workers, sched_output({}, {}), finished={"r1"})

    r2 = FakeRequest("r2", toks)  # every rank holds the blocks: 2 offered (vLLM computes >= 1 token)
    assert sched.get_num_new_matched_tokens(r2, 0) == (2 * T, False)
    sched.update_state_after_alloc(r2, types.SimpleNamespace(get_block_ids=lambda: ([7, 8, 9],)), 2 * T)
    r2.num_computed_tokens = 2 * T
    meta, _ = _step_ranks(sched, workers, sched_output({"r2": T}, {"r2": [7, 8, 9]}))
    assert [j.block_ids for j in meta.sync_loads] == [[7, 8]]
    for whole in wholes:  # each rank got its own shard back, not another rank's
        assert torch.equal(whole[:, 7:9], whole[:, 1:3])
    assert not torch.equal(wholes[0][:, 7:9], wholes[1][:, 7:9])
    assert all(w.get_block_ids_with_load_errors() == set() for w in workers)
    sched.request_finished(r2, [7, 8, 9])
    assert not core.store.references()
    core.check_invariants()


def test_a_block_is_a_hit_only_when_every_tp_rank_holds_it(tp_sides):
    sched, workers, core, _ = tp_sides
    toks = list(range(1, 4 * T + 2))
    sched.get_num_new_matched_tokens(FakeRequest("a", toks), 0)
    meta, _ = _step_ranks(sched, workers, sched_output({"a": 4 * T + 1}, {"a": [1, 2, 3, 4, 5]}))
    (job,) = meta.stores
    core.store.remove([job.keys_of(1)[2]])  # rank 1 lost block 2 (rank 0 still holds it)
    r = FakeRequest("b", toks)
    assert sched.get_num_new_matched_tokens(r, 0) == (2 * T, False)  # min over ranks
    assert sched._reqs["b"].matched_blocks == 2


def test_a_tp_rank_whose_load_fails_reports_its_blocks_for_recompute(tp_sides):
    """Rank 1's service connection is gone at load time (its client misses): rank 1 reports every
    block of the job, rank 0 loads its shard; vLLM recomputes the reported blocks on every rank."""
    from tierstore.node.client import NodeKVStore

    sched, workers, _, _ = tp_sides
    toks = list(range(1, 3 * T + 2))
    sched.get_num_new_matched_tokens(FakeRequest("a", toks), 0)
    _step_ranks(sched, workers, sched_output({"a": 3 * T + 1}, {"a": [1, 2, 3, 4]}))
    r = FakeRequest("b", toks)
    assert sched.get_num_new_matched_tokens(r, 0) == (3 * T, False)
    sh = workers[1].shared
    sh.store.close()
    sh.store = NodeKVStore("unix:///nonexistent/tierstore-node.sock", sh.engine.layout, timeout_s=0.5)
    sched.update_state_after_alloc(r, types.SimpleNamespace(get_block_ids=lambda: ([9, 10, 11, 12],)), 3 * T)
    r.num_computed_tokens = 3 * T
    _step_ranks(sched, workers, sched_output({"b": 1}, {"b": [9, 10, 11, 12]}))
    assert workers[0].get_block_ids_with_load_errors() == set()
    assert workers[1].get_block_ids_with_load_errors() == {9, 10, 11}


def test_a_node_service_that_is_down_gives_misses_at_once(tp_sides):
    """The scheduler side's client cannot reach the service: nothing is offered (vLLM computes
    everything), within the client's timeout, and stores are refused, not waited for."""
    import time

    from tierstore.node.client import NodeKVStore

    sched, workers, _, _ = tp_sides
    sh = sched.shared
    sh.store.close()
    sh.store = NodeKVStore("unix:///nonexistent/tierstore-node.sock", sh.layout, timeout_s=0.5)
    t0 = time.monotonic()
    r = FakeRequest("a", list(range(1, 3 * T + 2)))
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    assert time.monotonic() - t0 < 2.0


def test_a_service_of_another_block_class_stops_the_engine_at_start_and_a_dead_one_does_not(tp_sides):
    from tierstore.config import StoreConfig
    from tierstore.errors import ConfigError
    from tierstore.integrations._common import open_store
    from tierstore.layout import KVLayout

    sched, _, _, _ = tp_sides
    url = sched._store_cfg.store.url
    other = KVLayout(num_layers=L, num_kv_heads=2 * H, head_dim=D, dtype=torch.float32, tokens_per_block=T)
    with pytest.raises(ConfigError, match="refused this client"):
        tv._connect(open_store(StoreConfig.from_dict({"store": {"url": url}}), other), "test")
    dead = StoreConfig.from_dict(
        {"store": {"url": "unix:///nonexistent/tierstore-node.sock", "timeout_s": 0.5}}
    )
    store = open_store(dead, sched.shared.layout)
    tv._connect(store, "test")  # a service that is down: misses until it is up, no error
    assert store.lookup_keys([bytes(32)]).matched_blocks == 0
    store.close()


# ---------------------------------------------------------------- PP = 2 (with TP = 1 and 2)
def test_each_pp_stage_stores_and_loads_its_own_layers_under_its_own_namespace(pp_sides):
    sched, workers, core, wholes = pp_sides
    toks = list(range(1, 3 * T + 1))
    sched.get_num_new_matched_tokens(FakeRequest("r1", toks), 0)
    meta, _ = _step_ranks(sched, workers, sched_output({"r1": 3 * T}, {"r1": [1, 2, 3]}))
    (job,) = meta.stores
    assert len(job.rank_keys) == len(workers)
    assert len({k for keys in job.rank_keys for k in keys}) == 3 * len(workers)  # no rank shares a key
    for w in workers:  # a rank's keys are the chain its own client computes for its namespace
        ns = dataclasses.replace(job.ns, pp_rank=w._pp_rank, tp_rank=w._tp_rank)
        assert w.shared.store.keys_for(ns, toks) == job.keys_of(w._rank)
    assert sorted(core.store.namespaces().values()) == [3] * len(workers)  # one per (stage, TP rank)
    sched.request_finished(FakeRequest("r1", toks), [1, 2, 3])
    _step_ranks(sched, workers, sched_output({}, {}), finished={"r1"})

    r2 = FakeRequest("r2", toks)
    assert sched.get_num_new_matched_tokens(r2, 0) == (2 * T, False)
    sched.update_state_after_alloc(r2, types.SimpleNamespace(get_block_ids=lambda: ([7, 8, 9],)), 2 * T)
    r2.num_computed_tokens = 2 * T
    meta, _ = _step_ranks(sched, workers, sched_output({"r2": T}, {"r2": [7, 8, 9]}))
    assert [j.block_ids for j in meta.sync_loads] == [[7, 8]]
    for whole in wholes:  # each rank got its own stage's layers back, not another rank's
        assert torch.equal(whole[:, 7:9], whole[:, 1:3])
    assert not torch.equal(wholes[0][:, 7:9], wholes[-1][:, 7:9])
    assert all(w.get_block_ids_with_load_errors() == set() for w in workers)
    sched.request_finished(r2, [7, 8, 9])
    assert not core.store.references()
    core.check_invariants()


def test_a_block_is_a_hit_only_when_every_pp_and_tp_rank_holds_it(pp_sides):
    sched, workers, core, _ = pp_sides
    toks = list(range(1, 4 * T + 2))
    sched.get_num_new_matched_tokens(FakeRequest("a", toks), 0)
    meta, _ = _step_ranks(sched, workers, sched_output({"a": 4 * T + 1}, {"a": [1, 2, 3, 4, 5]}))
    (job,) = meta.stores
    core.store.remove([job.keys_of(len(workers) - 1)[2]])  # the last stage's last rank lost block 2
    assert sched.get_num_new_matched_tokens(FakeRequest("b", toks), 0) == (2 * T, False)  # min over ranks
    assert sched._reqs["b"].matched_blocks == 2
    core.store.remove([job.keys_of(0)[1]])  # stage 0 lost block 1
    assert sched.get_num_new_matched_tokens(FakeRequest("c", toks), 0) == (1 * T, False)


def test_a_pp_stage_whose_load_fails_reports_its_blocks_for_recompute(pp_sides):
    """The last stage's service connection is gone at load time: its ranks report every block of
    the job, stage 0 loads its layers; vLLM recomputes the reported blocks."""
    from tierstore.node.client import NodeKVStore

    sched, workers, _, _ = pp_sides
    toks = list(range(1, 3 * T + 2))
    sched.get_num_new_matched_tokens(FakeRequest("a", toks), 0)
    _step_ranks(sched, workers, sched_output({"a": 3 * T + 1}, {"a": [1, 2, 3, 4]}))
    r = FakeRequest("b", toks)
    assert sched.get_num_new_matched_tokens(r, 0) == (3 * T, False)
    last = [w for w in workers if w._pp_rank == 1]
    for w in last:
        sh = w.shared
        sh.store.close()
        sh.store = NodeKVStore("unix:///nonexistent/tierstore-node.sock", sh.engine.layout, timeout_s=0.5)
    sched.update_state_after_alloc(r, types.SimpleNamespace(get_block_ids=lambda: ([9, 10, 11, 12],)), 3 * T)
    r.num_computed_tokens = 3 * T
    _step_ranks(sched, workers, sched_output({"b": 1}, {"b": [9, 10, 11, 12]}))
    for w in workers:
        assert w.get_block_ids_with_load_errors() == ({9, 10, 11} if w._pp_rank == 1 else set())


def test_handshakes_reach_the_scheduler_by_pp_and_tp_rank(pp_sides):
    """vLLM's ``set_xfer_handshake_metadata_pp_aware`` reaches ``set_ranks`` with its
    ``(pp_rank, tp_rank)`` keys; a missing rank or a stage of another layout is refused."""
    from tierstore.errors import ConfigError

    sched, workers, _, _ = pp_sides
    got = {(w._pp_rank, w._tp_rank): w.handshake() for w in workers}
    fresh = tv._SchedulerSide(sched._c, sched._settings, sched._store_cfg)
    conn = types.SimpleNamespace(_sched=fresh)
    missing = {k: v for k, v in got.items() if k != (1, 0)}
    with pytest.raises(ConfigError, match=r"handshakes from \(pp_rank, tp_rank\)"):
        tv.TierstoreConnector.set_xfer_handshake_metadata_pp_aware(conn, missing)
    with pytest.raises(ConfigError, match=r"handshakes from \(pp_rank, tp_rank\)"):  # vLLM's pre-PP call
        tv.TierstoreConnector.set_xfer_handshake_metadata(conn, {t: h for (p, t), h in got.items() if p == 0})
    h = got[1, 0]
    bad = dict(got)
    bad[1, 0] = tv.TierstoreHandshake(dataclasses.replace(h.layout, num_kv_heads=2 * H), h.namespace)
    with pytest.raises(ConfigError, match="stages may differ in num_layers only"):
        tv.TierstoreConnector.set_xfer_handshake_metadata_pp_aware(conn, bad)
    tv.TierstoreConnector.set_xfer_handshake_metadata_pp_aware(conn, got)
    assert fresh.shared.ranks == sorted(got)
    fresh.shutdown()


class _FailingWorker:
    """A worker side whose store cannot be set up (e.g. a tier path tierstore must not touch)."""

    def __init__(self):
        self.shut = 0

    def register_kv_caches(self, kv_caches):
        raise tv.ConfigError("kv_connector_extra_config configures no tier")

    def shutdown(self):
        self.shut += 1


def _connector_with(worker):
    conn = object.__new__(tv.TierstoreConnector)
    conn._closed, conn._sched, conn._worker = False, None, worker
    return conn


def test_a_connector_whose_store_fails_to_open_is_not_left_as_vllms_agent():
    """vLLM keeps the worker's connector in a process global and makes a new one only while it is
    empty; a failed start-up is not shut down, so in an in-process engine the next ``LLM(...)``
    reused the failed connector and raised its error whatever its own config said (trial 5a)."""
    from vllm.distributed.kv_transfer import kv_transfer_state as state

    assert not state.has_kv_transfer_group()
    worker = _FailingWorker()
    conn = _connector_with(worker)
    state._KV_CONNECTOR_AGENT = conn  # what ensure_kv_transfer_initialized did for this engine
    try:
        with pytest.raises(tv.ConfigError, match="no tier"):
            conn.register_kv_caches({})
        assert not state.has_kv_transfer_group() and worker.shut == 1 and conn._closed
        other = _connector_with(_FailingWorker())  # another engine's agent is left alone
        state._KV_CONNECTOR_AGENT = other
        with pytest.raises(tv.ConfigError):
            _connector_with(_FailingWorker()).register_kv_caches({})
        assert state.get_kv_transfer_group() is other and not other._closed
    finally:
        state._KV_CONNECTOR_AGENT = None
