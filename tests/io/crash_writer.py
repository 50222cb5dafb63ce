"""Subprocess writer for the kill -9 test: puts deterministic blocks and prints
``A <hex>`` after each acknowledged put and ``D <hex>`` before each delete."""
import hashlib
import sys

import numpy as np
import torch

from tierstore.errors import Status
from tierstore.io import SegmentStorage

BB = 12288 + 100
SEG = 256 << 10
CAP = 8 * SEG


def content(key: bytes, n: int) -> torch.Tensor:
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))


def open_store(path, engine):
    return SegmentStorage(path, CAP, BB, segment_size_bytes=SEG, engine=engine,
                          extent_size_bytes=64 << 10, iodepth=4, max_io_bytes=16 << 10)


def main() -> None:
    path, engine, run = sys.argv[1], sys.argv[2], int(sys.argv[3])
    s = open_store(path, engine)
    rng = np.random.default_rng(run)
    live = list(s.keys())
    out = sys.stdout
    out.write("READY\n")
    out.flush()
    i = 0
    while True:
        n = int(rng.integers(1, 9))
        keys = [hashlib.sha256(f"{run}-{i + j}".encode()).digest() for j in range(n)]
        i += n
        st = s.put(keys, [content(k, BB) for k in keys], placements=[int(rng.integers(0, 2))] * n)
        for k, x in zip(keys, st):
            if x is Status.OK:
                out.write(f"A {k.hex()}\n")
                live.append(k)
        out.flush()
        if Status.NO_SPACE in st or rng.random() < 0.1:
            victims = live[: max(1, len(live) // 3)]
            live = live[len(victims):]
            for k in victims:
                out.write(f"D {k.hex()}\n")
            out.flush()
            s.delete(victims)


if __name__ == "__main__":
    main()
