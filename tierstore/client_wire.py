"""The client's half of the daemon's HTTP protocol (:mod:`tierstore.server.protocol`), under
:class:`tierstore.client.RemoteKVStore`.

:class:`DaemonConnection` owns one aiohttp session driven from a background event-loop thread
(so its callers are synchronous and thread-safe), the open/closed state and the calls in
progress (``close`` waits for them), the retries of a 429 ``overloaded`` / 503 ``draining``
answer (honouring ``Retry-After``), the mapping of error answers to typed errors
(:class:`RemoteError`, :class:`AuthError`, :class:`ServerBusy`, ``QuotaExceeded``), and the
block transfers: a PUT's streamed body (:meth:`DaemonConnection.put_blocks`) and a GET's
manifest and block stream received straight into the caller's buffers
(:meth:`DaemonConnection.get_blocks`).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import itertools
import json
import threading
import urllib.parse
import weakref
from collections.abc import Callable

import torch

from .errors import ConfigError, QuotaExceeded, Status, StoreClosedError, TierStoreError
from .extras import require
from .layout import KVLayout
from .server.protocol import BLOCKS_CONTENT_TYPE, PREFIX, encode_prefix, keys_to_hex
from .units import check_duration_s

aiohttp = require("aiohttp", "tierstore.client (the daemon's client)")

#: ``Status`` by its wire value.
STATUS = {s.value: s for s in Status}


class RemoteError(TierStoreError):
    """The daemon refused a request (the message carries its status, code and message)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status = status
        self.code = code


class AuthError(RemoteError):
    """Missing or invalid credentials (HTTP 401) or a forbidden namespace (403)."""


class ServerBusy(RemoteError):
    """The daemon stayed overloaded or draining (429/503) through every retry."""


async def with_deadline(coro, timeout_s: float | None, partial: Callable):
    """``coro``, or ``partial()`` when it does not finish within ``timeout_s`` seconds.

    Raises
    ------
    ConfigError
        For a ``timeout_s`` that is not a finite number of seconds in ``(0, MAX_DURATION_S]``.
    """
    if timeout_s is None:
        return await coro
    timeout_s = check_duration_s(timeout_s, "timeout_s")
    try:
        return await asyncio.wait_for(coro, timeout_s)
    except asyncio.TimeoutError:
        return partial()


class DaemonConnection:
    """One HTTP session to a tierstore daemon (module doc).

    The parameters are :class:`~tierstore.client.RemoteKVStore`'s of the same names; ``retries`` and
    ``max_retry_wait_s`` may be changed at any time.

    Raises
    ------
    ConfigError
        A URL without ``http://`` or ``https://``, or without a host, or one that does not
        parse (an unclosed IPv6 bracket, a bad port).
    """

    def __init__(self, url: str, token: str, timeout_s: float, retries: int, max_retry_wait_s: float) -> None:
        try:
            parts = urllib.parse.urlsplit(url) if isinstance(url, str) else None
            _ = parts.port if parts is not None else None  # parses the port: raises on a bad one
        except ValueError as e:  # an unclosed IPv6 bracket, a non-numeric or out-of-range port
            raise ConfigError(f"url={url!r}: not a valid URL ({e}), e.g. http://127.0.0.1:8470") from None
        if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(
                f"url={url!r}: the URL needs a scheme (http:// or https://) and a host, e.g. "
                "http://127.0.0.1:8470"
            )
        self.url = url.rstrip("/")
        #: open/closed state and the calls in progress (close waits for them)
        self._state = threading.Condition(threading.Lock())
        self._active = 0
        self.closed = False
        self._auth = {"Authorization": f"Bearer {token}"}
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.retries = retries
        self.max_retry_wait_s = max_retry_wait_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="tierstore-client", daemon=True)
        self._thread.start()
        self._session: aiohttp.ClientSession | None = None
        self.call(self._open())
        _OPEN.add(self)
        # a connection dropped without close() (a client made in a function): its session is closed and
        # its loop stopped when it is collected (aiohttp printed "Unclosed client session"; trial 11);
        # at interpreter exit _close_at_exit closes the live ones
        self._finalizer = weakref.finalize(self, _release, self._loop, self._thread, self._session)
        self._finalizer.atexit = False

    async def _open(self) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout, connector=aiohttp.TCPConnector(limit=64))

    # ------------------------------------------------------------------ calls in progress
    def _enter(self, coro) -> None:
        with self._state:
            if self.closed:
                coro.close()  # never scheduled
                raise StoreClosedError("RemoteKVStore: the client is closed")
            self._active += 1

    def _leave(self) -> None:
        with self._state:
            self._active -= 1
            if not self._active:
                self._state.notify_all()

    def call(self, coro):
        """Run ``coro`` on the connection's loop and wait for it.

        Raises
        ------
        StoreClosedError
            After :meth:`close` began (nothing is sent).
        """
        self._enter(coro)
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        except concurrent.futures.CancelledError:
            raise StoreClosedError("RemoteKVStore: the client was closed during the call") from None
        finally:
            self._leave()

    def future(self, coro, wait: bool):
        """Run ``coro`` on the connection's loop: its result, or with ``wait=False`` a
        :class:`concurrent.futures.Future` of it (as :class:`~tierstore.api.KVStore`)."""
        if wait:
            return self.call(coro)
        self._enter(coro)
        try:  # close() lets a submitted call finish (up to the client's timeout)
            return asyncio.run_coroutine_threadsafe(coro, self._loop)
        finally:
            self._leave()

    # ------------------------------------------------------------------ requests
    async def _error(self, resp: aiohttp.ClientResponse) -> RemoteError:
        try:
            err = json.loads(await resp.read())["error"]
            code, msg = str(err["code"]), str(err["message"])
        except (ValueError, KeyError, TypeError):
            code, msg = "http_error", resp.reason or ""
        if resp.status in (401, 403):
            return AuthError(resp.status, code, msg)
        if code in ("quota_exceeded", "pin_quota_exceeded"):
            return QuotaExceeded(f"HTTP {resp.status} {code}: {msg}")
        if resp.status in (429, 503):
            return ServerBusy(resp.status, code, msg)
        return RemoteError(resp.status, code, msg)

    async def send(self, method: str, path: str, handle, data=None, json_body=None, headers=None):
        """Send with retries of retryable answers; ``handle(resp)`` consumes a 200.

        Raises
        ------
        RemoteError
            The daemon cannot be reached, or answered an error (:class:`AuthError`,
            :class:`ServerBusy` after :attr:`retries` retries, ``QuotaExceeded``).
        """
        hdrs = dict(self._auth)
        if headers:
            hdrs.update(headers)
        for attempt in itertools.count():
            body = data() if callable(data) else data
            try:
                async with self._session.request(
                    method, self.url + path, data=body, json=json_body, headers=hdrs
                ) as resp:
                    if resp.status == 200:
                        return await handle(resp)
                    err = await self._error(resp)
                    retry_s = float(resp.headers.get("Retry-After", "0.1") or 0.1)
            except aiohttp.ClientError as e:
                raise RemoteError(0, "connection", f"{method} {path}: {e}") from None
            if not isinstance(err, ServerBusy) or attempt >= self.retries:
                raise err
            await asyncio.sleep(min(self.max_retry_wait_s, retry_s) * (1 + 0.25 * attempt))

    async def request_json(self, method: str, path: str, body: dict | None):
        """A JSON request's JSON answer."""

        async def handle(resp):
            return json.loads(await resp.read())

        return await self.send(method, path, handle, json_body=body)

    def post(self, path: str, body: dict) -> dict:
        """POST ``body`` and wait for the JSON answer."""
        return self.call(self.request_json("POST", path, body))

    # ------------------------------------------------------------------ blocks
    async def put_blocks(
        self, d: bytes, keys, raw, first_position: int, lifetime, block_bytes: int
    ) -> list[Status]:
        """``PUT /v1/blocks``: the prefix (namespace digest ``d``, keys, first position, lifetime)
        then each raw block of ``block_bytes``, streamed from ``raw``; the daemon's statuses."""
        prefix = encode_prefix(
            {
                "namespace": d.hex(),
                "keys": keys_to_hex(keys),
                "first_position": first_position,
                "lifetime": lifetime,
            }
        )
        length = len(prefix) + len(raw) * block_bytes

        def body():
            async def gen():
                yield prefix
                for t in raw:
                    yield memoryview(t.numpy())

            return gen()

        async def handle(resp):
            return [STATUS[s] for s in json.loads(await resp.read())["statuses"]]

        return await self.send(
            "PUT",
            "/v1/blocks",
            handle,
            data=body,
            headers={"Content-Type": BLOCKS_CONTENT_TYPE, "Content-Length": str(length)},
        )

    async def get_blocks(
        self, d: bytes, keys, dests, raw_dests, promote: bool, layout: KVLayout, block_bytes: int
    ):
        """``POST /v1/blocks/get``: per key its status and, when ``OK``, its bytes.

        With ``raw_dests`` (per key a CPU ``uint8`` view of ``block_bytes``) the bytes are received
        straight into the contiguous ones (others through a private buffer) and the result holds
        ``dests``; without, into one new buffer viewed as typed blocks of ``layout``.

        Returns
        -------
        statuses : list of Status
        tensors : list of torch.Tensor or None

        Raises
        ------
        RemoteError
            A manifest that does not match the request, or a truncated or overlong stream.
        """
        B = block_bytes

        async def handle(resp):
            c = resp.content
            (mlen,) = PREFIX.unpack(await c.readexactly(PREFIX.size))
            man = json.loads(await c.readexactly(mlen))
            st = [STATUS[s] for s in man["statuses"]]
            if len(st) != len(keys) or man["block_bytes"] != B:
                raise RemoteError(200, "bad_response", "manifest does not match the request")
            ok = [i for i, s in enumerate(st) if s is Status.OK]
            outs: list[torch.Tensor | None] = [None] * len(keys)
            if raw_dests is not None:
                # straight into the caller's buffers (contiguous CPU ones), no staging copy
                targets = [
                    memoryview(raw_dests[i].numpy()) if raw_dests[i].is_contiguous() else None for i in ok
                ]
                tmp = [torch.empty(B, dtype=torch.uint8) if t is None else None for t in targets]
                views = [t if t is not None else memoryview(x.numpy()) for t, x in zip(targets, tmp)]
            else:
                buf = torch.empty(len(ok) * B, dtype=torch.uint8)
                whole = memoryview(buf.numpy()) if ok else memoryview(b"")
                views = [whole[j * B : (j + 1) * B] for j in range(len(ok))]
            j, off, got, want = 0, 0, 0, len(ok) * B
            while got < want:
                chunk = await c.readany()
                if not chunk:
                    raise RemoteError(200, "truncated", f"response ended after {got} of {want} bytes")
                cm = memoryview(chunk)
                p = 0
                while p < len(cm) and j < len(views):
                    take = min(len(cm) - p, B - off)
                    views[j][off : off + take] = cm[p : p + take]
                    p += take
                    off += take
                    if off == B:
                        j, off = j + 1, 0
                got += p
                if p < len(cm):
                    raise RemoteError(200, "bad_response", "response is longer than its manifest says")
            for j, i in enumerate(ok):
                if raw_dests is not None:
                    if tmp[j] is not None:
                        raw_dests[i].copy_(tmp[j])
                    outs[i] = dests[i]
                else:
                    outs[i] = layout.block_view(buf[j * B : (j + 1) * B])
            return st, outs

        body = {"namespace": d.hex(), "keys": keys_to_hex(keys), "promote": promote}
        return await self.send("POST", "/v1/blocks/get", handle, json_body=body)

    # ------------------------------------------------------------------ close
    async def _finish(self) -> None:
        """Let submitted calls finish (up to the client's timeout), then close the session."""
        me = asyncio.current_task()
        pending = [t for t in asyncio.all_tasks() if t is not me]
        if pending:
            _, late = await asyncio.wait(pending, timeout=self._timeout.total)
            for t in late:
                t.cancel()
        if self._session is not None:
            await self._session.close()
            self._session = None

    def close(self) -> None:
        """Refuse new calls, let the calls in progress finish, close the HTTP session and stop the
        background loop. Idempotent."""
        with self._state:
            if self.closed:
                return
            self.closed = True
            while self._active:
                self._state.wait()
        self._finalizer.detach()
        if self._loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(self._finish(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()


def _release(loop: asyncio.AbstractEventLoop, thread: threading.Thread, session) -> None:
    """Close the session of a :class:`DaemonConnection` collected without ``close()`` and stop its
    loop (``weakref.finalize``: no call can be in progress, each one holds the connection)."""
    if loop.is_closed():
        return
    if threading.current_thread() is thread:  # collected on its own loop: no waiting there
        loop.create_task(session.close())
        loop.call_soon(loop.stop)
        return
    try:
        asyncio.run_coroutine_threadsafe(session.close(), loop).result(timeout=5)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        if not thread.is_alive():
            loop.close()


#: Connections not closed yet: closed at interpreter exit (a script that never called ``close()``
#: got aiohttp's "Unclosed client session" warnings when its session was collected).
_OPEN: weakref.WeakSet[DaemonConnection] = weakref.WeakSet()


@atexit.register
def _close_at_exit() -> None:
    for conn in list(_OPEN):
        with conn._state:
            busy = conn._active > 0 or conn.closed
        if not busy:  # a call still in flight in another thread: leave it (close would wait for it)
            conn.close()


__all__ = ["AuthError", "DaemonConnection", "RemoteError", "STATUS", "ServerBusy", "with_deadline"]
