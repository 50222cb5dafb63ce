"""``Closing``: the one ``with`` protocol of tierstore's resources.

A resource that holds files, threads, rings or connections has ``close()``;
``with resource: ...`` closes it on the way out, exception or not, and never
swallows the exception (``__exit__`` returns ``None``). A class whose ``with``
does more (``KVStore`` checks it is open) writes its own.
"""

from __future__ import annotations

from typing import TypeVar

_C = TypeVar("_C", bound="Closing")


class Closing:
    """Mixin: ``__enter__`` returns the resource, ``__exit__`` calls its ``close()``."""

    __slots__ = ()

    def close(self) -> object:
        """Release what the resource holds; subclasses implement it (idempotent; what it
        returns, if anything, is theirs to say)."""
        raise NotImplementedError

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
