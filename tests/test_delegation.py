"""tierstore.delegation.handed_to: the facade's method is the part's, run on the part found per call."""

from __future__ import annotations

import inspect
import operator

import pytest

from tierstore.delegation import handed_to


class _Part:
    def __init__(self, tag: str) -> None:
        self.tag = tag

    def put(self, keys: list[bytes], *, copy: bool = False) -> list[str]:
        """Queue ``keys``."""
        return [f"{self.tag}:{k.decode()}:{copy}" for k in keys]


class _Facade:
    def __init__(self) -> None:
        self.part: _Part | None = _Part("a")

    put = handed_to(operator.attrgetter("part"), _Part.put)


def test_the_method_has_the_part_methods_signature_and_doc_and_runs_on_the_current_part():
    f = _Facade()
    assert inspect.signature(_Facade.put) == inspect.signature(_Part.put)
    assert _Facade.put.__doc__ == "Queue ``keys``." and _Facade.put.__name__ == "put"
    assert f.put([b"x"], copy=True) == ["a:x:True"]
    f.part = _Part("b")  # found at each call, not bound once
    assert f.put([b"y"]) == ["b:y:False"]


def test_what_finding_the_part_raises_the_call_raises():
    f = _Facade()
    f.part = None
    with pytest.raises(AttributeError, match="put"):
        f.put([b"x"])
