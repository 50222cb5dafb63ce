"""The ``tierstore`` console entry: how it ends when its reader goes away."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("args", [["bench", "--help"], ["--help"], ["version"]])
def test_output_into_a_closed_pipe_ends_quietly_with_141(args: list[str]) -> None:
    """``tierstore bench --help | head -1`` once ``head`` has gone: no traceback, status 141.

    The pipe's read end is closed before the command starts, so its first write fails with
    EPIPE every time (no race with a real ``head``). Before the fix the ``print`` raised
    ``BrokenPipeError`` and the user saw a traceback.
    """
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    try:
        done = subprocess.run(
            [sys.executable, "-c", "import sys; from tierstore.cli import _entry; sys.exit(_entry())", *args],
            stdout=write_fd,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_fd)
    assert "Traceback" not in done.stderr, done.stderr
    assert "BrokenPipeError" not in done.stderr, done.stderr
    assert done.returncode == 141


def test_output_into_an_open_pipe_is_unchanged() -> None:
    """The ordinary case: the whole help text arrives and the status is 0."""
    done = subprocess.run(
        [sys.executable, "-c", "import sys; from tierstore.cli import _entry; sys.exit(_entry())", "version"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("tierstore ")
