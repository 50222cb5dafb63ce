"""The offline frontier simulator (bench/frontier_sim.py, issue 26 P0a) against the real store and
against the offline references, on the packaged excerpt."""

from __future__ import annotations

import pytest

from tierstore.bench.references import flat_lru_hit_ratio

from .tools import load_tool

fs = load_tool("frontier_sim")


@pytest.mark.parametrize("name", ["a", "b"])
def test_region_mode_counts_equal_the_real_store(name):
    """Region mode (today's default, and fifo + clock copy-forward) replays the first 300 requests of
    the excerpt with exactly the real store's hits per tier, NVMe bytes, promotions, background
    cleans and NVMe evictions (tierstore.replay.run_replay on the replay's default NVMe file)."""
    wl = fs.load_workload("excerpt", limit=300)
    v = fs.validate(wl, "file", name)
    for k in (
        "hit_ratio",
        "hit_blocks_hbm",
        "hit_blocks_host",
        "hit_blocks_nvme",
        "nvme_user_bytes",
        "promotions",
        "flushed_blocks",
        "evictions_nvme",
        "host_wa",
        "segment_bytes",
    ):
        assert v["sim"][k] == v["real"][k], k
    assert v["real"]["hit_blocks_nvme"] > 0 and v["real"]["evictions_nvme"] > 0  # the NVMe tier was exercised


def test_block_mode_without_memory_tiers_is_one_flat_lru():
    """Per-block eviction with the memory tiers switched off, GC keeping every live block and LBA
    space to spare is exactly one LRU cache of the live budget (bench/cache_reference.py's flat LRU)."""
    wl = fs.load_workload("excerpt", limit=400)
    wl.hbm_bytes = wl.host_bytes = 0
    cfg = fs.SimConfig("flat", granularity="block", survivors="all", lba="device", fdp=True)
    sim = fs.Simulator(wl, cfg, util=0.5)
    r = sim.run()
    budget = r["live_budget_blocks"]
    assert budget == wl.nvme_bytes // wl.block_bytes
    assert r["lru_evicted_blocks"] > 0
    assert r["hit_blocks"] == round(flat_lru_hit_ratio(wl.keys, budget) * r["lookup_blocks"])


@pytest.mark.parametrize("fdp", [True, False])
def test_block_mode_keeps_budget_and_the_device_maps_only_live_data(fdp):
    """Per-block eviction never holds more than its live budget, deallocates every evicted slot
    (Simulator.check_invariants: the model maps exactly headers + live slots), and on an FDP
    device (RUH Update per segment, segment = RU) the model's GC never copies (WAF 1)."""
    wl = fs.load_workload("excerpt", limit=400)
    cfg = fs.SimConfig(
        "t", granularity="block", survivors="clock", survivor_stream=True, classifier="survivor", fdp=fdp
    )
    sim = fs.Simulator(wl, cfg, util=1.0)
    r = sim.run()  # runs check_invariants at the end
    assert 0 < r["nvme_live_blocks_end"] <= r["live_budget_blocks"]
    assert r["lru_evicted_blocks"] > 0 and r["trim_ranges"] > r["segments_reset_clean"]
    if fdp:
        assert r["device_waf"] == 1.0 and r["ruh_updates"] > 0
    else:
        assert r["device_waf"] >= 1.0 and r["ruh_updates"] == 0


def test_auc_by_hand():
    import numpy as np

    y = np.array([True, True, False, False, False])
    assert fs.auc(np.array([2.0, 2.0, 0.0, 0.0, 0.0]), y) == 1.0
    assert fs.auc(np.array([0.0, 0.0, 0.0, 0.0, 0.0]), y) == 0.5  # ties: chance
    # positives score 2, 0; negatives 2, 0, 0: pairs won 1 + 1, tied 1 + 2 (half each), of 6
    assert fs.auc(np.array([2.0, 0.0, 2.0, 0.0, 0.0]), y) == pytest.approx(3.5 / 6)


def test_region_mode_counts_equal_the_real_store_on_the_agent_workload(tmp_path):
    """The agent workload's prefixes are resident past a request's first miss: during the put the real
    store protects the plan's victims, writes and new blocks, not those already-stored keys, and the
    simulator has to do the same to keep the store's NVMe evictions (found by a whole-trace run)."""
    agent_workload = load_tool("agent_workload")
    path = str(tmp_path / "agent.jsonl")
    agent_workload.AgentWorkload(sessions=200, seed=0).write(path)
    wl = fs.load_workload("agent10", agent_trace=path)
    v = fs.validate(wl, "sim", "a")
    for k in ("hit_ratio", "hit_blocks_nvme", "promotions", "flushed_blocks", "evictions_nvme", "host_wa"):
        assert v["sim"][k] == v["real"][k], k


def test_engine_classes_by_hand():
    """A block whose chain continues two ways is a shared prefix (LONG), one in two requests a
    conversation (MEDIUM), one in a single request a query (SHORT); ``error`` re-draws that share."""
    keys = [[0, 1, 2], [0, 1, 3], [0, 5], [6, 7], [6, 7, 8]]
    L, M, S = 2, 1, 0
    assert fs.engine_classes(keys, 9) == [L, L, S, S, S, S, M, M, S]  # 4 never looked up: SHORT
    noisy = fs.engine_classes(keys, 9, error=1.0)
    assert noisy == fs.engine_classes(keys, 9, error=1.0)  # seeded
    assert set(noisy) <= {S, M, L}
    # per request: the blocks a request is the first to hold share one class
    per = fs.engine_classes(keys, 9, error=1.0, per_request=True)
    assert per[0] == per[1] == per[2] and per[6] == per[7] and per[4] == S  # 4: never looked up


def test_class_lru_evicts_the_lowest_class_first_and_lru_within():
    cls = {1: 1, 2: 0, 3: 1, 4: 0, 5: 2}
    o = fs.ClassLRU(3, cls.__getitem__)
    for k in (1, 2, 3, 4, 5):
        o[k] = None
    o.move_to_end(2)  # refreshed: the LRU end of class 0 is now 4
    o[4] = None  # already there: keeps its place, as an OrderedDict
    assert list(o) == [4, 2, 1, 3, 5]
    assert o.victims(3, lambda k: k == 2) == [4, 1, 3]
    assert list(o) == [4, 2, 1, 3, 5]  # victims() changes nothing
    o.pop(4)
    assert 4 not in o and len(o) == 4 and list(o) == [2, 1, 3, 5]


@pytest.mark.parametrize("order", ["lru", "s3fifo", "engine", "engine2"])
def test_block_mode_orders_without_memory_tiers_are_one_flat_cache_of_that_order(order):
    """With the memory tiers off, GC keeping every live block and LBA space to spare, per-block
    eviction in each order is exactly one flat cache of the live budget evicting in that order
    (flat_order_hit_ratio, which for LRU is bench/cache_reference.py's flat LRU); the engine's
    order evicts something (it is not trivially a bigger cache)."""
    wl = fs.load_workload("excerpt", limit=400)
    wl.hbm_bytes = wl.host_bytes = 0
    hints = "engine" if order.startswith("engine") else "none"
    cfg = fs.SimConfig(
        "flat", granularity="block", survivors="all", lba="device", fdp=True, nvme_order=order, hints=hints
    )
    sim = fs.Simulator(wl, cfg, util=0.5)
    r = sim.run()
    budget = r["live_budget_blocks"]
    assert r["lru_evicted_blocks"] > 0
    eng = fs.engine_classes(wl.keys, wl.n_blocks)
    ref_order = {
        "lru": fs.OrderedDict(),
        "s3fifo": fs.S3FIFOOrder(),
        "engine": fs.ClassLRU(3, eng.__getitem__),
        "engine2": fs.ClassLRU(2, lambda b: min(eng[b], 1)),
    }[order]
    want = fs.flat_order_hit_ratio(wl.keys, budget, ref_order)
    assert r["hit_blocks"] == round(want * r["lookup_blocks"])
    if order == "lru":
        assert r["hit_blocks"] == round(flat_lru_hit_ratio(wl.keys, budget) * r["lookup_blocks"])


def test_next_use_order_by_hand():
    """The oracle order puts the block looked up furthest ahead first (never again: first of all,
    ties: the larger key), judged from the current request, so a copy nobody refreshed is ranked
    by its next lookup, not its last."""
    occ = [[0, 5], [0, 2, 9], [1], [0, 3]]  # request indices that look each block up
    now = [0]
    o = fs.NextUseOrder(occ, lambda: now[0])
    for k in range(4):
        o[k] = None
    assert list(o) == [0, 3, 1, 2]  # next lookups 5, 3, 2, 1
    now[0] = 2
    assert list(o) == [2, 1, 0, 3]  # never, 9, 5, 3
    now[0] = 5
    assert list(o) == [3, 2, 0, 1]  # never (3, 2, 0 by key), 9
    assert o.victims(2, lambda k: k == 3) == [2, 0]
    o.pop(2)
    assert 2 not in o and len(o) == 3


@pytest.mark.parametrize(
    "name", ["d-s3", "m-hits", "d-eng-all", "m-eng2-all", "m-surv:nvme_order=dead;memory_order=dead"]
)
def test_new_orders_keep_the_tier_consistent(name):
    """Each new order, with the memory tiers on (their own order too for the ``-all`` configs),
    keeps the live budget and the device's mapping exact (check_invariants at the end of run)."""
    wl = fs.load_workload("excerpt", limit=200)
    r = fs.Simulator(wl, fs.config_from_spec(name), util=1.0).run()
    assert 0 < r["nvme_live_blocks_end"] <= r["live_budget_blocks"] and r["lru_evicted_blocks"] > 0


def test_order_config_errors():
    with pytest.raises(ValueError, match="granularity='block'"):
        fs.SimConfig("x", nvme_order="s3fifo")
    with pytest.raises(ValueError, match="hints='engine'"):
        fs.SimConfig("x", granularity="block", memory_order="engine")
    with pytest.raises(ValueError, match="accepted"):
        fs.SimConfig("x", memory_order="s3fifo")
    with pytest.raises(ValueError, match="hint_error"):
        fs.SimConfig("x", hints="engine", hint_error=1.5)


def test_flat_orders_bound_every_order_by_belady():
    """--flat-orders: at the flat LRU's blocks its LRU column is the reference flat LRU, a configuration
    with a live budget is sized smaller, and Belady bounds every order at every size."""
    wl = fs.load_workload("excerpt", limit=300)
    rows = fs.flat_orders(wl, ["d-eng-all"], 0.9)
    assert rows[0]["blocks"] == wl.capacity_blocks > rows[1]["blocks"]
    assert rows[0]["lru"] == flat_lru_hit_ratio(wl.keys, wl.capacity_blocks)
    for r in rows:
        assert all(r[k] <= r["belady"] + 1e-12 for k in ("lru", "s3fifo", "engine", "engine2"))
