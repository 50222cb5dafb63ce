"""An SSD/FTL model that stands in for an FDP device and measures WAF.

The model is a page-mapped flash translation layer with FDP (NVMe TP4146, folded into NVMe Base
Specification 2.1): reclaim groups of reclaim units, reclaim unit handles under Initially or
Persistently Isolated GC, over-provisioning, greedy or cost-benefit GC (Rosenblum and Ousterhout,
ACM TOCS 1992), and Deallocate/TRIM, at the granularity of a mapping page (a partial page write is
a read-modify-write). State is kept in numpy arrays and every write/trim/GC step is vectorised.

The I/O observer interface (called by ``tierstore.io`` engines after each completed operation)
is :meth:`FTLModel.on_write` / :meth:`FTLModel.on_trim`.

Continued in ``docs/FDP.md`` (``tierstore/fdp/ftl.py``): each part of the model, with the
specification sections and papers it follows.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import ConfigError, InvariantError

__all__ = ["FTLModel", "ISOLATION_INITIAL", "ISOLATION_PERSISTENT", "GC_POLICIES"]

ISOLATION_INITIAL = "initial"  # RUHT 1h, Initially Isolated (TP4146)
ISOLATION_PERSISTENT = "persistent"  # RUHT 2h, Persistently Isolated (TP4146)
GC_POLICIES = ("greedy", "cost_benefit")

_FREE, _OPEN, _FULL = 0, 1, 2


class _Stream:
    """An append point: the open RU of a host RUH or of a GC destination."""

    __slots__ = ("ru", "wp")

    def __init__(self) -> None:
        self.ru = -1  # RU index, -1 = none open
        self.wp = 0  # next page offset inside the RU


def _check_args(
    capacity_bytes: int,
    ru_size_bytes: int,
    op_fraction: float,
    num_ruh: int,
    isolation: str,
    gc: str,
    page_bytes: int,
    num_rg: int,
    rgif: int,
    gc_free_ru_min: int,
) -> None:
    """:class:`FTLModel`'s arguments checked, each against its own rule (``ConfigError`` naming it)."""
    if page_bytes <= 0 or page_bytes & (page_bytes - 1):
        raise ConfigError(f"page_bytes={page_bytes}: must be a power of two")
    if capacity_bytes <= 0 or capacity_bytes % page_bytes:
        raise ConfigError(
            f"capacity_bytes={capacity_bytes}: must be a positive multiple of page_bytes={page_bytes}"
        )
    if ru_size_bytes <= 0 or ru_size_bytes % page_bytes:
        raise ConfigError(
            f"ru_size_bytes={ru_size_bytes}: must be a positive multiple of page_bytes={page_bytes}"
        )
    if not op_fraction > 0:
        raise ConfigError(f"op_fraction={op_fraction!r}: must be > 0")
    if isolation not in (ISOLATION_INITIAL, ISOLATION_PERSISTENT):
        raise ConfigError(f"isolation={isolation!r}: accepted 'initial' | 'persistent'")
    if gc not in GC_POLICIES:
        raise ConfigError(f"gc={gc!r}: accepted {GC_POLICIES}")
    if not (1 <= num_ruh <= 65535 and 1 <= num_rg):
        raise ConfigError(f"num_ruh={num_ruh}, num_rg={num_rg}: need num_ruh in 1..65535, num_rg >= 1")
    if not 0 <= rgif <= 15 or (1 << rgif) < num_rg:
        raise ConfigError(f"rgif={rgif}: must be 0..15 and 2**rgif >= num_rg={num_rg}")
    if gc_free_ru_min < 2:
        raise ConfigError(f"gc_free_ru_min={gc_free_ru_min}: must be >= 2 (GC needs a spare RU)")


class FTLModel:
    """Page-mapped FTL with FDP reclaim groups, RUHs, isolation and GC.

    Parameters
    ----------
    capacity_bytes : int
        User-visible (logical) capacity, bytes; a multiple of ``page_bytes``.
    ru_size_bytes : int
        Reclaim unit size, bytes (FDP config descriptor RUNS); a multiple of ``page_bytes``.
    op_fraction : float
        Over-provisioning ``(physical - logical) / logical``, > 0.
    num_ruh : int
        Number of reclaim unit handles (placement handles ``0..num_ruh-1``).
    isolation : {"initial", "persistent"}
        RUH type for every RUH (see module doc).
    gc : {"greedy", "cost_benefit"}
        Victim selection.
    page_bytes : int
        Mapping unit, bytes (power of two, 4 KiB..64 KiB typical).
    num_rg : int
        Number of reclaim groups; physical RUs are split evenly.
    rgif : int
        Reclaim Group Identifier Format (bits of the PID naming the RG; FDP
        config descriptor FDPA bits 3:0).  PID = ``rg << (16 - rgif) | handle``.
    gc_free_ru_min : int
        GC keeps at least this many free RUs per RG before a host RU is opened.

    Notes
    -----
    ``stats()`` reports the same counters as a device's FDP Statistics log page
    (HBMW, MBMW, MBE), so :class:`tierstore.fdp.waf.WafWindow` works on both.
    """

    def __init__(
        self,
        capacity_bytes: int,
        ru_size_bytes: int,
        op_fraction: float,
        num_ruh: int = 8,
        isolation: str = ISOLATION_INITIAL,
        gc: str = "greedy",
        page_bytes: int = 64 * 1024,
        num_rg: int = 1,
        rgif: int = 0,
        gc_free_ru_min: int = 3,
    ) -> None:
        _check_args(
            capacity_bytes,
            ru_size_bytes,
            op_fraction,
            num_ruh,
            isolation,
            gc,
            page_bytes,
            num_rg,
            rgif,
            gc_free_ru_min,
        )
        self.capacity_bytes = int(capacity_bytes)
        self.ru_size_bytes = int(ru_size_bytes)
        self.op_fraction = float(op_fraction)
        self.num_ruh = int(num_ruh)
        self.num_rg = int(num_rg)
        self.rgif = int(rgif)
        self.isolation = isolation
        self.gc = gc
        self.page_bytes = int(page_bytes)
        self.gc_free_ru_min = int(gc_free_ru_min)

        self.logical_pages = capacity_bytes // page_bytes
        self.ru_pages = ru_size_bytes // page_bytes
        phys_pages = math.ceil(self.logical_pages * (1.0 + op_fraction))
        self.rus_per_rg = math.ceil(phys_pages / num_rg / self.ru_pages)
        # Every stream may hold one open RU; need room for them plus the GC reserve.
        streams_per_rg = num_ruh + (num_ruh if isolation == ISOLATION_PERSISTENT else 1)
        if self.rus_per_rg < streams_per_rg + gc_free_ru_min + 1:
            raise ConfigError(
                f"{self.rus_per_rg} RUs per RG is too few for {streams_per_rg} open "
                f"streams and a GC reserve of {gc_free_ru_min}; use smaller RUs"
            )
        self.num_ru = self.rus_per_rg * num_rg
        self.physical_pages = self.num_ru * self.ru_pages

        self.l2p = np.full(self.logical_pages, -1, dtype=np.int64)
        self.p2l = np.full(self.physical_pages, -1, dtype=np.int64)
        self.p_ruh = np.zeros(self.physical_pages, dtype=np.int32)  # RUH of the host write that made the page
        self.ru_valid = np.zeros(self.num_ru, dtype=np.int64)
        self.ru_state = np.zeros(self.num_ru, dtype=np.int8)
        self.ru_stamp = np.zeros(self.num_ru, dtype=np.float64)  # host-page clock of last append
        self.ru_erases = np.zeros(self.num_ru, dtype=np.int64)
        self._free: list[list[int]] = [
            list(range((g + 1) * self.rus_per_rg - 1, g * self.rus_per_rg - 1, -1)) for g in range(num_rg)
        ]
        self._host = [[_Stream() for _ in range(num_ruh)] for _ in range(num_rg)]
        n_gc = num_ruh if isolation == ISOLATION_PERSISTENT else 1
        self._gcs = [[_Stream() for _ in range(n_gc)] for _ in range(num_rg)]
        self._in_gc = False
        self._clock = 0.0

        self._zero_counters()

    def _zero_counters(self) -> None:
        """The model's counters at creation: bytes written by the host (HBMW), to the media (whole
        pages, MBMW) and erased (MBE), per RUH and per tenant, and the events counted."""
        # Counters (bytes). HBMW counts the host's bytes; MBMW whole media pages.
        self.hbmw_bytes = 0
        self.mbmw_bytes = 0
        self.mbe_bytes = 0
        self.trimmed_bytes = 0
        self.invalid_pid_writes = 0
        self.ruh_host_bytes = np.zeros(self.num_ruh, dtype=np.int64)  # host bytes per RUH (page-rounded)
        self.ruh_gc_bytes = np.zeros(self.num_ruh, dtype=np.int64)  # GC relocation bytes per originating RUH
        self.gc_runs = 0
        self.ruh_updates = 0
        # Optional tenants: named LBA ranges (set_tenants); bytes per tenant.
        self.tenant_names: list[str] = []
        self._tenant_lo = np.zeros(0, dtype=np.int64)  # first logical page of each tenant
        self.tenant_host_bytes = np.zeros(0, dtype=np.int64)
        self.tenant_gc_bytes = np.zeros(0, dtype=np.int64)
        self.ruh_update_unwritten_bytes = 0  # unwritten tails of RUs closed by RUH Update

    # ------------------------------------------------------------------ PIDs
    def pid_of(self, rg: int, handle: int) -> int:
        """PID = ``rg << (16 - rgif) | handle`` (TP4146 Placement Identifier; FDPA.RGIF)."""
        return (int(rg) << (16 - self.rgif)) | int(handle) if self.rgif else int(handle)

    def decode_pid(self, pid: int | None) -> tuple[int, int]:
        """Return ``(rg, ruh)`` for a PID; ``None`` or an invalid PID -> default ``(0, 0)``.

        An invalid PID is counted in ``invalid_pid_writes`` (a device logs an
        "Invalid Placement Identifier" FDP event, type 03h, and uses the default).
        """
        if pid is None:
            return 0, 0
        pid = int(pid)
        shift = 16 - self.rgif
        rg = pid >> shift if self.rgif else 0
        handle = pid & ((1 << shift) - 1)
        if not (0 <= rg < self.num_rg and 0 <= handle < self.num_ruh) or pid >> 16:
            self.invalid_pid_writes += 1
            return 0, 0
        return rg, handle

    # ------------------------------------------------------------ tenants
    def set_tenants(self, ranges: list[tuple[str, int, int]]) -> None:
        """Attribute host and GC bytes to named LBA ranges (tenants sharing the device).

        Parameters
        ----------
        ranges : list of (str, int, int)
            ``(name, start_bytes, end_bytes)``, page-aligned, non-overlapping;
            pages outside every range count under the name ``"other"``.

        A tenant's own write amplification is ``(host + GC bytes of its pages) /
        host bytes``; with per-tenant RUHs it equals its handles' ``ruh_waf``,
        without placement it is the only way to tell tenants apart (the model
        knows which logical page GC moves, a device does not report it).

        Raises
        ------
        ConfigError
            Misaligned, overlapping or out-of-range ranges, or called after writes.
        """
        if self.hbmw_bytes:
            raise ConfigError("set_tenants: call it before the first write")
        pb = self.page_bytes
        rs = sorted(ranges, key=lambda r: r[1])
        prev = 0
        los, names = [], []
        for name, lo, hi in rs:
            if lo % pb or hi % pb or not 0 <= lo < hi <= self.capacity_bytes or lo < prev:
                raise ConfigError(
                    f"tenant {name!r}: range [{lo}, {hi}) must be page-aligned, inside "
                    f"[0, {self.capacity_bytes}) and not overlap the previous one"
                )
            if lo > prev:
                los.append(prev // pb)
                names.append("other")
            los.append(lo // pb)
            names.append(name)
            prev = hi
        if prev < self.capacity_bytes:
            los.append(prev // pb)
            names.append("other")
        self.tenant_names = names
        self._tenant_lo = np.asarray(los, dtype=np.int64)
        self.tenant_host_bytes = np.zeros(len(names), dtype=np.int64)
        self.tenant_gc_bytes = np.zeros(len(names), dtype=np.int64)

    def _tenant_add(self, counter: np.ndarray, lpns: np.ndarray) -> None:
        if self._tenant_lo.size:
            t = np.searchsorted(self._tenant_lo, lpns, side="right") - 1
            counter += np.bincount(t, minlength=counter.size) * self.page_bytes

    # ------------------------------------------------------------ observer API
    def on_write(self, offset_bytes: int, nbytes: int, placement: int | None) -> None:
        """I/O observer hook: a write of ``nbytes`` at ``offset_bytes`` completed.

        ``placement`` is the PID the I/O layer tagged the write with, or ``None``.
        """
        self.write(offset_bytes, nbytes, placement)

    def on_trim(self, offset_bytes: int, nbytes: int) -> None:
        """I/O observer hook: a deallocate (TRIM) of ``nbytes`` at ``offset_bytes`` completed."""
        self.trim(offset_bytes, nbytes)

    def ruh_update(self, placement: int | None) -> None:
        """Reclaim Unit Handle Update (TP4146, I/O Management Send): point the handle
        named by ``placement`` at a fresh RU.

        The RU the handle had open is closed as it is (its unwritten tail stays
        unwritten, counted in ``ruh_update_unwritten_bytes``); the next write
        through the handle opens a new RU.  A handle
        with no open RU, or one whose RU is empty, is left as it is.
        """
        rg, ruh = self.decode_pid(placement)
        st = self._host[rg][ruh]
        if st.ru >= 0 and st.wp > 0:
            self.ruh_update_unwritten_bytes += (self.ru_pages - st.wp) * self.page_bytes
            self.ru_state[st.ru] = _FULL
            st.ru = -1
            st.wp = 0
            self.ruh_updates += 1

    # --------------------------------------------------------------- direct API
    def _page_range(self, offset_bytes: int, nbytes: int, outward: bool) -> tuple[int, int]:
        if offset_bytes < 0 or nbytes < 0 or offset_bytes + nbytes > self.capacity_bytes:
            raise ConfigError(
                f"range [{offset_bytes}, {offset_bytes + nbytes}) outside capacity {self.capacity_bytes}"
            )
        pb = self.page_bytes
        if outward:
            return offset_bytes // pb, -(-(offset_bytes + nbytes) // pb)
        return -(-offset_bytes // pb), (offset_bytes + nbytes) // pb

    def write(self, offset_bytes: int, nbytes: int, placement: int | None = None) -> None:
        """Host write of ``nbytes`` at byte ``offset_bytes`` with PID ``placement`` (or None)."""
        lo, hi = self._page_range(offset_bytes, nbytes, outward=True)
        if hi <= lo:
            return
        self.hbmw_bytes += int(nbytes)
        self.write_pages(np.arange(lo, hi, dtype=np.int64), placement, count_host_bytes=False)

    def write_pages(
        self, lpns: np.ndarray, placement: int | None = None, count_host_bytes: bool = True
    ) -> None:
        """Host write of whole pages ``lpns`` (int64 array, any order, duplicates allowed).

        Used by the validation workload (uniform random single-page writes).
        """
        lpns = np.asarray(lpns, dtype=np.int64)
        if lpns.size == 0:
            return
        if lpns.min() < 0 or lpns.max() >= self.logical_pages:
            raise ConfigError("write_pages: logical page out of range")
        rg, ruh = self.decode_pid(placement)
        if count_host_bytes:
            self.hbmw_bytes += int(lpns.size) * self.page_bytes
        self.ruh_host_bytes[ruh] += int(lpns.size) * self.page_bytes
        self._tenant_add(self.tenant_host_bytes, lpns)
        self._append(self._host[rg][ruh], rg, lpns, ruh, host=True)

    def trim(self, offset_bytes: int, nbytes: int) -> None:
        """Deallocate the pages fully inside ``[offset_bytes, offset_bytes + nbytes)``."""
        lo, hi = self._page_range(offset_bytes, nbytes, outward=False)
        if hi <= lo:
            return
        old = self.l2p[lo:hi]
        old = old[old >= 0]
        self.trimmed_bytes += int(old.size) * self.page_bytes
        self._invalidate(old)
        self.l2p[lo:hi] = -1

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        """Cumulative counters, like a device's FDP Statistics log page plus model detail.

        Returns
        -------
        dict
            ``hbmw_bytes``, ``mbmw_bytes``, ``mbe_bytes`` (int, bytes, cumulative);
            ``waf`` (float, MBMW/HBMW since creation, nan before any write);
            ``ruh_host_bytes`` / ``ruh_gc_bytes`` (list[int], per RUH, bytes);
            ``ruh_waf`` (list[float], (host+gc)/host per RUH); ``gc_runs``,
            ``trimmed_bytes``, ``invalid_pid_writes``, ``valid_bytes`` (int);
            with :meth:`set_tenants`, ``tenants``: name -> ``host_bytes``,
            ``gc_bytes`` (page-rounded) and ``wa``.
        """
        host = self.ruh_host_bytes
        with np.errstate(divide="ignore", invalid="ignore"):
            ruh_waf = np.where(host > 0, (host + self.ruh_gc_bytes) / np.maximum(host, 1), np.nan)
        return {
            "hbmw_bytes": int(self.hbmw_bytes),
            "mbmw_bytes": int(self.mbmw_bytes),
            "mbe_bytes": int(self.mbe_bytes),
            "waf": self.mbmw_bytes / self.hbmw_bytes if self.hbmw_bytes else float("nan"),
            "ruh_host_bytes": [int(x) for x in host],
            "ruh_gc_bytes": [int(x) for x in self.ruh_gc_bytes],
            "ruh_waf": [float(x) for x in ruh_waf],
            "gc_runs": int(self.gc_runs),
            "ruh_updates": int(self.ruh_updates),
            "ruh_update_unwritten_bytes": int(self.ruh_update_unwritten_bytes),
            "trimmed_bytes": int(self.trimmed_bytes),
            "invalid_pid_writes": int(self.invalid_pid_writes),
            "valid_bytes": int(self.ru_valid.sum()) * self.page_bytes,
            **self._tenant_stats(),
        }

    def _tenant_stats(self) -> dict[str, Any]:
        if not self.tenant_names:
            return {}
        out: dict[str, dict] = {}
        for name, h, g in zip(
            self.tenant_names, self.tenant_host_bytes.tolist(), self.tenant_gc_bytes.tolist()
        ):
            cur = out.setdefault(name, {"host_bytes": 0, "gc_bytes": 0})
            cur["host_bytes"] += int(h)
            cur["gc_bytes"] += int(g)
        for v in out.values():
            v["wa"] = (v["host_bytes"] + v["gc_bytes"]) / v["host_bytes"] if v["host_bytes"] else float("nan")
        return {"tenants": out}

    def check_invariants(self) -> None:
        """Cross-check ``l2p``/``p2l``/valid counts; raise :class:`InvariantError` on mismatch."""
        mapped = np.flatnonzero(self.l2p >= 0)
        phys = self.l2p[mapped]
        if not np.array_equal(self.p2l[phys], mapped):
            raise InvariantError("l2p and p2l disagree")
        counts = np.bincount(np.flatnonzero(self.p2l >= 0) // self.ru_pages, minlength=self.num_ru)
        if not np.array_equal(counts, self.ru_valid):
            raise InvariantError("per-RU valid counts disagree with p2l")
        if int((self.p2l >= 0).sum()) != mapped.size:
            raise InvariantError("p2l holds stale mappings")

    # -------------------------------------------------------------- internals
    def _invalidate(self, old_phys: np.ndarray) -> None:
        if old_phys.size == 0:
            return
        self.p2l[old_phys] = -1
        rus, cnt = np.unique(old_phys // self.ru_pages, return_counts=True)
        self.ru_valid[rus] -= cnt

    def _alloc_ru(self, rg: int, for_gc: bool) -> int:
        free = self._free[rg]
        if not for_gc:
            while len(free) < self.gc_free_ru_min:
                self._gc_one(rg)
        if not free:
            raise InvariantError(f"reclaim group {rg}: no free RU (GC reserve exhausted)")
        ru = free.pop()
        self.ru_state[ru] = _OPEN
        return ru

    def _append(self, st: _Stream, rg: int, lpns: np.ndarray, ruh: int | np.ndarray, host: bool) -> None:
        """Append pages to a stream's open RU(s); ``ruh`` is the originating RUH (scalar or per page)."""
        n = lpns.size
        done = 0
        rp = self.ru_pages
        while done < n:
            if st.ru < 0 or st.wp >= rp:
                if st.ru >= 0:
                    self.ru_state[st.ru] = _FULL
                st.ru = self._alloc_ru(rg, for_gc=not host)
                st.wp = 0
            k = min(rp - st.wp, n - done)
            chunk = lpns[done : done + k]
            if host:
                old = self.l2p[chunk]
                old = old[old >= 0]
                if old.size:
                    self._invalidate(np.unique(old))
            phys = np.arange(st.ru * rp + st.wp, st.ru * rp + st.wp + k, dtype=np.int64)
            self.l2p[chunk] = phys
            live = self.l2p[chunk] == phys  # duplicates inside the chunk: last one wins
            self.p2l[phys] = np.where(live, chunk, -1)
            self.p_ruh[phys] = ruh if np.isscalar(ruh) else ruh[done : done + k]
            self.ru_valid[st.ru] += int(live.sum()) if k > 1 else int(live[0])
            self.ru_stamp[st.ru] = self._clock
            self.mbmw_bytes += k * self.page_bytes
            if host:
                self._clock += k
            st.wp += k
            done += k

    def _pick_victim(self, rg: int) -> int:
        lo, hi = rg * self.rus_per_rg, (rg + 1) * self.rus_per_rg
        full = self.ru_state[lo:hi] == _FULL
        if not full.any():
            raise InvariantError(f"reclaim group {rg}: GC found no full RU to reclaim")
        valid = self.ru_valid[lo:hi]
        if self.gc == "greedy":
            score = np.where(full, valid, np.iinfo(np.int64).max)
            return lo + int(np.argmin(score))
        u = valid / self.ru_pages
        age = self._clock - self.ru_stamp[lo:hi] + 1.0
        with np.errstate(divide="ignore"):
            benefit = np.where(u > 0, (1.0 - u) * age / (2.0 * u), np.inf)
        benefit = np.where(full, benefit, -np.inf)
        return lo + int(np.argmax(benefit))

    def _gc_one(self, rg: int) -> None:
        if self._in_gc:
            raise InvariantError("GC re-entered")
        self._in_gc = True
        try:
            victim = self._pick_victim(rg)
            if self.ru_valid[victim] >= self.ru_pages:
                raise InvariantError(
                    f"reclaim group {rg}: every full RU is fully valid; "
                    "device is full (raise op_fraction or trim)"
                )
            rp = self.ru_pages
            base = victim * rp
            lp = self.p2l[base : base + rp]
            keep = lp >= 0
            n_valid = int(keep.sum())
            if n_valid:
                moved = lp[keep].copy()
                owners = self.p_ruh[base : base + rp][keep].copy()
                self.ruh_gc_bytes += np.bincount(owners, minlength=self.num_ruh) * self.page_bytes
                self._tenant_add(self.tenant_gc_bytes, moved)
                self.p2l[base : base + rp] = -1
                self.ru_valid[victim] = 0
                if self.isolation == ISOLATION_PERSISTENT:
                    for h in np.unique(owners):
                        sel = owners == h
                        self._append(self._gcs[rg][int(h)], rg, moved[sel], int(h), host=False)
                else:
                    self._append(self._gcs[rg][0], rg, moved, owners, host=False)
            # Erase: the RU returns to the free pool.
            self.ru_state[victim] = _FREE
            self.ru_erases[victim] += 1
            self.mbe_bytes += self.ru_size_bytes
            self._free[rg].insert(0, victim)
            self.gc_runs += 1
        finally:
            self._in_gc = False
