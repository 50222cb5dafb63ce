"""tierstore.contract: the types the deciding and the moving side share."""

import pickle

from tierstore.contract import (
    MEMORY_TIERS,
    Demotion,
    LoadPlan,
    LookupResult,
    Medium,
    PromotePlan,
    Status,
    StorePlan,
    Tier,
)
from tierstore.fdp.lifetime import LifetimeClass


def test_every_tier_has_one_medium_and_the_memory_tiers_are_the_memory_medium():
    assert {t: t.medium for t in Tier} == {
        Tier.HBM: Medium.MEMORY,
        Tier.HOST: Medium.MEMORY,
        Tier.NVME: Medium.NVME,
        Tier.REMOTE: Medium.REMOTE,
    }
    assert MEMORY_TIERS == tuple(t for t in Tier if t.medium is Medium.MEMORY)
    assert [t.label for t in Tier] == ["hbm", "host", "nvme", "remote"]


def test_plans_are_plain_data_that_survive_pickling():
    """What a transfer handler in another process would receive (issue 24): no lock, no callable."""
    demote = Demotion(
        row=3,
        key=b"k" * 32,
        src=Tier.HOST,
        src_slot=5,
        dst=Tier.NVME,
        dst_slot=-1,
        lifetime=LifetimeClass.SHORT,
        ns=b"n" * 32,
    )
    store = StorePlan(
        keys=[b"a" * 32, b"b" * 32],
        statuses=[None, Status.EXISTS],
        rows=[7, -1],
        memory=[(0, Tier.HBM, 2)],
        nvme_demote=[demote],
        frees=[(3, Tier.HOST, 5)],
        ns=b"n" * 32,
        given={(Tier.HOST, 5)},
    )
    store.moved, store.demote_statuses = StorePlan.NVME_DONE, {0: Status.OK}
    load = LoadPlan(keys=[b"a" * 32], rows=[7], sources=[(Tier.NVME, -1)], leads=[0])
    promote = PromotePlan(
        items=[(0, 7, Tier.HBM, 1)], victims=store, keys=[b"a" * 32], sources=[(Tier.NVME, -1)]
    )
    lookup = LookupResult([b"a" * 32], [Tier.HOST], [2e-5], 1, 2, 16, ("req", 1), None)
    for obj in (demote, store, load, promote, lookup):
        back = pickle.loads(pickle.dumps(obj))
        assert vars(back).keys() == vars(obj).keys()
        for name, value in vars(obj).items():
            if not isinstance(value, StorePlan):
                assert getattr(back, name) == value, name
    assert pickle.loads(pickle.dumps(store)).pending == [0]
    assert lookup.useful_keys == [b"a" * 32] and lookup.matched_tokens == 16
