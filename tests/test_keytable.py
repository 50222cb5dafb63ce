"""KeyTable against a dict model: every operation sequence agrees."""

import os
import random
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierstore import keytable
from tierstore.errors import LayoutError
from tierstore.keytable import VECTOR_MIN_KEYS, KeyTable


def _keys(n, seed=0):
    rng = random.Random(seed)
    return [rng.randbytes(32) for _ in range(n)]


def test_add_get_remove_and_row_reuse():
    t = KeyTable(16)
    keys = _keys(1000)
    rows = {}
    for k in keys:
        r, new = t.add(k)
        assert new and r not in rows.values()
        rows[k] = r
    assert len(t) == 1000 and t.capacity_rows >= 1000
    assert all(t.get(k) == r for k, r in rows.items())
    assert t.add(keys[5]) == (rows[keys[5]], False)
    for k in keys[::2]:
        assert t.remove(k) == rows.pop(k)
        assert t.get(k) == -1 and t.remove(k) == -1
    assert len(t) == 500
    r, new = t.add(os.urandom(32))
    assert new and r in set(range(1000)) - set(rows.values())  # a freed row is reused
    assert all(t.get(k) == r for k, r in rows.items())
    assert sorted(t.rows().tolist()) == sorted(list(rows.values()) + [r])
    assert t.key_of(rows[keys[1]]) == keys[1]


def test_get_many_matches_scalar_with_absent_keys_and_collisions():
    t = KeyTable(64)
    keys = _keys(3000, seed=1)
    for k in keys[:2000]:
        t.add(k)
    for k in keys[:2000:3]:
        t.remove(k)  # tombstones in probe chains
    # keys sharing their first 8 bytes collide on the home slot: the full key decides
    twins = [keys[0][:8] + os.urandom(24) for _ in range(40)]
    for k in twins[:20]:
        t.add(k)
    q = keys[:2500] + twins
    got = t.get_many(q)
    assert got.dtype == np.int64 and len(q) >= VECTOR_MIN_KEYS
    assert got.tolist() == [t.get(k) for k in q]
    assert (got[:2000:3] == -1).all() and (got[2000:2500] == -1).all() and (got[-20:] == -1).all()
    assert (got[-40:-20] >= 0).all()


def test_malformed_keys_are_refused():
    t = KeyTable()
    with pytest.raises(LayoutError):
        t.add(b"short")
    with pytest.raises(LayoutError):  # before the good key before it is inserted
        t.add_many([b"k" * 32, b"x" * 33])
    with pytest.raises(LayoutError):
        t.add_absent([b"k" * 32, b"x" * 31])
    assert len(t) == 0 and t.get(b"k" * 32) == -1
    with pytest.raises(LayoutError):
        t.get_many([b"x" * 31] * VECTOR_MIN_KEYS)


def test_memory_per_key_is_compact():
    n = 200_000
    t = KeyTable(n)
    for k in _keys(n, seed=2):
        t.add(k)
    assert t.nbytes / n <= 64, t.nbytes / n


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["add", "remove", "get"]), st.integers(0, 59)), max_size=300))
def test_agrees_with_a_dict(ops):
    pool = _keys(60, seed=3)
    t = KeyTable(16)
    model: dict = {}
    for op, i in ops:
        k = pool[i]
        if op == "add":
            r, new = t.add(k)
            assert new == (k not in model)
            if new:
                assert r not in model.values()
                model[k] = r
            else:
                assert model[k] == r
        elif op == "remove":
            assert t.remove(k) == model.pop(k, -1)
        else:
            assert t.get(k) == model.get(k, -1)
    assert len(t) == len(model)
    assert t.get_many(pool).tolist() == [model.get(k, -1) for k in pool]


@pytest.mark.parametrize("cap", [16, 4096])
def test_add_absent_places_every_key_like_add(cap):
    """Batch inserts (home slots taken, tombstones reused, duplicate homes,
    a rebuild mid-batch) leave the table as scalar adds would: every key
    found at its row, no row shared, removed keys gone."""
    t = KeyTable(cap)
    keys = _keys(5000, seed=7)
    old = keys[:1000]
    for k in old:
        t.add(k)
    for k in old[::2]:
        t.remove(k)  # tombstones, and free rows to reuse
    twins = [old[1][:8] + os.urandom(24) for _ in range(30)]  # same home slot as a live key
    batches = [keys[1000 + i : 1000 + i + 700] for i in range(0, 4000, 700)] + [twins]
    model = {k: t.get(k) for k in old[1::2]}
    for b in batches:
        rows = t.add_absent(b)
        assert rows.dtype == np.int64 and len(set(rows.tolist())) == len(b)
        model.update(zip(b, rows.tolist()))
    assert len(set(model.values())) == len(model) == len(t)
    q = list(model) + old[::2]
    assert t.get_many(q).tolist() == [model.get(k, -1) for k in q]
    assert [t.get(k) for k in q] == [model.get(k, -1) for k in q]
    assert all(t.key_of(r) == k for k, r in model.items())
    with pytest.raises(LayoutError):
        t.add_absent([b"x" * 33] * VECTOR_MIN_KEYS)


def test_ghost_keys_take_and_bound():
    from tierstore.keytable import GhostKeys

    g = GhostKeys(2)
    for k in (b"a" * 32, b"b" * 32, b"c" * 32):
        g.add(k)
    assert len(g) == 2
    assert not g.take(b"a" * 32)  # the oldest went when the third came
    assert g.take(b"b" * 32) and not g.take(b"b" * 32)  # taken once, then forgotten
    assert g.take(b"c" * 32) and len(g) == 0


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(
                ["add", "add_absent", "add_absent", "add_many", "remove", "detach", "release", "get_many"]
            ),
            st.integers(0, 599),
        ),
        min_size=10,
        max_size=250,
    )
)
def test_agrees_with_a_dict_through_rehashes(ops):
    """Random inserts (scalar and batched), removals, detached rows and batched lookups on a
    small table, so most sequences run through one or more incremental rehashes: every
    lookup agrees with a dict, a detached row is not reused until released, and rows
    stay distinct."""
    pool = _keys(600, seed=11)
    with mock.patch.object(keytable, "REHASH_BATCH_SLOTS", 64):  # small steps: many mid-move states
        _dict_model_run(ops, pool)


def _dict_model_run(ops, pool):
    t = KeyTable(16)
    model: dict = {}
    detached: list = []
    for op, i in ops:
        if op == "add":
            k = pool[i]
            r, new = t.add(k)
            assert new == (k not in model) and (new or model[k] == r)
            model[k] = r
        elif op == "add_absent":  # a batch of absent keys, long enough for the vectorised path
            batch = [k for k in pool[i:] + pool[:i] if k not in model][: VECTOR_MIN_KEYS + i % 100]
            rows = t.add_absent(batch)
            model.update(zip(batch, rows.tolist()))
        elif op == "add_many":  # present keys, absent ones and one given twice, in one call
            batch = pool[i : i + 1 + i % 90] + pool[i : i + 1]
            rows, inserted = t.add_many(batch)
            want = []
            for j, k in enumerate(batch):
                if k not in model:
                    want.append(j)
                    model[k] = rows[j]
                assert rows[j] == model[k]
            assert inserted == want
        elif op in ("remove", "detach"):
            k = pool[i]
            r = t.remove(k) if op == "remove" else t.detach(k)
            assert r == model.pop(k, -1)
            if op == "detach" and r >= 0:
                detached.append(r)
        elif op == "release" and detached:
            t.release_row(detached.pop())
        else:
            assert t.get_many(pool).tolist() == [model.get(k, -1) for k in pool]
        assert len(set(model.values())) == len(model) == len(t)
        assert not set(detached) & set(model.values())
    assert t.get_many(pool).tolist() == [model.get(k, -1) for k in pool]
    assert [t.get(k) for k in pool] == [model.get(k, -1) for k in pool]
    assert all(t.key_of(r) == k for k, r in model.items())
    assert t.full_rebuilds == 0


def test_lookups_during_a_rehash_find_both_arrays():
    """Mid-rehash (some keys moved, some not): scalar and vectorised lookups and removals
    find keys in either array, and the rehash ends with every key in the new one."""
    t = KeyTable(4096)  # 4096 slots: 2048 keys fill half
    keys = _keys(6000, seed=12)
    t.add_absent(keys[:2048])
    assert not t.rehashing
    t.add_absent(keys[2048:2112])  # passes half: a rehash starts and moves one step
    assert t.rehashing and 0 < t.rehash_slots < 4096
    model = {k: t.get(k) for k in keys[:2112]}
    assert all(r >= 0 for r in model.values())
    assert t.get_many(keys[:2500]).tolist() == [model.get(k, -1) for k in keys[:2500]]
    for k in keys[:2112:5]:  # in both arrays
        assert t.remove(k) == model.pop(k)
    for k in keys[2112:2200]:
        model[k] = t.add(k)[0]
    assert t.get_many(keys[:2500]).tolist() == [model.get(k, -1) for k in keys[:2500]]
    i = 2200
    while t.rehashing:
        model[keys[i]] = t.add(keys[i])[0]
        i += 1
    assert t.get_many(list(model)).tolist() == list(model.values())
    assert [t.get(k) for k in keys[:i]] == [model.get(k, -1) for k in keys[:i]]
    assert t.full_rebuilds == 0


def test_an_insert_moves_a_bounded_number_of_slots():
    """Counted, not timed: growing from 16 rows to 60k keys (several rehashes, the last of
    a 128k-slot array) with removals mixed in, no single add, batch add or removal moves
    more than REHASH_BATCH_SLOTS + REHASH_SLOTS_PER_KEY * keys inserted old slots, and
    no call lays the whole table out."""
    from tierstore.keytable import REHASH_BATCH_SLOTS, REHASH_SLOTS_PER_KEY

    t = KeyTable(16)
    keys = _keys(60_000, seed=13)
    worst = 0
    rehashes = 0
    j = 0
    for i in range(0, len(keys), 64):
        before, was = t.rehash_slots, t.rehashing
        if i % 128:
            t.add_absent(keys[i : i + 64])
            bound = REHASH_BATCH_SLOTS + REHASH_SLOTS_PER_KEY * 64
        else:
            t.add(keys[i])
            t.add_absent(keys[i + 1 : i + 64])  # not counted: only the scalar add's step below
            assert t.rehash_slots - before <= REHASH_BATCH_SLOTS + REHASH_SLOTS_PER_KEY * 64
            before, bound = t.rehash_slots, 0
            t.remove(keys[j])  # a removal moves nothing
            j += 3
        worst = max(worst, t.rehash_slots - before)
        rehashes += t.rehashing and not was
        assert t.rehash_slots - before <= bound
    assert rehashes >= 5 and t.full_rebuilds == 0 and worst >= REHASH_BATCH_SLOTS
    assert t.get_many(keys[j + 3 :: 7]).min() >= 0


def test_a_probe_off_the_tail_lays_the_table_out_again():
    """Keys whose home is the last slot of the power-of-two range fill the tail: the insert
    that finds no slot lays the whole table out again (counted), and every key stays found."""
    from tierstore.keytable import TAIL_SLOTS

    t = KeyTable(4096)
    twins = [b"\xff" * 8 + os.urandom(24) for _ in range(TAIL_SLOTS + 8)]
    rows = [t.add(k)[0] for k in twins]
    assert t.full_rebuilds >= 1
    assert t.get_many(twins).tolist() == rows == [t.get(k) for k in twins]


def test_row_growth_extends_the_key_buffer_in_place_and_keeps_every_key():
    """Growth extends ``_keys``/``_live`` (no second buffer held beside the old one: that
    doubled the peak memory of a growth) and every key keeps its row."""
    t = KeyTable(16)
    keys_buf, live_buf = t._keys, t._live
    ks = [bytes([i % 256, i // 256]) * 16 for i in range(300)]
    rows = [t.add(k)[0] for k in ks[:100]] + t.add_absent(ks[100:]).tolist()
    assert t.capacity_rows > 16 and t._keys is keys_buf and t._live is live_buf
    assert len(t._keys) == 32 * t.capacity_rows and len(t._live) == t.capacity_rows
    assert [t.get(k) for k in ks] == rows and t.keys_of(rows) == ks
