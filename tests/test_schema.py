"""tierstore.schema: the base of the store's and the daemon's configuration models."""
import pytest

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


@pytest.mark.parametrize("doc, match", [
    ({"cache_bytes": "4q"}, r"^invalid knobs:\n  cache_bytes='4q': expected a size"),
    ({"wait_s": "soon"}, r"^invalid knobs:\n  wait_s='soon': expected a duration"),
    ({"cache_bytes": None}, r"cache_bytes=None: expected a size"),
    ({"cache": 1}, r"cache: unknown key; accepted keys here are \['cache_bytes', 'spill_bytes', 'wait_s'\]"),
    ([1], "the document must be a mapping"),
])
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
