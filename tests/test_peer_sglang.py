"""SGLang diffusion's post-training API (router/peers/sglang/), as sglang 0.5.23's clients and tests call it.

In process: the log-probs' conversion against SGLang's own formulas, restated here from its
``flow_rollout_controller.py`` and evaluated on the same step; an SGLang body of every family (the registry's
tiny built-ins) becomes a native request the model accepts. On the shared ``tiny`` engine: SGLang's
``/rollout/generate`` answers parse with a reader written as SGLang's (``_maybe_deserialize``: safetensors bytes
under ``"t"``), equal the native answer of the same request (log-probs laid out over every step; in the
conventions where SGLang's differ, equal to its formulas evaluated on the trainer's recompute of each step's
velocity), and bad bodies are 400s naming the SGLang field. The weight, checksum, group and memory routes run on
an engine of this module's own (tests/test_peer_sglang_control.py).
"""

from __future__ import annotations

import base64
import math

import httpx
import msgpack
import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load

from common.builtin import ensure_builtin
from common.config.engine import Limits
from common.diffusion.policy import step_at
from common.diffusion.step_variants import step_variant
from common.families import read_model
from common.protocol.http_tensors import decode_tensors
from family_builtins import tiny_per_pipeline
from router.request.images import decode_image
from router.request.schemas import RolloutBody
from router.core.request_params import to_params
from router.peers.sglang.answer import sglang_log_probs
from router.peers.sglang.schemas import RolloutRequest
from router.peers.sglang.translate import Plan, native_body

LOG_SQRT_2PI = math.log(math.sqrt(2 * math.pi))


def read(obj):
    """SGLang's reader (``_maybe_deserialize``), restated: a ``__tensor__`` map is a safetensors file's "t"."""
    if isinstance(obj, dict):
        if obj.get("__tensor__"):
            return load(obj["data"])["t"]
        return {k: read(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [read(v) for v in obj]
    return obj


def sglang_step_log_prob(sde_type: str, noise_level: float, no_const: bool, x, v, x_next, sigmas, i) -> torch.Tensor:
    """SGLang's per-sample log-prob of one step (its ``flow_sde_sampling``), written from its formulas: the mean
    and scale of x_{i+1}, the noise that x_next implies, then the sum over elements divided by their count."""
    s, s_next = sigmas[i], sigmas[i + 1]
    dt = s_next - s
    if sde_type == "sde":
        s_max = sigmas[1]
        std_dev_t = torch.sqrt(s / (1 - torch.where(torch.isclose(s, s.new_tensor(1.0)), s_max, s))) * noise_level
        scale = std_dev_t * torch.sqrt(-dt)
        mean = x * (1 + std_dev_t**2 / (2 * s) * dt) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
    else:
        std_dev_t = s_next * math.sin(noise_level * math.pi / 2)
        scale = std_dev_t
        mean = (x - s * v) * (1 - s_next) + (x + v * (1 - s)) * torch.sqrt(s_next**2 - std_dev_t**2)
    eps = (x_next - mean) / scale
    val = -((eps * scale) ** 2)
    if not no_const:
        val = val / (2 * scale**2) - torch.log(scale) - LOG_SQRT_2PI
    dims = list(range(1, val.ndim))
    return val.sum(dims) / math.prod(val.shape[1:])


CONVENTIONS = [("sde", False), ("sde", True), ("cps", False), ("cps", True)]


@pytest.mark.parametrize("sde_type,no_const", CONVENTIONS)
def test_the_log_probs_convert_to_sglangs_conventions(sde_type, no_const):
    """The engine's log-prob of a step (its own step function), converted, equals SGLang's formula on the same
    x, v, x_next to float32 rounding, on every step of a shifted schedule (sigma 1 included)."""
    g = torch.Generator().manual_seed(3)
    sigmas = torch.tensor([1.0, 0.93, 0.8, 0.61, 0.35, 0.0])
    variant = step_variant(sde_type, 0.7)
    native, expected = [], []
    for i in range(len(sigmas) - 2):  # cps' last step has no noise (sigma_next 0): no density either way
        x, v = torch.randn(2, 4, 3, 5, generator=g), torch.randn(2, 4, 3, 5, generator=g)
        step = step_at(sigmas, i, v, x, variant, generator=[torch.Generator().manual_seed(k + 10 * i) for k in (0, 1)])
        native.append(step.log_prob)
        expected.append(sglang_step_log_prob(sde_type, 0.7, no_const, x, v, step.prev_sample, sigmas, i))
    plan = Plan(seed=0, steps=len(sigmas) - 1, rollout=True, sde_type=sde_type, noise_level=0.7, no_const=no_const,
                dit_trajectory=False, return_steps=None, peak_memory=False)
    steps = list(range(len(native)))
    got = sglang_log_probs(torch.stack(native, 1), steps, sigmas.tolist(), plan.steps, plan)
    want = torch.stack(expected, 1)
    assert got.shape == (2, plan.steps) and torch.all(got[:, len(steps):] == 0)  # steps without an SDE: 0
    assert torch.allclose(got[:, :len(steps)], want, rtol=2e-6, atol=1e-7), (got, want)
    if (sde_type, no_const) in (("sde", False), ("cps", True)):  # the engine's own convention: unchanged
        assert torch.equal(got[:, :len(steps)], torch.stack(native, 1))


@pytest.mark.parametrize("pipeline,model", sorted(tiny_per_pipeline().items()))
def test_an_sglang_body_runs_on_every_family(pipeline, model, tmp_path):
    """SGLang's body with every rollout field becomes a native request this model takes: its samples, SDE steps,
    the trajectory entries asked for, the conditioning, its image read from an allowed root."""
    info = read_model(ensure_builtin(model))
    takes = info.family.condition.image_input(info)
    body = {"prompt": "a red fox", "seed": 4, "num_outputs_per_prompt": 2, "num_inference_steps": 3,
            "rollout_sde_type": "cps", "rollout_noise_level": 0.6, "rollout_sde_step_indices": [0, 1],
            "rollout_return_dit_trajectory": True, "rollout_return_step_indices": [0, 1, 3],
            "rollout_return_denoising_env": True, "generator_device": "cuda", "fps": 12}
    images = {}
    if takes is not None:
        path = tmp_path / "in.png"
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 96, 3), dtype=np.uint8)).save(path)
        body["image_path"] = [str(path)]
        images = {"image": torch.from_numpy(decode_image(base64.b64encode(path.read_bytes()).decode()))}
    native, plan = native_body(RolloutRequest.model_validate(body), info, [str(tmp_path)])
    params = to_params(RolloutBody.model_validate(native), info, Limits(), None, images)
    r = params.rollout
    assert (params.n, params.seed, plan.seed, params.num_inference_steps) == (2, 4, 4, 3)
    assert (r.sde_type, r.noise_level, r.sde_step_indices, r.trajectory_steps) == ("cps", 0.6, [0, 1], [0, 1, 3])
    assert r.return_trajectory and r.return_conditioning and r.ode_solver == "euler"
    assert r.schedule == ("serving" if info.scheduler_config.get("use_flow_sigmas")
                          or info.scheduler_config["_class_name"].startswith("FlowMatch") else "rollout")
    frame_rate = {f.name for f in info.family.request_fields} & {"frame_rate"}
    assert params.fields.get("frame_rate") == (12.0 if frame_rate else None)


def test_image_paths_are_read_only_below_the_roots(tmp_path):
    info = read_model(ensure_builtin("tiny"))
    outside = tmp_path / "elsewhere.png"
    outside.write_bytes(b"x")
    root = tmp_path / "root"
    root.mkdir()
    (root / "link.png").symlink_to(outside)  # a link out of the root counts where it points
    for roots, path, why in (([], str(outside), "reads no image files"),
                             ([str(root)], str(outside), "outside the allowed"),
                             ([str(root)], str(root / "link.png"), "outside the allowed"),
                             ([str(root)], "relative.png", "absolute path")):
        with pytest.raises(Exception) as e:
            native_body(RolloutRequest(prompt="x", image_path=[path]), info, roots)
        assert e.value.field == "image_path.0" and why in e.value.message


# --- on the shared tiny engine -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def url(shared_engine):
    return shared_engine("tiny").url


def _sglang(url: str, body: dict, path: str = "/rollout/generate") -> list[dict]:
    r = httpx.post(url + path, json=body, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"] == "application/msgpack", r.text
    return read(msgpack.unpackb(r.content))


def _native(url: str, body: dict) -> dict:
    r = httpx.post(url + "/rollout/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return decode_tensors(r.json())


BASE = {"prompt": "a fox in the snow", "seed": 11, "num_inference_steps": 4, "guidance_scale": 3.0}


@pytest.fixture(scope="module")
def trainer():
    from rl import TrainerPolicy

    return TrainerPolicy(ensure_builtin("tiny"))


@pytest.mark.parametrize("sde_type,no_const", CONVENTIONS)
def test_sglang_rollouts_equal_the_native_ones(url, trainer, sde_type, no_const):
    """One group in SGLang's shape and the same group asked natively (SGLang's grid: Wan's UniPC schedule):
    frames, trajectory and schedule equal bit for bit; log-probs equal the native ones in the convention they
    share, and SGLang's formulas on the trainer's recompute of each SDE step where they differ."""
    sde = [1, 2]
    got = _sglang(url, {**BASE, "num_outputs_per_prompt": 2, "rollout_sde_type": sde_type,
                        "rollout_log_prob_no_const": no_const, "rollout_sde_step_indices": sde,
                        "rollout_return_dit_trajectory": True, "rollout_return_step_indices": [0, 1, 2, 3, 4]})
    ref = _native(url, {**BASE, "n": 2, "sde_type": sde_type, "sde_step_indices": sde, "schedule": "serving",
                        "return_trajectory": True, "output_type": "frames"})
    assert len(got) == 2 and [s["seed"] for s in got] == [11, 11]  # SGLang answers the request's seed
    params = trainer.params(BASE["prompt"], seed=11, num_inference_steps=4, guidance_scale=3.0, sde_type=sde_type,
                            sde_step_indices=sde, schedule="serving", return_trajectory=True)
    cond = trainer.embeddings(params)
    for sample, want in zip(got, ref["samples"]):
        assert set(sample) == {"request_id", "prompt", "seed", "generated_output", "rollout_log_probs",
                               "rollout_debug_tensors", "denoising_env", "dit_trajectory", "inference_time_s",
                               "peak_memory_mb"}
        assert torch.equal(sample["generated_output"], want["output"].permute(3, 0, 1, 2))
        traj = sample["dit_trajectory"]
        assert torch.equal(traj["latents"], want["trajectory"]["latents"])
        assert torch.equal(traj["sigmas"], want["trajectory"]["sigmas"])
        assert torch.equal(traj["timesteps"][:4], want["trajectory"]["timesteps"]) and traj["timesteps"][4] == 0
        lp = sample["rollout_log_probs"]
        assert lp.shape == (4,) and lp[0] == 0 and lp[3] == 0  # laid out over every step, 0 without an SDE
        if (sde_type, no_const) in (("sde", False), ("cps", True)):
            assert torch.equal(lp[sde], want["log_probs"])
            continue
        x, sig = traj["latents"], traj["sigmas"]
        for i in sde:
            with torch.no_grad():
                v = trainer.velocity(x[i:i + 1], traj["timesteps"][i], *cond, params, sigma=sig[i])
            oracle = sglang_step_log_prob(sde_type, 0.7, no_const, x[i:i + 1], v, x[i + 1:i + 2], sig, i)
            assert torch.allclose(lp[i], oracle[0], rtol=1e-4, atol=1e-6), (i, lp[i], oracle)


def test_sglang_answers_the_seed_it_drew_and_the_conditioning(url, trainer):
    """seed null: an int that reproduces the samples; the denoising env equals the trainer's embeddings."""
    first = _sglang(url, {**BASE, "seed": None, "rollout_return_denoising_env": True})
    seed = first[0]["seed"]
    assert isinstance(seed, int)
    again = _sglang(url, {**BASE, "seed": seed}, "/sglang/rollout/generate")  # no SGLang-only field: the prefix
    assert torch.equal(first[0]["generated_output"], again[0]["generated_output"])
    env = first[0]["denoising_env"]
    cond, uncond = trainer.embeddings(trainer.params(BASE["prompt"], seed=seed, num_inference_steps=4,
                                                     guidance_scale=3.0))
    assert torch.equal(env["pos_cond_kwargs"]["encoder_hidden_states"], cond)
    assert torch.equal(env["neg_cond_kwargs"]["encoder_hidden_states"], uncond)
    assert env["image_kwargs"] is None and env["guidance"] is None


@pytest.mark.parametrize("body,field", [
    ({"rollout_sde_type": "ode"}, "rollout_log_prob_no_const"),
    ({"rollout_noise_level": 0.0}, "rollout_noise_level"),
    ({"num_outputs_per_prompt": "2"}, "num_outputs_per_prompt"),
    ({"rollout_sde_type": "bogus"}, "rollout_sde_type"),
    ({"rollout_sde_step_indices": [9]}, "rollout_sde_step_indices"),
    ({"extra_sampling_params": {"bogus": 1}}, "extra_sampling_params.bogus"),
    ({"image_path": ["/etc/passwd"]}, "image_path.0"),
    ({"generator_device": "tpu"}, "generator_device"),
])
def test_bad_sglang_bodies_are_400s_naming_the_field(url, body, field):
    r = httpx.post(url + "/sglang/rollout/generate", json={"prompt": "x", "num_inference_steps": 2, **body},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field and r.json()["success"] is False


def test_pickled_tensors_are_refused_and_the_engine_answers_on(url):
    r = httpx.post(url + "/update_weights_from_tensor", json={"serialized_named_tensors": ["gASV..."]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["field"] == "serialized_named_tensors"
    assert httpx.get(url + "/health_generate", timeout=30).json() == {"status": "ok"}
    assert httpx.get(url + "/sglang/health", timeout=30).json() == {"status": "ok"}
    ok = _sglang(url, {"prompt": "x", "num_inference_steps": 2, "rollout": False}, "/sglang/rollout/generate")
    assert ok[0]["rollout_log_probs"] is None and ok[0]["dit_trajectory"] is None
