"""Shared fixtures: a tiny layout, a fake clock, stores with all three tiers."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tierstore import KVStore, Namespace, get_layout


@dataclasses.dataclass
class FakeEntry:
    """An entry as a policy sees it (:class:`tierstore.policies.base.EntryInfo`), with plain fields."""

    key: bytes
    size_bytes: int = 4096
    hits: int = 0
    last_access_s: float = 0.0
    created_s: float = 0.0
    position: int = 0
    lifetime: object = None
    ref_count: int = 0
    ns: bytes = bytes(32)
    nvme_written_s: float = 0.0


class FakeClock:
    """Manually advanced clock (seconds)."""

    def __init__(self) -> None:
        self.now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s

    def advance(self, s: float) -> None:
        self.now_s += s


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def layout():
    return get_layout("tiny")


@pytest.fixture
def ns():
    return Namespace(model="tiny-llama@rev1", tokenizer="tok@1")


def make_blocks(layout, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, *layout.block_shape), generator=g, dtype=torch.float32).to(layout.dtype)


def tokens(n: int, start: int = 0) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int64)


@pytest.fixture
def make_store(tmp_path, layout, clock):
    stores = []

    def _make(hbm=4, host=4, nvme=16, **kw):
        """A store with ``hbm``/``host`` memory slots and an NVMe tier of at
        least ``nvme`` blocks (a segment store in memory, one block per segment)."""
        from tierstore.io import format as fmt
        from tierstore.io.segments import SegmentStorage

        bb = layout.bytes_per_block
        nv = None
        if nvme:
            seg = fmt.extent_bytes_for(1, bb)
            nv = SegmentStorage(
                None,
                (nvme + 1) * seg,
                bb,
                segment_size_bytes=seg,
                engine="memory",
                extent_size_bytes=seg,
                owns_engine=True,
            )
        s = KVStore(layout, hbm_bytes=hbm * bb, host_bytes=host * bb, nvme=nv, clock=clock, **kw)
        stores.append(s)
        return s

    yield _make
    for s in stores:
        s.close()


class SlowEngine:
    """Factory of a memory engine whose reads and/or writes wait on events:
    a deliberately slowed NVMe for concurrency and deadline tests."""

    @staticmethod
    def make(size_bytes: int, slow_reads: bool = False, slow_writes: bool = False, delay_s: float = 0.0):
        import threading
        import time as _time

        from tierstore.io.memory import MemoryEngine

        class _Slow(MemoryEngine):
            def __init__(self):
                super().__init__(size_bytes)
                self.read_started = threading.Event()
                self.write_started = threading.Event()
                self.release = threading.Event()
                self.slow_reads, self.slow_writes, self.delay_s = slow_reads, slow_writes, delay_s

            def _read_impl(self, offset, view, nbytes):
                if self.slow_reads:
                    self.read_started.set()
                    if self.delay_s:
                        _time.sleep(self.delay_s)
                    else:
                        assert self.release.wait(30)
                return super()._read_impl(offset, view, nbytes)

            def _write_impl(self, offset, view, nbytes, placement):
                if self.slow_writes:
                    self.write_started.set()
                    if self.delay_s:
                        _time.sleep(self.delay_s)
                    else:
                        assert self.release.wait(30)
                return super()._write_impl(offset, view, nbytes, placement)

        return _Slow()


def memory_segment_store(layout, blocks: int, engine=None):
    """A segment store in memory holding at least ``blocks`` blocks (one per segment)."""
    from tierstore.io import format as fmt
    from tierstore.io.segments import SegmentStorage

    bb = layout.bytes_per_block
    seg = fmt.extent_bytes_for(1, bb)
    size = (blocks + 1) * seg
    return SegmentStorage(
        None,
        size,
        bb,
        segment_size_bytes=seg,
        engine=engine or "memory",
        extent_size_bytes=seg,
        owns_engine=True,
    )


def pytest_sessionstart(session):
    """Remove loop mounts and images that killed test processes left behind (tests/io/loopfs.py)."""
    from tests.io.loopfs import sweep_stale

    for what in sweep_stale():
        print(f"tierstore tests: removed stale {what}")


def pytest_collection_modifyitems(config, items):
    """Where this process cannot use io_uring (or TIERSTORE_IO_URING=0), tests that need it
    (marked ``uring``, or parametrized with the ``"uring"`` engine) skip and say why."""
    from tierstore.io.ring import uring_available

    ok, why = uring_available()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"io_uring unavailable: {why}")
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if item.get_closest_marker("uring") or any(
            v == "uring" for v in params.values() if isinstance(v, str)
        ):
            item.add_marker(skip)
