"""Subprocess writer for the kill -9 test: puts deterministic blocks and prints
``A <hex>`` after each acknowledged put and ``D <hex>`` before each delete.

Mode ``block`` / ``block-notrim`` (``eviction_granularity: block``; ``notrim``: the engine
ignores deallocation, as QEMU's ``discard=ignore``): an LRU listener prints ``E <hex>`` when
it names a victim, ``G <hex>`` for a block host GC dropped, and ``T <hex>`` once the put (or
delete) that evicted it returned, i.e. its tombstone is durable (and its slot may be trimmed)."""

import collections
import hashlib
import itertools
import sys

import numpy as np
import torch

from tierstore.errors import Status
from tierstore.io import SegmentStorage
from tierstore.io import format as fmt
from tierstore.io.engine import IOFuture

BB = 12288 + 100
SEG = 256 << 10
CAP = 8 * SEG


def content(key: bytes, n: int) -> torch.Tensor:
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))


def open_store(path, engine, mode="region", listener=None):
    kw = {}
    if mode.startswith("block"):
        kw = dict(eviction_granularity="block", trim_min_bytes=fmt.block_slot_bytes(BB), listener=listener)
    s = SegmentStorage(
        path,
        CAP,
        BB,
        segment_size_bytes=SEG,
        engine=engine,
        extent_size_bytes=64 << 10,
        iodepth=4,
        max_io_bytes=16 << 10,
        **kw,
    )
    if mode == "block-notrim":
        s.engine._trim_impl = lambda off, n: IOFuture.completed(n)
    return s


class Lru:
    """The index's NVMe LRU in miniature, saying what it evicts on ``out``."""

    def __init__(self, out):
        self.out = out
        self.order: collections.OrderedDict = collections.OrderedDict()
        self.evicted: list = []

    def pick_victims(self, n):
        ks = list(itertools.islice(self.order, n))
        for k in ks:
            del self.order[k]
            self.out.write(f"E {k.hex()}\n")
        self.out.flush()
        self.evicted += ks
        return ks

    def on_reclaim(self, keys):
        return [False] * len(keys)

    def on_dropped(self, keys):
        for k in keys:
            self.order.pop(k, None)
            self.out.write(f"G {k.hex()}\n")
        self.out.flush()

    def durable(self):
        for k in self.evicted:
            self.out.write(f"T {k.hex()}\n")
        self.out.flush()
        self.evicted = []


def main() -> None:
    path, engine, run = sys.argv[1], sys.argv[2], int(sys.argv[3])
    mode = sys.argv[4] if len(sys.argv) > 4 else "region"
    out = sys.stdout
    lru = Lru(out) if mode.startswith("block") else None
    s = open_store(path, engine, mode, lru)
    rng = np.random.default_rng(run)
    live = list(s.keys())
    if lru is not None:  # a restarted LRU starts as FIFO: oldest write first
        found = s.scan()
        live = [found.keys[i] for i in np.argsort(found.write_seqs, kind="stable")]
        lru.order.update((k, None) for k in live)
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
                if lru is not None:
                    lru.order[k] = None
        out.flush()
        if lru is not None:
            lru.durable()
            live = [k for k in live if k in lru.order]
        if Status.NO_SPACE in st or rng.random() < 0.1:
            victims = live[: max(1, len(live) // 3)]
            live = live[len(victims) :]
            for k in victims:
                out.write(f"D {k.hex()}\n")
            out.flush()
            s.delete(victims)
            if lru is not None:
                for k in victims:
                    lru.order.pop(k, None)
                    out.write(f"T {k.hex()}\n")
                out.flush()


if __name__ == "__main__":
    main()
