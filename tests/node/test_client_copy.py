"""The client's copies between a ticket's slots and the engine's blocks (``client.copy_slots``):
runs of a ``BlockRows`` batch whose slots follow each other are copied as row slices, other
plans block by block; both land every byte in its slot (or out of it) and nothing else."""

from __future__ import annotations

import types
import uuid

import numpy as np
import pytest
import torch

from tierstore.errors import Status
from tierstore.io.pages import BlockRows, FragmentPlan
from tierstore.node import client as client_mod
from tierstore.node import protocol as P
from tierstore.node.segment import Segment

BB = 5000  # a slot is wider than the block: only the block's bytes are copied

#: a ticket of 7 keys: a run (slots 2, 3), a key without a slot, a run (7, 8) broken by a
#: slot out of order (0), and a key whose slot follows but whose status is not OK
STATUSES = [Status.OK, Status.OK, Status.EXISTS, Status.OK, Status.OK, Status.OK, Status.NO_SPACE]
SLOTS = [2, 3, -1, 7, 8, 0, 1]


@pytest.fixture
def seg():
    s = Segment.create(f"t{uuid.uuid4().hex[:12]}", BB, 10, 2)
    yield s
    s.close()


def _ticket(seg: Segment, slots=SLOTS, statuses=STATUSES) -> P.TicketReply:
    arr = np.asarray(slots, dtype=np.int32)
    gens = np.zeros(len(slots), dtype=np.uint64)
    have = arr >= 0
    gens[have] = seg.bump_gens(arr[have])
    return P.TicketReply(
        1,
        plan_id=1,
        statuses=P.pack_statuses(statuses),
        slots=P.pack_slots(arr),
        gens=P.pack_u64(gens),
        ready=True,
    )


def _conn(seg: Segment):
    return types.SimpleNamespace(segment=seg, rows=seg.rows())


def _blocks(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (n, BB), dtype=np.uint8))


@pytest.mark.parametrize("batch", [True, False], ids=["block_rows", "per_block"])
def test_a_store_copies_each_ok_key_into_its_slot_and_a_load_copies_it_back(seg, batch):
    at = 2  # the ticket is the second chunk of a call: its key i is block at + i
    data = _blocks(at + len(SLOTS), 1)
    rows = seg.rows()
    rows.fill_(7)
    t = _ticket(seg)
    plans = BlockRows(data) if batch else [FragmentPlan.of_bytes(r) for r in data]
    counters = {"gen_mismatch": 0}
    ok = client_mod.copy_slots(_conn(seg), t, plans, at, True, BB, counters)
    want = [st is Status.OK and s >= 0 for st, s in zip(STATUSES, SLOTS)]
    assert ok.tolist() == want and counters["gen_mismatch"] == 0
    for i, (s, w) in enumerate(zip(SLOTS, want)):
        if w:
            assert torch.equal(rows[s, :BB], data[at + i])
    untouched = sorted(set(range(12)) - {s for s, w in zip(SLOTS, want) if w})
    assert bool((rows[untouched] == 7).all()) and bool((rows[:, BB:] == 7).all())

    out = torch.zeros_like(data)
    dests = (
        BlockRows(out, destination=True)
        if batch
        else [FragmentPlan.of_bytes(r, destination=True) for r in out]
    )
    got = client_mod.copy_slots(_conn(seg), t, dests, at, False, BB, counters)
    assert got.tolist() == want
    for i, w in enumerate(want):
        assert torch.equal(out[at + i], data[at + i] if w else torch.zeros(BB, dtype=torch.uint8))
    assert bool((out[:at] == 0).all())


def test_a_slot_reused_during_the_copy_is_not_counted(seg):
    t = _ticket(seg)
    seg.bump_gens([7])  # slot 7 was handed to another ticket meanwhile
    counters = {"gen_mismatch": 0}
    ok = client_mod.copy_slots(_conn(seg), t, BlockRows(_blocks(len(SLOTS), 2)), 0, True, BB, counters)
    assert ok.tolist() == [True, True, False, False, True, True, False]
    assert counters["gen_mismatch"] == 1


def test_runs_are_cut_into_pieces_of_about_chunk_bytes(seg):
    """Slots 0..5 for keys 0..5: one run; pieces of 2 rows each (chunk 2 blocks), every byte lands."""
    rows = seg.rows()
    data = _blocks(6, 3)
    todo = np.arange(6)
    pieces = client_mod._run_pieces(rows, data, np.arange(6, dtype=np.int32), todo, 0, True, BB, 2 * BB)
    assert len(pieces) == 3
    for p in pieces:
        p()
    assert torch.equal(rows[:6, :BB], data)
    assert client_mod._run_pieces(rows, data, np.arange(6, dtype=np.int32), todo[:0], 0, True, BB, BB) == []


def test_node_metrics_count_blocks_by_status_and_payload_bytes():
    """``count_blocks`` counts each status (by identity, not per-block hashing) and
    ``count_bytes`` adds up, on the labelled children it keeps."""
    from prometheus_client import CollectorRegistry

    from tierstore.server.metrics import NodeMetrics

    r = CollectorRegistry()
    m = NodeMetrics(r)
    m.count_blocks("put", "acme", [Status.OK] * 3 + [Status.EXISTS, Status.NO_SPACE, Status.OK])
    m.count_blocks("put", "acme", (s for s in [Status.OK, Status.IO_ERROR]))
    m.count_bytes("in", "acme", 10)
    m.count_bytes("in", "acme", 5)

    def value(name, **labels):
        return r.get_sample_value(name, labels)

    assert value("tierstore_node_blocks_total", op="put", tenant="acme", status="ok") == 5
    assert value("tierstore_node_blocks_total", op="put", tenant="acme", status="exists") == 1
    assert value("tierstore_node_blocks_total", op="put", tenant="acme", status="no_space") == 1
    assert value("tierstore_node_blocks_total", op="put", tenant="acme", status="io_error") == 1
    assert value("tierstore_node_blocks_total", op="put", tenant="acme", status="miss") is None
    assert value("tierstore_node_payload_bytes_total", direction="in", tenant="acme") == 15
