"""``eviction_granularity: block`` on the segment store: victims in the listener's order, dead
slots deallocated in runs after their tombstones are durable, exact accounting, and a
reopen that never brings an evicted block back (trims real or ignored)."""

import collections
import os
import shutil
import tempfile

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from tierstore.config import NvmeTierConfig
from tierstore.errors import ConfigError, ForeignDataError, InvariantError, Status, StoreLockedError
from tierstore.io import SegmentStorage
from tierstore.io import format as fmt
from tierstore.io.engine import IOFuture
from tierstore.io.factory import open_engine
from tierstore.io.journal import Journal, RecordKind, read_records
from tierstore.io.memory import MemoryEngine  # noqa: F401  (the engine the memory stores use)
from tierstore.io.segments import _open_journal

BB = 4096
SEG = 64 << 10
CAP = 16 * SEG
SLOT = fmt.block_slot_bytes(BB)


class LruListener:
    """The index's side, in miniature: an LRU of the stored keys, ``protected`` never picked."""

    def __init__(self, keys=()):
        self.order = collections.OrderedDict((k, None) for k in keys)
        self.protected: set = set()
        self.picked: list = []
        self.dropped: list = []

    def track(self, keys):
        for k in keys:
            self.order[k] = None
            self.order.move_to_end(k)

    def pick_victims(self, n):
        out = [k for k in self.order if k not in self.protected][:n]
        for k in out:
            del self.order[k]
        self.picked += out
        return out

    def on_reclaim(self, keys):
        return [k in self.protected for k in keys]

    def on_dropped(self, keys):
        self.dropped += keys
        for k in keys:
            self.order.pop(k, None)


class TrimLog:
    def __init__(self):
        self.trims: list = []

    def on_write(self, off, n, placement):
        pass

    def on_trim(self, off, n):
        self.trims.append((off, n))


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def block(k: bytes) -> torch.Tensor:
    g = torch.Generator().manual_seed(int.from_bytes(k[:4], "little"))
    return torch.randint(0, 256, (BB,), dtype=torch.uint8, generator=g)


def put(s, lis, ids):
    ks = [key(i) for i in ids]
    st = s.put(ks, [block(k) for k in ks])
    lis.track([k for k, x in zip(ks, st) if x is Status.OK])
    s.check_invariants()
    return st


def memory_store(**kw):
    lis = LruListener()
    args = dict(
        segment_size_bytes=SEG,
        engine="memory",
        extent_size_bytes=SEG,
        eviction_granularity="block",
        live_fraction=0.5,
        trim_min_bytes=SLOT,
        listener=lis,
    )
    args.update(kw)
    s = SegmentStorage(None, CAP, BB, **args)
    log = TrimLog()
    s.engine.add_observer(log)
    return s, lis, log


def test_bad_granularity_is_refused():
    with pytest.raises(ConfigError, match="eviction_granularity"):
        SegmentStorage(None, CAP, BB, segment_size_bytes=SEG, engine="memory", eviction_granularity="blocks")
    with pytest.raises(Exception, match="eviction_granularity"):
        NvmeTierConfig(device="sim", capacity_bytes=CAP, eviction_granularity="page")
    with pytest.raises(ConfigError, match="live_fraction"):
        SegmentStorage(
            None,
            CAP,
            BB,
            segment_size_bytes=SEG,
            engine="memory",
            eviction_granularity="block",
            live_fraction=1.5,
        )
    assert NvmeTierConfig(device="sim", capacity_bytes=CAP).eviction_granularity == "region"


def test_block_mode_on_a_device_needs_a_journal_path():
    with pytest.raises(ConfigError, match="journal_path"):
        _open_journal("/dev/null", None, block=True)


def test_evicts_single_blocks_in_the_listeners_order():
    s, lis, _ = memory_store()
    budget = s.capacity_blocks()
    assert budget == int(0.5 * (16 - 1 - 1) * 15)
    for a in range(0, budget, 5):
        assert put(s, lis, range(a, a + 5)) == [Status.OK] * 5
    assert len(s) == budget and s.free_blocks() == 0
    lis.track([key(i) for i in range(0, 10)])  # hits: 0..9 become the most recent
    lis.protected = {key(10)}  # in use: never a victim
    assert put(s, lis, range(1000, 1004)) == [Status.OK] * 4
    assert lis.picked == [key(i) for i in (11, 12, 13, 14)]
    assert len(s) == budget
    for k in lis.picked:
        assert not s.contains(k)
    for i in (0, 9, 10, 15):
        d = torch.empty(BB, dtype=torch.uint8)
        assert s.get([key(i)], [d]) == [Status.OK] and torch.equal(d, block(key(i)))
    st = s.stats()
    assert st["block_evictions"] == 4 and st["blocks"] == budget
    assert st["eviction_granularity"] == "block" and st["live_budget_blocks"] == budget


def test_adjacent_dead_slots_trimmed_as_one_run_never_a_header_or_live_slot():
    s, lis, log = memory_store()
    budget = s.capacity_blocks()
    for a in range(0, budget, 5):
        put(s, lis, range(a, a + 5))
    where = {i: s.locate(key(i))[1] for i in range(budget)}
    put(s, lis, range(1000, 1005))  # evicts 0..4: one extent's five adjacent slots
    first = where[0]
    assert log.trims == [(first, 5 * SLOT)]
    assert all(where[i] == first + i * SLOT for i in range(5))
    assert first % SEG >= fmt.header_bytes_for(5)  # the header before them stays
    st = s.stats()
    assert st["trimmed_bytes"] == 5 * SLOT and st["trim_ranges"] == 1 and st["dead_pending_bytes"] == 0
    assert st["hole_blocks"] == 5


def test_short_runs_wait_for_trim_min_bytes():
    s, lis, log = memory_store(trim_min_bytes=3 * SLOT)
    budget = s.capacity_blocks()
    for a in range(0, budget, 5):
        put(s, lis, range(a, a + 5))
    lis.track([key(i) for i in range(1, budget)])  # only block 0 is old
    put(s, lis, [1000])
    assert lis.picked == [key(0)] and log.trims == []
    assert s.stats()["dead_pending_bytes"] == SLOT
    lis.track([key(i) for i in range(3, budget)])  # then 1 and 2, its neighbours
    put(s, lis, [1001, 1002])
    assert log.trims == [(s.locate(key(3))[1] - 3 * SLOT, 3 * SLOT)]
    assert s.stats()["dead_pending_bytes"] == 0


def test_segment_reused_only_after_its_reset_and_trimmed_whole():
    s, lis, log = memory_store()
    budget = s.capacity_blocks()
    for a in range(0, 15 * 8, 5):  # far past the budget: every early segment empties
        put(s, lis, range(a, a + 5))
    st = s.stats()
    assert len(s) <= budget
    assert st["segments_reset"] > 0
    resets = [(o, n) for o, n in log.trims if n == SEG]
    assert len(resets) == st["segments_reset"]
    reset_log = [r for r in s._blk.journal.records if r.kind is RecordKind.SEGMENT_RESET]
    assert len(reset_log) == st["segments_reset"]


def test_gc_keeps_or_evicts_and_accounting_stays_exact():
    # live 1.0: puts of 5 pack 13 blocks a segment, fewer than the budget assumes: the segments fill
    # first; every 5th block is hit again and again (every 10th is protected), so the single victims
    # (least recently used) leave two in each segment, and host GC runs
    s, lis, _ = memory_store(live_fraction=1.0)
    lis.protected = {key(i) for i in range(0, 600, 10)}
    for a in range(0, 600, 5):
        st = put(s, lis, range(a, a + 5))
        assert Status.IO_ERROR not in st
        assert len(s) <= s.capacity_blocks()
        lis.track([key(i) for i in range(0, a, 5) if s.contains(key(i))])
    st = s.stats()
    assert st["gc_evicted_blocks"] > 0 and st["gc_bytes_written"] > 0  # kept ones were copied forward
    assert all(s.contains(k) for k in lis.protected)
    assert st["put_blocks_ok"] == len(s) + st["block_evictions"] + st["gc_evicted_blocks"]


def test_invariants_catch_a_wrong_count():
    s, lis, _ = memory_store()
    put(s, lis, range(5))
    s._blk.dead[s.locate(key(0))[0]] += 1
    with pytest.raises(InvariantError):
        s.check_invariants()


def _file_store(path, lis, engine="posix", live_fraction=0.5, **kw):
    return SegmentStorage(
        str(path),
        CAP,
        BB,
        segment_size_bytes=SEG,
        engine=engine,
        extent_size_bytes=SEG,
        eviction_granularity="block",
        live_fraction=live_fraction,
        trim_min_bytes=SLOT,
        listener=lis,
        **kw,
    )


def _ignore_trims(s):
    s.engine._trim_impl = lambda off, n: IOFuture.completed(n)  # as QEMU's discard=ignore


@pytest.mark.parametrize("trims", ["real", "ignored"])
def test_reopen_never_brings_an_evicted_block_back(tmp_path, trims):
    path = tmp_path / "tier.bin"
    lis = LruListener()
    s = _file_store(path, lis)
    if trims == "ignored":
        _ignore_trims(s)
    budget = s.capacity_blocks()
    for a in range(0, budget + 40, 5):
        put(s, lis, range(a, a + 5))
    evicted = set(lis.picked)
    assert len(evicted) == 40
    survivors = set(s.keys())
    s.close()
    recs = read_records(str(path) + ".journal").records
    assert {r.digest for r in recs if r.kind is RecordKind.BLOCK_DEAD} >= evicted
    s2 = _file_store(path, LruListener())
    assert set(s2.keys()) == survivors and not evicted & set(s2.keys())
    assert s2.stats()["recovery_tombstoned_blocks"] > 0
    s2.check_invariants()
    for k in list(survivors)[:20]:
        d = torch.empty(BB, dtype=torch.uint8)
        assert s2.get([k], [d]) == [Status.OK] and torch.equal(d, block(k))
    for k in evicted:
        assert s2.get([k], [torch.empty(BB, dtype=torch.uint8)]) == [Status.MISS]
    s2.close()
    if trims == "ignored":  # the journal is what keeps them dead: their bytes are still there
        os.unlink(str(path) + ".journal")
        s3 = SegmentStorage(str(path), CAP, BB, segment_size_bytes=SEG, engine="posix", extent_size_bytes=SEG)
        assert evicted & set(s3.keys())
        s3.close()


def test_region_mode_reads_a_journal_left_by_block_mode(tmp_path):
    path = tmp_path / "tier.bin"
    lis = LruListener()
    s = _file_store(path, lis)
    _ignore_trims(s)
    for a in range(0, s.capacity_blocks() + 20, 5):
        put(s, lis, range(a, a + 5))
    evicted = set(lis.picked)
    s.close()
    s2 = SegmentStorage(str(path), CAP, BB, segment_size_bytes=SEG, engine="posix", extent_size_bytes=SEG)
    assert evicted and not evicted & set(s2.keys())
    s2.close()


def test_tombstone_naming_another_key_is_ignored(tmp_path):
    path = tmp_path / "tier.bin"
    lis = LruListener()
    s = _file_store(path, lis)
    put(s, lis, range(5))
    si, off = s.locate(key(0))
    s._blk.journal.append(RecordKind.BLOCK_DEAD, si, int(s._segs.gen[si]), off, key(99))
    s._blk.journal.commit()
    s.close()
    s2 = _file_store(path, LruListener())
    assert s2.contains(key(0)) and s2.stats()["journal_mismatch"] == 1
    s2.close()


def test_stale_reset_segment_not_adopted_when_its_trim_was_ignored(tmp_path):
    path = tmp_path / "tier.bin"
    lis = LruListener()
    s = _file_store(path, lis)
    _ignore_trims(s)
    for a in range(0, 15 * 10, 5):
        put(s, lis, range(a, a + 5))
    assert s.stats()["segments_reset"] > 0
    live = set(s.keys())
    s.close()
    s2 = _file_store(path, LruListener())
    assert set(s2.keys()) == live
    st = s2.stats()
    assert st["recovery_stale_segments"] > 0
    s2.check_invariants()
    s2.close()


def test_trim_only_after_its_record_is_durable():
    s, lis, _ = memory_store()

    class Check:
        bad: list = []

        def on_write(self, off, n, placement):
            pass

        def on_trim(self, off, n):  # the committed records at the moment of the trim
            recs = s._blk.journal.records
            if n == SEG:
                ok = any(r.kind is RecordKind.SEGMENT_RESET and r.segment == off // SEG for r in recs)
            else:
                dead = {r.value for r in recs if r.kind is RecordKind.BLOCK_DEAD}
                ok = all(o in dead for o in range(off, off + n, SLOT))
            if not ok:
                self.bad.append((off, n))

    chk = Check()
    s.engine.add_observer(chk)
    for a in range(0, 15 * 10, 5):
        put(s, lis, range(a, a + 5))
    s.delete([key(149), key(148)])
    put(s, lis, range(1000, 1005))
    assert s.stats()["trim_ranges"] > 0 and s.stats()["segments_reset"] > 0
    assert chk.bad == []


def test_trim_waits_for_a_read_in_flight():
    s, lis, log = memory_store()
    budget = s.capacity_blocks()
    for a in range(0, budget, 5):
        put(s, lis, range(a, a + 5))
    si, off0 = s.locate(key(0))
    s._segs.readers[si] += 1  # a get pinned the segment before the eviction
    put(s, lis, range(1000, 1005))
    assert lis.picked == [key(i) for i in range(5)] and log.trims == []
    assert s.stats()["dead_pending_bytes"] == 5 * SLOT
    s._segs.readers[si] -= 1
    put(s, lis, [1005])  # the next flush trims them
    assert (off0, 5 * SLOT) in log.trims


class _BlockMachine(RuleBasedStateMachine):
    evicted = 0
    """put / hit / protect / delete / get / reopen (trims real or ignored) on a file store in
    block mode, compaction forced; invariants and the live budget after every step, and a
    reopen brings back exactly the blocks that were live."""

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="blk-")
        self.path = os.path.join(self.dir, "tier.bin")
        self.lis = LruListener()
        self.s = self._open(False)
        self.next = 0

    def _open(self, ignore):
        s = _file_store(self.path, self.lis, live_fraction=0.15)  # a budget of 31 blocks: evictions soon
        if ignore:
            _ignore_trims(s)
        s._blk.journal.should_compact = lambda *a, **k: True  # compaction at every check
        s._blk._compact_check_bytes = 0
        return s

    @rule(n=st.integers(1, 30))
    def put_blocks(self, n):
        ids = range(self.next, self.next + n)
        self.next += n
        st_ = put(self.s, self.lis, ids)
        assert Status.IO_ERROR not in st_
        assert len(self.s) <= self.s.capacity_blocks()

    @rule(i=st.integers(0, 400))
    def hit(self, i):
        if self.s.contains(key(i)):
            self.lis.track([key(i)])

    @rule(i=st.integers(0, 400))
    def protect(self, i):
        if len(self.lis.protected) < 5:
            self.lis.protected.add(key(i))

    @rule(i=st.integers(0, 400))
    def delete(self, i):
        self.s.delete([key(i)])
        self.lis.order.pop(key(i), None)

    @rule(i=st.integers(0, 400))
    def get(self, i):
        d = torch.empty(BB, dtype=torch.uint8)
        st_ = self.s.get([key(i)], [d])[0]
        assert st_ is (Status.OK if self.s.contains(key(i)) else Status.MISS) or st_ is Status.MISS
        if st_ is Status.OK:
            assert torch.equal(d, block(key(i)))

    @rule(ignore=st.booleans())
    def reopen(self, ignore):
        live = set(self.s.keys())
        self.s.close()
        self.s = self._open(ignore)
        assert set(self.s.keys()) == live
        self.lis.order = collections.OrderedDict((k, None) for k in self.lis.order if k in live)

    @invariant()
    def consistent(self):
        self.s.check_invariants()

    def teardown(self):
        _BlockMachine.evicted += self.s.stats()["block_evictions"]
        self.s.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def test_accounting_invariants_stateful():
    run_state_machine_as_test(
        _BlockMachine,
        settings=settings(
            max_examples=12, stateful_step_count=40, deadline=None, suppress_health_check=list(HealthCheck)
        ),
    )
    assert _BlockMachine.evicted > 0


@pytest.mark.parametrize("given", ["name", "engine object"])
def test_refused_target_gets_no_journal_beside_it(tmp_path, given):
    from tierstore.errors import ForeignDataError

    path = tmp_path / "user.bin"
    path.write_bytes(b"a user's data" * (CAP // 13 + 1))
    before = path.read_bytes()
    eng = open_engine("posix", str(path), CAP) if given == "engine object" else "posix"
    with pytest.raises(ForeignDataError):
        SegmentStorage(
            str(path),
            CAP,
            BB,
            segment_size_bytes=SEG,
            engine=eng,
            label=True,
            eviction_granularity="block",
            listener=LruListener(),
        )
    if given == "engine object":
        eng.close()
    assert not os.path.exists(str(path) + ".journal") and path.read_bytes() == before


# ---------------------------------------------------------------- the journal is the tier's own (trial29)
def test_a_users_file_named_like_the_journals_tmp_is_never_deleted(tmp_path):
    """Found by a fresh-user trial: opening a block-mode tier deleted ``<journal>.tmp`` whatever it
    held. A file tierstore did not write is refused and left as it is."""
    path = tmp_path / "tier.bin"
    tmp = tmp_path / "tier.bin.journal.tmp"
    mine = os.urandom(5000)
    tmp.write_bytes(mine)
    with pytest.raises(ForeignDataError, match="not a journal tierstore was writing"):
        _file_store(path, LruListener())
    assert tmp.read_bytes() == mine
    tmp.unlink()
    s = _file_store(path, LruListener())  # once it is moved, the tier opens
    s.close()
    # a .tmp tierstore left (a crash before its rename) is still cleaned up
    j = tmp_path / "other.journal"
    tmp2 = tmp_path / "other.journal.tmp"
    tmp2.write_bytes(b"TSJOURN1" + bytes(56))
    Journal(str(j)).close()
    assert not tmp2.exists() and j.exists()


def test_another_tiers_journal_is_refused_and_drops_nothing(tmp_path):
    """Found by a fresh-user trial: tier B opened with tier A's journal_path silently lost every
    block (A's segment resets marked B's segments stale, and they were trimmed)."""
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    la, lb = LruListener(), LruListener()
    sa = _file_store(a, la)
    put(sa, la, range(0, 10))
    sa.close()
    sb = _file_store(b, lb)
    put(sb, lb, range(100, 110))
    kept = set(sb.keys())
    sb.close()
    before = (tmp_path / "a.bin.journal").read_bytes()
    with pytest.raises(ForeignDataError, match="journal of another tier"):
        _file_store(b, LruListener(), journal_path=str(tmp_path / "a.bin.journal"))
    assert (tmp_path / "a.bin.journal").read_bytes() == before
    with pytest.raises(ForeignDataError, match="journal of another tier"):  # region mode reads it too
        SegmentStorage(
            str(b),
            CAP,
            BB,
            segment_size_bytes=SEG,
            engine="posix",
            extent_size_bytes=SEG,
            journal_path=str(tmp_path / "a.bin.journal"),
        )
    sb = _file_store(b, LruListener())
    assert set(sb.keys()) == kept
    sb.close()


def test_one_journal_one_open_tier(tmp_path):
    """Two tiers given one journal_path (trial29: both appended to it): the second is refused."""
    j = str(tmp_path / "shared.journal")
    s1 = _file_store(tmp_path / "one.bin", LruListener(), journal_path=j)
    try:
        with pytest.raises(ForeignDataError, match="journal of another tier"):
            _file_store(tmp_path / "two.bin", LruListener(), journal_path=j)
        with pytest.raises(StoreLockedError, match="journal is in use"):  # an id-less opener too
            Journal(j)
    finally:
        s1.close()
    Journal(j).close()  # the lock goes with the tier


@pytest.mark.parametrize("bad", ["", "DIR", "SELF"])
def test_a_journal_path_that_is_no_file_of_its_own_is_a_config_error(tmp_path, bad):
    path = tmp_path / "tier.bin"
    jp = {"": "", "DIR": str(tmp_path), "SELF": str(path)}[bad]
    with pytest.raises(ConfigError, match="journal_path"):
        _file_store(path, LruListener(), journal_path=jp)
    assert not os.path.exists(".tmp") or bad != ""
