"""KVStores in separate processes share prefixes through the Mooncake remote tier (issue 16):
B hits what A stored with identical bytes, a cold third process hits both, another tenant
gets nothing, and a dead publisher's blocks become misses, never wrong bytes."""
from __future__ import annotations

import pathlib

import pytest

from .cluster import WorkerProc

SCRIPT = pathlib.Path(__file__).with_name("store_worker.py")


def _remote(master) -> dict:
    s = master.settings()
    return {k: s[k] for k in ("master", "metadata", "local_hostname", "segment_bytes", "local_buffer_bytes",
                              "publish_queue_blocks", "timeout_s")} | {"cluster": "store-sharing"}


@pytest.fixture
def stores(master_factory, tmp_path):
    master = master_factory()
    procs: list[WorkerProc] = []

    def spawn(name: str, **kw) -> WorkerProc:
        w = WorkerProc({"remote": _remote(master), **kw}, tmp_path, name, script=SCRIPT)
        procs.append(w)
        return w
    yield spawn
    for w in procs:
        w.request_exit()
    for w in procs:
        w.close(timeout_s=20)


def test_processes_share_prefixes_byte_exact(stores):
    a, b = stores("a"), stores("b")
    assert a.ready["ready"] == "ok" and b.ready["ready"] == "ok"
    assert a.call("store", prompts=[[1, 4], [2, 3]])["ok"] == 7
    assert b.call("store", prompts=[[3, 5]])["ok"] == 5
    got = b.call("lookup", prompts=[[1, 4], [2, 3]])["results"]
    assert [r["matched"] for r in got] == [4, 3] and [r["wrong"] for r in got] == [0, 0]
    assert [r["loaded"] for r in got] == [4, 3] and all(set(r["tiers"]) == {"remote"} for r in got)
    again = b.call("lookup", prompts=[[1, 4]])["results"][0]  # now indexed locally (a cache fill)
    assert again["loaded"] == 4 and set(again["tiers"]) == {"host"}
    c = stores("c")  # a third process starts cold and hits both
    got = c.call("lookup", prompts=[[1, 4], [3, 5]])["results"]
    assert [r["loaded"] for r in got] == [4, 5] and sum(r["wrong"] for r in got) == 0
    st = c.call("stats")
    assert st["remote_loaded_blocks"] == 9 and st["remote_hit_blocks"] == 9


def test_other_tenant_gets_zero_remote_reuse(stores):
    a, other = stores("a"), stores("other", tenant="bravo")
    assert a.call("store", prompts=[[7, 4]])["ok"] == 4
    r = other.call("lookup", prompts=[[7, 4]])["results"][0]
    assert r["matched"] == 0 and r["loaded"] == 0


def test_a_dead_publisher_is_a_miss_not_wrong_bytes(stores):
    a, b = stores("a"), stores("b")
    assert a.call("store", prompts=[[11, 4]])["ok"] == 4
    assert b.call("lookup", prompts=[[11, 4]])["results"][0]["loaded"] == 4
    c = stores("c")
    c.ready
    a.kill9()  # its segment held the objects
    r = c.call("lookup", prompts=[[11, 4]], timeout_s=60)["results"][0]
    assert r["wrong"] == 0 and r["loaded"] == 0  # listed a while by the master, then gone: misses
    assert c.call("store", prompts=[[12, 2]])["ok"] == 2  # and the survivors keep working
    assert b.call("lookup", prompts=[[12, 2]])["results"][0]["loaded"] == 2
