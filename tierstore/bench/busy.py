"""Busy competitors: CPU-bound processes that run beside a measurement.

An engine's host is busy (tokenizers, schedulers, sampling, other engines), so the benchmarks
measure their hot paths quiet and with competitors (house rule 6). A competitor is a Python spin
loop in a process of its own, started before the measured block and killed and reaped after it.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from collections.abc import Iterator

#: Seconds the competitors run before the block starts, so the scheduler has placed them.
SETTLE_S = 0.5


@contextlib.contextmanager
def competitors(n: int) -> Iterator[list[subprocess.Popen]]:
    """Run ``n`` spin-loop processes (``while True: pass``) for the duration of the block.

    Parameters
    ----------
    n : int
        How many; ``0`` (or less) runs the block alone.

    Yields
    ------
    list of subprocess.Popen
        The competitors (empty for ``n <= 0``); all killed and reaped when the block ends.
    """
    if n <= 0:
        yield []
        return
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(SETTLE_S)
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
