"""bench/frontier_store.py: one configuration per registered classifier, rows that are the real store's
counts with the placement's accuracy against chance, and the learned-mix check."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tierstore.policies.registry import CLASSIFIER

from .tools import load_tool


def test_every_classifier_has_a_per_block_fdp_config():
    fs = load_tool("frontier_store")
    for name in CLASSIFIER.names():
        what, pol, nv = fs.CONFIGS[f"d-{name}"]
        assert pol["classifier"] == name and nv["eviction_granularity"] == "block" and nv["fdp"]["enabled"]
    assert fs.CONFIGS["c"][2] == {"eviction_granularity": "block"}  # conventional: no FDP


def test_fit_mix_beats_chance_only_when_the_features_say_something():
    fs = load_tool("frontier_store")
    rng = np.random.default_rng(0)
    n = 3000
    life = rng.exponential(10.0, n)
    died = np.ones(n, dtype=bool)
    informative = np.c_[np.zeros(n), life + rng.normal(0, 1.0, n), np.zeros(n), np.zeros(n)]
    noise = np.c_[np.zeros(n), rng.exponential(10.0, n), np.zeros(n), np.zeros(n)]
    good = fs.fit_mix(informative, life, died, [1 / 3] * 3)
    bad = fs.fit_mix(noise, life, died, [1 / 3] * 3)
    assert good["accuracy"] > good["chance_same_shares"] + 0.2
    assert abs(bad["accuracy"] - bad["chance_same_shares"]) < 0.05


@pytest.mark.timeout(600)
def test_rows_through_the_real_store(tmp_path):
    fs = load_tool("frontier_store")
    out = tmp_path / "rows.jsonl"
    assert (
        fs.main(
            [
                "--workload",
                "excerpt",
                "--limit",
                "150",
                "--configs",
                "a,c,d-demotion",
                "--utils",
                "0.9",
                "--isolations",
                "initial",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = {r["config"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"a", "c", "d-demotion"}
    for r in rows.values():
        assert r["requests"] == 150 and r["wrong_kv_blocks"] == 0 and r["e2e_wa"] >= 1.0
        assert r["flat_lru_saved_tokens"] <= r["belady_saved_tokens"]
    assert rows["a"]["block_evictions"] == 0 and rows["c"]["block_evictions"] > 0
    p = rows["d-demotion"]["placement"]
    assert p["writes"] > 0 and 0.0 <= p["chance_same_shares"] <= 1.0 and "learned_mix" in p
    assert "FTL model" in fs.report(list(rows.values()))
