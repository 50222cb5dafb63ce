"""Reinsertion on region eviction: the CLOCK reference bit (hit since the NVMe copy was written)."""

from __future__ import annotations

import pytest

from tierstore import KVStore, Tier
from tierstore.io import format as fmt
from tierstore.io.segments import SegmentStorage
from tierstore.policies.reinsert import ClockReinsertion, HitsReinsertion, make_reinsert

from ..conftest import make_blocks, tokens


class E:
    def __init__(self, hits, last, written):
        self.hits, self.last_access_s, self.nvme_written_s = hits, last, written


def test_clock_rule_unit():
    c = make_reinsert("clock")
    assert isinstance(c, ClockReinsertion)
    assert c(E(1, 10.0, 5.0), 20.0)  # hit after it was written: second chance
    assert not c(E(3, 4.0, 5.0), 20.0)  # hit only before (in memory): dropped
    assert not c(E(0, 5.0, 5.0), 20.0)  # never hit
    assert HitsReinsertion()(E(3, 4.0, 5.0), 20.0)  # the hits rule keeps any block ever hit


def _nvme_only(layout, clock, blocks, reinsert):
    bb = layout.bytes_per_block
    one = fmt.extent_bytes_for(1, bb)
    seg = 2 * one  # two blocks per segment: evicting one with a kept block still frees space
    nv = SegmentStorage(
        None,
        (blocks // 2 + 1) * seg,
        bb,
        segment_size_bytes=seg,
        engine="memory",
        extent_size_bytes=one,
        owns_engine=True,
        region_policy="fifo",
    )
    return KVStore(layout, hbm_bytes=0, host_bytes=0, nvme=nv, clock=clock, reinsert=reinsert)


@pytest.mark.parametrize("reinsert", ["none", "clock"])
def test_fifo_regions_copy_forward_blocks_hit_on_flash(layout, ns, clock, reinsert):
    s = _nvme_only(layout, clock, 8, reinsert)
    try:
        T = layout.tokens_per_block
        hot = tokens(T, 0)
        assert all(st.name == "OK" for st in s.store(ns, hot, make_blocks(layout, 1)))
        clock.advance(1)
        for i in range(1, 8):  # fill the tier behind the hot block
            s.store(ns, tokens(T, 1000 * i), make_blocks(layout, 1, seed=i))
            clock.advance(1)
        with s.request() as rid:  # a hit while the block is on flash
            assert s.lookup(ns, hot, request_id=rid).matched_blocks == 1
        clock.advance(1)
        s.store(
            ns, tokens(T, 500_000), make_blocks(layout, 1, seed=9)
        )  # evicts the oldest region: the hot one
        hot_key = s.keys_for(ns, hot)[0]
        assert s.tiers_of(s.keys_for(ns, tokens(T, 500_000))[0]) == [Tier.NVME]
        kept = s.resident([hot_key]) == [True]
        assert kept == (reinsert == "clock")
        st = s.nvme.stats()
        assert (st["region_kept_blocks"] > 0) == (reinsert == "clock")
        if kept:  # its bit restarted at the copy-forward: not hit again, the next round drops it
            assert st["gc_bytes_written"] > 0
            for i in range(10):
                clock.advance(1)
                s.store(ns, tokens(T, 700_000 + 1000 * i), make_blocks(layout, 1, seed=20 + i))
            assert s.resident([hot_key]) == [False]
    finally:
        s.close()
