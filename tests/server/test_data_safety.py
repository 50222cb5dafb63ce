"""The daemon, ``serve --check`` and the client never destroy a user's file nor acknowledge what is not kept
(issue 22 items 1, 2, 4, 13, 14)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import yaml

from tierstore import KVStore, Namespace
from tierstore.client import RemoteKVStore
from tierstore.errors import ConfigError, ForeignDataError, Status, StoreClosedError, StoreLockedError
from tierstore.server.config import parse_config
from tierstore.server.daemon import main
from tierstore.server.service import Service

from .conftest import ROOT, TOKENS, make_config
from .helpers import block_for


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _check(tmp_path, cfg: dict, capsys) -> tuple[int, str, str]:
    p = tmp_path / "daemon.yaml"
    p.write_text(yaml.safe_dump(cfg))
    rc = main(["--config", str(p), "--check"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _errors(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ": error: " in ln and "cannot start on this machine" not in ln]


def test_check_and_start_up_refuse_a_non_tierstore_file(tmp_path, capsys):
    """The issue: serve --check said "config OK" for a 50 MB random file, and start-up grew it to
    8 GiB and rewrote it."""
    cfg = make_config(str(tmp_path))
    victim = tmp_path / "nvme"
    victim.write_bytes(os.urandom(4 << 20))
    before = (_sha(victim), victim.stat().st_size)
    rc, out, err = _check(tmp_path, cfg, capsys)
    assert rc == 2 and "config OK" not in out
    (line,) = [ln for ln in _errors(err) if "tiers.nvme.path" in ln]
    assert (
        str(victim) in line and "4.00MiB" in line and "first bytes" in line and "Nothing was written" in line
    )
    with pytest.raises(ForeignDataError):
        Service(parse_config(cfg))
    assert (_sha(victim), victim.stat().st_size) == before
    # the daemon's own start-up (a process): refused, one line, the file untouched
    p = tmp_path / "daemon.yaml"
    r = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "serve", "--config", str(p)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert r.returncode == 1 and '"event": "startup_failed"' in r.stderr and "first bytes" in r.stderr
    assert (_sha(victim), victim.stat().st_size) == before


def test_format_true_lets_the_daemon_take_it(tmp_path, capsys):
    cfg = make_config(str(tmp_path))
    (tmp_path / "nvme").write_bytes(os.urandom(1 << 20))
    cfg["tiers"]["nvme"]["format"] = True
    rc, out, err = _check(tmp_path, cfg, capsys)
    assert rc == 0 and "format: true: what it holds is overwritten at start" in out, err
    svc = Service(parse_config(cfg))
    svc.close()
    del cfg["tiers"]["nvme"]["format"]  # labelled now: no format needed, blocks recovered
    rc, out, err = _check(tmp_path, cfg, capsys)
    assert rc == 0 and "its blocks are recovered at start" in out, err


def test_check_and_start_up_name_the_process_holding_the_tier(tmp_path, capsys):
    cfg = make_config(str(tmp_path))
    holder = KVStore.from_config({"layout": cfg["layout"], "tiers": cfg["tiers"]})
    try:
        rc, _, err = _check(tmp_path, cfg, capsys)
        assert rc == 2 and any(f"in use by process {os.getpid()}" in ln for ln in _errors(err)), err
        t0 = time.monotonic()
        with pytest.raises(StoreLockedError, match=f"pid {os.getpid()}"):
            Service(parse_config(cfg))
        assert time.monotonic() - t0 < 5
        t0 = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-m", "tierstore.cli", "serve", "--config", str(tmp_path / "daemon.yaml")],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=ROOT),
        )
        assert r.returncode == 1 and f"in use by process {os.getpid()}" in r.stderr, r.stderr
        assert "BlockingIOError" not in r.stderr and time.monotonic() - t0 < 60  # interpreter start included
    finally:
        holder.close()


def test_the_daemon_follows_the_one_path_rule(tmp_path, capsys):
    """A path ending in '/' is a directory that must exist; the daemon creates none."""
    cfg = make_config(str(tmp_path))
    cfg["tiers"]["nvme"]["path"] = str(tmp_path / "nvme") + "/"
    rc, _, err = _check(tmp_path, cfg, capsys)
    assert rc == 2 and any("does not exist" in ln and "tiers.nvme.path" in ln for ln in _errors(err)), err
    with pytest.raises(ConfigError, match="does not exist"):
        Service(parse_config(cfg))
    assert not (tmp_path / "nvme").exists()
    (tmp_path / "nvme").mkdir()
    svc = Service(parse_config(cfg))
    svc.close()
    assert os.listdir(tmp_path / "nvme") == ["tierstore.nvme"]


# ----------------------------------------------------------------------------- the client
def test_a_url_without_a_scheme_is_refused_by_name():
    """RemoteKVStore("127.0.0.1:8470") said "HTTP 0 connection"."""
    with pytest.raises(
        ConfigError, match=r"url='127.0.0.1:8470': the URL needs a scheme \(http:// or https://\)"
    ):
        RemoteKVStore("127.0.0.1:8470", TOKENS["acme"])


@pytest.mark.parametrize("url", ["http://[::1", "http://127.0.0.1:99999", "http://127.0.0.1:port"])
def test_a_url_that_does_not_parse_is_a_config_error(url):
    """Fresh-user trial 7: RemoteKVStore("http://[::1") raised a bare ValueError."""
    with pytest.raises(ConfigError, match=r"not a valid URL"):
        RemoteKVStore(url, TOKENS["acme"])


def test_a_closed_client_refuses_every_call(daemon):
    c = RemoteKVStore(daemon.url, TOKENS["acme"])
    ns = Namespace(model="closed-client")
    toks = list(range(2 * c.layout.tokens_per_block))
    keys = c.keys_for(ns, toks)
    blocks = [block_for(k, c.block_bytes) for k in keys]
    c.close()
    assert c.closed
    calls = {
        "store_keys": lambda: c.store_keys(ns, keys, blocks),
        "store(wait=False)": lambda: c.store_keys(ns, keys, blocks, wait=False),
        "lookup": lambda: c.lookup(ns, toks),
        "lookup_keys": lambda: c.lookup_keys(keys),
        "exists": lambda: c.exists(keys),
        "probe": lambda: c.probe(ns, toks),
        "load": lambda: c.load(keys, ns=ns),
        "prefetch": lambda: c.prefetch(ns, toks),
        "pin": lambda: c.pin(ns, toks),
        "unpin": lambda: c.unpin(1),
        "invalidate": lambda: c.invalidate(ns),
        "stats": lambda: c.stats(),
    }
    for _name, call in calls.items():
        with pytest.raises(StoreClosedError, match="closed"):
            call()
    c.close()  # idempotent
    assert c.keys_for(ns, toks) == keys
    with RemoteKVStore(daemon.url, TOKENS["acme"]) as again:
        assert again.exists(keys, ns=ns) == 0  # nothing was acknowledged, nothing is there


def test_a_store_racing_the_client_close_is_kept_or_refused(daemon):
    c = RemoteKVStore(daemon.url, TOKENS["acme"])
    ns = Namespace(model="racing-close")
    b = c.layout.tokens_per_block
    acked: list[bytes] = []
    refused = []

    def writer(w: int) -> None:
        for i in range(100_000):
            toks = [w * 10**7 + i * b + j for j in range(b)]
            keys = c.keys_for(ns, toks)
            try:
                st = c.store_keys(ns, keys, [block_for(keys[0], c.block_bytes)])
            except StoreClosedError:
                refused.append(w)
                return
            if st == [Status.OK]:
                acked.append(keys[0])

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    c.close()
    for t in threads:
        t.join(60)
    assert sorted(refused) == [0, 1, 2] and acked
    with RemoteKVStore(daemon.url, TOKENS["acme"]) as again:
        dests = [torch.empty(again.block_bytes, dtype=torch.uint8) for _ in acked]
        st, _ = again.load(acked, dests, ns=ns)
        assert st == [Status.OK] * len(acked)
        assert all(torch.equal(d, block_for(k, again.block_bytes)) for d, k in zip(dests, acked))
