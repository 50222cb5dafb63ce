"""Fixtures of the remote suite: an in-memory Mooncake cluster (``cluster``, ``fake_master``,
``remote_cfg``) and a real Mooncake master (skipped without the wheel)."""

from __future__ import annotations

import socket

import pytest

import tierstore.remote.mooncake as mc
from tierstore import KVStore
from tierstore.errors import ConfigError

from .cluster import Master, WorkerProc
from .fake_mooncake import FakeCluster, FakeStore
from .prompts import BB, LAYOUT


@pytest.fixture
def cluster():
    return FakeCluster(lease_s=0.2)


@pytest.fixture
def fake_master():
    """A listening 127.0.0.1 socket: the tier checks that the master answers before ``setup``."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(16)
    yield f"127.0.0.1:{s.getsockname()[1]}"
    s.close()


@pytest.fixture
def remote_cfg(cluster, fake_master, monkeypatch):
    """RemoteConfig fields for a store on the fake cluster (``fake_master`` stands in for the master)."""
    monkeypatch.setattr(mc, "load_mooncake_store", lambda: lambda: FakeStore(cluster))
    for k in (
        "MC_TCP_BIND_ADDRESS",
        "MC_RPC_TIMEOUT_MS",
        "MC_RPC_CONNECT_TIMEOUT_MS",
        "MC_STORE_CLIENT_SETUP_RETRIES",
    ):  # the tier sets these with setdefault: keep them out of os.environ
        monkeypatch.setenv(k, "1")
    return {
        "master": fake_master,
        "metadata": "P2PHANDSHAKE",
        "segment_bytes": 0,
        "local_buffer_bytes": 8 * (BB + 64),
        "publish_queue_blocks": 16,
        "timeout_s": 0.5,
    }


@pytest.fixture
def host_blocks():
    """Host-tier blocks of a ``make_store`` store (a module may override it)."""
    return 32


@pytest.fixture
def make_store(remote_cfg, host_blocks):
    """``make_store(**remote)``: a host-tier KVStore (``LAYOUT``, no promotion) on the fake cluster,
    connected; all are closed at teardown."""
    stores = []

    def _make(host_blocks: int = host_blocks, **remote) -> KVStore:
        st = KVStore(LAYOUT, host_bytes=host_blocks * BB, promotion="none", remote={**remote_cfg, **remote})
        assert st.remote.wait_ok(5)
        stores.append(st)
        return st

    yield _make
    for st in stores:
        st.close()


def _mooncake_missing() -> str | None:
    try:
        from tierstore.remote.mooncake import load_mooncake_store

        load_mooncake_store()
    except ConfigError as e:
        return str(e)
    return None


@pytest.fixture(scope="session")
def mooncake_wheel():
    """Skips the test, with the reason, when Mooncake Store cannot be imported."""
    why = _mooncake_missing()
    if why:
        pytest.skip(f"Mooncake Store not available: {why}")


@pytest.fixture
def master_factory(mooncake_wheel, tmp_path):
    masters = []

    def _make(**kw) -> Master:
        m = Master(tmp_path, **kw).start()
        masters.append(m)
        return m

    yield _make
    for m in masters:
        m.kill()


@pytest.fixture
def workers(tmp_path):
    """``spawn(opts, name)`` starts a worker process; all are closed (or killed) at teardown."""
    procs: list[WorkerProc] = []

    def spawn(opts: dict, name: str) -> WorkerProc:
        w = WorkerProc(opts, tmp_path, name)
        procs.append(w)
        return w

    yield spawn
    for w in procs:  # SIGKILL: a clean close takes Mooncake about 2 s per client; the tests that
        if w.proc.poll() is None:  # check clean exits close their workers themselves
            w.kill9()
