"""The pydantic base every configuration model shares: strict models, sizes and durations, and
one error format.

:class:`StrictModel` is ``extra="forbid"`` and frozen (an unknown key is an error that lists
the accepted keys). :data:`SizeBytes` accepts ``64GiB``, ``4k``, ``1g`` or an int
(:func:`tierstore.units.parse_size`, base 1024); :data:`DurationS` accepts ``30s``, ``500ms``
or seconds (:func:`tierstore.units.parse_time_s`), :data:`PositiveDurationS` only above 0;
``Optional*`` let ``null`` through. Both are parsed once, at load, with the field's name in
the message. :func:`parse_model` turns every validation failure into one
:class:`~tierstore.errors.ConfigError` whose lines name the key, the value and what is
accepted (:func:`format_validation_error`); :func:`read_yaml` reads a file. The store's models
(:mod:`tierstore.config`, :mod:`tierstore.policies.config`) and the daemon's
(:mod:`tierstore.server.config`) are built on these.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from .errors import ConfigError
from .units import MAX_DURATION_S, check_duration_s, parse_size, parse_time_s

_Model = TypeVar("_Model", bound=BaseModel)

__all__ = [
    "DurationS",
    "OptionalSizeBytes",
    "PositiveDurationS",
    "WaitS",
    "SizeBytes",
    "StrictModel",
    "format_validation_error",
    "parse_model",
    "read_yaml",
]


class StrictModel(BaseModel):
    """A configuration model: unknown keys are errors, instances are immutable."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, v: Any, info: ValidationInfo) -> Any:
        """Refuse ``true``/``false`` where a number belongs: pydantic's lax mode reads a bool as 1 or 0
        (``live_fraction: true`` would keep every block live). Fields that take a bool are untouched."""
        if isinstance(v, bool) and info.field_name is not None:
            if _takes_a_number_not_a_bool(cls.model_fields[info.field_name].annotation):
                raise ValueError(f"{info.field_name}={v}: expected a number, not a yes/no value")
        return v


def _takes_a_number_not_a_bool(annotation: Any) -> bool:
    """True for ``int``, ``float`` and their ``Optional``/``Annotated`` forms, unless ``bool`` is
    allowed too."""
    args = getattr(annotation, "__args__", None)
    kinds = set(args) if args and getattr(annotation, "__metadata__", None) is None else {annotation}
    if getattr(annotation, "__metadata__", None) is not None:  # Annotated[int, ...]
        kinds = {annotation.__origin__}
    return bool(kinds & {int, float}) and bool not in kinds


def _size(v: Any, info: ValidationInfo) -> int:
    return parse_size(v, info.field_name or "size")


def _size_or_none(v: Any, info: ValidationInfo) -> int | None:
    return None if v is None else parse_size(v, info.field_name or "size")


def _dur(v: Any, info: ValidationInfo) -> float:
    return parse_time_s(v, info.field_name or "duration")


def _positive(v: float) -> float:
    if v <= 0:
        raise ValueError("must be > 0")
    return v


def _wait(v: Any, info: ValidationInfo) -> float:
    key = info.field_name or "duration"
    if isinstance(v, str) and v.strip().startswith("-"):  # parse_time_s would say ">= 0"
        raise ValueError(f"must be a finite number of seconds in (0, {MAX_DURATION_S:g}]")
    return check_duration_s(parse_time_s(v, key) if isinstance(v, str) else v, key)


#: Bytes: an int or a size string (``4k``, ``16MiB``), parsed before validation.
SizeBytes = Annotated[int, BeforeValidator(_size)]
#: :data:`SizeBytes` or ``None``.
OptionalSizeBytes = Annotated[int | None, BeforeValidator(_size_or_none)]
#: Seconds: a number or a duration string (``30s``, ``500ms``), parsed before validation.
DurationS = Annotated[float, BeforeValidator(_dur)]
#: :data:`DurationS` that must be > 0 (a timeout, a lease).
PositiveDurationS = Annotated[float, BeforeValidator(_dur), AfterValidator(_positive)]
#: A wait a client hands to :func:`tierstore.units.check_duration_s`: a number of seconds or a
#: duration string in ``(0, MAX_DURATION_S]`` (a day), checked here once with that check's
#: range and message, so a config the model accepts is one the client opens.
WaitS = Annotated[float, BeforeValidator(_wait)]


def _accepted_keys(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str] | None:
    """Field names of the model that owns the unknown key at ``loc``."""
    cur: Any = model
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        if not (isinstance(cur, type) and issubclass(cur, BaseModel)) or part not in cur.model_fields:
            return None
        ann = cur.model_fields[part].annotation
        cur = next(
            (a for a in getattr(ann, "__args__", (ann,)) if isinstance(a, type) and issubclass(a, BaseModel)),
            None,
        )
        if cur is None and hasattr(ann, "__args__"):  # list[Model]
            cur = next(
                (a for a in getattr(ann, "__args__", ()) if isinstance(a, type) and issubclass(a, BaseModel)),
                None,
            )
    if isinstance(cur, type) and issubclass(cur, BaseModel):
        return sorted(cur.model_fields)
    return None


def format_validation_error(err: ValidationError, root: type[BaseModel], what: str) -> str:
    """One line per problem: ``key=value: what is accepted``."""
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        val = e.get("input")
        if e["type"] == "extra_forbidden":
            acc = _accepted_keys(root, tuple(e["loc"]))
            lines.append(f"{key or '(document)'}: unknown key; accepted keys here are {acc}")
            continue
        if e["type"] == "missing":
            lines.append(f"{key or '(document)'}: required key is missing")
            continue
        msg = e["msg"].removeprefix("Value error, ")
        inner = f"{e['loc'][-1]}=" if e["loc"] else None
        if inner and msg.startswith(inner) and ": " in msg:  # parse_size/parse_time_s repeat key=value
            msg = msg.split(": ", 1)[1]
        if isinstance(val, dict):  # a section's own check: its key (none for the document), not its body
            lines.append(f"{key}: {msg}" if key else msg)
        else:
            lines.append(f"{key}={val!r}: {msg}")
    return f"invalid {what}:\n  " + "\n  ".join(lines)


def parse_model(model: type[_Model], doc: Any, what: str) -> _Model:
    """Validate ``doc`` into ``model``; every failure is one :class:`ConfigError`."""
    if not isinstance(doc, dict):
        raise ConfigError(f"invalid {what}: the document must be a mapping, got {type(doc).__name__}")
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, model, what)) from None
    except ConfigError as e:  # raised by parse_size/parse_time_s inside a validator
        raise ConfigError(f"invalid {what}: {e}") from None


def read_yaml(path: str) -> Any:
    """Parse a YAML file. Raises :class:`ConfigError` for an unreadable file or bad syntax."""
    try:
        with open(path, encoding="utf-8") as f:
            return yaml.safe_load(f)
    except OSError as e:
        raise ConfigError(f"config file {path!r}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path!r}: YAML syntax error: {e}") from None
