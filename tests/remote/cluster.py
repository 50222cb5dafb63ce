"""Test harness: a ``mooncake_master`` on 127.0.0.1 and worker processes.

:class:`Master` is :class:`tierstore.remote.local_master.LocalMaster` (loopback
ports, 500 ms read leases, 2 s client TTL: see there) plus the options a test
worker takes. :class:`WorkerProc` runs tests/remote/worker.py, one MooncakeTier
per process.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from tierstore.remote.local_master import LocalMaster

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKER = pathlib.Path(__file__).with_name("worker.py")


class Master(LocalMaster):
    """:class:`LocalMaster` with the options a test worker needs."""

    def settings(self, **kw) -> dict:
        """Worker options (``RemoteConfig`` fields, ``MooncakeTuning`` knobs, ``block_bytes``) for this
        master."""
        d = {
            "master": self.address,
            "metadata": self.metadata,
            "local_hostname": "127.0.0.1",
            "segment_bytes": 64 << 20,
            "local_buffer_bytes": 16 << 20,
            "publish_queue_blocks": 64,
            "timeout_s": 3.0,
            "block_bytes": 256 << 10,
            "reconnect_backoff_s": (0.1, 1.0),
        }
        d.update(kw)
        return d


class WorkerProc:
    """A tests/remote/worker.py process (one MooncakeTier)."""

    def __init__(
        self,
        opts: dict,
        workdir: pathlib.Path,
        name: str,
        ready_timeout_s: float = 90,
        script: pathlib.Path = WORKER,
    ) -> None:
        self.name = name
        self._ready: dict | None = None
        self._exit_sent = False
        self._ready_timeout_s = ready_timeout_s
        self.log_path = pathlib.Path(workdir) / f"worker-{name}.log"
        env = dict(
            os.environ,
            PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
            MC_TCP_BIND_ADDRESS="127.0.0.1",
        )
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [sys.executable, str(script), json.dumps(opts)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            env=env,
            cwd=workdir,
            start_new_session=True,
        )
        log.close()

    @property
    def ready(self) -> dict:
        """The worker's first line (``{"ready": tier state}``); waits for it.
        Workers start in parallel: spawning does not wait (importing torch takes seconds)."""
        if self._ready is None:
            self._ready = self._reply(self._ready_timeout_s)
        return self._ready

    def wait_ready(self) -> dict:
        """Wait for the worker's first line (:attr:`ready`) and return it."""
        return self.ready

    def _reply(self, timeout_s: float) -> dict:
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            if not sel.select(timeout_s):
                raise TimeoutError(f"worker {self.name}: no reply in {timeout_s} s; log: {self.log_tail()}")
        finally:
            sel.close()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker {self.name} exited {self.proc.poll()}: {self.log_tail()}")
        return json.loads(line)

    def send(self, op: str, **kw) -> None:
        """Send a command without waiting for its reply (read it with :meth:`reply`)."""
        self.wait_ready()
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()

    def reply(self, timeout_s: float = 60) -> dict:
        return self._reply(timeout_s)

    def call(self, op: str, timeout_s: float = 60, **kw) -> dict:
        self.wait_ready()
        self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
        self.proc.stdin.flush()
        return self._reply(timeout_s)

    def kill9(self) -> None:
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)

    def request_exit(self) -> None:
        """Ask the worker to close its tier and exit (:meth:`close` waits for it)."""
        if self.proc.poll() is None and not self._exit_sent:
            try:
                self.wait_ready()
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self._exit_sent = True
            except (TimeoutError, RuntimeError, BrokenPipeError, OSError):
                self.proc.kill()

    def close(self, timeout_s: float = 30) -> int:
        """Ask the worker to exit; kill it if it does not. Returns the exit code."""
        self.request_exit()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        return self.proc.returncode

    def log_tail(self, n: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""


def wait_until(fn, timeout_s: float, every_s: float = 0.1):
    """Poll ``fn()`` every ``every_s`` until it is truthy or ``timeout_s`` passed; its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        v = fn()
        if v or time.monotonic() > deadline:
            return v
        time.sleep(every_s)
