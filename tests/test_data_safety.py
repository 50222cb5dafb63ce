"""Never destroy a user's file, never acknowledge what is not kept (issue 22 items 1-4, 13, 14), through
KVStore.

Each case was a wrong result on the code before the fix: a random file given as the
NVMe tier was overwritten (its sha256 changed), a closed store acknowledged stores
that were gone after a reopen, a reopen with another capacity lost blocks without
counting them, a second process on the same path waited 30 s and died with a raw
BlockingIOError, and several messages named the wrong problem. The last case is wrong KV
under concurrency: a flush planned while a store was in flight wrote another block's bytes.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest
import torch

from tierstore import KVStore, Namespace, Status, Tier
from tierstore.errors import (
    ConfigError,
    ForeignDataError,
    LayoutError,
    StoreClosedError,
    StoreLockedError,
    TierStoreError,
)
from tierstore.io import format as fmt
from tierstore.layout import KVLayout

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16, tokens_per_block=16)
NS = Namespace(model="m@1", tenant="acme")
B = LAYOUT.tokens_per_block
BB = LAYOUT.bytes_per_block
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _prompt(i: int, blocks: int = 4):
    toks = np.arange(i * 1000, i * 1000 + blocks * B)
    kv = torch.from_numpy(
        np.random.default_rng(i).standard_normal((blocks, *LAYOUT.block_shape)).astype(np.float16)
    )
    return toks, kv


def _sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _stat(path):
    st = os.stat(path)
    return _sha(path), st.st_size, st.st_mtime_ns


def _loads_exact(s: KVStore, toks, kv) -> bool:
    hit = s.lookup(NS, toks)
    st, out = s.load(hit.keys)
    return (
        len(hit.keys) == kv.shape[0]
        and st == [Status.OK] * kv.shape[0]
        and all(torch.equal(a, b) for a, b in zip(out, kv))
    )


# ----------------------------------------------------------------------------- item 1: a user's file
def _random_file(path, nbytes: int = 4 << 20) -> None:
    with open(path, "wb") as f:
        f.write(os.urandom(nbytes))


def test_a_non_tierstore_file_is_refused_before_any_write(tmp_path):
    """The issue's repro (100 MiB there, 4 MiB here): the file's sha256, size and mtime are unchanged."""
    p = tmp_path / "x.bin"
    _random_file(p)
    before = _stat(p)
    with pytest.raises(ForeignDataError) as e:
        KVStore(LAYOUT, host_bytes=8 << 20, nvme_path=str(p), nvme_bytes=64 << 20)
    msg = str(e.value)
    assert "\n" not in msg and str(p) in msg and "4.00MiB" in msg and "first bytes" in msg
    assert "Nothing was written" in msg and "nvme_format=True" in msg
    assert isinstance(e.value, ConfigError)
    assert _stat(p) == before
    assert sorted(os.listdir(tmp_path)) == ["x.bin"]  # no sidecar file either


def test_the_config_path_and_a_directory_refuse_it_too(tmp_path):
    """build.assemble (from_config, the daemon, the bench, the connectors) checks the same way,
    also for the file tierstore.nvme inside a directory."""
    (tmp_path / "tierstore.nvme").write_bytes(b"a user's notes\n" * 1000)
    before = _stat(tmp_path / "tierstore.nvme")
    for path in (str(tmp_path), str(tmp_path) + "/", str(tmp_path / "tierstore.nvme")):
        with pytest.raises(ForeignDataError, match="tierstore.nvme"):
            KVStore.from_config({"tiers": {"nvme": {"path": path, "capacity_bytes": "64MiB"}}}, LAYOUT)
    assert _stat(tmp_path / "tierstore.nvme") == before


def test_format_true_takes_a_foreign_file_and_a_reopen_needs_no_format(tmp_path):
    p = tmp_path / "x.bin"
    _random_file(p, 1 << 20)
    toks, kv = _prompt(1)
    with KVStore(LAYOUT, nvme_path=str(p), nvme_bytes=16 << 20, nvme_format=True) as s:
        assert s.store(NS, toks, kv) == [Status.OK] * 4
    with KVStore(LAYOUT, nvme_path=str(p), nvme_bytes=16 << 20) as s:
        assert _loads_exact(s, toks, kv)


def test_a_tier_whose_label_is_destroyed_is_refused_and_the_message_says_it_may_be_ours(tmp_path):
    """Fresh-user trial 7: a tier file of tierstore's own with its label XORed away was refused as
    "data tierstore did not write" only, steering the user to format without saying what it may be."""
    p = tmp_path / "tier.kv"
    toks, kv = _prompt(3)
    with KVStore(LAYOUT, nvme_path=str(p), nvme_bytes=16 << 20) as s:
        assert s.store(NS, toks, kv) == [Status.OK] * 4
        s.flush()
    with open(p, "r+b") as f:
        head = bytearray(f.read(64))
        f.seek(0)
        f.write(bytes(b ^ 0xFF for b in head))
    before = _stat(p)
    with pytest.raises(ForeignDataError, match="a tierstore tier whose label was damaged") as e:
        KVStore(LAYOUT, nvme_path=str(p), nvme_bytes=16 << 20)
    assert "Nothing was written" in str(e.value)
    assert _stat(p) == before


def test_an_empty_file_is_formatted(tmp_path):
    """Nothing to lose: an empty file is taken (and marked tierstore's before it is grown)."""
    toks, kv = _prompt(2)
    p = tmp_path / "empty.kv"
    p.write_bytes(b"")
    with KVStore(LAYOUT, nvme_path=str(p), nvme_bytes=16 << 20) as s:
        assert s.store(NS, toks, kv) == [Status.OK] * 4
    with KVStore(LAYOUT, nvme_path=str(p), nvme_bytes=16 << 20) as s:
        assert _loads_exact(s, toks, kv)


@pytest.mark.parametrize("kind", ["holes", "zeros"])
def test_a_hole_only_or_zero_file_is_refused_like_any_other(tmp_path, kind):
    """The trial's repro: ``truncate -s 2M`` was formatted and overwritten (sha256 changed) while a
    dense 1 MiB file of zeros was refused. A non-empty file without the label is not tierstore's."""
    p = tmp_path / kind
    with open(p, "wb") as f:
        if kind == "holes":
            f.truncate(2 << 20)
        else:
            f.write(bytes(1 << 20))
    before = _stat(p)
    with pytest.raises(ForeignDataError, match="Nothing was written"):
        KVStore(LAYOUT, nvme_path=str(p), nvme_bytes=2 << 20)
    assert _stat(p) == before


_DIE_BEFORE_LABEL = textwrap.dedent("""
    import os, signal, sys
    import torch
    from tierstore import KVStore
    from tierstore.io import recovery
    from tierstore.layout import KVLayout
    def die(*a, **k):
        os.kill(os.getpid(), signal.SIGKILL)
    recovery.write_label = die
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16, tokens_per_block=16)
    KVStore(lay, nvme_path=sys.argv[1], nvme_bytes=16 << 20)
""")


@pytest.mark.parametrize("start", ["absent", "empty"])
def test_a_tier_whose_creator_died_before_its_label_is_formatted(tmp_path, start):
    """tierstore's own file, killed between growing it and writing its label: sparse and label-less,
    but its first page is the mark written (and synced) before it was grown, so it is taken."""
    p = tmp_path / "kv"
    if start == "empty":
        p.write_bytes(b"")
    r = subprocess.run(
        [sys.executable, "-c", _DIE_BEFORE_LABEL, str(p)],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert r.returncode == -9, r.stderr
    assert os.path.getsize(p) == 16 << 20 and p.read_bytes()[: fmt.ALIGN_BYTES] == fmt.UNLABELLED_PAGE
    toks, kv = _prompt(3)
    with KVStore(LAYOUT, nvme_path=str(p), nvme_bytes=16 << 20) as s:
        assert s.store(NS, toks, kv) == [Status.OK] * 4
    with KVStore(LAYOUT, nvme_path=str(p), nvme_bytes=16 << 20) as s:
        assert _loads_exact(s, toks, kv)


@pytest.mark.parametrize("as_dir", [True, False], ids=["directory", "file"])
def test_tierstores_own_tier_reopens(tmp_path, as_dir):
    path = str(tmp_path) if as_dir else str(tmp_path / "kv.nvme")
    prompts = [_prompt(i) for i in range(3)]
    with KVStore(LAYOUT, host_bytes=4 * BB, nvme_path=path, nvme_bytes=16 << 20) as s:
        for toks, kv in prompts:
            assert s.store(NS, toks, kv) == [Status.OK] * 4
    with open(os.path.join(path, "tierstore.nvme") if as_dir else path, "rb") as f:
        assert f.read(8) == b"TSKVLBL1"  # the label (tierstore.io.label)
    for _ in range(2):
        with KVStore(LAYOUT, host_bytes=4 * BB, nvme_path=path, nvme_bytes=16 << 20) as s:
            assert s.stats()["nvme_backend"]["recovered_blocks"] == 12
            assert all(_loads_exact(s, toks, kv) for toks, kv in prompts)


def test_a_tier_of_the_format_before_labels_is_refused_by_name(tmp_path):
    """An extent header at byte 0 and no label: an earlier tierstore's tier, not reopened, not overwritten."""
    p = tmp_path / "old.nvme"
    page = bytearray(8192)
    page[:8] = fmt.MAGIC
    p.write_bytes(bytes(page))
    before = _stat(p)
    with pytest.raises(ForeignDataError, match="earlier format"):
        KVStore(LAYOUT, nvme_path=str(p), nvme_bytes=16 << 20)
    assert _stat(p) == before


def test_a_damaged_label_is_refused(tmp_path):
    p = tmp_path / "kv.nvme"
    with KVStore(LAYOUT, nvme_path=str(p), nvme_bytes=16 << 20) as s:
        assert s.store(NS, *_prompt(3)) == [Status.OK] * 4
    with open(p, "r+b") as f:
        f.seek(20)
        f.write(b"\xff")
    before = _stat(p)
    with pytest.raises(ForeignDataError, match="damaged tierstore label"):
        KVStore(LAYOUT, nvme_path=str(p), nvme_bytes=16 << 20)
    assert _stat(p) == before


@pytest.fixture
def loop_device(tmp_path):
    """A 64 MiB loop block device over a random file (root and losetup needed)."""
    if os.geteuid() != 0 or not os.path.exists("/dev/loop-control"):
        pytest.skip("a loop device needs root")
    img = tmp_path / "disk.img"
    _random_file(img, 64 << 20)
    r = subprocess.run(["losetup", "--find", "--show", str(img)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"losetup: {r.stderr.strip()}")
    dev = r.stdout.strip()
    try:
        yield dev
    finally:
        subprocess.run(["losetup", "-d", dev], check=False)


def test_a_block_device_is_formatted_only_when_told_to(loop_device):
    before = _sha(loop_device)
    with pytest.raises(ForeignDataError, match="device without tierstore's label") as e:
        KVStore(LAYOUT, nvme_path=loop_device, nvme_bytes=32 << 20)
    assert "\n" not in str(e.value) and loop_device in str(e.value) and "format" in str(e.value)
    assert _sha(loop_device) == before
    toks, kv = _prompt(4)
    with KVStore(LAYOUT, nvme_path=loop_device, nvme_bytes=32 << 20, nvme_format=True) as s:
        assert s.store(NS, toks, kv) == [Status.OK] * 4
    with KVStore(LAYOUT, nvme_path=loop_device, nvme_bytes=32 << 20) as s:  # its label: no format needed
        assert _loads_exact(s, toks, kv)
    with KVStore(LAYOUT, nvme_path=loop_device, nvme_bytes=32 << 20, nvme_format=True) as s:
        assert _loads_exact(s, toks, kv)  # format never erases a tier that carries the label


def test_an_invalidation_on_a_block_device_is_kept_on_it_and_nothing_is_created_beside_it(loop_device):
    """Fresh-user trial 11: invalidate() on a tier over /dev/loop0 created /dev/loop0.invalidations
    (a file tierstore did not own, in /dev). The records now go in the label page: nothing beside the
    node, and the invalidated namespace is still not served after a reopen."""
    other = Namespace(model="m@1", tenant="other")
    (toks, kv), (toks2, kv2) = _prompt(5), _prompt(6)
    beside = os.path.basename(loop_device) + "."
    with KVStore(LAYOUT, nvme_path=loop_device, nvme_bytes=32 << 20, nvme_format=True) as s:
        assert s.store(NS, toks, kv) == [Status.OK] * 4
        assert s.store(other, toks2, kv2) == [Status.OK] * 4
        assert s.invalidate(NS) == 4
    assert [f for f in os.listdir(os.path.dirname(loop_device)) if f.startswith(beside)] == []
    with KVStore(LAYOUT, nvme_path=loop_device, nvme_bytes=32 << 20) as s:
        assert s.lookup(NS, toks).matched_blocks == 0
        hit = s.lookup(other, toks2)
        st, out = s.load(hit.keys)
        assert st == [Status.OK] * 4 and all(torch.equal(a, b) for a, b in zip(out, kv2))
    with KVStore(LAYOUT, nvme_path=loop_device, nvme_bytes=48 << 20) as s:  # a relabel keeps them
        assert s.lookup(NS, toks).matched_blocks == 0 and s.lookup(other, toks2).matched_blocks == 4


def test_invalidations_past_the_label_pages_room_never_drop_another_namespace(loop_device):
    """Fresh-user trial 12: past the label page's 91 records, the oldest were folded into one record
    for every namespace, so invalidating 100 namespaces of one tenant dropped another tenant's
    acknowledged blocks at the next start. The 92nd namespace's invalidation is refused (ENOSPC,
    nothing recorded) and every other namespace loads exact after a reopen."""
    from tierstore.io.invalidation_log import LABEL_TAIL_RECORDS

    toks, kv = _prompt(7)
    with KVStore(LAYOUT, nvme_path=loop_device, nvme_bytes=32 << 20, nvme_format=True) as s:
        assert s.store(NS, toks, kv) == [Status.OK] * 4
        for i in range(LABEL_TAIL_RECORDS):
            s.invalidate(Namespace(model=f"gone@{i}", tenant="other"))
        with pytest.raises(OSError) as err:
            s.invalidate(Namespace(model="one-too-many", tenant="other"))
        assert err.value.errno == errno.ENOSPC and "reformat" in str(err.value)
        s.invalidate(Namespace(model="gone@3", tenant="other"))  # a recorded namespace: still works
    with KVStore(LAYOUT, nvme_path=loop_device, nvme_bytes=32 << 20) as s:
        assert _loads_exact(s, toks, kv)


# ----------------------------------------------------------------------------- item 2: a closed store
def _closed_calls(s: KVStore, toks, kv, keys):
    return {
        "store": lambda: s.store(NS, toks, kv),
        "store(wait=False)": lambda: s.store(NS, toks, kv, wait=False),
        "store_keys": lambda: s.store_keys(NS, keys, list(kv)),
        "store_fragments": lambda: s.store_fragments(NS, toks, [LAYOUT.fragments(b) for b in kv]),
        "lookup": lambda: s.lookup(NS, toks),
        "lookup_keys": lambda: s.lookup_keys(keys),
        "probe": lambda: s.probe(NS, toks),
        "exists": lambda: s.exists(keys),
        "load": lambda: s.load(keys),
        "load(timeout_s)": lambda: s.load(keys, timeout_s=5),
        "load_fragments": lambda: s.load_fragments(keys, [LAYOUT.fragments(torch.empty_like(b)) for b in kv]),
        "prefetch": lambda: s.prefetch(NS, toks),
        "prefetch_keys": lambda: s.prefetch_keys(keys),
        "pin": lambda: s.pin(NS, toks),
        "pin_keys": lambda: s.pin_keys(NS, keys),
        "unpin": lambda: s.unpin(1),
        "invalidate": lambda: s.invalidate(NS),
        "remove": lambda: s.remove(keys),
        "clear": lambda: s.clear(),
        "evict": lambda: s.evict("host", 1),
        "flush": lambda: s.flush(),
        "resident": lambda: s.resident(keys),
        "block_info": lambda: s.block_info(keys[0]),
        "state_of": lambda: s.state_of(keys[0]),
        "tiers_of": lambda: s.tiers_of(keys[0]),
        "namespaces": lambda: s.namespaces(),
        "keys_of_namespace": lambda: s.keys_of_namespace(s.digest(NS)),
        "request": lambda: s.request().__enter__(),
        "with": lambda: s.__enter__(),
    }


def test_every_call_on_a_closed_store_raises_and_nothing_is_acknowledged(tmp_path):
    """The issue: after close(), store() returned [OK]*4, load() OK, and a reopen found nothing."""
    toks, kv = _prompt(5)
    s = KVStore(LAYOUT, host_bytes=8 * BB, nvme_path=str(tmp_path), nvme_bytes=16 << 20)
    keys = s.keys_for(NS, toks)
    s.close()
    assert s.closed
    for name, call in _closed_calls(s, toks, kv, keys).items():
        with pytest.raises(StoreClosedError, match="closed"):
            call()
        assert issubclass(StoreClosedError, TierStoreError), name
    # still answered: close again, counters, configuration, pure functions, reference cleanup
    s.close()
    s.__exit__(None, None, None)
    assert s.stats()["blocks"] == 0 and s.keys_for(NS, toks) == keys and s.release(("req", 1)) == 0
    assert s.capacity_bytes()["host"] == 8 * BB and s.device_stats()["device"]
    with KVStore(LAYOUT, nvme_path=str(tmp_path), nvme_bytes=16 << 20) as again:
        assert again.lookup(NS, toks).matched_blocks == 0  # nothing was acknowledged, nothing is there


def test_a_store_racing_close_is_either_kept_or_refused(tmp_path):
    """Threads store while another thread closes: every store that returned OK is found after a
    reopen (close waits for calls in progress, then writes memory-only blocks down); the rest raise."""
    s = KVStore(LAYOUT, host_bytes=64 * BB, nvme_path=str(tmp_path), nvme_bytes=32 << 20)
    acked: list[tuple] = []
    refused = []
    lock = threading.Lock()
    started = threading.Barrier(5)

    def writer(w: int) -> None:
        started.wait()
        for i in range(10_000):
            toks, kv = _prompt(w * 100_000 + i, blocks=2)
            try:
                st = s.store(NS, toks, kv)
            except StoreClosedError:
                with lock:
                    refused.append(w)
                return
            with lock:
                acked.extend((toks, kv[j : j + 1]) for j, x in enumerate(st) if x is Status.OK and j == 0)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.3)
    s.close()
    for t in threads:
        t.join(60)
    assert sorted(refused) == [0, 1, 2, 3] and acked
    with KVStore(LAYOUT, nvme_path=str(tmp_path), nvme_bytes=32 << 20) as again:
        for toks, kv in acked:
            key = again.keys_for(NS, toks)[:1]
            st, out = again.load(key)
            assert st == [Status.OK] and torch.equal(out[0], kv[0])


def test_close_waits_for_a_store_in_progress_and_writes_it_down(tmp_path):
    """A store that began before close() is acknowledged only if it is kept: close waits for it,
    then writes the memory-only blocks down (the store's copy is held up here, as a slow one would be)."""
    toks, kv = _prompt(9)
    s = KVStore(LAYOUT, host_bytes=16 * BB, nvme_path=str(tmp_path), nvme_bytes=16 << 20)
    real, entered, out = s._mover.run_store, threading.Event(), []

    def slow_run_store(plan, sources):
        entered.set()
        time.sleep(0.5)
        return real(plan, sources)

    s._mover.run_store = slow_run_store
    t = threading.Thread(target=lambda: out.append(s.store(NS, toks, kv)))
    t.start()
    assert entered.wait(30)
    s.close()
    t.join(30)
    assert out == [[Status.OK] * 4]
    with KVStore(LAYOUT, nvme_path=str(tmp_path), nvme_bytes=16 << 20) as again:
        assert _loads_exact(again, toks, kv)


# ----------------------------------------------------------------------------- item 3: another capacity
def _fill(path, n_prompts: int, nvme_bytes: int, blocks: int = 4):
    prompts = [_prompt(100 + i, blocks) for i in range(n_prompts)]
    with KVStore(LAYOUT, nvme_path=str(path), nvme_bytes=nvme_bytes) as s:
        for toks, kv in prompts:
            assert s.store(NS, toks, kv) == [Status.OK] * blocks
        seg = {k: s.nvme.locate(k)[0] for toks, _ in prompts for k in s.keys_for(NS, toks)}
        assert s.stats()["nvme_backend"]["region_evicted_blocks"] == 0  # everything acknowledged is there
    return prompts, seg


@pytest.mark.parametrize("reopen_bytes", [1024 << 20, 32 << 20], ids=["larger", "smaller-that-fits"])
def test_reopen_with_another_capacity_keeps_what_fits(tmp_path, reopen_bytes):
    """The issue: 10 blocks at 256 MiB, reopened at 32 MiB: 1 recovered, 0 matched; at 1 GiB: 3 and 1.
    Here 600 blocks over two 4 MiB segments (the segment size of a 256 MiB tier)."""
    prompts, seg = _fill(tmp_path, 150, 256 << 20)
    assert len(seg) == 600 and set(seg.values()) == {0, 1}
    with KVStore(LAYOUT, nvme_path=str(tmp_path), nvme_bytes=reopen_bytes) as s:
        nb = s.stats()["nvme_backend"]
        assert nb["recovered_blocks"] == 600 and nb["recovery_dropped_blocks"] == 0
        assert sum(_loads_exact(s, toks, kv) for toks, kv in prompts) == 150
        assert s.nvme.segment_size_bytes == 4 << 20  # the label's, not one chosen for the new capacity
        for toks, kv in prompts[:3]:  # and it keeps working
            assert s.store(NS, toks + 10**6, kv) == [Status.OK] * 4
    with KVStore(LAYOUT, nvme_path=str(tmp_path), nvme_bytes=reopen_bytes) as s:
        assert s.stats()["nvme_backend"]["recovered_blocks"] == 612


def test_a_smaller_reopen_counts_every_dropped_block_and_says_so_once(tmp_path, caplog):
    """Blocks in segments past the new end are dropped, counted exactly, and said in one warning;
    recovered + dropped = acknowledged; what is kept loads byte-exact; a later larger reopen does
    not bring the dropped blocks back."""
    prompts, seg = _fill(tmp_path, 500, 64 << 20)  # 1 MiB segments of ~120 8-KiB blocks: ~17 segments
    acked = len(seg)
    kept_segments = 8
    assert max(seg.values()) >= kept_segments + 4
    want_dropped = sum(1 for v in seg.values() if v >= kept_segments)
    with caplog.at_level(logging.WARNING, logger="tierstore"):
        s = KVStore(LAYOUT, nvme_path=str(tmp_path), nvme_bytes=kept_segments << 20)
    try:
        nb = s.stats()["nvme_backend"]
        assert nb["recovery_dropped_blocks"] == want_dropped > 0
        assert nb["recovered_blocks"] + nb["recovery_dropped_blocks"] == acked
        lines = [r for r in caplog.records if "past the new end were dropped" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.WARNING
        assert f"{want_dropped} blocks" in lines[0].getMessage()
        found = 0
        for toks, kv in prompts:
            keys = s.keys_for(NS, toks)
            st, out = s.load(keys)
            for k, x, o, b in zip(keys, st, out, kv):
                if seg[k] < kept_segments:
                    assert x is Status.OK and torch.equal(o, b)
                    found += 1
                else:
                    assert x is Status.MISS
        assert found == nb["recovered_blocks"]
    finally:
        s.close()
    with KVStore(LAYOUT, nvme_path=str(tmp_path), nvme_bytes=64 << 20) as s:
        assert s.stats()["nvme_backend"]["recovered_blocks"] == acked - want_dropped


def test_a_capacity_too_small_for_the_tiers_segments_is_refused_naming_both(tmp_path):
    _fill(tmp_path, 2, 256 << 20)  # 4 MiB segments
    f = tmp_path / "tierstore.nvme"
    before = _stat(f)
    with pytest.raises(ConfigError) as e:
        KVStore(LAYOUT, nvme_path=str(tmp_path), nvme_bytes=16 << 20)  # 4 segments of 4 MiB < 8
    msg = str(e.value)
    assert "capacity_bytes=16777216" in msg and "4194304-byte segments" in msg and "256.00MiB" in msg
    assert "33554432" in msg  # the least capacity that works
    assert _stat(f) == before
    with pytest.raises(ConfigError, match="a tier keeps its segment size"):
        KVStore(LAYOUT, nvme_path=str(tmp_path), nvme_bytes=256 << 20, segment_size_bytes=1 << 20)
    assert _stat(f) == before


# ----------------------------------------------------------------------------- item 4: a second process
_SECOND = textwrap.dedent("""
    import sys, time, torch
    from tierstore import KVStore
    from tierstore.layout import KVLayout
    from tierstore.errors import StoreLockedError
    lay = KVLayout(num_layers=2, num_kv_heads=2, head_dim=32, dtype=torch.float16, tokens_per_block=16)
    t0 = time.monotonic()
    try:
        KVStore(lay, nvme_path=sys.argv[1], nvme_bytes=16 << 20)
    except StoreLockedError as e:
        print(f"{time.monotonic() - t0:.3f} {e}")
        sys.exit(3)
    sys.exit(0)
""")


def test_a_second_process_fails_at_once_naming_the_holder(tmp_path):
    """The issue: it waited 30 s and died with a raw BlockingIOError from io/_fileops.py."""
    with KVStore(LAYOUT, nvme_path=str(tmp_path), nvme_bytes=16 << 20):
        t0 = time.monotonic()
        r = subprocess.run(
            [sys.executable, "-c", _SECOND, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=ROOT),
        )
        wall_s = time.monotonic() - t0
    assert r.returncode == 3, r.stdout + r.stderr
    open_s, msg = r.stdout.strip().split(" ", 1)
    assert float(open_s) < 2.0, (open_s, wall_s)
    assert f"process {os.getpid()}" in msg and str(tmp_path / "tierstore.nvme") in msg
    assert "BlockingIOError" not in r.stderr


def test_a_second_store_in_this_process_is_refused_too(tmp_path):
    with KVStore(LAYOUT, nvme_path=str(tmp_path), nvme_bytes=16 << 20) as s:
        t0 = time.monotonic()
        with pytest.raises(StoreLockedError, match=f"already open in this process \\(pid {os.getpid()}\\)"):
            KVStore(LAYOUT, nvme_path=str(tmp_path), nvme_bytes=16 << 20)
        assert time.monotonic() - t0 < 2.0
        assert s.store(NS, *_prompt(6)) == [Status.OK] * 4  # the first one is untouched


# ----------------------------------------------------------------------------- item 13: one path rule
def test_one_path_rule(tmp_path):
    """Ends in '/' or names an existing directory: a directory (tierstore.nvme inside); anything else is
    the file; a missing directory is an error, and nothing is created."""
    with pytest.raises(ConfigError, match="does not exist"):
        KVStore(LAYOUT, nvme_path=str(tmp_path / "newdir") + "/", nvme_bytes=16 << 20)
    with pytest.raises(ConfigError, match="does not exist"):
        KVStore(LAYOUT, nvme_path=str(tmp_path / "missing" / "kv"), nvme_bytes=16 << 20)
    assert os.listdir(tmp_path) == []
    with KVStore(LAYOUT, nvme_path=str(tmp_path / "kv"), nvme_bytes=16 << 20):  # no extension: still a file
        pass
    assert os.path.isfile(tmp_path / "kv")
    (tmp_path / "d").mkdir()
    with KVStore(LAYOUT, nvme_path=str(tmp_path / "d"), nvme_bytes=16 << 20):
        pass
    assert os.listdir(tmp_path / "d") == ["tierstore.nvme"]


# ----------------------------------------------------------------------------- item 14: messages
def test_a_capacity_below_one_block_says_so():
    """--hbm_size=1k --host_size=0 --nvme_size=0 said "every tier is disabled"."""
    with pytest.raises(
        ConfigError,
        match=f"the hbm tier's capacity, 1024 bytes .* is below one block of this layout \\({BB} bytes",
    ):
        KVStore(LAYOUT, hbm_bytes=1024)
    with pytest.raises(ConfigError, match="host tier's capacity, 100 bytes"):
        KVStore(LAYOUT, hbm_bytes=4 * BB, host_bytes=100)


def test_a_negative_start_block_says_it_must_be_at_least_zero():
    toks, kv = _prompt(7)
    with KVStore(LAYOUT, host_bytes=8 * BB) as s:
        with pytest.raises(LayoutError, match=r"^start_block=-1: must be >= 0"):
            s.store(NS, toks, kv[:1], start_block=-1)
        with pytest.raises(LayoutError, match=r"^start_block=-1: must be >= 0"):
            s.store_fragments(NS, toks, [LAYOUT.fragments(kv[0])], start_block=-1)


def test_numpy_kv_is_refused_by_name():
    """A float16 numpy array of blocks said "expected 64 fragments, got 32"."""
    toks, kv = _prompt(8)
    with KVStore(LAYOUT, host_bytes=8 * BB) as s:
        for what, blocks in (("kv_blocks", kv.numpy()), ("a block", list(kv.numpy()))):
            with pytest.raises(
                LayoutError, match=f"^{what}: numpy arrays are not accepted; pass torch tensors"
            ):
                s.store(NS, toks, blocks)
        with pytest.raises(LayoutError, match="numpy arrays are not accepted"):
            s.store_keys(NS, s.keys_for(NS, toks), list(kv.numpy()))
        assert s.store(NS, toks, kv) == [Status.OK] * 4
        with pytest.raises(LayoutError, match="^a destination: numpy arrays are not accepted"):
            s.load(s.keys_for(NS, toks), dests=list(np.empty_like(kv.numpy())))
        assert s.stats()["blocks"] == 4


def test_a_path_under_proc_is_a_config_error(tmp_path):
    with pytest.raises(
        ConfigError, match=r"tiers.nvme.path='/proc/tierstore-kv': cannot open /proc/tierstore-kv"
    ):
        KVStore(LAYOUT, nvme_path="/proc/tierstore-kv", nvme_bytes=16 << 20)


def test_a_tier_too_large_for_the_file_system_leaves_no_file(tmp_path):
    """nvme_bytes=100<<40: "File too large" left a 0-byte file; a file that was there stays."""
    p = tmp_path / "kv.nvme"
    with pytest.raises(ConfigError, match="larger than a file may be on this file system") as e:
        KVStore(LAYOUT, nvme_path=str(p), nvme_bytes=100 << 40)
    if "File too large" not in str(e.value):
        pytest.skip(f"this file system takes 100 TiB files: {e.value}")
    assert not p.exists() and os.listdir(tmp_path) == []
    p.write_bytes(b"")  # an existing (empty) file is not ours to remove
    with pytest.raises(ConfigError, match="File too large"):
        KVStore(LAYOUT, nvme_path=str(p), nvme_bytes=100 << 40)
    assert p.exists() and p.stat().st_size == 0


def test_a_failed_open_removes_only_the_file_it_created(tmp_path):
    """A tier that fails after its file was created (here: a segment of 4 KiB cannot hold a block,
    found when the segment store opens) leaves nothing behind; a file that was there stays."""
    p = tmp_path / "kv.nvme"
    with pytest.raises(ConfigError, match="segment_size_bytes=4096"):
        KVStore(LAYOUT, nvme_path=str(p), nvme_bytes=16 << 20, segment_size_bytes=4096)
    assert os.listdir(tmp_path) == []
    p.write_bytes(b"")
    with pytest.raises(ConfigError, match="segment_size_bytes=4096"):
        KVStore(LAYOUT, nvme_path=str(p), nvme_bytes=16 << 20, segment_size_bytes=4096)
    assert os.listdir(tmp_path) == ["kv.nvme"]


def test_the_bench_says_a_tier_below_one_block_and_passes_format(capsys):
    """The issue's command: ``--hbm_size=1k --host_size=0 --nvme_size=0`` said "every tier is
    disabled"; ``--format=1`` reaches the NVMe tier's config (a device is formatted only then)."""
    from tierstore.bench.cli import main
    from tierstore.bench.kvjobs import nvme_options

    assert main(["--name=k", "--rw=kvtrace", "--hbm_size=1k", "--host_size=0", "--nvme_size=0"]) != 0
    err = capsys.readouterr().err
    assert "the hbm tier's capacity, 1024 bytes (1.00KiB), is below one block" in err, err
    assert "every tier is disabled" not in err
    base = {"device": "/dev/ng0n1", "dataplacement": "none", "op": 0.07, "utilization": 0.9}
    assert nvme_options({**base, "format": True})["format"] is True
    assert nvme_options(base)["format"] is False
    assert nvme_options({**base, "device": "file", "ioengine": "posix", "format": True})["format"] is True


# ----------------------------------------------------------------------------- wrong KV under concurrency
@pytest.mark.parametrize("victim", ["hbm_moves_down", "host_dropped"])
def test_a_flush_never_reads_a_slot_that_a_store_in_flight_hands_on(tmp_path, victim):
    """A miss, never wrong KV. Block A lives only in memory; the store of B makes A its victim and
    gives A's slot to B (``hbm_moves_down``: A moves down to host; ``host_dropped``: no lower
    tier and NVMe admission refuses A at its first sighting, so A is dropped). A flush (``flush()``, or the
    background clean that promotions ask for) planned while that store was in flight took A's old slot as
    A's source; gathered after B's bytes landed there, it wrote B's KV to NVMe under A's key with
    a valid checksum, and A served B's KV from then on. Found by
    tests/integrations/test_hf.py::test_concurrent_generation_matches_offload_off (first-token
    logits 0.08 off); here the two threads are held at the points where that race interleaved."""
    (toks_a, kv_a), (toks_b, kv_b) = _prompt(1, blocks=1), _prompt(2, blocks=1)
    tiers = (
        dict(hbm_bytes=BB, host_bytes=2 * BB)
        if victim == "hbm_moves_down"
        else dict(hbm_bytes=0, host_bytes=BB, admission="second")
    )
    s = KVStore(LAYOUT, nvme_path=str(tmp_path), nvme_bytes=16 << 20, **tiers)
    try:
        key_a = s.keys_for(NS, toks_a)[0]
        assert s.store(NS, toks_a, kv_a) == [Status.OK] and Tier.NVME not in s.tiers_of(key_a)
        real_store, real_flush = s._mover.run_store, s._mover.run_flush
        planned, flush_planned, stored = threading.Event(), threading.Event(), threading.Event()

        def held_store(plan, sources):  # B's plan is made: A is its victim, B takes A's slot
            planned.set()
            flush_planned.wait(30)
            return real_store(plan, sources)

        def late_flush(plan):  # the flush gathers only once B's store has completed
            flush_planned.set()
            stored.wait(30)
            return real_flush(plan)

        s._mover.run_store, s._mover.run_flush = held_store, late_flush
        out = []
        t = threading.Thread(target=lambda: (out.append(s.store(NS, toks_b, kv_b)), stored.set()))
        t.start()
        assert planned.wait(30)
        s.flush()
        flush_planned.set()  # a flush that planned nothing never reached late_flush
        t.join(30)
        s._mover.run_store, s._mover.run_flush = real_store, real_flush
        assert out == [[Status.OK]]
        if victim == "hbm_moves_down":
            assert s.evict("host", 1) == 1  # A leaves memory: from here on it is read from NVMe
            assert s.tiers_of(key_a) == [Tier.NVME]
        else:  # A was dropped (admission), unless the flush wrote it down
            assert s.stats()["admission_rejected_blocks"] == 1
        st, got = s.load([key_a])
        assert st[0] is not Status.OK or not torch.equal(got[0], kv_b[0]), "A's key served B's KV"
        if victim == "hbm_moves_down":  # A was kept: written down from its host copy
            assert st == [Status.OK] and torch.equal(got[0], kv_a[0])
        else:  # A was dropped and is a miss
            assert st == [Status.MISS] and s.tiers_of(key_a) == []
        s.check_invariants(quiescent=True)
    finally:
        s.close()


def test_an_empty_file_is_left_empty_when_the_tier_fails_to_open(tmp_path):
    """An empty file is a valid target (it is formatted); when the open then fails (here: another tier's
    journal), the file is left as it was found. It was left grown to the tier's size (a sparse 16 MiB
    file where the user had an empty one; stop-29 fresh-user trial)."""
    with KVStore(
        LAYOUT, nvme_path=str(tmp_path / "a.bin"), nvme_bytes=16 << 20, eviction_granularity="block"
    ) as a:
        a.store(NS, list(range(4 * B)), torch.ones(4, *LAYOUT.block_shape, dtype=LAYOUT.dtype))
    p = tmp_path / "b.bin"
    p.write_bytes(b"")
    with pytest.raises(ForeignDataError, match="journal of another tier"):
        KVStore(
            LAYOUT,
            nvme_path=str(p),
            nvme_bytes=16 << 20,
            eviction_granularity="block",
            journal_path=str(tmp_path / "a.bin.journal"),
        )
    assert p.stat().st_size == 0 and p.stat().st_blocks == 0
