"""The load gate: "copy into the engine's buffer" and "give up at the deadline" exclude each other.

A load with a deadline hands one :class:`LoadGate` to every copy into its destinations (memory
scatters, NVMe reads, remote fetches). :meth:`LoadGate.close`, called at the deadline, waits for a
copy in progress and stops later ones, so the engine's buffers are never written behind its back.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence


class LoadGate:
    """Makes "copy into the engine's buffer" and "give up at the deadline" exclusive.

    A load with a deadline hands this gate to every copy into its
    destinations. :meth:`close` (at the deadline) waits for a copy in progress
    and stops later ones; the late I/O then completes into nothing, and the
    caller reports those blocks as misses, so the engine recomputes them while
    its buffers are never written behind its back.
    """

    def __init__(self, deadline_s: float | None = None) -> None:
        """``deadline_s``: a :func:`time.monotonic` time after which no copy starts, even
        before :meth:`close` runs (a thread that closes at the deadline may be scheduled
        late, or wait behind copies that take the lock back one after another)."""
        self._lock = threading.Lock()
        self.closed = False
        self.deadline_s = deadline_s
        self.delivered: set[int] = set()

    @contextlib.contextmanager
    def enter(self, indices: Sequence[int]) -> Iterator[bool]:
        """Context manager yielding ``True`` if the copy of ``indices`` may proceed."""
        with self._lock:
            if self.closed or (self.deadline_s is not None and time.monotonic() >= self.deadline_s):
                yield False
                return
            yield True
            self.delivered.update(indices)

    def close(self) -> set[int]:
        """Stop further copies; return the indices delivered so far."""
        with self._lock:
            self.closed = True
            return set(self.delivered)

    def at(self, positions: Sequence[int]) -> GateView:
        """This gate for a call that moves part of the load: its block ``j`` is block
        ``positions[j]`` of the load (an NVMe read or a remote fetch of the blocks found there)."""
        return GateView(self, positions)


class GateView:
    """A :class:`LoadGate` as a call moving part of its load sees it (:meth:`LoadGate.at`).

    Parameters
    ----------
    gate : LoadGate
    positions : sequence of int
        Per block of the call, its position in the load.
    """

    __slots__ = ("gate", "positions")

    def __init__(self, gate: LoadGate, positions: Sequence[int]) -> None:
        self.gate = gate
        self.positions = list(positions)

    def enter(self, indices: Sequence[int]) -> contextlib.AbstractContextManager[bool]:
        """:meth:`LoadGate.enter` for the call's blocks ``indices`` (at their load positions)."""
        pos = self.positions
        return self.gate.enter([pos[j] for j in indices])
