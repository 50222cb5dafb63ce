"""kill -9 under load, restart: every acknowledged put is served byte-exact, nothing corrupt."""

from __future__ import annotations

import threading
import time

import torch

from tierstore import Namespace
from tierstore.client import RemoteError, RemoteKVStore
from tierstore.errors import Status

from .conftest import TOKENS, Daemon, make_config
from .helpers import block_for


def test_kill9_under_load_keeps_every_acknowledged_put(tmp_path):
    d = Daemon(str(tmp_path), make_config(str(tmp_path))).start()
    acked: dict[int, list[tuple[Namespace, list[int], list[bytes]]]] = {w: [] for w in range(3)}
    stop = threading.Event()

    def writer(w: int) -> None:
        c = RemoteKVStore(d.url, TOKENS["acme" if w < 2 else "bravo"], retries=0, timeout_s=10)
        try:
            r = 0
            while not stop.is_set():
                ns = Namespace(model=f"crash-{w}")
                toks = [w * 10_000_000 + r * 1000 + i for i in range(c.layout.tokens_per_block * 8)]
                keys = c.keys_for(ns, toks)
                blocks = torch.stack([block_for(k, c.block_bytes) for k in keys])
                try:
                    st = c.store(ns, toks, blocks)
                except RemoteError:
                    return  # the daemon died mid-request: this put was never acknowledged
                if all(s in (Status.OK, Status.EXISTS) for s in st):
                    acked[w].append((ns, toks, keys))
                r += 1
        finally:
            c.close()

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    time.sleep(2.5)
    d.kill9()
    stop.set()
    for t in threads:
        t.join(30)
    n_acked = sum(len(v) for v in acked.values())
    assert n_acked >= 3, "the load did not get going before the kill"
    d.start()
    try:
        for w, puts in acked.items():
            with RemoteKVStore(d.url, TOKENS["acme" if w < 2 else "bravo"]) as c:
                for ns, _toks, keys in puts:
                    st, outs = c.load(keys, ns=ns)
                    assert st == [Status.OK] * len(keys), f"writer {w}: acknowledged blocks missing: {st}"
                    for k, o in zip(keys, outs):
                        assert torch.equal(c.layout.as_bytes(o), block_for(k, c.block_bytes))
        rec = [r for r in d.records() if r.get("event") == "recovered"]
        assert rec and rec[0]["blocks"] >= n_acked * 8
        # whatever else was recovered (torn, unacknowledged puts) is either whole or absent: read it all
        with RemoteKVStore(d.url, TOKENS["acme"]) as c:
            ns = Namespace(model="crash-0")
            r = len(acked[0])
            toks = [r * 1000 + i for i in range(c.layout.tokens_per_block * 8)]
            keys = c.keys_for(ns, toks)
            st, outs = c.load(keys, ns=ns)
            for s, k, o in zip(st, keys, outs):
                assert s in (Status.OK, Status.MISS)
                if s is Status.OK:
                    assert torch.equal(c.layout.as_bytes(o), block_for(k, c.block_bytes))
    finally:
        d.stop()
