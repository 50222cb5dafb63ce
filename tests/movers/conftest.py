"""The remote tier's fixtures, for test_remote.py: a FakeCluster, a listening socket for the master
(tests/remote/conftest.py), MooncakeTier on FakeStore (tests/remote/test_tier.py)."""

from ..remote.conftest import cluster, fake_master  # noqa: F401 (fixtures, found by name)
from ..remote.test_tier import make_tier  # noqa: F401 (a fixture, found by name)
