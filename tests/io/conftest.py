import os

import pytest

from tierstore.io.factory import open_engine

ENGINES = ["posix", "uring", "memory"]


def make_engine(kind, tmp_path, size_bytes, **kw):
    return open_engine(
        kind, None if kind == "memory" else str(tmp_path / f"dev-{kind}.bin"), size_bytes, **kw
    )


@pytest.fixture(params=ENGINES)
def engine_kind(request):
    return request.param


def rand_key(rng=None):
    return os.urandom(32)
