"""The error every request check raises: the field it refuses, and why."""

from __future__ import annotations


class FieldError(ValueError):
    """A request field is invalid; ``field`` names it in the HTTP error, ``message`` says why."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message
