"""vLLM-Omni's stage-aware RL API (router/peers/vllm_omni/), as its clients (verl-omni, UniRL) and its own
``test_rl_api.py`` call it.

In process: a vLLM-Omni rollout body of every family (the registry's built-ins) becomes a native request the model
accepts; unknown and unsupported ``sampling_params`` are 400s naming them; the pause gate holds new generations
back. On the shared ``tiny`` engine: the rollout's shared-memory handles, opened as the peer's own reader opens
them, equal the native answer of the same seed bit for bit (log-probs scattered over every step), and bad input
is a 4xx naming the field. On an engine of this module's own (``--weight-root``): pause, the weight transfer,
the checksum against vLLM-Omni's formula computed here on the file, LoRA, sleep and wake by stage id, aborts.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import os
import threading
import time
from multiprocessing import shared_memory

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from common.builtin import BUILTINS, ensure_builtin
from common.config.engine import Limits
from common.diffusion.checksums import omni_parameters_checksum
from common.families import BINDINGS, read_model
from router.request.images import decode_image
from router.request.schemas import RolloutBody
from router.client import EngineClient
from router.core.errors import FieldError
from router.core.pause import PauseGate
from router.core.request_params import sized_by_image, to_params
from router.peers.vllm_omni.control import stable_lora_int_id
from router.peers.vllm_omni.schemas import OmniRolloutRequest
from router.peers.vllm_omni.translate import native_body

P = "/vllm-omni"
REQ = dict(prompt="a lighthouse at dusk", negative_prompt="blurry")
SP = dict(seed=5, num_inference_steps=3, height=32, width=32, num_frames=1, guidance_scale=4.0)


def omni_sha256(named) -> str:
    """vLLM-Omni's diffusion worker's digest, restated from its source: sorted by name; name, str(dtype),
    str(tuple(shape)), raw bytes."""
    digest = hashlib.sha256()
    for name, p in sorted(named, key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(str(p.dtype).encode())
        digest.update(str(tuple(p.shape)).encode())
        digest.update(p.detach().contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return digest.hexdigest()


def open_handle(handle: dict) -> np.ndarray:
    """The peer's reader (vllm_omni/diffusion/ipc.py ``_array_from_shm``), restated: copy, close, unlink."""
    shm = shared_memory.SharedMemory(name=handle["name"])
    try:
        return np.ndarray(handle["shape"], dtype=np.dtype(handle["numpy_dtype"]),
                          buffer=shm.buf[:handle["nbytes"]]).copy()
    finally:
        shm.close()
        shm.unlink()


def field_of(r: httpx.Response) -> str:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    return r.json()["error"]["field"]


# --- in process -------------------------------------------------------------------------------------------------
def _first_builtin(pipeline: str) -> str:
    return next(n for n, spec in BUILTINS.items() if getattr(spec, "pipeline", None) == pipeline)


@pytest.mark.parametrize("pipeline", sorted(BINDINGS))
def test_a_vllm_omni_body_runs_on_every_family(pipeline):
    """Mapped, ignored and default-valued fields, the family's own, the rollout's settings in extra_args, an
    input image where the model takes one: a native request the model accepts, as the body asked."""
    info = read_model(ensure_builtin(_first_builtin(pipeline)))
    d, own = info.defaults, {f.name for f in info.family.request_fields}
    sp = {"seed": 4, "num_outputs_per_prompt": 2, "num_inference_steps": 3, info.family.cfg_field: 2.0, "fps": 12, "generator_device": "cuda",
          "guidance_scale_provided": True, "return_trajectory_latents": True, "output_type": "pil", "eta": 0.0,
          "layers": 4, "extra_step_kwargs": {}, "quality": "high",
          "extra_args": {"sde_type": "cps", "noise_level": 0.6, "sde_window_size": 2, "kl_reference": "base"}}
    if "num_frames" in d:
        sp["num_frames"] = d["num_frames"]
    if not sized_by_image(info):
        sp.update(height=d["height"], width=d["width"])
    images = {}
    if info.family.condition.image_input(info) is not None:
        buf = io.BytesIO()
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(buf, "PNG")
        sp["extra_args"]["image"] = base64.b64encode(buf.getvalue()).decode()
        images = {"image": torch.from_numpy(decode_image(sp["extra_args"]["image"]))}
    negative = {"negative_prompt": " "} if info.family.cfg_field != "guidance_scale" else {}  # true CFG needs one
    native, plan = native_body(OmniRolloutRequest.model_validate(
        {"prompt": "a fox", **negative, "sampling_params": sp}), info)
    params = to_params(RolloutBody.model_validate(native), info, Limits(), None, images)
    r = params.rollout
    assert (params.n, params.seed, plan.seed, params.num_inference_steps) == (2, 4, 4, 3)
    assert (r.sde_type, r.noise_level, r.return_trajectory) == ("cps", 0.6, True)
    assert r.sde_window[1] - r.sde_window[0] == 2
    assert plan.request_id.startswith("rollout-") and len(plan.request_id) == 40
    cfg = info.family.cfg_field
    assert (params.fields.get(cfg) if cfg in own else getattr(params, cfg)) == 2.0
    rate = info.family.request_fps
    assert rate is None or rate(params) == 12.0  # fps: the family's frame rate where it takes one


def test_sampling_params_the_engine_cannot_honour_are_refused_by_name():
    info = read_model(ensure_builtin("tiny"))
    other = next(f.name for b in BINDINGS.values() for f in b.request_fields
                 if f.name not in {g.name for g in info.family.request_fields})
    cases = [({"sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
             ({"sampling_params": {"strength": 0.5}}, "sampling_params.strength"),
             ({"sampling_params": {"quality": "low"}}, "sampling_params.quality"),
             ({"sampling_params": {other: 3.0}}, f"sampling_params.{other}"),
             ({"sampling_params": {"extra_args": {"cfg_text_scale": 4.0}}}, "sampling_params.extra_args.cfg_text_scale"),
             ({"sampling_params": {"extra_args": []}}, "sampling_params.extra_args"),
             ({"stage_id": 1}, "stage_id"), ({"request_id": "a/b"}, "request_id")]
    for body, field in cases:
        with pytest.raises(FieldError) as refused:
            native_body(OmniRolloutRequest.model_validate({**REQ, **body}), info)
        assert refused.value.field == field, (body, refused.value.message)
    native, plan = native_body(OmniRolloutRequest.model_validate(
        {**REQ, "sampling_params": {"num_outputs_per_prompt": 0, other: None}}), info)
    assert plan.peer_field("n") == "sampling_params.num_outputs_per_prompt" and other not in native


def test_the_pause_gate_holds_new_work_until_resume_and_waits_for_work_in_flight():
    async def scenario():
        gate, busy, aborted = PauseGate(), [1], []
        await gate.wait_open()  # open: at once
        pausing = asyncio.ensure_future(gate.pause("wait", lambda: aborted.append(1), lambda: busy[0], 5.0))
        await asyncio.sleep(0.05)
        held = asyncio.ensure_future(gate.wait_open())
        await asyncio.sleep(0.05)
        assert gate.status() == {"is_paused": True, "barrier_complete": False} and not held.done()
        busy[0] = 0
        await pausing
        assert gate.status() == {"is_paused": True, "barrier_complete": True} and gate.waiting == 1
        gate.resume()
        await asyncio.wait_for(held, 1.0)
        await gate.pause("abort", lambda: aborted.append(1), lambda: 0, 5.0)
        assert aborted == [1] and gate.barrier_complete

    asyncio.run(scenario())


# --- the shared tiny engine: read-only ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shared(shared_engine):
    return shared_engine("tiny")


@pytest.fixture(scope="module")
def http(shared):
    with httpx.Client(base_url=shared.url, timeout=120) as c:
        yield c


@pytest.mark.parametrize("n", [1, 2])
def test_the_rollouts_handles_equal_the_native_answer(http, shared, n):
    """Prefixed (n 2) and at the root (n 1, the body's request_id makes it vLLM-Omni's): latents [T+1, ...] and
    log-probs over every step, 0 off the SDE steps; each segment is gone once the client unlinked it."""
    sp = {**SP, "num_outputs_per_prompt": n, "extra_args": {"sde_step_indices": [1]}}
    path = f"{P}/rollout/generate" if n == 2 else "/rollout/generate"
    r = http.post(path, json={**REQ, "request_id": f"omni-{n}", "stage_id": 0, "sampling_params": sp})
    assert r.status_code == 200, r.text
    out = r.json()
    assert (out["request_id"], out["stage_id"], out["transport"]) == (f"omni-{n}", 0, "shm")
    handles = out["handles"]
    assert set(handles) == {"latents", "timesteps", "log_probs"}
    for h in handles.values():
        assert h["name"].startswith("psm_") and (h["kind"], h["ownership"], h["release"]) == ("shm", "client", "unlink")
        assert not any(k.startswith("__") for k in h)
    got = {k: torch.from_numpy(open_handle(h)) for k, h in handles.items()}
    assert not any(os.path.exists(f"/dev/shm/{h['name']}") for h in handles.values())
    with EngineClient(shared.url) as c:
        native = c.rollout(REQ["prompt"], negative_prompt=REQ["negative_prompt"], n=n, return_trajectory=True,
                           sde_step_indices=[1], **{k: v for k, v in SP.items()})["samples"]
    T = 3
    assert got["timesteps"].shape == (T,) and torch.equal(got["timesteps"], native[0]["trajectory"]["timesteps"])
    for i, s in enumerate(native):
        lat = got["latents"] if n == 1 else got["latents"][i]
        lp = got["log_probs"] if n == 1 else got["log_probs"][i]
        assert lat.shape[0] == T + 1 and torch.equal(lat, s["trajectory"]["latents"])
        want = torch.zeros(T, dtype=s["log_probs"].dtype)
        want[s["log_prob_steps"].long()] = s["log_probs"]
        assert torch.equal(lp, want) and lp[1] != 0
    m = out["metrics"]
    assert (m["seed"], m["seeds"], m["sde_steps"], m["num_inference_steps"]) == (5, [5 + i for i in range(n)], [1], T)


def test_bad_input_is_a_4xx_naming_the_field(http):
    """Each refused before anything changes; the engine answers as before after."""
    cases = [
        ("post", f"{P}/rollout/generate", {"json": {**REQ, "sampling_params": {"bogus": 1}}}, "sampling_params.bogus"),
        ("post", "/rollout/generate", {"json": {**REQ, "stage_id": 1}}, "stage_id"),
        ("post", "/rollout/generate", {"json": {**REQ, "request_id": "x", "sampling_params": {
            "num_inference_steps": 0}}}, "sampling_params.num_inference_steps"),
        ("post", "/rollout/generate", {"json": {**REQ, "transport": "tcp"}}, "transport"),
        ("post", "/sleep", {"params": {"stage_ids": 1}}, "stage_ids"),
        ("post", "/wake_up", {"params": {"stage_ids": "x"}}, "stage_ids"),
        ("post", "/init_weight_transfer_engine", {"json": {"init_info": {"backend": "nccl"}}}, "init_info.backend"),
        ("post", "/get_weights_checksum", {"json": {"stage_ids": [1]}}, "stage_ids"),
        ("post", f"{P}/get_weights_checksum", {"json": {"component": "vae"}}, "component"),
        ("post", "/v1/load_lora_adapter", {"json": {"lora_name": "a", "lora_path": "/x", "stage_ids": [2]}},
         "stage_ids"),
        ("get", "/get_world_size", {"params": {"stage_id": 1}}, "stage_id"),
        ("post", "/pause", {"params": {"mode": "freeze"}}, "mode"),
        ("post", "/reset_prefix_cache", {"params": {"stage_ids": 3}}, "stage_ids"),
        ("post", "/v1/omni/sleep", {"json": {"stage_ids": [0], "level": 3}}, "level"),
    ]
    for method, path, kwargs, field in cases:
        assert field_of(getattr(http, method)(path, **kwargs)) == field, (path, kwargs)
    assert http.get("/health").json()["ok"]
    assert http.get("/is_paused").json() == {"is_paused": False, "barrier_complete": False}


def test_topology_status_and_cache_routes(http):
    stage = {"stage_id": 0, "stage_type": "diffusion", "world_size": 1}
    for path in ("/get_world_size", f"{P}/get_world_size?stage_id=0"):
        out = http.get(path).json()
        assert out["world_size"] == 1 and stage.items() <= out["stages"][0].items()
    info = http.get("/server_info").json()
    assert info["omni_rl"]["stage_aware"] is True and info["omni_rl"]["rollout_transport"] == "shm"
    assert http.get(f"{P}/is_sleeping").json()["stages"] == [{"stage_id": 0, "is_sleeping": False}]
    for path in ("/reset_prefix_cache?stage_ids=0&reset_external=true", "/reset_mm_cache", "/reset_encoder_cache"):
        r = http.post(path)
        assert r.status_code == 200 and r.content == b""


# --- an engine of this module's own: the state-changing sequence -------------------------------------------------
@pytest.fixture(scope="module")
def root(lora_root):
    return lora_root


@pytest.fixture(scope="module")
def own(engine_factory, root):
    return engine_factory("tiny", extra=["--weight-root", str(root)])


@pytest.fixture(scope="module")
def admin(own):
    with httpx.Client(base_url=own.url, timeout=120) as c:
        yield c


def _rollout_in_thread(url: str, steps: int, request_id: str) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        with httpx.Client(base_url=url, timeout=120) as c:
            sp = {**SP, "num_inference_steps": steps}
            r = c.post(f"{P}/rollout/generate", json={**REQ, "request_id": request_id, "sampling_params": sp})
            out["status"], out["body"] = r.status_code, r.json()
            if r.status_code == 200:
                for h in out["body"]["handles"].values():
                    open_handle(h)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def test_the_weight_transfer_sequence_loads_the_file(admin, own, root, tiny_dir):
    """pause -> init -> start -> update_weights -> finish -> resume; a rollout sent while paused waits for the
    resume; the checksum after is vLLM-Omni's formula on the file's parameters."""
    assert admin.post("/start_weight_update").status_code == 400  # no completed pause: as the real engine
    assert admin.post("/pause?mode=wait&clear_cache=false").json() == {"status": "paused"}
    assert admin.get("/is_paused").json() == {"is_paused": True, "barrier_complete": True}
    held, answer = _rollout_in_thread(own.url, 3, "held-1")
    init = admin.post("/init_weight_transfer_engine", json={"init_info": {"backend": "safetensors", "stage_ids": [0]}})
    assert init.status_code == 200 and init.json()["acks"][0]["stage_id"] == 0, init.text
    assert admin.post("/start_weight_update").json()["message"] == "Weight update started"
    assert field_of(admin.post("/update_weights", json={"update_info": {"path": "/etc/passwd"}})) == "update_info.path"
    assert field_of(admin.post("/update_weights", json={"update_info": {"path": str(root / "x.safetensors"),
                                                                        "stage_ids": [1]}})) == "update_info.stage_ids"
    state = load_file(str(next((tiny_dir / "transformer").glob("*.safetensors"))))
    g = torch.Generator().manual_seed(1)
    state = {k: v + 0.01 * torch.randn(v.shape, generator=g, dtype=v.dtype) if v.is_floating_point() else v
             for k, v in state.items()}
    path = root / "omni-step-1.safetensors"
    save_file(state, str(path))
    up = admin.post("/update_weights", json={"update_info": {"path": str(path), "component": "transformer"}})
    assert up.status_code == 200, up.text
    acks = up.json()["acks"]
    assert acks[0]["success"] and acks[0]["result"]["weight_version"] == 1
    assert admin.post("/finish_weight_update", json={"weight_version": "step-1"}).status_code == 200
    time.sleep(0.3)
    assert held.is_alive()  # still paused
    assert admin.post("/resume").json() == {"status": "resumed"}
    held.join(60)
    assert answer["status"] == 200 and answer["body"]["metrics"]["weight_version"] == 1
    from diffusers import WanTransformer3DModel

    names = {n for n, _ in WanTransformer3DModel.from_pretrained(tiny_dir / "transformer").named_parameters()}
    want = omni_sha256([(n, state[n]) for n in names])
    got = admin.post("/get_weights_checksum", json={"stage_ids": [0], "component": "transformer"}).json()
    assert got["acks"][0]["result"]["checksum"] == want and got["acks"][0]["stage_id"] == 0
    module = WanTransformer3DModel.from_pretrained(tiny_dir / "transformer")
    module.load_state_dict(state)
    assert omni_parameters_checksum(module) == want


def test_lora_sleep_wake_and_aborts_by_stage_id(admin, own, tiny_lora):
    load = admin.post("/v1/load_lora_adapter", json={"lora_name": "omni", "lora_path": str(tiny_lora.path),
                                                     "stage_ids": [0]})
    assert load.status_code == 200, load.text
    assert load.json()["acks"][0]["result"]["lora_int_id"] == stable_lora_int_id(str(tiny_lora.path))
    unload = admin.post("/v1/unload_lora_adapter", json={"lora_name": "omni", "lora_int_id": 12345})
    assert field_of(unload) == "lora_int_id"
    assert admin.post("/v1/unload_lora_adapter", json={"lora_name": "omni", "stage_ids": [0]}).status_code == 200
    r = admin.post("/sleep?level=1&stage_ids=0")
    assert r.status_code == 200 and r.content == b""
    assert admin.get(f"{P}/is_sleeping").json()["stages"] == [{"stage_id": 0, "is_sleeping": True}]
    assert admin.get("/is_paused").json()["is_paused"] is True
    r = admin.post("/wake_up?stage_ids=0&tags=weights")
    assert r.status_code == 200 and r.content == b""
    assert admin.get("/is_paused").json()["is_paused"] is False
    assert admin.post("/v1/omni/wakeup", json={"stage_ids": [0]}).json()["status"] == "SKIPPED"
    slept = admin.post("/v1/omni/sleep", json={"stage_ids": [0], "level": 1}).json()
    assert slept["status"] == "SUCCESS" and {a["stage_id"] for a in slept["acks"]} == {0}
    assert admin.post("/v1/omni/wakeup", json={"stage_ids": [0]}).json()["status"] == "SUCCESS"
    slow, answer = _rollout_in_thread(own.url, 400, "slow-1")
    deadline = time.monotonic() + 30
    while admin.get("/progress/slow-1").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.02)
    aborted = admin.post("/abort_requests", json={"request_ids": ["slow-1", "unknown"]}).json()
    assert aborted == {"status": "aborted", "aborted": 2}
    slow.join(60)
    assert answer["status"] == 499
    assert admin.post("/abort_requests").json() == {"status": "aborted", "aborted": 0}
    assert admin.get("/health").json()["ok"]
