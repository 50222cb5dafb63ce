"""The node's shared segment: a sealed memfd with its header and gens, rank columns that alias it,
attach from a handed-over fd (in this process and in a real second process over SCM_RIGHTS),
read-only fds the kernel keeps read-only, fork refusal, pre-faulting, and unmapping only after
the last view."""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import signal
import socket
import stat
import subprocess
import sys
import textwrap
import uuid

import pytest
import torch

from tierstore.errors import LayoutError
from tierstore.node import protocol as P
from tierstore.node.segment import (
    F_ADD_SEALS,
    F_GET_SEALS,
    GEN_OFFSET,
    HEADER,
    PAGE_BYTES,
    SEALS,
    SLOT_ALIGN_BYTES,
    ColumnPool,
    Segment,
    SegmentError,
    SegmentHeader,
    column_offsets,
)
from tierstore.tiers.memory import BlockPool


def _name() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def _mapped(name: str) -> bool:
    with open("/proc/self/maps") as f:
        return any(f"memfd:tierstore-{name}" in line for line in f)


def _run(script: str, pass_fds=(), timeout=120, **kw) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")]))
    )
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        pass_fds=pass_fds,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


@pytest.fixture
def seg():
    s = Segment.create(_name(), block_bytes=5000, host_slots=3, staging_slots=2)
    yield s
    s.close()


def test_create_lays_out_header_gens_and_slots_and_seals_the_memfd(seg):
    h = seg.header
    assert (h.slot_bytes, h.host_slots, h.staging_slots, h.slots) == (8192, 3, 2, 5)
    assert h.slot_offset == SLOT_ALIGN_BYTES and h.segment_bytes == SLOT_ALIGN_BYTES + 5 * 8192
    st = os.fstat(seg.fd)
    assert st.st_size == h.segment_bytes == seg.size_bytes
    assert stat.S_IMODE(st.st_mode) == 0o600
    assert fcntl.fcntl(seg.fd, F_GET_SEALS) == SEALS
    assert "memfd:tierstore-" in os.readlink(f"/proc/self/fd/{seg.fd}")
    # the header as another reader sees it: straight from the file
    raw = os.pread(seg.fd, HEADER.size, 0)
    assert raw[:8] == b"TSNODE01"
    assert SegmentHeader.unpack(raw, st.st_size) == h
    assert len(h.boot_id) == 16 and h.boot_id != Segment.create(_name(), 4096, 1).header.boot_id
    assert seg.gens_of(range(5)).tolist() == [0] * 5
    assert seg.rows().shape == (5, 8192)
    assert seg.host_rows().shape == (3, 5000) and seg.host_rows().stride() == (8192, 1)


@pytest.mark.parametrize("size", [0, 1, 4096 * 1000])
def test_no_holder_can_resize_the_sealed_memfd(seg, size):
    with pytest.raises(PermissionError):
        os.ftruncate(seg.fd, size)
    with pytest.raises(PermissionError):  # F_SEAL_SEAL: no seal added (nor removed) later
        fcntl.fcntl(seg.fd, F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    assert os.fstat(seg.fd).st_size == seg.size_bytes


def test_geometry_refusals():
    with pytest.raises(LayoutError, match="block_bytes"):
        Segment.create(_name(), 0, 4)
    with pytest.raises(LayoutError, match="at least one slot"):
        Segment.create(_name(), 4096, 0, 0)
    with pytest.raises(LayoutError, match="boot_id"):
        Segment.create(_name(), 4096, 1, boot_id=b"short")
    with pytest.raises(SegmentError, match="segment name"):
        Segment.create("a/b", 4096, 1)
    big = SegmentHeader.for_blocks(4096, 300_000, 0, bytes(16))  # the gen array spills past 2 MiB
    assert big.slot_offset == 2 * SLOT_ALIGN_BYTES >= GEN_OFFSET + 8 * 300_000


def test_columns_and_host_rows_alias_the_mapping(seg):
    offs = column_offsets([3000, 2000])
    assert offs == [0, 3000]
    r0, r1 = seg.column(offs[0], 3000), seg.column(offs[1], 2000, name="rank1")
    assert isinstance(r1, BlockPool) and (r1.num_blocks, r1.block_bytes, r1.name) == (5, 2000, "rank1")
    assert r1.data.shape == (5, 2000) and r1.data.stride() == (8192, 1)
    r0.view(4).fill_(7)  # a staging slot, rank 0
    r1.view(4).fill_(9)  # the same slot, rank 1
    r1.data[1:3].fill_(5)  # what the mover's slice copies do
    off = seg.header.slot_offset
    slot4 = os.pread(seg.fd, 8192, off + 4 * 8192)
    assert slot4[:3000] == b"\7" * 3000 and slot4[3000:5000] == b"\t" * 2000
    assert slot4[5000:] == bytes(3192)  # the slot's padding is nobody's
    assert os.pread(seg.fd, 2000, off + 1 * 8192 + 3000) == b"\5" * 2000
    assert os.pread(seg.fd, 3000, off + 1 * 8192) == bytes(3000)
    # the service's host tier over the same rows: slot s of the pool is slot s of the segment
    host = BlockPool.from_tensor("host", seg.host_rows())
    assert (host.num_blocks, host.block_bytes) == (3, 5000)
    assert bytes(host.view(1)[3000:].numpy()) == b"\5" * 2000
    host.data.index_copy_(0, torch.tensor([2]), torch.full((1, 5000), 3, dtype=torch.uint8))
    assert os.pread(seg.fd, 5000, off + 2 * 8192) == b"\3" * 5000
    assert os.pread(seg.fd, 3192, off + 2 * 8192 + 5000) == bytes(3192)


@pytest.mark.parametrize("offset,shard", [(0, 5001), (4000, 1001), (-1, 10), (0, 0)])
def test_a_column_must_fit_the_block(seg, offset, shard):
    with pytest.raises(LayoutError, match="does not fit"):
        ColumnPool(seg, offset, shard)


@pytest.mark.parametrize("shards", [[], [4096, 0], [-1]])
def test_column_offsets_refuse_empty_shards(shards):
    with pytest.raises(LayoutError):
        column_offsets(shards)


def test_attach_shares_bytes_and_gens_and_takes_the_fd(seg):
    fd = os.dup(seg.fd)
    peer = Segment.attach(fd, block_bytes=5000, boot_id=seg.header.boot_id)
    with pytest.raises(OSError) as e:
        os.fstat(fd)  # attach closed it: the mapping holds the memory
    assert e.value.errno == errno.EBADF
    assert peer.header == seg.header and peer.writable and not peer.owner and peer.fd is None
    peer.column(0, 5000).view(0).fill_(0xAB)
    assert bytes(seg.rows()[0, :5000].numpy()) == b"\xab" * 5000
    assert seg.bump_gens([0, 3, 3]).tolist() == [1, 2, 2]
    assert peer.gens_of([0, 3, 4]).tolist() == [1, 2, 0]
    with pytest.raises(SegmentError, match="owner"):
        peer.bump_gens([0])
    with pytest.raises(ValueError):  # a client's view of the gens is read-only
        peer._gens[0] = 5
    peer.close()


def test_attach_refuses_another_boot_and_blocks_larger_than_a_slot(seg):
    with pytest.raises(SegmentError, match="boot"):
        Segment.attach(os.dup(seg.fd), boot_id=bytes(16))
    with pytest.raises(SegmentError, match="block_bytes"):
        Segment.attach(os.dup(seg.fd), block_bytes=8193)


def test_attach_refuses_what_is_not_a_sealed_tierstore_segment(tmp_path):
    plain = os.memfd_create("plain", os.MFD_CLOEXEC)  # no sealing allowed: a holder could truncate
    os.ftruncate(plain, 4 << 20)
    with pytest.raises(SegmentError, match="not sealed"):
        Segment.attach(plain)
    path = tmp_path / "f"
    path.write_bytes(bytes(4 << 20))
    with pytest.raises(SegmentError):
        Segment.attach(os.open(path, os.O_RDWR))
    foreign = os.memfd_create("foreign", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(foreign, 4 << 20)
    os.pwrite(foreign, b"NOTOURS!", 0)
    fcntl.fcntl(foreign, F_ADD_SEALS, SEALS)
    with pytest.raises(SegmentError, match="magic"):
        Segment.attach(foreign)
    # our header on a file of another size
    wrong = os.memfd_create("wrong", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    hdr = SegmentHeader.for_blocks(4096, 4, 0, bytes(16))
    os.ftruncate(wrong, hdr.segment_bytes + PAGE_BYTES)
    os.pwrite(wrong, hdr.pack(), 0)
    fcntl.fcntl(wrong, F_ADD_SEALS, SEALS)
    with pytest.raises(SegmentError, match="does not match"):
        Segment.attach(wrong)


def test_a_readonly_fd_maps_read_only(seg):
    seg.column(0, 5000).view(2).fill_(0x42)
    ro = seg.readonly_fd()
    assert fcntl.fcntl(ro, fcntl.F_GETFL) & os.O_ACCMODE == os.O_RDONLY
    with pytest.raises(PermissionError):  # the kernel: no writable shared mapping of an O_RDONLY fd
        mmap.mmap(ro, seg.size_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    peer = Segment.attach(ro, block_bytes=5000)
    col = peer.column(0, 5000)
    assert not peer.writable and not col.writable
    assert bytes(col.view(2).numpy()) == b"\x42" * 5000
    assert not peer._np.flags.writeable
    peer.close()


WRITE_THROUGH_READONLY = """
    import sys
    from tierstore.node.segment import Segment
    peer = Segment.attach({fd}, block_bytes=5000)
    col = peer.column(0, 5000)
    print("mapped", peer.writable, bytes(col.view(1)[:4].numpy()).hex(), flush=True)
    col.view(1).fill_(0xEE)
    print("wrote", flush=True)
"""


def test_a_write_through_a_readonly_mapping_faults_in_the_writer_only(seg):
    seg.column(0, 5000).view(1).fill_(0x11)
    ro = seg.readonly_fd()
    try:
        p = _run(WRITE_THROUGH_READONLY.format(fd=ro), pass_fds=(ro,))
    finally:
        os.close(ro)
    assert "mapped False 11111111" in p.stdout, p.stderr[-2000:]
    assert "wrote" not in p.stdout and p.returncode == -signal.SIGSEGV
    assert bytes(seg.rows()[1, :5000].numpy()) == b"\x11" * 5000


OTHER_USER = """
    import mmap, os
    os.setgid(65534); os.setuid(65534)
    out = []
    for flags in (os.O_RDWR, os.O_WRONLY):
        try:
            os.open("/proc/self/fd/{fd}", flags); out.append("reopened")
        except PermissionError:
            out.append("refused")
    try:
        mmap.mmap({fd}, {size}, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE); out.append("mapped rw")
    except PermissionError:
        out.append("refused")
    m = mmap.mmap({fd}, {size}, mmap.MAP_SHARED, mmap.PROT_READ)
    out.append(m[{off}:{off} + 4].hex())
    print(" ".join(out))
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run the reader as another user")
def test_a_reader_of_another_user_cannot_reopen_the_segment_writable(seg):
    seg.rows()[0, :4].fill_(0x5A)
    ro = seg.readonly_fd()
    try:
        p = _run(OTHER_USER.format(fd=ro, size=seg.size_bytes, off=seg.header.slot_offset), pass_fds=(ro,))
    finally:
        os.close(ro)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.split() == ["refused", "refused", "refused", "5a5a5a5a"]


RANK_PROCESS = """
    import os, socket
    from tierstore.node import protocol as P
    from tierstore.node.segment import Segment
    sock = socket.socket(fileno={sock})
    fs = P.FrameSocket(sock, P.REPLY_DECODER)
    welcome, fds = fs.recv_with_fds(1)
    try:
        os.ftruncate(fds[0], 0); truncated = "yes"
    except PermissionError:
        truncated = "EPERM"
    seg = Segment.attach(fds[0], block_bytes=welcome.block_bytes, boot_id=welcome.boot_id)
    col0 = seg.column(0, 3000)
    col1 = seg.column(3000, 2000)
    seen = bytes(col0.view(1)[:8].numpy()).hex()
    col1.view(1).copy_(col0.view(1)[:2000] + 1)  # rank 1 gathers its shard
    gens = seg.gens_of([0, 1]).tolist()
    print("pid", os.getpid(), "truncate", truncated, "seen", seen, "gens", gens, "fds", len(fds), flush=True)
    fs.send(P.Bye(welcome.rid, "attached"))
    assert fs.recv() is None  # the service closes
"""


def test_the_memfd_goes_to_a_second_process_over_scm_rights(seg):
    pattern = torch.arange(3000, dtype=torch.int64).remainder(200).to(torch.uint8)
    seg.column(0, 3000).view(1).copy_(pattern)
    seg.bump_gens([1])
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    h = seg.header
    welcome = P.Welcome(
        7,
        session=1,
        pool="p",
        block_bytes=5000,
        slot_bytes=h.slot_bytes,
        host_slots=h.host_slots,
        staging_slots=h.staging_slots,
        segment_bytes=h.segment_bytes,
        boot_id=h.boot_id,
        op_timeout_s=2.0,
        max_keys=64,
    )
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(RANK_PROCESS.format(sock=theirs.fileno()))],
        pass_fds=(theirs.fileno(),),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    theirs.close()
    fs = P.FrameSocket(ours, P.REQUEST_DECODER)
    try:
        fs.send(welcome, fds=[seg.fd])
        ours.settimeout(120)
        ack = fs.recv()
    finally:
        fs.close()
        out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err[-3000:]
    assert ack == P.Bye(7, "attached")
    words = out.split()
    assert int(words[1]) != os.getpid()
    assert words[3] == "EPERM"  # the sealed segment cannot be shrunk there either
    assert words[5] == bytes(pattern[:8].numpy()).hex()  # rank 1 reads what rank 0 wrote here
    assert " ".join(words[7:9]) == "[0, 1]"  # and the gens the service bumped
    assert words[-1] == "1"
    # and this process sees the other rank's shard, in its own column of the same slot
    assert torch.equal(seg.column(3000, 2000).view(1), pattern[:2000] + 1)


def test_a_forked_child_refuses_the_inherited_mapping_and_attaches_its_own(seg):
    col = seg.column(0, 5000)
    col.view(0).fill_(0x33)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: only our calls, then _exit
        os.close(r)
        out = []
        for call in (
            lambda: col.view(0),
            lambda: col.data,
            seg.rows,
            lambda: seg.column(0, 10),
            lambda: seg.gens_of([0]),
            seg.prefault,
        ):
            try:
                call()
                out.append("used")
            except SegmentError as e:
                out.append("refused" if "inherited across fork" in str(e) else f"other:{e}")
        own = Segment.attach(os.dup(seg.fd))
        out.append(bytes(own.column(0, 4).view(0).numpy()).hex())
        own.close()
        seg.close()  # forgets the inherited mapping; the parent's memfd stays open
        os.write(w, " ".join(out).encode())
        os._exit(0)
    os.close(w)
    got = b""
    while chunk := os.read(r, 4096):
        got += chunk
    os.close(r)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert got.decode().split() == ["refused"] * 6 + ["33333333"]
    assert bytes(col.view(0)[:2].numpy()) == b"\x33\x33"  # the parent's mapping is untouched
    assert os.fstat(seg.fd).st_size == seg.size_bytes


@pytest.mark.parametrize("method", ["auto", "touch"])
def test_prefault_allocates_every_page_and_keeps_the_bytes(method):
    s = Segment.create(_name(), block_bytes=64 << 10, host_slots=48)
    try:
        s.rows()[5].fill_(0x77)
        before = os.fstat(s.fd).st_blocks * 512
        assert before < s.size_bytes // 4
        used = s.prefault(method, chunk_bytes=1 << 20)
        assert used == ("madvise" if method == "auto" else "touch")
        assert os.fstat(s.fd).st_blocks * 512 >= s.size_bytes
        assert bytes(s.rows()[5].numpy()) == b"\x77" * (64 << 10)
        assert bytes(s.rows()[6].numpy()) == bytes(64 << 10)
    finally:
        s.close()


def test_prefault_of_a_readonly_mapping_reads_the_pages_in():
    s = Segment.create(_name(), block_bytes=64 << 10, host_slots=16)
    peer = Segment.attach(s.readonly_fd())
    try:
        assert peer.prefault() == "madvise"  # MADV_POPULATE_READ: WRITE is EINVAL on PROT_READ
        assert os.fstat(s.fd).st_blocks * 512 >= s.size_bytes
        with pytest.raises(SegmentError, match="method"):
            peer.prefault("fast")
    finally:
        peer.close()
        s.close()


def test_close_unmaps_only_after_the_last_view():
    name = _name()
    s = Segment.create(name, block_bytes=4096, host_slots=2)
    col = s.column(0, 4096)
    col.view(1).fill_(0x61)
    keep = col.data
    fd = s.fd
    s.close()
    with pytest.raises(OSError):
        os.fstat(fd)  # the owner's memfd is closed ...
    assert _mapped(name)  # ... but the mapping lives while a view does
    assert bytes(keep[1, :2].numpy()) == b"aa"
    with pytest.raises(SegmentError, match="closed"):
        col.view(1)
    with pytest.raises(SegmentError, match="closed"):
        s.rows()
    s.close()  # idempotent
    del keep, col
    assert not _mapped(name)
    # without outstanding views close() unmaps at once
    name2 = _name()
    with Segment.create(name2, block_bytes=4096, host_slots=1) as s2:
        assert _mapped(name2)
    assert not _mapped(name2) and s2.fd is None
