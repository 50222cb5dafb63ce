"""KeyTable against a dict model: every operation sequence agrees."""

import os
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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
