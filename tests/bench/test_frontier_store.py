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


def test_hinted_stores_pass_one_hint_per_run_and_stop_at_a_block_not_kept():
    from tierstore import Status

    fs = load_tool("frontier_store")
    calls = []

    class Store:
        def store_keys(self, ns, keys, blocks, *, lifetime=None, first_position=0, wait=True):
            calls.append((list(keys), list(blocks), lifetime, first_position))
            return [Status.NO_SPACE if k == b"x" else Status.OK for k in keys]

    s = Store()
    hints = {b"a": "system", b"b": "system", b"c": "query", b"d": "conversation", b"x": "query"}
    fs.hinted_stores(s, hints)
    assert s.store_keys(b"ns", [b"a", b"b", b"c", b"d"], [1, 2, 3, 4], first_position=5) == [Status.OK] * 4
    assert calls == [
        ([b"a", b"b"], [1, 2], "system", 5),
        ([b"c"], [3], "query", 7),
        ([b"d"], [4], "conversation", 8),
    ]
    calls.clear()
    assert s.store_keys(b"ns", [b"a", b"x", b"d"], [1, 2, 3]) == [Status.OK, Status.NO_SPACE, Status.NO_SPACE]
    assert [c[0] for c in calls] == [[b"a"], [b"x"]]  # the chain behind a block not kept is not stored


def test_hint_map_labels_every_stored_key_and_says_which_hints_read_the_future():
    from tierstore.fdp.lifetime import LifetimeClass, class_from_hint

    fs = load_tool("frontier_store")
    wl = fs.load_workload("excerpt", None, 60, 32 << 10, None)
    eng = fs._fs.engine_classes(wl.keys, wl.n_blocks)
    n_keys = len({b for ks in wl.keys for b in ks})
    m = fs.hint_map(wl, "engine")
    assert len(m) == n_keys and {class_from_hint(h) for h in m.values()} <= set(LifetimeClass)
    assert sorted(int(class_from_hint(h)) for h in m.values()) == sorted(
        eng[b] for b in {b for ks in wl.keys for b in ks}
    )
    sys14 = fs.hint_map(wl, "system14")
    assert len(sys14) == n_keys and set(sys14.values()) <= {"system", "conversation"}
    assert "FUTURE" in fs.HINT_SOURCES["engine"] and "FUTURE" not in fs.HINT_SOURCES["system14"]
    assert fs.CONFIGS["d-hint-cls"][1]["eviction"] == "class_lru"


def test_rows_whose_hints_read_the_future_never_count_as_the_best_d():
    fs = load_tool("frontier_store")
    base = dict(
        workload="w",
        util=0.9,
        isolation="initial",
        flat_lru_saved_tokens=100,
        flat_lru=0.5,
        belady_saved_tokens=130,
        belady=0.6,
        device_waf=1.0,
        host_wa=1.0,
        placement={},
    )
    rows = [
        {**base, "config": "d-hint", "saved_prefill_tokens": 90, "e2e_wa": 1.01},
        {
            **base,
            "config": "d-hint-cls-eng",
            "saved_prefill_tokens": 120,
            "e2e_wa": 1.01,
            "hints_read_future": True,
        },
    ]
    (line,) = fs.summary(rows)[2:]
    assert "`d-hint` | 90 (-10.00 %)" in line and line.endswith("**no** |")
    assert "`d-hint-cls-eng` u=0.9 (its hints READ THE FUTURE)" in fs.report(rows)
