"""Exact NVMe passthrough encoding; the ring itself is exercised with NOPs; device path is @fdp."""

from __future__ import annotations

import ctypes
import os
import struct

import pytest

from tierstore.errors import AlignmentError, ConfigError
from tierstore.fdp import passthrough as pt
from tierstore.fdp.placement import make_pid


def test_pid_and_cdw_encoding():
    pid = make_pid(1, 3, rgif=2)
    assert pid == 0x4003
    assert pt.write_cdw13(pid) == 0x40030000
    assert pt.write_cdw12(8, placed=True) == 0x00200007
    assert pt.write_cdw12(8, placed=False) == 0x7
    assert pt.write_cdw13(None) == 0
    with pytest.raises(ConfigError):
        pt.write_cdw12(0, True)


def test_nvme_uring_cmd_layout():
    assert pt.NVME_URING_CMD_IO == 0xC0484E80
    cmd = pt.build_write_cmd(
        nsid=1, slba=(5 << 32) | 7, nlb=8, addr=0x1122334455667788, lba_bytes=4096, pid=0x4003
    )
    b = cmd.pack()
    assert len(b) == 72
    assert b[0] == 0x01  # opcode write
    assert struct.unpack_from("<I", b, 4)[0] == 1  # nsid
    assert struct.unpack_from("<Q", b, 24)[0] == 0x1122334455667788  # addr
    assert struct.unpack_from("<I", b, 36)[0] == 8 * 4096  # data_len
    assert struct.unpack_from("<II", b, 40) == (7, 5)  # cdw10/cdw11 = slba lo/hi
    assert struct.unpack_from("<I", b, 48)[0] == 0x00200007  # cdw12
    assert struct.unpack_from("<I", b, 52)[0] == 0x40030000  # cdw13
    assert pt.NvmeUringCmd.unpack(b) == cmd


@pytest.mark.uring
def test_ring_sqe128_cqe32_and_uring_cmd_sqe():
    with pt.IoUring(8, big=True) as ring:
        ring.prep_nop(11)
        cmd = pt.build_write_cmd(1, 0, 8, 0, 4096, 0x4003)
        ring.prep_nvme_cmd(-1, cmd, 12)
        sqe = ring.sqe_bytes_at(-1)
        assert len(sqe) == 128
        assert sqe[0] == pt.IORING_OP_URING_CMD
        assert struct.unpack_from("<I", sqe, 8)[0] == pt.NVME_URING_CMD_IO
        assert sqe[48 : 48 + 72] == cmd.pack()
        got = {ud: res for ud, res, _ in ring.submit_and_wait(2)}
        assert got[11] == 0
        assert got[12] == -9  # EBADF: the kernel accepted the URING_CMD SQE shape, fd -1 rejected


@pytest.mark.uring
def test_write_stream_field():
    with pt.IoUring(4, big=False) as ring:
        buf = ctypes.create_string_buffer(4096)
        ring.prep_write(-1, ctypes.addressof(buf), 4096, 8192, 5, write_stream=3)
        sqe = ring.sqe_bytes_at(-1)
        assert sqe[0] == pt.IORING_OP_WRITE and sqe[44] == 3
        assert struct.unpack_from("<Q", sqe, 8)[0] == 8192


def test_select_write_path(tmp_path):
    dev, sysfs = tmp_path / "dev", tmp_path / "sys"
    dev.mkdir()
    q = sysfs / "block" / "nvme0n1" / "queue"
    q.mkdir(parents=True)
    p = pt.select_write_path("/dev/nvme0n1", dev_root=str(dev), sys_root=str(sysfs))
    assert p.mode == "none" and "no FDP placement" in p.status
    (q / "max_write_streams").write_text("8\n")
    p = pt.select_write_path("/dev/nvme0n1", dev_root=str(dev), sys_root=str(sysfs))
    assert (p.mode, p.streams) == ("write_stream", 8)
    (dev / "ng0n1").write_text("")
    p = pt.select_write_path("/dev/nvme0n1", dev_root=str(dev), sys_root=str(sysfs))
    assert p.mode == "uring_cmd" and p.device.endswith("ng0n1")


def test_alignment():
    assert pt.check_aligned(8192, 32768, 4096) == (2, 8)
    with pytest.raises(AlignmentError):
        pt.check_aligned(100, 4096, 4096)


@pytest.mark.fdp
@pytest.mark.skipif(
    not pt.ng_char_devices() or not os.environ.get("TIERSTORE_FDP_SCRATCH_NG"),
    reason="needs /dev/ng* and TIERSTORE_FDP_SCRATCH_NG=/dev/ngXnY "
    "(a scratch namespace: LBA 0 is overwritten)",
)
def test_device_placed_write():
    dev = os.environ["TIERSTORE_FDP_SCRATCH_NG"]
    w = pt.PassthroughWriter(dev, nsid=int(dev.rsplit("n", 1)[1]))
    try:
        buf = (ctypes.c_char * (8 * 4096))()
        assert w.write(buf, 0, None) == 0
    finally:
        w.close()


@pytest.mark.uring
def test_writer_sends_commands_through_the_shared_queue(tmp_path):
    """PassthroughWriter -> RingQueue.submit_cmd -> Ring.prep_uring_cmd, as on a device.

    A regular file has no ``uring_cmd`` handler, so the kernel completes the command
    with a negative errno: the writer must report that as :class:`IoUringError`
    (CI once hit a TypeError here, because the ring subclass changed the signature).
    """
    f = tmp_path / "not-a-char-dev"
    f.write_bytes(bytes(8192))
    w = pt.PassthroughWriter(str(f), 1, 4096, entries=4)
    try:
        import ctypes

        buf = (ctypes.c_char * 4096)()
        with pytest.raises(pt.IoUringError) as e:
            w.write(buf, 0, 3)
        assert e.value.errno in (95, 22, 25)  # EOPNOTSUPP / EINVAL / ENOTTY, by kernel version
        with pytest.raises(pt.IoUringError):
            w.ruh_status_bytes(64)
    finally:
        w.close()
