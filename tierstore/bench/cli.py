"""``tierstore bench``: a fio-like command line for tierstore's workloads.

Usage::

    tierstore bench [options] [--key=value ...] [jobfile ...]

Job files are fio INI files (:mod:`tierstore.bench.jobfile`); every schema key
is also a ``--key=value`` (or ``--key value``) flag. As in fio, each ``--name=`` on the command line
starts a job that inherits the flags given before the first ``--name=`` (which
also override the job files' values); command-line jobs come before the files'
jobs. Without ``--name=`` or a job file the flags define one job.

Continued in ``docs/BENCH.md`` (``tierstore/bench/cli.py``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence

from ..errors import ConfigError, TierStoreError
from ..extras import require
from ..units import parse_time_s
from . import output as out_mod
from .jobfile import JobSpec, is_bool_text, option_takes_argument, parse_jobs, schema_help, showcmd
from .plot import plot_results
from .registry import (
    JobInterrupted,
    StatusOptions,
    get_runner,
    job_progress,
    load_runner_modules,
    request_stop,
    reset_stop,
    set_info_sink,
    set_status_options,
    stop_requested,
    stop_signal,
    warn,
)
from .result import JobResult, merge_results

__all__ = ["main", "group_reports"]

PROG = "tierstore bench"
#: ``--help``: plain text for a terminal (the module docstring is reST for the docs)
HELP = """usage: tierstore bench [options] [--key=value ...] [jobfile ...]

A fio-like benchmark of tierstore's workloads. Job files are fio INI files; every job key is also
a --key=value (or --key value) flag. As in fio, each --name= starts a job that inherits the flags
given before the first --name=; without --name= or a job file the flags define one job.

  --rw=W                 kvtrace (default: a request trace through the store), kvstore, kvload,
                         kvmixed; read, write, randread, randwrite, randrw, rw (plain file I/O)
  --cmdhelp[=KEY]        every job key with its values and default (or one key)
  --parse-only           validate the jobs and exit 0
  --showcmd              print each job's equivalent command line and exit
  --output-format=F      normal, json, json+ or terse (comma-combined; --minimal is terse)
  --output=FILE          write the report to FILE instead of stdout (replaces FILE, as fio does)
  --plot=DIR             write PNG charts to DIR (needs tierstore[bench])
  --eta=WHEN             auto, always or never (status lines on stderr when not a terminal)
  --eta-newline=T        seconds between status lines (default 10)
  --status-interval=T    a status line every T seconds, terminal or not
  --version              print the version (tierstore-X.Y.Z, as fio prints fio-3.33)

Ctrl-C or SIGTERM stops the running job, prints what it measured and removes the files it
created (exit status 128 + the signal). Exit status: 0, or 1 for a bad job or a failed one (its
err= is the errno, as fio's). More: docs/BENCH.md in the source tree."""
_VALUE_FLAGS = {
    "output-format",
    "output_format",
    "output",
    "plot",
    "cmdhelp",
    "eta",
    "eta-newline",
    "eta_newline",
    "status-interval",
    "status_interval",
    "terse-version",
    "terse_version",
}
_BOOL_FLAGS = {"parse-only", "parse_only", "showcmd", "help", "version", "minimal"}


def _split_argv(argv: Sequence[str]) -> tuple[dict[str, str | bool], list[str], list[str]]:
    """Separate the command's own flags, the job-key flags (as ``--key=value``) and the job files.

    As fio's ``getopt_long``, an option that takes a value takes it as ``--key=value`` or as the next
    argument (``--bs 4k``); a boolean key alone means 1 and takes the next argument only when it is a
    boolean's value (``--direct 0``). A missing value (the last argument, or another ``--option``) is
    fio's "option '--name' requires an argument".
    """
    own: dict[str, str | bool] = {}
    keys: list[str] = []
    files: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        arg, i = args[i], i + 1
        if arg in ("-h",):
            own["help"] = True
            continue
        if not arg.startswith("--"):
            files.append(arg)
            continue
        name, sep, value = arg[2:].partition("=")
        if name in _BOOL_FLAGS:
            own[name.replace("_", "-")] = True
            continue
        if name in _VALUE_FLAGS:
            takes = not sep and name != "cmdhelp"
        else:
            takes = not sep and option_takes_argument(name)
            if not sep and not takes and i < len(args) and is_bool_text(args[i]):
                takes = True  # a boolean given as --direct 0
        if takes:
            if i == len(args) or args[i].startswith("--"):
                raise ConfigError(f"command line: option '--{name}' requires an argument")
            value, i = args[i], i + 1
        if name in _VALUE_FLAGS:
            own[name.replace("_", "-")] = value
        else:
            keys.append(f"--{name}={value}" if sep or takes else arg)
    return own, keys, files


def _error(message: str) -> int:
    print(f"{PROG}: error: {message}", file=sys.stderr)
    return 1


def _status_options(own: dict) -> StatusOptions:
    eta = str(own.get("eta", "auto")).strip().lower()
    if eta not in ("auto", "always", "never"):
        raise ConfigError(f"eta={eta!r}: accepted values are ['auto', 'always', 'never']")
    newline = parse_time_s(str(own["eta-newline"]), key="eta-newline") if "eta-newline" in own else 10.0
    interval = (
        parse_time_s(str(own["status-interval"]), key="status-interval") if "status-interval" in own else 0.0
    )
    if newline <= 0:
        raise ConfigError(f"eta-newline={own['eta-newline']!r}: must be > 0")
    if interval < 0:
        raise ConfigError(f"status-interval={own['status-interval']!r}: must be >= 0")
    return StatusOptions(eta, newline, interval)


@contextlib.contextmanager
def _stop_on_signals() -> Iterator[None]:
    """First SIGINT/SIGTERM: ask the job to stop and report (fio's behaviour); a second one interrupts."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame) -> None:
        if stop_requested():
            raise KeyboardInterrupt
        print(f"{PROG}: terminating on signal {signum}", file=sys.stderr)
        request_stop(signum)

    old = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, h in old.items():
            signal.signal(sig, h)


class _LibraryWarnings(logging.Handler):
    """tierstore's own log warnings during a run (a full disk, a tier larger than the free space, an
    io_uring fallback), printed once each as the command's ``tierstore bench: warning: ...`` lines."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            warn(record.getMessage())
        except Exception:  # noqa: BLE001 (a broken format string: logging's own report, never a dead job)
            self.handleError(record)


@contextlib.contextmanager
def _library_warnings() -> Iterator[None]:
    log = logging.getLogger("tierstore")
    handler = _LibraryWarnings()
    log.addHandler(handler)
    try:
        yield
    finally:
        log.removeHandler(handler)


def _report_error(result: JobResult) -> None:
    """fio's error line for a job that failed: ``fio: pid=N, err=5/..., error=...``."""
    name = errno.errorcode.get(result.error, str(result.error))
    print(
        f"{PROG}: job {result.jobname!r}: pid={os.getpid()}, err={result.error} ({name}), "
        f"error={result.error_message or os.strerror(result.error)}",
        file=sys.stderr,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tierstore bench`` with ``argv`` (default ``sys.argv[1:]``).

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments after the program name.

    Returns
    -------
    int
        Exit status: 0 on success, 1 on a configuration error or a failed job.
    """
    cmd = _parse(list(sys.argv[1:] if argv is None else argv))
    if isinstance(cmd, int):
        return cmd
    specs = cmd.specs
    results: list[JobResult | None] = [None] * len(specs)
    reset_stop()
    set_status_options(cmd.status)
    # fio prints its informational lines ("Laying out IO file") with the normal report
    set_info_sink(sys.stdout if cmd.formats == ["normal"] and not cmd.own.get("output") else sys.stderr)
    try:
        with _stop_on_signals(), _library_warnings():
            for batch in _batches(specs):
                if stop_requested():
                    break
                rc = _run_batch(batch, [cmd.runners[i] for i in batch], [specs[i] for i in batch], results)
                if rc:
                    return rc
    finally:
        set_info_sink(None)
    ran = [(r, spec) for r, spec in zip(results, specs) if r is not None]
    for r, _ in ran:
        if r.error:
            _report_error(r)
    if not ran and stop_signal():
        return 128 + stop_signal()
    rc = _write_report(cmd, ran, results)
    if rc:
        return rc
    sig = stop_signal()
    if sig:
        return 128 + sig
    return 1 if any(r.error for r, _ in ran) else 0


@dataclasses.dataclass
class _Command:
    """A parsed command line that runs jobs: the command's own flags, the report formats, the status
    line options, the jobs and each job's runner."""

    own: dict[str, str | bool]
    formats: list[str]
    status: StatusOptions
    specs: list[JobSpec]
    runners: list


def _parse(argv: list[str]) -> _Command | int:
    """The command line's jobs, or the exit status of a command that ends here (``--help``,
    ``--version``, ``--cmdhelp``, ``--showcmd``, ``--parse-only``, a bad flag or job: 1)."""
    try:
        own, key_flags, files = _split_argv(argv)
        if own.get("help"):
            print(HELP)
            return 0
        if own.get("version"):
            print(out_mod.FIO_VERSION)
            return 0
        if "cmdhelp" in own:
            try:
                print(schema_help(str(own["cmdhelp"]) or None), flush=True)
            except BrokenPipeError:  # `--cmdhelp | head`: the reader left; not an error
                os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        formats = out_mod.parse_output_formats(
            "terse"
            if own.get("minimal") and "output-format" not in own
            else str(own.get("output-format", "normal"))
        )
        if "terse-version" in own and str(own["terse-version"]).strip() != str(out_mod.TERSE_VERSION):
            raise ConfigError(
                f"terse-version={own['terse-version']!r}: only {out_mod.TERSE_VERSION} is written "
                "(fio's default)"
            )
        status = _status_options(own)
        specs = parse_jobs(key_flags, files)
        if own.get("showcmd"):
            print("\n".join(showcmd(specs, PROG)))
            return 0
        if own.get("parse-only"):
            return 0
        load_runner_modules()
        runners = [get_runner(spec.options["rw"]) for spec in specs]
        if own.get("plot"):  # before the run, not after it
            require("matplotlib", "--plot")
    except (ConfigError, ValueError) as exc:
        return _error(str(exc))
    return _Command(own, formats, status, specs, runners)


def _write_report(
    cmd: _Command, ran: list[tuple[JobResult, JobSpec]], results: list[JobResult | None]
) -> int:
    """Render the report of the jobs that ran to ``--output`` or stdout, and the ``--plot`` charts;
    returns 0, or 1 after saying which file could not be written."""
    own = cmd.own
    merged, merged_specs = group_reports([r for r, _ in ran], [spec for _, spec in ran])
    report = out_mod.render(merged, merged_specs, cmd.formats)
    if own.get("output"):
        try:
            with open(str(own["output"]), "w", encoding="utf-8") as fh:
                fh.write(report)
        except OSError as exc:
            return _error(f"output={own['output']!r}: {exc.strerror}")
    else:
        sys.stdout.write(report)
        sys.stdout.flush()
    if own.get("plot"):
        try:
            for path in plot_results(results, str(own["plot"])):
                print(f"plot: {path}", file=sys.stderr)
        except OSError as exc:
            return _error(f"plot={own['plot']!r}: {exc.strerror}")
    return 0


def _batches(specs: Sequence[JobSpec]) -> list[list[int]]:
    """Indices of the jobs that start together: a new batch at each job that waits for the ones before it
    (``stonewall``), as fio's ``run_threads`` starts every job up to the next stonewall at once."""
    batches: list[list[int]] = []
    for i, spec in enumerate(specs):
        if not batches or spec.waits_for_previous:
            batches.append([])
        batches[-1].append(i)
    return batches


def _run_batch(batch: list[int], runners: list, specs: list[JobSpec], results: list[JobResult | None]) -> int:
    """Run the jobs of one batch at once (one job: in this thread); returns 0 or 1 (a job could not run).

    Each job runs in its own thread; a stop request (the first Ctrl-C) reaches every runner, which stops
    and reports. The rich bar is drawn only for a batch of one (several live bars cannot share a terminal);
    status lines are printed per job.
    """
    if len(batch) == 1:
        return _run_one(specs[0], runners[0], results, batch[0], bar=True)
    codes = [0] * len(batch)

    def work(k: int) -> None:
        codes[k] = _run_one(specs[k], runners[k], results, batch[k], bar=False)

    threads = [
        threading.Thread(target=work, args=(k,), name=f"job-{specs[k].name}") for k in range(len(batch))
    ]
    for t in threads:
        t.start()
    try:
        for t in threads:
            while t.is_alive():
                t.join(0.1)
    except (
        KeyboardInterrupt
    ):  # a second signal: the runners were asked to stop by the first; let them clean up
        request_stop(signal.SIGINT)
        for t in threads:
            t.join()
        raise
    return max(codes)


def group_reports(
    results: Sequence[JobResult], specs: Sequence[JobSpec]
) -> tuple[list[JobResult], list[JobSpec]]:
    """fio's ``group_reporting``: a job that sets it and shares the previous job's reporting group is
    reported in the same entry (fio's ``__show_run_stats``); the others stay entries of their own.

    Parameters
    ----------
    results : sequence of JobResult
        What ran, in job order.
    specs : sequence of JobSpec
        Their parsed jobs.

    Returns
    -------
    (list of JobResult, list of JobSpec)
        One entry per report unit, with the spec whose ``job options`` fio shows (the last member's).
    """
    units: list[list[int]] = []
    for i, spec in enumerate(specs):
        if units and spec.options.get("group_reporting") and specs[units[-1][-1]].groupid == spec.groupid:
            units[-1].append(i)
        else:
            units.append([i])
    out_results = [
        merge_results([results[i] for i in unit]) if len(unit) > 1 else results[unit[0]] for unit in units
    ]
    return out_results, [specs[unit[-1]] for unit in units]


def _run_one(spec, runner, results: list[JobResult | None], index: int, bar: bool = True) -> int:
    """Run one job into ``results[index]``; returns 0, or 1 after printing why it could not run."""
    try:
        with job_progress(spec.name, bar_allowed=bar):
            opts = dict(spec.options)
            opts["_explicit"] = frozenset(spec.explicit) | frozenset(spec.global_explicit)
            result = runner(opts)
    except JobInterrupted as exc:
        print(f"{PROG}: job {spec.name!r}: {exc}", file=sys.stderr)
        return 0
    except TierStoreError as exc:
        return _error(f"job {spec.name!r}: {exc}")
    except OSError as exc:  # a device/file that cannot be opened or sized: say which, no traceback
        where = f" ({exc.filename})" if exc.filename else ""
        hint = ""
        if exc.errno in (errno.ENOMEM, errno.EFBIG, errno.ENOSPC):
            hint = (
                "; the tier capacities (hbm_size, host_size, nvme_size, device_size) do not fit this machine"
            )
        return _error(f"job {spec.name!r}: {exc.strerror or exc}{where}{hint}")
    except MemoryError:
        return _error(
            f"job {spec.name!r}: cannot allocate memory; the tier capacities (hbm_size, host_size, "
            "nvme_size, device_size) do not fit this machine"
        )
    except RuntimeError as exc:  # torch reports a failed allocation as a RuntimeError
        if "allocate" not in str(exc):
            raise
        return _error(
            f"job {spec.name!r}: cannot allocate memory for the memory tiers "
            f"(hbm_size={spec.options.get('hbm_size')}, host_size={spec.options.get('host_size')})"
        )
    result.groupid = spec.groupid
    results[index] = result
    return 0


if __name__ == "__main__":
    sys.exit(main())
