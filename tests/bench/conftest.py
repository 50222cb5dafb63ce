"""Shared helpers of the benchmark CLI tests."""

from __future__ import annotations

import json
import pathlib

import pytest

from tierstore.bench import iojobs  # noqa: F401  (registers rw=read|write|randread|randwrite before tests swap the registry)
from tierstore.bench.cli import main

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
REPO = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def run_bench(capsys):
    """Run ``tierstore bench`` in-process; returns ``(rc, stdout, stderr)``."""

    def _run(*argv: str) -> tuple[int, str, str]:
        rc = main(list(argv))
        captured = capsys.readouterr()
        return rc, captured.out, captured.err

    return _run


@pytest.fixture
def bench_json(tmp_path, run_bench):
    """Run a short memory-engine job with JSON output; returns the parsed document."""

    def _run(*extra: str, fmt: str = "json") -> dict:
        out = tmp_path / "out.json"
        rc, _, err = run_bench(
            "--ioengine=memory", "--size=4m", "--bs=4k", f"--output-format={fmt}", f"--output={out}", *extra
        )
        assert rc == 0, err
        return json.loads(out.read_text())

    return _run
