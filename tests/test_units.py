import pytest

from tierstore.errors import ConfigError
from tierstore.units import parse_size, parse_time_s


@pytest.mark.parametrize(
    "text,val", [("4k", 4096), ("16MiB", 16 << 20), ("1g", 1 << 30), ("512", 512), ("2m", 2 << 20), (7, 7)]
)
def test_sizes(text, val):
    assert parse_size(text) == val


@pytest.mark.parametrize("text,val", [("30", 30.0), ("500ms", 0.5), ("10us", 1e-5), ("2m", 120.0)])
def test_times(text, val):
    assert parse_time_s(text) == pytest.approx(val)


@pytest.mark.parametrize("bad", ["4q", "-1", "abc", "1.5"])
def test_bad_sizes_name_the_key(bad):
    with pytest.raises(ConfigError, match="bs="):
        parse_size(bad, key="bs")
