"""The movers: execute the block index's plans; they decide nothing.

The index (:mod:`tierstore.index`) says *what* goes *where*; the movers copy the bytes without the
index lock (vLLM's offloading handlers, SGLang's ``HiCacheController``). One handler per transfer
kind, in one :class:`HandlerTable`: :class:`MemoryHandler` (memory <-> memory: every memory copy),
:class:`NvmeHandler` (memory <-> NVMe: one batched write per plan, built by :mod:`.batch`, and the
storage's one read path) and :class:`RemoteHandler` (memory <-> the shared remote tier, with the
host slots a late transfer holds). :class:`Movers` (:mod:`.execute`) runs a plan in the order it
needs; :class:`WorkQueues` are its ``"load"`` and ``"store"`` queues; :class:`LoadGate` makes a
deadline and a copy into the engine's buffer exclusive.

Handlers import no index, planner, API, build, configuration or policy: they take everything from
the plan (key, tier, slot, lifetime class, namespace) and from what they were built with (pools, a
``BlockStorage``, a ``RemoteBlockTier``, the placement function), so one can run in another process.
"""

from .batch import NvmeBatch, add_new_blocks, demotion_batch, store_batch
from .execute import Movers, make_movers
from .gate import GateView, LoadGate
from .memory import MemoryHandler
from .nvme import NvmeHandler
from .queues import WorkQueues
from .remote import RemoteHandler
from .table import HandlerTable, TransferKind

__all__ = [
    "GateView",
    "HandlerTable",
    "LoadGate",
    "MemoryHandler",
    "Movers",
    "NvmeBatch",
    "NvmeHandler",
    "RemoteHandler",
    "TransferKind",
    "WorkQueues",
    "add_new_blocks",
    "demotion_batch",
    "make_movers",
    "store_batch",
]
