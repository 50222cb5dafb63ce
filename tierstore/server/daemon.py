"""``tierstore serve --config FILE``: run the storage daemon until SIGTERM/SIGINT.

With a ``node`` section the store is also served to the node's engine processes on
``node.socket`` (:mod:`tierstore.node.server`: a UNIX socket and a shared segment); ``--node``
serves it there only (no HTTP listener).

Exit codes: 0 after a clean drain, 2 for a bad command line or config
(the message names the key, the value and what is accepted) and for a
``--check`` that finds the config cannot start on this machine
(:mod:`tierstore.server.check`: memory, disk space, layout vs the NVMe file,
device, ports), 1 when the store or the listener cannot be started (the same
checks run before start-up, except the port test, which the bind itself does).
The listening ports are bound *before* the store opens: a port that is taken
fails start-up at once, before the NVMe tier's recovery reads the tier.

Shutdown: on SIGTERM or SIGINT the daemon reports not-ready (``/readyz`` 503),
answers new API requests with 503 + ``Retry-After``, waits up to
``limits.shutdown_timeout_s`` for requests in flight, waits for store work in
its worker threads, and closes the store. Every acknowledged put is already
durable (extent headers are the journal, :mod:`tierstore.io.format`), so no
manifest needs writing; a kill -9 loses only unacknowledged puts.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

from aiohttp import web

from ..errors import ConfigError, TierStoreError
from .config import DaemonConfig, load_config

log = logging.getLogger("tierstore.server")


async def _start_node_socket(loop: asyncio.AbstractEventLoop, svc: Any, cfg: DaemonConfig) -> Any:
    """With a ``node`` section, the same store on the node's UNIX socket too: the started
    :class:`~tierstore.node.server.NodeServer` (else ``None``); raises ``NodeServiceError``."""
    if cfg.node is None or svc.node_core is None:
        return None
    from ..node.server import NodeServer

    server = NodeServer(svc.node_core, cfg.node, access=svc.node_access, metrics=svc.node_metrics)
    return await loop.run_in_executor(None, server.start)


def _bind(host: str, port: int) -> list[socket.socket]:
    """Bound, not yet listening, TCP sockets for every address of ``host`` (what
    ``loop.create_server(host=..., port=...)`` binds: each ``getaddrinfo`` result, ``SO_REUSEADDR``,
    IPv6 sockets v6-only); connections are refused until the site starts listening on them.

    Raises
    ------
    OSError
        An address cannot be bound (the port is taken, the host is not this machine's); the
        sockets bound before it are closed.
    """
    infos = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0, socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    try:
        for fam, typ, proto, _, addr in dict.fromkeys(infos):
            s = socket.socket(fam, typ, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if fam == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind(addr)
    except OSError:
        for s in socks:
            s.close()
        raise
    return socks


async def _drain(loop: asyncio.AbstractEventLoop, svc: Any, timeout_s: float) -> None:
    """Refuse new API requests (503 + Retry-After; ``/readyz`` 503) and wait up to ``timeout_s``
    for those in flight to finish (bodies included)."""
    svc.draining = True
    t_end = loop.time() + timeout_s
    while svc.inflight > 0 and loop.time() < t_end:
        await asyncio.sleep(0.02)
    if svc.inflight:
        log.warning("drain timeout", extra={"fields": {"event": "drain_timeout", "inflight": svc.inflight}})


def _bind_ports(cfg: DaemonConfig) -> tuple[list[socket.socket], list[socket.socket]] | None:
    """:func:`_bind` the listen and the metrics port (``[]`` without ``metrics.port``); ``None``
    (said as ``startup_failed``, nothing left bound) when either cannot be bound."""
    bound: list[socket.socket] = []
    try:
        bound = _bind(cfg.listen.host, cfg.listen.port)
        return bound, _bind(cfg.metrics.host, cfg.metrics.port) if cfg.metrics.port is not None else []
    except OSError as e:
        for sk in bound:
            sk.close()
        log.error("cannot listen", extra={"fields": {"event": "startup_failed", "error": str(e)}})
        return None


async def _start_sites(runner: web.AppRunner, socks: list[socket.socket]) -> int:
    """Set ``runner`` up and serve it on every socket of :func:`_bind`; return the first one's port."""
    await runner.setup()
    for sk in socks:
        await web.SockSite(runner, sk).start()
    return socks[0].getsockname()[1]


async def serve(cfg: DaemonConfig) -> int:
    """Run the daemon until a stop signal; returns the exit status."""
    from .http import JsonAccessLogger
    from .service import Service

    loop = asyncio.get_running_loop()
    ports = _bind_ports(cfg)  # the ports first: a taken port must not wait for the NVMe tier's recovery
    if ports is None:
        return 1
    bound, msocks = ports
    try:
        svc = await loop.run_in_executor(None, Service, cfg)
    except (TierStoreError, OSError) as e:
        for sk in bound + msocks:
            sk.close()
        log.error("cannot open the store", extra={"fields": {"event": "startup_failed", "error": str(e)}})
        return 1
    lim = cfg.limits
    runner = web.AppRunner(
        svc.make_app(),
        handle_signals=False,
        shutdown_timeout=lim.shutdown_timeout_s,
        auto_decompress=False,  # compressed bodies are refused (415), never decoded
        access_log_class=JsonAccessLogger,
        access_log=logging.getLogger("tierstore.access") if cfg.log.access_log else None,
    )
    runners = [runner]
    try:
        port = await _start_sites(runner, bound)
        mport = None
        if msocks:
            mr = web.AppRunner(svc.make_metrics_app(), handle_signals=False, access_log=None)
            runners.append(mr)
            mport = await _start_sites(mr, msocks)
    except OSError as e:
        log.error("cannot listen", extra={"fields": {"event": "startup_failed", "error": str(e)}})
        for r in runners:
            await r.cleanup()
        for sk in bound + msocks:
            sk.close()
        await loop.run_in_executor(None, svc.close)
        return 1
    try:
        node_server = await _start_node_socket(loop, svc, cfg)
    except TierStoreError as e:  # NodeServiceError
        log.error("cannot listen", extra={"fields": {"event": "startup_failed", "error": str(e)}})
        for r in runners:
            await r.cleanup()
        await loop.run_in_executor(None, svc.close)
        return 1
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    svc.ready = True
    log.info(
        "listening",
        extra={
            "fields": {
                "event": "listening",
                "host": cfg.listen.host,
                "port": port,
                "metrics_port": mport,
                "block_bytes": svc.block_bytes,
                "node_socket": cfg.node.socket if cfg.node else None,
                "durable": svc.durable,
            }
        },
    )
    await stop.wait()
    log.info("draining", extra={"fields": {"event": "draining", "inflight": svc.inflight}})
    await _drain(loop, svc, lim.shutdown_timeout_s)
    for r in runners:
        await r.cleanup()  # stops listening, waits for in-flight handlers up to shutdown_timeout_s
    if node_server is not None:
        await loop.run_in_executor(None, node_server.close)
    await loop.run_in_executor(None, svc.close)
    log.info("stopped", extra={"fields": {"event": "stopped"}})
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``tierstore serve``; returns the exit status."""
    ap = argparse.ArgumentParser(prog="tierstore serve", description="Run the tierstore KV-block daemon.")
    ap.add_argument("--config", required=True, help="YAML config file (see configs/daemon.yaml)")
    ap.add_argument("--check", action="store_true", help="validate the config and exit")
    ap.add_argument(
        "--node",
        action="store_true",
        help="serve the store to engine processes on the config's node.socket (UNIX socket and "
        "shared memory) instead of HTTP",
    )
    try:
        args = ap.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:
        return int(e.code or 0)
    try:
        cfg = load_config(args.config)
    except ConfigError as e:
        print(f"tierstore serve: {e}", file=sys.stderr)
        return 2
    if args.node and cfg.node is None:
        print(
            f"tierstore serve: {args.config}: --node needs a 'node' section (node: {{socket: PATH}})",
            file=sys.stderr,
        )
        return 2
    from .check import preflight

    if args.check:
        pf = preflight(cfg)
        for note in pf.notes:
            print(f"tierstore serve: {args.config}: {note}")
        for err in pf.errors:
            print(f"tierstore serve: {args.config}: error: {err}", file=sys.stderr)
        if pf.errors:
            print(
                f"tierstore serve: {args.config}: the config is valid but cannot start on this machine "
                f"({len(pf.errors)} problem{'s' if len(pf.errors) > 1 else ''})",
                file=sys.stderr,
            )
            return 2
        print(f"tierstore serve: {args.config}: config OK")
        return 0
    from .http import setup_logging

    setup_logging(cfg.log.level)
    pf = preflight(cfg, ports=False)  # the listeners' bind is the port check at start
    if pf.errors:
        for err in pf.errors:
            log.error("cannot start", extra={"fields": {"event": "startup_failed", "error": err}})
        return 1
    for note in pf.notes:
        log.info("preflight", extra={"fields": {"event": "preflight", "note": note}})
    if args.node:
        from ..node.server import run_node

        return run_node(cfg)
    return asyncio.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main())
