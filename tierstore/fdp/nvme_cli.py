"""FDP device discovery and reading through nvme-cli, driven by the ``sh`` package.

What is read, and how (nvme-cli 2.3 option spellings, checked against
``nvme <cmd> --help`` of 2.3 and nvme-cli ``plugins/fdp/fdp.c``):

=====================  =============================================  ==========================
What                   Command                                        Parsed by
=====================  =============================================  ==========================
FDP support            ``nvme id-ctrl DEV -b`` (4096 raw bytes)       CTRATT bit 19 (FDPS)
FDP enabled?           ``nvme get-feature DEV -f 0x1d -c ENDGID``     "Current value:0x..." bit 0
enable FDP             ``nvme set-feature DEV -f 0x1d -v ENDGID``     (CDW11 = ENDGID,
                       ``-c (IDX << 8 | 1) -s``                        CDW12 = FDPCIDX<<8 | FDPE)
configurations (20h)   ``nvme fdp configs DEV -e ENDGID -b``          :func:`logpages.parse_fdp_configs`
RUH usage (21h)        ``nvme fdp usage DEV -e ENDGID -b``            :func:`logpages.parse_ruh_usage`
statistics (22h)       ``nvme fdp stats DEV -e ENDGID -b``            :func:`logpages.parse_fdp_stats`
events (23h)           ``nvme fdp events DEV -e ENDGID [-E] -b``      :func:`logpages.parse_fdp_events`
RUH status             ``nvme io-mgmt-recv DEV -n NSID -m 1 -l LEN``  :func:`parse_hex_dump`, then
                       (I/O Management Receive, MO 01h)               :func:`logpages.parse_ruh_status`
Identify Namespace     ``nvme id-ns DEV -n NSID -b`` (4096 bytes)     :func:`logpages.parse_id_ns`
=====================  =============================================  ==========================

Continued in ``docs/FDP.md`` (``tierstore/fdp/nvme_cli.py``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, CorruptData, TierStoreError
from ..extras import require
from . import logpages as lp

if TYPE_CHECKING:
    import sh  # the fdp extra, imported when nvme-cli is driven (require below)

__all__ = [
    "NvmeCliError",
    "NvmeCli",
    "FdpDeviceStats",
    "FdpDeviceInfo",
    "FID_FDP",
    "parse_stats_json",
    "parse_stats_text",
    "parse_ruh_status_json",
    "parse_configs_json",
    "parse_usage_json",
    "parse_events_json",
    "parse_feature_value",
    "parse_hex_dump",
]

#: Feature identifier of Flexible Data Placement (Base Spec 2.1, figure "Feature Identifiers").
FID_FDP = 0x1D


class NvmeCliError(TierStoreError):
    """nvme-cli is missing, failed, or printed something we cannot parse."""


def _check_endgid(endgid: int) -> int:
    endgid = int(endgid)
    if not 1 <= endgid <= 0xFFFF:
        raise ConfigError(
            f"endurance group id {endgid}: valid ids are 1..65535 (0 is not an endurance group)"
        )
    return endgid


def _u(v: Any) -> int:
    """A JSON counter: int, or a decimal/hex string (uint128 counters are strings)."""
    if isinstance(v, bool):
        raise CorruptData(f"expected an integer counter, got {v!r}")
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        s = v.strip().replace(",", "").replace("_", "")
        try:
            return int(s, 0)
        except ValueError:
            raise CorruptData(f"unparsable counter {v!r}") from None
    raise CorruptData(f"expected an integer counter, got {type(v).__name__} {v!r}")


# ---------------------------------------------------------------- JSON / text
def parse_stats_json(text: str | bytes) -> lp.FdpStats:
    """``nvme fdp stats -o json``: ``{"hbmw": .., "mbmw": .., "mbe": ..}`` (strings or numbers)."""
    d = json.loads(text)
    try:
        return lp.FdpStats(_u(d["hbmw"]), _u(d["mbmw"]), _u(d["mbe"]))
    except KeyError as e:
        raise CorruptData(f"fdp stats JSON lacks {e}") from None


_STATS_TEXT = {
    "hbmw": r"\(HBMW\)\s*:\s*([0-9.,' \u00a0\u202f]+)",
    "mbmw": r"\(MBMW\)\s*:\s*([0-9.,' \u00a0\u202f]+)",
    "mbe": r"\(MBE\)\s*:\s*([0-9.,' \u00a0\u202f]+)",
}


def parse_stats_text(text: str | bytes) -> lp.FdpStats:
    """``nvme fdp stats`` normal output, e.g. ``Host Bytes with Metadata Written (HBMW): 1,234``.

    Counters are printed with ``uint128_t_to_l10n_string`` (locale thousands
    separators), so only the digits are kept.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    vals = {}
    for k, pat in _STATS_TEXT.items():
        m = re.search(pat, text)
        if not m:
            raise CorruptData(f"fdp stats text lacks {k.upper()}")
        digits = re.sub(r"\D", "", m.group(1))
        if not digits:
            raise CorruptData(f"fdp stats text: no digits for {k.upper()}")
        vals[k] = int(digits)
    return lp.FdpStats(vals["hbmw"], vals["mbmw"], vals["mbe"])


def parse_ruh_status_json(text: str | bytes) -> lp.RuhStatus:
    """``nvme fdp status -o json``: ``{"nruhsd": n, "ruhss": [{"pid","ruhid","earutr","ruamw"}]}``."""
    items = _counted_json(text, "status", "nruhsd", "ruhss")
    descs = tuple(
        lp.RuhStatusDesc(_u(x["pid"]), _u(x["ruhid"]), _u(x.get("earutr", 0)), _u(x.get("ruamw", 0)))
        for x in items
    )
    return lp.RuhStatus(len(items), descs)


def _counted_json(text: str | bytes, what: str, count_key: str, list_key: str) -> list:
    """The first ``count_key`` items of the list ``list_key`` of nvme-cli's JSON ``text``.

    Raises
    ------
    CorruptData
        When the list holds fewer items than the count says.
    """
    d = json.loads(text)
    n = _u(d[count_key])
    items = d.get(list_key, [])
    if len(items) < n:
        raise CorruptData(f"fdp {what} JSON: {count_key}={n} but {len(items)} descriptors")
    return items[:n]


def parse_configs_json(text: str | bytes) -> lp.FdpConfigLog:
    """``nvme fdp configs -o json``. ``n`` is 0-based; ``ruhs``/``maxpids`` may be absent (2.x).

    Missing ``maxpids`` is reported as ``nruh - 1``; missing ``ruhs`` as an empty tuple.
    Prefer the binary log (:func:`logpages.parse_fdp_configs`) when you need RUH types.
    """
    d = json.loads(text)
    configs = []
    for c in d.get("configs", []):
        ruhs = tuple(lp.RuhDesc(_u(r["ruht"])) for r in c.get("ruhs", []))
        nruh = _u(c["nruh"])
        configs.append(
            lp.FdpConfig(
                size_bytes=0,
                fdpa=_u(c["fdpa"]),
                vss_bytes=_u(c.get("vss", 0)),
                nrg=_u(c["nrg"]),
                nruh=nruh,
                maxpids=_u(c.get("maxpids", max(nruh - 1, 0))),
                nnss=_u(c.get("nnss", 0)),
                runs_bytes=_u(c["runs"]),
                erutl_s=_u(c.get("erutl", 0)),
                ruhs=ruhs,
            )
        )
    n = _u(d.get("n", len(configs) - 1)) + 1
    return lp.FdpConfigLog(n, 0, 0, tuple(configs))


def parse_usage_json(text: str | bytes) -> lp.RuhUsageLog:
    """``nvme fdp usage -o json``: ``{"nruh": n, "ruhus": [{"ruha": a}]}``."""
    items = _counted_json(text, "usage", "nruh", "ruhus")
    return lp.RuhUsageLog(len(items), tuple(_u(x["ruha"]) for x in items))


def parse_events_json(text: str | bytes) -> lp.FdpEventsLog:
    """``nvme fdp events -o json``: ``{"n": n, "events": [{"type","fdpef","pid","timestamp","nsid",...}]}``.

    ``rgid``/``ruhid`` are not printed by nvme-cli 2.x JSON and come back as 0.
    """
    d = json.loads(text)
    n = _u(d["n"])
    evs = []
    for x in d.get("events", [])[:n]:
        evs.append(
            lp.FdpEvent(
                type=_u(x["type"]),
                flags=_u(x.get("fdpef", x.get("flags", 0))),
                pid=_u(x.get("pid", 0)),
                timestamp_ms=_u(x.get("timestamp", 0)) & ((1 << 48) - 1),
                nsid=_u(x.get("nsid", 0)),
                rgid=_u(x.get("rgid", 0)),
                ruhid=_u(x.get("ruhid", 0)),
                nlbam=_u(x["nlbam"]) if "nlbam" in x else None,
                lba=_u(x["lba"]) if "lba" in x else None,
            )
        )
    return lp.FdpEventsLog(n, tuple(evs))


def parse_feature_value(text: str | bytes) -> int:
    """``nvme get-feature`` output: ``get-feature:0x1d (...), Current value:0x000001``."""
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    m = re.search(r"[Cc]urrent value\s*:\s*(0x[0-9a-fA-F]+|\d+)", text)
    if not m:
        raise CorruptData(f"get-feature output has no 'Current value': {text[:200]!r}")
    return int(m.group(1), 0)


def parse_hex_dump(text: str | bytes, expect_bytes: int | None = None) -> bytes:
    """The bytes of nvme-cli's hexadecimal dump (``d()`` in nvme-cli ``util``: lines
    ``0000: 00 01 ... "ascii"`` under a column header).

    Raises
    ------
    CorruptData
        No dump lines, offsets out of order, or ``expect_bytes`` given and not matched.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", "replace")
    out = bytearray()
    for line in text.splitlines():
        m = re.match(r"^([0-9a-fA-F]{4,}):\s(.*)$", line.strip())
        if not m:
            continue
        if int(m.group(1), 16) != len(out):
            raise CorruptData(f"hex dump: line at offset {m.group(1)} after {len(out)} bytes")
        for tok in m.group(2).split():
            if tok.startswith('"') or not re.fullmatch(r"[0-9a-fA-F]{2}", tok):
                break
            out.append(int(tok, 16))
    if not out:
        raise CorruptData(f"no hex dump in nvme-cli output: {text[:200]!r}")
    if expect_bytes is not None and len(out) != expect_bytes:
        raise CorruptData(f"hex dump has {len(out)} bytes, expected {expect_bytes}")
    return bytes(out)


# ------------------------------------------------------------------- driver
@dataclass(frozen=True)
class FdpDeviceInfo:
    """What discovery found: support, enablement, the active configuration and RUH status."""

    device: str
    fdp_supported: bool
    fdp_enabled: bool | None
    config_index: int | None
    config: lp.FdpConfig | None
    ruh_status: lp.RuhStatus | None


class NvmeCli:
    """Run nvme-cli through ``sh`` and parse its raw-binary output.

    Parameters
    ----------
    nvme : str
        The nvme executable (name looked up on ``PATH`` or a path).
    timeout_s : float
        Per-command timeout, seconds.
    """

    def __init__(self, nvme: str = "nvme", timeout_s: float = 30.0) -> None:
        self.nvme = nvme
        self.timeout_s = timeout_s

    def _cmd(self) -> sh.Command:
        sh = require("sh", "driving nvme-cli")
        try:
            return sh.Command(self.nvme)
        except sh.CommandNotFound:
            raise NvmeCliError(f"nvme-cli not found ({self.nvme!r}); install the nvme-cli package") from None

    def run(self, args: Sequence[str]) -> bytes:
        """Run ``nvme *args`` and return stdout as bytes; raise :class:`NvmeCliError` on failure
        (:class:`~tierstore.errors.ConfigError` without the ``sh`` package: ``tierstore[fdp]``)."""
        cmd = self._cmd()
        sh = require("sh", "driving nvme-cli")
        try:
            rc = cmd(
                *[str(a) for a in args],
                _return_cmd=True,
                _timeout=self.timeout_s,
                _env={**os.environ, "LC_ALL": "C"},
            )
        except sh.ErrorReturnCode as e:
            err = e.stderr.decode("utf-8", "replace").strip()
            raise NvmeCliError(
                f"nvme {' '.join(map(str, args))} failed (exit {e.exit_code}): {err}"
            ) from None
        except sh.TimeoutException:
            raise NvmeCliError(f"nvme {' '.join(map(str, args))} timed out after {self.timeout_s}s") from None
        return bytes(rc.stdout)

    # -- identify / features
    def id_ctrl_raw(self, dev: str) -> bytes:
        """Identify Controller, 4096 raw bytes."""
        out = self.run(["id-ctrl", dev, "-b"])
        if len(out) < lp.ID_CTRL_BYTES:
            raise CorruptData(f"id-ctrl -b returned {len(out)} bytes, expected {lp.ID_CTRL_BYTES}")
        return out[: lp.ID_CTRL_BYTES]

    def fdp_supported(self, dev: str) -> bool:
        """CTRATT bit 19 (FDPS) of Identify Controller."""
        return lp.fdp_supported(lp.ctratt_from_id_ctrl(self.id_ctrl_raw(dev)))

    def fdp_feature(self, dev: str, endgid: int) -> tuple[bool, int]:
        """Get Features 1Dh for ``endgid``: returns ``(enabled, config_index)``."""
        endgid = _check_endgid(endgid)
        v = parse_feature_value(self.run(["get-feature", dev, "-f", hex(FID_FDP), "-c", str(endgid)]))
        return bool(v & 1), (v >> 8) & 0xFF

    @staticmethod
    def enable_fdp_args(dev: str, endgid: int, config_index: int = 0, enable: bool = True) -> list[str]:
        """Argument list that enables (or disables) FDP config ``config_index`` on ``endgid``.

        Set Features 1Dh with Save: CDW11 = ENDGID, CDW12 = FDPCIDX << 8 | FDPE.
        The spec requires the endurance group to have no namespaces when this is changed.
        """
        endgid = _check_endgid(endgid)
        if not 0 <= config_index <= 0xFF:
            raise ConfigError(f"config_index={config_index}: must be 0..255")
        cdw12 = (config_index << 8) | (1 if enable else 0)
        return ["set-feature", dev, "-f", hex(FID_FDP), "-v", str(endgid), "-c", hex(cdw12), "-s"]

    def enable_fdp(self, dev: str, endgid: int, config_index: int = 0, enable: bool = True) -> bytes:
        """Run :meth:`enable_fdp_args` (destructive on a real device; namespaces must be deleted first)."""
        return self.run(self.enable_fdp_args(dev, endgid, config_index, enable))

    # -- FDP log pages
    def configs(self, dev: str, endgid: int) -> lp.FdpConfigLog:
        """FDP Configurations log (20h)."""
        return lp.parse_fdp_configs(self.run(["fdp", "configs", dev, "-e", str(_check_endgid(endgid)), "-b"]))

    def usage(self, dev: str, endgid: int) -> lp.RuhUsageLog:
        """RUH Usage log (21h)."""
        return lp.parse_ruh_usage(self.run(["fdp", "usage", dev, "-e", str(_check_endgid(endgid)), "-b"]))

    def stats(self, dev: str, endgid: int) -> lp.FdpStats:
        """FDP Statistics log (22h)."""
        return lp.parse_fdp_stats(self.run(["fdp", "stats", dev, "-e", str(_check_endgid(endgid)), "-b"]))

    def events(self, dev: str, endgid: int, host_events: bool = False) -> lp.FdpEventsLog:
        """FDP Events log (23h); ``host_events`` selects host events (``-E``)."""
        args = (
            ["fdp", "events", dev, "-e", str(_check_endgid(endgid))]
            + (["-E"] if host_events else [])
            + ["-b"]
        )
        return lp.parse_fdp_events(self.run(args))

    def ruh_status_raw(self, dev: str, nsid: int, data_len: int) -> bytes:
        """``data_len`` bytes of RUH Status (I/O Management Receive, MO 01h) of namespace ``nsid``."""
        data_len = -(-int(data_len) // 4) * 4
        out = self.run(["io-mgmt-recv", dev, "-n", str(int(nsid)), "-m", "1", "-l", str(data_len)])
        return parse_hex_dump(out, data_len)

    def ruh_status(self, dev: str, nsid: int, max_descs: int = 128) -> lp.RuhStatus:
        """RUH Status of namespace ``nsid``, read with an explicit length (module doc).

        Parameters
        ----------
        dev : str
            The namespace's device (``/dev/ngXnY`` or ``/dev/nvmeXnY``).
        nsid : int
            Namespace id.
        max_descs : int
            Descriptors to make room for at first (reclaim groups x RUHs of
            the active configuration); a longer list is read again whole.

        Raises
        ------
        CorruptData
            The controller returned fewer bytes than its descriptor count needs.
        """
        raw = self.ruh_status_raw(dev, nsid, lp.ruh_status_bytes_for(max(1, max_descs)))
        n = int.from_bytes(raw[14:16], "little")
        if lp.ruh_status_bytes_for(n) > len(raw):
            raw = self.ruh_status_raw(dev, nsid, lp.ruh_status_bytes_for(n))
        return lp.parse_ruh_status(raw)

    def id_ns(self, dev: str, nsid: int) -> lp.IdNamespace:
        """Identify Namespace of ``nsid`` (size and logical block format)."""
        out = self.run(["id-ns", dev, "-n", str(int(nsid)), "-b"])
        return lp.parse_id_ns(out)

    def serial(self, ctrl_dev: str) -> str:
        """The controller's serial number (Identify Controller SN)."""
        return lp.serial_from_id_ctrl(self.id_ctrl_raw(ctrl_dev))

    def discover(self, ctrl_dev: str, ns_dev: str, endgid: int = 1, nsid: int = 1) -> FdpDeviceInfo:
        """Support -> enablement -> active config -> RUH status, stopping early where FDP is absent."""
        if not self.fdp_supported(ctrl_dev):
            return FdpDeviceInfo(ctrl_dev, False, None, None, None, None)
        enabled, idx = self.fdp_feature(ctrl_dev, endgid)
        if not enabled:
            return FdpDeviceInfo(ctrl_dev, True, False, idx, None, None)
        log = self.configs(ctrl_dev, endgid)
        if idx >= len(log.configs):
            raise CorruptData(f"active FDP config index {idx} but the log lists {len(log.configs)}")
        cfg = log.configs[idx]
        return FdpDeviceInfo(
            ctrl_dev, True, True, idx, cfg, self.ruh_status(ns_dev, nsid, max(1, cfg.nrg) * max(1, cfg.nruh))
        )


class FdpDeviceStats:
    """A real device as a stats source for :class:`tierstore.fdp.waf.WafWindow`.

    ``stats()`` returns ``{"hbmw_bytes", "mbmw_bytes", "mbe_bytes"}`` read from
    ``nvme fdp stats DEV -e ENDGID -b`` -- the same keys as the FTL model.
    """

    def __init__(self, dev: str, endgid: int = 1, cli: NvmeCli | None = None) -> None:
        self.dev = dev
        self.endgid = _check_endgid(endgid)
        self.cli = cli or NvmeCli()

    def stats(self) -> Mapping[str, int]:
        """One read of the FDP Statistics log."""
        return self.cli.stats(self.dev, self.endgid).as_dict()
