"""Fixtures for tests against a real Mooncake master (skipped without the wheel)."""
from __future__ import annotations

import pytest

from tierstore.errors import ConfigError

from .cluster import Master, WorkerProc


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
