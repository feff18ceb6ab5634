"""Z-Image end to end on the session's shared tiny-z-image engine (real processes, ZeroMQ, HTTP on loopback).

/generate equals the workers' path in process (tests/family_harness.py) with guidance and its settings on and
in the Turbo setting at a non-square size; /rollout/generate's log-probs equal the trainer's recompute; Z-Image's
refusals are 400s naming their field.
"""

from __future__ import annotations

import pytest
import torch

from common.builtin import ensure_builtin
from common.config.engine import Limits
from common.diffusion.params import to_params
from family_harness import InProcess, max_diff
from rl import TrainerPolicy, Trajectory
from router.client import EngineClient

MODEL = "tiny-z-image"
TOL = 1e-5
REQ = dict(prompt="a lighthouse at dusk", negative_prompt="blurry, dark", seed=3, num_inference_steps=4,
           guidance_scale=4.0, cfg_normalization=True, cfg_truncation=0.2)  # guidance off at steps 2 and 3


@pytest.fixture(scope="module")
def eng(shared_engine):
    return shared_engine(MODEL)


@pytest.fixture(scope="module")
def client(eng):
    with EngineClient(eng.url) as c:
        yield c


@pytest.fixture(scope="module")
def local():
    return InProcess(ensure_builtin(MODEL))


@pytest.mark.parametrize("over", [{}, {"height": 96, "width": 64, "guidance_scale": 0.0, "num_inference_steps": 8}],
                         ids=["guided", "turbo-tall"])
def test_generate_equals_the_in_process_run(client, local, over, record_property):
    body = {**REQ, **over}
    got = torch.as_tensor(client.generate(**body)["samples"][0]["output"])
    p = to_params(body, local.info, Limits())
    want = local.frames(local.run(p).latents, p)[0]
    assert got.shape == want.shape == (1, p.height, p.width, 3) and got.std() > 1e-3
    d = max_diff(got, want)
    record_property("max_diff", d)
    assert d <= TOL


def test_rollout_log_probs_equal_the_trainers_recompute(client):
    body = {**REQ, "sde_step_indices": [1, 2]}  # one guided step, one truncated
    sample = client.rollout(**body, return_trajectory=True)["samples"][0]
    trainer = TrainerPolicy(ensure_builtin(MODEL))
    with torch.no_grad():
        again = trainer.log_probs(Trajectory.from_sample(sample), sample["log_prob_steps"], trainer.params(**body))
    assert len(again) == 2
    assert max_diff(again, torch.as_tensor(sample["log_probs"])) <= TOL


def test_refusals_name_their_field(eng):
    assert eng.http.get("/health").json()["pipeline"] == "ZImagePipeline"
    for body, field in (({"height": 72}, "height"), ({"num_frames": 5}, "num_frames"),
                        ({"true_cfg_scale": 2.0}, "true_cfg_scale"), ({"cfg_truncation": 2.0}, "cfg_truncation"),
                        ({"cfg_normalization": "on"}, "cfg_normalization"),
                        ({"image": "data:image/png;base64,AAAA"}, "image")):
        r = eng.http.post("/generate", json={"prompt": "a fox", **body})
        assert r.status_code == 400 and r.json()["error"]["field"] == field, (body, r.text)


def test_openai_images_are_the_pixels_of_generate(eng):
    """``/v1/images/generations`` through the official client: each PNG is ``/generate``'s frames as
    round(255 x), byte for byte; the served model lists its family."""
    from openai_checks import assert_images_are_the_pixels_of_generate

    assert_images_are_the_pixels_of_generate(eng, {**REQ, "guidance_scale": 4.0})


def test_the_cli_png_is_the_pixels_of_generate(eng, tmp_path):
    """``disagg generate`` (a real subprocess) against the engine: the PNG is ``/generate``'s round(255 x)."""
    import numpy as np
    from PIL import Image

    from common.protocol.http_tensors import body_to_tensor
    from router.api.media import to_uint8
    from test_cli import disagg, saved_seed

    out = tmp_path / "z.png"
    run = disagg("generate", REQ["prompt"], "-o", str(out), "--url", eng.url, "--seed", "3", "--steps", "2",
                 "--size", "64x48", "--negative-prompt", "blurry", "--guidance", "4", key=None)
    assert saved_seed(run) == 3
    r = eng.http.post("/generate", json=dict(prompt=REQ["prompt"], seed=3, num_inference_steps=2, width=64, height=48,
                                             negative_prompt="blurry", guidance_scale=4.0, num_frames=1))
    assert r.status_code == 200, r.text
    assert np.array_equal(np.array(Image.open(out)), to_uint8(body_to_tensor(r.json()["samples"][0]["output"]))[0])
