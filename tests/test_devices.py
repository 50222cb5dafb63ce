"""tierstore.devices: the typed device geometry (NvmeGeometry) that device_stats reports,
and open_device for each device kind without a store around it."""

from __future__ import annotations

import dataclasses

import pytest

from tierstore import KVStore, get_layout
from tierstore.config import NvmeTierConfig
from tierstore.devices import NvmeGeometry, file_tier_geometry, open_device
from tierstore.errors import ConfigError
from tierstore.fdp.simdevice import SimFdpDevice
from tierstore.io.label import inspect_target

BB = get_layout("tiny").bytes_per_block


def test_geometry_is_frozen_and_as_dict_holds_only_the_set_fields():
    g = NvmeGeometry("file (posix engine) /x", device_bytes=1 << 20, nvme_bytes=1 << 20, utilization=1.0)
    assert g.as_dict() == {
        "description": "file (posix engine) /x",
        "device_bytes": 1 << 20,
        "nvme_bytes": 1 << 20,
        "utilization": 1.0,
    }
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.device_bytes = 0


def test_open_sim_device_in_memory():
    nv = NvmeTierConfig.model_validate(
        {
            "device": "sim",
            "engine": "memory",
            "capacity_bytes": 6 << 20,
            "model": {"device_bytes": 8 << 20, "ru_size_bytes": 256 << 10, "num_ruh": 4},
        }
    )
    od = open_device(nv, BB)
    try:
        assert od.path is None and od.discovery is None
        assert (
            isinstance(od.device, SimFdpDevice) and od.stats_source is od.device and od.ftl is od.device.ftl
        )
        assert (od.tier_bytes, od.segment_bytes) == (6 << 20, 256 << 10)
        g = od.geometry
        assert (g.device_bytes, g.nvme_bytes, g.ru_size_bytes, g.segment_size_bytes, g.num_ruh) == (
            8 << 20,
            6 << 20,
            256 << 10,
            256 << 10,
            4,
        )
        assert g.utilization == pytest.approx(0.75) and g.lba_bytes is None and g.warning is None
        assert g.description.startswith("sim (FTL model, memory engine)")
    finally:
        od.engine.close()


def test_open_sim_device_refuses_an_ru_off_the_page_size():
    nv = NvmeTierConfig.model_validate(
        {
            "device": "sim",
            "engine": "memory",
            "capacity_bytes": 6 << 20,
            "model": {"device_bytes": 8 << 20, "ru_size_bytes": (256 << 10) + 512},
        }
    )
    with pytest.raises(ConfigError, match="must be a multiple of page_bytes"):
        open_device(nv, BB)


def test_file_geometry_of_a_new_tier_is_chosen_from_the_capacity(tmp_path):
    path = str(tmp_path / "t.nvme")
    nv = NvmeTierConfig.model_validate(
        {"path": path, "capacity_bytes": 4 << 20, "segment_size_bytes": 256 << 10}
    )
    assert file_tier_geometry(inspect_target(path), nv, BB) == (256 << 10, 4 << 20)


def test_device_stats_reports_the_geometry_fields_of_a_file_tier(tmp_path):
    s = KVStore.from_config(
        {"tiers": {"nvme": {"path": str(tmp_path), "capacity_bytes": "4m", "segment_size_bytes": "256k"}}},
        get_layout("tiny"),
    )
    try:
        d = s.device_stats()
        # a plain file: no FTL model, no OP or RUHs; the keys KVStore.device_stats has always given
        assert list(d) == [
            "device",
            "device_bytes",
            "nvme_bytes",
            "ru_size_bytes",
            "segment_size_bytes",
            "utilization",
            "dataplacement",
            "tier_write_bytes",
            "host_user_bytes",
            "host_gc_bytes",
            "host_write_amplification",
            "engine_write_bytes",
            "engine_trim_bytes",
        ]
        assert d["device"].startswith("file (") and d["nvme_bytes"] == d["device_bytes"] == 4 << 20
        assert d["utilization"] == 1.0 and d["dataplacement"] == "none"
    finally:
        s.close()


def test_device_fdp_is_assembled_from_discovery_with_placement_and_device_counters(monkeypatch):
    """``device: fdp`` without hardware: the QEMU 4x2 namespace of tests/fdp as discovery
    answers it, a memory engine in place of the passthrough one, nvme-cli's counters faked."""
    import os

    from tests.fdp import gen_fixtures as G
    from tests.fdp.test_device_path import _status_4x2
    from tierstore import devices
    from tierstore.fdp import device as fdp_device
    from tierstore.fdp import discovery, nvme_cli
    from tierstore.fdp import logpages as lp
    from tierstore.io.factory import open_engine

    with open(os.path.join(G.DATA, "qemu_4x2", "configs.bin"), "rb") as f:
        cfg = lp.parse_fdp_configs(f.read()).configs[0]
    with open(os.path.join(G.DATA, "qemu_4x2", "id_ns.bin"), "rb") as f:
        idns = lp.parse_id_ns(f.read())
    info = nvme_cli.FdpDeviceInfo("/dev/nvme0", True, True, 0, cfg, _status_4x2())
    ns = discovery.FdpNamespace(
        "/dev/ng0n1", "/dev/nvme0n1", "/dev/nvme0", 1, 1, idns, 524288, "fdpvm0001", info
    )
    monkeypatch.setattr(fdp_device, "discover_namespace", lambda dev, endgid=1, cli=None: ns)
    engines = []

    def passthrough(char_dev, size_bytes, nsid, lba_bytes, **kw):
        engines.append((char_dev, size_bytes, nsid, lba_bytes, kw))
        return open_engine("memory", None, size_bytes)

    class Counters:
        def __init__(self, dev, endgid=1):
            self.dev = dev

        def stats(self):
            return {"hbmw_bytes": 4096, "mbmw_bytes": 8192, "mbe_bytes": 0}

    monkeypatch.setattr(devices, "PassthroughEngine", passthrough)
    monkeypatch.setattr(nvme_cli, "FdpDeviceStats", Counters)
    runs = cfg.runs_bytes
    s = KVStore.from_config(
        {
            "tiers": {
                "nvme": {
                    "device": "fdp",
                    "path": "/dev/ng0n1",
                    "capacity_bytes": 4 * runs,
                    "fdp": {"enabled": True},
                }
            }
        },
        get_layout("tiny"),
    )
    try:
        assert engines[0][:4] == ("/dev/ng0n1", 4 * runs, 1, 512)
        assert (
            engines[0][4]["ruh_update_segment_bytes"] == runs and engines[0][4]["pid_table"] == ns.pid_table
        )
        assert s.placement.enabled and s.ftl is None
        d = s.device_stats()
        assert d["device"].startswith("/dev/ng0n1 (FDP namespace 1 of /dev/nvme0")
        assert (d["device_bytes"], d["nvme_bytes"], d["ru_size_bytes"], d["segment_size_bytes"]) == (
            ns.size_bytes,
            4 * runs,
            runs,
            runs,
        )
        assert "lba_bytes" not in d and s._parts.geometry.lba_bytes == 512
        assert d["dataplacement"] == "fdp" and (d["hbmw_bytes"], d["mbmw_bytes"]) == (4096, 8192)
        assert "ruh_updates" not in d
    finally:
        s.close()
