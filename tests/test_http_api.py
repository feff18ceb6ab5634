"""The router's HTTP API on a running engine: health, validation, error reporting, response shape, shutdown."""

import base64
import json
import math
import time
from pathlib import Path

import pytest

from common.diffusion.params import ROLLOUT, WINDOW
from common.diffusion.model_info import ModelInfo
from common.families import read_model
from conftest import pid_alive

# The shared engine keeps every limit at its default.
DEFAULT_LIMITS = dict(max_height=2048, max_width=2048, max_num_frames=129, max_steps=1000, max_n=32,
                      max_prompt_chars=4096)


@pytest.fixture(scope="module")
def engine(shared_engine):
    return shared_engine("tiny")


@pytest.fixture(scope="module")
def launched(shared_engine):
    return shared_engine("tiny", launched=True)  # the default suite's launched topology: its workers' processes


def _ppid(pid: int) -> int:
    # /proc/<pid>/stat: "pid (comm) state ppid ..."; comm may hold spaces, so split after the last ')'
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2:].split()[1])


def _post(engine, body, **kw):
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return engine.http.post("/generate", content=content, headers={"content-type": "application/json"}, **kw)


def test_health_lists_live_ready_workers(launched):
    engine = launched
    r = engine.http.get("/health")
    assert r.status_code == 200
    body = r.json()
    assert body["ok"] is True
    rows = body["workers"]
    assert [(w["role"], w["index"]) for w in rows] == [("encoder", 0), ("denoise", 0), ("decode", 0)]
    pids = [w["pid"] for w in rows]
    assert len(set(pids)) == 3 and engine.proc.pid not in pids  # three processes, none of them the router
    for w in rows:
        assert w["device"] == "cpu"
        assert isinstance(w["pid"], int) and pid_alive(w["pid"])
        assert _ppid(w["pid"]) == engine.proc.pid  # children of the launcher
        assert w["endpoint"] == f"ipc://{engine.runtime / (w['role'] + '-0.sock')}"
        assert Path(w["endpoint"][len("ipc://"):]).exists()
        assert w["socket_type"] == "PULL"
        assert w["state"] == "ready"
        assert 0 <= w["seconds_since_heartbeat"] < 5


def _text(**fields):
    return json.dumps({"prompt": "a fox", **fields})


BAD_BODIES = [
    ("height-not-multiple", _text(height=40), "height"),
    ("height-above-max", _text(height=DEFAULT_LIMITS["max_height"] + 16), "height"),
    ("height-negative", _text(height=-16), "height"),
    ("width-zero", _text(width=0), "width"),
    ("width-above-max", _text(width=DEFAULT_LIMITS["max_width"] + 16), "width"),
    ("frames-6", _text(num_frames=6), "num_frames"),
    ("frames-0", _text(num_frames=0), "num_frames"),
    ("frames-above-max", _text(num_frames=DEFAULT_LIMITS["max_num_frames"] + 4), "num_frames"),
    ("steps-0", _text(num_inference_steps=0), "num_inference_steps"),
    ("steps-1001", _text(num_inference_steps=DEFAULT_LIMITS["max_steps"] + 1), "num_inference_steps"),
    ("guidance-nan", '{"prompt": "a fox", "guidance_scale": NaN}', "guidance_scale"),
    ("guidance-inf", '{"prompt": "a fox", "guidance_scale": Infinity}', "guidance_scale"),
    ("guidance-neg-inf", '{"prompt": "a fox", "guidance_scale": -Infinity}', "guidance_scale"),
    ("guidance-negative", _text(guidance_scale=-1.0), "guidance_scale"),
    ("seed-negative", _text(seed=-1), "seed"),
    ("seed-too-big", _text(seed=2**63), "seed"),
    ("n-0", _text(n=0), "n"),
    ("n-above-max", _text(n=DEFAULT_LIMITS["max_n"] + 1), "n"),
    ("sigmas-empty", _text(sigmas=[]), "sigmas"),
    ("sigmas-1.5", _text(sigmas=[1.5, 0.5]), "sigmas.0"),
    ("sigmas-negative", _text(sigmas=[0.5, -0.1]), "sigmas.1"),
    ("sigmas-nan", '{"prompt": "a fox", "sigmas": [1.0, NaN]}', "sigmas.1"),
    ("sigmas-too-many", _text(sigmas=[0.5] * (DEFAULT_LIMITS["max_steps"] + 1)), "sigmas"),
    ("timesteps-above-1000", _text(timesteps=[1000.5, 500.0]), "timesteps"),
    ("timesteps-empty", _text(timesteps=[]), "timesteps"),
    ("mu-nan", '{"prompt": "a fox", "mu": NaN}', "mu"),
    ("mu-huge", _text(mu=1e6), "mu"),
    ("unknown-field", _text(num_steps=4), "num_steps"),
    ("missing-prompt", json.dumps({"seed": 1}), "prompt"),
    ("prompt-int", json.dumps({"prompt": 5}), "prompt"),
    ("prompt-null", json.dumps({"prompt": None}), "prompt"),
    ("height-string", _text(height="32"), "height"),
    ("height-float", _text(height=32.5), "height"),
    ("height-bool", _text(height=True), "height"),
    ("seed-float", _text(seed=1.0), "seed"),
    ("sigmas-not-list", _text(sigmas=0.5), "sigmas"),
    ("output-type", _text(output_type="gif"), "output_type"),
    ("body-list", json.dumps([{"prompt": "a fox"}]), "body"),
    ("body-string", json.dumps("a fox"), "body"),
    ("body-empty", "", "body"),
    ("invalid-json", '{"prompt": "a fox",', "body"),
    ("prompt-too-long", _text(prompt="x" * (DEFAULT_LIMITS["max_prompt_chars"] + 1)), "prompt"),
    ("negative-prompt-too-long", _text(negative_prompt="x" * (DEFAULT_LIMITS["max_prompt_chars"] + 1)),
     "negative_prompt"),
]


@pytest.mark.parametrize("text, field", [b[1:] for b in BAD_BODIES], ids=[b[0] for b in BAD_BODIES])
def test_invalid_requests_are_rejected_by_the_router(engine, text, field):
    r = _post(engine, text)
    assert r.status_code == 400, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert err["type"] == "invalid_request"
    assert err["field"] == field
    assert err["stage"] == "router"
    assert isinstance(err["message"], str) and err["message"].startswith(f"{field}:")


def test_prompt_at_the_limit_is_accepted(engine):
    r = _post(engine, {"prompt": "x" * DEFAULT_LIMITS["max_prompt_chars"], "output_type": "latent",
                       "num_inference_steps": 1})
    assert r.status_code == 200, r.text


def test_engine_serves_after_invalid_requests(engine):
    for _, text, _ in BAD_BODIES:
        assert _post(engine, text).status_code == 400
    r = _post(engine, {"prompt": "a fox", "seed": 3})
    assert r.status_code == 200, r.text
    assert r.json()["samples"][0]["output"]["shape"] == [5, 32, 32, 3]
    # Nothing was left in flight by the rejected requests.
    assert all(w["outstanding"] == 0 for w in engine.http.get("/health").json()["workers"])


def test_worker_failure_names_the_stage_and_engine_keeps_serving(engine, tiny_dir):
    # The router checks sizes against its limits only. The tiny transformer has few rotary positions
    # per axis (64: 1024 px at patch 2 x VAE stride 8), so one patch row more is a size the router
    # accepts and only the denoise worker can refuse (the transformer raises).
    info = read_model(tiny_dir)
    rope = json.loads((tiny_dir / "transformer" / "config.json").read_text())["rope_max_seq_len"]
    height = (rope + 1) * info.patch_size[1] * info.vae_scale_spatial
    assert height <= DEFAULT_LIMITS["max_height"]
    r = _post(engine, {"prompt": "a fox", "height": height, "width": 16, "num_inference_steps": 1})
    assert r.status_code == 500, r.text
    err = r.json()["error"]
    assert err["stage"] == "denoise"
    assert err["type"] == "RuntimeError"
    assert err["message"]
    assert isinstance(err["request_id"], str) and len(err["request_id"]) == 32
    health = engine.http.get("/health")
    assert health.status_code == 200
    assert all(w["outstanding"] == 0 and w["state"] == "ready" for w in health.json()["workers"])
    ok = _post(engine, {"prompt": "a fox", "seed": 4, "output_type": "latent"})
    assert ok.status_code == 200, ok.text
    assert ok.json()["samples"][0]["output"]["shape"] == [16, 2, 4, 4]


def _tensor(obj):
    raw = base64.b64decode(obj["data"])
    assert obj["dtype"] == "float32"
    assert len(raw) == 4 * math.prod(obj["shape"])
    return raw


def test_response_structure(engine):
    r = _post(engine, {"prompt": "a fox at dawn", "seed": 12})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/json")
    body = r.json()
    assert isinstance(body["request_id"], str) and len(body["request_id"]) == 32
    int(body["request_id"], 16)
    assert len(body["samples"]) == 1
    s = body["samples"][0]
    assert s["seed"] == 12
    assert s["route"] == {"encoder": 0, "denoise": 0, "decode": 0}
    assert s["output"]["shape"] == [5, 32, 32, 3]
    _tensor(s["output"])
    t = body["timings"]
    assert set(t) == {"encode_s", "denoise_s", "decode_s", "total_s"}
    assert all(isinstance(v, float) and v >= 0 for v in t.values())
    assert t["encode_s"] > 0 and t["denoise_s"] > 0 and t["decode_s"] > 0
    # One sample runs the stages one after another inside the router's wall time.
    assert t["total_s"] >= t["encode_s"] + t["denoise_s"] + t["decode_s"]
    # Each worker's peak while it held the request (CPU: its resident set, the model and interpreter included).
    peaks = body["peak_memory"]
    assert set(peaks) == {"encoder", "denoise", "decode"}
    assert all(isinstance(v, int) and 10 << 20 < v < 64 << 30 for v in peaks.values()), peaks


def test_latent_response_skips_decode(engine):
    body = _post(engine, {"prompt": "a fox at dawn", "seed": 12, "output_type": "latent"}).json()
    s = body["samples"][0]
    assert s["output"]["shape"] == [16, 2, 4, 4]
    _tensor(s["output"])
    assert body["timings"]["decode_s"] == 0.0 and body["timings"]["denoise_s"] > 0
    assert body["peak_memory"]["decode"] is None and body["peak_memory"]["denoise"] > 0


def test_n_samples_get_their_own_seeds_and_request_ids(engine):
    body = _post(engine, {"prompt": "a fox", "seed": 7, "n": 3, "output_type": "latent"}).json()
    assert [s["seed"] for s in body["samples"]] == [7, 8, 9]
    outs = [base64.b64decode(s["output"]["data"]) for s in body["samples"]]
    assert len(set(outs)) == 3
    assert len(body["request_id"]) == 32


@pytest.mark.parametrize("method, path, status, type_, allow", [
    ("GET", "/unknown", 404, "not_found", None),
    ("POST", "/rollout/unknown", 404, "not_found", None),
    ("GET", "/generate", 405, "method_not_allowed", "POST"),
    ("PUT", "/update_weights_from_disk", 405, "method_not_allowed", "POST"),
    ("POST", "/health", 405, "method_not_allowed", "GET"),
])
def test_unknown_paths_and_methods_answer_in_the_error_shape(engine, method, path, status, type_, allow):
    r = engine.http.request(method, path)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    assert r.headers.get("allow") == allow
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"type", "message", "request_id", "stage"}
    assert (err["type"], err["stage"], err["request_id"]) == (type_, "router", None)
    assert path in err["message"]


BODY_MODELS = {
    "/generate": {"prompt", "negative_prompt", "height", "width", "num_frames", "num_inference_steps", "guidance_scale",
                  "guidance_scale_2", "seed", "n", "sigmas", "timesteps", "mu", "output_type", "timeout_s",
                  "lora_name", "lora_scale", "max_sequence_length", "image", "last_image", "cache", "seeds", "stream",
                  "output_dtype", "sigmas_as_given"},  # tiny: Wan's
    "/update_weights_from_disk": {"path", "module", "checksum"},
    "/update_weights_from_tensors": {"module", "checksum", "tensors", "buckets", "lora"},
    "/update_weights_from_distributed": {"module", "checksum", "tensors", "buckets", "lora"},
    "/init_weights_group": {"master_address", "master_port", "backend", "timeout_s"},
    "/v1/load_lora_adapter": {"lora_name", "lora_path", "load_into_transformer_2"},
    "/v1/unload_lora_adapter": {"lora_name"},
    "/release_memory_occupation": {"tags", "level", "mode"},
    "/resume_memory_occupation": {"tags", "reload"},
}
BODY_MODELS["/rollout/generate"] = BODY_MODELS["/generate"] | {*ROLLOUT, *WINDOW, "return_partial", "initial_latents"}


@pytest.fixture(scope="module")
def openapi(engine):
    r = engine.http.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


@pytest.mark.parametrize("path", sorted(BODY_MODELS))
def test_openapi_declares_each_request_body(openapi, path):
    op = openapi["paths"][path]["post"]
    body = op["requestBody"]
    assert body["required"] is True
    assert set(body["content"]) == {"application/json", "application/msgpack"}
    schema = body["content"]["application/json"]["schema"]
    assert "$ref" not in json.dumps(schema)  # self-contained: "Try it out" needs no components
    if path == "/v1/load_lora_adapter":  # a path (JSON), or the trainer's tensors (msgpack or JSON)
        schema, tensors = schema["oneOf"]
        assert tensors["required"] == ["lora_name", "tensors", "blob", "rank"]
    assert set(schema["properties"]) == BODY_MODELS[path]
    required = {"/update_weights_from_disk": ["path"], "/v1/load_lora_adapter": ["lora_name", "lora_path"],
                "/v1/unload_lora_adapter": ["lora_name"], "/update_weights_from_tensors": ["tensors", "buckets"],
                "/update_weights_from_distributed": ["tensors", "buckets"],
                "/init_weights_group": ["master_address", "master_port"],
                "/release_memory_occupation": [], "/resume_memory_occupation": []}
    assert schema.get("required", []) == required.get(path, ["prompt"])
    assert schema["additionalProperties"] is False
    assert set(body["content"]["application/json"]["example"]) <= BODY_MODELS[path]
    assert op["responses"]["200"]["description"]
    assert op["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")


def test_openapi_documents_the_checksum_query_and_no_unused_422(openapi):
    op = openapi["paths"]["/weights_checksum"]["get"]
    (param,) = op["parameters"]
    assert (param["name"], param["in"], param["schema"]["enum"]) == ("module", "query", ["transformer", "transformer_2"])
    for path in openapi["paths"].values():
        for operation in path.values():
            assert "422" not in operation["responses"]  # the router answers 400, never FastAPI's 422


@pytest.mark.parametrize("path", ["/generate", "/rollout/generate"])
def test_the_documented_example_is_a_request_that_succeeds(engine, openapi, path):
    example = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]["example"]
    r = engine.http.post(path, json=example)
    assert r.status_code == 200, r.text
    samples = r.json()["samples"]
    assert len(samples) == 1 and samples[0]["seed"] == example.get("seed", 0)
    assert ("log_probs" in samples[0]) == (path == "/rollout/generate")


def test_docs_page_is_served(engine):
    r = engine.http.get("/docs")
    assert r.status_code == 200 and "/openapi.json" in r.text


@pytest.mark.heavy  # own engine; test_reliability.py's SIGTERM test checks no orphans
def test_shutdown_leaves_no_orphans(engine_factory):
    eng = engine_factory("tiny", launched=True)
    pids = eng.worker_pids()
    assert len(pids) == 3 and all(pid_alive(p) for p in pids)
    launcher = eng.proc.pid
    t0 = time.monotonic()
    eng.stop()
    while time.monotonic() - t0 < 10 and any(pid_alive(p) for p in pids):
        time.sleep(0.1)
    assert not [p for p in pids if pid_alive(p)], "worker processes outlived the engine"
    assert not pid_alive(launcher)
    assert eng.proc.returncode == 0
    assert eng.log_text().rstrip().endswith("launch INFO stopped: all workers exited")
