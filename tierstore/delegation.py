"""A facade's method that hands the call to one of its parts: one place states its signature.

A facade that owns parts (the remote tier's publisher and loader, the movers' transfer handlers)
offers some of their methods as its own. :func:`handed_to` makes such a method from the part's
method: the same signature and docstring (``functools.wraps``: ``inspect.signature``, mypy and
the docs see the part's), run on the part that ``part(facade)`` returns at each call (so a part
looked up per call, or one that is missing, raises as the lookup does).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Concatenate, ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")


def handed_to(
    part: Callable[[Any], Any], method: Callable[Concatenate[Any, P], R]
) -> Callable[Concatenate[Any, P], R]:
    """A method of a facade that runs ``method`` on ``part(self)``.

    Parameters
    ----------
    part : callable
        Returns the part from the facade (e.g. ``operator.attrgetter("publisher")``); called at
        every call, so what it raises (a missing part) the call raises.
    method : function
        The part's method (e.g. ``Publisher.put``), called by name on the part; its signature,
        annotations and docstring become the facade method's.

    Returns
    -------
    function
        To assign in the facade's class body (``put = handed_to(..., Publisher.put)``).
    """
    name = method.__name__

    @functools.wraps(method)
    def on_part(self: Any, *args: P.args, **kwargs: P.kwargs) -> R:
        return getattr(part(self), name)(*args, **kwargs)

    return on_part
