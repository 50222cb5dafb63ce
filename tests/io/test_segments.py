import os

import numpy as np
import pytest
import torch

from tierstore.errors import ConfigError, LayoutError, Status
from tierstore.io import SegmentStorage
from tierstore.io import format as fmt
from tierstore.io.memory import MemoryEngine
from tierstore.tiers.storage import BlockStorage

EXT = 64 << 10
SEG = 256 << 10


def content(key: bytes, n: int) -> torch.Tensor:
    rng = np.random.default_rng(int.from_bytes(key[:8], "little"))
    return torch.from_numpy(rng.integers(0, 256, n, dtype=np.uint8))


def open_store(kind, tmp_path, block_bytes, capacity=2 << 20, **kw):
    eng = kw.pop("engine_obj", None)
    if kind == "memory":
        eng = eng or MemoryEngine(capacity)
        return SegmentStorage(
            None,
            capacity,
            block_bytes,
            segment_size_bytes=kw.pop("seg", SEG),
            engine=eng,
            extent_size_bytes=kw.pop("ext", EXT),
            **kw,
        )
    return SegmentStorage(
        str(tmp_path / "store.bin"),
        capacity,
        block_bytes,
        segment_size_bytes=kw.pop("seg", SEG),
        engine=kind,
        extent_size_bytes=kw.pop("ext", EXT),
        iodepth=4,
        max_io_bytes=16 << 10,
        **kw,
    )


def test_is_a_block_storage():
    assert issubclass(SegmentStorage, BlockStorage)


@pytest.mark.parametrize(
    "block_bytes", [1, 4095, 4096, 4097, EXT - 4096 - 1, EXT - 4096, EXT - 4096 + 1, EXT - 1, EXT, EXT + 1]
)
def test_round_trip_bit_exact_and_recovered(engine_kind, tmp_path, block_bytes):
    capacity = 8 * max(SEG, 2 * fmt.extent_bytes_for(1, block_bytes))
    seg = capacity // 8
    eng = MemoryEngine(capacity) if engine_kind == "memory" else None
    s = open_store(engine_kind, tmp_path, block_bytes, capacity, seg=seg, engine_obj=eng)
    keys = [os.urandom(32) for _ in range(7)]
    blocks = [content(k, block_bytes) for k in keys]
    assert s.put(keys, blocks, placements=[0, 1, 0, None, 1, 0, 0]) == [Status.OK] * 7
    dests = [torch.empty(block_bytes, dtype=torch.uint8) for _ in keys]
    assert s.get(keys, dests) == [Status.OK] * 7
    assert all(torch.equal(a, b) for a, b in zip(blocks, dests))
    s.close()
    s = open_store(engine_kind, tmp_path, block_bytes, capacity, seg=seg, engine_obj=eng)
    assert sorted(s.keys()) == sorted(keys)
    dests = [torch.empty(block_bytes, dtype=torch.uint8) for _ in keys]
    assert s.get(keys[::-1], dests[::-1]) == [Status.OK] * 7
    assert all(torch.equal(a, b) for a, b in zip(blocks, dests))
    # appends after recovery keep the chain readable after another restart
    more = [os.urandom(32) for _ in range(3)]
    assert s.put(more, [content(k, block_bytes) for k in more]) == [Status.OK] * 3
    s.close()
    s = open_store(engine_kind, tmp_path, block_bytes, capacity, seg=seg, engine_obj=eng)
    assert sorted(s.keys()) == sorted(keys + more)
    s.close()


def test_fragments_llama_like(engine_kind, tmp_path):
    """64 fragments of 1 KiB per block (scaled-down 32 layers x {K,V})."""
    frag, nfrag = 1024, 64
    s = open_store(engine_kind, tmp_path, frag * nfrag, capacity=4 << 20, seg=1 << 20, ext=256 << 10)
    keys = [os.urandom(32) for _ in range(10)]
    per_block = [[torch.randn(frag // 2, dtype=torch.bfloat16) for _ in range(nfrag)] for _ in keys]
    assert s.put_fragments(keys, per_block) == [Status.OK] * 10
    outs = [[torch.empty(frag // 2, dtype=torch.bfloat16) for _ in range(nfrag)] for _ in keys]
    assert s.get_fragments(keys, outs) == [Status.OK] * 10
    for a, b in zip(per_block, outs):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    st = s.stats()
    assert st["extents_written"] < 10  # batched: several blocks per extent
    s.close()


def test_exists_miss_delete_and_misuse(tmp_path):
    s = open_store("memory", tmp_path, 4096)
    k = os.urandom(32)
    assert s.put([k, k], [content(k, 4096)] * 2) == [Status.OK, Status.EXISTS]
    assert s.put([k], [content(k, 4096)]) == [Status.EXISTS]
    other = os.urandom(32)
    d = torch.empty(4096, dtype=torch.uint8)
    assert s.get([other], [d]) == [Status.MISS]
    assert s.contains(k)
    s.delete([k, other])
    assert not s.contains(k)
    assert s.get([k], [d]) == [Status.MISS]
    with pytest.raises(LayoutError):
        s.put([k], [torch.zeros(4095, dtype=torch.uint8)])
    with pytest.raises(LayoutError):
        s.put([b"short"], [torch.zeros(4096, dtype=torch.uint8)])
    with pytest.raises(ConfigError):
        SegmentStorage(None, 1 << 20, 4096, segment_size_bytes=1 << 20, engine="memory")


def test_free_blocks_is_honest_and_gc_reclaims(tmp_path):
    bb = 16 << 10
    s = open_store("memory", tmp_path, bb, capacity=2 << 20)
    assert s.free_blocks() == s.capacity_blocks() > 0
    stored = []
    # worst case: one block per put; free_blocks() of them must all succeed
    while s.free_blocks() > 0:
        k = os.urandom(32)
        assert s.put([k], [content(k, bb)]) == [Status.OK]
        stored.append(k)
    assert len(stored) >= s.capacity_blocks()
    k = os.urandom(32)
    assert s.put([k] * 1, [content(k, bb)]) in ([Status.NO_SPACE], [Status.OK])
    # delete every other block: space only comes back by compaction
    dead = stored[::2]
    s.delete(dead)
    live = [k for k in stored if k not in set(dead)]
    new = [os.urandom(32) for _ in range(10)]
    assert s.put(new, [content(k, bb) for k in new]) == [Status.OK] * 10
    st = s.stats()
    assert st["gc_bytes_written"] > 0 and st["host_write_amplification"] > 1.0
    for k in live + new:
        d = torch.empty(bb, dtype=torch.uint8)
        assert s.get([k], [d]) == [Status.OK] and torch.equal(d, content(k, bb))


def test_whole_segment_reclaim_punches(tmp_path):
    bb = 32 << 10
    s = open_store("posix", tmp_path, bb, capacity=2 << 20)
    keys = [os.urandom(32) for _ in range(40)]
    assert s.put(keys, [content(k, bb) for k in keys]) == [Status.OK] * 40
    before = os.stat(tmp_path / "store.bin").st_blocks
    s.delete(keys)
    st = s.stats()
    assert st["segments_reclaimed"] >= 1 and st["engine"]["bytes_trimmed"] > 0
    assert os.stat(tmp_path / "store.bin").st_blocks < before
    s.close()


def test_read_eio_is_per_block(tmp_path):
    eng = MemoryEngine(2 << 20)
    s = open_store("memory", tmp_path, 8192, engine_obj=eng)
    keys = [os.urandom(32) for _ in range(6)]
    blocks = [content(k, 8192) for k in keys]
    assert s.put(keys, blocks) == [Status.OK] * 6
    eng.read_errors.append((s.locate(keys[2])[1], 4096))
    dests = [torch.zeros(8192, dtype=torch.uint8) for _ in keys]
    st = s.get(keys, dests)
    assert st == [Status.OK, Status.OK, Status.IO_ERROR, Status.OK, Status.OK, Status.OK]
    for i in (0, 1, 3, 4, 5):
        assert torch.equal(dests[i], blocks[i])
    assert s.get([keys[2]], [dests[2]]) == [Status.MISS]
    assert s.stats()["get_io_errors"] == 1


def test_enospc_injected_rejects_and_keeps_entries(tmp_path):
    eng = MemoryEngine(2 << 20)
    s = open_store("memory", tmp_path, 8192, engine_obj=eng)
    old = [os.urandom(32) for _ in range(4)]
    assert s.put(old, [content(k, 8192) for k in old]) == [Status.OK] * 4
    eng.write_limit_bytes = 0
    new = [os.urandom(32) for _ in range(5)]
    assert s.put(new, [content(k, 8192) for k in new]) == [Status.NO_SPACE] * 5
    eng.write_limit_bytes = None
    assert not any(s.contains(k) for k in new)
    for k in old:
        d = torch.empty(8192, dtype=torch.uint8)
        assert s.get([k], [d]) == [Status.OK] and torch.equal(d, content(k, 8192))
    assert s.put(new, [content(k, 8192) for k in new]) == [Status.OK] * 5
    s.close()
    s2 = open_store("memory", tmp_path, 8192, engine_obj=eng)
    assert sorted(s2.keys()) == sorted(old + new)


def test_observer_sees_the_exact_lba_stream(tmp_path):
    class Rec:
        def __init__(self):
            self.w, self.t = [], []

        def on_write(self, off, n, placement):
            self.w.append((off, n, placement))

        def on_trim(self, off, n):
            self.t.append((off, n))

    eng = MemoryEngine(2 << 20)
    rec = Rec()
    eng.add_observer(rec)
    s = open_store("memory", tmp_path, 16 << 10, engine_obj=eng)
    keys = [os.urandom(32) for _ in range(30)]
    assert (
        s.put(keys, [content(k, 16 << 10) for k in keys], placements=[7] * 15 + [9] * 15) == [Status.OK] * 30
    )
    st = eng.stats()
    assert sum(n for _, n, _ in rec.w) == st["bytes_written"]
    assert {p for _, _, p in rec.w} == {7, 9}
    assert st["bytes_by_placement"][7] == sum(n for _, n, p in rec.w if p == 7)
    # one open segment per placement stream: streams never share a segment
    seg_of = {}
    for off, n, p in rec.w:
        assert off // SEG == (off + n - 1) // SEG
        seg_of.setdefault(off // SEG, set()).add(p)
    assert all(len(v) == 1 for v in seg_of.values())
    s.delete(keys)
    assert rec.t and all(n == SEG and off % SEG == 0 for off, n in rec.t)


def test_entries_keep_namespace_and_order_across_restart(tmp_path):
    eng = MemoryEngine(2 << 20)
    s = open_store("memory", tmp_path, 4096, engine_obj=eng)
    k1, k2 = os.urandom(32), os.urandom(32)
    ns = bytes(range(32))
    assert s.put([k1], [content(k1, 4096)], ns_digests=[ns]) == [Status.OK]
    assert s.put([k2], [content(k2, 4096)]) == [Status.OK]
    seq_next = s.write_seq()
    s.close()
    s = open_store("memory", tmp_path, 4096, engine_obj=eng)
    e = s.entries()
    assert e[k1][0] == ns and e[k2][0] == bytes(32)
    assert e[k1][1] < e[k2][1] < s.write_seq() == seq_next


def test_reopen_with_another_block_size_is_refused_and_loses_nothing(tmp_path):
    path = str(tmp_path / "s.bin")
    keys = [os.urandom(32) for _ in range(5)]
    s = SegmentStorage(path, 8 << 20, 8192, segment_size_bytes=1 << 20, engine="posix")
    assert s.put(keys, [content(k, 8192) for k in keys]) == [Status.OK] * 5
    s.close()
    for bb in (8192 - 4096, 8192 + 4096):  # a smaller and a larger layout
        with pytest.raises(ConfigError, match="8192"):
            SegmentStorage(path, 8 << 20, bb, segment_size_bytes=1 << 20, engine="posix")
    s = SegmentStorage(path, 8 << 20, 8192, segment_size_bytes=1 << 20, engine="posix")  # lock released
    try:
        assert sorted(s.keys()) == sorted(keys)
        for k in keys:
            d = torch.empty(8192, dtype=torch.uint8)
            assert s.get([k], [d]) == [Status.OK] and torch.equal(d, content(k, 8192))
    finally:
        s.close()


def test_recovery_reads_headers_larger_than_its_own_extents(tmp_path):
    """A store written with large extents (a header over 1 MiB) is recovered,
    or refused, by one opened with small extents: never silently emptied."""
    path = str(tmp_path / "big.bin")
    n = 12000
    keys = [i.to_bytes(32, "little") for i in range(n)]
    s = SegmentStorage(
        path, 128 << 20, 4096, segment_size_bytes=64 << 20, engine="posix", extent_size_bytes=48 << 20
    )
    data = torch.arange(4096, dtype=torch.int32).to(torch.uint8)
    assert s.put(keys, [data] * n) == [Status.OK] * n
    s.close()
    with pytest.raises(ConfigError, match="4096"):
        SegmentStorage(
            path, 128 << 20, 8192, segment_size_bytes=64 << 20, engine="posix", extent_size_bytes=1 << 20
        )
    s = SegmentStorage(
        path, 128 << 20, 4096, segment_size_bytes=64 << 20, engine="posix", extent_size_bytes=1 << 20
    )
    try:
        assert s.stats()["recovered_blocks"] == n
        d = torch.empty(4096, dtype=torch.uint8)
        assert s.get([keys[-1]], [d]) == [Status.OK] and torch.equal(d, data)
    finally:
        s.close()


def test_a_failing_fill_leaves_no_hole_and_later_puts_survive_restart(tmp_path):
    """An exception while gathering (after the space was planned) must give the
    space back: a hole in a segment's chain would hide later acknowledged puts."""
    from tierstore.io.pages import FragmentPlan

    path = str(tmp_path / "h.bin")
    s = SegmentStorage(path, 8 << 20, 8192, segment_size_bytes=1 << 20, engine="posix")
    k = [bytes([i]) * 32 for i in range(1, 6)]
    assert s.put(k[:1], [content(k[0], 8192)]) == [Status.OK]

    class Boom(FragmentPlan):
        def gather(self, staging, offset):
            raise RuntimeError("gather failed")

    bad = Boom([torch.zeros(8192, dtype=torch.uint8)], 8192, None)
    with pytest.raises(RuntimeError, match="gather failed"):
        s.put_fragments(k[1:3], [[content(k[1], 8192)], bad])
    assert not s.contains(k[1]) and not s.contains(k[2])
    assert s.put(k[3:5], [content(x, 8192) for x in k[3:5]]) == [Status.OK] * 2
    s.close()
    s = SegmentStorage(path, 8 << 20, 8192, segment_size_bytes=1 << 20, engine="posix")
    try:
        for x in (k[0], k[3], k[4]):
            d = torch.empty(8192, dtype=torch.uint8)
            assert s.get([x], [d]) == [Status.OK] and torch.equal(d, content(x, 8192))
    finally:
        s.close()


@pytest.mark.parametrize("stuck_in", ["write", "preallocate"])
def test_reads_never_queue_behind_a_writer(stuck_in):
    """A put stuck in its I/O (a slow write, or fallocate of a new segment)
    holds no lock a reader needs: gets of stored blocks return meanwhile."""
    import threading

    class Stuck(MemoryEngine):
        def __init__(self, n):
            super().__init__(n)
            self.started, self.release, self.armed = threading.Event(), threading.Event(), False

        def _wait(self, what):
            if self.armed and what == stuck_in:
                self.started.set()
                assert self.release.wait(30)

        def _write_impl(self, offset, view, nbytes, placement):
            self._wait("write")
            return super()._write_impl(offset, view, nbytes, placement)

        def _preallocate_impl(self, offset, length):
            self._wait("preallocate")
            return super()._preallocate_impl(offset, length)

    bb = 8192
    eng = Stuck(4 << 20)
    g = SegmentStorage(None, 4 << 20, bb, segment_size_bytes=SEG, engine=eng, extent_size_bytes=EXT)
    try:
        old = [bytes([i]) * 32 for i in range(1, 4)]
        assert g.put(old, [content(k, bb) for k in old]) == [Status.OK] * 3
        # fill the open segment so that the next put opens (preallocates) a new one
        per_seg = SEG // fmt.extent_bytes_for(1, bb)
        filler = [bytes([200, i]) + bytes(30) for i in range(per_seg * 2)]
        g.put(filler, [content(k, bb) for k in filler])
        eng.armed = True
        new = [bytes([9, i]) + bytes(30) for i in range(per_seg)]
        t = threading.Thread(target=lambda: g.put(new, [content(k, bb) for k in new]))
        t.start()
        assert eng.started.wait(10), f"the put never reached its {stuck_in}"
        out = torch.zeros(bb, dtype=torch.uint8)
        done = threading.Event()
        res = []
        r = threading.Thread(target=lambda: (res.append(g.get([old[1]], [out])), done.set()))
        r.start()
        assert done.wait(5), f"a get queued behind a put stuck in its {stuck_in}"
        assert res[0] == [Status.OK] and torch.equal(out, content(old[1], bb))
        assert t.is_alive()
        eng.release.set()
        t.join(30)
        assert g.get([new[0]], [out]) == [Status.OK]
    finally:
        eng.release.set()
        g.close()
