"""What is worth sharing: the remote tier's admission rule.

Publishing a block to the shared tier costs a copy, a checksum and a network
transfer, and it takes cluster DRAM from other instances' blocks. Most blocks
of a conversation trace are never reused (about two thirds: Mooncake, FAST
2025, 182,790 unique of 288,500 block references), so sharing every block
spends bandwidth and capacity on blocks nobody asks for again.

:class:`ShareAdmission` is the rule the core calls when it is about to publish
a block (a store or a demotion). It is pure bookkeeping: no I/O, no lock held
by the caller, and it never sees block bytes.

* ``mode="all"``: share every block (a prefix computed once is at once
  available to every instance: the best hit rate for the cost of bandwidth).
* ``mode="reused"``: share a block when it has been hit locally
  (``hits >= min_hits``), or when it comes back a second time (its key is in a
  bounded FIFO of keys declined before, a "ghost" set). Blocks seen once stay
  local. This is TinyLFU's doorkeeper ("admit on the second sighting":
  G. Einziger, R. Friedman and B. Manes, "TinyLFU: A Highly Efficient Cache
  Admission Policy", ACM TOS 13(4), 2017, section 3.4.2), the same rule as the
  NVMe tier's :class:`tierstore.policies.admission.SecondSightingAdmission`.

``RemoteConfig.admission`` (``all`` | ``reused``) selects the mode.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..keytable import GhostKeys

MODES = ("all", "reused")


class ShareAdmission:
    """Decides whether a block is published to the remote tier.

    Parameters
    ----------
    mode : {"all", "reused"}
        See the module docstring.
    min_hits : int
        Local hits that admit a block at once in ``reused`` mode.
    ghost_keys : int
        Declined keys remembered (FIFO); bounds memory to about
        ``100 * ghost_keys`` bytes.

    Attributes
    ----------
    admitted, declined : int
        Decisions so far.

    Raises
    ------
    ConfigError
        For an unknown mode or a bound < 1.

    Notes
    -----
    Not thread-safe: the core calls it under its own index lock (it is a few
    dictionary operations).
    """

    def __init__(self, mode: str = "all", min_hits: int = 1, ghost_keys: int = 1 << 16) -> None:
        if mode not in MODES:
            raise ConfigError(f"remote.admission={mode!r}: accepted {', '.join(MODES)}")
        if min_hits < 1 or ghost_keys < 1:
            raise ConfigError(
                f"ShareAdmission: min_hits and ghost_keys must be >= 1 (got {min_hits}, {ghost_keys})"
            )
        self.mode = mode
        self.min_hits = int(min_hits)
        self.ghost_keys = int(ghost_keys)
        self._ghost = GhostKeys(self.ghost_keys)
        self.admitted = 0
        self.declined = 0

    def admit(self, key: bytes, hits: int = 0) -> bool:
        """Whether to publish ``key`` now.

        Parameters
        ----------
        key : bytes
            32-byte block key.
        hits : int
            Local hits of the block so far (the index's count).

        Returns
        -------
        bool
            ``True``: publish. ``False``: keep it local (in ``reused`` mode the
            key is remembered, and admitted when it is offered again).
        """
        if self.mode == "all" or hits >= self.min_hits or self._ghost.take(key):
            self.admitted += 1
            return True
        self._ghost.add(key)
        self.declined += 1
        return False
