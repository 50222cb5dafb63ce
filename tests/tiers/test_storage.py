"""The storage interfaces (tierstore.tiers.storage): one contract for every BlockStorage, the
minimal backend that implements only the abstract methods passes it on the defaults, a store runs
on that backend (the core calls the interface, it never probes), and the real backends are
instances of their interfaces."""

from __future__ import annotations

import contextlib
import socket

import numpy as np
import pytest
import torch

from tierstore import KVStore, leading_ok
from tierstore.errors import LayoutError, Status
from tierstore.io.pages import plan_fragments
from tierstore.io.segments import SegmentStorage
from tierstore.tiers.storage import BlockStorage, RegionListener, RemoteBlockTier, StoredBlocks

from ..conftest import make_blocks, memory_segment_store, tokens

BB = 4096
NS_A, NS_B = b"a" * 32, b"b" * 32


class MemStorage(BlockStorage):
    """A backend written against the interface: only the abstract methods, a dict of blocks."""

    def __init__(self, block_bytes: int, capacity: int) -> None:
        self.block_bytes = block_bytes
        self._capacity = capacity
        self._blocks: dict[bytes, tuple[torch.Tensor, bytes]] = {}

    def capacity_blocks(self) -> int:
        return self._capacity

    def put_fragments(self, keys, fragments_per_block, placements=None, ns_digests=None):
        out = []
        for i, (k, frags) in enumerate(zip(keys, fragments_per_block)):
            k = bytes(k)
            if k in self._blocks:
                out.append(Status.EXISTS)
                continue
            if len(self._blocks) >= self._capacity:
                out.append(Status.NO_SPACE)
                continue
            plan = plan_fragments(frags)
            if plan.nbytes != self.block_bytes:
                raise LayoutError(f"a block of {plan.nbytes} bytes; blocks are {self.block_bytes}")
            buf = torch.empty(self.block_bytes, dtype=torch.uint8)
            plan.gather(buf, 0)
            self._blocks[k] = (buf, bytes(ns_digests[i]) if ns_digests is not None else bytes(32))
            out.append(Status.OK)
        return out

    def get_fragments(self, keys, dest_fragments_per_block, gate=None):
        out = []
        for i, (k, frags) in enumerate(zip(keys, dest_fragments_per_block)):
            got = self._blocks.get(bytes(k))
            if got is None:
                out.append(Status.MISS)
                continue
            plan = plan_fragments(frags, destination=True)
            with gate([i]) if gate is not None else contextlib.nullcontext(True) as go:
                if go:
                    plan.scatter(got[0], 0)
            out.append(Status.OK if go else Status.MISS)
        return out

    def delete(self, keys) -> None:
        for k in keys:
            self._blocks.pop(bytes(k), None)

    def contains(self, key) -> bool:
        return bytes(key) in self._blocks

    def scan(self) -> StoredBlocks:
        keys = list(self._blocks)
        return StoredBlocks(keys, [self._blocks[k][1] for k in keys], np.zeros(len(keys), dtype=np.int64))


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def block(i: int, nbytes: int = BB) -> torch.Tensor:
    return torch.arange(i, i + nbytes, dtype=torch.int64).to(torch.uint8)


@pytest.fixture(params=["minimal", "segments"])
def storage(request):
    if request.param == "minimal":
        s = MemStorage(BB, capacity=16)
    else:
        from tierstore.io import format as fmt

        seg = fmt.extent_bytes_for(1, BB)
        s = SegmentStorage(
            None,
            17 * seg,
            BB,
            segment_size_bytes=seg,
            engine="memory",
            extent_size_bytes=seg,
            owns_engine=True,
        )
    yield s
    s.close()


def test_put_get_round_trip_exists_and_miss(storage):
    assert storage.put([key(1), key(2)], [block(1), block(2)], ns_digests=[NS_A, NS_A]) == [Status.OK] * 2
    assert storage.put([key(1)], [block(9)], ns_digests=[NS_A]) == [Status.EXISTS]
    dest = [torch.full((BB,), 7, dtype=torch.uint8) for _ in range(3)]
    assert storage.get([key(2), key(1), key(3)], dest) == [Status.OK, Status.OK, Status.MISS]
    assert torch.equal(dest[0], block(2)) and torch.equal(dest[1], block(1))  # the first put stayed
    assert bool((dest[2] == 7).all())  # a miss leaves its destination untouched
    assert storage.contains(key(1)) and not storage.contains(key(3)) and len(storage) == 2
    with pytest.raises(LayoutError):
        storage.put([key(4)], [])
    with pytest.raises(LayoutError):
        storage.get([key(1)], [])


def test_fragments_in_and_out_and_a_closed_gate_is_a_miss(storage):
    src = block(5)
    halves = [src[: BB // 2].view(torch.int16), src[BB // 2 :]]
    assert storage.put_fragments([key(5)], [halves], ns_digests=[NS_A]) == [Status.OK]
    out = torch.zeros(BB, dtype=torch.uint8)
    assert storage.get_fragments([key(5)], [[out[:1000], out[1000:]]]) == [Status.OK]
    assert torch.equal(out, src)

    @contextlib.contextmanager
    def closed(indices):
        yield False

    late = torch.full((BB,), 3, dtype=torch.uint8)
    assert storage.get_fragments([key(5)], [[late]], gate=closed) == [Status.MISS]
    assert bool((late == 3).all())


def test_scan_entries_and_keys_agree(storage):
    storage.put([key(1), key(2), key(3)], [block(1), block(2), block(3)], ns_digests=[NS_A, NS_B, NS_A])
    got = storage.scan()
    assert isinstance(got, StoredBlocks) and got.write_seqs.dtype == np.int64
    keys, nss, seqs = got  # unpacks as the tuple it replaced
    assert dict(zip(keys, nss)) == {key(1): NS_A, key(2): NS_B, key(3): NS_A}
    assert sorted(storage.keys()) == sorted(keys)
    assert storage.entries() == {k: (ns, int(s)) for k, ns, s in zip(keys, nss, seqs.tolist())}


def test_invalidate_namespace_drops_exactly_that_namespace(storage):
    storage.put([key(1), key(2), key(3)], [block(1), block(2), block(3)], ns_digests=[NS_A, NS_B, NS_A])
    storage.touch([key(1), key(99)])  # a hit, and an unknown key: no error
    assert storage.invalidate_namespace(NS_A) == 2
    assert [storage.contains(key(i)) for i in (1, 2, 3)] == [False, True, False]
    assert storage.invalidate_namespace(b"c" * 32) == 0
    with pytest.raises(LayoutError, match="32 bytes"):
        storage.invalidate_namespace(b"short")
    storage.delete([key(2), key(42)])
    assert len(storage) == 0 and storage.scan().keys == []


def test_the_rest_of_the_interface_answers(storage):
    class Listener:
        def on_reclaim(self, keys):
            return [True] * len(keys)

        def on_dropped(self, keys):
            pass

    listener: RegionListener = Listener()
    storage.set_listener(listener)
    assert storage.capacity_blocks() >= 16 and storage.free_blocks() >= 0
    assert isinstance(storage.compact(), bool)
    assert isinstance(storage.write_seq(), int) and isinstance(storage.stats(), dict)


def test_the_minimal_backend_gets_the_documented_defaults():
    s = MemStorage(BB, capacity=1)
    assert s.put([key(1), key(2)], [block(1), block(2)]) == [Status.OK, Status.NO_SPACE]
    assert (s.free_blocks(), s.compact(), s.write_seq(), s.stats()) == (0, False, 0, {})
    assert s.entries() == {key(1): (bytes(32), 0)}


def test_a_store_runs_on_a_backend_that_implements_only_the_interface(layout, ns):
    """The core calls the interface (scan, set_listener, get_fragments, touch,
    invalidate_namespace) and never probes for a method: a store whose NVMe tier is the
    minimal backend stores, looks up, loads and invalidates through it."""
    nvme = MemStorage(layout.bytes_per_block, capacity=8)
    store = KVStore(layout, hbm_bytes=0, host_bytes=0, nvme=nvme)
    try:
        toks, blocks = tokens(4 * layout.tokens_per_block), make_blocks(layout, 4)
        assert store.store(ns, toks, blocks) == [Status.OK] * 4
        assert len(nvme) == 4
        res = store.lookup(ns, toks)
        assert res.useful_blocks == 4
        st, out = store.load(res.useful_keys)
        assert leading_ok(st) == 4 and all(torch.equal(o, b) for o, b in zip(out, blocks))
        assert store.invalidate(ns) == 4 and len(nvme) == 0
    finally:
        store.close()
    reopened = MemStorage(layout.bytes_per_block, capacity=8)  # a restart adopts what scan() lists
    zeros = torch.zeros(layout.bytes_per_block, dtype=torch.uint8)
    reopened.put([b"k" * 32], [zeros], ns_digests=[ns.digest()])
    store = KVStore(layout, hbm_bytes=0, host_bytes=0, nvme=reopened)
    try:
        assert store.lookup_keys([b"k" * 32]).matched_blocks == 1
    finally:
        store.close()


def test_the_segment_store_is_a_block_storage(layout):
    s = memory_segment_store(layout, 8)
    try:
        assert isinstance(s, BlockStorage)
    finally:
        s.close()


def test_a_mooncake_tier_is_a_remote_block_tier_with_the_remote_status_semantics():
    from tierstore.remote import MooncakeTier, MooncakeTuning, RemoteConfig

    from ..remote.fake_mooncake import FakeCluster, FakeStore

    master = socket.socket()
    master.bind(("127.0.0.1", 0))
    master.listen(4)
    cluster = FakeCluster()
    config = RemoteConfig(
        master=f"127.0.0.1:{master.getsockname()[1]}",
        metadata="P2PHANDSHAKE",
        timeout_s=1.0,
        publish_queue_blocks=4,
    )
    tier: RemoteBlockTier = MooncakeTier(
        config, BB, tuning=MooncakeTuning(set_env=False), store_factory=lambda: FakeStore(cluster)
    )
    try:
        assert isinstance(tier, RemoteBlockTier)
        assert tier.put([key(1), key(2)], [block(1), block(2)]) == [Status.OK] * 2  # queued
        assert tier.flush(5) and tier.state == "ok"
        assert tier.put([key(1)], [block(1)]) == [Status.EXISTS]  # published recently
        assert tier.exists_prefix([key(1), key(2), key(3)]) == 2 and tier.contains(key(2))
        dest = [torch.zeros(BB, dtype=torch.uint8) for _ in range(2)]
        assert tier.get_into([key(2), key(3)], dest) == [Status.OK, Status.MISS]
        assert torch.equal(dest[0], block(2)) and bool((dest[1] == 0).all())
        assert isinstance(tier.stats(), dict)
    finally:
        tier.close()
        master.close()
