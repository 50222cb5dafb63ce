"""fio-style job files and ``--key=value`` flags for ``tierstore bench``.

A job file is an INI file as fio reads it: a ``[global]`` section whose keys
every following ``[job]`` section inherits, then one section per job. Every
key of the schema (:data:`SCHEMA`) also works as a command-line flag
``--key=value``. On the command line, as in fio, each ``--name=`` starts a job
that takes the flags after it and inherits those before the first ``--name=``;
those global flags also override the job files' values in every job. Without
``--name=`` and job files the flags define a single job, named after ``rw``, on
top of the embedded defaults (which need no device and no GPU). Jobs run at
once unless ``stonewall`` (:func:`parse_jobs`).

Sizes take ``k``/``m``/``g``/``t`` suffixes with base 1024 and times take
``ns``/``us``/``ms``/``s``/``m``/``h`` suffixes, as in fio
(:func:`tierstore.units.parse_size`, :func:`tierstore.units.parse_time_s`).

Examples
--------
>>> jobs = parse_jobs(["--rw=randread", "--bs=4k", "--size=1m"])
>>> jobs[0].name, jobs[0].options["bs"]
('randread', 4096)
"""

from __future__ import annotations

import configparser
import dataclasses
import difflib
import os
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import ConfigError
from ..policies.registry import ADMISSION, EVICTION
from ..units import parse_size, parse_time_s

__all__ = [
    "OptionSpec",
    "SCHEMA",
    "ALIASES",
    "VALUE_ALIASES",
    "JobSpec",
    "parse_value",
    "parse_jobs",
    "read_job_file",
    "showcmd",
    "format_value",
    "schema_help",
    "flag_pairs",
    "parse_flag_list",
    "IOENGINES",
    "SYNC_IOENGINES",
    "KV_RW",
    "engine_kind",
    "FIO_OPTION_NAMES",
    "unknown_option",
    "option_takes_argument",
    "is_bool_text",
]

_TRUE = {"1", "true", "yes", "on", ""}
_FALSE = {"0", "false", "no", "off"}
_LIFETIME_CLASSES = ("long", "medium", "short")


@dataclasses.dataclass(frozen=True)
class OptionSpec:
    """One key of the job schema.

    Parameters
    ----------
    name : str
        The key, as written in a job file or as ``--name=value``.
    kind : str
        One of ``str``, ``choice``, ``int``, ``float``, ``fraction``, ``size``,
        ``time``, ``bool``, ``int_list``, ``mix`` and ``device`` (``file``, ``sim``
        or a ``/dev/...`` path).
    default : Any
        The embedded default, already typed (what :func:`parse_value` returns).
    help : str
        One line for ``--cmdhelp``.
    choices : tuple of str, optional
        Accepted values of a ``choice`` key.
    minimum : float, optional
        Smallest accepted value of a numeric key.
    maximum : float, optional
        Largest accepted value of a numeric key.
    """

    name: str
    kind: str
    default: Any
    help: str
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None


def _spec(
    name: str,
    kind: str,
    default: Any,
    help: str,
    choices: Sequence[str] | None = None,
    minimum: float | None = None,
    maximum: float | None = None,
) -> OptionSpec:
    return OptionSpec(name, kind, default, help, tuple(choices) if choices else None, minimum, maximum)


#: Workloads: the KV ones are run by the tier manager's runners, the plain ones by
#: :mod:`tierstore.bench.iojobs`.
RW_CHOICES = (
    "kvtrace",
    "kvstore",
    "kvload",
    "kvmixed",
    "read",
    "write",
    "randread",
    "randwrite",
    "randrw",
    "rw",
)
#: The KV workloads (their I/O is a KV block; they report ``kv`` and ``device`` sections).
KV_RW = ("kvtrace", "kvstore", "kvload", "kvmixed")

#: ``ioengine=`` values and the tierstore engine each one runs on (:func:`engine_kind`). tierstore's own
#: names map to themselves; fio's names to the engine that does what fio's does.
IOENGINES: dict[str, str] = {
    "posix": "posix",
    "uring": "uring",
    "auto": "auto",
    "kvikio": "kvikio",
    "memory": "memory",
    "io_uring": "uring",
    "libaio": "uring",
    "posixaio": "posix",
    "psync": "posix",
    "sync": "posix",
    "pvsync": "posix",
    "pvsync2": "posix",
}
#: fio's synchronous engines: one I/O at a time per job clone, whatever ``iodepth`` says (fio: "increasing
#: iodepth beyond 1 will not affect synchronous ioengines").
SYNC_IOENGINES = ("psync", "sync", "pvsync", "pvsync2")

_IOENGINE_HELP = (
    "I/O engine. tierstore's: posix (O_DIRECT preadv/pwritev from iodepth threads per clone), uring "
    "(io_uring: up to iodepth reads/writes queued per io_uring_enter, completions reaped in batches; "
    "plain jobs run this loop in C, tierstore.io._ringloop, where it was built at install, else in "
    "Python, and say which), auto (uring "
    "where this process can use io_uring, else posix with a warning), memory (no file), kvikio (GPUDirect "
    "Storage). fio's names map to them: io_uring -> uring; libaio -> uring (the kernel's other asynchronous "
    "interface; io_uring does the same job: iodepth I/Os in flight from one thread); posixaio -> posix "
    "(glibc's "
    "POSIX AIO is a pool of threads doing pread/pwrite, as posix is); psync, sync, pvsync, pvsync2 -> one "
    "synchronous preadv/pwritev at a time per clone on the O_DIRECT file (fio's synchronous engines ignore "
    "iodepth; numjobs gives parallelism). KV jobs put their NVMe tier through posix or uring the same way."
)


def engine_kind(ioengine: str) -> str:
    """The tierstore engine of an ``ioengine=`` value (:data:`IOENGINES`).

    Parameters
    ----------
    ioengine : str
        A value of :data:`IOENGINES`, e.g. ``"io_uring"`` or ``"posix"``.

    Returns
    -------
    str
        One of ``posix``, ``uring``, ``auto``, ``kvikio``, ``memory``.

    Raises
    ------
    ConfigError
        For a value that is not in :data:`IOENGINES`.
    """
    try:
        return IOENGINES[ioengine]
    except KeyError:
        raise ConfigError(f"ioengine={ioengine!r}: accepted values are {list(IOENGINES)}") from None


#: The schema: every known key with its type, default, accepted values and help.
SCHEMA: dict[str, OptionSpec] = {
    s.name: s
    for s in [
        _spec("name", "str", "", "Job name (defaults to the section name, or to rw without a job file)."),
        _spec("description", "str", "", "Free-text description of the job."),
        _spec("rw", "choice", "kvtrace", "Workload to run.", RW_CHOICES),
        _spec(
            "trace",
            "str",
            "",
            "Mooncake JSONL trace for rw=kvtrace (empty: the packaged 1,000-request excerpt).",
        ),
        _spec(
            "trace_block_size",
            "size",
            32 << 10,
            "rw=kvtrace: bytes stored per 512-token trace block (scaled KV; real Llama-3.1-8B is 64m).",
            minimum=4096,
        ),
        _spec("number_ios", "int", 0, "rw=kvtrace: replay at most this many requests (0: all).", minimum=0),
        _spec(
            "bs",
            "size",
            4096,
            "Plain rw: block size of one I/O. rw=kvstore|kvload|kvmixed: bytes of a request's "
            "prompt (kvmixed: of a conversation's turn), rounded down to whole KV blocks of the layout (at "
            "least one; a warning when it is not "
            "whole blocks); the report's bs and IOPS are per KV block. rw=kvtrace: not used "
            "(trace_block_size sets a "
            "block's bytes, the trace each call's blocks).",
            minimum=1,
        ),
        _spec("size", "size", 64 << 20, "Bytes of the file / working set each job covers.", minimum=1),
        _spec("fragment_size", "size", 0, "Bytes of one KV fragment (per-layer chunk); 0: the layout's own."),
        _spec("iodepth", "int", 1, "Number of I/Os in flight per job.", minimum=1),
        _spec(
            "numjobs",
            "int",
            1,
            "Number of clones of the job (reported as one group), each doing size= of I/O. As in fio, "
            "each clone of a plain job has a file of its own (jobname.N.0) unless filename= is given "
            "(then they share it).",
            minimum=1,
        ),
        _spec(
            "runtime", "time", 0.0, "Stop after this long (0: when size is done). Bare numbers are seconds."
        ),
        _spec("time_based", "bool", False, "Keep running for runtime even when size is done."),
        _spec("ramp_time", "time", 0.0, "Run this long before counting statistics."),
        _spec("ioengine", "choice", "posix", _IOENGINE_HELP, tuple(IOENGINES)),
        _spec("direct", "bool", True, "Open files with O_DIRECT (as fio's direct=1)."),
        _spec(
            "directory",
            "str",
            "",
            "Directory for the job's files (empty: a private temporary directory of its own, "
            "removed when the job ends, also after Ctrl-C or a failure, unless unlink=0 (then kept, "
            "and a line names it); plain and KV jobs alike).",
        ),
        _spec(
            "filename",
            "str",
            "",
            "File (or device) to use; a relative name is under directory=, or, without it, under the "
            "working directory (fio's rule; plain and KV jobs alike).",
        ),
        _spec(
            "unlink",
            "bool",
            True,
            "Remove the files this job created when it ends, also after Ctrl-C/SIGTERM (fio's unlink=; fio's "
            "default is 0). 0 keeps them (in the job's private temporary directory without directory=, which "
            "is then kept and named). A file that existed before the job is never removed.",
        ),
        _spec("layout", "choice", "tiny", "KV layout preset.", ("llama-3.1-8b", "qwen2.5-7b", "tiny")),
        _spec(
            "hbm_size",
            "size",
            256 << 20,
            "Capacity of the HBM (GPU) tier. rw=kvtrace default: 2% of the trace's unique bytes.",
        ),
        _spec(
            "host_size",
            "size",
            1 << 30,
            "Capacity of the pinned host DRAM tier. rw=kvtrace default: 8% of unique bytes.",
        ),
        _spec(
            "nvme_size",
            "size",
            4 << 30,
            "Capacity of the NVMe tier. rw=kvtrace default: 30% of unique bytes.",
        ),
        _spec("eviction", "choice", "lru", "Eviction policy (policies.eviction).", EVICTION.names()),
        _spec(
            "admission",
            "choice",
            "none",
            "SSD admission policy (policies.admission; none = all).",
            ADMISSION.names(),
        ),
        _spec("dataplacement", "choice", "none", "Data placement (fio's dataplacement=).", ("none", "fdp")),
        _spec(
            "plids", "int_list", (), "Indices into the RUH Status list (fio's plids=/fdp_pli=), e.g. 0,1,2."
        ),
        _spec(
            "plid_select",
            "choice",
            "roundrobin",
            "How writes pick a placement ID.",
            ("roundrobin", "random", "lifetime"),
        ),
        _spec(
            "device",
            "device",
            "file",
            "Where the NVMe tier (KV jobs) or the job's I/O (plain jobs) goes: file = a file on this file "
            "system "
            "(directory/filename, through ioengine; WAF from an FTL model observing it), sim = the FTL "
            "model is "
            "the device (data in memory, no disk touched), or an FDP namespace /dev/ngXnY (not verified on "
            "hardware).",
        ),
        _spec(
            "format",
            "bool",
            False,
            "Let a job write over data tierstore did not write: KV jobs format an NVMe tier device "
            "(device=/dev/...) "
            "without tierstore's label (a KV job's file is always new: an existing one is refused whatever "
            "format "
            "says); plain jobs write to a device, or to an existing non-empty file no tierstore job "
            "created. What it holds is lost, as with mkfs. Without it such a target is refused "
            "before anything is written (fio writes without asking).",
        ),
        _spec("device_size", "size", 4 << 30, "Capacity of the (simulated) device.", minimum=1),
        _spec("ru_size", "size", 32 << 20, "Reclaim unit size of the (simulated) device.", minimum=1),
        _spec(
            "op", "fraction", 0.07, "Over-provisioning of the simulated device, a fraction or a percentage."
        ),
        _spec("utilization", "fraction", 0.9, "Share of the device's user capacity the workload fills."),
        _spec(
            "lifetime_mix",
            "mix",
            {"long": 10.0, "medium": 30.0, "short": 60.0},
            "Share of writes per lifetime class, e.g. long:10,medium:30,short:60.",
        ),
        _spec("time_scale", "float", 1.0, "Speed-up of trace time (2: twice as fast).", minimum=0),
        _spec("block_tokens", "int", 16, "Tokens per KV block.", minimum=1),
        _spec(
            "load_blocks",
            "choice",
            "useful",
            "rw=kvload/kvmixed: useful = load the prefix the cost model says beats recompute (what an engine "
            "does); matched = load every matched block (a bandwidth test).",
            ("useful", "matched"),
        ),
        _spec("seed", "int", 0, "Seed of every random choice (fio's randseed)."),
        _spec(
            "rwmixread",
            "int",
            50,
            "rw=randrw|rw: percentage of I/Os that are reads (fio's rwmixread).",
            minimum=0,
            maximum=100,
        ),
        _spec(
            "rwmixwrite",
            "int",
            50,
            "rw=randrw|rw: percentage of I/Os that are writes (fio's rwmixwrite; "
            "rwmixread wins when both are given).",
            minimum=0,
            maximum=100,
        ),
        _spec(
            "stonewall",
            "bool",
            False,
            "Start this job only when every job before it has finished, and start a new "
            "reporting group (fio's stonewall, alias wait_for_previous). Without it, jobs run at once.",
        ),
        _spec(
            "new_group",
            "bool",
            False,
            "Start a new reporting group with this job (it still runs at once with the "
            "jobs before it unless stonewall).",
        ),
        _spec(
            "group_reporting",
            "bool",
            False,
            "Report this job together with the job before it when both are in "
            "one reporting group (fio's rule; set in [global] or before the first --name, a whole group is "
            "one "
            "entry). numjobs clones are always reported as one entry. KV jobs are not merged (their kv and "
            "device "
            "sections are per store): a group that would merge one is refused.",
        ),
    ]
}

#: fio spellings accepted as aliases of schema keys: fio's own aliases of the options tierstore has
#: (``.alias`` in fio's options.c: ``blocksize``, ``readwrite``, ``timeout``, ``data_placement``,
#: ``fdp_pli``, ``fdp_pli_select``, ``wait_for_previous``), ``randseed`` and ``jobname``.
ALIASES: dict[str, str] = {
    "blocksize": "bs",
    "readwrite": "rw",
    "timeout": "runtime",
    "data_placement": "dataplacement",
    "fdp_pli": "plids",
    "fdp_pli_select": "plid_select",
    "randseed": "seed",
    "jobname": "name",
    "wait_for_previous": "stonewall",
}
#: fio spellings accepted as aliases of a key's values.
VALUE_ALIASES: dict[str, dict[str, str]] = {"rw": {"readwrite": "rw"}}

#: fio's option names (``fio --cmdhelp=all`` of fio 3.33, its job options without the I/O engines' own): an
#: unknown key among them is refused as a fio option tierstore bench does not have, not as a typo.
FIO_OPTION_NAMES: frozenset[str] = frozenset(
    """
    allow_file_create allow_mounted_write allrandrepeat atomic ba block_error_percentiles bs bs_unaligned
    bsrange bssplit buffer_compress_chunk buffer_pattern buffered bwavgtime cgroup cgroup_nodelete
    cgroup_weight
    clat_percentiles clocksource continue_on_error cpumask cpus_allowed cpus_allowed_policy create_fsync
    create_on_open create_only create_serialize dedupe_global dedupe_mode dedupe_percentage description direct
    directory disable_clat disable_lat disable_slat disk_util do_verify end_fsync error_dump exec_postrun
    exec_prerun exit_what exitall exitall_on_error experimental_verify fadvise_hint fallocate fdatasync
    file_append file_service_type filename filename_format filesize fill_device flow flow_id flow_sleep fsync
    fsync_on_close gid group_reporting gtod_cpu gtod_reduce ignore_error ignore_zone_limits invalidate io_size
    io_submit_mode iodepth iodepth_batch iodepth_low ioengine iopsavgtime ioscheduler job_max_open_zones
    kb_base lat_percentiles latency_percentile latency_run latency_target latency_window lockfile lockmem
    log_alternate_epoch log_avg_msec log_compression log_compression_cpus log_entries log_hist_coarseness
    log_hist_msec log_max_value log_offset log_prio log_store_compressed log_unix_epoch loops max_latency
    max_open_zones mem merge_blktrace_file merge_blktrace_iters merge_blktrace_scalars name new_group nice
    norandommap nrfiles numa_cpu_nodes numa_mem_policy number_ios numjobs offset offset_align offset_increment
    opendir openfiles overwrite per_job_logs percentage_random percentile_list pre_read prio prioclass profile
    ramp_time random_distribution random_generator randrepeat randseed rate rate_cycle rate_ignore_thinktime
    rate_iops rate_iops_min rate_min rate_process read_beyond_wp read_iolog read_iolog_chunked refill_buffers
    replay_align replay_no_stall replay_redirect replay_scale replay_skip replay_time_scale runtime rw
    rw_sequencer rwmixread rwmixwrite scramble_buffers serialize_overlap significant_figures size
    slat_percentiles startdelay stats steadystate steadystate_duration steadystate_ramp_time stonewall sync
    sync_file_range thinktime thinktime_blocks thinktime_blocks_type thinktime_iotime thinktime_spin thread
    time_based trim_backlog trim_backlog_batch trim_percentage trim_verify_zero uid unified_rw_reporting
    unique_filename unit_base unlink unlink_each_loop verify verify_async verify_backlog verify_backlog_batch
    verify_dump verify_fatal verify_interval verify_offset verify_only verify_pattern verify_state_load
    verify_state_save wait_for write_barrier write_bw_log write_hint write_hist_log write_iolog write_iops_log
    write_lat_log zero_buffers zone_reset_frequency zone_reset_threshold zonecapacity zonemode zonerange
    zonesize zoneskip
""".split()
)


def unknown_option(key: str) -> ConfigError:
    """The error for a key that is not in :data:`SCHEMA` or :data:`ALIASES`: one line saying that a fio option
    (:data:`FIO_OPTION_NAMES`) is not supported, or that the key is unknown, with the nearest known keys."""
    if key in FIO_OPTION_NAMES:
        return ConfigError(
            f"fio option {key!r} is not supported by tierstore bench "
            "(`tierstore bench --cmdhelp` lists the options it accepts)"
        )
    near = difflib.get_close_matches(key, [*SCHEMA, *ALIASES], n=3)
    hint = f"; did you mean {' or '.join(near)}?" if near else ""
    return ConfigError(
        f"{key}: unknown option{hint} (`tierstore bench --cmdhelp` lists the options it accepts)"
    )


def option_takes_argument(key: str) -> bool:
    """Whether ``--key`` needs a value (every key but the booleans, which mean 1 alone), as fio's
    ``getopt_long`` options take one as ``--key=value`` or ``--key value``.

    Raises
    ------
    ConfigError
        For an unknown key (:func:`unknown_option`).
    """
    spec = SCHEMA.get(ALIASES.get(key, key))
    if spec is None:
        raise unknown_option(key)
    return spec.kind != "bool"


def is_bool_text(raw: str) -> bool:
    """Whether ``raw`` is a boolean's value spelt out (``1``, ``0``, ``true``, ``off``...; not empty)."""
    text = raw.strip().lower()
    return bool(text) and (text in _TRUE or text in _FALSE)


def _bad(key: str, raw: Any, what: str) -> ConfigError:
    return ConfigError(f"{key}={raw!r}: {what}")


def _parse_bool(key: str, raw: str) -> bool:
    text = raw.strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise _bad(key, raw, "accepted values are 1/0, true/false, yes/no, on/off")


def _parse_number(key: str, raw: str, conv: Callable[[str], Any], what: str) -> Any:
    try:
        return conv(raw.strip())
    except ValueError:
        raise _bad(key, raw, f"expected {what}") from None


def _parse_fraction(key: str, raw: str) -> float:
    text = raw.strip()
    pct = text.endswith("%")
    value = _parse_number(key, text.rstrip("%"), float, "a fraction such as 0.9 or a percentage such as 90%")
    if pct:
        value /= 100.0
    if not 0.0 <= value <= 1.0:
        raise _bad(key, raw, "expected a fraction in [0, 1] or a percentage in [0%, 100%]")
    return value


def _parse_int_list(key: str, raw: str) -> tuple[int, ...]:
    parts = [p.strip() for p in raw.replace(":", ",").split(",") if p.strip()]
    out = []
    for p in parts:
        if not p.isdigit():
            raise _bad(key, raw, "expected a comma-separated list of non-negative integers such as 0,1,2")
        out.append(int(p))
    return tuple(out)


def _parse_mix(key: str, raw: str) -> dict[str, float]:
    mix: dict[str, float] = {}
    for part in (p.strip() for p in raw.split(",") if p.strip()):
        cls, sep, weight = part.partition(":")
        cls = cls.strip().lower()
        if not sep or cls not in _LIFETIME_CLASSES:
            raise _bad(
                key,
                raw,
                f"expected class:weight pairs with classes {list(_LIFETIME_CLASSES)}, "
                "e.g. long:10,medium:30,short:60",
            )
        w = _parse_number(key, weight, float, "a number as each weight")
        if w < 0:
            raise _bad(key, raw, "weights must be >= 0")
        mix[cls] = w
    if not mix or sum(mix.values()) <= 0:
        raise _bad(key, raw, "at least one weight must be > 0")
    return mix


def _parse_device(key: str, raw: str) -> str:
    text = raw.strip()
    if text.lower() in ("file", "sim"):
        return text.lower()
    if text.startswith("/dev/"):
        return text
    raise _bad(
        key,
        raw,
        "accepted values are file (a file on this file system), sim (the FTL model) or an "
        "NVMe namespace path such as /dev/ng0n1",
    )


def parse_value(key: str, raw: Any) -> Any:
    """Parse and validate one value against :data:`SCHEMA`.

    Parameters
    ----------
    key : str
        A schema key or an alias in :data:`ALIASES`.
    raw : Any
        The value as written (a string), or an already typed value.

    Returns
    -------
    Any
        The typed value: ``int`` bytes for sizes, ``float`` seconds for times,
        ``bool``, ``tuple`` of ints for lists, ``dict`` for mixes.

    Raises
    ------
    ConfigError
        For an unknown key or a bad value; the message names the key, the value
        and what is accepted.
    """
    key = ALIASES.get(key, key)
    spec = SCHEMA.get(key)
    if spec is None:
        raise unknown_option(key)
    if not isinstance(raw, str):
        raw = format_value(key, raw)
    kind = spec.kind
    if kind == "str":
        value: Any = raw.strip()
    elif kind == "choice":
        value = raw.strip().lower()
        value = VALUE_ALIASES.get(key, {}).get(value, value)
        if value not in spec.choices:
            raise _bad(key, raw, f"accepted values are {list(spec.choices)}")
    elif kind == "int":
        value = _parse_number(key, raw, int, "an integer")
    elif kind == "float":
        value = _parse_number(key, raw, float, "a number")
    elif kind == "fraction":
        value = _parse_fraction(key, raw)
    elif kind == "size":
        value = parse_size(raw.strip(), key=key)
    elif kind == "time":
        value = parse_time_s(raw.strip(), key=key)
    elif kind == "bool":
        value = _parse_bool(key, raw)
    elif kind == "int_list":
        value = _parse_int_list(key, raw)
    elif kind == "mix":
        value = _parse_mix(key, raw)
    elif kind == "device":
        value = _parse_device(key, raw)
    else:  # a schema entry with a kind this module does not know is a bug here
        raise ConfigError(f"{key}: schema kind {kind!r} is not supported")
    if spec.minimum is not None and value < spec.minimum:
        raise _bad(key, raw, f"must be >= {spec.minimum:g}")
    if spec.maximum is not None and value > spec.maximum:
        raise _bad(key, raw, f"must be <= {spec.maximum:g}")
    return value


def format_value(key: str, value: Any) -> str:
    """Format a typed value back to the text a job file would hold.

    Parameters
    ----------
    key : str
        The schema key.
    value : Any
        A typed value, or a string (returned unchanged).

    Returns
    -------
    str
        Text that :func:`parse_value` parses back to ``value``.
    """
    if isinstance(value, str):
        return value
    spec = SCHEMA.get(ALIASES.get(key, key))
    if isinstance(value, bool):
        return "1" if value else "0"
    if spec is not None and spec.kind == "size" and isinstance(value, int):
        for suffix, shift in (("g", 30), ("m", 20), ("k", 10)):
            if value and value % (1 << shift) == 0:
                return f"{value >> shift}{suffix}"
        return str(value)
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        return ",".join(f"{k}:{v:g}" for k, v in value.items())
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@dataclasses.dataclass
class JobSpec:
    """One job after parsing: typed options plus the raw text that set them.

    Attributes
    ----------
    name : str
        The job name (section name, ``name=``, or ``rw`` without a job file).
    options : dict
        Every schema key with its typed value (defaults filled in); this is
        what a runner receives.
    explicit : dict
        The keys set by the job file's own section or the command line, as
        written (strings). fio's JSON ``job options`` shows these.
    global_explicit : dict
        The keys set by ``[global]`` (and command-line flags), as written.
    groupid : int
        fio's reporting group: 0 for the first job, one more at each job with
        ``stonewall`` or ``new_group`` after the first (fio's ``add_job``).
    waits_for_previous : bool
        ``stonewall`` on a job after the first: it starts only when every job
        before it has finished. Jobs between two such jobs run at once.
    """

    name: str
    options: dict[str, Any]
    explicit: dict[str, str]
    global_explicit: dict[str, str]
    groupid: int = 0
    waits_for_previous: bool = False


def read_job_file(path: str) -> list[tuple[str, dict[str, str]]]:
    """Read a fio-style INI job file into ordered raw sections.

    Parameters
    ----------
    path : str
        The job file. ``#`` and ``;`` start comments; a boolean key without
        ``=`` (such as ``time_based``) means ``1``, as in fio; any other key
        without a value is an error.

    Returns
    -------
    list of (str, dict)
        ``(section name, {key: raw value})`` in file order; ``global`` included.

    Raises
    ------
    ConfigError
        If the file cannot be read or is not valid INI, or a key that takes a
        value has none.
    """
    parser = configparser.ConfigParser(
        allow_no_value=True,
        interpolation=None,
        strict=False,
        comment_prefixes=("#", ";"),
        inline_comment_prefixes=(";",),
        default_section="\x00none",
    )
    parser.optionxform = str  # keep keys as written (fio keys are lower case anyway)
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        raise ConfigError(f"job file {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"job file {path!r}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    for n, line in enumerate(text.splitlines(), 1):
        if re.match(r"\s*\[[^\]]*$", line):
            raise ConfigError(
                f"job file {path!r}, line {n}: an unclosed section header ({line.strip()!r}); "
                "a job section is [name], as in fio"
            )
        if re.match(r"\s*include\s", line):
            raise ConfigError(
                f"job file {path!r}, line {n}: `include` (fio's job-file directive) is not followed by "
                "tierstore bench: put the included jobs in this file"
            )
    try:
        parser.read_string(_number_sections(text), source=path)
    except configparser.MissingSectionHeaderError as exc:
        raise ConfigError(
            f"job file {path!r}, line {exc.lineno}: option outside of a [] job section "
            f"({exc.line.strip()!r}); options follow a [global] or [job] header, as in fio"
        ) from None
    except configparser.Error as exc:
        raise ConfigError(f"job file {path!r}: {exc.message}") from None
    sections = []
    for numbered in parser.sections():
        section = numbered.rpartition(_NTH)[0]
        raw = {
            k.strip(): (_bare_key(path, section, k.strip()) if v is None else v.strip())
            for k, v in parser.items(numbered)
        }
        sections.append((section, raw))
    return sections


#: Joins a section's name and its place in the file (:func:`_number_sections`).
_NTH = "\x1f"


def _number_sections(text: str) -> str:
    """``text`` with every section header numbered (``[w]`` -> ``[w<_NTH>2]``), so that two
    sections of one name stay two jobs, in file order, as in fio (configparser would merge them:
    trial 11's ``[w] rw=write`` then ``[w] rw=read`` ran one job, the read)."""
    count = iter(range(1 << 62))
    return re.sub(r"^(\s*)\[([^\]\n]+)\]", lambda m: f"{m[1]}[{m[2]}{_NTH}{next(count)}]", text, flags=re.M)


def _bare_key(path: str, section: str, key: str) -> str:
    """The value of a job-file key written without ``=``: ``1`` for a boolean (fio's ``time_based``),
    an error for a key that takes a value (fio's rule; ``size`` alone is not ``size=1``).

    An unknown key passes here as ``1``, so that :func:`_validate_raw` says it is unknown.
    """
    spec = SCHEMA.get(ALIASES.get(key, key))
    if spec is not None and spec.kind != "bool":
        raise ConfigError(
            f"job file {path!r} [{section}]: {key!r} has no value; only boolean options (such as "
            f"direct or time_based) may be written alone: write {key}=VALUE"
        )
    return "1"


def _validate_raw(raw: Mapping[str, str], where: str) -> dict[str, str]:
    out = {}
    for key, value in raw.items():
        canon = ALIASES.get(key, key)
        try:
            parse_value(canon, value)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        out[canon] = value
    return out


def _finish(
    name_hint: str, merged: dict[str, str], explicit: dict[str, str], global_explicit: dict[str, str]
) -> JobSpec:
    options = {k: spec.default for k, spec in SCHEMA.items()}
    for key, value in merged.items():
        options[key] = parse_value(key, value)
    name = options["name"] or name_hint or options["rw"]
    options["name"] = name
    return JobSpec(name, options, explicit, global_explicit)


def parse_jobs(flags: Sequence[str] | Mapping[str, str] = (), job_files: Sequence[str] = ()) -> list[JobSpec]:
    """Build the jobs from job files and ``--key=value`` flags, as fio does.

    Command-line jobs: each ``--name=`` flag starts a new job, which takes the
    flags after it up to the next ``--name=``; the flags before the first
    ``--name=`` are the command line's globals, inherited by every job (fio's
    rule). Without any ``--name=`` all flags are globals and, without job files,
    define one job named after ``rw``.

    Job files: each section after ``[global]`` is a job that inherits the
    file's ``[global]``. The command line's globals override the files' values
    in every job (unlike fio, where a job file's own value wins; kept so that
    ``tierstore bench job.fio --size=1m`` shrinks every job). Command-line jobs
    come first, then the files' jobs, in order (fio's order).

    Then every job gets fio's reporting group (:attr:`JobSpec.groupid`) and
    whether it waits for the jobs before it (``stonewall``).

    Parameters
    ----------
    flags : sequence of str or mapping
        ``--key=value`` (or ``--key`` for a boolean) strings in command-line
        order, or a mapping ``{key: raw value}`` (globals only).
    job_files : sequence of str
        fio-style INI job files, read in order.

    Returns
    -------
    list of JobSpec
        In run order.

    Raises
    ------
    ConfigError
        For an unknown key, a bad value, a job file with no job section, or
        ``group_reporting`` that would merge a KV job with another job.
    """
    if isinstance(flags, Mapping):
        cli_globals, cli_jobs = _validate_raw(flags, "command line"), []
    else:
        cli_globals, cli_jobs = _split_command_line(flag_pairs(flags))
    jobs: list[JobSpec] = []
    for own in cli_jobs:
        jobs.append(_finish("", {**cli_globals, **own}, dict(own), dict(cli_globals)))
    for path in job_files:
        global_raw: dict[str, str] = {}
        found = False
        sections = read_job_file(path)
        for section, raw in sections:
            where = f"{path} [{section}]"
            checked = _validate_raw(raw, where)
            if section == "global":
                global_raw.update(checked)
                continue
            found = True
            merged = {**global_raw, **checked, **cli_globals}
            own = {**checked, **{k: v for k, v in cli_globals.items() if k in checked}}
            jobs.append(_finish(section, merged, own, {**global_raw, **cli_globals}))
        if not found:
            held = "only a [global] section" if sections else "no section at all (empty, or only comments)"
            raise ConfigError(
                f"job file {path!r}: no job section: it holds {held}; a job is a [name] section"
            )
    if not jobs:
        jobs.append(_finish("", dict(cli_globals), dict(cli_globals), {}))
    _assign_groups(jobs)
    return jobs


def _split_command_line(pairs: Sequence[tuple[str, str]]) -> tuple[dict[str, str], list[dict[str, str]]]:
    """``(globals, [job options, ...])``: a ``--name`` starts a job (fio's command line)."""
    globals_raw: list[tuple[str, str]] = []
    jobs: list[list[tuple[str, str]]] = []
    for key, value in pairs:
        if key == "name":  # only --name starts a job, as in fio (--jobname is an alias of the key)
            jobs.append([])
        (jobs[-1] if jobs else globals_raw).append((key, value))
    return (
        _validate_raw(dict(globals_raw), "command line"),
        [_validate_raw(dict(job), f"command line job {dict(job)['name']!r}") for job in jobs],
    )


def _assign_groups(jobs: list[JobSpec]) -> None:
    """fio's ``add_job``: a new reporting group at each ``stonewall``/``new_group`` job after the first;
    ``stonewall`` also makes the job wait for every job before it. Checks ``group_reporting`` merges."""
    groupid = 0
    for i, job in enumerate(jobs):
        starts = job.options["stonewall"] or job.options["new_group"]
        if i and starts:
            groupid += 1
        job.groupid = groupid
        job.waits_for_previous = bool(i and job.options["stonewall"])
    for prev, job in zip(jobs, jobs[1:]):
        if (
            job.options["group_reporting"]
            and job.groupid == prev.groupid
            and (job.options["rw"] in KV_RW or prev.options["rw"] in KV_RW)
        ):
            raise ConfigError(
                f"group_reporting: job {job.name!r} (rw={job.options['rw']}) would be merged with job "
                f"{prev.name!r} (rw={prev.options['rw']}); KV jobs are not merged (their kv and device "
                "sections belong to one store): give one of them new_group or drop group_reporting"
            )


def flag_pairs(flags: Sequence[str]) -> list[tuple[str, str]]:
    """Turn ``["--bs=4k", "--time_based"]`` into ``[("bs", "4k"), ("time_based", "1")]``, in order.

    Raises
    ------
    ConfigError
        For an argument that does not start with ``--``, an unknown key, or a key other than a boolean
        without ``=value`` (fio's "option '--name' requires an argument").
    """
    out: list[tuple[str, str]] = []
    for arg in flags:
        if not arg.startswith("--"):
            raise ConfigError(f"command line: {arg!r}: expected --key=value")
        key, sep, value = arg[2:].partition("=")
        if not sep and option_takes_argument(key):
            raise ConfigError(f"command line: option '--{key}' requires an argument")
        out.append((key, value if sep else "1"))
    return out


def parse_flag_list(flags: Sequence[str]) -> dict[str, str]:
    """Turn ``["--bs=4k", "--time_based"]`` into ``{"bs": "4k", "time_based": "1"}`` (the last value wins).

    Raises
    ------
    ConfigError
        For an argument that does not start with ``--``.
    """
    return dict(flag_pairs(flags))


def showcmd(jobs: Sequence[JobSpec], prog: str = "tierstore bench") -> list[str]:
    """The equivalent command line of each job, as fio's ``--showcmd``.

    Parameters
    ----------
    jobs : sequence of JobSpec
        Parsed jobs.
    prog : str
        The program name to start each line with.

    Returns
    -------
    list of str
        One shell-quoted command line per job, with every non-default key.
    """
    lines = []
    for job in jobs:
        parts = [prog, f"--name={shlex.quote(job.name)}"]
        for key, spec in SCHEMA.items():
            if key == "name":
                continue
            value = job.options[key]
            if value != spec.default:
                parts.append(shlex.quote(f"--{key}={format_value(key, value)}"))
        lines.append(" ".join(parts))
    return lines


def schema_help(key: str | None = None) -> str:
    """Help text of one key, or of every key (fio's ``--cmdhelp``).

    Raises
    ------
    ConfigError
        For an unknown key.
    """
    keys = list(SCHEMA) if not key or key == "all" else [ALIASES.get(key, key)]
    lines = []
    for k in keys:
        spec = SCHEMA.get(k)
        if spec is None:
            raise unknown_option(k)
        accepted = f" [{'|'.join(spec.choices)}]" if spec.choices else f" <{spec.kind}>"
        default = format_value(k, spec.default) or '""'
        lines.append(f"{k:15s}{accepted}: {spec.help} (default: {default})")
    return "\n".join(lines)


def resolve_path(options: Mapping[str, Any], default_name: str) -> str:
    """The file a job uses: ``filename`` under ``directory`` (fio's rule).

    Parameters
    ----------
    options : mapping
        Typed job options.
    default_name : str
        File name when ``filename`` is empty (fio uses ``jobname.0.0``).

    Returns
    -------
    str
        A path, or ``""`` when neither ``directory`` nor ``filename`` is set.
    """
    filename = options.get("filename") or ""
    directory = options.get("directory") or ""
    if filename and (os.path.isabs(filename) or not directory):
        return filename
    if directory:
        return os.path.join(directory, filename or default_name)
    return ""
