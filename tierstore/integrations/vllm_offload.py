"""tierstore as a secondary tier of vLLM's native KV offloading (``TieringOffloadingSpec``).

vLLM 0.32 has two ways to put KV somewhere else: KV connectors
(:mod:`tierstore.integrations.vllm`, which works on every platform) and the
newer native offloading (``vllm/v1/kv_offload/``): the ``OffloadingConnector``
with a ``TieringOffloadingSpec`` keeps a CPU *primary* tier in a shared mmap
(``SharedOffloadRegion``, one row of ``kv_bytes_per_chunk`` bytes per chunk)
and cascades chunks to *secondary* tiers, which never touch GPU memory: a
store copies a primary row out, a promotion copies bytes into a primary row.
:class:`TierstoreSecondaryTier` is such a secondary tier: tierstore's host
memory and NVMe (with FDP placement and its eviction policies) behind vLLM's
own CPU tier. vLLM loads it out of tree, no patch::

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "OffloadingConnector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592, "secondary_tiers": [{"type": "TierstoreSecondaryTier",
        "module_path": "tierstore.integrations.vllm_offload",
        "tiers": {"nvme": {"path": "/mnt/nvme/kv", "capacity_bytes": "1TiB"}}}]}}'

(``SecondaryTierFactory.get_tier_class`` imports ``module_path`` and takes
the class named ``type``; the factory pops ``type``, ``module_path`` and
``backpressure`` and passes every other key of the tier's dict to the
constructor. Source: vLLM 0.32 ``v1/kv_offload/tiering/factory.py``, ``spec.py``.)
With ``"store": {"url": "unix:///run/tierstore/node.sock"}`` in place of ``tiers``, the tier is a
client of the node service's store (``tierstore serve --node``), shared by every engine on the node.

Continued in ``docs/INTEGRATIONS.md`` (``tierstore/integrations/vllm_offload.py``).
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from ..config import StoreConfig
from ..errors import ConfigError, LayoutError, Status, StoreClosedError
from ..identity import Namespace, scoped_key
from ..io.label import resolve_nvme_path
from ..layout import KVLayout
from ._common import LIFETIME_HINTS, model_identity, open_store, split_extra_config, store_summary

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

logger = logging.getLogger(__name__)

#: ``kv_transfer_params`` key of a request's lifetime hint (as in the KV connector).
LIFETIME_PARAM = "tierstore_lifetime"


class OffloadTierSettings(BaseModel):
    """The tier's own keys (beside tierstore's ``tiers``/``policies``/``remote``).

    Attributes
    ----------
    tenant : str, optional
        Tenant scope of every chunk this engine stores and finds (a deployment
        tag; per-request isolation is vLLM's ``cache_salt``, already in its keys).
    model_id : str, optional
        Exact model identity; wins over the name/revision/fingerprint rule.
    locality : {"LOCAL", "REMOTE"}, optional
        vLLM's ``Locality`` of this tier (per-request tier filters use it).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    tenant: str | None = Field(None, min_length=1)
    model_id: str | None = Field(None, min_length=1)
    locality: Literal["LOCAL", "REMOTE"] | None = None


def split_tier_config(config: dict) -> tuple[StoreConfig, OffloadTierSettings]:
    """Validate the tier's dict (what the factory passes after popping its own keys):
    :func:`tierstore.integrations._common.split_extra_config` with the tier's own keys at the
    top level.

    Raises
    ------
    ConfigError
        An unknown key (the message lists the accepted ones), a bad value, a
        ``layout`` section, an HBM tier, or no tier at all.
    """
    return split_extra_config(
        config,
        None,
        OffloadTierSettings,
        "TierstoreSecondaryTier config",
        refuse={"layout": "'layout' is derived from vLLM's offload chunk; remove it"},
        secondary="a secondary tier has no GPU access (vLLM's primary CPU tier sits between it and the GPU)",
        note=" (plus vLLM's type, module_path, backpressure)",
    )


def chunk_layout(chunk_bytes: int, tokens_per_chunk: int) -> KVLayout:
    """The opaque tierstore layout of one vLLM offload chunk of ``chunk_bytes`` bytes.

    ``uint8``, one layer, one head, ``tokens_per_chunk`` tokens when
    ``chunk_bytes`` divides into ``2 * tokens_per_chunk`` (always for page-aligned
    chunks of power-of-two token counts up to 2048), else one "token" per chunk.
    ``bytes_per_block == chunk_bytes`` either way.

    Raises
    ------
    ConfigError
        If ``chunk_bytes`` is not a positive even number.
    """
    if chunk_bytes <= 0 or chunk_bytes % 2:
        raise ConfigError(f"vLLM offload chunk of {chunk_bytes} bytes: must be a positive even size")
    t = tokens_per_chunk if tokens_per_chunk > 0 and chunk_bytes % (2 * tokens_per_chunk) == 0 else 1
    return KVLayout(1, 1, chunk_bytes // (2 * t), "uint8", t, "vllm-offload-chunk", "layer_fused")


def _revision_of(model: str) -> str | None:
    """The engine's ``--revision`` if the scheduler's vLLM config is current and is this model's."""
    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # older vLLM
        return None
    cfg = get_current_vllm_config_or_none()
    mc = getattr(cfg, "model_config", None)
    if mc is None or getattr(mc, "model", None) != model:
        return None
    return getattr(mc, "revision", None)


def chunk_namespace(spec: OffloadingSpec, settings: OffloadTierSettings, chunk_bytes: int) -> Namespace:
    """The namespace of every chunk of this engine (module docstring, "Keys and isolation")."""
    cfg = spec.config
    model = cfg.model.name
    ident, exact = model_identity(model, _revision_of(model), None, settings.model_id)
    if not exact:
        logger.warning(
            "model %r has no pinned revision and is no local directory: tierstore keys its offload "
            "chunks by the name only; set model_id in the tier config (or --revision) so that other "
            "weights under the same name never share KV",
            model,
        )
    groups = hashlib.sha256(repr([(g.tokens_per_block, tuple(g.layer_names)) for g in cfg.groups]).encode())
    par = cfg.parallel
    geometry = (
        f"{cfg.model.dtype};chunk_bytes={chunk_bytes};tokens_per_hash={cfg.cache.tokens_per_hash};"
        f"blocks_per_chunk={cfg.cache.blocks_per_chunk};groups={groups.hexdigest()[:16]};"
        f"canonical={bool(cfg.canonical_layout)};replicated={bool(cfg.replicated_layout)};"
        f"pcp={par.pcp_size};dcp={par.dcp_size};world={par.world_size}"
    )
    return Namespace(
        model=ident,
        kv_dtype=geometry,
        tp_rank=0,
        tp_size=par.tp_size,
        pp_rank=0,
        pp_size=par.pp_size,
        tenant=settings.tenant or "default",
    )


def _per_engine_file(store_cfg: StoreConfig, ns: Namespace, layout: KVLayout) -> StoreConfig:
    """``tiers.nvme.path`` a directory (it ends in ``/`` or exists): this engine's own file in it,
    ``vllm_offload_<model>_<digest>.nvme``, named by the namespace and the chunk
    layout, so a restart of the same engine finds it again and engines of
    another model, topology or chunk size never open each other's file (the
    file is locked while open). A file or device path is used as it is; with
    ``store.url`` (the node service's store) there is no file of this engine's."""
    nv = store_cfg.tiers.nvme
    if store_cfg.store.url is not None or nv is None or nv.path is None or nv.device == "fdp":
        return store_cfg
    ident = hashlib.sha256(repr((ns, layout.fingerprint())).encode()).hexdigest()[:16]
    safe = re.sub(r"[^A-Za-z0-9._-]+", "_", ns.model)[-48:].strip("_") or "model"
    # the one path rule (tierstore.io.label): a directory (ends in / or exists) gets this engine's file
    path = resolve_nvme_path(nv.path, file_name=f"vllm_offload_{safe}_{ident}.nvme")
    tiers = store_cfg.tiers.model_copy(update={"nvme": nv.model_copy(update={"path": path})})
    return store_cfg.model_copy(update={"tiers": tiers})


class TierstoreSecondaryTier(SecondaryTierManager):
    """A vLLM ``SecondaryTierManager`` backed by a tierstore :class:`KVStore` (see the module docstring).

    Parameters
    ----------
    offloading_spec : OffloadingSpec
        vLLM's ``TieringOffloadingSpec`` (its ``config`` names model, dtype,
        topology and chunk geometry).
    primary_kv_view : memoryview
        The primary tier's rows, shape ``(num_chunks, kv_bytes_per_chunk)``,
        C-contiguous, writable (vLLM's ``SharedOffloadRegion`` mmap).
    tier_type : str
        The ``type`` the factory resolved (this class's name).
    backpressure_detector : BackpressureDetector, optional
        vLLM's store back-pressure (the manager consults it, not this tier).
    **config
        The tier's dict: ``tiers``, ``policies``, ``remote``, ``tenant``,
        ``model_id``, ``locality``; or ``store`` (``url``, ``timeout_s``, ``pool``: the node
        service's store, whose chunks every engine of the same model, dtype, topology and
        tenant on the node shares; vLLM's ``medium`` is then ``STORAGE``, whatever the
        service's tiers) in place of ``tiers``, ``policies`` and ``remote``.

    Raises
    ------
    ConfigError
        An invalid tier config, a primary view that is not C-contiguous,
        writable bytes, or a node service whose pool holds chunks of another size.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **config: Any,
    ) -> None:
        store_cfg, settings = split_tier_config(config)
        if primary_kv_view.readonly or not primary_kv_view.c_contiguous or primary_kv_view.ndim != 2:
            raise ConfigError(
                f"primary KV view: need a writable, C-contiguous (num_chunks, chunk_bytes) view; "
                f"got ndim={primary_kv_view.ndim}, readonly={primary_kv_view.readonly}, "
                f"c_contiguous={primary_kv_view.c_contiguous}"
            )
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.settings = settings
        self.locality = Locality(settings.locality) if settings.locality else None
        if store_cfg.store.url is None and store_cfg.tiers.nvme is None:  # memory only: host hits
            self.medium = Medium.CPU
            self.cache_hit_source = CacheHitSource.HOST
        self.chunk_bytes = self.block_size_bytes
        self.num_chunks = int(primary_kv_view.shape[0])
        spec_cfg = offloading_spec.config
        self.tokens_per_chunk = spec_cfg.cache.tokens_per_hash * spec_cfg.cache.blocks_per_chunk
        layout = chunk_layout(self.chunk_bytes, self.tokens_per_chunk)
        self.namespace = chunk_namespace(offloading_spec, settings, self.chunk_bytes)
        self.store = open_store(_per_engine_file(store_cfg, self.namespace, layout), layout)
        try:  # the node service's store connects here: a refusal (another chunk size) stops the start
            summary = store_summary(self.store)
        except ConfigError:
            self.store.close()
            raise
        self._digest = self.store.digest(self.namespace)
        # one uint8 tensor over vLLM's rows (no copy): row c is _rows[c]; released in shutdown
        # (vLLM unmaps the region after its tiers shut down and refuses while a view is exported)
        self._flat = primary_kv_view.cast("B")
        self._rows = torch.frombuffer(self._flat, dtype=torch.uint8).view(self.num_chunks, self.chunk_bytes)
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="tierstore-vllm-offload-store")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="tierstore-vllm-offload-load")
        self._jobs: dict[int, tuple[Future, list[OffloadKey], bool]] = {}
        self._lock = threading.Lock()
        self._closed = False
        logger.info(
            "tierstore secondary tier: %d-byte chunks of %d tokens, model %s, tenant %r; %s",
            self.chunk_bytes,
            self.tokens_per_chunk,
            self.namespace.model,
            self.namespace.tenant,
            summary,
        )

    # ------------------------------------------------------------------ helpers
    def _key(self, key: OffloadKey) -> bytes:
        return scoped_key(self._digest, bytes(key))

    def _row_views(self, chunk_ids) -> list[torch.Tensor]:
        ids = [int(c) for c in chunk_ids]
        bad = [c for c in ids if not 0 <= c < self.num_chunks]
        if bad:
            raise LayoutError(f"primary chunk ids {bad} outside [0, {self.num_chunks})")
        return [self._rows[c] for c in ids]

    @staticmethod
    def _lifetime(req_context: ReqContext) -> str | None:
        hint = (req_context.kv_transfer_params or {}).get(LIFETIME_PARAM)
        return hint if hint in LIFETIME_HINTS else None

    def _position(self, key: OffloadKey, req_context: ReqContext) -> int:
        end = req_context.get_offload_key_position(key)
        return max(0, (end - 1) // self.tokens_per_chunk) if end else 0

    # ------------------------------------------------------------------ SecondaryTierManager
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise StoreClosedError(f"TierstoreSecondaryTier.{what}: the tier was shut down")

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT if tierstore holds the chunk in any tier, else MISS (a pure probe)."""
        self._check_open("lookup")
        return LookupResult.HIT if self.store.exists([self._key(key)]) else LookupResult.MISS

    def _job_rows(self, job: TransferJob, what: str) -> tuple[list, list, list[bytes]]:
        """A ``what`` (store or load) job's keys, primary rows and tierstore keys, one row per key.

        Raises
        ------
        StoreClosedError
            After :meth:`shutdown`.
        LayoutError
            When the job has not one chunk id per key.
        """
        self._check_open(f"submit_{what}")
        keys = list(job.keys)
        rows = self._row_views(job.chunk_ids)
        if len(rows) != len(keys):
            raise LayoutError(f"{what} job {job.job_id}: {len(keys)} keys but {len(rows)} chunk ids")
        return keys, rows, [self._key(k) for k in keys]

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Copy primary rows ``chunk_ids`` into tierstore on the store thread (returns at once)."""
        keys, rows, skeys = self._job_rows(job_metadata, "store")
        lifetime = self._lifetime(job_metadata.req_context)
        first = self._position(keys[0], job_metadata.req_context) if keys else 0

        def run() -> tuple[list[Status], float]:
            t0 = time.perf_counter()
            st = self.store.store_keys(self.namespace, skeys, rows, lifetime=lifetime, first_position=first)
            return st, time.perf_counter() - t0

        with self._lock:
            self._jobs[job_metadata.job_id] = (self._saver.submit(run), keys, False)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Copy chunks from tierstore into primary rows ``chunk_ids`` on the load thread."""
        keys, rows, skeys = self._job_rows(job_metadata, "load")

        def run() -> tuple[list[Status], float]:
            t0 = time.perf_counter()
            # promote=False: vLLM's primary tier now holds the hot copy
            st, _ = self.store.load(skeys, rows, promote=False)
            return st, time.perf_counter() - t0

        with self._lock:
            self._jobs[job_metadata.job_id] = (self._loader.submit(run), keys, True)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        with self._lock:
            done = [(jid, j) for jid, j in self._jobs.items() if j[0].done()]
            for jid, _ in done:
                del self._jobs[jid]
        out = []
        for jid, (fut, keys, is_load) in done:
            try:
                statuses, dt = fut.result()
            except (
                LayoutError,
                ConfigError,
                OSError,
                RuntimeError,
            ) as e:  # a lost job: all its chunks failed
                logger.error(
                    "tierstore secondary tier: %s job %d failed: %s", "load" if is_load else "store", jid, e
                )
                out.append(JobResult(job_id=jid, success=False))
                continue
            good = {Status.OK} if is_load else {Status.OK, Status.EXISTS}
            ok = [s in good for s in statuses]
            moved = sum(s is Status.OK for s in statuses) * self.chunk_bytes
            if all(ok):
                out.append(JobResult(job_id=jid, success=True, transfer_time=dt, transfer_bytes=moved))
            else:
                loaded = tuple(k for k, g in zip(keys, ok) if g) if is_load else None
                out.append(
                    JobResult(
                        job_id=jid,
                        success=False,
                        successful_keys=loaded or None,
                        transfer_time=dt,
                        transfer_bytes=moved,
                    )
                )
        return out

    def has_pending_work(self) -> bool:
        with self._lock:
            return bool(self._jobs)

    def drain_jobs(self) -> None:
        """Wait for every submitted job (results stay queued for :meth:`get_finished_jobs`)."""
        with self._lock:
            futs = [j[0] for j in self._jobs.values()]
        wait(futs)

    def shutdown(self) -> None:
        """Finish the jobs in flight and close the store (its NVMe tier persists)."""
        if self._closed:
            return
        self._closed = True
        self._saver.shutdown(wait=True)
        self._loader.shutdown(wait=True)
        self._jobs.clear()
        self._rows = None
        self._flat.release()
        self.store.close()


__all__ = [
    "TierstoreSecondaryTier",
    "OffloadTierSettings",
    "chunk_layout",
    "chunk_namespace",
    "split_tier_config",
]
