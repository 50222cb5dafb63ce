"""``tierstore bench``: a fio-like benchmark CLI for the tiered KV store.

Modules
-------
jobfile   fio INI job files, ``--key=value`` flags, the typed option schema.
result    :class:`JobResult` / :class:`DirectionResult`, what every runner returns.
registry  ``register_runner(rw_names, fn)`` and the progress bar runners report to.
output    fio's ``normal``, ``json`` and ``json+`` reports (plus ``kv``/``device``).
fiostat   fio's latency histogram, percentiles and buckets.
plot      ``--plot=DIR`` PNGs.
iojobs    the plain ``rw=read|write|randread|randwrite`` runner.
cli       ``main(argv) -> int``.

A runner plugs in with::

    from tierstore.bench import JobResult, register_runner
    register_runner(["kvtrace"], run_kvtrace)   # run_kvtrace(options: dict) -> JobResult
"""

from __future__ import annotations

from .registry import current_progress, get_runner, job_progress, register_runner, registered_runners
from .result import CpuUsage, DirectionRecorder, DirectionResult, JobResult

__all__ = [
    "JobResult",
    "DirectionResult",
    "DirectionRecorder",
    "CpuUsage",
    "register_runner",
    "get_runner",
    "registered_runners",
    "current_progress",
    "job_progress",
]
