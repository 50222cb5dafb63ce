"""io/_fileops.lock_exclusive: the lock of one writer per NVMe tier file."""

from __future__ import annotations

import os

import pytest

from tierstore.errors import StoreLockedError
from tierstore.io import _fileops


def test_a_lock_released_between_the_try_and_proc_locks_is_taken(tmp_path, monkeypatch):
    """A killed holder's last io_uring reference may drop the flock after our LOCK_NB try
    failed and before /proc/locks is read: no holder is listed then. That is not another
    container's process; trying again gets the lock (CI saw test_kill9_recovery[uring]
    refused with "its PID is not visible here")."""
    real_flock = _fileops.fcntl.flock
    tries = []

    def flock(fd, op):
        tries.append(op)
        if len(tries) == 1:
            raise BlockingIOError(11, "Resource temporarily unavailable")
        return real_flock(fd, op)

    monkeypatch.setattr(_fileops.fcntl, "flock", flock)
    monkeypatch.setattr(_fileops, "lock_holder_pid", lambda fd: None)
    fd = os.open(tmp_path / "tier", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _fileops.lock_exclusive(fd, str(tmp_path / "tier"), timeout_s=5.0)
        assert len(tries) == 2
    finally:
        os.close(fd)


def test_a_lock_whose_holder_stays_unlisted_is_refused_within_the_retry(tmp_path, monkeypatch):
    def flock(fd, op):
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(_fileops.fcntl, "flock", flock)
    monkeypatch.setattr(_fileops, "lock_holder_pid", lambda fd: None)
    monkeypatch.setattr(_fileops, "UNSEEN_HOLDER_RETRY_S", 0.05)
    fd = os.open(tmp_path / "tier", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(StoreLockedError, match="PID is not visible"):
            _fileops.lock_exclusive(fd, str(tmp_path / "tier"), timeout_s=30.0)
    finally:
        os.close(fd)
