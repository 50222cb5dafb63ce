"""What a new user's trial of ``tierstore bench`` hit: fio command lines pasted with ``--opt value``,
fio options tierstore does not have, what ``bs`` means for KV jobs, and the messages of refused files."""
from __future__ import annotations

import pytest

from tierstore.bench.jobfile import parse_jobs


# ------------------------------------------------------------------ 1: fio's --opt value and unknown fio options
def test_space_separated_values_parse_as_fio_does(run_bench):
    """``--bs 4k`` used to make '4k' a job file and ``--rw read`` set rw='1'."""
    rc, out, err = run_bench("--time_based", "--group_reporting", "--name", "j", "--rw", "read", "--bs", "8k",
                             "--size", "1m", "--direct", "0", "--stonewall", "--output-format", "json", "--showcmd")
    assert rc == 0, err
    assert out.split() == ["tierstore", "bench", "--name=j", "--rw=read", "--bs=8k", "--size=1m",
                           "--time_based=1", "--direct=0", "--stonewall=1", "--group_reporting=1"]


@pytest.mark.parametrize("argv,option", [
    (["--name"], "--name"),
    (["--name=j", "--bs", "--rw=read"], "--bs"),
    (["--name=j", "--rw=read", "--output-format"], "--output-format"),
])
def test_an_option_without_its_value_is_fios_error(run_bench, argv, option):
    rc, out, err = run_bench("--parse-only", *argv)
    assert rc == 1 and out == ""
    assert f"option '{option}' requires an argument" in err


def test_a_bare_value_option_in_a_flag_list_is_refused():
    """parse_jobs(["--name"]) used to make a job named '1'."""
    with pytest.raises(Exception, match=r"option '--name' requires an argument"):
        parse_jobs(["--name"])


@pytest.mark.parametrize("option", ["verify", "thread", "loops", "norandommap", "randrepeat", "filesize"])
@pytest.mark.parametrize("form", ["--{}=1", "--{}"])
def test_a_fio_option_tierstore_lacks_says_so_in_one_line(run_bench, option, form):
    rc, _, err = run_bench("--parse-only", "--name=j", form.format(option))
    assert rc == 1
    (line,) = err.strip().splitlines()
    assert f"fio option '{option}' is not supported by tierstore bench" in line
    assert "known options are" not in line and len(line) < 200


def test_a_typo_names_the_nearest_option(run_bench):
    rc, _, err = run_bench("--parse-only", "--iodeth=4")
    assert rc == 1 and "iodeth: unknown option; did you mean iodepth?" in err
