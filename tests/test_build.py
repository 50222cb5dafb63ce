"""tierstore.build: one assembly path for every NVMe device kind, placement tags reaching
the FTL per RUH, dataplacement none in the default RUH, and the kvtrace device section."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tierstore import KVStore, Namespace, Status, get_layout
from tierstore.config import StoreConfig
from tierstore.errors import ConfigError
from tierstore.fdp.device import NOT_VERIFIED_ON_HARDWARE, RuhUpdateShim
from tierstore.fdp.lifetime import LifetimeClass
from tierstore.policies.lifetime import ReuseEntryClassifier, make_classifier


@pytest.fixture
def layout():
    return get_layout("tiny")


NS = Namespace(model="tiny-llama@rev1", tokenizer="tok@1")


def _store_chain(store, n_blocks: int, seed: int, lifetime: str | None = None) -> list[Status]:
    lay = store.layout
    rng = np.random.default_rng(seed)
    toks = rng.integers(0, 30000, n_blocks * lay.tokens_per_block)
    blocks = torch.randn(n_blocks, *lay.block_shape, dtype=lay.dtype)
    return store.store(NS, toks, blocks, lifetime=lifetime), toks, blocks


def _sim(
    layout,
    dataplacement="none",
    plids=(),
    engine="memory",
    path=None,
    host_bytes=0,
    ru_size_bytes=256 << 10,
    **runtime,
) -> KVStore:
    nvme = {
        "device": "sim",
        "engine": engine,
        "fdp": {"enabled": dataplacement == "fdp", "plids": list(plids)},
        "model": {"device_bytes": 8 << 20, "utilization": 0.75, "ru_size_bytes": ru_size_bytes, "num_ruh": 4},
    }
    if path is not None:
        nvme["path"] = path
    cfg = StoreConfig.from_dict({"tiers": {"host": {"capacity_bytes": host_bytes}, "nvme": nvme}})
    return KVStore.from_config(cfg, layout, **runtime)


def test_file_mode_roundtrip_with_model(tmp_path, layout):
    w = KVStore.from_config(
        {
            "tiers": {
                "nvme": {
                    "path": str(tmp_path),
                    "capacity_bytes": "4m",
                    "segment_size_bytes": "256k",
                    "model": {},
                }
            }
        },
        layout,
    )
    try:
        st, toks, blocks = _store_chain(w, 4, 1)
        assert st == [Status.OK] * 4
        hit = w.lookup(NS, toks)
        sts, outs = w.load(hit)
        assert sts == [Status.OK] * 4 and torch.equal(torch.stack(outs), blocks)
        d = w.device_stats()
        assert w.nvme.segment_size_bytes == d["ru_size_bytes"] == 256 << 10
        assert "model" in d["device"] and d["waf"] == pytest.approx(1.0) and d["e2e_wa"] >= 1.0
    finally:
        w.close()


@pytest.mark.parametrize("engine", ["memory", "posix"])
def test_sim_mode_builds_segment_equals_ru(tmp_path, layout, engine):
    w = _sim(layout, engine=engine, path=str(tmp_path) if engine != "memory" else None)
    try:
        assert w.nvme.segment_size_bytes == w.ftl.ru_size_bytes == 256 << 10
        d = w.device_stats()
        assert d["nvme_bytes"] == 6 << 20 and d["utilization"] == pytest.approx(0.75)
        assert w.ftl.capacity_bytes == 8 << 20
        st, _, _ = _store_chain(w, 3, 2)
        assert st == [Status.OK] * 3
    finally:
        w.close()


def test_fdp_tags_reach_ftl_per_ruh(layout):
    w = _sim(layout, dataplacement="fdp")
    try:
        pol = w.placement
        for i, hint in enumerate(("system", "conversation", "query")):
            st, _, _ = _store_chain(w, 5, 10 + i, lifetime=hint)
            assert st == [Status.OK] * 5
        d = w.device_stats()
        used = {int(k) for k in d["ruh_bytes"]}
        expect = {pol.class_pid[c] for c in LifetimeClass}
        assert used == expect and 0 not in used
        assert len(expect) == 3
        assert d["invalid_pid_writes"] == 0
        assert w.stats()["nvme_backend"]["engine"]["bytes_by_placement"].keys() == expect
    finally:
        w.close()


def test_fdp_tier_in_a_file_tags_its_label_with_the_default_pid(tmp_path, layout):
    """The label and a format's zeroed chain starts are written with the metadata PID
    (the default handle), not untagged: on an FDP SSD every write names a handle
    (CI's fdp session found 4096 untagged bytes: the label)."""
    w = _sim(layout, dataplacement="fdp", engine="posix", path=str(tmp_path))
    try:
        st, _, _ = _store_chain(w, 3, 4, lifetime="system")
        assert st == [Status.OK] * 3
        by = w.stats()["nvme_backend"]["engine"]["bytes_by_placement"]
        assert "none" not in by and None not in by
        assert by[w.placement.placement_for_metadata()] >= 4096
    finally:
        w.close()


def test_dataplacement_none_goes_to_default_ruh(layout):
    w = _sim(layout, dataplacement="none")
    try:
        for i, hint in enumerate(("system", "conversation", "query")):
            _store_chain(w, 5, 20 + i, lifetime=hint)
        d = w.device_stats()
        assert set(d["ruh_bytes"]) == {"0"} and d["hbmw_bytes"] > 0
        assert set(w.stats()["nvme_backend"]["engine"]["bytes_by_placement"]) == {"none"}
        assert not w.placement.enabled and d["dataplacement"] == "none"
    finally:
        w.close()


def test_plids_pick_handles(layout):
    w = _sim(layout, dataplacement="fdp", plids=(3, 2))
    try:
        assert w.placement.class_pid == {
            LifetimeClass.LONG: 3,
            LifetimeClass.MEDIUM: 2,
            LifetimeClass.SHORT: 3,
        }
    finally:
        w.close()
    with pytest.raises(ConfigError, match="plids"):
        _sim(layout, dataplacement="fdp", plids=(9,))


def test_bad_configs_are_clear(layout, tmp_path):
    with pytest.raises(ConfigError, match="device"):
        StoreConfig.from_dict({"tiers": {"nvme": {"device": "nvme", "path": "x", "capacity_bytes": 1}}})
    with pytest.raises(ConfigError, match="utilization"):
        StoreConfig.from_dict(
            {"tiers": {"nvme": {"device": "sim", "capacity_bytes": "1m", "model": {"utilization": 1.5}}}}
        )
    with pytest.raises(ConfigError, match="RU"):
        _sim(layout, ru_size_bytes=8 << 20)
    with pytest.raises(ConfigError, match="/dev/ng"):
        KVStore.from_config(
            {"tiers": {"nvme": {"device": "fdp", "path": str(tmp_path / "x"), "capacity_bytes": "1m"}}},
            layout,
        )
    with pytest.raises(ConfigError, match="too small"):
        KVStore(layout, nvme_path=str(tmp_path), nvme_bytes=layout.bytes_per_block)
    assert "hardware" in NOT_VERIFIED_ON_HARDWARE


def test_classifier_plugin(layout):
    calls = []

    def always_long(entry, now_s):
        calls.append(entry.key)
        return LifetimeClass.LONG

    assert make_classifier("reuse").__class__ is ReuseEntryClassifier
    w = _sim(layout, dataplacement="fdp", classify=always_long)
    try:
        _store_chain(w, 4, 3)
        assert len(calls) == 4
        assert set(w.device_stats()["ruh_bytes"]) == {str(w.placement.class_pid[LifetimeClass.LONG])}
    finally:
        w.close()
    with pytest.raises(ConfigError, match="classifier"):
        make_classifier("psychic")


def test_ruh_update_shim_starts_fresh_ru():
    class Target:
        def __init__(self):
            self.log = []

        def ruh_update(self, pl):
            self.log.append(("update", pl))

        def on_write(self, off, n, pl):
            self.log.append(("write", off))

        def on_trim(self, off, n):
            self.log.append(("trim", off))

    t = Target()
    s = RuhUpdateShim(t, 1 << 20)
    s.on_write(0, 4096, 5)
    s.on_write(4096, 4096, 5)
    s.on_write(1 << 20, 4096, 5)
    s.on_trim(0, 1 << 20)
    assert t.log == [
        ("update", 5),
        ("write", 0),
        ("write", 4096),
        ("update", 5),
        ("write", 1 << 20),
        ("trim", 0),
    ]
    assert s.ruh_updates == 2


def test_kvtrace_device_section_sim(tmp_path, capsys):
    from tierstore.bench import registry
    from tierstore.bench.cli import main
    from tierstore.bench.kvjobs import run_kvtrace

    registry.register_runner(["kvtrace"], run_kvtrace, replace=True)
    for dp in ("fdp", "none"):
        out = tmp_path / f"{dp}.json"
        rc = main(
            [
                "--rw=kvtrace",
                "--number_ios=150",
                "--device=sim",
                f"--dataplacement={dp}",
                "--utilization=0.9",
                "--output-format=json",
                f"--output={out}",
            ]
        )
        assert rc == 0, capsys.readouterr().err
        d = json.loads(out.read_text())["jobs"][0]["device"]
        for k in ("hbmw_bytes", "mbmw_bytes", "mbe_bytes", "waf", "ruh_bytes", "e2e_wa"):
            assert k in d, k
        assert d["waf"] >= 1.0 and d["e2e_wa"] >= 1.0 and d["device"].startswith("sim")
        assert d["utilization"] == pytest.approx(0.9, abs=0.02)
        assert len(d["waf_timeseries"]["waf"]) == len(d["waf_timeseries"]["t_s"]) >= 1
        if dp == "none":
            assert set(d["ruh_bytes"]) == {"0"}
        else:
            assert "0" not in d["ruh_bytes"]


def test_several_streams_never_drop_demotions(layout):
    """With one open segment per placement stream, a demotion to a stream without
    room makes the region manager evict a region; no demotion is refused."""
    w = _sim(layout, dataplacement="fdp", host_bytes=16 * layout.bytes_per_block)
    try:
        for i in range(400):
            st, _, _ = _store_chain(w, 4, 100 + i, lifetime=("system", "query", "conversation")[i % 3])
            assert st == [Status.OK] * 4
        snap = w.stats()
        assert snap.get("nvme_put_no_space", 0) == 0
        assert snap["nvme_backend"]["regions_evicted"] > 0 and snap["demotions_host_nvme"] > 1500
        w.check_invariants(quiescent=True)
        assert w.device_stats()["waf"] == pytest.approx(1.0)
    finally:
        w.close()


def test_small_blocks_say_how_much_of_the_nvme_tier_they_can_use(tmp_path, caplog):
    """4 KiB blocks: each may take an extent of its own with a 4096-byte header, so 64 MiB holds 31.5 MiB
    of KV; that was said nowhere (a fresh-user trial found it). One warning at build, with both figures."""
    from tierstore.layout import KVLayout

    small = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=16, dtype=torch.float16)
    assert small.bytes_per_block == 4096
    with caplog.at_level("WARNING", logger="tierstore"):
        s = KVStore(small, host_bytes=0, nvme_path=str(tmp_path / "small"), nvme_bytes=64 << 20)
    try:
        held = s.capacity_bytes()["nvme"]
    finally:
        s.close()
    said = [r.getMessage() for r in caplog.records if "header" in r.getMessage()]
    assert len(said) == 1, said
    assert str(64 << 20) in said[0] and str(held) in said[0] and held < 40 << 20
    caplog.clear()
    for name, tpb in (("big", 64), ("trace", 16)):  # 128 KiB; 32 KiB, the packaged trace's (the main job)
        big = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, tokens_per_block=tpb, dtype=torch.float16)
        with caplog.at_level("WARNING", logger="tierstore"):
            KVStore(big, host_bytes=0, nvme_path=str(tmp_path / name), nvme_bytes=64 << 20).close()
        assert not [r for r in caplog.records if "header" in r.getMessage()], name


def test_the_capacity_warning_bounds_what_the_tier_really_holds(tmp_path, caplog):
    """Fresh-user trial: 'NVMe tier of 2 MiB holds 126 blocks', then the tier held and returned 180:
    126 is the least (one block per extent). The warning says so and gives the most (full extents);
    batched stores land in between."""
    import re

    from tierstore.layout import KVLayout

    lay = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, tokens_per_block=16, dtype=torch.float32)
    assert lay.bytes_per_block == 8192
    with caplog.at_level("WARNING", logger="tierstore"):
        s = KVStore(lay, host_bytes=0, nvme_path=str(tmp_path / "nvme"), nvme_bytes=2 << 20)
    try:
        (said,) = [r.getMessage() for r in caplog.records if "header" in r.getMessage()]
        m = re.search(r"holds at least (\d+) blocks .* up to (\d+) blocks when every extent is full", said)
        assert m, said
        least, most = int(m.group(1)), int(m.group(2))
        assert least == s.nvme.capacity_blocks() and most > least
        ns = Namespace(model="fill")
        g = torch.Generator().manual_seed(3)
        for c in range(2 * most // 8):  # batches of 8: extents of several blocks, until eviction
            toks = list(range(c * 1000, c * 1000 + 8 * 16))
            s.store(ns, toks, [torch.randn(lay.block_shape, generator=g) for _ in range(8)])
        s.flush()
        held = sum(s.namespaces().values())
        assert least < held <= most, (least, held, most)
    finally:
        s.close()


def test_segments_that_strand_half_the_tier_are_said_with_a_size_that_fits(tmp_path, caplog):
    """2 MiB blocks in a 256 MiB tier: 4 MiB segments hold one block each (two need 4 MiB + a
    4096-byte header), so half the tier never held KV and nothing said so (fresh-user trial 4c)."""
    lay = get_layout("llama-3.1-8b")
    with caplog.at_level("WARNING", logger="tierstore.build"):
        KVStore(lay, nvme_path=str(tmp_path / "a"), nvme_bytes=256 << 20).close()
    said = [r.getMessage() for r in caplog.records if "can hold KV" in r.getMessage()]
    assert len(said) == 1 and "(49%)" in said[0] and "segment_size_bytes=4198400" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="tierstore.build"):  # the size it names: quiet, and it fits
        s = KVStore(lay, nvme_path=str(tmp_path / "b"), nvme_bytes=256 << 20, segment_size_bytes=4198400)
    try:
        assert not [r for r in caplog.records if "can hold KV" in r.getMessage()]
        ns, toks = Namespace(model="fit"), list(range(2 * lay.tokens_per_block))
        kv = torch.zeros((2, *lay.block_shape), dtype=lay.dtype)
        assert s.store(ns, toks, kv) == [Status.OK, Status.OK]
    finally:
        s.close()
