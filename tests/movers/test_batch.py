"""The one NVMe batch builder: a store plan's victims first, then its new blocks in plan order,
each with its placement tag and namespace; flush and fill batches through the same builder."""

from __future__ import annotations

import torch

from tierstore.contract import Demotion, StorePlan, Tier
from tierstore.fdp.lifetime import LifetimeClass
from tierstore.io.pages import FragmentPlan
from tierstore.movers import MemoryHandler, NvmeBatch, add_new_blocks, demotion_batch, store_batch
from tierstore.tiers.memory import BlockPool

BB = 128
NS_PLAN, NS_VICTIM = b"p" * 32, b"v" * 32
PID = {None: 0, LifetimeClass.SHORT: 1, LifetimeClass.MEDIUM: 2, LifetimeClass.LONG: 3}


def key(i: int) -> bytes:
    return bytes([i]) * 32


def memory() -> MemoryHandler:
    return MemoryHandler({Tier.HBM: BlockPool("hbm", 2, BB), Tier.HOST: BlockPool("host", 4, BB)})


def test_store_batch_is_demotions_then_new_blocks():
    mem = memory()
    demote = [
        Demotion(7, key(70), Tier.HOST, 3, Tier.NVME, -1, LifetimeClass.LONG, NS_VICTIM),
        Demotion(8, key(80), Tier.HBM, 1, Tier.NVME, -1, None, b""),
    ]
    keys = [key(i) for i in range(4)]
    plan = StorePlan(
        keys,
        [None] * 4,
        [0, 1, 2, 3],
        nvme_new=[(2, LifetimeClass.SHORT), (0, None)],
        nvme_demote=demote,
        ns=NS_PLAN,
    )
    sources = [FragmentPlan.of_bytes(torch.full((BB,), i, dtype=torch.uint8)) for i in range(4)]
    b = store_batch(plan, sources, mem, PID.get)
    assert b.keys == [key(70), key(80), key(2), key(0)] and b.demotions == 2 and len(b) == 4
    assert b.placements == [3, 0, 1, 0]
    assert b.ns_digests == [NS_VICTIM, bytes(32), NS_PLAN, NS_PLAN]  # no namespace: 32 zero bytes
    # victims are read from their memory slots (no copy), new blocks from the engine's plans
    assert b.fragments[0][0].data_ptr() == mem.view(Tier.HOST, 3).data_ptr()
    assert b.fragments[1][0].data_ptr() == mem.view(Tier.HBM, 1).data_ptr()
    assert b.fragments[2] is sources[2] and b.fragments[3] is sources[0]


def test_without_a_placement_table_every_tag_is_none():
    plan = StorePlan(
        [key(1)],
        [None],
        [0],
        nvme_new=[(0, LifetimeClass.LONG)],
        nvme_demote=[Demotion(3, key(3), Tier.HOST, 0, Tier.NVME, -1, LifetimeClass.SHORT)],
    )
    b = store_batch(plan, [FragmentPlan.of_bytes(torch.zeros(BB, dtype=torch.uint8))], memory(), None)
    assert b.placements == [None, None] and b.ns_digests == [bytes(32), bytes(32)]


def test_flush_and_fill_batches():
    mem = memory()
    victim = Demotion(1, key(1), Tier.HOST, 2, Tier.NVME, -1, LifetimeClass.MEDIUM, NS_VICTIM)
    d = demotion_batch([victim], mem, PID.get)
    assert (d.keys, d.placements, d.ns_digests, d.demotions) == ([key(1)], [2], [NS_VICTIM], 1)
    buf = torch.zeros(BB, dtype=torch.uint8)
    f = add_new_blocks(
        NvmeBatch(), [key(5), key(6)], [[buf], [buf]], [None, LifetimeClass.LONG], b"", PID.get
    )
    assert (f.keys, f.placements, f.ns_digests, f.demotions) == ([key(5), key(6)], [0, 3], [bytes(32)] * 2, 0)
