"""Name → factory registries, one per family of interchangeable parts.

A family (an eviction policy, an admission policy, a segment policy, ...) is a :class:`Registry`
named after the configuration key that chooses a member (``Registry("eviction")``). Every place
that accepts a member's name -- YAML, ``KVStore(...)`` keywords, an engine's extra config, the
bench CLI -- asks the family's registry, so they accept exactly the same names, aliases included,
and refuse the others with one message: ``"{family}={name!r}: accepted values are [...]"``.

A name is registered once; an alias is a second spelling of one canonical name and never a
member of its own. Members keep registration order (the order :meth:`Registry.names` lists and
error messages show).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Generic, TypeVar

from .errors import ConfigError

T = TypeVar("T")


class Registry(Generic[T]):
    """The members of one family: canonical name → factory, plus aliases.

    Parameters
    ----------
    family : str
        The configuration key that names a member (``"eviction"``, ``"admission"``,
        ``"region_policy"``); it starts every error message.

    Examples
    --------
    >>> EVICTION: Registry[object] = Registry("eviction")
    >>> EVICTION.register("lru", dict, aliases=("least_recent",))
    >>> EVICTION.canonical("least_recent")
    'lru'
    """

    def __init__(self, family: str) -> None:
        if not isinstance(family, str) or not family:
            raise ConfigError(f"Registry: family={family!r}: must be a non-empty string")
        self.family = family
        self._factories: dict[str, Callable[..., T]] = {}
        self._aliases: dict[str, str] = {}  # alias -> canonical name

    def register(
        self, name: str, factory: Callable[..., T], *, aliases: Iterable[str] = (), replace: bool = False
    ) -> None:
        """Make ``factory`` the member ``name`` (also reachable as each of ``aliases``).

        Parameters
        ----------
        name : str
            Canonical name.
        factory : callable
            ``factory(*args, **kwargs)`` builds the member (:meth:`make` passes its arguments on).
        aliases : iterable of str
            Other spellings of ``name``.
        replace : bool
            Allow replacing a member registered before under ``name`` (its aliases are dropped).

        Raises
        ------
        ConfigError
            For an empty name, a name or alias already taken (unless ``replace`` and it is
            ``name`` itself), or an alias equal to a canonical name.
        """
        aliases = tuple(aliases)
        for n in (name, *aliases):
            if not isinstance(n, str) or not n:
                raise ConfigError(f"{self.family}: a member's name must be a non-empty string, not {n!r}")
        if name in self._aliases or (name in self._factories and not replace):
            raise ConfigError(f"{self.family}={name!r}: already registered")
        for a in aliases:
            if a == name or a in self._factories or self._aliases.get(a, name) != name:
                raise ConfigError(f"{self.family}={a!r}: already registered (alias of {name!r} refused)")
        if name in self._factories:
            self._aliases = {a: c for a, c in self._aliases.items() if c != name}
        self._factories[name] = factory
        self._aliases.update((a, name) for a in aliases)

    def canonical(self, name: str) -> str:
        """The canonical name of ``name`` (itself, or what it is an alias of).

        Raises
        ------
        ConfigError
            ``"{family}={name!r}: accepted values are [...]"`` for a name not registered.
        """
        if isinstance(name, str):
            if name in self._factories:
                return name
            if name in self._aliases:
                return self._aliases[name]
        raise ConfigError(f"{self.family}={name!r}: accepted values are {self.names()}")

    def make(self, name: str, *args: Any, **kwargs: Any) -> T:
        """Build the member ``name`` (or an alias of it): ``factory(*args, **kwargs)``.

        Raises
        ------
        ConfigError
            For a name not registered (:meth:`canonical`).
        """
        return self._factories[self.canonical(name)](*args, **kwargs)

    def names(self, aliases: bool = True) -> list[str]:
        """Accepted names in registration order, each canonical name followed by its aliases
        (``aliases=False``: the canonical names only)."""
        out = []
        for name in self._factories:
            out.append(name)
            if aliases:
                out.extend(a for a, c in self._aliases.items() if c == name)
        return out

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and (name in self._factories or name in self._aliases)

    def __repr__(self) -> str:
        return f"Registry({self.family!r}, {self.names()})"
