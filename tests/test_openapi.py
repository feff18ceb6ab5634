"""What /openapi.json says, in process (the router app over a dispatcher that is never started), for every
family's built-in model: the request bodies carry the limits this engine enforces, taken from its flags and
its model directory (sizes and their multiple, frames, steps, n, the fields the family refuses, enums), the
msgpack and form bodies, and every response is documented: 200 with its real shape (never an empty schema),
/health's 503, /metrics as text, files as their media types, every 4xx / 5xx in the error shape.

That the engine's answers match these shapes, and that it refuses what the schema forbids, is tests/test_fuzz.py.
"""

from __future__ import annotations

import json

import pytest

from common.config.engine import EngineConfig, Limits
from common.config.topology import parse_topology
from common.diffusion.params import ROLLOUT, WINDOW
from common.families import read_model
from common.builtin import ensure_builtin
from router.api.app import create_app
from router.core.engine import Engine
from router.link.dispatcher import Dispatcher
from router.core.request_params import size_multiple

MODELS = ["tiny", "tiny-sd3", "tiny-flux", "tiny-qwen-image", "tiny-sana", "tiny-wan-i2v", "tiny-z-image", "tiny-flux2-klein",
          "tiny-hunyuan-video15", "tiny-hunyuan-video15-i2v"]  # (the I2V one: a required image)
LIMITS = Limits(max_height=96, max_width=160, max_num_frames=13, max_steps=7, max_n=3, max_prompt_chars=99,
                request_timeout_s=42.0, max_lora_rank=12)


@pytest.fixture(scope="module", params=MODELS)
def served(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rt")
    model = ensure_builtin(request.param)
    config = EngineConfig(model=str(model), workers=parse_topology("encoder=1,denoise=1,decode=1", tmp),
                          router_endpoint=f"ipc://{tmp}/router.sock", runtime_dir=str(tmp),
                          limits=Limits(**{**{f: getattr(LIMITS, f) for f in LIMITS.__struct_fields__},
                                           "data_dir": str(tmp / "jobs")}))
    app = create_app(Engine(config, Dispatcher(config)))
    return read_model(model), app.openapi()


def _body(doc, path, media="application/json"):
    return doc["paths"][path]["post"]["requestBody"]["content"][media]["schema"]


def _value(prop: dict) -> dict:
    """A property's non-null form."""
    return next((b for b in prop.get("anyOf", [prop]) if b.get("type") != "null"), {"type": "null"})


def test_generation_bodies_carry_the_engines_limits(served):
    info, doc = served
    multiple = size_multiple(info)
    for path in ("/generate", "/rollout/generate"):
        props = _body(doc, path)["properties"]
        for name, most in (("height", 96), ("width", 160)):
            size = _value(props[name])
            if info.family.latents.snaps_sizes:  # any size within the bounds: the model snaps it
                assert (size["minimum"], size["maximum"], "multipleOf" in size) == (1, most, False)
            else:
                assert {k: size[k] for k in ("minimum", "maximum", "multipleOf")} == {
                    "minimum": multiple, "maximum": most, "multipleOf": multiple}
        frames = _value(props["num_frames"])["enum"]
        assert frames == ([1, 5, 9, 13] if info.family.video else [1])
        steps = _value(props["num_inference_steps"])
        assert steps["maximum"] == 7 and steps["minimum"] in (1, 2)
        assert props["n"]["maximum"] == 3 and props["n"]["minimum"] == 1
        assert props["prompt"]["maxLength"] == 99 and _value(props["timeout_s"])["maximum"] == 42.0
        assert set(props["output_type"]["enum"]) == {"frames", "latent", "mp4", "png"}
        assert _value(props["cache"])["properties"]["method"]["enum"]
        assert (_value(props["guidance_scale_2"])["type"] == "null") == (info.boundary_ratio is None) \
            if "guidance_scale_2" in props else True  # a one-expert model refuses its family's second guidance
        assert (_value(props["mu"])["type"] == "null") == (not info.dynamic_shifting)
        takes_image = info.family.condition.image_input(info)
        assert (_value(props["image"])["type"] == "null") == (takes_image is None)
        assert ("image" in _body(doc, path)["required"]) == (takes_image == "required")
    rollout = _body(doc, "/rollout/generate")["properties"]
    assert rollout["sde_type"]["enum"] == ["sde", "cps", "ode", "flow_grpo_wan", "dance_grpo"]
    assert rollout["noise_level"]["maximum"] == 10.0 and rollout["schedule"]["enum"] == ["rollout", "serving"]
    assert _value(rollout["sde_window_size"])["maximum"] == 7 and rollout["ode_solver"]["enum"] == ["euler", "serving"]
    assert _value(rollout["sde_window_range"])["items"]["maximum"] == 7
    sizes = _value(_body(doc, "/v1/images/generations")["properties"]["size"])["enum"]
    assert f"{multiple}x{multiple}" in sizes and all(int(s.split("x")[0]) % multiple == 0 for s in sizes)


def test_a_served_models_bodies_list_exactly_its_familys_own_fields(served):
    """Beyond the fields every family takes, a generation body lists the served family's declared fields (its
    binding's request_fields) and takes no other."""
    info, doc = served
    common = {"prompt", "negative_prompt", "height", "width", "num_frames", "num_inference_steps", "guidance_scale",
              "seed", "n", "sigmas", "timesteps", "mu", "max_sequence_length", "output_type", "timeout_s",
              "lora_name", "lora_scale", "cache", "image", "last_image", "seeds", "stream", "output_dtype",
              "sigmas_as_given"}
    own = {f.name for f in info.family.request_fields} - common
    expected = {"wan": {"guidance_scale_2"}, "wan-i2v": {"guidance_scale_2"}, "sd3": set(),
                "flux": {"true_cfg_scale"}, "qwen-image": {"true_cfg_scale"},
                "sana": {"use_resolution_binning", "clean_caption"},
                "z-image": {"cfg_normalization", "cfg_truncation"}, "flux2-klein": set(), "hunyuan-video15": set(),
                "hunyuan-video15-i2v": set()}[info.family.family]
    assert own == expected
    for path in ("/generate", "/rollout/generate"):
        body = _body(doc, path)
        assert set(body["properties"]) - common - ROLLOUT_FIELDS == own and body["additionalProperties"] is False
    for path in ("/v1/images/generations", "/v1/videos"):
        assert own <= set(_body(doc, path)["properties"])


ROLLOUT_FIELDS = {*ROLLOUT, *WINDOW, "return_partial", "initial_latents"}  # params.py's lists, and the router's own


def test_the_adapter_body_from_memory_and_the_form_bodies_are_documented(served):
    _, doc = served
    for media in ("application/json", "application/msgpack"):
        by_path, from_memory = _body(doc, "/v1/load_lora_adapter", media)["oneOf"]
        assert "lora_path" in by_path["required"] and "blob" in from_memory["required"]
        assert from_memory["properties"]["rank"]["maximum"] == 12
        shape = from_memory["properties"]["tensors"]["items"]["properties"]["shape"]["items"]
        assert shape["type"] == "integer" and shape["maximum"] < 1 << 63
    assert _body(doc, "/generate", "application/msgpack")["properties"]
    form = _body(doc, "/v1/videos", "multipart/form-data")["properties"]
    assert form["input_reference"]["format"] == "binary" and "prompt" in form


def _resolve(doc, schema: dict) -> dict:
    ref = schema.get("$ref", "")
    return doc["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else schema


def test_every_response_is_documented_with_its_shape(served):
    _, doc = served
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            where = f"{method.upper()} {path}"
            ok = op["responses"]["200"]
            assert ok["description"] and ok["content"], where
            for media, content in ok["content"].items():
                schema = _resolve(doc, content["schema"])
                assert schema.get("properties") or schema.get("format") == "binary" or media == "text/plain", where
            for status, response in op["responses"].items():
                if status != "200" and not (path == "/health" and status == "503"):
                    assert set(response["content"]) == {"application/json"}, (where, status)
                    assert response["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
            assert {"400", "500"} <= set(op["responses"]), where  # a query that is not UTF-8; the catch-all
    health = doc["paths"]["/health"]["get"]["responses"]
    assert health["503"]["content"]["application/json"] == health["200"]["content"]["application/json"]
    assert set(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert set(doc["paths"]["/generate"]["post"]["responses"]["200"]["content"]) == {
        "application/json", "application/msgpack", "video/mp4", "image/png"}
    assert set(doc["paths"]["/v1/videos/{video_id}/content"]["get"]["responses"]["200"]["content"]) == {"video/mp4"}
    samples = _resolve(doc, doc["paths"]["/generate"]["post"]["responses"]["200"]["content"]["application/json"]
                       ["schema"])
    assert {"request_id", "samples", "timings", "peak_memory", "weight_version", "attempts"} <= set(samples["required"])
    assert json.dumps(doc)  # the whole document is JSON (no value it cannot encode)
