"""The handler table: one transfer handler per (source medium, destination medium).

As vLLM's ``kv_offload`` registers one transfer handler per (source, destination) medium, the
movers route every transfer through this table: memory <-> memory is the
:class:`~tierstore.movers.memory.MemoryHandler`, memory <-> NVMe the
:class:`~tierstore.movers.nvme.NvmeHandler`, memory <-> remote the
:class:`~tierstore.movers.remote.RemoteHandler`. A store without an NVMe or a remote tier has no
handler for those kinds; asking for one is a :class:`~tierstore.errors.ConfigError` naming it.
"""

from __future__ import annotations

from typing import Literal, overload

from ..contract import Medium
from ..errors import ConfigError
from .memory import MemoryHandler
from .nvme import NvmeHandler
from .remote import RemoteHandler

#: ``(source medium, destination medium)``.
TransferKind = tuple[Medium, Medium]
Handler = MemoryHandler | NvmeHandler | RemoteHandler
_M = Literal[Medium.MEMORY]

_WHY_MISSING = {Medium.NVME: "no NVMe tier", Medium.REMOTE: "no remote tier"}


class HandlerTable:
    """The handlers of a store, by transfer kind.

    Parameters
    ----------
    memory : MemoryHandler
        Memory <-> memory (every store has memory tiers or engine buffers).
    nvme : NvmeHandler or None
        Memory <-> NVMe; ``None`` without an NVMe tier.
    remote : RemoteHandler or None
        Memory <-> remote; ``None`` without a remote tier.
    """

    def __init__(
        self, memory: MemoryHandler, nvme: NvmeHandler | None = None, remote: RemoteHandler | None = None
    ) -> None:
        self.memory, self.nvme, self.remote = memory, nvme, remote
        m = Medium.MEMORY
        self.kinds: dict[TransferKind, Handler] = {(m, m): memory}
        for medium, handler in ((Medium.NVME, nvme), (Medium.REMOTE, remote)):
            if handler is not None:
                self.kinds[(m, medium)] = self.kinds[(medium, m)] = handler

    @overload
    def __getitem__(self, kind: tuple[_M, _M]) -> MemoryHandler: ...
    @overload
    def __getitem__(
        self, kind: tuple[_M, Literal[Medium.NVME]] | tuple[Literal[Medium.NVME], _M]
    ) -> NvmeHandler: ...
    @overload
    def __getitem__(
        self, kind: tuple[_M, Literal[Medium.REMOTE]] | tuple[Literal[Medium.REMOTE], _M]
    ) -> RemoteHandler: ...
    @overload
    def __getitem__(self, kind: TransferKind) -> Handler: ...

    def __getitem__(self, kind: TransferKind) -> Handler:
        """The handler of ``(source, destination)``.

        Raises
        ------
        ConfigError
            When the store has no handler for that kind (no such tier), e.g.
            ``no memory->nvme handler: no NVMe tier``.
        """
        handler = self.kinds.get(kind)
        if handler is None:
            src, dst = kind
            if Medium.MEMORY not in kind:
                why = "no such transfer (a handler moves bytes between memory and one other medium)"
            else:
                why = _WHY_MISSING.get(dst if src is Medium.MEMORY else src, "no such transfer")
            raise ConfigError(f"no {src.value}->{dst.value} handler: {why}")
        return handler

    def __contains__(self, kind: TransferKind) -> bool:
        return kind in self.kinds
