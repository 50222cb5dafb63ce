"""The README's commands name paths that exist in a fresh clone (issue 19, item 11)."""

from __future__ import annotations

import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
DOCS = [
    "README.md",
    "tierstore/server/README.md",
    "bench/jobs/kvtrace.fio",
    *sorted(str(p.relative_to(REPO)) for p in [*REPO.glob("bench/*.md"), *REPO.glob("docs/*.md")]),
]


def _command_lines(text: str) -> list[str]:
    """Lines of ```bash blocks, and ';' comment lines of job files, that run tierstore or python."""
    lines = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S):
        lines += block.splitlines()
    lines += [ln.lstrip("; ") for ln in text.splitlines() if ln.startswith(";")]
    return [ln for ln in lines if "tierstore " in ln or "python" in ln]


@pytest.mark.parametrize("doc", DOCS)
def test_paths_in_commands_exist_from_the_checkout_root(doc):
    text = (REPO / doc).read_text()
    downloaded = set(re.findall(r"curl -LO \S+/([^/\s]+)", text))
    checked = 0
    for line in _command_lines(text):
        assert "PATH/TO" not in line, line
        for path in re.findall(
            r"(?:--trace=|--config |\s)((?:\.\./|/)?[\w./-]+\.(?:jsonl|fio|yaml|py))\b", line
        ):
            if path.startswith(
                ("/work/shared/", "/tmp/")
            ):  # the workspace copy; an output the command writes
                continue
            assert not path.startswith("../"), f"{doc}: {path!r} only works from one directory"
            if path in downloaded:  # fetched by a curl line of the same document
                continue
            assert (REPO / path).exists(), (
                f"{doc}: {line.strip()!r} names {path!r}, which a clone does not have"
            )
            checked += 1
    assert checked or doc != "README.md"


def test_readme_says_where_the_full_trace_comes_from():
    text = (REPO / "README.md").read_text()
    assert "FAST25-release/traces/conversation_trace.jsonl" in text and "Apache-2.0" in text
    assert "https://github.com/kvcache-ai/Mooncake" in text
    assert "/work/shared/traces/mooncake_conversation_trace.jsonl" in text
    assert (REPO / "tierstore" / "data" / "mooncake_excerpt.jsonl").exists()
