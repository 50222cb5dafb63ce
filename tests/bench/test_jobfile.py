"""Job files, flags, schema validation, --parse-only and --showcmd."""

from __future__ import annotations

import pytest

from tierstore.bench.jobfile import SCHEMA, parse_jobs, parse_value, showcmd
from tierstore.errors import ConfigError

from .conftest import REPO

JOB = """\
; comment
[global]
bs=64k
size=1g
ioengine=memory
runtime=500ms
time_based
plids=0,1,2

[a]
rw=randwrite

[b]
rw=read
bs=4k
fdp_pli=3
"""


def test_global_inherited_and_overridden(tmp_path):
    path = tmp_path / "j.fio"
    path.write_text(JOB)
    a, b = parse_jobs([], [str(path)])
    assert (a.name, a.options["rw"], a.options["bs"], a.options["size"]) == ("a", "randwrite", 65536, 1 << 30)
    assert a.options["runtime"] == pytest.approx(0.5) and a.options["time_based"] is True
    assert a.options["plids"] == (0, 1, 2)
    assert (b.options["bs"], b.options["plids"]) == (4096, (3,))
    assert b.explicit == {"rw": "read", "bs": "4k", "plids": "3"}


def test_cli_flags_override_file(tmp_path):
    path = tmp_path / "j.fio"
    path.write_text(JOB)
    jobs = parse_jobs(["--bs=8k", "--iodepth=4"], [str(path)])
    assert [j.options["bs"] for j in jobs] == [8192, 8192]
    assert all(j.options["iodepth"] == 4 for j in jobs)


def test_no_job_file_uses_defaults_and_rw_name():
    (job,) = parse_jobs(["--rw=randread"])
    assert job.name == "randread"
    for key, spec in SCHEMA.items():
        if key not in ("rw", "name"):
            assert job.options[key] == spec.default, key
    assert job.options["device"] == "file"  # what --cmdhelp says and what runs (issue 19 item 7)


@pytest.mark.parametrize(
    "key,raw,want",
    [
        ("size", "16MiB", 16 << 20),
        ("hbm_size", "2g", 2 << 30),
        ("runtime", "250ms", 0.25),
        ("ramp_time", "10us", 1e-5),
        ("op", "7%", 0.07),
        ("utilization", "0.9", 0.9),
        ("lifetime_mix", "long:10,medium:30,short:60", {"long": 10.0, "medium": 30.0, "short": 60.0}),
        ("time_based", "", True),
        ("direct", "0", False),
        ("layout", "Qwen2.5-7B", "qwen2.5-7b"),
    ],
)
def test_value_parsing(key, raw, want):
    got = parse_value(key, raw)
    if isinstance(want, float):
        assert got == pytest.approx(want)
    else:
        assert got == want


@pytest.mark.parametrize(
    "key,raw,needle",
    [
        ("rw", "randfoo", "accepted values are ['kvtrace'"),
        ("eviction", "fifo", "accepted values are ['lru', 's3fifo', 'cost', 'class_lru']"),
        ("bs", "4x", "expected a size"),
        ("runtime", "10 parsecs", "expected a duration"),
        ("plids", "a,b", "comma-separated list"),
        ("lifetime_mix", "forever:1", "classes ['long', 'medium', 'short']"),
        ("iodepth", "0", ">= 1"),
        ("nosuchkey", "1", "unknown option"),
    ],
)
def test_bad_values_name_key_value_and_accepted(key, raw, needle):
    with pytest.raises(ConfigError) as err:
        parse_value(key, raw)
    assert key in str(err.value) and needle in str(err.value)
    if key != "nosuchkey":
        assert repr(raw) in str(err.value)


def test_bad_key_in_file_names_file_and_section(tmp_path, run_bench):
    path = tmp_path / "bad.fio"
    path.write_text("[global]\nbs=4k\n[j1]\nrw=read\neviction=fifo\n")
    rc, out, err = run_bench("--parse-only", str(path))
    assert rc == 1 and out == ""
    assert "bad.fio [j1]" in err and "eviction='fifo'" in err and "'s3fifo'" in err


def test_unknown_flag_exit_1(run_bench):
    rc, _, err = run_bench("--parse-only", "--iodeth=4")
    assert rc == 1 and "iodeth: unknown option" in err


@pytest.mark.parametrize(
    "name", ["kvtrace", "kvstore", "kvload", "kvmixed", "seqwrite", "randread", "fdp-device"]
)
def test_shipped_job_files_parse(name, run_bench):
    path = REPO / "bench" / "jobs" / f"{name}.fio"
    rc, out, err = run_bench("--parse-only", str(path))
    assert rc == 0, err


def test_fdp_device_job():
    (job,) = parse_jobs([], [str(REPO / "bench" / "jobs" / "fdp-device.fio")])
    o = job.options
    assert (o["filename"], o["dataplacement"], o["plids"]) == ("/dev/ng0n1", "fdp", (0, 1, 2))


def test_showcmd_round_trips(tmp_path, run_bench):
    path = REPO / "bench" / "jobs" / "kvmixed.fio"
    rc, out, _ = run_bench("--showcmd", str(path))
    assert rc == 0
    line = out.strip().splitlines()[0]
    assert line.startswith("tierstore bench --name=kvmixed ")
    again = parse_jobs(line.split()[2:])
    assert again[0].options == parse_jobs([], [str(path)])[0].options
    assert showcmd(again) == [line]


def test_bare_fraction_above_one_is_an_error_not_a_percentage():
    from tierstore.bench.jobfile import parse_value
    from tierstore.errors import ConfigError

    assert parse_value("utilization", "90%") == pytest.approx(0.9)
    assert parse_value("utilization", "0.9") == pytest.approx(0.9)
    with pytest.raises(ConfigError, match="utilization"):
        parse_value("utilization", "2")


@pytest.mark.parametrize("admission", SCHEMA["admission"].choices)
def test_every_admission_choice_opens_a_store(admission, tmp_path):
    """Each ``--admission`` the CLI offers is one the store config accepts (the documented
    ``--admission=second_hit`` failed at job start, ``--admission=reused`` was refused)."""
    from tierstore.bench.kvjobs import replay_config, store_config

    (job,) = parse_jobs([f"--admission={admission}"])
    cfg = replay_config(job.options).store_config(0, 1 << 20, 16 << 20, str(tmp_path))
    assert cfg.policies.admission == admission
    assert (
        store_config(job.options, 0, 1 << 20, 16 << 20, str(tmp_path / "kv")).policies.admission == admission
    )
    assert "reused" in SCHEMA["admission"].choices and "second_hit" in SCHEMA["admission"].choices


@pytest.mark.parametrize(
    "text, needle",
    [
        ("rw=read\n[a]\nsize=1m\n", "line 1: option outside of a [] job section ('rw=read')"),
        ("[a\nsize=1m\n", "line 1: an unclosed section header ('[a')"),
        ("[a]\nsize=1m\n[b\nsize=2m\n", "line 3: an unclosed section header ('[b')"),
        ("[a]\nsize=1m\ninclude other.fio\n", "line 3: `include` (fio's job-file directive) is not followed"),
        (b"[a]\nsize=1m\xff\n", "not UTF-8 text"),
    ],
)
def test_job_file_syntax_errors_say_the_line_as_fio_does(tmp_path, text, needle):
    """A broken header and an option before any section both said configparser's "File contains no
    section headers", and `include` was "an unknown option" (fresh-user trial 4a)."""
    p = tmp_path / "j.fio"
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError) as e:
        parse_jobs(job_files=[str(p)])
    assert needle in str(e.value)


@pytest.mark.parametrize("key", ["size", "bs", "iodepth", "rw"])
def test_value_key_without_value_in_job_file_is_refused(tmp_path, key):
    """A bare ``size`` line became ``size=1`` (one block run; a bare ``bs`` failed later as
    "bs=1: ... multiple of 4096"); fio allows a bare key only for boolean options (fresh-user
    trial 9)."""
    p = tmp_path / "j.fio"
    p.write_text(f"[global]\nrw=read\n[j]\n{key}\n")
    with pytest.raises(ConfigError) as e:
        parse_jobs(job_files=[str(p)])
    assert f"j.fio' [j]: '{key}' has no value" in str(e.value)
    assert f"write {key}=VALUE" in str(e.value)


def test_bare_boolean_keys_in_job_file_mean_1(tmp_path):
    p = tmp_path / "j.fio"
    p.write_text("[j]\nrw=read\nsize=1m\ndirect\ntime_based\ngroup_reporting\nstonewall\n")
    (job,) = parse_jobs(job_files=[str(p)])
    assert job.options["direct"] and job.options["time_based"] and job.options["group_reporting"]
    assert job.explicit["time_based"] == "1"


def test_bare_unknown_key_in_job_file_is_called_unknown(tmp_path):
    p = tmp_path / "j.fio"
    p.write_text("[j]\nrw=read\nnosuchkey\n")
    with pytest.raises(ConfigError, match="nosuchkey: unknown option"):
        parse_jobs(job_files=[str(p)])


@pytest.mark.parametrize(
    "text, held",
    [
        ("", "no section at all"),
        ("; only a comment\n", "no section at all"),
        ("[global]\nbs=4k\n", "only a [global]"),
    ],
)
def test_job_file_without_a_job_says_what_it_holds(tmp_path, text, held):
    """An empty job file said "no job section (only [global])" with no [global] in it (trial 9)."""
    p = tmp_path / "j.fio"
    p.write_text(text)
    with pytest.raises(ConfigError) as e:
        parse_jobs(job_files=[str(p)])
    assert f"no job section: it holds {held}" in str(e.value)


def test_two_sections_of_one_name_are_two_jobs_as_in_fio(tmp_path):
    """Fresh-user trial 11: ``[w] rw=write`` then ``[w] rw=read`` ran one job (the sections merged);
    fio runs both, in file order. A later [global] applies to the jobs after it, as in fio."""
    path = tmp_path / "dup.fio"
    path.write_text("[w]\nrw=write\nsize=1m\n[global]\nbs=8k\n[w]\nrw=read\nsize=1m\n")
    jobs = parse_jobs([], [str(path)])
    assert [(j.name, j.options["rw"], j.options["bs"]) for j in jobs] == [
        ("w", "write", 4096),
        ("w", "read", 8192),
    ]


def test_fio_aliases_of_our_options_are_accepted(tmp_path):
    """Trial 11: ``blocksize=8k`` (fio's alias of bs, options.c) was refused as unknown."""
    path = tmp_path / "a.fio"
    path.write_text("[global]\nsize=1m\nblocksize=8k\n[r]\nreadwrite=randread\ntimeout=2s\n")
    (job,) = parse_jobs(["--data_placement=fdp", "--fdp_pli_select=roundrobin"], [str(path)])
    assert (job.options["bs"], job.options["rw"], job.options["runtime"]) == (8192, "randread", 2.0)
    assert (job.options["dataplacement"], job.options["plid_select"]) == ("fdp", "roundrobin")
