"""``tierstore serve --check`` catches what start-up would refuse (issue 19, item 13)."""

from __future__ import annotations

import hashlib
import os
import re
import socket
import subprocess
import sys

import pytest
import torch
import yaml

from tierstore import KVStore
from tierstore.errors import ConfigError
from tierstore.layout import KVLayout
from tierstore.server.check import mem_available_bytes, preflight
from tierstore.server.config import load_config, parse_config
from tierstore.server.daemon import main

from .conftest import ROOT, make_config


def _write(tmp_path, cfg: dict) -> str:
    p = tmp_path / "daemon.yaml"
    p.write_text(yaml.safe_dump(cfg))
    return str(p)


def _meminfo(tmp_path, gib: int) -> str:
    p = tmp_path / "meminfo"
    p.write_text(f"MemTotal:       {gib << 20} kB\nMemAvailable:   {(gib - 1) << 20} kB\n")
    return str(p)


def _check(tmp_path, cfg: dict, capsys) -> tuple[int, str, str]:
    rc = main(["--config", _write(tmp_path, cfg), "--check"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_check_passes_a_config_that_starts(tmp_path, capsys):
    rc, out, err = _check(tmp_path, make_config(str(tmp_path)), capsys)
    assert rc == 0 and "config OK" in out, err
    assert not os.path.exists(tmp_path / "nvme") and not os.path.exists(tmp_path / "state")  # nothing created


def test_check_refuses_a_host_tier_larger_than_available_memory(tmp_path, capsys):
    """configs/daemon.yaml asks for 64 GiB of host DRAM; --check said 'config OK' on a 24 GiB machine."""
    cfg = make_config(str(tmp_path))
    avail = mem_available_bytes()
    assert avail
    cfg["tiers"]["host"]["capacity_bytes"] = 2 * avail
    rc, out, err = _check(tmp_path, cfg, capsys)
    assert rc == 2 and "config OK" not in out
    assert f"memory: tiers.host.capacity_bytes={2 * avail}" in err and "exceed MemAvailable=" in err
    assert "cannot start on this machine (1 problem)" in err


def test_startup_refuses_it_too(tmp_path):
    cfg = make_config(str(tmp_path))
    cfg["tiers"]["host"]["capacity_bytes"] = 2 * mem_available_bytes()
    r = subprocess.run(
        [sys.executable, "-m", "tierstore.cli", "serve", "--config", _write(tmp_path, cfg)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert r.returncode == 1
    assert '"event": "startup_failed"' in r.stderr and "exceed MemAvailable" in r.stderr


def test_shipped_configs(tmp_path, capsys):
    """daemon.yaml is an example for a big server: refused on a 24 GiB machine, with the reason;
    daemon-small.yaml starts here."""
    big = load_config(os.path.join(ROOT, "configs", "daemon.yaml"))
    pf = preflight(big, ports=False, meminfo=_meminfo(tmp_path, 24))
    assert any(
        e.startswith("memory: tiers.host.capacity_bytes=68719476736 (64.00GiB) exceed") for e in pf.errors
    )
    small = os.path.join(ROOT, "configs", "daemon-small.yaml")
    rc = main(["--config", small, "--check"])
    out = capsys.readouterr()
    if rc and all("cannot bind" in line for line in out.err.splitlines() if ": error: " in line):
        pytest.skip(f"a port of daemon-small.yaml is in use on this machine: {out.err}")
    assert rc == 0 and "config OK" in out.out, out.err


def test_check_refuses_an_nvme_tier_larger_than_the_free_disk(tmp_path, capsys):
    cfg = make_config(str(tmp_path))
    cfg["tiers"]["nvme"]["capacity_bytes"] = "1024TiB"
    rc, _, err = _check(tmp_path, cfg, capsys)
    assert rc == 2 and "disk: tiers.nvme.capacity_bytes=1125899906842624 (1024.00TiB) is larger than" in err


def test_check_refuses_a_missing_device(tmp_path, capsys):
    cfg = make_config(str(tmp_path))
    cfg["tiers"]["nvme"]["path"] = "/dev/nvme97n3"
    rc, _, err = _check(tmp_path, cfg, capsys)
    assert rc == 2 and "tiers.nvme.path=/dev/nvme97n3" in err and "no such device" in err


def test_check_refuses_a_file_system_without_o_direct(tmp_path, capsys):
    cfg = make_config(str(tmp_path))
    if not os.path.isdir("/dev/shm") or os.statvfs("/dev/shm").f_bavail == 0:
        pytest.skip("no /dev/shm")
    try:  # tmpfs refuses O_DIRECT; the daemon never falls back to buffered I/O
        fd = os.open("/dev/shm/.tierstore-probe", os.O_CREAT | os.O_RDWR | os.O_DIRECT, 0o600)
        os.close(fd)
        os.unlink("/dev/shm/.tierstore-probe")
        pytest.skip("/dev/shm accepts O_DIRECT here")
    except OSError:
        pass
    cfg["tiers"]["nvme"]["path"] = f"/dev/shm/tierstore-check-{os.getpid()}"
    rc, _, err = _check(tmp_path, cfg, capsys)
    assert rc == 2 and "cannot open with O_DIRECT" in err
    assert not os.path.exists(cfg["tiers"]["nvme"]["path"])


def test_check_refuses_busy_ports(tmp_path, capsys):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    port = s.getsockname()[1]
    try:
        cfg = make_config(str(tmp_path), listen={"host": "127.0.0.1", "port": port})
        rc, _, err = _check(tmp_path, cfg, capsys)
        assert rc == 2 and f"listen: cannot bind 127.0.0.1:{port}" in err and "already running" in err
        cfg = make_config(str(tmp_path), metrics={"host": "127.0.0.1", "port": port})
        rc, _, err = _check(tmp_path, cfg, capsys)
        assert rc == 2 and f"metrics: cannot bind 127.0.0.1:{port}" in err
    finally:
        s.close()


def _sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_check_refuses_a_layout_that_does_not_match_the_nvme_file(tmp_path, capsys):
    """A layout whose blocks do not match the existing NVMe file passed --check; start-up refuses it."""
    from tierstore.server.service import Service

    cfg = make_config(str(tmp_path))
    cfg["puts"] = {"durable": True}
    svc = Service(parse_config(cfg))  # writes one block of the 8 KiB layout
    try:
        scope = bytes(32)
        st = svc.store.store_keys(scope, [os.urandom(32)], [torch.zeros(svc.block_bytes, dtype=torch.uint8)])
        assert st[0].value == "ok"
    finally:
        svc.close()
    nvme = tmp_path / "nvme"
    before, mtime = _sha(nvme), os.stat(nvme).st_mtime_ns
    rc, out, err = _check(tmp_path, cfg, capsys)
    assert rc == 0 and "recovered at start" in out, err
    other = dict(cfg, layout=dict(cfg["layout"], head_dim=128))  # 16 KiB blocks
    rc, _, err = _check(tmp_path, other, capsys)
    assert rc == 2 and "layout: " in err and "holds blocks of 8192 bytes" in err and "16384-byte" in err
    assert _sha(nvme) == before and os.stat(nvme).st_mtime_ns == mtime  # --check changed nothing
    # same block size, another geometry: starts, but drops the blocks of scopes of the old layout
    (tmp_path / "state").mkdir(exist_ok=True)
    (tmp_path / "state" / "scopes.jsonl").write_text(
        '{"scope": "%s", "owner": "acme", "layout": "%s"}\n' % ("00" * 32, "ff" * 32)
    )
    same = dict(cfg, layout=dict(cfg["layout"], num_kv_heads=2, head_dim=32))
    rc, out, err = _check(tmp_path, same, capsys)
    assert rc == 0 and "1 scopes in" in out and "drops their blocks" in out


def test_check_accepts_a_character_device_that_cannot_seek(tmp_path, capsys, monkeypatch):
    """An NVMe generic node (/dev/ngXnY, a character device) answers SEEK_END with ESPIPE:
    the preflight must not call that "cannot open" (it stopped the daemon in the FDP VM)."""
    import errno

    import tierstore.server.check as check

    cfg = make_config(str(tmp_path))
    cfg["tiers"]["nvme"]["path"] = "/dev/null"  # a character device on every Linux
    real = os.lseek

    def lseek(fd, pos, how):
        if how == os.SEEK_END:
            raise OSError(errno.ESPIPE, os.strerror(errno.ESPIPE))
        return real(fd, pos, how)

    monkeypatch.setattr(check.os, "lseek", lseek)
    monkeypatch.setattr("tierstore.io.label.is_nvme_generic", lambda path, st: True)  # what /dev/ngXnY is
    rc, _, err = _check(tmp_path, cfg, capsys)
    assert "Illegal seek" not in err and "tiers.nvme.path=/dev/null: cannot open" not in err, err


def test_check_refuses_a_character_device_that_is_not_nvme_generic(tmp_path, capsys):
    """/dev/null as the NVMe path: refused as what it is, not as a file system refusing O_DIRECT."""
    cfg = make_config(str(tmp_path))
    cfg["tiers"]["nvme"]["path"] = "/dev/null"
    rc, _, err = _check(tmp_path, cfg, capsys)
    assert (
        rc != 0 and "'/dev/null': a character device that is not an NVMe generic device (/dev/ngXnY)" in err
    )
    assert "O_DIRECT" not in err


def test_check_says_read_only_file_system(tmp_path, capsys, monkeypatch):
    """A directory on a read-only mount was "not writable by this user (uid 0)" (statvfs says ST_RDONLY; this
    test fakes the mount: access(2) refuses writes there, as it does with EROFS, and statvfs has
    ST_RDONLY)."""
    import types

    import tierstore.server.check as check

    ro = tmp_path / "ro"
    ro.mkdir()
    cfg = make_config(str(tmp_path))
    cfg["tiers"]["nvme"]["path"] = str(ro / "nvme")
    real_access, real_statvfs = os.access, os.statvfs

    def access(path, mode, **kw):
        return False if str(path).startswith(str(ro)) and mode & os.W_OK else real_access(path, mode, **kw)

    def statvfs(path):
        vfs = real_statvfs(path)
        if not str(path).startswith(str(ro)):
            return vfs
        fields = {k: getattr(vfs, k) for k in dir(vfs) if k.startswith("f_")}
        return types.SimpleNamespace(**{**fields, "f_flag": vfs.f_flag | os.ST_RDONLY})

    monkeypatch.setattr(check.os, "access", access)
    monkeypatch.setattr(check.os, "statvfs", statvfs)
    rc, _, err = _check(tmp_path, cfg, capsys)
    assert rc != 0 and f"{ro} is on a read-only file system" in err and "not writable by this user" not in err


def test_check_refuses_a_tier_file_this_user_cannot_write(tmp_path, capsys, monkeypatch):
    """An existing (empty) tier file of mode 444 in a writable directory passed --check ("config OK") and the
    start
    failed with Permission denied (re-trial of issue 22). access(2) is faked: this test runs as root."""
    import tierstore.server.check as check

    tier = tmp_path / "ro.nvme"
    tier.touch()
    tier.chmod(0o444)
    cfg = make_config(str(tmp_path))
    cfg["tiers"]["nvme"]["path"] = str(tier)
    real_access = os.access

    def access(path, mode, **kw):
        return False if str(path) == str(tier) and mode & os.W_OK else real_access(path, mode, **kw)

    monkeypatch.setattr(check.os, "access", access)
    rc, _, err = _check(tmp_path, cfg, capsys)
    assert rc != 0 and f"{tier} is not readable and writable by this user" in err


def test_daemon_yaml_names_every_nvme_key():
    """configs/daemon.yaml says it documents every key: the NVMe tier's keys added since (block mode,
    the flush bounds, the region policy) were missing (fresh-user trial). Each must be there, set or
    in a comment."""
    from tierstore.config import NvmeTierConfig

    text = open(os.path.join(ROOT, "configs", "daemon.yaml")).read()
    section = text[text.index("  nvme:") : text.index("\n# Shared remote tier")]
    missing = [k for k in NvmeTierConfig.model_fields if not re.search(rf"^\s*#?\s*{k}:", section, re.M)]
    assert not missing, f"configs/daemon.yaml lacks NVMe keys {missing}"


def test_daemon_yaml_names_every_node_key():
    """The node section's keys (access: allow_uids, allow_gids, tenant) are documented there too."""
    import yaml

    from tierstore.server.config import NodeConfig

    text = open(os.path.join(ROOT, "configs", "daemon.yaml")).read()
    section = text[text.index("\nnode:") :]
    missing = [k for k in NodeConfig.model_fields if not re.search(rf"^\s*#?\s*{k}:", section, re.M)]
    assert not missing, f"configs/daemon.yaml lacks node keys {missing}"
    node = yaml.safe_load(text)["node"]
    assert node["tenant"] is None and node["allow_uids"] is None and node["allow_gids"] == []


@pytest.mark.parametrize("case", ["missing_dir", "directory", "empty", "foreign", "foreign_tmp"])
def test_check_refuses_a_block_mode_journal_that_start_up_refuses(tmp_path, capsys, case):
    """serve --check said 'config OK' for block-mode journals that start-up then refused (fresh-user
    trial)."""
    cfg = make_config(str(tmp_path))
    nv = cfg["tiers"]["nvme"]
    nv["eviction_granularity"] = "block"
    foreign = tmp_path / "foreign.bin"
    foreign.write_bytes(os.urandom(5000))
    nv["journal_path"] = {
        "missing_dir": str(tmp_path / "no" / "j"),
        "directory": str(tmp_path),
        "empty": "",
        "foreign": str(foreign),
        "foreign_tmp": str(tmp_path / "j"),
    }[case]
    if case == "foreign_tmp":
        (tmp_path / "j.tmp").write_bytes(os.urandom(100))
    rc, out, err = _check(tmp_path, cfg, capsys)
    assert rc != 0 and "journal_path" in err and "config OK" not in out, (out, err)
    assert foreign.stat().st_size == 5000


def test_check_passes_block_mode_with_its_own_journal(tmp_path, capsys):
    cfg = make_config(str(tmp_path))
    cfg["tiers"]["nvme"]["eviction_granularity"] = "block"
    rc, out, err = _check(tmp_path, cfg, capsys)
    assert rc == 0 and "config OK" in out, err


def test_check_refuses_a_block_mode_live_budget_below_one_block(tmp_path, capsys):
    """Block mode keeps at most live_fraction x the blocks beyond the reserve and the open segment; a budget
    below one block is refused at start-up, and serve --check said 'config OK' for it (stop-29 trial)."""
    cfg = make_config(str(tmp_path))
    cfg["tiers"]["nvme"].update(eviction_granularity="block", live_fraction=0.00001)
    rc, out, err = _check(tmp_path, cfg, capsys)
    assert rc != 0 and "no block fits the live budget" in err and "config OK" not in out, (out, err)
    nv = cfg["tiers"]["nvme"]
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, dtype=torch.float32, tokens_per_block=16)
    with pytest.raises(ConfigError, match="no block fits the live budget"):  # start-up agrees
        KVStore(
            layout,
            nvme_path=nv["path"],
            nvme_bytes=nv["capacity_bytes"],
            **{
                k: nv[k]
                for k in ("segment_size_bytes", "extent_size_bytes", "eviction_granularity", "live_fraction")
            },
        )
    nv["live_fraction"] = 0.01
    rc, out, err = _check(tmp_path, cfg, capsys)
    assert rc == 0 and "config OK" in out and "block mode keeps at most" in out, err


def test_check_names_the_extra_a_node_section_needs(tmp_path, monkeypatch):
    """Fresh-user trial: with only '.[server]' installed, --check said 'config OK' for a config with
    a node: section, and start-up then failed on the missing msgspec."""
    cfg = parse_config(make_config(str(tmp_path), node={"socket": str(tmp_path / "node.sock")}))
    assert not [e for e in preflight(cfg, ports=False).errors if "msgspec" in e]
    monkeypatch.setitem(sys.modules, "msgspec", None)  # import msgspec now raises ImportError
    errors = preflight(cfg, ports=False).errors
    assert any("needs msgspec" in e and "tierstore[node]" in e for e in errors), errors


def test_check_says_a_small_memory_tier_in_a_unit_that_shows_it(tmp_path, capsys):
    """Fresh-user trial: a 16 MiB host tier was 'memory: 0.0 GiB of memory tiers'."""
    cfg = make_config(str(tmp_path))
    cfg["tiers"]["host"]["capacity_bytes"] = 16 << 20
    cfg["tiers"]["hbm"] = {"capacity_bytes": 0}
    rc, out, err = _check(tmp_path, cfg, capsys)
    assert rc == 0 and "memory: 16.00MiB of memory tiers" in out + err, out + err


@pytest.mark.parametrize("under", [False, True])
def test_a_state_dir_that_is_a_regular_file_is_refused_before_anything_is_created(tmp_path, capsys, under):
    """Fresh-user trial: a state_dir naming an existing file passed --check ('config OK'); start-up
    then failed with a bare '[Errno 17] File exists' after creating the NVMe tier file."""
    from tierstore.server.service import Service

    blocker = tmp_path / "not-a-dir"
    blocker.write_bytes(b"user data")
    cfg = make_config(str(tmp_path), state_dir=str(blocker / "state" if under else blocker))
    rc, out, err = _check(tmp_path, cfg, capsys)
    assert rc == 2 and "config OK" not in out
    assert "state_dir:" in err and "is not a directory" in err
    with pytest.raises(ConfigError, match="state_dir="):
        Service(parse_config(cfg))
    assert not os.path.exists(tmp_path / "nvme")  # no tier file left behind
    assert blocker.read_bytes() == b"user data"


@pytest.mark.parametrize(
    "garbage",
    [
        bytes(range(128, 256)) * 4 + b"\n",
        b"[1, 2]\n",
        b'{"scope": "not hex", "owner": "acme", "layout": 7}\n',
    ],
)
def test_a_state_file_line_tierstore_did_not_write_is_skipped_and_said(tmp_path, capsys, garbage):
    """A non-UTF-8 ``scopes.jsonl`` stopped ``--check`` and start-up with a UnicodeDecodeError
    traceback (fresh-user trial 4a); a JSON line that is not a record raised AttributeError/
    ValueError at start-up. Such a line is skipped (as a torn one), said by --check and at start."""
    from tierstore.server.service import Service

    cfg = make_config(str(tmp_path))
    (tmp_path / "state").mkdir()
    good = {
        "scopes.jsonl": '{"scope": "%s", "owner": "acme", "layout": "%s"}\n' % ("00" * 32, "ff" * 32),
        "invalidations.jsonl": '{"scope": "%s", "seq": 3}\n' % ("00" * 32),
    }
    for name, line in good.items():
        (tmp_path / "state" / name).write_bytes(garbage + line.encode())
    before = {n: _sha(tmp_path / "state" / n) for n in ("scopes.jsonl", "invalidations.jsonl")}
    rc, out, err = _check(tmp_path, cfg, capsys)
    assert rc == 0, err
    assert "1 line of" in out and "scopes.jsonl" in out and "not a record" in out
    svc = Service(parse_config(cfg))
    svc.close()
    assert {n: _sha(tmp_path / "state" / n) for n in before} == before  # read, never rewritten


@pytest.mark.parametrize("name", ["scopes.jsonl", "invalidations.jsonl"])
def test_a_state_file_with_no_record_of_tierstore_is_refused_and_left_alone(tmp_path, capsys, name):
    """A user's own ``scopes.jsonl`` in ``state_dir`` (complete lines, none a record): start-up
    appended the daemon's records to it (a file tierstore did not create). Now ``--check`` and
    start-up refuse it, naming the file, and it keeps its bytes."""
    from tierstore.server.service import Service

    cfg = make_config(str(tmp_path))
    (tmp_path / "state").mkdir()
    mine = tmp_path / "state" / name
    mine.write_bytes(b'{"user": "notes"}\nline two\n')
    before = _sha(mine)
    rc, out, err = _check(tmp_path, cfg, capsys)
    assert rc == 2 and "config OK" not in out
    assert f"{mine}: none of its 2 lines is a record tierstore writes" in err
    with pytest.raises(ConfigError, match=f"{re.escape(str(mine))}: none of its 2 lines is a record"):
        Service(parse_config(cfg))
    assert _sha(mine) == before


def test_a_torn_tail_is_ended_before_the_next_record_is_appended(tmp_path):
    """A crash during the first append leaves a line without its newline: start-up accepts the file
    (it is tierstore's), and the next record goes on a line of its own. Before, the record was
    glued to the torn tail, and the scope's owner was lost at the next start."""
    from tierstore.server.config import parse_config as parse
    from tierstore.server.tenancy import Tenancy

    cfg = parse(make_config(str(tmp_path)))
    (tmp_path / "state").mkdir()
    reg = tmp_path / "state" / "scopes.jsonl"
    reg.write_bytes(b'{"scope": "ab')  # torn: no newline
    ten = Tenancy(cfg, 4096, b"\x01" * 16)
    scope, owner = ten.resolve(cfg.tenants[0].name, b"\x02" * 32, write=True)
    again = Tenancy(cfg, 4096, b"\x01" * 16)
    assert again.scope_owner == {scope: owner}
    assert reg.read_bytes().startswith(b'{"scope": "ab\n{')


@pytest.mark.parametrize("written, mode", [("0600", "0600"), ("0660", "0660"), ("'0660'", "0660")])
def test_an_unquoted_socket_mode_is_the_same_mode(tmp_path, written, mode):
    """``socket_mode: 0600`` unquoted is the YAML 1.1 octal int 384, which was refused as
    "node.socket_mode=384: Input should be '0600' or '0660'" (fresh-user trial 9)."""
    doc = make_config(str(tmp_path), node={"socket": str(tmp_path / "node.sock")})
    text = yaml.safe_dump(doc).replace("socket: ", f"socket_mode: {written}\n  socket: ", 1)
    path = tmp_path / "daemon.yaml"
    path.write_text(text)
    assert yaml.safe_load(text)["node"]["socket_mode"] in (mode, int(mode, 8))
    assert load_config(str(path)).node.socket_mode == mode


@pytest.mark.parametrize("value", [0o644, 600, 0o777])
def test_another_int_socket_mode_says_to_quote_it(tmp_path, value):
    doc = make_config(str(tmp_path), node={"socket": str(tmp_path / "node.sock"), "socket_mode": value})
    with pytest.raises(ConfigError) as e:
        parse_config(doc)
    assert f"node.socket_mode={value}" in str(e.value)
    assert "write the mode quoted, e.g. '0600'" in str(e.value)
