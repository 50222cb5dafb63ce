"""One registry per policy family: YAML, KVStore keywords, an engine's extra config, the
``make_*`` factories and the bench CLI accept exactly the names of the family's registry."""

from __future__ import annotations

import pytest
from pydantic import BaseModel, ConfigDict

from tierstore import KVStore
from tierstore.bench.jobfile import SCHEMA, parse_jobs
from tierstore.config import StoreConfig
from tierstore.errors import ConfigError
from tierstore.integrations._common import split_extra_config
from tierstore.policies.admission import make_admission
from tierstore.policies.base import make_policy
from tierstore.policies.lifetime import make_classifier
from tierstore.policies.registry import ADMISSION, CLASSIFIER, EVICTION, REINSERT
from tierstore.policies.reinsert import make_reinsert

FAMILIES = {"eviction": EVICTION, "admission": ADMISSION, "classifier": CLASSIFIER, "reinsert": REINSERT}
MAKE = {
    "eviction": make_policy,
    "admission": make_admission,
    "classifier": make_classifier,
    "reinsert": make_reinsert,
}
#: The families the bench CLI has a key for (the others are set through a job's store config).
CLI_FAMILIES = ("eviction", "admission")
#: Every name any family accepts, and names none accepts: each family must refuse the others'.
CANDIDATES = sorted(
    {n for r in FAMILIES.values() for n in r.names()} | {"bogus", "second_sighting", "LRU", ""}
)


def _accepted(check) -> list[str]:
    out = []
    for name in CANDIDATES:
        try:
            check(name)
        except ConfigError:
            continue
        out.append(name)
    return out


def _yaml(tmp_path, family):
    def check(name):
        path = tmp_path / f"{family}.yaml"
        path.write_text(f"tiers: {{host: {{capacity_bytes: 1MiB}}}}\npolicies: {{{family}: '{name}'}}\n")
        assert getattr(StoreConfig.from_yaml(str(path)).policies, family) == name

    return check


class ConnectorSection(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _extra_config(family):
    def check(name):
        cfg, _ = split_extra_config(
            {"policies": {family: name}}, "connector", ConnectorSection, "extra config"
        )
        assert getattr(cfg.policies, family) == name

    return check


def _kwargs(layout, family):
    def check(name):
        KVStore(layout, host_bytes=8 * layout.bytes_per_block, **{family: name}).close()

    return check


def _cli(family):
    def check(name):
        (job,) = parse_jobs([f"--{family}={name}"])
        assert job.options[family] == name.lower()  # the CLI folds the case of every choice, as fio does

    return check


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_cli_yaml_extra_config_and_kwargs_accept_the_same_names(family, layout, tmp_path):
    registry = FAMILIES[family]
    names = sorted(registry.names())
    assert _accepted(_yaml(tmp_path, family)) == names
    assert _accepted(_extra_config(family)) == names
    assert _accepted(_kwargs(layout, family)) == names
    assert _accepted(MAKE[family]) == names
    if family in CLI_FAMILIES:
        assert SCHEMA[family].choices == tuple(registry.names())
        assert _accepted(_cli(family)) == sorted(n for n in CANDIDATES if n.lower() in registry)
    else:
        assert family not in SCHEMA


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_entry_point_refuses_a_name_with_the_accepted_ones(family, layout, tmp_path):
    names = FAMILIES[family].names()
    checks = [_yaml(tmp_path, family), _extra_config(family), _kwargs(layout, family), MAKE[family]]
    if family in CLI_FAMILIES:
        checks.append(_cli(family))
    for check in checks:
        with pytest.raises(ConfigError, match=f"{family}='bogus'") as e:
            check("bogus")
        assert all(repr(n) in str(e.value) for n in names), (check, str(e.value))


def test_aliases_build_the_member_of_their_canonical_name():
    assert make_admission("none") is None and make_admission("all") is None and make_admission(None) is None
    assert (
        type(make_admission("second_hit")) is type(make_admission("second")) is type(make_admission("reused"))
    )
    assert ADMISSION.canonical("second_hit") == "reused"
    assert EVICTION.names() == ["lru", "s3fifo", "cost", "class_lru"]
    assert make_reinsert("none") is None and make_reinsert(None) is None


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_registry_per_family(family):
    """The names the config's error message lists, the CLI's choices and ``make_*``'s message
    are the registry's (plan section 11, item 9)."""
    from tierstore.config import PoliciesConfig
    from tierstore.schema import parse_model

    registry = FAMILIES[family]
    with pytest.raises(ConfigError) as config_error:
        parse_model(PoliciesConfig, {family: "bogus"}, "policies")
    assert f"accepted values are {sorted(registry.names())}" in str(config_error.value)
    with pytest.raises(ConfigError) as make_error:
        MAKE[family]("bogus")
    assert f"accepted values are {registry.names()}" in str(make_error.value)
    if family in CLI_FAMILIES:
        assert list(SCHEMA[family].choices) == registry.names()
