"""A shared remote tier on Mooncake Store.

Engine instances (and machines) that point at one Mooncake cluster share blocks:
a prefix one instance computed and published is a remote hit for every other.
:class:`MooncakeTier` is the component; the core's index decides *what* to look
up, load and publish, and calls it (from its mover, never under its lock).

The tier is split in four modules: this one (lifecycle, connecting and the
degraded state, the prober, ``exists_prefix``, ``remove``, ``stats``, ``close``),
and the two parts it builds and owns, :mod:`~tierstore.remote.publisher` (``put``,
the publish queue and its threads) and :mod:`~tierstore.remote.loader`
(``register_memory``, ``get_into``, the object checks), which reach it through
:class:`~tierstore.remote.calls.TierLink`; :mod:`~tierstore.remote.calls` (call
threads, registered slots, Mooncake's error codes).

Contract: every public method is thread-safe, returns within about ``timeout_s``
(``put`` after a memory copy) and never raises for an expected outcome; a failure
is a miss, never wrong bytes and never a hang. Every Mooncake call a caller waits
for runs on a call thread; a timeout or an unreachable master (-900) marks the
tier degraded (lookups answer 0, loads miss, publishes are dropped, all counted)
until the prober reconnects. Memory a late call may still write into is not
reused until the call returns.

The Mooncake calls used and their return codes, the behaviour measured on
loopback, the failure modes, tenant isolation and the process-wide environment
the tier sets are in ARCHITECTURE.md, "The remote tier".
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures as cf
import logging
import operator
import os
import socket
import threading
import time
import urllib.parse
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..closing import Closing
from ..delegation import handed_to
from ..errors import ConfigError, LayoutError
from ..io.format import KEY_BYTES
from ..tiers.storage import RemoteBlockTier

# public names of this module before the split, still importable from here
from .calls import (  # noqa: F401
    _NO_RESULT,
    INVALID_PARAMS,
    LEASE_EXPIRED,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    RPC_FAIL,
    TRANSFER_FAIL,
    RegisteredRegion,
    TierLink,
    _callback,
    _CallFailed,
    _CallThreads,
    _close_late_client,
    _close_quietly,
    _probe_call,
    _Slots,
)
from .format import CORRUPT_REASONS, HEADER_BYTES, ObjectNamer, object_bytes
from .loader import Loader
from .publisher import SPACE_RETRY_S, Publisher  # noqa: F401 (SPACE_RETRY_S: as above)
from .settings import MooncakeTuning, RemoteConfig

log = logging.getLogger(__name__)
_publisher = operator.attrgetter("publisher")
_loader = operator.attrgetter("loader")

#: ``MC_STORE_CLIENT_SETUP_RETRIES`` the tier sets (Mooncake's default, 20, retries a
#: lost master for about 90 s while holding the GIL; a few retries still cover
#: a port taken between Mooncake's choice and its bind, Mooncake #736).
SETUP_RETRIES = 4

#: pip extra and package that bring Mooncake Store.
EXTRA = "tierstore[cluster]"
WHEEL = "mooncake-transfer-engine-non-cuda==0.3.13.post1"
APT_PACKAGES = "libcurl4 libibverbs1 rdma-core librdmacm1 libnuma1 liburing2"


def load_mooncake_store() -> type:
    """Import ``mooncake.store.MooncakeDistributedStore``.

    Raises
    ------
    ConfigError
        When the wheel is missing (naming the ``tierstore[cluster]`` extra) or
        its native libraries cannot load (naming the apt packages).
    """
    try:
        from mooncake.store import MooncakeDistributedStore
    except ModuleNotFoundError as e:
        raise ConfigError(
            f"remote.engine=mooncake needs Mooncake Store, which is not installed ({e}). "
            f"Install the extra: pip install '{EXTRA}' (brings {WHEEL})."
        ) from None
    except (ImportError, OSError) as e:
        raise ConfigError(
            f"remote.engine=mooncake: the Mooncake wheel is installed but its native code does not "
            f"load ({e}). It needs the system libraries of: apt-get install {APT_PACKAGES}"
        ) from None
    return MooncakeDistributedStore


_COUNTERS = (
    # publish
    "puts_offered",
    "puts_queued",
    "puts_exists",
    "dropped_queue_full",
    "dropped_degraded",
    "dropped_closed",
    "published_blocks",
    "published_bytes",
    "put_no_space",
    "put_no_space_retries",
    "put_failed",
    "put_calls",
    "staged_puts",
    "zero_copy_puts",
    # lookup / load
    "exists_calls",
    "exists_keys",
    "exists_hits",
    "exists_errors",
    "gets_requested",
    "get_hits",
    "get_misses",
    "get_errors",
    "get_bytes",
    "get_calls",
    "gets_degraded",
    "get_no_slot",
    "zero_copy_gets",
    "staged_gets",
    "corrupt_objects",
    # failures
    "timeouts",
    "rpc_failures",
    "call_exceptions",
    "degraded_entries",
    "reconnects",
    "setup_failures",
    "removals_ok",
    "removal_lease_retries",
    "removals_dropped",
)


class MooncakeTier(RemoteBlockTier, TierLink, Closing):
    """The remote tier: publish, look up and load blocks in a Mooncake cluster.

    Parameters
    ----------
    config : RemoteConfig
        Where the cluster is and how much memory this client uses (the ``remote`` section).
    block_bytes : int
        Size of every block in bytes (the store's ``bytes_per_block``).
    tuning : MooncakeTuning
        Threads, header slots, reconnect back-off and the other knobs no configuration carries.
    store_factory : callable, optional
        Returns a new ``MooncakeDistributedStore``-like client (tests pass an
        in-memory fake). Default: :func:`load_mooncake_store`'s class.
    connect : bool
        Connect (``setup``) now; when it fails the tier starts degraded and the
        prober keeps trying. ``False``: leave it to the prober.

    Raises
    ------
    ConfigError
        Mooncake is not installed (naming the ``tierstore[cluster]`` extra), or bad arguments.

    Notes
    -----
    Threads: ``publish_threads`` publishers, a prober (reconnects, background removals) and
    ``call_threads`` call threads. Every public method is thread-safe, returns within about
    ``timeout_s`` (``put`` returns after a memory copy) and never raises for an expected
    outcome. No lock is held across a Mooncake call or a block copy. Memory:
    ``(publish_queue_blocks + max(2, local_buffer_bytes // object_bytes)) * object_bytes`` of
    registered staging, plus ``segment_bytes`` that Mooncake maps for the cluster.

    ``put`` and ``flush`` run on its :class:`~tierstore.remote.publisher.Publisher` (``publisher``);
    ``register_memory``, ``set_load_observer`` and ``get_into`` on its
    :class:`~tierstore.remote.loader.Loader` (``loader``): parts it builds, each with its own state
    and slots, reaching the tier through :class:`~tierstore.remote.calls.TierLink`.

    Implements :class:`tierstore.tiers.storage.RemoteBlockTier` (whose table says where
    it differs from the local interface): a block can vanish at any time (evicted, its
    holder died, the master restarted), publication is asynchronous, capacity the cluster's.
    """

    def __init__(
        self,
        config: RemoteConfig,
        block_bytes: int,
        *,
        tuning: MooncakeTuning = MooncakeTuning(),
        store_factory: Callable[[], Any] | None = None,
        connect: bool = True,
    ) -> None:
        if not isinstance(config, RemoteConfig):
            raise ConfigError(f"MooncakeTier: config must be a RemoteConfig, got {type(config).__name__}")
        if int(block_bytes) <= 0:
            raise ConfigError(f"block_bytes={block_bytes}: must be > 0")
        self.config, self.tuning = s, tu = config, tuning
        self.block_bytes = int(block_bytes)
        self.object_bytes = object_bytes(self.block_bytes)
        self._factory = store_factory if store_factory is not None else load_mooncake_store()
        self._namer = ObjectNamer(s.cluster, s.name_secret_bytes)
        self._probe_name = self._namer.prefix + "probe"
        self._timeout_s = float(s.timeout_s)

        self._lock = threading.Lock()  # state, counters, pending sets; never held across I/O
        self._counters = dict.fromkeys(_COUNTERS, 0)
        self._errors: collections.Counter = collections.Counter()
        self._corrupt: collections.Counter = collections.Counter()
        self._state = "connecting"
        self._reason = "not connected yet"
        self._degraded_since = time.monotonic()
        self._backoff_s = tu.reconnect_backoff_s[0]
        self._next_probe = 0.0
        self._closed = False
        self._client: Any = None
        self._inflight_calls = 0
        self._direct: dict[object, list] = {}  # publisher calls in progress: [start_s, what, reported]
        self._removals: dict[str, list] = {}  # name -> [next_attempt_s, attempts]
        self._work = threading.Condition(self._lock)

        # registered staging, the parts' slots: every pool is registered with each new client
        put_slots = _Slots(s.publish_queue_blocks, self.object_bytes)
        get_slots = _Slots(max(2, s.local_buffer_bytes // self.object_bytes), self.object_bytes)
        hdr_slots = _Slots(tu.header_slots, HEADER_BYTES)
        self._slot_pools = (put_slots, get_slots, hdr_slots)
        self.loader = Loader(self, get_slots, hdr_slots)
        self.publisher = Publisher(self, put_slots, hdr_slots, self.loader.region_of)
        self._calls = _CallThreads(tu.call_threads, "tierstore-mooncake-call")
        if tu.set_env:
            self._set_env()
        if connect:
            self._connect()
        self._prober = threading.Thread(target=self._probe_loop, name="tierstore-mooncake-probe", daemon=True)
        self.publisher.start()
        self._prober.start()
        _LIVE.add(self)

    # ------------------------------------------------------------------ setup
    def _set_env(self) -> None:
        s = self.config
        host = s.local_hostname
        if host.count(":") == 1:
            host = host.split(":", 1)[0]
        if s.protocol == "tcp":
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", host)
        ms = str(int(self._timeout_s * 1000))
        os.environ.setdefault("MC_RPC_TIMEOUT_MS", ms)
        os.environ.setdefault("MC_RPC_CONNECT_TIMEOUT_MS", ms)
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(SETUP_RETRIES))

    def _setup_client(self) -> Any:
        """Create, set up and register a client (runs on a call thread)."""
        s = self.config
        client = self._factory()
        rc = client.setup(
            s.local_hostname,
            s.metadata,
            int(s.segment_bytes),
            int(self.tuning.mooncake_local_buffer_bytes),
            s.protocol,
            s.device,
            s.master,
            tenant_id=s.mooncake_tenant,
        )
        if rc != 0:
            _close_quietly(client)
            raise _CallFailed(f"setup returned {rc}", rc)
        bufs = [(p.base_ptr, p.buf.numel()) for p in self._slot_pools] + self.loader.regions()
        for ptr, n in bufs:
            rc = client.register_buffer(ptr, n)
            if rc != 0:
                _close_quietly(client)
                raise _CallFailed(f"register_buffer returned {rc}", rc)
        return client

    def _endpoints(self) -> list[tuple[str, int]]:
        """``(host, port)`` of the master and of an HTTP/etcd metadata server."""
        s = self.config
        host, _, port = s.master.rpartition(":")
        out = [(host.strip("[]"), int(port))]
        u = urllib.parse.urlsplit(s.metadata)
        if u.scheme in ("http", "https", "etcd") and u.hostname and u.port:
            out.append((u.hostname, u.port))
        return out

    def _unreachable(self) -> str | None:
        """Why the master or metadata server cannot be reached, or ``None``.

        Mooncake's ``setup`` holds the GIL for as long as it retries an
        unreachable master (90 s with 0.3.13.post1's 20 retries): every Python
        thread of the process stops. A plain TCP connect first keeps a dead
        master from freezing the engine.
        """
        for host, port in self._endpoints():
            try:
                with socket.create_connection((host, port), timeout=min(self._timeout_s, 1.0)):
                    pass
            except OSError as e:
                return f"{host}:{port} unreachable ({e.strerror or e})"
        return None

    def _connect(self) -> bool:
        why = self._unreachable()
        if why is not None:
            self._degrade(f"setup skipped: {why}", count="setup_failures")
            return False
        fut = self._calls.submit(self._setup_client)
        try:
            client = fut.result(self._timeout_s * 2)
        except cf.TimeoutError:
            fut.add_done_callback(_close_late_client)
            self._degrade(f"setup took more than {self._timeout_s * 2:.1f} s", count="setup_failures")
            return False
        except _CallFailed as e:
            self._degrade(f"setup failed: {e}", count="setup_failures", code=e.code)
            return False
        except Exception as e:  # noqa: BLE001 (a client that raises is a failed setup, not a crash)
            self._degrade(f"setup raised {type(e).__name__}: {e}", count="setup_failures")
            return False
        with self._lock:
            if self._closed:
                closing = client
            else:
                closing = None
                was = self._state
                self._client = client
                self._state, self._reason = "ok", ""
                self._backoff_s = self.tuning.reconnect_backoff_s[0]
                if was == "degraded":
                    self._counters["reconnects"] += 1
        if closing is not None:
            _close_quietly(closing)
            return False
        log.info(
            "mooncake tier connected: master=%s segment_bytes=%d",
            self.config.master,
            self.config.segment_bytes,
        )
        return True

    # --------------------------------------------------------------- helpers
    def _bump(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counters[name] += n

    def _degrade(self, reason: str, *, count: str | None = None, code: int | None = None) -> None:
        with self._lock:
            if count:
                self._counters[count] += 1
            if code is not None:
                self._errors[code] += 1
            if self._closed:
                return
            if self._state != "degraded":
                self._counters["degraded_entries"] += 1
                self._degraded_since = time.monotonic()
                self._next_probe = time.monotonic() + self._backoff_s
                log.warning("mooncake tier degraded: %s (local tiers keep serving)", reason)
            self._state, self._reason = "degraded", reason
            self._work.notify_all()

    def _usable(self) -> Any:
        """The client when calls may be made, else ``None``."""
        with self._lock:
            return self._client if self._state == "ok" and not self._closed else None

    def _watchdog(self) -> None:
        """Degrade when a direct call has run longer than ``timeout_s``."""
        now = time.monotonic()
        late = []
        with self._lock:
            for ent in self._direct.values():
                if not ent[2] and now - ent[0] > self._timeout_s:
                    ent[2] = True
                    late.append(ent[1])
        for what in late:
            self._degrade(f"{what} took more than {self._timeout_s:.1f} s", count="timeouts")

    def _check_keys(self, keys: Sequence[bytes], bufs: Sequence[torch.Tensor], what: str) -> None:
        if len(keys) != len(bufs):
            raise LayoutError(f"{len(keys)} keys but {len(bufs)} {what}")
        for k in keys:
            if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
                raise LayoutError(f"block keys are {KEY_BYTES} bytes, got {k!r:.40}")
        for b in bufs:
            if not isinstance(b, torch.Tensor) or b.device.type != "cpu" or not b.is_contiguous():
                raise LayoutError(f"{what} must be contiguous CPU tensors")
            if b.numel() * b.element_size() != self.block_bytes:
                raise LayoutError(
                    f"{what[:-1]} of {b.numel() * b.element_size()} bytes; "
                    f"blocks are {self.block_bytes} bytes"
                )

    # ------------------------------------------------------------------ parts
    _put = handed_to(_publisher, Publisher.put)
    flush = handed_to(_publisher, Publisher.flush)
    get_into = handed_to(_loader, Loader.get_into)
    register_memory = handed_to(_loader, Loader.register_memory)
    set_load_observer = handed_to(_loader, Loader.set_load_observer)

    # ----------------------------------------------------------------- lookup
    def exists_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading ``keys`` the cluster holds (one ``batch_is_exist``).

        Each present object gets a read lease from the master (so a load right
        after the lookup finds it). Degraded, timed out or failed: 0.

        Raises
        ------
        LayoutError
            For a key that is not 32 bytes.
        """
        if not keys:
            return 0
        names = [self._namer(bytes(k)) for k in keys]
        client = self._usable()
        if client is None:
            return 0
        self._bump("exists_calls")
        res = self._call("batch_is_exist", client.batch_is_exist, names)
        if res is _NO_RESULT:
            return 0
        n = 0
        for r in res:
            if r != 1:
                break
            n += 1
        errs = [r for r in res[n:] if r not in (0, 1)]
        with self._lock:
            self._counters["exists_keys"] += len(names)
            self._counters["exists_hits"] += n
            if errs:
                self._counters["exists_errors"] += len(errs)
                for r in errs:
                    self._errors[r] += 1
        if RPC_FAIL in errs:
            self._degrade("batch_is_exist: master unreachable (-900)", count="rpc_failures")
        return n

    def contains(self, key: bytes) -> bool:
        """Whether the cluster holds ``key`` (:meth:`exists_prefix` of one key)."""
        return self.exists_prefix([key]) == 1

    # ---------------------------------------------------------------- removal
    def remove(self, keys: Sequence[bytes]) -> None:
        """Remove blocks from the cluster in the background (best effort: an
        object under a read lease is retried with backoff; unknown keys are ignored)."""
        self._remove_later([self._namer(bytes(k)) for k in keys])

    def _remove_later(self, names: Sequence[str]) -> None:
        """Queue objects for removal by the prober (also corrupt ones the loader found)."""
        now = time.monotonic()
        with self._lock:
            for nm in names:
                self._removals.setdefault(nm, [now, 0])
            self._work.notify_all()

    def _run_removals(self, client) -> None:
        now = time.monotonic()
        with self._lock:
            due = [nm for nm, (t, _a) in self._removals.items() if t <= now][:64]
        for nm in due:
            rc = self._call("remove", client.remove, nm)
            if rc is _NO_RESULT:
                return
            with self._lock:
                ent = self._removals.get(nm)
                if ent is None:
                    continue
                if rc in (0, OBJECT_NOT_FOUND):
                    self._counters["removals_ok"] += 1
                    del self._removals[nm]
                elif rc == OBJECT_HAS_LEASE and ent[1] < 8:
                    self._counters["removal_lease_retries"] += 1
                    ent[1] += 1
                    ent[0] = now + min(0.25 * 2 ** ent[1], 16.0)
                else:
                    self._counters["removals_dropped"] += 1
                    self._errors[rc] += 1
                    del self._removals[nm]

    # ----------------------------------------------------------------- prober
    def _probe_loop(self) -> None:
        lo, hi = self.tuning.reconnect_backoff_s
        while True:
            with self._lock:
                if self._closed:
                    return
                wait = 0.05 if self._state != "ok" else 0.25
                self._work.wait(wait)
                if self._closed:
                    return
                state, client = self._state, self._client
                due = time.monotonic() >= self._next_probe
                busy_calls = self._inflight_calls
            self._watchdog()
            if state == "ok":
                if client is not None and self._removals:
                    self._run_removals(client)
                continue
            if not due:
                continue
            if client is None:
                ok = self._connect()
            elif busy_calls > 0:  # a timed-out call has not returned: the client may be wedged
                ok = False
            else:
                ok = self._probe(client)
            with self._lock:
                if ok:
                    if self._state != "ok":
                        self._state, self._reason = "ok", ""
                        self._counters["reconnects"] += 1
                        log.info(
                            "mooncake tier recovered after %.1f s", time.monotonic() - self._degraded_since
                        )
                    self._backoff_s = lo
                else:
                    self._backoff_s = min(self._backoff_s * 2, hi)
                    self._next_probe = time.monotonic() + self._backoff_s

    def _probe(self, client) -> bool:
        fut = self._calls.submit(_probe_call, client, self._probe_name)
        try:
            return fut.result(self._timeout_s)
        except cf.TimeoutError:
            self._bump("timeouts")
            return False
        except Exception as e:  # noqa: BLE001 (a raising client is a failed probe)
            log.debug("mooncake probe raised %r", e)
            return False

    # ------------------------------------------------------------------ state
    @property
    def state(self) -> str:
        """``connecting``, ``ok``, ``degraded`` or ``closed``."""
        with self._lock:
            return self._state

    def wait_ok(self, timeout_s: float) -> bool:
        """Wait until the tier is ``ok`` (connected and not degraded)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.state == "ok":
                return True
            time.sleep(0.02)
        return self.state == "ok"

    def stats(self) -> dict:
        """Counters and state (see the module docstring for their meaning).

        Keys: every counter of :data:`_COUNTERS`; ``state``; ``degraded_reason``;
        ``degraded_for_s``; ``queued_blocks``; ``publish_slots_free``;
        ``get_slots_free``; ``pending_removals``; ``errors`` (Mooncake return
        code -> count); ``corrupt_<reason>`` for each of
        :data:`~tierstore.remote.format.CORRUPT_REASONS`.
        """
        with self._lock:
            d: dict[str, Any] = dict(self._counters)
            d["state"] = self._state
            d["degraded_reason"] = self._reason
            d["degraded_for_s"] = (
                (time.monotonic() - self._degraded_since) if self._state == "degraded" else 0.0
            )
            d["queued_blocks"] = self.publisher.queued_blocks()
            d["pending_removals"] = len(self._removals)
            d["errors"] = dict(self._errors)
            for r in CORRUPT_REASONS:
                d[f"corrupt_{r}"] = self._corrupt[r]
        d["publish_slots_free"] = self.publisher.free_slots()
        d["get_slots_free"] = self.loader.free_slots()
        return d

    def close(self) -> None:
        """Publish what is queued (waiting at most about ``timeout_s``), stop the
        threads and close the client. Idempotent; never hangs on a dead cluster."""
        with self._lock:
            if self._closed:
                return
        self.flush(self._timeout_s)
        with self._lock:
            self._closed = True
            self._state = "closed"
            dropped = self.publisher.take_queued()
            client, self._client = self._client, None
            self._work.notify_all()
        self.publisher.give_back(dropped)
        deadline = time.monotonic() + self._timeout_s
        self.publisher.join(deadline)
        self._prober.join(max(0.0, deadline - time.monotonic()))
        if client is not None:
            fut = self._calls.submit(_close_quietly, client)
            try:
                fut.result(self._timeout_s)
            except cf.TimeoutError:
                log.warning("mooncake tier: client close took more than %.1f s; abandoned", self._timeout_s)
            del fut, client
        # Join the call threads: a daemon thread still running at interpreter exit is
        # ended by pthread_exit, whose forced unwind through C++ frames (a torch
        # tensor's deallocation, Mooncake) calls std::terminate (SIGABRT at exit,
        # seen with 1 in 8 processes before this join).
        self._calls.stop(self._timeout_s)
        _LIVE.discard(self)


#: Tiers not closed yet; closed at interpreter exit (before daemon threads are torn down).
_LIVE: weakref.WeakSet[MooncakeTier] = weakref.WeakSet()


@atexit.register
def _close_live_tiers() -> None:
    for tier in list(_LIVE):
        tier.close()
