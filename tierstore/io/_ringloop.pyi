"""Types of the C module built from _ringloop.c (see its ``run`` docstring and
tierstore.io.ring.run_fixed_turns)."""

from typing import Any

def run(
    sq: Any,
    cq: Any,
    sqes: Any,
    fd: int,
    layout: tuple[int, int, int, int, int, int, int, int, int],
    state: Any,
    offsets: Any,
    opcodes: Any,
    tags: Any,
    log: Any,
    deadline_ns: int,
    return_ns: int,
    wait_nr: int,
    drain: bool,
    /,
) -> tuple[int, int, int, int, int, int, int, int]: ...
