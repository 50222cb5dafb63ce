"""RemoteKVStore has KVStore's signatures for what it offers, the fragment API, and refuses token ids
where keys are expected before any request (issue 19, item 14, client side)."""

from __future__ import annotations

import concurrent.futures
import inspect

import numpy as np
import pytest
import torch

from tierstore import Namespace
from tierstore.api import KVStore, KVStoreProtocol, leading_ok
from tierstore.client import RemoteKVStore
from tierstore.errors import ConfigError, LayoutError, Status
from tierstore.io import KVPagePool

from .conftest import TOKENS
from .helpers import block_for


def _protocol_methods() -> list[str]:
    return sorted(n for n, m in vars(KVStoreProtocol).items() if not n.startswith("_") and callable(m))


def test_signatures_match_kvstore():
    """Both implement the shared typed interface (KVStoreProtocol) with the same signatures
    (prefetch took other arguments; store_fragments/load_fragments were missing)."""
    local, remote = dict(inspect.getmembers(KVStore)), dict(inspect.getmembers(RemoteKVStore))
    names = _protocol_methods()
    assert len(names) >= 20 and not [n for n in names if n not in remote], "the client lacks protocol methods"
    for name in names:
        want = [
            (p.name, p.kind, p.default)
            for p in inspect.signature(getattr(KVStoreProtocol, name)).parameters.values()
        ]
        for impl in (local, remote):
            got = [(p.name, p.kind, p.default) for p in inspect.signature(impl[name]).parameters.values()]
            pos = [p for p in got if p[1] is not inspect.Parameter.KEYWORD_ONLY]
            assert pos == [p for p in want if p[1] is not inspect.Parameter.KEYWORD_ONLY], (
                name,
                impl is remote,
            )
            kw = {p for p in got if p[1] is inspect.Parameter.KEYWORD_ONLY}
            want_kw = {p for p in want if p[1] is inspect.Parameter.KEYWORD_ONLY}
            assert want_kw <= kw, (name, impl is remote, want_kw - kw)
            # an implementation may add keyword-only options with defaults, nothing else
            assert all(p[2] is not inspect.Parameter.empty for p in kw - want_kw), (name, kw - want_kw)


@pytest.fixture
def client(daemon):
    with RemoteKVStore(daemon.url, TOKENS["acme"]) as c:
        yield c


def _pool(c, num_blocks: int, seed: int) -> torch.Tensor:
    """A vLLM-like pool (layers, 2, blocks, tokens, heads, dim) of the daemon's layout."""
    lay = c.layout
    g = torch.Generator().manual_seed(seed)
    return torch.randn((lay.num_layers, 2, num_blocks) + lay.fragment_shape, generator=g).to(lay.dtype)


def test_fragments_round_trip_through_the_daemon(client):
    c = client
    ns = Namespace(model="fragments")
    toks = list(range(3 * c.layout.tokens_per_block + 5))
    src = _pool(c, 5, seed=1)
    pages = KVPagePool(src)
    assert c.store_fragments(ns, toks, pages.plans([4, 0, 2])) == [Status.OK] * 3
    hit = c.lookup(ns, toks)
    assert hit.matched_blocks == 3
    dst = torch.zeros_like(src)
    st = c.load_fragments(hit, KVPagePool(dst).plans([1, 3, 0], destination=True))
    assert leading_ok(st) == 3
    for d, s in ((1, 4), (3, 0), (0, 2)):
        assert torch.equal(dst[:, :, d], src[:, :, s])
    assert torch.count_nonzero(dst[:, :, 2]) == 0  # untouched
    # per-fragment lists (not views of one pool), and wait=False futures
    frags = [[src[layer, kv, 1].clone() for layer in range(c.layout.num_layers) for kv in (0, 1)]]
    toks2 = list(range(100, 100 + c.layout.tokens_per_block))
    fut = c.store_fragments(ns, toks2, frags, wait=False)
    assert isinstance(fut, concurrent.futures.Future) and fut.result(30) == [Status.OK]
    out = [[torch.empty_like(f) for f in frags[0]]]
    fut = c.load_fragments(c.keys_for(ns, toks2), out, wait=False)
    assert fut.result(30) == [Status.OK]
    assert all(torch.equal(a, b) for a, b in zip(out[0], frags[0]))
    # a miss leaves its destination untouched
    keep = [torch.full_like(f, 7) for f in frags[0]]
    assert c.load_fragments(c.keys_for(Namespace(model="absent"), toks2), [keep]) == [Status.MISS]
    assert all(int((k == 7).all()) for k in keep)
    with pytest.raises(LayoutError, match="fragments"):
        c.store_fragments(ns, toks2, [frags[0][:-1]])


def test_prefetch_has_kvstores_signature(client):
    c = client
    ns = Namespace(model="prefetch-sig")
    toks = list(range(2 * c.layout.tokens_per_block))
    c.store(ns, toks, torch.stack([block_for(k, c.block_bytes) for k in c.keys_for(ns, toks)]))
    fut = c.prefetch(ns, toks, tier="host")
    assert isinstance(fut, concurrent.futures.Future) and fut.result(30) >= 0
    with pytest.raises(ConfigError, match="tier='hbm'"):
        c.prefetch(ns, toks, tier="hbm")


def test_token_ids_where_keys_are_expected_fail_before_any_request(client, monkeypatch):
    """Token ids became zero-filled keys: a 413 with 99 tokens, a 400 with fewer."""
    c = client
    ns = Namespace(model="misuse")

    async def no_request(*a, **k):
        raise AssertionError("a request was sent")

    monkeypatch.setattr(c._wire, "send", no_request)
    toks99 = list(range(99))
    for call in (
        lambda: c.load(toks99, ns=ns),
        lambda: c.load(np.arange(5), ns=ns),
        lambda: c.exists(toks99, ns=ns),
        lambda: c.lookup_keys(toks99[:3], ns=ns),
        lambda: c.store_keys(ns, [1, 2], torch.zeros(2, c.block_bytes, dtype=torch.uint8)),
        lambda: c.load_fragments(toks99[:1], [[]], ns=ns),
    ):
        with pytest.raises(LayoutError, match="token ids"):
            call()
    keys = c.keys_for(ns, list(range(c.layout.tokens_per_block)))
    with pytest.raises(LayoutError, match="block keys"):
        c.lookup(ns, keys)  # and the other way round
    with pytest.raises(LayoutError, match="block keys"):
        c.prefetch(ns, keys)


def test_key_level_calls_match_kvstore(client):
    c = client
    ns = Namespace(model="key-level")
    toks = list(range(4 * c.layout.tokens_per_block))
    keys = c.keys_for(ns, toks)
    blocks = torch.stack([block_for(k, c.block_bytes) for k in keys])
    fut = c.store_keys(ns, keys, blocks, first_position=0, wait=False)
    assert fut.result(30) == [Status.OK] * 4
    assert c.exists(keys) == 4 and c.exists(keys, ns=ns) == 4
    res = c.lookup_keys(keys[:3])
    assert res.matched_blocks == 3
    st, outs = c.load(keys, wait=False).result(30)
    assert leading_ok(st) == 4 and all(torch.equal(c.layout.as_bytes(o), b) for o, b in zip(outs, blocks))


def test_what_the_client_does_not_offer_is_listed_and_documented():
    """Until the remote client has a method, the docs say so: NOT_OFFERED is exactly KVStore's public
    methods and properties that RemoteKVStore lacks, and the README and the client's docstring name each."""
    import pathlib

    import tierstore.client as client_mod
    from tierstore.client import NOT_OFFERED

    lacking = {
        n for n in dir(KVStore) if not n.startswith("_") and n.islower() and not hasattr(RemoteKVStore, n)
    }
    listed = [n for names in NOT_OFFERED.values() for n in names]
    assert len(listed) == len(set(listed))
    assert set(listed) == lacking, (
        f"offered now, drop from NOT_OFFERED: {sorted(set(listed) - lacking)}; "
        f"missing remotely, add to NOT_OFFERED and the READMEs: {sorted(lacking - set(listed))}"
    )
    root = pathlib.Path(__file__).resolve().parents[2]
    readme = (root / "README.md").read_text()
    daemon = readme[readme.index("## The daemon") : readme.index("## Benchmarks and results")]
    for name in listed:
        assert f"`{name}`" in daemon, name
        assert f"``{name}``" in client_mod.__doc__, name
    assert "tierstore.client.NOT_OFFERED" in (root / "tierstore" / "server" / "README.md").read_text()


def test_a_client_never_closed_leaves_no_warnings_at_exit(daemon):
    """Fresh-user trial: a script that used RemoteKVStore without close() printed aiohttp's
    'Unclosed client session' / 'Unclosed connector' at exit."""
    import subprocess
    import sys

    from .conftest import ROOT

    code = (
        "from tierstore.client import RemoteKVStore\n"
        f"c = RemoteKVStore({daemon.url!r}, {TOKENS['acme']!r})\n"
        "print(c.stats()['block_bytes'] > 0)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr[-2000:]
    assert "Unclosed" not in r.stderr, r.stderr[-2000:]


def test_a_client_dropped_without_close_leaves_no_warnings_and_no_thread(daemon):
    """Fresh-user trial 11: a RemoteKVStore made in a function and dropped without close() printed
    aiohttp's 'Unclosed client session' when it was collected (the exit hook closes only the live
    ones), and its loop thread ran on."""
    import subprocess
    import sys

    from .conftest import ROOT

    code = (
        "import gc, threading\n"
        "from tierstore.client import RemoteKVStore\n"
        f"def use():\n    c = RemoteKVStore({daemon.url!r}, {TOKENS['acme']!r}); c.stats()\n"
        "use(); gc.collect()\n"
        "print([t.name for t in threading.enumerate() if t.name == 'tierstore-client'])\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip() == "[]", (r.stdout, r.stderr[-2000:])
    assert "Unclosed" not in r.stderr, r.stderr[-2000:]


def test_a_bad_chain_position_or_lifetime_fails_before_any_request_as_in_kvstore(client, monkeypatch):
    """The daemon client sent them and raised RemoteError (HTTP 400, pydantic's wording); KVStore
    raises LayoutError/ConfigError (fresh-user trial 4b)."""
    c = client

    async def no_request(*a, **k):
        raise AssertionError("a request was sent")

    monkeypatch.setattr(c._wire, "send", no_request)
    ns = Namespace(model="misuse")
    keys = c.keys_for(ns, list(range(2 * c.layout.tokens_per_block)))
    blocks = torch.zeros(2, c.block_bytes, dtype=torch.uint8)
    for bad in (-1, 2**31 - 1, 1.5):
        with pytest.raises(LayoutError, match="first_position"):
            c.store_keys(ns, keys, blocks, first_position=bad)
    with pytest.raises(ConfigError, match="lifetime hint"):
        c.store_keys(ns, keys, blocks, lifetime="forever")
    with pytest.raises(ConfigError, match="lifetime hint"):
        c.store(ns, list(range(2 * c.layout.tokens_per_block)), blocks, lifetime="forever")


def test_one_block_without_its_batch_dimension_is_refused_as_kvstore_refuses_it(client):
    """``RemoteKVStore.store(ns, toks, kv[0])`` (one block of ``block_shape``, no leading ``n``)
    stored it; KVStore and NodeKVStore read the first dimension as the blocks and refuse it
    (fresh-user trial 4b)."""
    from tierstore import KVStore

    c = client
    ns = Namespace(model="one-block")
    toks = list(range(c.layout.tokens_per_block))
    one = torch.ones(c.layout.block_shape, dtype=c.layout.dtype)
    embedded = KVStore(c.layout, host_bytes=4 * c.block_bytes)
    try:
        with pytest.raises(LayoutError) as want:
            embedded.store(ns, toks, one)
    finally:
        embedded.close()
    with pytest.raises(LayoutError) as got:
        c.store(ns, toks, one)
    assert str(got.value) == str(want.value)
    assert c.lookup(ns, toks).matched_blocks == 0
    assert c.store(ns, toks, one.unsqueeze(0)) == [Status.OK]  # with its batch dimension
