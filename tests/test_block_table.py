import torch

from tierstore.block_table import BlockTable, PagedAllocator
from tierstore.tiers.memory import BlockPool

B = 4


def make(n=8):
    pool = BlockPool("hbm", n, 16)
    return pool, PagedAllocator(pool)


def test_fork_shares_and_cow_on_partial_tail():
    pool, alloc = make()
    a = BlockTable(alloc, B)
    assert a.append_tokens(6)  # 1 full + 1 partial block
    pool.view(a.blocks[1]).fill_(7)
    b = a.fork()
    assert a.blocks == b.blocks and alloc.ref_counts[a.blocks[1]] == 2
    shared_tail = a.blocks[1]
    assert b.append_tokens(1)  # b writes into the shared partial block -> copy
    assert b.blocks[0] == a.blocks[0]  # full block still shared
    assert b.blocks[1] != shared_tail and a.blocks[1] == shared_tail
    assert torch.equal(pool.view(b.blocks[1]), pool.view(shared_tail))  # contents copied
    assert alloc.ref_counts[shared_tail] == 1 and alloc.cow_copies == 1
    assert a.append_tokens(1)  # a is now the sole owner: no copy
    assert a.blocks[1] == shared_tail and alloc.cow_copies == 1


def test_no_cow_at_block_boundary():
    pool, alloc = make()
    a = BlockTable(alloc, B)
    a.append_tokens(8)
    b = a.fork()
    b.append_tokens(1)  # new block; full blocks are never copied
    assert alloc.cow_copies == 0 and b.blocks[:2] == a.blocks


def test_out_of_blocks_changes_nothing_and_free_returns_all():
    pool, alloc = make(3)
    a = BlockTable(alloc, B)
    assert a.append_tokens(10)
    b = a.fork()
    assert not b.append_tokens(5)  # needs a CoW copy + 1 block, only 0 free
    assert b.num_tokens == 10 and b.blocks == a.blocks
    a.free()
    b.free()
    assert pool.free_blocks == 3 and all(c == 0 for c in alloc.ref_counts)
