"""The daemon joins a Mooncake Store cluster (issue 16): it contributes its memory
as a segment, shares blocks with another daemon, and keeps serving its own tiers.

Real processes on 127.0.0.1: one ``mooncake_master``, two daemons
(``tierstore serve`` with a ``remote:`` section, tests/server/conftest.py's
harness) and two plain KVStore processes without a segment of their own
(tests/remote/store_worker.py). Skipped without the Mooncake wheel.
"""

from __future__ import annotations

import concurrent.futures
import os
import pathlib
import re
import time

import torch

from tierstore import Namespace, Status
from tierstore.api import leading_ok
from tierstore.client import RemoteKVStore

from ..server.conftest import TOKENS, Daemon, make_config
from ..server.helpers import block_for
from .cluster import Master, WorkerProc

SCRIPT = pathlib.Path(__file__).with_name("store_worker.py")


def _metric(d: Daemon, name: str, label: str | None = None) -> float:
    code, body = d.get("/metrics")
    assert code == 200
    pat = (
        "^"
        + re.escape(name)
        + (r'\{counter="' + re.escape(label) + r'"\}' if label else "")
        + r" ([0-9.e+]+)$"
    )
    m = re.search(pat, body.decode(), re.M)
    return float(m.group(1)) if m else 0.0


def test_daemons_join_the_cluster_contribute_memory_and_share(mooncake_wheel, tmp_path):
    m = Master(tmp_path).start()
    remote = {
        "engine": "mooncake",
        "master": m.address,
        "metadata": m.metadata,
        "local_hostname": "127.0.0.1",
        "timeout_s": "3s",
        "cluster": "daemons",
    }
    daemons, workers = [], []
    try:
        for name, seg in (("d1", "64MiB"), ("d2", "0")):  # d1 is the storage server: the only segment
            tmp = str(tmp_path / name)
            os.makedirs(tmp)
            daemons.append(Daemon(tmp, make_config(tmp, remote={**remote, "segment_bytes": seg})))
        wopts = {
            "remote": {k: v for k, v in remote.items() if k != "engine"}
            | {"segment_bytes": 0, "timeout_s": 3}
        }
        p = WorkerProc(wopts, tmp_path, "p", script=SCRIPT)  # start while the daemons start
        workers.append(p)
        with concurrent.futures.ThreadPoolExecutor(2) as ex:  # both start at once
            d1, d2 = ex.map(lambda d: d.start(), daemons)
        assert _metric(d1, "tierstore_remote_up") == 1.0 and _metric(d2, "tierstore_remote_up") == 1.0
        # 1. a KVStore process without memory of its own publishes into the daemon's segment;
        # after it is killed, another one still loads every block: they lived in d1's memory
        assert p.ready["ready"] == "ok"
        assert p.call("store", prompts=[[50, 4]])["ok"] == 4
        q = WorkerProc(wopts, tmp_path, "q", script=SCRIPT)
        workers.append(q)
        q.wait_ready()
        p.kill9()
        r = q.call("lookup", prompts=[[50, 4]])["results"][0]
        assert r["loaded"] == 4 and r["wrong"] == 0 and set(r["tiers"]) == {"remote"}, r
        # 2. a client of d1 stores through the daemon (host and NVMe tiers, published);
        # a client of d2 finds the blocks in the shared tier, byte-exact
        ns = Namespace(model="daemon-model@1", tokenizer="t")
        with RemoteKVStore(d1.url, TOKENS["acme"]) as c1, RemoteKVStore(d2.url, TOKENS["acme"]) as c2:
            toks = list(range(c1.layout.tokens_per_block * 6))
            keys = c1.keys_for(ns, toks)
            blocks = torch.stack([block_for(k, c1.block_bytes) for k in keys])
            assert c1.store(ns, toks, blocks) == [Status.OK] * 6
            deadline = time.monotonic() + 10
            while (
                _metric(d1, "tierstore_remote_events_total", "published_blocks") < 6
                and time.monotonic() < deadline
            ):
                time.sleep(0.1)
            hit = c2.lookup(ns, toks)
            assert hit.matched_blocks == 6 and {t.label for t in hit.tiers} == {"remote"}
            st, outs = c2.load(hit.keys)
            assert leading_ok(st) == 6
            for k, o in zip(keys, outs):
                assert torch.equal(c2.layout.as_bytes(o).reshape(-1), block_for(k, c2.block_bytes))
            assert {t.label for t in c2.lookup(ns, toks).tiers} == {"host"}  # d2 kept them (a cache fill)
            # another tenant of d2 gets nothing from acme's blocks
            with RemoteKVStore(d2.url, TOKENS["carol"]) as other:
                assert other.lookup(ns, toks).matched_blocks == 0
        assert _metric(d2, "tierstore_manager_events_total", "remote_fill_blocks") == 6
        # 3. the master goes away: the daemons report it and keep serving their own tiers
        m.kill()
        with RemoteKVStore(d1.url, TOKENS["acme"]) as c1:
            deadline = time.monotonic() + 20
            while _metric(d1, "tierstore_remote_up") == 1.0 and time.monotonic() < deadline:
                c1.lookup(
                    ns, list(range(10_000, 10_000 + c1.layout.tokens_per_block))
                )  # a remote lookup notices
                time.sleep(0.2)
            assert _metric(d1, "tierstore_remote_up") == 0.0, "\n".join(
                ln for ln in d1.log().splitlines() if "mooncake" in ln.lower() or "degraded" in ln
            )[-4000:]
            st, outs = c1.load(c1.lookup(ns, toks).keys)
            assert leading_ok(st) == 6
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.kill9()
        for d in daemons:
            if d.proc is not None and d.proc.poll() is None:
                d.kill9()
        m.kill()
