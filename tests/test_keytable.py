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
from tierstore.keytable import FIND_VECTOR_MIN_KEYS, VECTOR_MIN_KEYS, KeyTable


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


def test_short_and_vectorised_lookups_agree_through_tombstones_collisions_and_a_rehash():
    """The scalar probe of short batches and the vectorised one answer alike, key by key, in
    every state: tombstones in chains, keys sharing a home slot, and an old array mid-move."""
    with mock.patch.object(keytable, "REHASH_BATCH_SLOTS", 64):
        t = KeyTable(16)
        keys = _keys(1200, seed=5)
        twins = [keys[0][:8] + os.urandom(24) for _ in range(30)]  # one home slot: long chains
        for i, k in enumerate(twins[:15] + keys[:800]):
            t.add(k)
            if i >= 500 and t.rehashing:
                break  # stop with an old array still being moved
        for k in keys[:800:3]:
            t.remove(k)
        q = keys[:900] + twins
        want = [t.get(k) for k in q]
        for n in (1, 7, FIND_VECTOR_MIN_KEYS - 1, FIND_VECTOR_MIN_KEYS, 64, 200):
            got = [r for i in range(0, len(q), n) for r in t.get_many(q[i : i + n]).tolist()]
            assert got == want, n
        assert t.rehashing
        assert any(r >= 0 for r in want[-30:]) and any(r < 0 for r in want)
    with pytest.raises(LayoutError):  # a short batch the vectorised probe took before refuses the same way
        t.get_many([b"x" * 31] * VECTOR_MIN_KEYS)
    assert t.get_many([b"x" * 31]).tolist() == [-1]


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
    """Growth extends ``_keys``/``_held`` (no second buffer held beside the old one: that
    doubled the peak memory of a growth) and every key keeps its row."""
    t = KeyTable(16)
    keys_buf, live_buf = t._keys, t._held
    ks = [bytes([i % 256, i // 256]) * 16 for i in range(300)]
    rows = [t.add(k)[0] for k in ks[:100]] + t.add_absent(ks[100:]).tolist()
    assert t.capacity_rows > 16 and t._keys is keys_buf and t._held is live_buf
    assert len(t._keys) == 32 * t.capacity_rows and len(t._held) == t.capacity_rows
    assert [t.get(k) for k in ks] == rows and t.keys_of(rows) == ks


# ------------------------------------------------------------------ two holders (one table)
from tierstore.keytable import INDEX, LOCATOR, HeldKeys  # noqa: E402

_HOLDERS = (INDEX, LOCATOR)


def test_a_key_held_by_both_sides_stays_until_both_let_go():
    """One row per key for both holders: the locator's row is adopted by the index, the slot
    stays while either holds it, and the row is reused only after both let go."""
    t = KeyTable(64)
    k = os.urandom(32)
    r, new = t.add(k, LOCATOR)
    assert new and t.add(k, INDEX) == (r, True) and t.add(k, INDEX) == (r, False)
    assert len(t) == 1 and t.held_count(INDEX) == t.held_count(LOCATOR) == 1
    assert t.remove(k, holder=LOCATOR) == r
    assert t.get(k, LOCATOR) == -1 and t.get(k, INDEX) == r and len(t) == 1
    assert t.add(os.urandom(32), LOCATOR)[0] != r  # the row is still the index's
    assert t.remove(k, holder=INDEX) == r and t.get(k, INDEX) == -1 and len(t) == 1
    assert t.add(os.urandom(32), INDEX)[0] == r  # both let go: the row is free again
    # batches: the index adopts the locator's rows (vectorised), one slot per key
    keys = _keys(200, seed=3)
    rows = t.add_absent(keys, LOCATOR)
    assert t.add_absent(keys, INDEX).tolist() == rows.tolist() and len(t) == 202
    assert t.get_many(keys, INDEX).tolist() == t.get_many(keys, LOCATOR).tolist() == rows.tolist()


def test_a_key_on_nvme_only_is_a_miss_for_the_index_until_adopted():
    t = KeyTable(64)
    idx, loc = HeldKeys(t, INDEX, owner=False), HeldKeys(t, LOCATOR, owner=True)
    keys = _keys(40, seed=4)
    rows = loc.add_absent(keys)
    assert idx.get(keys[0]) == -1 and (idx.get_many(keys) == -1).all() and idx.rows().size == 0
    assert len(idx) == 0 and len(loc) == 40 and not idx.live_mask(rows).any() and loc.live_mask(rows).all()
    assert idx.add(keys[0]) == (int(rows[0]), True) and idx.get(keys[0]) == rows[0]
    # the owner counts the table; each side its ordinals (4 B a row: HeldKeys' order)
    assert idx.nbytes == 4 * t.capacity_rows and loc.nbytes == t.nbytes + 4 * t.capacity_rows
    with pytest.raises(ValueError):
        HeldKeys(t, 4, owner=False)


def test_a_row_the_index_detached_stays_reserved_while_the_locator_keeps_its_key():
    """A doomed index row (in use) keeps its row; a new store of the key takes another row
    (two slots for one key, one per holder); the row is freed when both let go."""
    t = KeyTable(64)
    k = os.urandom(32)
    r, _ = t.add(k, INDEX)
    assert t.add(k, LOCATOR) == (r, True)
    assert t.detach(k, INDEX) == r and t.get(k, INDEX) == -1 and t.get(k, LOCATOR) == r
    r2, new = t.add(k, INDEX)
    assert new and r2 != r and t.get(k, INDEX) == r2 and t.get(k, LOCATOR) == r and len(t) == 2
    assert t.get_many([k] * 20, INDEX).tolist() == [r2] * 20
    assert t.get_many([k] * 20, LOCATOR).tolist() == [r] * 20
    assert t.remove(k, holder=LOCATOR) == r and len(t) == 1
    assert t.add(os.urandom(32), LOCATOR)[0] not in (r, r2)  # r is still reserved
    t.release_row(r, INDEX)
    assert t.add(os.urandom(32), LOCATOR)[0] == r  # now free
    assert t.drop_holder(INDEX) == 1 and t.get(k, INDEX) == -1 and t.held_count(INDEX) == 0
    r3, _ = t.add(k, LOCATOR)
    t.reserve(1000)  # a second holder's capacity: exactly, keys kept
    assert t.capacity_rows == 1000 and t.get(k, LOCATOR) == r3 and t.add(k, INDEX) == (r3, True)


_holder_ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "add_absent", "add_absent", "remove", "detach", "release"]),
        st.sampled_from(_HOLDERS),
        st.integers(0, 599),
    ),
    min_size=10,
    max_size=120,
)


@settings(max_examples=15, deadline=None)
@given(_holder_ops)
def test_two_holders_agree_with_a_model_through_rehashes(ops):
    """Every holder operation against a model (held keys and reserved rows per holder), on a
    table small enough that inserts rehash and grow it: a holder finds exactly its keys, a
    key both hold has one row, a reserved row is never handed out."""
    pool = _keys(600, seed=11)
    with mock.patch.object(keytable, "REHASH_BATCH_SLOTS", 64):  # small steps: many mid-move states
        t = _two_holder_run(ops, pool)
    for h in _HOLDERS:
        assert t.get_many(pool, h).tolist() == [t.get(k, h) for k in pool]
    assert t.full_rebuilds == 0


def _two_holder_run(ops, pool):
    """The ops through each holder's HeldKeys, checked against the model; and each holder's
    order (its ordinals) against a table of its own fed the same ops (main's row numbers)."""
    t = KeyTable(16)
    side = {h: HeldKeys(t, h, owner=h == LOCATOR) for h in _HOLDERS}
    own = {h: KeyTable(16) for h in _HOLDERS}  # a table of the holder's own: the order to keep
    own_reserved: dict[int, dict[int, int]] = {INDEX: {}, LOCATOR: {}}  # shared row -> own row
    held: dict[int, dict[bytes, int]] = {INDEX: {}, LOCATOR: {}}
    reserved: dict[int, set[int]] = {INDEX: set(), LOCATOR: set()}
    for op, h, i in ops:
        other = LOCATOR if h == INDEX else INDEX
        hk = side[h]
        if op in ("add", "add_absent"):
            if op == "add":
                batch = [pool[i]]
                rows = [hk.add(pool[i])[0]]
                own[h].add(pool[i])
            else:
                batch = [k for k in pool[i:] + pool[:i] if k not in held[h]][: VECTOR_MIN_KEYS + i % 100]
                rows = hk.add_absent(batch).tolist()
                own[h].add_absent(batch)
            used = (
                set(held[INDEX].values()) | set(held[LOCATOR].values()) | reserved[INDEX] | reserved[LOCATOR]
            )
            for k, row in zip(batch, rows):
                if k in held[h]:
                    assert row == held[h][k]
                elif k in held[other] and held[other][k] not in reserved[h]:
                    assert row == held[other][k]  # adopted
                else:
                    assert row not in used  # a fresh or freed row
                held[h][k] = row
        elif op in ("remove", "detach"):
            row = hk.remove(pool[i], free_row=op == "remove")
            assert row == held[h].pop(pool[i], -1)
            own_row = own[h].remove(pool[i], free_row=op == "remove")
            if op == "detach" and row >= 0:
                reserved[h].add(row)
                own_reserved[h][row] = own_row
        elif reserved[h]:
            row = min(reserved[h])
            reserved[h].discard(row)
            hk.release_row(row)
            own[h].release_row(own_reserved[h].pop(row))
        for hh in _HOLDERS:
            assert t.get_many(pool, hh).tolist() == [held[hh].get(k, -1) for k in pool]
            for sub in (pool[:5], pool[5 : 4 + FIND_VECTOR_MIN_KEYS], pool[40 : 40 + FIND_VECTOR_MIN_KEYS]):
                assert t.get_many(sub, hh).tolist() == [held[hh].get(k, -1) for k in sub]  # both probes
            assert t.held_count(hh) == len(held[hh])
        assert len(t) == len({(k, r) for hh in _HOLDERS for k, r in held[hh].items()})
    for hh in _HOLDERS:
        assert sorted(t.rows(hh).tolist()) == sorted(held[hh].values())
        assert all(t.key_of(r) == k for k, r in held[hh].items())
        # the holder's order is its own table's: the same keys in the same order, ordinals = rows
        assert t.keys_of(side[hh].rows().tolist()) == own[hh].keys_of(own[hh].rows().tolist())
        assert all(int(side[hh]._ord[r]) == own[hh].get(k) for k, r in held[hh].items())
        assert all(int(side[hh]._ord[r]) == own_reserved[hh][r] for r in reserved[hh])
        for sub in (side[hh].held_rows()[::2], side[hh].held_rows()[:3]):  # a scatter, a sort
            assert t.keys_of(side[hh].in_order(sub).tolist()) == sorted(
                t.keys_of(sub.tolist()), key=own[hh].get
            )
    return t
