"""bench/server_bench.py with a reused --dir, and its ABBA pairing (issue 19, item 17)."""

from __future__ import annotations

import json
import socket

from .tools import load_tool


def _dead_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nobody listens there now
    return port


def test_reused_dir_and_abba_order(tmp_path, capsys):
    """A stale baseline.port from an earlier run made the script connect to a dead port
    (ConnectionRefused, then an IndexError); the baseline always ran first."""
    server_bench = load_tool("server_bench")
    (tmp_path / "baseline.port").write_text(str(_dead_port()))  # what an earlier run leaves behind
    (tmp_path / "state").mkdir()
    (tmp_path / "state" / "scopes.jsonl").write_text("{torn")
    out = tmp_path / "r.json"
    rc = server_bench.main(
        [
            "--dir",
            str(tmp_path),
            "--runs",
            "2",
            "--ops",
            "1",
            "--clients",
            "1",
            "--sizes-mib",
            "2",
            "--host-bytes",
            "64MiB",
            "--nvme-bytes",
            "512MiB",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["order"] == ["baseline,tierstore", "tierstore,baseline"]
    assert {r["op"] for r in doc["results"]} == {"put", "get"}
    assert all(len(r["tierstore_Bps"]) == 2 and min(r["baseline_Bps"]) > 0 for r in doc["results"])
    captured = capsys.readouterr()
    assert "removed baseline.port, state of an earlier run" in captured.err
    assert "2 runs in ABBA order" in captured.out


def test_memory_acknowledged_row(tmp_path, capsys):
    """``--ack memory`` runs the daemon with write-back puts (answered from the host tier, as the
    baseline answers from its dict); the JSON and the table say which, with the load average."""
    import yaml

    server_bench = load_tool("server_bench")
    out = tmp_path / "r.json"
    args = ["--dir", str(tmp_path), "--runs", "1", "--ops", "1", "--clients", "1", "--sizes-mib", "2"]
    args += ["--host-bytes", "64MiB", "--nvme-bytes", "512MiB", "--ack", "memory", "--json", str(out)]
    assert server_bench.main(args) == 0
    assert yaml.safe_load((tmp_path / "daemon.yaml").read_text())["puts"] == {"durable": False}
    doc = json.loads(out.read_text())
    assert doc["ack"] == "memory" and len(doc["loadavg_start_end"]) == 2
    assert all(len(r["per_run_ratio"]) == 1 and r["per_run_ratio"][0] > 0 for r in doc["results"])
    assert "puts acknowledged: memory" in capsys.readouterr().out


def test_put_profile_reports_client_and_daemon_spans(tmp_path, capsys):
    """bench/put_profile.py: the daemon's spans come back from its process (written at exit) and
    are matched to the client's requests."""
    put_profile = load_tool("put_profile")
    args = ["--dir", str(tmp_path), "--ops", "3", "--host-bytes", "64MiB", "--nvme-bytes", "512MiB"]
    assert put_profile.main(args) == 0
    out = capsys.readouterr().out
    for span in ("client.store_keys (total)", "srv.put_blocks (handler)", "store.nvme.fdatasync"):
        assert f"| {span} |" in out, span
    assert "| store.host copy (memory.gather) |" in out
