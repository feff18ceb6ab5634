"""The request fields a family declares beyond those every family takes.

A binding lists its own (:attr:`Binding.request_fields`); the conversion of a request into
:class:`~common.protocol.messages.GenerationParams` (common/diffusion/params.py), the HTTP bodies and their
schema (router/), and a trainer's params all take them from there. A declared field whose name is one of
``GenerationParams``' own (``num_frames``, ``max_sequence_length``) travels there; every other travels in
``GenerationParams.fields`` and is read with :func:`field_value`. Declarations several families share are
written once, here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from common.diffusion.model_facts import ModelFacts

FROM_MODEL = "from the model directory"  # a default: the directory's serving default (ModelInfo.defaults)
JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string"}


@dataclass(frozen=True)
class RequestField:
    """One optional request field: its type, its default (None: absent unless given; :data:`FROM_MODEL`), its
    bounds, what it means (the schema's description), and the checks beyond its bounds: ``model_check`` (why
    this model directory takes no value, else None) and ``resolve`` (the value in effect, from the value given
    or defaulted and the request's other fields; it raises ``ValueError`` for a value refused)."""

    name: str
    type: type
    doc: str
    default: object = None
    minimum: float | None = None
    maximum: float | None = None
    model_check: Callable[["ModelFacts"], str | None] | None = None
    resolve: Callable[[object, dict], object] | None = None
    aliases: tuple[str, ...] = ()  # what other engines' APIs call it (router/peers/: e.g. "fps" for a frame rate)
    # Taken with an image only (a setting of the image's conditioning, on a model where the image is optional).
    needs_image: bool = False

    def problem(self, value) -> str | None:
        """Why ``value`` is not of this field's type and bounds (None: it is)."""
        numeric = self.type in (int, float)
        ok = isinstance(value, (int, float) if self.type is float else self.type) and not isinstance(value, bool)
        if self.type is bool:
            ok = isinstance(value, bool)
        if not ok:
            return f"must be {'a ' if numeric else ''}{JSON_TYPES[self.type]}, got {value!r}"
        if numeric and not math.isfinite(value):
            return f"must be finite, got {value}"
        if numeric and ((self.minimum is not None and value < self.minimum)
                        or (self.maximum is not None and value > self.maximum)):
            return f"must be within [{self.minimum:g}, {self.maximum:g}], got {value}"
        return None

    def json_schema(self) -> dict:
        """The field as an optional JSON-schema property (null: left out)."""
        kind = {"type": JSON_TYPES[self.type]}
        if self.minimum is not None:
            kind["minimum"] = self.minimum
        if self.maximum is not None:
            kind["maximum"] = self.maximum
        return {"anyOf": [kind, {"type": "null"}], "default": None, "title": self.name.replace("_", " ").title(),
                "description": self.doc}


def declared(fields, name: str) -> "RequestField | None":
    """The field of ``fields`` (a binding's request fields) named ``name``, or that another engine's API calls so
    (its ``aliases``); None where the family has none."""
    return next((f for f in fields if f.name == name or name in f.aliases), None)


def field_value(params, name: str):
    """A request's value of field ``name`` (a family's, or one every family has); None where it has none."""
    if name in params.fields:
        return params.fields[name]
    return getattr(params, name, None)


# --- declarations several families share ---------------------------------------------------------------------

NUM_FRAMES = RequestField("num_frames", int, doc="video families: 4k+1 frames (LTX-2: 8k+1; image families: 1)")


def max_sequence_length(maximum: int = 512) -> RequestField:
    """The text encoder's token budget, at most ``maximum`` (its pipeline's ``check_inputs``)."""
    return RequestField("max_sequence_length", int, "the text encoder's token budget (as the family's diffusers "
                        "pipeline)", minimum=1, maximum=maximum)


def _true_cfg(value, request: dict):
    """The pipelines run true CFG only with a negative prompt: 1 without one, where a scale above 1 is refused
    rather than ignored."""
    if request.get("negative_prompt") is not None:
        return float(value)
    if request.get("true_cfg_scale") is not None and request["true_cfg_scale"] > 1.0:
        raise ValueError("runs true classifier-free guidance only with a negative_prompt; give one (it may be \" \")")
    return 1.0


TRUE_CFG_SCALE = RequestField("true_cfg_scale", float, "classifier-free guidance with negative_prompt (this "
                              "family's guidance_scale is the embedded guidance)", default=FROM_MODEL,
                              minimum=0.0, maximum=100.0, resolve=_true_cfg)
