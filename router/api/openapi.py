"""What ``/openapi.json`` (and so ``/docs``) says about each endpoint.

The POST handlers read their bodies themselves (size limit, msgpack, the
router's own 400s), so FastAPI cannot see a body parameter to document; the
body models are declared here instead, with their examples. The handlers
build their answers themselves too: :func:`ok` declares what a 200 holds
(router/api/answers.py), :func:`errors` the errors in the one error shape. What
depends on the running engine (its flags, its model) is merged into the
request bodies once, when the document is first built (:func:`engine_openapi`,
router/api/body_facts.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from fastapi import FastAPI
from pydantic import BaseModel

from common.protocol.messages import EXPERT_NAMES
from router.api.bodies import MSGPACK
from router.api.http_errors import ErrorBody

BINARY = {"type": "string", "format": "binary"}
# Any operation can answer these: a query or path that is not UTF-8 (400), an exception nothing else answered
# (500 internal_error); engine_openapi adds them where an endpoint's own list has not.
EVERYWHERE = (400, 500)


def inline_refs(schema: dict) -> dict:
    """``schema`` with every ``#/$defs/...`` reference replaced by its definition (no recursive models here)."""
    defs = schema.get("$defs", {})

    def resolve(node):
        if isinstance(node, list):
            return [resolve(v) for v in node]
        if not isinstance(node, dict):
            return node
        ref = node.get("$ref", "")
        if ref.startswith("#/$defs/"):
            rest = {k: v for k, v in node.items() if k != "$ref"}
            return resolve({**defs[ref.removeprefix("#/$defs/")], **rest})
        return {k: resolve(v) for k, v in node.items() if k != "$defs"}

    return resolve(schema)


def _schema(model: type[BaseModel]) -> dict:
    return inline_refs(model.model_json_schema())


def request_body(model: type[BaseModel], *alternatives: type[BaseModel], form: dict | None = None) -> dict:
    """``openapi_extra`` declaring ``model`` as the required body, in JSON or msgpack; ``alternatives``: other
    body forms the endpoint takes too (one of them, told apart by their required fields); ``form``: the
    endpoint takes multipart form fields as well, with these extra properties (files)."""
    schema = _schema(model)
    example = (schema.get("examples") or [None])[0]
    if alternatives:
        schema = {"oneOf": [schema, *map(_schema, alternatives)]}
    json_media = {"schema": schema}
    if example is not None:
        json_media["example"] = example  # what "Try it out" in /docs starts from
    content = {"application/json": json_media, MSGPACK: {"schema": schema}}
    if form is not None:
        form_schema = {**schema, "properties": {**schema["properties"], **form}}
        content["multipart/form-data"] = {"schema": form_schema}
    return {"requestBody": {"required": True, "content": content}}


def ok(model: type[BaseModel] | None = None, description: str = "", *, msgpack: bool = False,
       media: Iterable[str] = ()) -> dict:
    """The ``responses`` entry of a 200: ``model``'s JSON (and its msgpack form with ``msgpack``), and files
    or text of other ``media`` types."""
    entry: dict = {"description": description or (model.__doc__ or "").strip().split("\n")[0] or "OK"}
    content = {}
    if model is not None:
        entry["model"] = model
        if msgpack:
            content[MSGPACK] = {"schema": {"$ref": f"#/components/schemas/{model.__name__}"}}
    for media_type in media:
        content[media_type] = {"schema": {"type": "string"} if media_type.startswith("text/") else BINARY}
    if content:
        entry["content"] = content
    return {200: entry}


MODULE_QUERY = {"parameters": [{
    "name": "module", "in": "query", "required": False, "description": "the expert to checksum",
    "schema": {"type": "string", "enum": list(EXPERT_NAMES), "default": EXPERT_NAMES[0]},
}]}

VIDEO_ID_PATH = {"parameters": [{"name": "video_id", "in": "path", "required": True, "description": "the job's id",
                                 "schema": {"type": "string"}}]}
IMAGE_ID_PATH = {"parameters": [{"name": "image_id", "in": "path", "required": True,
                                 "description": "the image's id (img_...)", "schema": {"type": "string"}}]}
LIST_QUERY = {"parameters": [
    {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
    {"name": "limit", "in": "query", "required": False, "schema": {"type": "integer", "minimum": 1, "maximum": 100}},
    {"name": "order", "in": "query", "required": False, "schema": {"type": "string", "enum": ["asc", "desc"]}},
]}


def errors(*statuses: int) -> dict:
    """``responses`` entries for the errors an endpoint can answer, all in the one error shape."""
    return {status: {"model": ErrorBody, "description": ERROR_DESCRIPTIONS[status]} for status in statuses}


ERROR_DESCRIPTIONS = {
    400: "invalid_request: a field is invalid (error.field names it)",
    401: "unauthorized: missing or wrong API key",
    403: "forbidden: needs the admin key, or weight updates are disabled",
    404: "not_found: no such video job or image (unknown, deleted or expired), or no such request in flight",
    409: "not_ready: the video job has not finished; weights_changed: a rollout run again after "
         "a worker died would have run on other weights or another adapter version; request_id_in_use: the "
         "X-Request-Id is in flight already",
    413: "body_too_large: the body exceeds --max-body-bytes",
    429: "overloaded: too many requests in flight (Retry-After); too_many_jobs: --max-jobs video jobs held",
    499: "cancelled: POST /abort_request cancelled the request (a rollout with return_partial answers 200 with "
         "the steps done instead)",
    500: "a worker failed the request (error.stage names it), or workers now disagree; storage_error: a stored "
         "file could not be read; internal_error: the router failed (its log has the traceback under the "
         "request id)",
    503: "shutting_down, unavailable (no ready worker), sleeping (its weights are released) or worker_lost "
         "(after --max-attempts runs)",
    504: "timeout: no answer in time",
}


def _kind(schema: dict) -> str | None:
    return schema.get("type") or ("object" if "properties" in schema else None)


PY_TYPES = {"integer": int, "number": (int, float), "string": str, "boolean": bool}
KEYWORD_KINDS = {"minimum": "integer number", "maximum": "integer number", "multipleOf": "integer number",
                 "maxLength": "string", "pattern": "string", "maxItems": "array", "items": "array",
                 "properties": "object"}


def _fits(schema: dict, keywords: dict) -> bool:
    """Whether ``keywords`` apply to ``schema``'s kind of value (numbers' bounds to numbers, ...)."""
    kind = _kind(schema)
    if kind in (None, "null"):
        return False
    if "enum" in keywords and not all(isinstance(v, PY_TYPES.get(kind, object)) for v in keywords["enum"]):
        return False
    return all(kind in KEYWORD_KINDS.get(k, kind).split() for k in keywords if k != "enum")


def constrain(schema: dict, keywords: dict) -> dict:
    """``schema`` (a property's) with ``keywords`` merged into its non-null forms; ``{"type": "null"}``
    replaces it (a field the engine refuses whatever its value)."""
    if keywords == {"type": "null"}:
        return {k: v for k, v in schema.items() if k in ("title", "description")} | {"type": "null"}
    if "anyOf" in schema:
        return {**schema, "anyOf": [constrain(b, keywords) if _fits(b, keywords) else b for b in schema["anyOf"]]}
    out = dict(schema)
    for key, value in keywords.items():
        if key == "properties":
            props = dict(out.get("properties", {}))
            for name, kw in value.items():
                if name in props:
                    props[name] = constrain(props[name], kw)
            out["properties"] = props
        elif key == "items":
            out["items"] = constrain(out.get("items", {}), value) if "type" in out.get("items", {}) else value
        else:
            out[key] = value
    return out


def _merge_facts(node, facts: dict[str, dict]):
    """Every body schema in ``node`` (by its ``title``) given its facts, at any depth."""
    if isinstance(node, list):
        return [_merge_facts(v, facts) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _merge_facts(v, facts) for k, v in node.items()}
    fact = facts.get(node.get("title")) if "properties" in node else None
    if fact:
        node = constrain(node, {"properties": fact.get("properties", {})})
        if "added" in fact:  # the served family's own fields: the body takes these and no other extra one
            node["properties"] = {**node["properties"], **fact["added"]}
            node["additionalProperties"] = False
        if "required" in fact:
            node["required"] = fact["required"]
    return node


def engine_openapi(app: FastAPI, facts: dict[str, dict]) -> Callable[[], dict]:
    """A replacement for ``app.openapi``: FastAPI's document, built once, with this engine's ``facts``
    (router/api/body_facts.py) merged into the request bodies and :data:`EVERYWHERE`'s errors on every operation."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = build()
            for operations in doc["paths"].values():
                for op in operations.values():
                    if "requestBody" in op:
                        op["requestBody"] = _merge_facts(op["requestBody"], facts)
                    for status in EVERYWHERE:
                        op["responses"].setdefault(str(status), {
                            "description": ERROR_DESCRIPTIONS[status],
                            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}})
            app.openapi_schema = doc
        return app.openapi_schema

    return openapi
