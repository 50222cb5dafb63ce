"""Fixed-size block pools in memory: the HBM tier (L1) and the host tier (L2).

A pool is one ``uint8`` tensor of shape ``(num_blocks, block_bytes)`` plus a free
list of slot indices (SGLang's "allocator + device pool", vLLM's
``BlockPool``). The HBM pool lives on ``cuda`` when CUDA is present, otherwise on
the CPU as a stand-in that runs the same code. The host pool is allocated with
``pin_memory=True`` when CUDA is present (so host<->device copies are DMA), and
plain otherwise (``pin_memory=True`` raises without a CUDA driver).

Slots are handed out lowest-first, so tests see deterministic slot ids.
"""
from __future__ import annotations

import heapq

import torch

from ..errors import ConfigError, InvariantError, LayoutError


def cuda_available() -> bool:
    """True when torch sees a usable CUDA device."""
    try:
        return torch.cuda.is_available()
    except RuntimeError:
        return False


class BlockPool:
    """A pool of ``num_blocks`` slots of ``block_bytes`` bytes each.

    Parameters
    ----------
    name : str
        Tier name (``"hbm"`` or ``"host"``), used in messages and metrics.
    num_blocks : int
        Slots in the pool (>= 0).
    block_bytes : int
        Bytes per slot.
    device : str or torch.device
        Where the pool tensor lives.
    pin_memory : bool
        Page-lock a CPU pool (only valid when CUDA is present).

    Attributes
    ----------
    data : torch.Tensor
        Shape ``(num_blocks, block_bytes)``, dtype ``uint8``.
    """

    def __init__(self, name: str, num_blocks: int, block_bytes: int,
                 device: str | torch.device = "cpu", pin_memory: bool = False) -> None:
        if num_blocks < 0 or block_bytes <= 0:
            raise LayoutError(f"{name}: num_blocks={num_blocks}, block_bytes={block_bytes} are invalid")
        self.name = name
        self.block_bytes = block_bytes
        self.num_blocks = num_blocks
        self.device = torch.device(device)
        try:
            self.data = torch.empty((num_blocks, block_bytes), dtype=torch.uint8, device=self.device,
                                    pin_memory=pin_memory and self.device.type == "cpu")
        except (RuntimeError, AssertionError) as exc:  # no CUDA driver, or out of memory
            what = "pinned host" if pin_memory and self.device.type == "cpu" else str(self.device)
            raise ConfigError(f"{name}: cannot allocate {num_blocks} x {block_bytes} bytes of {what} "
                              f"memory: {str(exc).splitlines()[0]}") from exc
        self._free = list(range(num_blocks))  # a min-heap: lowest slot first
        self._used = bytearray(num_blocks)

    @property
    def free_blocks(self) -> int:
        """Slots free now."""
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        """Slots in use now."""
        return self.num_blocks - len(self._free)

    def allocate(self) -> int | None:
        """Take the lowest free slot, or ``None`` when the pool is full."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._used[slot] = 1
        return slot

    def free(self, slot: int) -> None:
        """Return a slot to the free list.

        Raises
        ------
        InvariantError
            On a double free or an out-of-range slot.
        """
        if not 0 <= slot < self.num_blocks or not self._used[slot]:
            raise InvariantError(f"{self.name}: free of slot {slot} that is not allocated")
        self._used[slot] = 0
        heapq.heappush(self._free, slot)

    def view(self, slot: int) -> torch.Tensor:
        """The slot's bytes: a 1-D ``uint8`` view of ``block_bytes``."""
        return self.data[slot]
