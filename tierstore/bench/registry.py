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
"""
from __future__ import annotations

import contextlib
import contextvars
import importlib
import os
import sys
import time
from typing import Any, Callable, Iterable, Iterator

from ..errors import ConfigError
from .result import JobResult

__all__ = [
    "Runner", "register_runner", "get_runner", "registered_runners", "load_runner_modules",
    "RUNNER_MODULES", "BenchProgress", "current_progress", "job_progress",
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
            raise ConfigError(f"rw={name!r}: a runner is already registered ({old.__module__}.{old.__qualname__})")
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
        raise ConfigError(f"rw={rw!r}: no runner is registered for it in this build; "
                          f"available: {sorted(_RUNNERS)}") from None


def registered_runners() -> dict[str, Runner]:
    """A copy of the registry, ``{rw name: runner}``."""
    return dict(_RUNNERS)


class BenchProgress:
    """Progress of the running job, drawn with rich (bar, rate, ETA).

    The bar (drawn on stderr) appears only after ``delay_s`` seconds and only
    when both stdout and stderr are terminals; otherwise every method is a
    cheap no-op. :func:`current_progress` is a context variable: call it in
    the runner's own thread (worker threads do not inherit it). Runners call
    :meth:`start` once and :meth:`update` / :meth:`advance` as they go.

    Parameters
    ----------
    description : str
        Label shown left of the bar (the job name).
    enabled : bool, optional
        Force on/off; default: stdout and stderr are both terminals.
    delay_s : float
        Show the bar only for runs longer than this.
    console : rich.console.Console, optional
        Where to draw (default: a console on stderr).
    """

    def __init__(self, description: str, enabled: bool | None = None, delay_s: float = 2.0,
                 console: Any = None) -> None:
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

    def start(self, total: float | None, unit: str = "") -> None:
        """Set the amount of work (``None``: unknown) and its unit (``"B"``, ``"s"``, ``"req"``)."""
        self.total = total
        self.unit = unit
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

    def _refresh(self) -> None:
        if not self.enabled:
            return
        if self._progress is None:
            if time.monotonic() - self._t0_s < self.delay_s:
                return
            from rich.console import Console
            from rich.progress import (BarColumn, Progress, TaskProgressColumn, TextColumn,
                                       TimeElapsedColumn, TimeRemainingColumn)
            self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(),
                                      TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                      console=self.console or Console(stderr=True), transient=True)
            self._progress.start()
            self._task = self._progress.add_task(self.description, total=self.total)
        self._progress.update(self._task, completed=self.completed)

    def close(self) -> None:
        """Remove the bar (if drawn)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


_CURRENT: contextvars.ContextVar[BenchProgress | None] = contextvars.ContextVar("tierstore_bench_progress",
                                                                                 default=None)


def current_progress() -> BenchProgress:
    """The progress of the job now running (a disabled one outside :func:`job_progress`)."""
    progress = _CURRENT.get()
    return progress if progress is not None else BenchProgress("", enabled=False)


@contextlib.contextmanager
def job_progress(description: str, enabled: bool | None = None, delay_s: float = 2.0) -> Iterator[BenchProgress]:
    """Context in which :func:`current_progress` returns a bar for ``description``.

    Parameters
    ----------
    description : str
        The job name.
    enabled : bool, optional
        Force on/off; default: only when stdout and stderr are terminals.
    delay_s : float
        Show the bar only for runs longer than this.

    Yields
    ------
    BenchProgress
    """
    progress = BenchProgress(description, enabled=enabled, delay_s=delay_s)
    token = _CURRENT.set(progress)
    try:
        yield progress
    finally:
        _CURRENT.reset(token)
        progress.close()
