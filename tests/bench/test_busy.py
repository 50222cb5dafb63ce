"""The benchmarks' busy competitors (tierstore/bench/busy.py)."""

from __future__ import annotations

import pytest

from tierstore.bench.busy import competitors


def test_competitors_spin_during_the_block_and_are_reaped_after():
    with competitors(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)  # running
    assert all(p.returncode is not None for p in procs)  # killed and waited for


def test_competitors_are_reaped_when_the_block_raises():
    with pytest.raises(RuntimeError), competitors(1) as procs:
        raise RuntimeError("measurement failed")
    assert procs[0].returncode is not None


def test_no_competitors_is_the_quiet_condition():
    with competitors(0) as procs:
        assert procs == []
