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
