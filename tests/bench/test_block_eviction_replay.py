"""bench/block_eviction_replay.py on a short excerpt: its rows are the store's counts, block mode evicts
single blocks and deallocates, region mode does neither."""

from __future__ import annotations

import json

from .tools import load_tool


def test_rows_of_region_and_block(tmp_path):
    ber = load_tool("block_eviction_replay")
    out = tmp_path / "o.json"
    assert ber.main(["--limit", "200", "--configs", "region,block", "--json", str(out)]) == 0
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    reg, blk = rows["region"], rows["block"]
    assert reg["block_evictions"] == 0 and reg["trimmed_bytes"] == 0
    assert blk["block_evictions"] > 0 and blk["segments_reset"] > 0
    for r in (reg, blk):
        assert r["requests"] == 200 and r["wrong_kv_blocks"] == 0 and r["e2e_wa_ftl_model"] >= 1.0
