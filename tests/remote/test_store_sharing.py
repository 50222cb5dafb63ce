"""KVStores in separate processes share prefixes through a real Mooncake master (issue 16).

Each process is tests/remote/store_worker.py: a ``KVStore`` whose remote tier
is configured through the ``remote=`` option, TCP transport on 127.0.0.1. The
module's first tests share one master and four processes (starting a process
costs seconds on 2 cores); the failure tests (kill -9, master restart) get
their own. Skipped, with the reason, without the Mooncake wheel.
"""

from __future__ import annotations

import pathlib
import time

import pytest

from .cluster import Master, WorkerProc, wait_until

SCRIPT = pathlib.Path(__file__).with_name("store_worker.py")


def _remote(master, **kw) -> dict:
    s = master.settings()
    d = {
        k: s[k]
        for k in (
            "master",
            "metadata",
            "local_hostname",
            "segment_bytes",
            "local_buffer_bytes",
            "publish_queue_blocks",
            "timeout_s",
        )
    } | {"cluster": "store-sharing"}
    d.update(kw)
    return d


class _Procs:
    def __init__(self, tmp) -> None:
        self.tmp = tmp
        self.procs: list[WorkerProc] = []

    def spawn(
        self, master, name: str, tenant: str = "acme", prefill_tokens_per_s: float | None = None, **remote
    ) -> WorkerProc:
        opts = {"remote": _remote(master, **remote), "tenant": tenant}
        if prefill_tokens_per_s is not None:
            opts["prefill_tokens_per_s"] = prefill_tokens_per_s
        w = WorkerProc(opts, self.tmp, name, script=SCRIPT)
        self.procs.append(w)
        return w

    def close(self) -> None:
        """SIGKILL: a clean close takes Mooncake about 2 s per client (tests/remote/test_mooncake_cluster.py
        checks clean exits), and the master goes next."""
        for w in self.procs:
            if w.proc.poll() is None:
                w.kill9()


#: The engine's prefill rate the workers' cost models use: 20,000 tokens/s, so recomputing a
#: 16-token block takes 0.8 ms, less than one Mooncake call's declared 1 ms (CostModel).
PREFILL_TOKENS_PER_S = 20_000.0


@pytest.fixture(scope="module")
def shared(mooncake_wheel, tmp_path_factory):
    """One master (HTTP metadata server, the config's default) and A, B (tenant acme),
    Y (tenant bravo) and C (acme, cold: it does nothing before its test)."""
    tmp = tmp_path_factory.mktemp("store-sharing")
    m = Master(tmp, metadata="http").start()
    p = _Procs(tmp)
    ws = {
        n: p.spawn(m, n, tenant=t, prefill_tokens_per_s=PREFILL_TOKENS_PER_S)
        for n, t in (("a", "acme"), ("b", "acme"), ("y", "bravo"), ("c", "acme"))
    }
    try:
        for w in ws.values():
            assert w.ready["ready"] == "ok", w.log_tail()
        yield ws
    finally:
        p.close()
        m.kill()


@pytest.fixture
def procs(tmp_path):
    p = _Procs(tmp_path)
    yield p
    p.close()


def test_processes_share_prefixes_byte_exact_and_a_cold_third_hits_both(shared):
    a, b, c = shared["a"], shared["b"], shared["c"]
    assert a.call("store", prompts=[[1, 4], [2, 3]])["ok"] == 7
    assert b.call("store", prompts=[[3, 5]])["ok"] == 5
    got = b.call("lookup", prompts=[[1, 4], [2, 3]])["results"]
    assert [r["matched"] for r in got] == [4, 3] and [r["wrong"] for r in got] == [0, 0]
    assert [r["loaded"] for r in got] == [4, 3] and all(set(r["tiers"]) == {"remote"} for r in got)
    again = b.call("lookup", prompts=[[1, 4]])["results"][0]  # a cache fill: now in B's host tier
    assert again["loaded"] == 4 and set(again["tiers"]) == {"host"}
    sb = b.call("stats")
    assert sb["remote_fill_blocks"] == 7 and sb["tier_zero_copy_gets"] == 7 and sb["tier_staged_gets"] == 0
    # C starts cold and hits both A's and B's blocks
    got = c.call("lookup", prompts=[[1, 4], [3, 5]])["results"]
    assert [r["loaded"] for r in got] == [4, 5] and sum(r["wrong"] for r in got) == 0
    st = c.call("stats")
    assert st["remote_loaded_blocks"] == 9 and st["remote_hit_blocks"] == 9


def test_a_remote_hit_that_beats_recompute_is_useful_and_load_of_the_result_loads_it(shared):
    """Issue 22, item 9: B's lookup found 8 blocks in the remote tier with useful_blocks=0, so
    load(result) loaded nothing. A remote load of 8 blocks is one Mooncake call: its latency is
    paid once (8 x 16 KiB at the declared 1 GB/s + 1 ms: 1.1 ms against 6.4 ms of prefill), and
    once B has loaded, its estimate is the measured Mooncake transfer time (bounded by the
    declared one)."""
    a, b = shared["a"], shared["b"]
    assert a.call("store", prompts=[[60, 8]])["ok"] == 8
    r = b.call("lookup", prompts=[[60, 8]], useful=True)["results"][0]
    assert (r["matched"], r["useful"], r["not_useful_reason"]) == (8, 8, None), r
    assert set(r["tiers"]) == {"remote"} and r["loaded"] == 8 and r["wrong"] == 0, r
    est = b.call("cost")["remote"]
    assert est["measured_loads"] >= 1, est  # Mooncake transfers feed the estimate
    assert a.call("store", prompts=[[s, 8] for s in (61, 62, 63)])["ok"] == 24
    for seed in (61, 62, 63):  # three more remote loads: a measured estimate (min_measured)
        r = b.call("lookup", prompts=[[seed, 8]], useful=True)["results"][0]
        assert (r["useful"], r["loaded"], r["wrong"]) == (8, 8, 0), r
    est = b.call("cost")["remote"]
    assert est["measured_loads"] >= 4 and est["measured_ms_per_block"] > 0, est
    # bounded: whatever the transfers took on this machine, the estimate of 8 blocks is at most
    # the declared one (1 ms + 8 x 16 KiB at 1 GB/s), so the next remote hit is useful too
    assert est["estimate_ms_per_block_of_8"] <= (1.0 + 8 * 16384 / 1e6) / 8 + 1e-9, est
    assert a.call("store", prompts=[[64, 8]])["ok"] == 8
    r = b.call("lookup", prompts=[[64, 8]], useful=True)["results"][0]
    assert (r["useful"], r["loaded"], r["wrong"]) == (8, 8, 0), (r, est)


def test_other_tenant_zero_remote_reuse_both_ways(shared):
    a, y = shared["a"], shared["y"]
    assert a.call("store", prompts=[[20, 4]])["ok"] == 4  # acme stores T
    assert y.call("store", prompts=[[21, 4]])["ok"] == 4  # bravo stores U
    # the same tokens under the other tenant: nothing, and the same answer as tokens nobody stored
    for who, theirs, never in ((y, 20, 22), (a, 21, 23)):
        r_theirs, r_never = who.call("lookup", prompts=[[theirs, 4], [never, 4]])["results"]
        for r in (r_theirs, r_never):
            assert (r["matched"], r["loaded"], r["tiers"], r["status"]) == (0, 0, [], [])
    # each tenant's own blocks are shared as usual (a bravo process that did not store U hits it)
    r = shared["c"].call("lookup", prompts=[[21, 4]], tenant="bravo")["results"][0]
    assert r["loaded"] == 4 and r["wrong"] == 0 and set(r["tiers"]) == {"remote"}
    assert a.call("stats").get("remote_loaded_blocks", 0) == 0


def test_corrupt_remote_object_from_mooncakes_own_client_is_a_counted_miss(shared):
    a, b = shared["a"], shared["b"]
    assert a.call("store", prompts=[[30, 4], [31, 3]])["ok"] == 7
    assert a.call("corrupt", seed=30, nblocks=4, block=1, how="payload")["rc"] == 0
    assert a.call("corrupt", seed=31, nblocks=3, block=0, how="garbage")["rc"] == 0
    before = b.call("stats")
    r30, r31 = b.call("lookup", prompts=[[30, 4], [31, 3]])["results"]
    assert r30["matched"] == 4 and r30["loaded"] == 1 and r30["wrong"] == 0
    assert r31["matched"] == 3 and r31["loaded"] == 0 and r31["wrong"] == 0
    after = b.call("stats")
    assert after["tier_corrupt_payload_crc"] - before["tier_corrupt_payload_crc"] == 1
    assert after["tier_corrupt_magic"] - before["tier_corrupt_magic"] == 1
    assert after["remote_load_errors"] - before.get("remote_load_errors", 0) == 2
    # the bad objects are removed in the background; A publishes again on its next store of them
    assert wait_until(lambda: b.call("stats")["tier_removals_ok"] - before["tier_removals_ok"] >= 2, 15)


def test_kill9_of_the_segment_owner_gives_misses_never_wrong_bytes(mooncake_wheel, tmp_path, procs):
    m = Master(tmp_path).start()
    try:
        a = procs.spawn(m, "a")  # the only segment: A's objects live in A's memory
        assert a.ready["ready"] == "ok"
        assert a.call("store", prompts=[[11, 4]])["ok"] == 4
        b = procs.spawn(m, "b")  # started after: survives with its own segment
        c = procs.spawn(m, "c", segment_bytes=0)
        r = b.call("lookup", prompts=[[11, 4]])["results"][0]
        assert r["loaded"] == 4 and r["wrong"] == 0  # B filled its host tier
        c.wait_ready()
        a.kill9()
        t0 = time.monotonic()
        r = c.call("lookup", prompts=[[11, 4]], timeout_s=60)["results"][0]
        assert time.monotonic() - t0 < 15, r  # bounded: timeout_s=3 per Mooncake call
        assert r["wrong"] == 0 and r["loaded"] == 0, r  # listed a while by the master, then gone: misses
        assert all(s in ("miss", "io_error") for s in r["status"]), r
        # the others keep working: B serves its copy locally, and sharing goes on in B's segment
        r = b.call("lookup", prompts=[[11, 4]])["results"][0]
        assert r["loaded"] == 4 and r["wrong"] == 0 and set(r["tiers"]) == {"host"}
        # once the master has dropped A's segment (client_ttl), C's publishes land in B's segment
        assert wait_until(lambda: c.call("lookup", prompts=[[11, 4]])["results"][0]["matched"] == 0, 20)
        assert c.call("store", prompts=[[12, 2]])["ok"] == 2
        r = b.call("lookup", prompts=[[12, 2]])["results"][0]
        assert r["loaded"] == 2 and r["wrong"] == 0 and set(r["tiers"]) == {"remote"}, r
        assert c.call("stats")["tier_state"] == "ok"
    finally:
        m.kill()


def test_master_restart_degrades_local_tiers_keep_serving_then_reconnects(mooncake_wheel, tmp_path, procs):
    m = Master(tmp_path, metadata="http").start()
    try:
        a, b = procs.spawn(m, "a"), procs.spawn(m, "b")
        assert a.ready["ready"] == b.ready["ready"] == "ok"
        assert a.call("store", prompts=[[40, 3]])["ok"] == 3
        assert b.call("lookup", prompts=[[40, 3]])["results"][0]["loaded"] == 3
        m.kill()
        t0 = time.monotonic()
        assert a.call("store", prompts=[[41, 3]])["ok"] == 3  # local stores go on
        for w, seed in ((a, 41), (b, 40)):  # and local hits are served
            r = w.call("lookup", prompts=[[seed, 3]])["results"][0]
            assert r["loaded"] == 3 and r["wrong"] == 0 and set(r["tiers"]) == {"host"}
        r = b.call("lookup", prompts=[[41, 3]])["results"][0]  # remote-only: a miss, not a hang
        assert r["loaded"] == 0 and r["wrong"] == 0
        assert time.monotonic() - t0 < 20
        sa = a.call("stats")
        assert sa["tier_state"] == "degraded" and sa["tier_degraded_reason"], sa
        m.start()  # same ports; a non-HA master comes back empty
        assert wait_until(
            lambda: a.call("stats")["tier_state"] == "ok" and b.call("stats")["tier_state"] == "ok", 30
        )
        assert a.call("stats")["tier_reconnects"] >= 1
        # Sharing resumes: a block a stores reaches b. Right after the reconnect the restarted
        # master may not hold every segment yet, and a publish it refuses for space is retried
        # twice, then dropped (counted; CI once lost the one publish this test made): so each
        # attempt stores a fresh prompt (a re-stored local hit is not published again) until one
        # reaches b, within 30 s.
        seeds = iter(range(42, 1000))
        got = []

        def shared_again() -> bool:
            seed = next(seeds)
            assert a.call("store", prompts=[[seed, 2]])["ok"] == 2
            if wait_until(lambda: b.call("lookup", prompts=[[seed, 2]])["results"][0]["loaded"] == 2, 3):
                got.append(seed)
            return bool(got)

        assert wait_until(shared_again, 30)
        r = b.call("lookup", prompts=[[got[0], 2]])["results"][0]
        assert r["wrong"] == 0
    finally:
        m.kill()
