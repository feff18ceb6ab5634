"""What every value of a request must be, wherever it comes from (JSON or msgpack body, form field, query,
path): text that is Unicode (no lone surrogate, UTF-8 where it arrives as bytes), integers that fit in a
signed 64-bit integer, finite numbers. A value that is not is a 400 naming its field, before any model
sees it: past the router they would fail in the msgpack codec or the job store, far from the field.
"""

from __future__ import annotations

import math
from urllib.parse import unquote_to_bytes

from router.core.errors import FieldError

INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1


def _name(path: str, key) -> str:
    """A field's dotted name (``tensors.0.shape``, as pydantic's errors spell it), printable whatever the key."""
    key = str(key).encode("utf-8", "backslashreplace").decode("utf-8")
    return f"{path}.{key}" if path else key


def _text_problem(s: str) -> str | None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: JSON's "\ud800", or bytes that were not UTF-8 (msgpack)
        return "must be Unicode text (a lone surrogate, or bytes that are not UTF-8, found)"
    return None


def check_values(data, root: str = "") -> None:
    """Every string, integer and float in ``data`` (a decoded body), at any depth, keys included. Iterative:
    a deeply nested body costs no Python stack."""
    stack = [(root, data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            problem = _text_problem(value)
            if problem:
                raise FieldError(path or "body", problem)
        elif isinstance(value, bool) or value is None or isinstance(value, (bytes, bytearray)):
            continue
        elif isinstance(value, int):
            if not INT_MIN <= value <= INT_MAX:
                raise FieldError(path or "body", f"integers must fit in a signed 64-bit integer, got {value}")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise FieldError(path or "body", f"numbers must be finite, got {value}")
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(key, str) and _text_problem(key):
                    raise FieldError(_name(path, key), "field names must be Unicode text")
                stack.append((_name(path, key), item))
        elif isinstance(value, (list, tuple)):
            stack.extend((_name(path, i), item) for i, item in enumerate(value))


def raw_text_problem(scope: dict) -> FieldError | None:
    """A query parameter or path whose percent-escapes are not UTF-8 (the server would have replaced them with
    U+FFFD silently): the 400 naming it, else None."""
    raw_path = scope.get("raw_path") or b""
    if not _utf8(unquote_to_bytes(raw_path)):
        return FieldError("path", "must be UTF-8 once percent-decoded")
    for pair in (scope.get("query_string") or b"").split(b"&"):
        name, _, value = pair.partition(b"=")
        name_bytes = unquote_to_bytes(name.replace(b"+", b" "))
        if not _utf8(name_bytes) or not _utf8(unquote_to_bytes(value.replace(b"+", b" "))):
            shown = name_bytes.decode("utf-8", "backslashreplace")
            return FieldError(shown or "query", "query parameters must be UTF-8 once percent-decoded")
    return None


def _utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
