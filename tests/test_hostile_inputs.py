"""Hostile inputs to the endpoints beyond /generate: adapter names and paths, OpenAI fields, video job ids,
weight buckets and groups. Each is refused with its 4xx in the one error shape (a 400 names the field), no
worker is lost, and the engine then answers a reference request exactly as before any of them.

The /generate corpus is in tests/test_http_api.py; hostile wire messages in tests/test_worker_robustness.py.
"""

from __future__ import annotations

import json

import msgpack
import pytest
import torch

from router.client import EngineClient

REFERENCE = {"prompt": "a fox at dawn", "seed": 5, "num_inference_steps": 3, "output_type": "latent"}
TENSOR = {"name": "proj_out.weight", "dtype": "float32", "shape": [4], "bucket": 0, "offset": 0}
BUCKET = {"nbytes": 16, "segment": "disagg-0123abcd-weights-" + "0" * 32}


def _weights(**over) -> dict:
    body = {"tensors": [TENSOR], "buckets": [BUCKET]}
    for key, value in over.items():
        body[key] = value
    return body


LORA = "/v1/load_lora_adapter"
BLOB = {"dtype": "float32", "shape": [4], "data": "AAAAAAAAAAAAAAAAAAAAAA=="}
LORA_TENSORS = {"lora_name": "mem", "tensors": [{"name": "a", "shape": [4]}], "blob": BLOB, "rank": 4}
IMAGES = "/v1/images/generations"
VIDEOS = "/v1/videos"
TENSORS = "/update_weights_from_tensors"
# name: (method, path, JSON body or None, status, the field a 400 names)
CASES = {
    # adapter names and paths
    "lora-name-traversal": ("POST", LORA, {"lora_name": "../x", "lora_path": "/tmp/a"}, 400, "lora_name"),
    "lora-name-slash": ("POST", LORA, {"lora_name": "a/b", "lora_path": "/tmp/a"}, 400, "lora_name"),
    "lora-name-empty": ("POST", LORA, {"lora_name": "", "lora_path": "/tmp/a"}, 400, "lora_name"),
    "lora-name-long": ("POST", LORA, {"lora_name": "x" * 1000, "lora_path": "/tmp/a"}, 400, "lora_name"),
    "lora-name-control": ("POST", LORA, {"lora_name": "a\nb", "lora_path": "/tmp/a"}, 400, "lora_name"),
    "lora-name-int": ("POST", LORA, {"lora_name": 5, "lora_path": "/tmp/a"}, 400, "lora_name"),
    "lora-path-missing": ("POST", LORA, {"lora_name": "ok"}, 400, "lora_path"),
    "lora-path-empty": ("POST", LORA, {"lora_name": "ok", "lora_path": ""}, 400, "lora_path"),
    "lora-path-long": ("POST", LORA, {"lora_name": "ok", "lora_path": "/" + "x" * 5000}, 400, "lora_path"),
    "lora-path-outside-roots": ("POST", LORA, {"lora_name": "ok", "lora_path": "/etc/passwd"}, 400, "lora_path"),
    "lora-path-traversal": ("POST", LORA, {"lora_name": "ok", "lora_path": "ROOT/../../etc"}, 400, "lora_path"),
    "lora-path-nul": ("POST", LORA, {"lora_name": "ok", "lora_path": "ROOT/a\u0000b"}, 400, "lora_path"),
    "lora-expert-flag": ("POST", LORA, {"lora_name": "ok", "lora_path": "ROOT", "load_into_transformer_2": "yes"},
                         400, "load_into_transformer_2"),
    "unload-bad-name": ("POST", "/v1/unload_lora_adapter", {"lora_name": "../x"}, 400, "lora_name"),
    "generate-unloaded-adapter": ("POST", "/generate", {"prompt": "x", "lora_name": "never-loaded"}, 400,
                                  "lora_name"),
    "generate-adapter-scale": ("POST", "/generate", {"prompt": "x", "lora_scale": 1e9}, 400, "lora_scale"),
    # OpenAI fields
    "images-size-words": ("POST", IMAGES, {"prompt": "x", "size": "big"}, 400, "size"),
    "images-size-huge": ("POST", IMAGES, {"prompt": "x", "size": "100000x100000"}, 400, "size"),
    "images-size-negative": ("POST", IMAGES, {"prompt": "x", "size": "32x-32"}, 400, "size"),
    "images-n-0": ("POST", IMAGES, {"prompt": "x", "n": 0}, 400, "n"),
    "images-n-huge": ("POST", IMAGES, {"prompt": "x", "n": 10**9}, 400, "n"),
    "images-url-format": ("POST", IMAGES, {"prompt": "x", "response_format": "url"}, 400, "response_format"),
    "images-other-model": ("POST", IMAGES, {"prompt": "x", "model": "gpt-image-1"}, 400, "model"),
    "images-no-prompt": ("POST", IMAGES, {"size": "32x32"}, 400, "prompt"),
    "images-seed-negative": ("POST", IMAGES, {"prompt": "x", "seed": -1}, 400, "seed"),
    "videos-seconds-negative": ("POST", VIDEOS, {"prompt": "x", "seconds": "-1"}, 400, "seconds"),
    "videos-seconds-words": ("POST", VIDEOS, {"prompt": "x", "seconds": "four"}, 400, "seconds"),
    "videos-seconds-huge": ("POST", VIDEOS, {"prompt": "x", "seconds": "1e9"}, 400, "seconds"),
    "videos-size-odd": ("POST", VIDEOS, {"prompt": "x", "size": "12x12"}, 400, "size"),
    "videos-frames-6": ("POST", VIDEOS, {"prompt": "x", "num_frames": 6}, 400, "num_frames"),
    "videos-timeout-0": ("POST", VIDEOS, {"prompt": "x", "timeout_s": 0}, 400, "timeout_s"),
    # video job ids
    "job-id-traversal": ("GET", VIDEOS + "/..%2F..%2Fetc%2Fpasswd", None, 404, None),
    "job-id-long": ("GET", VIDEOS + "/" + "a" * 5000, None, 404, None),
    "job-id-nul": ("GET", VIDEOS + "/%00", None, 404, None),
    "job-id-unicode": ("GET", VIDEOS + "/%E2%80%AEvideo", None, 404, None),
    "job-delete-unknown": ("DELETE", VIDEOS + "/video_unknown", None, 404, None),
    "job-content-unknown": ("GET", VIDEOS + "/video_unknown/content", None, 404, None),
    "jobs-limit-negative": ("GET", VIDEOS + "?limit=-1", None, 400, "limit"),
    "jobs-limit-words": ("GET", VIDEOS + "?limit=many", None, 400, "limit"),
    "jobs-order": ("GET", VIDEOS + "?order=sideways", None, 400, "order"),
    # weight buckets and groups
    "bucket-segment-traversal": ("POST", TENSORS, _weights(buckets=[{"nbytes": 16, "segment": "../../etc"}]), 400,
                                 "buckets.0.segment"),
    "bucket-nbytes-negative": ("POST", TENSORS, _weights(buckets=[{**BUCKET, "nbytes": -1}]), 400,
                               "buckets.0.nbytes"),
    "bucket-index-out-of-range": ("POST", TENSORS, _weights(tensors=[{**TENSOR, "bucket": 7}]), 400,
                                  "tensors.0.bucket"),
    "bucket-offset-past-end": ("POST", TENSORS, _weights(tensors=[{**TENSOR, "offset": 1 << 40}]), 400,
                               "tensors.0.offset"),
    "bucket-dtype": ("POST", TENSORS, _weights(tensors=[{**TENSOR, "dtype": "float128"}]), 400, "tensors.0.dtype"),
    "bucket-shape-negative": ("POST", TENSORS, _weights(tensors=[{**TENSOR, "shape": [-4]}]), 400,
                              "tensors.0.shape.0"),
    "bucket-no-tensors": ("POST", TENSORS, _weights(tensors=[]), 400, "tensors"),
    "bucket-module": ("POST", TENSORS, _weights(module="vae"), 400, "module"),
    "bucket-segment-foreign": ("POST", TENSORS, _weights(), 400, None),
    "group-port-0": ("POST", "/init_weights_group", {"master_address": "127.0.0.1", "master_port": 0}, 400,
                     "master_port"),
    "group-backend": ("POST", "/init_weights_group", {"master_address": "127.0.0.1", "master_port": 29500,
                                                      "backend": "mpi"}, 400, "backend"),
    "disk-path-outside-roots": ("POST", "/update_weights_from_disk", {"path": "/etc"}, 400, "path"),
    # text that is not Unicode: a lone surrogate, in every generation endpoint, in values and in names
    **{f"surrogate-prompt-{path}": ("POST", path, {"prompt": "a fox \ud800"}, 400, "prompt")
       for path in ("/generate", "/rollout/generate", IMAGES, VIDEOS)},
    "surrogate-negative-prompt": ("POST", "/generate", {"prompt": "x", "negative_prompt": "\udfff"}, 400,
                                  "negative_prompt"),
    "surrogate-field-name": ("POST", "/generate", {"prompt": "x", "\ud800": 1}, 400, "\\ud800"),
    "surrogate-lora-name": ("POST", LORA, {"lora_name": "\ud800", "lora_path": "/tmp/a"}, 400, "lora_name"),
    "surrogate-nested": ("POST", TENSORS, _weights(tensors=[{**TENSOR, "name": "a\udc80"}]), 400, "tensors.0.name"),
    # integers past 64 bits anywhere; the adapter from memory as JSON (its tensors' shapes, rank, blob)
    "bigint-lora-rank": ("POST", LORA, {**LORA_TENSORS, "rank": 99999999999999999999}, 400, "rank"),
    "bigint-lora-shape": ("POST", LORA, {**LORA_TENSORS, "tensors": [{"name": "a", "shape": [10**20]}]}, 400,
                          "tensors.0.shape.0"),
    "bigint-lora-blob-shape": ("POST", LORA, {**LORA_TENSORS, "blob": {**BLOB, "shape": [-(10**20)]}}, 400,
                               "blob.shape.0"),
    "lora-blob-data-int": ("POST", LORA, {**LORA_TENSORS, "blob": {**BLOB, "data": 10**12}}, 400, "blob.data"),
    "lora-rank-over-64": ("POST", LORA, {**LORA_TENSORS, "rank": 1 << 40}, 400, "rank"),
    "bigint-bucket-offset": ("POST", TENSORS, _weights(tensors=[{**TENSOR, "offset": 1 << 70}]), 400,
                             "tensors.0.offset"),
    "bigint-bucket-nbytes": ("POST", TENSORS, _weights(buckets=[{**BUCKET, "nbytes": 1 << 64}]), 400,
                             "buckets.0.nbytes"),
    "bigint-seed": ("POST", "/generate", {"prompt": "x", "seed": 1 << 64}, 400, "seed"),
    "bigint-steps": ("POST", IMAGES, {"prompt": "x", "num_inference_steps": -(1 << 80)}, 400, "num_inference_steps"),
    "bigint-group-port": ("POST", "/init_weights_group", {"master_address": "127.0.0.1", "master_port": 1 << 65}, 400,
                          "master_port"),
    "number-huge": ("POST", "/generate", {"prompt": "x", "guidance_scale": 1e400}, 400, "guidance_scale"),
}


@pytest.fixture(scope="module")
def engine(engine_factory, lora_root):
    return engine_factory("tiny", extra=["--weight-root", str(lora_root), "--weight-sync-from-memory"])


@pytest.fixture(scope="module")
def before(engine):
    rows = engine.http.get("/health").json()["workers"]
    return EngineClient(engine.url).generate(**REFERENCE)["samples"][0]["output"], [w["pid"] for w in rows]


def _send(engine, method, path, body, root):
    """``body`` as JSON text (escapes such as a lone surrogate's kept as written), ``ROOT`` replaced."""
    if body is None:
        return engine.http.request(method, path)
    return engine.http.request(method, path, content=json.dumps(body).replace("ROOT", str(root)),
                               headers={"content-type": "application/json"})


@pytest.mark.parametrize("case", list(CASES))
def test_a_hostile_input_is_refused_in_the_error_shape(engine, before, lora_root, case):
    method, path, body, status, field = CASES[case]
    r = _send(engine, method, path, body, lora_root)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"type", "message", "request_id", "stage"}
    if status == 400 and field is not None:
        assert err.get("field") == field, err


def test_the_engine_serves_as_before_after_the_hostile_inputs(engine, before):
    for case in CASES:  # all of them again, back to back
        method, path, body, status, _ = CASES[case]
        _send(engine, method, path, body, "/nonexistent")
    for case in RAW:
        test_text_that_is_not_unicode_is_refused_wherever_it_comes(engine, case)
    output, pids = before
    rows = engine.http.get("/health")
    assert rows.status_code == 200 and [w["pid"] for w in rows.json()["workers"]] == pids  # no worker lost
    again = EngineClient(engine.url).generate(**REFERENCE)["samples"][0]["output"]
    assert torch.equal(again, output)


def _multipart(fields: dict[str, bytes]) -> tuple[bytes, str]:
    boundary = "fuzzboundary"
    parts = [f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n'.encode() + v + b"\r\n"
             for k, v in fields.items()]
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


# Text that is not Unicode arriving as bytes: msgpack strings, form fields, query and path escapes, headers.
MSGPACK = {"content-type": "application/msgpack"}
FORM, FORM_TYPE = _multipart({"prompt": b"a fox \xed\xa0\x80", "seconds": b"1"})
RAW = {
    "msgpack-prompt": ("POST", "/generate", {"content": msgpack.packb({"prompt": b"a \xff fox"}, use_bin_type=False),
                                             "headers": MSGPACK}, "prompt"),
    "msgpack-lora-rank": ("POST", LORA, {"content": msgpack.packb({**LORA_TENSORS, "rank": 1 << 63}),
                                         "headers": MSGPACK}, "rank"),
    "form-prompt": ("POST", VIDEOS, {"content": FORM, "headers": {"content-type": FORM_TYPE}}, "prompt"),
    "query-after": ("GET", VIDEOS + "?after=%ED%A0%80", {}, "after"),
    "path-job-id": ("GET", VIDEOS + "/video_%FF", {}, "path"),
    "header-request-id": ("POST", "/generate", {"json": {"prompt": "x"}, "headers": {"X-Request-Id": b"\xff"}},
                          "X-Request-Id"),
}


@pytest.mark.parametrize("case", list(RAW))
def test_text_that_is_not_unicode_is_refused_wherever_it_comes(engine, case):
    method, path, kwargs, field = RAW[case]
    r = engine.http.request(method, path, **kwargs)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field
