"""tierstore/io/inputs.py: the one copy of the input checks KVStore and the daemon client share
(duplicate D3 of issue 23: the client's own ``_plan`` is gone)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tierstore.client
from tierstore import KVLayout
from tierstore.errors import LayoutError
from tierstore.io.inputs import check_keys, destination_bytes, plan_block, plan_sources
from tierstore.io.pages import BlockRows, FragmentPlan

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, tokens_per_block=4)
BB = LAYOUT.bytes_per_block


def test_the_client_plans_fragments_with_the_stores_check():
    assert tierstore.client.plan_block is plan_block
    assert not hasattr(tierstore.client.RemoteKVStore, "_plan")


def test_a_whole_block_plan_is_accepted_and_a_wrong_size_refused():
    raw = torch.arange(BB, dtype=torch.int64).to(torch.uint8)
    plan = plan_block(FragmentPlan.of_bytes(raw), LAYOUT, destination=False)  # count == 1: one flat block
    assert plan.nbytes == BB
    with pytest.raises(LayoutError, match=f"planned block of 1 fragments.*{BB} bytes"):
        plan_block(FragmentPlan.of_bytes(raw[:-2]), LAYOUT, destination=False)


def test_fragments_are_counted_and_numpy_is_refused_by_name():
    frags = [torch.zeros(LAYOUT.fragment_bytes, dtype=torch.uint8) for _ in range(LAYOUT.num_fragments)]
    assert plan_block(frags, LAYOUT, destination=False).nbytes == BB
    with pytest.raises(LayoutError, match=f"expected {LAYOUT.num_fragments} fragments, got 1"):
        plan_block(frags[:1], LAYOUT, destination=False)
    with pytest.raises(LayoutError, match="numpy arrays are not accepted"):
        plan_block(
            [np.zeros(LAYOUT.fragment_bytes, np.uint8)] * LAYOUT.num_fragments, LAYOUT, destination=False
        )
    with pytest.raises(LayoutError, match="must be a list of tensors"):
        plan_block(torch.zeros(BB, dtype=torch.uint8), LAYOUT, destination=False)


def test_sources_destinations_and_keys():
    blocks = torch.zeros((3, *LAYOUT.block_shape), dtype=LAYOUT.dtype)
    assert isinstance(plan_sources(blocks, LAYOUT), BlockRows)  # one batch, checked once
    assert plan_sources(blocks[:0], LAYOUT) == []
    assert len(plan_sources(list(blocks), LAYOUT)) == 3
    with pytest.raises(LayoutError, match=f"block of {BB - 1} bytes"):
        plan_sources([torch.zeros(BB - 1, dtype=torch.uint8)], LAYOUT)
    d = torch.zeros(LAYOUT.block_shape, dtype=LAYOUT.dtype)
    assert destination_bytes(d, LAYOUT).numel() == BB
    with pytest.raises(LayoutError, match="must be contiguous"):
        destination_bytes(torch.zeros((2, BB), dtype=torch.uint8)[:, 0], LAYOUT)
    assert check_keys([bytearray(32)]) == [bytes(32)]
    with pytest.raises(LayoutError, match="32-byte"):
        check_keys([b"x" * 31])
