"""What ``/openapi.json`` (and so ``/docs``) says about each endpoint.

The POST handlers read their bodies themselves (size limit, msgpack, the
router's own 400s), so FastAPI cannot see a body parameter to document; the
body models are declared here instead, with their examples.
"""

from __future__ import annotations

from pydantic import BaseModel

from common.protocol.messages import EXPERT_NAMES
from router.bodies import MSGPACK
from router.http_errors import ErrorBody


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


def request_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` declaring ``model`` as the required body, in JSON or msgpack."""
    schema = inline_refs(model.model_json_schema())
    json_media = {"schema": schema}
    if schema.get("examples"):
        json_media["example"] = schema["examples"][0]  # what "Try it out" in /docs starts from
    return {"requestBody": {"required": True, "content": {"application/json": json_media, MSGPACK: {"schema": schema}}}}


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
    409: "job_running / not_ready: the video job has not finished; weights_changed: a rollout run again after "
         "a worker died would have run on other weights or another adapter version; request_id_in_use: the "
         "X-Request-Id is in flight already",
    413: "body_too_large: the body exceeds --max-body-bytes",
    429: "overloaded: too many requests in flight (Retry-After); too_many_jobs: --max-jobs video jobs held",
    500: "a worker failed the request (error.stage names it), or workers now disagree; storage_error: a stored "
         "file could not be read",
    503: "shutting_down, unavailable (no ready worker) or worker_lost (after --max-attempts runs)",
    504: "timeout: no answer in time",
}
