"""HTTP plumbing of the daemon: errors, JSON logs, request models and parsing, bearer auth headers.

Every error the API answers is ``{"error": {"code", "message"}}`` with an HTTP
status (:class:`ApiError`, :func:`error_response`; the codes are listed in
``openapi.yaml``). Request bodies are validated by strict pydantic models
(unknown fields are errors, no type coercion); :func:`parse_json` turns every
malformed body into a 400 with a message that names the field.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
)

__all__ = [
    "ApiError",
    "error_response",
    "JsonFormatter",
    "setup_logging",
    "JsonAccessLogger",
    "KeysRequest",
    "PutManifest",
    "PinRequest",
    "UnpinRequest",
    "InvalidateRequest",
    "hex32",
    "validation_message",
    "parse_json",
    "bearer_token",
    "require_json",
    "UNAUTHORIZED_HEADERS",
]

_HEX64 = re.compile(r"^[0-9a-fA-F]{64}$")
#: ``WWW-Authenticate`` of a 401 (RFC 6750 section 3).
UNAUTHORIZED_HEADERS = {"WWW-Authenticate": 'Bearer realm="tierstore"'}


class ApiError(Exception):
    """An HTTP error answered as ``{"error": {"code", "message"}}``."""

    def __init__(self, status: int, code: str, message: str, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


def error_response(status: int, code: str, message: str, headers: dict | None = None) -> web.Response:
    """A JSON error response."""
    return web.json_response({"error": {"code": code, "message": message}}, status=status, headers=headers)


class JsonFormatter(logging.Formatter):
    """One JSON object per log line (``ts``, ``level``, ``logger``, ``msg`` + extra fields)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": round(record.created, 6),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_logging(level: str) -> None:
    """Route every logger to stderr as JSON lines."""
    h = logging.StreamHandler()
    h.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [h]
    root.setLevel(level)


class JsonAccessLogger(AbstractAccessLogger):
    """aiohttp access log as JSON (method, path, status, bytes, duration, tenant)."""

    def log(self, request, response, time_s: float) -> None:
        self.logger.info(
            "request",
            extra={
                "fields": {
                    "event": "access",
                    "method": request.method,
                    "path": request.path,
                    "status": response.status,
                    "resp_bytes": response.body_length,
                    "duration_s": round(time_s, 6),
                    "tenant": request.get("tenant"),
                    "remote": request.remote,
                }
            },
        )


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class KeysRequest(_Req):
    """Body of get / exists / lookup / prefetch."""

    namespace: StrictStr
    keys: list[StrictStr]
    promote: StrictBool = True


class PutManifest(_Req):
    """Manifest of a put."""

    namespace: StrictStr
    keys: list[StrictStr]
    first_position: StrictInt = Field(0, ge=0)
    lifetime: StrictStr | None = None


class PinRequest(_Req):
    """Body of a pin."""

    namespace: StrictStr
    keys: list[StrictStr]
    lease_s: StrictFloat | StrictInt | None = None


class UnpinRequest(_Req):
    """Body of an unpin."""

    lease_id: StrictInt


class InvalidateRequest(_Req):
    """Body of an invalidate."""

    namespace: StrictStr


def hex32(value: str, what: str) -> bytes:
    if not _HEX64.match(value):
        raise ApiError(400, "bad_request", f"{what}: expected 64 hex digits (32 bytes)")
    return bytes.fromhex(value)


def validation_message(err: ValidationError) -> str:
    parts = []
    for e in err.errors()[:5]:
        key = ".".join(str(p) for p in e["loc"]) or "(body)"
        parts.append(f"{key}: {e['msg']}")
    return "; ".join(parts)


def parse_json(raw: bytes, model: type[BaseModel]) -> Any:
    """Validate a JSON object body against ``model``.

    The body must be UTF-8 (RFC 8259 section 8.1: JSON exchanged between systems
    is UTF-8; ``json.loads`` of bytes would also guess UTF-16/32). Integers of
    more digits than Python converts (``sys.get_int_max_str_digits()``, 4300 by
    default), nesting deeper than the parser's recursion limit and non-finite
    numbers are malformed input, not server errors.

    Raises
    ------
    ApiError
        400 ``bad_json`` for a body that is not UTF-8 or not a JSON object,
        400 ``bad_request`` for one that does not match ``model``.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(
            400,
            "bad_json",
            f"body is not UTF-8: byte 0x{raw[e.start]:02x} at offset {e.start} "
            "(JSON bodies and put manifests are UTF-8)",
        ) from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ApiError(400, "bad_json", f"body is not valid JSON: {e}") from None
    except ValueError as e:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        raise ApiError(
            400, "bad_json", f"body is not acceptable JSON: {str(e).splitlines()[0][:200]}"
        ) from None
    except RecursionError:
        raise ApiError(400, "bad_json", "body is not acceptable JSON: nested too deeply") from None
    if not isinstance(doc, dict):
        raise ApiError(400, "bad_json", "body must be a JSON object")
    try:
        return model.model_validate(doc)
    except ValidationError as e:
        raise ApiError(400, "bad_request", validation_message(e)) from None
    except (ValueError, RecursionError) as e:  # a value pydantic cannot even format in its message
        raise ApiError(400, "bad_request", f"body does not match the schema: {type(e).__name__}") from None


def bearer_token(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer <token>`` header, or ``None``.

    The scheme name is case-insensitive (RFC 7235 section 2.1: ``bearer``,
    ``BEARER`` and ``Bearer`` are the same scheme); one or more spaces separate it
    from the token (RFC 7235 ``1*SP``).
    """
    if not header:
        return None
    scheme, sep, token = header.partition(" ")
    if not sep or scheme.lower() != "bearer":
        return None
    token = token.strip(" ")
    return token or None


def require_json(content_type: str) -> None:
    """A JSON endpoint's ``Content-Type`` check (its media type, parameters such as ``charset`` aside).

    Raises
    ------
    ApiError
        415 ``unsupported_media_type`` for anything but ``application/json``.
    """
    if content_type.lower() != "application/json":
        raise ApiError(
            415, "unsupported_media_type", f"Content-Type must be application/json, got {content_type!r}"
        )
