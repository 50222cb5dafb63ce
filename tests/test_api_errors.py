"""Bad input to the Python API is a typed TierStoreError (found by a new-user run of the README)."""
from __future__ import annotations

import pytest
import torch

from tierstore import KVStore, Namespace
from tierstore.errors import ConfigError
from tierstore.layout import KVLayout

LAY = KVLayout(2, 2, 4, torch.float32, 16, "newuser")


@pytest.mark.parametrize("kw", [dict(hbm_bytes=-1), dict(host_bytes="abc")])
def test_bad_capacities_are_config_errors(kw):
    with pytest.raises(ConfigError, match="capacity_bytes"):
        KVStore(LAY, **kw)


def test_a_missing_nvme_directory_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        KVStore(LAY, nvme_path=str(tmp_path / "no" / "such" / "dir" / "kv"), nvme_bytes=1 << 26)


def test_a_string_is_not_a_namespace():
    s = KVStore(LAY, host_bytes=1 << 20)
    try:
        with pytest.raises(ConfigError, match="namespace must be"):
            s.lookup("notans", list(range(32)))
    finally:
        s.close()


def test_storing_zero_new_blocks_returns_an_empty_list():
    """The README's loop (`store(ns, ids, new_kv, start_block=n)`) on a second pass: all hit."""
    s = KVStore(LAY, host_bytes=1 << 20)
    try:
        ns, ids = Namespace(model="m"), list(range(64))
        kv = torch.ones((4,) + tuple(LAY.block_shape))
        assert len(s.store(ns, ids, kv)) == 4
        assert s.store(ns, ids, kv[4:], start_block=4) == []
        assert len(s.lookup(ns, ids).keys) == 4
    finally:
        s.close()
