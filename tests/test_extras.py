"""tierstore.extras: a missing optional package is a one-line error naming how to install it."""

from __future__ import annotations

import pytest

from tierstore import extras
from tierstore.errors import ConfigError


def test_a_missing_extra_names_both_install_forms(monkeypatch):
    """The hint used to give only the released package's form, not a source checkout's (pip install -e)."""
    monkeypatch.setitem(extras.EXTRA_OF, "tierstore_no_such_module", "server")
    with pytest.raises(ConfigError) as err:
        extras.require("tierstore_no_such_module", "tierstore serve")
    (line,) = str(err.value).splitlines()
    assert "tierstore serve needs tierstore_no_such_module, which is not installed" in line
    assert "pip install 'tierstore[server]'" in line and "pip install -e '.[server]'" in line
