"""Paged block tables with reference-counted physical blocks and copy-on-write.

This is the engine-side view of the HBM pool (vLLM v0's ``BlockSpaceManager``
with its ``CopyOnWriteTracker``; PagedAttention, Kwon et al., SOSP 2023 §4.4):
a sequence's *block table* maps logical block ``i`` (tokens
``[i*B, (i+1)*B)``) to a physical slot of a :class:`~tierstore.tiers.memory.BlockPool`.
Forking a sequence (parallel sampling, beam search, agent branches) shares every
physical block by reference. Full blocks are immutable, so sharing them is free;
the *last, partial* block is the only one that is ever written, so when two
branches append after a shared partial block, the writer first gets a private
copy (copy-on-write).
"""
from __future__ import annotations

from .errors import InvariantError
from .tiers.memory import BlockPool


class PagedAllocator:
    """Reference-counted allocation of physical blocks from a :class:`BlockPool`.

    Parameters
    ----------
    pool : BlockPool
        The physical blocks (``(num_blocks, block_bytes)`` uint8).
    """

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self.ref_counts = [0] * pool.num_blocks
        self.cow_copies = 0

    def allocate(self) -> int | None:
        """A fresh block with refcount 1, or ``None`` when the pool is full."""
        b = self.pool.allocate()
        if b is not None:
            self.ref_counts[b] = 1
        return b

    def incref(self, b: int) -> None:
        if self.ref_counts[b] <= 0:
            raise InvariantError(f"incref of free block {b}")
        self.ref_counts[b] += 1

    def decref(self, b: int) -> None:
        """Drop one reference; the block returns to the pool at zero.

        Raises
        ------
        InvariantError
            If the block is already free (the count would go negative).
        """
        if self.ref_counts[b] <= 0:
            raise InvariantError(f"decref of free block {b}")
        self.ref_counts[b] -= 1
        if self.ref_counts[b] == 0:
            self.pool.free(b)

    def copy_on_write(self, b: int) -> int | None:
        """Return a block the caller may write: ``b`` itself if unshared, else a copy.

        Returns ``None`` when a copy is needed and the pool is full.
        """
        if self.ref_counts[b] == 1:
            return b
        nb = self.allocate()
        if nb is None:
            return None
        self.pool.view(nb).copy_(self.pool.view(b))
        self.decref(b)
        self.cow_copies += 1
        return nb


class BlockTable:
    """Logical -> physical block mapping of one sequence.

    Parameters
    ----------
    allocator : PagedAllocator
    tokens_per_block : int
    """

    def __init__(self, allocator: PagedAllocator, tokens_per_block: int) -> None:
        self.allocator = allocator
        self.tokens_per_block = tokens_per_block
        self.blocks: list[int] = []
        self.num_tokens = 0

    def append_tokens(self, n: int) -> bool:
        """Make room for ``n`` more tokens: copy-on-write of a shared partial last
        block, then new blocks as needed. Returns ``False`` (and changes nothing
        visible) when the pool cannot supply the blocks."""
        if n <= 0:
            return True
        B = self.tokens_per_block
        partial = self.num_tokens % B != 0
        need_new = -(-(self.num_tokens + n) // B) - len(self.blocks)
        cow = partial and self.allocator.ref_counts[self.blocks[-1]] > 1
        if self.allocator.pool.free_blocks < need_new + (1 if cow else 0):
            return False
        if cow:
            self.blocks[-1] = self.allocator.copy_on_write(self.blocks[-1])
        for _ in range(need_new):
            self.blocks.append(self.allocator.allocate())
        self.num_tokens += n
        return True

    def fork(self) -> "BlockTable":
        """A new table sharing every physical block (each gets one more reference)."""
        child = BlockTable(self.allocator, self.tokens_per_block)
        for b in self.blocks:
            self.allocator.incref(b)
        child.blocks = list(self.blocks)
        child.num_tokens = self.num_tokens
        return child

    def free(self) -> None:
        """Release every block reference; the table becomes empty."""
        for b in self.blocks:
            self.allocator.decref(b)
        self.blocks = []
        self.num_tokens = 0

    @property
    def full_blocks(self) -> int:
        """Blocks that are full (shareable under the exact-hit rule)."""
        return self.num_tokens // self.tokens_per_block
