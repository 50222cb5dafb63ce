"""Fixtures that run the real daemon (``python -m tierstore.cli serve``) as a subprocess on loopback."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = {
    "acme": "acme-token-0123456789abcdef",
    "bravo": "bravo-token-0123456789abcdef",
    "carol": "carol-token-0123456789abcdef",
}
#: Client-side namespace declared public in the test config.
PUBLIC_NS = {"model": "shared-model@1", "tenant": "public"}


def make_config(tmp: str, **over) -> dict:
    """A small daemon config under ``tmp``: 8 KiB blocks, 4 MiB host, 96 MiB NVMe in the file ``tmp/nvme``."""
    cfg = {
        "state_dir": os.path.join(tmp, "state"),
        "listen": {"host": "127.0.0.1", "port": 0},
        "log": {"level": "INFO", "access_log": False},
        "layout": {
            "num_layers": 1,
            "num_kv_heads": 1,
            "head_dim": 64,
            "dtype": "fp32",
            "tokens_per_block": 16,
        },
        "tiers": {
            "host": {"capacity_bytes": "4MiB"},
            "nvme": {
                "path": os.path.join(tmp, "nvme"),
                "capacity_bytes": "96MiB",
                "segment_size_bytes": "4MiB",
                "extent_size_bytes": "1MiB",
            },
        },
        "tenants": [
            {"name": "acme", "tokens": [TOKENS["acme"]], "quota_bytes": "64MiB"},
            # bravo is configured by token hash only
            {"name": "bravo", "token_sha256": [hashlib.sha256(TOKENS["bravo"].encode()).hexdigest()]},
            {"name": "carol", "tokens": [TOKENS["carol"]], "quota_bytes": "64KiB"},
        ],
        "public_namespaces": [
            {"name": "shared", "namespace": PUBLIC_NS, "writers": ["acme"], "readers": "*"}
        ],
        "limits": {
            "max_request_bytes": "4MiB",
            "max_inflight_requests": 32,
            "request_timeout_s": "20s",
            "shutdown_timeout_s": "10s",
            "max_keys_per_request": 1024,
        },
    }
    for k, v in over.items():
        cfg[k] = v
    if isinstance(cfg.get("node"), dict):
        # these tenants share one node socket on purpose (tests of scoping across them); the refusal
        # without this opt-in is tests/node/test_tenancy.py::test_several_tenants_on_one_node_socket_*
        cfg["node"] = {"tenants_share_memory": True, **cfg["node"]}
    return cfg


class Daemon:
    """One daemon subprocess; stderr (JSON logs) goes to a file."""

    def __init__(self, tmp: str, cfg: dict) -> None:
        self.tmp = tmp
        self.cfg_path = os.path.join(tmp, "daemon.yaml")
        with open(self.cfg_path, "w") as f:
            yaml.safe_dump(cfg, f)
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.log_path = ""
        self.starts = 0

    def start(self, timeout_s: float = 60.0) -> Daemon:
        self.starts += 1
        self.log_path = os.path.join(self.tmp, f"daemon-{self.starts}.log")
        env = dict(os.environ, PYTHONPATH=ROOT)
        with open(self.log_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tierstore.cli", "serve", "--config", self.cfg_path],
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
                cwd=ROOT,
            )
        t_end = time.monotonic() + timeout_s
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited {self.proc.returncode}: {self.log()}")
            for rec in self.records():
                if rec.get("event") == "listening":
                    self.port = rec["port"]
                    return self
            time.sleep(0.05)
        raise RuntimeError(f"daemon did not start: {self.log()}")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def records(self) -> list[dict]:
        out = []
        for line in self.log().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else 0
        self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(10)


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    """A daemon shared by a test module."""
    tmp = str(tmp_path_factory.mktemp("daemon"))
    d = Daemon(tmp, make_config(tmp)).start()
    yield d
    d.stop()
