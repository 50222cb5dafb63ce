"""kvikio (GPUDirect Storage / compat mode) backend; needs CUDA."""

import os

import pytest
import torch

from tierstore.io.kvikio import KvikioUnavailable, kvikio_available


def test_unavailable_is_a_clear_error(tmp_path):
    ok, why = kvikio_available()
    if ok:
        pytest.skip("kvikio is available here")
    from tierstore.io import open_engine

    with pytest.raises(KvikioUnavailable, match="CUDA|kvikio"):
        open_engine("kvikio", str(tmp_path / "k.bin"), 1 << 20)


@pytest.mark.gpu
@pytest.mark.skipif(not kvikio_available()[0], reason="needs kvikio and a CUDA device")
@pytest.mark.parametrize("nbytes", [4096, 1 << 20, (1 << 20) + 4096])
def test_kvikio_round_trip_device_buffers(tmp_path, nbytes):
    from tierstore.io import open_engine

    eng = open_engine("kvikio", str(tmp_path / "k.bin"), 4 << 20)
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    assert eng.write(4096, src).get() == nbytes
    eng.sync()
    assert eng.read(4096, dst).get() == nbytes
    assert torch.equal(src, dst)
    eng.close()


@pytest.mark.gpu
@pytest.mark.skipif(not kvikio_available()[0], reason="needs kvikio and a CUDA device")
def test_kvikio_segment_store(tmp_path):
    from tierstore.errors import Status
    from tierstore.io import SegmentStorage

    s = SegmentStorage(
        str(tmp_path / "s.bin"),
        8 << 20,
        64 << 10,
        segment_size_bytes=1 << 20,
        engine="kvikio",
        extent_size_bytes=256 << 10,
    )
    keys = [os.urandom(32) for _ in range(8)]
    blocks = [torch.randint(0, 256, (64 << 10,), dtype=torch.uint8) for _ in keys]
    assert s.put(keys, blocks) == [Status.OK] * 8
    d = [torch.empty(64 << 10, dtype=torch.uint8) for _ in keys]
    assert s.get(keys, d) == [Status.OK] * 8
    assert all(torch.equal(a, b) for a, b in zip(blocks, d))
    s.close()
