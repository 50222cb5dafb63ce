"""bench/fdp_vm_handles.py: bytes per handle from RUAMW reads, and the table beside the model's bytes.

The guest run itself needs ``../shared/tools/fdp-vm`` (minutes under TCG): not run here."""

from __future__ import annotations

from .tools import load_tool

RUNS = 8 << 20
LBA = 512


def test_handle_tally_sums_each_ru_from_its_start_to_the_read_before_its_update():
    t = load_tool("fdp_vm_handles").HandleTally({0: RUNS // LBA, 1: RUNS // LBA - 8}, RUNS, LBA)
    t.switch(1, RUNS // LBA - 8 - 100)  # 100 blocks into the RU an earlier run left 8 blocks into
    t.switch(1, RUNS // LBA - 50)  # a fresh RU took 50 blocks, then another update
    t.finish({0: RUNS // LBA - 3, 1: RUNS // LBA - 7})
    assert t.bytes == {0: 3 * LBA, 1: (100 + 50 + 7) * LBA}
    assert t.updates == {0: 0, 1: 2}
    assert t.unwritten_bytes == (RUNS // LBA - 108 + RUNS // LBA - 50) * LBA  # MBMW - HBMW on QEMU


def test_table_puts_device_engine_and_model_bytes_per_pid_with_the_class():
    fh = load_tool("fdp_vm_handles")
    guest = {
        "row": {"class_pid": {"LONG": 1, "MEDIUM": 2, "SHORT": 3, "default": 0}},
        "device_bytes_per_pid": {"2": 4096, "3": 8192},
        "engine_bytes_per_pid": {"2": 4096, "3": 8192, "none": 512},
        "ruh_updates_per_pid": {"3": 1},
        "host_events": {"n": 0, "per_pid": {}},
    }
    res = {
        "namespace": {"runs_bytes": RUNS},
        "configs": {
            "d-hint": {"sim": {"ruh_bytes": {"2": 4096, "3": 8192}}, "guest": guest},
            "c": {"sim": {"ruh_bytes": None}, "guest": {"error": "boom"}},
        },
    }
    lines = fh.table(res)
    assert "| `d-hint` | 3 | SHORT | 8,192 | 8,192 | 8,192 | 1 | 0 |" in lines
    assert "| `d-hint` | 2 | MEDIUM | 4,096 | 4,096 | 4,096 | 0 | 0 |" in lines
    assert "| `d-hint` | 0 | default | 0 | 512 (512 untagged) | 0 | 0 | 0 |" in lines  # handle 0's
    assert any("guest failed: boom" in x for x in lines)


def test_whole_rus_filled_without_a_ruh_update_are_shown_beside_the_ruamw_tally():
    fh = load_tool("fdp_vm_handles")
    assert (
        fh.device_cell(3 * LBA, 2 * RUNS + 3 * LBA, RUNS)
        == f"{2 * RUNS + 3 * LBA:,} (2 whole RUs + 1,536 by RUAMW)"
    )
    assert fh.device_cell(3 * LBA, 3 * LBA, RUNS) == "1,536"
    assert fh.device_cell(3 * LBA, 4 * LBA, RUNS) == "1,536"  # not whole RUs: the tally as it is
