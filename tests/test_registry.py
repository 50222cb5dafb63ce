"""tierstore.registry: one name -> factory table per family, aliases, one error message."""

import pytest

from tierstore.errors import ConfigError
from tierstore.registry import Registry


def _admission() -> Registry:
    reg: Registry = Registry("admission")
    reg.register("all", lambda: "admit every block", aliases=("none",))
    reg.register("reused", lambda: "second sighting", aliases=("second", "second_hit"))
    reg.register("predicted", lambda threshold=0.5: ("predicted", threshold))
    return reg


def test_names_keep_registration_order_with_aliases_after_their_member():
    reg = _admission()
    assert reg.names() == ["all", "none", "reused", "second", "second_hit", "predicted"]
    assert reg.names(aliases=False) == ["all", "reused", "predicted"]


def test_an_alias_builds_its_canonical_member():
    reg = _admission()
    assert reg.canonical("second_hit") == "reused"
    assert reg.canonical("reused") == "reused"
    assert reg.make("second") == "second sighting"
    assert reg.make("predicted", threshold=0.7) == ("predicted", 0.7)
    assert "none" in reg and "lru" not in reg and 3 not in reg


@pytest.mark.parametrize("bad", ["second-hit", "", "ALL", None, 3])
def test_an_unknown_name_names_the_family_and_every_accepted_value(bad):
    reg = _admission()
    msg = (
        f"admission={bad!r}: accepted values are "
        "['all', 'none', 'reused', 'second', 'second_hit', 'predicted']"
    )
    with pytest.raises(ConfigError) as e:
        reg.make(bad)
    assert str(e.value) == msg
    with pytest.raises(ConfigError):
        reg.canonical(bad)


def test_a_name_or_alias_is_registered_once():
    reg = _admission()
    with pytest.raises(ConfigError, match="admission='all': already registered"):
        reg.register("all", dict)
    with pytest.raises(ConfigError, match="admission='none': already registered"):
        reg.register("none", dict)  # an alias is not a new member
    with pytest.raises(ConfigError, match="'second'"):
        reg.register("fresh", dict, aliases=("second",))
    with pytest.raises(ConfigError, match="'reused'"):
        reg.register("fresh", dict, aliases=("reused",))
    with pytest.raises(ConfigError, match="non-empty"):
        reg.register("", dict)
    assert reg.names() == ["all", "none", "reused", "second", "second_hit", "predicted"]  # nothing half-added


def test_replace_swaps_the_factory_and_drops_the_old_aliases():
    reg = _admission()
    reg.register("reused", lambda: "replaced", aliases=("twice",), replace=True)
    assert reg.make("twice") == "replaced"
    assert "second" not in reg
    assert reg.names() == ["all", "none", "reused", "twice", "predicted"]


def test_a_family_needs_a_name():
    with pytest.raises(ConfigError):
        Registry("")
