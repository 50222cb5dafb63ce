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
    assert g.as_dict() == {"description": "file (posix engine) /x", "device_bytes": 1 << 20,
                           "nvme_bytes": 1 << 20, "utilization": 1.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        g.device_bytes = 0


def test_open_sim_device_in_memory():
    nv = NvmeTierConfig.model_validate({"device": "sim", "engine": "memory", "capacity_bytes": 6 << 20,
                                        "model": {"device_bytes": 8 << 20, "ru_size_bytes": 256 << 10,
                                                  "num_ruh": 4}})
    od = open_device(nv, BB)
    try:
        assert od.path is None and od.discovery is None
        assert isinstance(od.device, SimFdpDevice) and od.stats_source is od.device and od.ftl is od.device.ftl
        assert (od.tier_bytes, od.segment_bytes) == (6 << 20, 256 << 10)
        g = od.geometry
        assert (g.device_bytes, g.nvme_bytes, g.ru_size_bytes, g.segment_size_bytes, g.num_ruh) == \
            (8 << 20, 6 << 20, 256 << 10, 256 << 10, 4)
        assert g.utilization == pytest.approx(0.75) and g.lba_bytes is None and g.warning is None
        assert g.description.startswith("sim (FTL model, memory engine)")
    finally:
        od.engine.close()


def test_open_sim_device_refuses_an_ru_off_the_page_size():
    nv = NvmeTierConfig.model_validate({"device": "sim", "engine": "memory", "capacity_bytes": 6 << 20,
                                        "model": {"device_bytes": 8 << 20, "ru_size_bytes": (256 << 10) + 512}})
    with pytest.raises(ConfigError, match="must be a multiple of page_bytes"):
        open_device(nv, BB)


def test_file_geometry_of_a_new_tier_is_chosen_from_the_capacity(tmp_path):
    path = str(tmp_path / "t.nvme")
    nv = NvmeTierConfig.model_validate({"path": path, "capacity_bytes": 4 << 20, "segment_size_bytes": 256 << 10})
    assert file_tier_geometry(inspect_target(path), nv, BB) == (256 << 10, 4 << 20)


def test_device_stats_reports_the_geometry_fields_of_a_file_tier(tmp_path):
    s = KVStore.from_config({"tiers": {"nvme": {"path": str(tmp_path), "capacity_bytes": "4m",
                                                "segment_size_bytes": "256k"}}}, get_layout("tiny"))
    try:
        d = s.device_stats()
        # a plain file: no FTL model, no OP or RUHs; the keys KVStore.device_stats has always given
        assert list(d) == ["device", "device_bytes", "nvme_bytes", "ru_size_bytes", "segment_size_bytes",
                           "utilization", "dataplacement", "tier_write_bytes", "host_user_bytes", "host_gc_bytes",
                           "host_write_amplification", "engine_write_bytes", "engine_trim_bytes"]
        assert d["device"].startswith("file (") and d["nvme_bytes"] == d["device_bytes"] == 4 << 20
        assert d["utilization"] == 1.0 and d["dataplacement"] == "none"
    finally:
        s.close()
