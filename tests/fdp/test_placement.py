"""Placement policy (handle->PID table from RUH Status) and the lifetime classifier."""

from __future__ import annotations

import os

import pytest

from tests.fdp import gen_fixtures as G
from tierstore.errors import ConfigError
from tierstore.fdp import logpages as lp
from tierstore.fdp.ftl import FTLModel
from tierstore.fdp.lifetime import LifetimeClass as L
from tierstore.fdp.lifetime import ReuseLifetimeClassifier, class_from_hint
from tierstore.fdp.placement import PlacementPolicy, make_pid, split_pid
from tierstore.fdp.simdevice import SimFdpDevice


def test_make_split_pid():
    assert make_pid(1, 3, 2) == 0x4003
    assert split_pid(0x4003, 2) == (1, 3)
    assert make_pid(0, 5, 0) == 5 and split_pid(5, 0) == (0, 5)
    with pytest.raises(ConfigError):
        make_pid(4, 0, 2)
    with pytest.raises(ConfigError):
        make_pid(0, 1 << 14, 2)


def test_policy_from_device_status_fixture():
    with open(os.path.join(G.DATA, "ruh_status_rgif2.bin"), "rb") as f:
        st = lp.parse_ruh_status(f.read())
    p = PlacementPolicy.from_ruh_status(st, rgif=2, reclaim_group=1)
    assert p.default_pid == 0x4000
    assert p.placement_for(L.LONG) == 0x4001 and p.placement_for(L.MEDIUM) == 0x4002
    assert p.placement_for(L.SHORT) == 0x4003
    assert p.placement_for(None) == 0x4000 and p.placement_for_metadata() == 0x4000
    with pytest.raises(ConfigError):
        PlacementPolicy.from_ruh_status(st, rgif=2, reclaim_group=3)


@pytest.mark.parametrize("nruh,expect", [(1, (0, 0, 0)), (2, (0, 1, 1)), (3, (1, 2, 2)), (8, (1, 2, 3))])
def test_handle_sharing_with_few_handles(nruh, expect):
    dev = SimFdpDevice(FTLModel(64 << 20, 1 << 20, 0.5, num_ruh=nruh, page_bytes=4096))
    p = dev.placement_policy()
    assert (p.placement_for(L.LONG), p.placement_for(L.MEDIUM), p.placement_for(L.SHORT)) == expect


def test_disabled_policy_gives_no_placement():
    p = PlacementPolicy.disabled()
    assert p.placement_for(L.SHORT) is None and p.placement_for_metadata() is None
    assert p.placement_for_key("k", "system") is None


def test_hints():
    assert class_from_hint("system prompt") is L.LONG
    assert class_from_hint("conversation") is L.MEDIUM
    assert class_from_hint("single query") is L.SHORT
    assert class_from_hint("Single-Query") is L.SHORT
    with pytest.raises(ConfigError):
        class_from_hint("forever")


def test_reuse_classifier():
    c = ReuseLifetimeClassifier(long_min_reuses=3, long_max_interval_s=600, medium_max_idle_s=300)
    c.observe("sys", 0.0)
    for t in (10.0, 20.0, 30.0):
        c.observe("sys", t)
    c.observe("conv", 0.0)
    c.observe("conv", 120.0)
    c.observe("q", 5.0)
    assert c.classify("sys", now_s=40.0) is L.LONG
    assert c.classify("conv", now_s=200.0) is L.MEDIUM
    assert c.classify("conv", now_s=1000.0) is L.SHORT  # idle too long
    assert c.classify("q", now_s=6.0) is L.SHORT
    assert c.classify("unseen") is L.SHORT
    assert c.classify("q", hint="system") is L.LONG  # the hint wins
    small = ReuseLifetimeClassifier(max_keys=2)
    for k in "abc":
        small.observe(k, 0.0)
    assert small.reuse_stats("a") == (0, float("inf")) and len(small._seen) == 2
