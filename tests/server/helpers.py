"""Deterministic block contents for byte-exact checks."""

from __future__ import annotations

import hashlib

import numpy as np
import torch


def block_for(key: bytes, block_bytes: int) -> torch.Tensor:
    """The bytes a test stores under ``key`` (a function of the key only)."""
    seed = int.from_bytes(hashlib.sha256(b"test-block" + key).digest()[:8], "little")
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.integers(0, 256, block_bytes, dtype=np.uint8))
