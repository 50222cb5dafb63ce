"""The remote tier's fixtures, for test_remote.py: a FakeCluster, a listening socket for the master,
MooncakeTier on FakeStore (tests/remote/test_tier.py)."""

from ..remote.test_tier import cluster, fake_master, make_tier  # noqa: F401 (fixtures, found by name)
