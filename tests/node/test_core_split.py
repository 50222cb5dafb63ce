"""Split execution (issue 24, N3): the index prepares, a client (here: two "ranks", each a
column of the shared segment, in two threads) copies the bytes into or out of the slots, the
service completes. Every test checks the index's invariants and that every slot is free again."""

from __future__ import annotations

import threading
import uuid

import numpy as np
import pytest
import torch

from tierstore.build import assemble
from tierstore.config import StoreConfig
from tierstore.contract import Tier
from tierstore.errors import Status
from tierstore.layout import KVLayout
from tierstore.node.segment import Segment, column_offsets
from tierstore.node.tickets import PlanService, Ready, TicketError
from tierstore.tiers.memory import BlockPool
from tierstore.transfers import Transfers

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16, tokens_per_block=16)
BB = LAYOUT.bytes_per_block
HOST, STAGING = 8, 4
NS = b"n" * 32
SHARDS = [BB // 2, BB - BB // 2]
OFFS = column_offsets(SHARDS)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Node:
    """A store over a segment's host slots, an NVMe file, and its plan service."""

    def __init__(self, tmp_path, **policies) -> None:
        self.seg = Segment.create(f"t{uuid.uuid4().hex[:12]}", BB, HOST, STAGING)
        cfg = StoreConfig.from_dict(
            {
                "tiers": {
                    "host": {"capacity_bytes": HOST * BB},
                    "nvme": {
                        "path": str(tmp_path) + "/",
                        "capacity_bytes": "4m",
                        "segment_size_bytes": "256k",
                    },
                },
                "policies": policies,
            }
        )
        self.parts = assemble(cfg, LAYOUT, host_pool=BlockPool.from_tensor("host", self.seg.host_rows()))
        self.index = self.parts.index
        self.tr = Transfers(self.index, self.parts.mover, None, self.parts.nvme, LAYOUT)
        self.clock = Clock()
        self.svc = PlanService(self.tr, self.seg, lease_s=60, clock=self.clock)
        self.cols = [self.seg.column(o, b) for o, b in zip(OFFS, SHARDS)]
        self.rng = np.random.default_rng(7)

    def close(self) -> None:
        self.parts.mover.shutdown()
        self.parts.nvme.close()
        self.seg.close()

    def blocks(self, n: int) -> tuple[list[bytes], list[torch.Tensor]]:
        keys = [self.rng.bytes(32) for _ in range(n)]
        data = [torch.from_numpy(self.rng.integers(0, 256, BB, dtype=np.uint8)) for _ in range(n)]
        return keys, data

    def gather(self, rank: int, ticket, data, ok=None) -> list[bool]:
        """Rank ``rank`` copies its shard of each block with a slot into it."""
        out = []
        for i, s in enumerate(ticket.slots):
            good = s >= 0 and (ok is None or ok[i])
            if good:
                self.cols[rank].view(int(s)).copy_(data[i][OFFS[rank] : OFFS[rank] + SHARDS[rank]])
            out.append(bool(good))
        return out

    def scatter(self, rank: int, ticket) -> list[torch.Tensor | None]:
        return [
            self.cols[rank].view(int(s)).clone() if st is Status.OK else None
            for s, st in zip(ticket.slots, ticket.statuses)
        ]

    def store(self, keys, data, ranks: int = 2):
        t = self.svc.prepare_store(NS, keys, ranks=ranks, wait=True)
        res = None
        for r in range(ranks):
            res = self.svc.complete_store(t.plan_id, self.gather(r, t, data), rank=r)
        return t, res

    def load(self, keys, ranks: int = 2) -> tuple[list, list[torch.Tensor | None]]:
        t = self.svc.prepare_load(keys, ranks=ranks, wait=True)
        parts = [self.scatter(r, t) for r in range(ranks)]
        gens_ok = self.seg.gens_of(np.maximum(t.slots, 0)) == t.gens
        st = None
        for r in range(ranks):
            st = self.svc.complete_load(
                t.plan_id, [p is not None and g for p, g in zip(parts[r], gens_ok)], rank=r
            )
        out = [
            torch.cat([parts[0][i], parts[1][i]]) if parts[0][i] is not None else None
            for i in range(len(keys))
        ]
        return st, out

    def host_used(self) -> int:
        return self.index.placement.alloc[Tier.HOST].used

    def quiet(self) -> None:
        """Nothing open, nothing held, every staging slot free."""
        self.parts.mover.drain()
        assert self.svc.open_tickets() == 0
        self.svc.check_invariants()
        self.index.check_invariants(quiescent=True)
        assert self.svc.staging.free == STAGING


@pytest.fixture
def node(tmp_path):
    n = Node(tmp_path)
    yield n
    n.close()


def test_two_ranks_store_into_their_columns_and_load_back(node):
    keys, data = node.blocks(3)
    t = node.svc.prepare_store(NS, keys, ranks=2)
    assert t.ready and t.statuses == [Status.OK] * 3 and (t.slots >= 0).all()
    assert (node.seg.gens_of(t.slots) == t.gens).all() and (t.gens > 0).all()
    results = [None, None]

    def rank(r):
        results[r] = node.svc.complete_store(t.plan_id, node.gather(r, t, data), rank=r)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    done = [x for x in results if x is not None]
    assert len(done) == 1 and done[0].statuses == [Status.OK] * 3 and not done[0].durable
    assert node.index.probe(keys) == 3
    st, out = node.load(keys)
    assert st == [Status.OK] * 3
    assert all(torch.equal(o, d) for o, d in zip(out, data))
    node.quiet()


def test_a_rank_that_failed_its_shard_hides_the_key_and_frees_its_slot(node):
    keys, data = node.blocks(3)
    t = node.svc.prepare_store(NS, keys, ranks=2)
    assert node.svc.complete_store(t.plan_id, node.gather(0, t, data), rank=0) is None
    res = node.svc.complete_store(t.plan_id, node.gather(1, t, data, ok=[True, False, True]), rank=1)
    # key 1 failed on rank 1: not kept, and key 2 after it is unreachable (chain rule)
    assert res.statuses == [Status.OK, Status.IO_ERROR, Status.NO_SPACE]
    assert node.index.probe(keys) == 1 and node.index.tiers_of(keys[1]) == []
    assert node.host_used() == 1
    assert node.index.metrics.counters["store_copy_failed"] >= 1
    node.quiet()


def test_reports_are_idempotent_and_checked(node):
    keys, data = node.blocks(2)
    t = node.svc.prepare_store(NS, keys, ranks=2)
    assert node.svc.complete_store(t.plan_id, node.gather(0, t, data), rank=0) is None
    # rank 0 again, saying its copy failed: its first report stands
    assert node.svc.complete_store(t.plan_id, [False, False], rank=0) is None
    first = node.svc.complete_store(t.plan_id, node.gather(1, t, data), rank=1)
    assert first.statuses == [Status.OK, Status.OK]
    again = node.svc.complete_store(t.plan_id, [False, False], rank=1)
    assert again == first
    with pytest.raises(TicketError, match="store ticket"):
        node.svc.complete_load(t.plan_id, [True, True])
    lt = node.svc.prepare_load(keys, ranks=1)
    with pytest.raises(TicketError, match="3 results for 2 keys"):
        node.svc.complete_load(lt.plan_id, [True] * 3)
    with pytest.raises(TicketError, match="rank 1 outside"):
        node.svc.complete_load(lt.plan_id, [True, True], rank=1)
    with pytest.raises(TicketError, match="no such ticket"):
        node.svc.complete_load(10**6, [True])
    assert node.svc.complete_load(lt.plan_id, [True, True]) == [Status.OK, Status.OK]
    assert node.svc.complete_load(lt.plan_id, [False, False]) == [Status.OK, Status.OK]
    assert node.svc.abort(lt.plan_id) is False
    node.quiet()


class Gate:
    """Holds the NVMe writes of the store queue until opened."""

    def __init__(self, nvme) -> None:
        self.open = threading.Event()
        self.entered = threading.Event()
        self.real = nvme.write
        self.writes: list[list[bytes]] = []
        nvme.write = self

    def __call__(self, batch):
        self.entered.set()
        assert self.open.wait(10)
        self.writes.append(list(batch.keys))
        return self.real(batch)


def test_victims_leave_before_their_dirty_slot_is_handed_out(node):
    keys, data = node.blocks(HOST)
    _, res = node.store(keys, data)
    assert res.statuses == [Status.OK] * HOST and node.host_used() == HOST
    old_slot = {k: node.index.memory_slot(k, Tier.HOST) for k in keys}
    gate = Gate(node.parts.mover.nvme)
    new_keys, new_data = node.blocks(1)
    t = node.svc.prepare_store(NS, new_keys, ranks=2)  # the victim must go to NVMe first
    assert not t.ready and gate.entered.wait(10)
    victim = next(k for k, s in old_slot.items() if s == t.slots[0])
    with pytest.raises(TicketError, match="not ready"):
        node.svc.complete_store(t.plan_id, [True], rank=0)
    assert node.svc.poll() == [] and not node.svc.wait_ready(t.plan_id, 0.05)
    gate.open.set()
    assert node.svc.wait_ready(t.plan_id, 10)
    assert node.svc.poll() == [Ready(t.plan_id, ())]
    assert len(gate.writes) == 1 and victim in gate.writes[0]  # a batch of victims, this one with them
    assert node.index.tiers_of(victim) == [Tier.NVME]
    for r in range(2):
        res = node.svc.complete_store(t.plan_id, node.gather(r, t, new_data), rank=r)
    assert res.statuses == [Status.OK]
    # the victim's bytes were written before the new block overwrote its slot
    st, out = node.load([victim] + new_keys)
    assert st == [Status.OK, Status.OK]
    assert torch.equal(out[0], data[keys.index(victim)]) and torch.equal(out[1], new_data[0])
    node.quiet()


def test_a_block_on_nvme_is_staged_once_for_both_ranks_then_promoted(node):
    keys, data = node.blocks(3)
    node.store(keys, data)
    assert node.tr.evict(Tier.HOST, 3) == 3
    assert all(node.index.tiers_of(k) == [Tier.NVME] for k in keys)
    reads = []
    real = node.parts.mover.nvme.read

    def counting(ks, dests, *a, **k):
        reads.extend(ks)
        return real(ks, dests, *a, **k)

    node.parts.mover.nvme.read = counting
    t = node.svc.prepare_load(keys, ranks=2, wait=False)
    assert node.svc.wait_ready(t.plan_id, 10)
    assert node.svc.poll() == [Ready(t.plan_id, ())]
    assert all(s >= HOST for s in t.slots)  # staging slots
    assert node.svc.staging.free == STAGING - 3
    parts = [node.scatter(r, t) for r in range(2)]
    assert node.svc.complete_load(t.plan_id, [True] * 3, rank=0) is None
    assert node.svc.complete_load(t.plan_id, [True] * 3, rank=1) == [Status.OK] * 3
    assert sorted(reads) == sorted(keys)  # one read per block, for both ranks
    for i in range(3):
        assert torch.equal(torch.cat([parts[0][i], parts[1][i]]), data[i])
    assert all(Tier.HOST in node.index.tiers_of(k) for k in keys)  # promoted from the staging slot
    st, out = node.load(keys)
    assert st == [Status.OK] * 3 and all(torch.equal(o, d) for o, d in zip(out, data))
    node.quiet()


def test_a_corrupt_nvme_block_is_a_failed_key_of_the_ready_ticket(node):
    keys, data = node.blocks(3)
    node.store(keys, data)
    node.tr.evict(Tier.HOST, 3)
    raw = bytearray(open(node.parts.nvme.path, "rb").read())
    at = raw.find(data[1][:64].numpy().tobytes())
    assert at >= 0
    with open(node.parts.nvme.path, "r+b") as f:
        f.seek(at + 100)
        f.write(bytes([raw[at + 100] ^ 0xFF]))
    t = node.svc.prepare_load(keys, ranks=1, wait=False)
    assert node.svc.wait_ready(t.plan_id, 10)
    assert node.svc.poll() == [Ready(t.plan_id, (1,))]
    assert t.failed == (1,) and t.statuses == [Status.OK, Status.MISS, Status.OK]
    got = node.scatter(0, t)
    assert node.svc.complete_load(t.plan_id, [g is not None for g in got]) == [
        Status.OK,
        Status.IO_ERROR,
        Status.OK,
    ]
    assert node.index.tiers_of(keys[1]) == []  # never served again
    node.quiet()


def test_an_abandoned_store_expires_and_frees_its_slots(node):
    keys, data = node.blocks(2)
    node.store(keys, data)
    new_keys, new_data = node.blocks(4)
    t = node.svc.prepare_store(NS, new_keys, ranks=2)
    node.gather(0, t, new_data)  # one rank copied, then the client vanished
    node.tr.evict(Tier.HOST, 2)
    lt = node.svc.prepare_load(keys, ranks=1, wait=True)  # staged, never completed either
    assert node.svc.staging.free == STAGING - 2 and node.svc.open_tickets() == 2
    assert node.svc.expire() == 0
    node.clock.now += 61
    assert node.svc.expire() == 2
    assert node.svc.open_tickets() == 0 and node.svc.staging.free == STAGING
    # the four host slots it was handed are free again; the two old blocks are on NVMe only
    assert node.index.probe(new_keys) == 0 and node.host_used() == 0
    late = node.svc.complete_store(t.plan_id, [True] * 4, rank=1)  # too late: never acknowledged
    assert late.statuses == [Status.IO_ERROR] * 4
    assert node.svc.complete_load(lt.plan_id, [True, True]) == [Status.MISS, Status.MISS]
    assert node.index.metrics.counters["tickets_expired"] == 2
    node.quiet()
    st, out = node.load(keys)  # the blocks the expired load held are intact
    assert st == [Status.OK] * 2 and all(torch.equal(o, d) for o, d in zip(out, data))


def test_a_load_tickets_slot_is_not_reused_while_the_client_reads_it(node):
    keys, data = node.blocks(HOST)
    node.store(keys, data)
    t = node.svc.prepare_load(keys[:1], ranks=1)
    slot = int(t.slots[0])
    assert t.ready and slot < HOST  # read in place from its host slot
    for _ in range(3):  # churn: every other block of the host tier is replaced
        more, more_data = node.blocks(HOST)
        st, res = node.store(more, more_data)
        assert slot not in st.slots.tolist()
    assert torch.equal(node.seg.rows()[slot, :BB], data[0])
    assert node.seg.gens_of([slot])[0] == t.gens[0]
    assert node.svc.complete_load(t.plan_id, [True]) == [Status.OK]
    node.quiet()


def test_abort_while_the_victims_are_written_keeps_nothing(node):
    keys, data = node.blocks(HOST)
    node.store(keys, data)
    gate = Gate(node.parts.mover.nvme)
    new_keys, _ = node.blocks(2)
    t = node.svc.prepare_store(NS, new_keys, ranks=1)
    assert gate.entered.wait(10) and not t.ready
    assert node.svc.abort(t.plan_id) is True
    gate.open.set()
    node.parts.mover.drain()
    assert node.svc.complete_store(t.plan_id, [True, True]).statuses == [Status.IO_ERROR] * 2
    assert node.index.probe(new_keys) == 0
    assert node.index.metrics.counters["tickets_aborted"] == 1
    node.quiet()


def test_a_quarantined_store_keeps_its_slots_until_released(node):
    keys, data = node.blocks(2)
    t = node.svc.prepare_store(NS, keys, ranks=1)
    held = set(t.slots.tolist())
    node.clock.now += 61
    assert node.svc.expire(quarantine=True) == 1  # its client may still be writing
    assert node.svc.quarantined_slots() == 2 and node.svc.open_tickets() == 1
    with pytest.raises(TicketError, match="quarantined"):
        node.svc.complete_store(t.plan_id, b"\x01\x01")
    for _ in range(2):  # churn through the host tier: the held slots are never handed out
        more, more_data = node.blocks(HOST)
        st, _ = node.store(more, more_data)
        assert not held & set(st.slots.tolist())
    assert node.svc.expire(quarantine=True) == 0
    gens = node.seg.gens_of(t.slots)
    assert node.svc.abort(t.plan_id)  # its owner is known to be done
    assert (node.seg.gens_of(t.slots) == gens + 1).all()
    assert node.index.probe(keys) == 0 and node.svc.quarantined_slots() == 0
    node.quiet()


def test_an_aborted_load_bumps_the_generations_its_reader_checks(node):
    keys, data = node.blocks(2)
    node.store(keys, data)
    t = node.svc.prepare_load(keys, ranks=1)
    assert (node.seg.gens_of(t.slots) == t.gens).all()
    assert node.svc.quarantine(t.plan_id)  # a load is aborted at once: its reader sees new gens
    assert (node.seg.gens_of(t.slots) != t.gens).all()
    assert node.svc.complete_load(t.plan_id, b"\x01\x01") == [Status.MISS, Status.MISS]
    node.quiet()


def test_a_block_with_no_host_slot_goes_to_nvme_from_a_staging_slot(node):
    keys, data = node.blocks(HOST)
    node.store(keys, data)
    held = node.svc.prepare_load(keys, ranks=1)  # every host block is being read: no victim
    new_keys, new_data = node.blocks(3)
    t = node.svc.prepare_store(NS, new_keys, ranks=2, wait=True)
    assert t.ready and all(HOST <= s < HOST + STAGING for s in t.slots)
    assert node.svc.staging.free == STAGING - 3
    for r in range(2):
        res = node.svc.complete_store(t.plan_id, node.gather(r, t, new_data), rank=r)
    assert res.statuses == [Status.OK] * 3 and res.durable == frozenset(range(3))
    assert all(node.index.tiers_of(k) == [Tier.NVME] for k in new_keys)
    assert node.svc.complete_load(held.plan_id, [True] * HOST) == [Status.OK] * HOST
    st, out = node.load(new_keys)  # read back from NVMe through staging slots
    assert st == [Status.OK] * 3 and all(torch.equal(o, d) for o, d in zip(out, new_data))
    node.quiet()


def test_staging_runs_out_the_rest_of_the_chain_is_no_space(node):
    keys, data = node.blocks(HOST)
    node.store(keys, data)
    held = node.svc.prepare_load(keys, ranks=1)
    new_keys, new_data = node.blocks(STAGING + 2)
    t = node.svc.prepare_store(NS, new_keys, ranks=1, wait=True)
    assert t.statuses == [Status.OK] * STAGING + [Status.NO_SPACE] * 2
    assert node.index.metrics.counters["staging_full"] == 2
    res = node.svc.complete_store(t.plan_id, node.gather(0, t, new_data))
    assert res.statuses == [Status.OK] * STAGING + [Status.NO_SPACE] * 2
    assert node.index.probe(new_keys) == STAGING
    node.svc.complete_load(held.plan_id, [True] * HOST)
    node.quiet()


def test_concurrent_clients_keep_every_byte_and_every_slot(node):
    errors: list = []
    kept: dict = {}
    lock = threading.Lock()

    def client(seed: int) -> None:
        rng = np.random.default_rng(seed)
        try:
            for _ in range(15):
                n = int(rng.integers(1, 4))
                keys = [rng.bytes(32) for _ in range(n)]
                data = [torch.from_numpy(rng.integers(0, 256, BB, dtype=np.uint8)) for _ in range(n)]
                t = node.svc.prepare_store(NS, keys, ranks=1, wait=bool(rng.integers(0, 2)))
                assert node.svc.wait_ready(t.plan_id, 20)
                if rng.random() < 0.2:
                    node.svc.abort(t.plan_id)
                    continue
                rows = node.seg.rows()
                for i, s in enumerate(t.slots):  # one rank: the whole block
                    if s >= 0:
                        rows[s, :BB].copy_(data[i])
                res = node.svc.complete_store(t.plan_id, [bool(s >= 0) for s in t.slots])
                with lock:
                    kept.update((k, d) for k, d, s in zip(keys, data, res.statuses) if s is Status.OK)
                    sample = list(kept.items())[-3:]
                lt = node.svc.prepare_load([k for k, _ in sample], ranks=1, wait=True)
                rows = node.seg.rows()
                got = [
                    rows[s, :BB].clone() if st is Status.OK else None for s, st in zip(lt.slots, lt.statuses)
                ]
                fresh = node.seg.gens_of(np.maximum(lt.slots, 0)) == lt.gens
                for (_k, d), g, f in zip(sample, got, fresh):
                    assert g is None or not f or torch.equal(g, d), "wrong bytes"
                node.svc.complete_load(lt.plan_id, [g is not None and f for g, f in zip(got, fresh)])
        except BaseException as e:  # noqa: BLE001  reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    node.quiet()


def test_a_ticket_with_a_callback_is_announced_to_it_not_to_poll(node):
    keys, data = node.blocks(2)
    node.store(keys, data)
    node.tr.evict(Tier.HOST, 2)
    told: list = []
    t = node.svc.prepare_load(keys, ranks=1, on_ready=told.append)
    assert node.svc.wait_ready(t.plan_id, 10)
    node.parts.mover.drain()
    assert told == [Ready(t.plan_id, ())] and node.svc.poll() == []
    assert node.svc.complete_load(t.plan_id, [True, True]) == [Status.OK, Status.OK]
    node.quiet()


def test_a_store_completed_without_waiting_runs_its_second_half_on_the_queue(node):
    keys, data = node.blocks(2)
    t = node.svc.prepare_store(NS, keys, ranks=2)
    assert node.svc.complete_store(t.plan_id, node.gather(0, t, data), rank=0, wait=False).result(10) is None
    fut = node.svc.complete_store(t.plan_id, node.gather(1, t, data), rank=1, wait=False)
    res = fut.result(10)
    assert res.statuses == [Status.OK, Status.OK]
    assert node.svc.complete_store(t.plan_id, [0, 0], rank=1, wait=False).result(10) == res
    node.quiet()


def test_a_ticket_whose_queue_refuses_is_given_up_and_the_refusal_raised(node, monkeypatch):
    """The movers' queue refuses a ticket's first half (the store is closing): its plan is aborted,
    the ticket finished (nothing stored, nothing held, every staging slot free) and the refusal
    raised, for a store (victims to write) and a load (blocks to stage) alike."""
    keys, data = node.blocks(HOST)
    node.store(keys, data)
    assert node.tr.evict(Tier.HOST, 2) == 2  # two blocks on NVMe only: a load stages them
    on_nvme = [k for k in keys if node.index.tiers_of(k) == [Tier.NVME]]
    node.store(*node.blocks(2))  # the host tier full again: a new store has victims to write

    def refuse(kind, fn):
        raise RuntimeError(f"{kind} queue closed")

    monkeypatch.setattr(node.tr, "submit", refuse)
    new_keys, _ = node.blocks(1)
    with pytest.raises(RuntimeError, match="store queue closed"):
        node.svc.prepare_store(NS, new_keys, ranks=1)
    assert node.index.probe(new_keys) == 0
    with pytest.raises(RuntimeError, match="load queue closed"):
        node.svc.prepare_load(on_nvme, ranks=1)
    assert node.index.tiers_of(on_nvme[0]) == [Tier.NVME]
    monkeypatch.undo()
    st, out = node.load(on_nvme)
    assert st == [Status.OK] * 2 and all(torch.equal(o, data[keys.index(k)]) for o, k in zip(out, on_nvme))
    node.quiet()
