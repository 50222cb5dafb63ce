"""tierstore.schema: the base of the store's and the daemon's configuration models."""

import copy

import pytest

from tierstore.config import StoreConfig
from tierstore.errors import ConfigError
from tierstore.schema import DurationS, OptionalSizeBytes, SizeBytes, StrictModel, parse_model


class Knobs(StrictModel):
    cache_bytes: SizeBytes = 0
    spill_bytes: OptionalSizeBytes = None
    wait_s: DurationS = 1.0


def test_sizes_and_durations_are_parsed_once_at_load():
    k = parse_model(Knobs, {"cache_bytes": "4k", "spill_bytes": "1MiB", "wait_s": "500ms"}, "knobs")
    assert (k.cache_bytes, k.spill_bytes, k.wait_s) == (4096, 1 << 20, 0.5)
    assert parse_model(Knobs, {"spill_bytes": None}, "knobs").spill_bytes is None


@pytest.mark.parametrize(
    "doc, match",
    [
        ({"cache_bytes": "4q"}, r"^invalid knobs:\n  cache_bytes='4q': expected a size"),
        ({"wait_s": "soon"}, r"^invalid knobs:\n  wait_s='soon': expected a duration"),
        ({"cache_bytes": None}, r"cache_bytes=None: expected a size"),
        (
            {"cache": 1},
            r"cache: unknown key; accepted keys here are \['cache_bytes', 'spill_bytes', 'wait_s'\]",
        ),
        ([1], "the document must be a mapping"),
    ],
)
def test_one_error_format_names_key_value_and_what_is_accepted(doc, match):
    with pytest.raises(ConfigError, match=match):
        parse_model(Knobs, doc, "knobs")


def test_the_daemon_reuses_the_stores_models():
    from tierstore import config
    from tierstore.server import config as daemon

    fields = daemon.DaemonConfig.model_fields
    assert fields["layout"].annotation is config.LayoutConfig
    assert fields["tiers"].annotation is config.TiersConfig
    assert fields["policies"].annotation is config.PoliciesConfig
    assert daemon.LimitsConfig.__mro__[1] is StrictModel is config.TiersConfig.__mro__[1]


OPTION_SETS = [
    dict(hbm_bytes=1 << 20, host_bytes="2MiB", device="cpu", eviction="s3fifo", admission="second_hit"),
    dict(
        host_bytes=1 << 20,
        nvme_path="NVME",
        nvme_bytes=64 << 20,
        nvme_engine="posix",
        region_policy="fifo",
        segment_size_bytes="4MiB",
        flush_on_close=False,
        flush_timeout_s="2s",
        flush_max_bytes="8m",
        nvme_format=True,
        iodepth=4,
        classifier="reuse",
    ),  # KVStore's reinsert= is a run-time object
    dict(
        host_bytes=1 << 20,
        nvme_path="NVME",
        nvme_bytes=64 << 20,
        nvme_device="sim",
        nvme_engine="memory",
        promotion="one",
        write_policy="write_through",
        pin_quota_bytes="1g",
        default_lease_s="5s",
    ),
    dict(host_bytes=1 << 20, remote={"master": "h:1", "segment_bytes": 0, "admission": "reused"}),
]


@pytest.mark.parametrize("options", OPTION_SETS)
def test_from_options_is_the_config_kvstore_keywords_open(options, layout, tmp_path, monkeypatch):
    """StoreConfig.from_options (the one table of KVStore keyword spellings) builds exactly the
    config KVStore(...)'s keywords hand to build.assemble, and refuses what they refuse."""
    import tierstore.api as api
    import tierstore.build as build
    from tierstore.config import NVME_OPTIONS, OPTION_ALIASES, StoreConfig

    options = {k: str(tmp_path / "kv") if v == "NVME" else v for k, v in options.items()}
    seen = []

    class Opened(Exception):
        pass

    def capture(cfg, layout, **runtime):
        seen.append(cfg)
        raise Opened  # stop before anything opens

    monkeypatch.setattr(build, "assemble", capture)
    with pytest.raises(Opened):
        api.KVStore(layout, **options)
    assert StoreConfig.from_options(**options) == seen[0]
    nvme_keys = set(NVME_OPTIONS) | {k for k, v in OPTION_ALIASES.items() if v.startswith("tiers.nvme.")}
    assert nvme_keys == build.NVME_KEYWORDS


@pytest.mark.parametrize(
    "options, match",
    [
        (dict(evicton="lru"), r"unknown option\(s\) \['evicton'\]"),
        (dict(region_policy="fifo"), r"\['region_policy'\] need an NVMe tier"),
        (dict(admission="sometimes"), "admission='sometimes'"),
        (dict(device="tpu"), "device='tpu'"),
    ],
)
def test_from_options_refuses_what_kvstore_refuses(options, match, layout):
    from tierstore import KVStore
    from tierstore.config import StoreConfig

    for open_ in (lambda: StoreConfig.from_options(**options), lambda: KVStore(layout, **options)):
        with pytest.raises(ConfigError, match=match):
            open_()


@pytest.mark.parametrize(
    "section, key",
    [
        (
            {"tiers": {"nvme": {"path": "/tmp/x/", "capacity_bytes": "64m"}}},
            ("tiers", "nvme", "live_fraction"),
        ),
        ({"tiers": {"nvme": {"path": "/tmp/x/", "capacity_bytes": "64m"}}}, ("tiers", "nvme", "iodepth")),
        (
            {"tiers": {"nvme": {"path": "/tmp/x/", "capacity_bytes": "64m", "device": "sim"}}},
            ("tiers", "nvme", "model", "num_ruh"),
        ),
        ({}, ("policies", "evict_batch_blocks")),
    ],
)
def test_a_yes_no_value_is_no_number(section, key):
    """YAML's ``true``/``yes`` given where a number belongs was read as 1 (``live_fraction: true`` kept
    every block live): pydantic's lax mode turns a bool into 1 or 1.0. A number field refuses it, naming
    the key; a bool field still takes it."""
    doc = copy.deepcopy(section)
    node = doc
    for part in key[:-1]:
        node = node.setdefault(part, {})
    node[key[-1]] = True
    with pytest.raises(ConfigError, match=rf"{key[-1]}.*a number, not a yes/no value"):
        parse_model(StoreConfig, doc, "store config")
    node[key[-1]] = 2 if key[-1] != "live_fraction" else 0.5
    parse_model(StoreConfig, doc, "store config")  # the same key with a number is fine


def test_an_empty_nvme_path_says_what_a_path_is_without_the_sections_body():
    """Fresh-user trial: nvme_path="" said '(document)={...}: device: file needs a path'."""
    from tierstore import KVStore, get_layout

    with pytest.raises(ConfigError) as e:
        KVStore(get_layout("llama-3.1-8b"), host_bytes=8 << 20, nvme_path="", nvme_bytes=64 << 20)
    msg = str(e.value)
    assert "{...}" not in msg and "(document)" not in msg
    assert "needs a path" in msg and "nvme_path=" in msg


@pytest.mark.parametrize("value", [-5, "-5s", 0, "0s", "2d", 1e9, float("nan")])
def test_store_timeout_is_refused_once_with_the_range_the_client_takes(value):
    """-5 was "must be >= 0" but 0 "> 0", and "2d" and 1e9 passed the model and were then refused
    by open_store as outside (0, 86400] (fresh-user trial 9): one check, one message, at load."""
    with pytest.raises(ConfigError) as e:
        parse_model(StoreConfig, {"store": {"url": "unix:///run/n.sock", "timeout_s": value}}, "store config")
    assert f"store.timeout_s={value!r}: must be a finite number of seconds in (0, 86400]" in str(e.value)


@pytest.mark.parametrize("value, want", [(86400, 86400.0), ("1d", 86400.0), ("500ms", 0.5), (2, 2.0)])
def test_store_timeout_accepted_is_one_the_client_takes(value, want):
    from tierstore.units import check_duration_s

    cfg = parse_model(
        StoreConfig, {"store": {"url": "unix:///run/n.sock", "timeout_s": value}}, "store config"
    )
    assert cfg.store.timeout_s == want == check_duration_s(cfg.store.timeout_s, "timeout_s")


@pytest.mark.parametrize(
    "section", [{"tiers": {"host": {"capacity_bytes": "1GiB"}}}, {"policies": {}}, {"remote": None}]
)
def test_a_store_url_beside_the_sections_it_owns_is_refused_by_the_model(section):
    """StoreConfig.from_dict took store.url and tiers, and open_store then ignored the tiers silently
    (fresh-user trial 9; only the engines' splitter refused them)."""
    doc = {"store": {"url": "unix:///run/n.sock"}, **section}
    with pytest.raises(ConfigError) as e:
        StoreConfig.from_dict(doc)
    assert "store.url='unix:///run/n.sock' names the node service" in str(e.value)
    assert f"remove {sorted(section)}" in str(e.value)
    assert StoreConfig.from_dict(section).store.url is None
    assert StoreConfig.from_dict({"store": {"url": "unix:///run/n.sock"}}).tiers == StoreConfig().tiers
