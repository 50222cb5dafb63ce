"""Runner registry and the progress bar runners report to.

A runner is a callable ``fn(job_options: dict) -> JobResult`` registered for
one or more ``rw=`` names::

    from tierstore.bench.registry import register_runner, current_progress

    def run_kvtrace(options):
        progress = current_progress()
        progress.start(total=options["runtime"], unit="s")
        ...
        progress.update(elapsed_s)
        return JobResult(...)

    register_runner(["kvtrace"], run_kvtrace)

The CLI imports the modules in :data:`RUNNER_MODULES` (and those named in the
environment variable ``TIERSTORE_BENCH_RUNNERS``, comma separated) so their
``register_runner`` calls run before jobs are dispatched.

Continued in ``docs/BENCH.md`` (``tierstore/bench/registry.py``): stopping early; status output.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import importlib
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TextIO

from ..errors import ConfigError, TierStoreError
from ..extras import available
from .result import JobResult

__all__ = [
    "Runner",
    "register_runner",
    "get_runner",
    "registered_runners",
    "load_runner_modules",
    "RUNNER_MODULES",
    "BenchProgress",
    "current_progress",
    "job_progress",
    "StatusOptions",
    "request_stop",
    "stop_requested",
    "stop_signal",
    "reset_stop",
    "info",
    "warn",
    "remove_private_dir",
    "set_info_sink",
    "set_status_options",
    "JobInterrupted",
]

#: ``fn(job_options) -> JobResult``.
Runner = Callable[[dict[str, Any]], JobResult]

#: Modules imported by :func:`load_runner_modules`; a module that does not exist (yet) is skipped.
RUNNER_MODULES = ("tierstore.bench.iojobs", "tierstore.bench.kvjobs", "tierstore.bench.kvsynth")

_RUNNERS: dict[str, Runner] = {}


def register_runner(rw_names: str | Iterable[str], fn: Runner, *, replace: bool = False) -> None:
    """Register ``fn`` as the runner of each ``rw=`` name.

    Parameters
    ----------
    rw_names : str or iterable of str
        Workload names, e.g. ``["kvtrace"]`` or ``"randread"``.
    fn : callable
        ``fn(job_options: dict) -> JobResult``; ``job_options`` holds every
        key of :data:`tierstore.bench.jobfile.SCHEMA`, typed.
    replace : bool
        Allow replacing a runner registered before (tests use this).

    Raises
    ------
    ConfigError
        If a name already has a different runner and ``replace`` is false.
    """
    names = [rw_names] if isinstance(rw_names, str) else list(rw_names)
    for name in names:
        old = _RUNNERS.get(name)
        if old is not None and old is not fn and not replace:
            raise ConfigError(
                f"rw={name!r}: a runner is already registered ({old.__module__}.{old.__qualname__})"
            )
        _RUNNERS[name] = fn


def load_runner_modules() -> None:
    """Import :data:`RUNNER_MODULES` and ``$TIERSTORE_BENCH_RUNNERS`` so they register.

    Raises
    ------
    ImportError
        If a module exists but fails to import (a missing module is skipped).
    """
    extra = [m.strip() for m in os.environ.get("TIERSTORE_BENCH_RUNNERS", "").split(",") if m.strip()]
    for module in (*RUNNER_MODULES, *extra):
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:  # the module exists but one of its imports is missing
                raise


def get_runner(rw: str) -> Runner:
    """The runner of ``rw``.

    Raises
    ------
    ConfigError
        If no runner is registered for ``rw``; the message lists those that are.
    """
    try:
        return _RUNNERS[rw]
    except KeyError:
        raise ConfigError(
            f"rw={rw!r}: no runner is registered for it in this build; available: {sorted(_RUNNERS)}"
        ) from None


def registered_runners() -> dict[str, Runner]:
    """A copy of the registry, ``{rw name: runner}``."""
    return dict(_RUNNERS)


# ------------------------------------------------------------------ stop requests
_STOP = threading.Event()
_STOP_SIGNAL: list[int] = []


def request_stop(signum: int = 0) -> None:
    """Ask the running job to stop early and report what it measured (signal-handler safe)."""
    if not _STOP_SIGNAL:
        _STOP_SIGNAL.append(int(signum))
    _STOP.set()


def stop_requested() -> bool:
    """Whether a stop was requested (runners poll this between operations)."""
    return _STOP.is_set()


def stop_signal() -> int | None:
    """The signal number of the first stop request (0 when not from a signal), or ``None``."""
    return _STOP_SIGNAL[0] if _STOP_SIGNAL else None


def reset_stop() -> None:
    """Clear a stop request (at the start of each ``tierstore bench`` invocation)."""
    _STOP.clear()
    _STOP_SIGNAL.clear()


class JobInterrupted(TierStoreError):
    """A runner that cannot report partial statistics stopped on a stop request."""


# ------------------------------------------------------------------ info lines
_INFO_SINK: list[TextIO | None] = [None]


def set_info_sink(stream: TextIO | None) -> None:
    """Where :func:`info` writes (``None``: stderr)."""
    _INFO_SINK[0] = stream


def info(message: str) -> None:
    """Print one of fio's informational lines (e.g. ``job: Laying out IO file (1 file / 16MiB)``).

    fio prints these with the normal output (stdout); the CLI points the sink at
    stdout for ``--output-format=normal`` without ``--output``, and at stderr
    otherwise, so a JSON report on stdout stays parseable.
    """
    stream = _INFO_SINK[0] or sys.stderr
    stream.write(message.rstrip("\n") + "\n")
    stream.flush()


def warn(message: str) -> None:
    """Print a warning about the job to stderr (``tierstore bench: warning: ...``)."""
    sys.stderr.write(f"tierstore bench: warning: {message}\n")
    sys.stderr.flush()


@dataclasses.dataclass(frozen=True)
class StatusOptions:
    """fio's ``--eta``, ``--eta-newline`` and ``--status-interval`` (see the module doc).

    Attributes
    ----------
    eta : {"auto", "always", "never"}
        ``auto``: a bar on a terminal, status lines on stderr when stdout is not a
        terminal; ``always``: status lines even on a terminal (no bar); ``never``: nothing.
    eta_newline_s : float
        Seconds between status lines (fio's ``--eta-newline``).
    status_interval_s : float
        When > 0, a status line every this many seconds whatever ``eta`` says
        (fio's ``--status-interval``; fio dumps full statistics there, this prints
        the status line).
    """

    eta: str = "auto"
    eta_newline_s: float = 10.0
    status_interval_s: float = 0.0

    def line_interval_s(self, stdout_tty: bool, stderr_tty: bool) -> float | None:
        """Seconds between status lines, or ``None`` for no lines."""
        if self.status_interval_s > 0:
            return self.status_interval_s
        if self.eta == "never":
            return None
        if self.eta == "always" or not stdout_tty:
            return self.eta_newline_s
        return None

    def bar(self, stdout_tty: bool, stderr_tty: bool) -> bool:
        """Whether the rich bar is drawn."""
        return self.eta == "auto" and self.status_interval_s <= 0 and stdout_tty and stderr_tty


_STATUS: list[StatusOptions] = [StatusOptions()]


def set_status_options(options: StatusOptions) -> None:
    """Set the status behaviour of the jobs that follow (the CLI does, from its flags)."""
    _STATUS[0] = options


def _fmt_eta(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h:{m:02d}m:{s:02d}s" if h else f"{m:02d}m:{s:02d}s"


def _fmt_rate(value: float, unit: str) -> str:
    if unit == "B":
        for suffix, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value >= scale:
                return f"{value / scale:.1f}{suffix}/s"
        return f"{value:.0f}B/s"
    if unit == "s":
        return ""
    return f"{value:.1f} {unit or 'op'}/s"


class BenchProgress:
    """Progress of the running job: a rich bar on a terminal, fio-style status lines otherwise.

    The bar (drawn on stderr) appears only after ``delay_s`` seconds and only
    when enabled (default: both stdout and stderr are terminals). With
    ``line_interval_s`` set, a background thread prints a status line to
    ``stream`` (stderr) every ``line_interval_s`` seconds instead, from the last
    reported state, so a stalled phase still shows signs of life. Otherwise every
    method is a cheap no-op. :func:`current_progress` is a context variable:
    call it in the runner's own thread (worker threads do not inherit it).
    Runners call :meth:`start` once and :meth:`update` / :meth:`advance` as they go.

    Parameters
    ----------
    description : str
        Label shown left of the bar, and in the status line (the job name).
    enabled : bool, optional
        Force the bar on/off; default: stdout and stderr are both terminals.
    delay_s : float
        Show the bar only for runs longer than this.
    console : rich.console.Console, optional
        Where to draw (default: a console on stderr).
    line_interval_s : float, optional
        Seconds between status lines; ``None``: no lines.
    stream : file, optional
        Where status lines go (default: stderr).
    """

    def __init__(
        self,
        description: str,
        enabled: bool | None = None,
        delay_s: float = 2.0,
        console: Any = None,
        line_interval_s: float | None = None,
        stream: TextIO | None = None,
    ) -> None:
        self.description = description
        self.console = console
        self.enabled = (sys.stdout.isatty() and sys.stderr.isatty()) if enabled is None else enabled
        self.delay_s = delay_s
        self.total: float | None = None
        self.unit = ""
        self.completed = 0.0
        self._t0_s = time.monotonic()
        self._progress: Any = None
        self._task: Any = None
        self.line_interval_s = line_interval_s
        self.stream = stream
        self.lines = 0
        #: bytes moved so far and their direction ("r"/"w"), for the status line's bandwidth
        self.io_bytes: int | None = None
        self.io_dir = "r"
        self._ticker: threading.Thread | None = None
        self._ticker_stop = threading.Event()

    def start(self, total: float | None, unit: str = "") -> None:
        """Set the amount of work (``None``: unknown) and its unit (``"B"``, ``"s"``, ``"req"``)."""
        self.total = total
        self.unit = unit
        self.completed = 0.0
        self._t0_s = time.monotonic()
        if self._progress is not None:
            self._progress.update(self._task, total=total)

    def update(self, completed: float) -> None:
        """Set the work done so far."""
        self.completed = completed
        self._refresh()

    def advance(self, amount: float = 1.0) -> None:
        """Add ``amount`` to the work done."""
        self.completed += amount
        self._refresh()

    def status_line(self) -> str:
        """fio's ETA line, e.g. ``Jobs: 1 (f=1): [kvtrace(1)][45.0%][12.5 req/s][eta 00m:44s]``."""
        elapsed = max(time.monotonic() - self._t0_s, 1e-9)
        done, total, unit = self.completed, self.total, self.unit
        pct = f"{100.0 * min(done / total, 1.0):.1f}%" if total else "-.-%"
        if unit == "s":
            rate = f"{done:.0f}s/{total:.0f}s" if total else f"{done:.0f}s"
        else:
            rate = _fmt_rate(done / elapsed, unit)
        if total and done > 0:
            eta = _fmt_eta((total - done) * elapsed / done) if unit != "s" else _fmt_eta(total - done)
        else:
            eta = "--m:--s"
        bw = f"[{self.io_dir}={_fmt_rate(self.io_bytes / elapsed, 'B')}]" if self.io_bytes is not None else ""
        return f"Jobs: 1 (f=1): [{self.description}(1)][{pct}][{rate}]{bw}[eta {eta}]"

    def _tick(self) -> None:
        while not self._ticker_stop.wait(self.line_interval_s):
            stream = self.stream or sys.stderr
            try:
                stream.write(self.status_line() + "\n")
                stream.flush()
            except (OSError, ValueError):  # stderr closed (a pipe reader went away): stop printing
                return
            self.lines += 1

    def open(self) -> None:
        """Start the status-line thread (when ``line_interval_s`` is set)."""
        if self.line_interval_s and self.line_interval_s > 0 and self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="bench-status", daemon=True)
            self._ticker.start()

    def _refresh(self) -> None:
        if not self.enabled:
            return
        if self._progress is None:
            if time.monotonic() - self._t0_s < self.delay_s:
                return
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                Progress,
                TaskProgressColumn,
                TextColumn,
                TimeElapsedColumn,
                TimeRemainingColumn,
            )

            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                TextColumn("ETA"),
                TimeRemainingColumn(),
                console=self.console or Console(stderr=True),
                transient=True,
            )
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=self.total)
        self._progress.update(self._task, completed=self.completed)

    def close(self) -> None:
        """Remove the bar (if drawn) and stop the status lines."""
        self._ticker_stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


_CURRENT: contextvars.ContextVar[BenchProgress | None] = contextvars.ContextVar(
    "tierstore_bench_progress", default=None
)


def current_progress() -> BenchProgress:
    """The progress of the job now running (a disabled one outside :func:`job_progress`)."""
    progress = _CURRENT.get()
    return progress if progress is not None else BenchProgress("", enabled=False)


@contextlib.contextmanager
def job_progress(
    description: str,
    enabled: bool | None = None,
    delay_s: float = 2.0,
    status: StatusOptions | None = None,
    bar_allowed: bool = True,
) -> Iterator[BenchProgress]:
    """Context in which :func:`current_progress` returns the progress of ``description``.

    Parameters
    ----------
    description : str
        The job name.
    enabled : bool, optional
        Force the bar on/off; default: from ``status`` and the terminals.
    delay_s : float
        Show the bar only for runs longer than this.
    status : StatusOptions, optional
        Bar vs status lines (default: what :func:`set_status_options` set).
    bar_allowed : bool
        False for a job that runs at once with others: no bar (one live bar per
        terminal), the status lines as ``status`` says.

    Yields
    ------
    BenchProgress
    """
    status = status or _STATUS[0]
    out_tty, err_tty = sys.stdout.isatty(), sys.stderr.isatty()
    bar = (status.bar(out_tty, err_tty) and bar_allowed) if enabled is None else enabled
    lines = None if enabled is not None else status.line_interval_s(out_tty, err_tty)
    if bar and not available("rich"):  # the core install: fio's status lines instead of the bar
        bar = False
        lines = lines or status.eta_newline_s
    progress = BenchProgress(description, enabled=bar, delay_s=delay_s, line_interval_s=lines)
    progress.open()
    token = _CURRENT.set(progress)
    try:
        yield progress
    finally:
        _CURRENT.reset(token)
        progress.close()


def remove_private_dir(options: Mapping[str, Any], path: str) -> None:
    """Remove a job's private temporary directory, unless ``unlink=0`` and a file is left in it:
    then it is kept, and a line says where (fio's ``unlink=0`` keeps the job's files)."""
    if not options.get("unlink", True) and os.path.isdir(path) and os.listdir(path):
        info(f"{options.get('name') or options['rw']}: unlink=0: the job's files are kept in {path}")
        return
    shutil.rmtree(path, ignore_errors=True)
