"""The handler table: one handler per (source medium, destination medium), a clear error for a
kind the store has no tier for, and the executor routing through it."""

from __future__ import annotations

import pytest

from tierstore.contract import Demotion, Medium, StorePlan, Tier
from tierstore.errors import ConfigError
from tierstore.movers import HandlerTable, MemoryHandler, Movers, NvmeHandler, RemoteHandler
from tierstore.tiers.memory import BlockPool

from ..conftest import memory_segment_store

M, N, R = Medium.MEMORY, Medium.NVME, Medium.REMOTE


def test_kinds_of_a_memory_only_store_and_the_missing_handler_errors():
    memory = MemoryHandler({Tier.HOST: BlockPool("host", 2, 64)})
    table = HandlerTable(memory)
    assert table[M, M] is memory and (M, M) in table
    assert set(table.kinds) == {(M, M)}
    for kind, msg in (
        ((M, N), "no memory->nvme handler: no NVMe tier"),
        ((N, M), "no nvme->memory handler: no NVMe tier"),
        ((M, R), "no memory->remote handler: no remote tier"),
        ((R, M), "no remote->memory handler: no remote tier"),
    ):
        assert kind not in table
        with pytest.raises(ConfigError, match=msg):
            table[kind]
    with pytest.raises(ConfigError, match="no nvme->remote handler: no such transfer"):
        table[N, R]


def test_one_handler_serves_both_directions_of_its_medium(layout):
    nvme_storage = memory_segment_store(layout, 4)
    try:
        memory = MemoryHandler({})
        nvme = NvmeHandler(nvme_storage)
        remote = object.__new__(RemoteHandler)  # the table only files it; no tier needed here
        table = HandlerTable(memory, nvme, remote)
        assert table[M, N] is table[N, M] is nvme
        assert table[M, R] is table[R, M] is remote
        assert set(table.kinds) == {(M, M), (M, N), (N, M), (M, R), (R, M)}
    finally:
        nvme_storage.close()


def test_movers_route_through_the_table_and_refuse_a_missing_kind():
    pools = {Tier.HOST: BlockPool("host", 2, 64)}
    movers = Movers(HandlerTable(MemoryHandler(pools)))
    assert movers.memory is movers.handlers[M, M] and movers.nvme is None and movers.remote is None
    victim = Demotion(0, b"k" * 32, Tier.HOST, 0, Tier.NVME, -1)
    plan = StorePlan([b"k" * 32], [None], [0], nvme_demote=[victim])
    with pytest.raises(ConfigError, match="no memory->nvme handler"):
        movers.run_flush(plan)
    with pytest.raises(ConfigError, match="no remote->memory handler"):
        movers.remote_get([b"k" * 32], [])
    with pytest.raises(ConfigError, match="no memory->remote handler"):
        movers.publish([b"k" * 32], [])
    ran = []
    movers.after_release({0}, lambda: ran.append(1))  # no remote tier: nothing can hold a slot
    assert ran == [1]
