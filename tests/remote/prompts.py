"""The layout, namespace and random prompts the remote suite's store tests share."""

from __future__ import annotations

import numpy as np
import torch

from tierstore import KVLayout, Namespace

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float16, tokens_per_block=16)
BB = LAYOUT.bytes_per_block
NS = Namespace(model="m@1", tenant="acme")


def prompt(seed: int, nblocks: int) -> tuple[np.ndarray, torch.Tensor]:
    """Random tokens of ``nblocks`` blocks and random KV for them (``(nblocks, *block_shape)`` fp16)."""
    tokens = np.random.default_rng(seed).integers(0, 30000, nblocks * LAYOUT.tokens_per_block)
    kv = torch.from_numpy(
        np.random.default_rng(seed + 1).standard_normal((nblocks, *LAYOUT.block_shape)).astype(np.float16)
    )
    return tokens, kv
