"""A ``mooncake_master`` on loopback, for development, tests and benchmarks.

:class:`LocalMaster` starts the Mooncake wheel's native ``mooncake_master``
bound to 127.0.0.1 on free ports (RPC, metrics, and with ``metadata="http"`` the
embedded HTTP metadata server), restarts it on the same ports, and kills it.
A production cluster runs its master as a service (Mooncake deployment guide);
this is the single-machine equivalent.

Defaults differ from Mooncake's where a short-lived cluster needs it:

* ``--default_kv_lease_ttl`` (``lease_ms``) 500 ms instead of 10 s, so an
  OBJECT_HAS_LEASE (-706) refusal ends within a test;
* ``--client_ttl`` (``client_ttl_s``) 2 s instead of 10 s, so a killed
  client's segment is dropped quickly.

Mooncake listens beyond loopback where it gives no choice (0.3.13.post1): the
clients' handshake and TCP-transport ports bind all interfaces, and so does the
embedded HTTP metadata server whatever ``--http_metadata_server_host`` says.
``metadata="p2p"`` (``P2PHANDSHAKE``) runs without the HTTP metadata server.
"""

from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import time


def master_binary() -> str:
    """Path of the native ``mooncake_master`` inside the installed wheel."""
    import mooncake

    return os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master")


def free_ports(n: int) -> list[int]:
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


class LocalMaster:
    """One ``mooncake_master`` process on 127.0.0.1.

    Parameters
    ----------
    workdir : path
        Where the master's log (``master-<rpc port>.log``) goes.
    metadata : {"p2p", "http"}
        ``p2p``: clients use ``P2PHANDSHAKE``; ``http``: the master's embedded
        HTTP metadata server.
    lease_ms, client_ttl_s : int
        See the module docstring.
    extra_args : tuple of str
        More master flags (e.g. ``--enable_multi_tenants=true``).

    Raises
    ------
    RuntimeError
        From :meth:`start` when the master exits or does not listen in time
        (the message carries its log's tail).
    """

    def __init__(
        self,
        workdir: pathlib.Path,
        metadata: str = "p2p",
        lease_ms: int = 500,
        client_ttl_s: int = 2,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.workdir = pathlib.Path(workdir)
        self.metadata_mode = metadata
        self.rpc_port, self.metrics_port, self.http_port = free_ports(3)
        self.args = [
            f"--rpc_port={self.rpc_port}",
            "--rpc_address=127.0.0.1",
            f"--metrics_port={self.metrics_port}",
            "--metrics_host=127.0.0.1",
            f"--default_kv_lease_ttl={lease_ms}",
            f"--client_ttl={client_ttl_s}",
            *extra_args,
        ]
        if metadata == "http":
            self.args += [
                "--enable_http_metadata_server=true",
                "--http_metadata_server_host=127.0.0.1",
                f"--http_metadata_server_port={self.http_port}",
            ]
        self.proc: subprocess.Popen | None = None
        self.log_path = self.workdir / f"master-{self.rpc_port}.log"
        self.starts = 0

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return (
            f"http://127.0.0.1:{self.http_port}/metadata" if self.metadata_mode == "http" else "P2PHANDSHAKE"
        )

    def start(self, timeout_s: float = 20) -> LocalMaster:
        self.starts += 1
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [master_binary(), *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
            start_new_session=True,
        )
        log.close()
        ports = [self.rpc_port] + ([self.http_port] if self.metadata_mode == "http" else [])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited {self.proc.returncode}: {self.log_tail()}")
            if all(_listening(p) for p in ports):
                return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"mooncake_master not listening after {timeout_s} s: {self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL (a crash); waits for the process."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.kill()

    def restart(self) -> None:
        self.kill()
        self.start()

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""
