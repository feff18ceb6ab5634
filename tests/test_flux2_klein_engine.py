"""FLUX.2 [klein] end to end on the session's shared tiny-flux2-klein engine (real processes, ZeroMQ, HTTP on
loopback).

/generate equals the workers' path in process (tests/family_harness.py): CFG with the empty prompt, a non-square
size without guidance, and an edit whose reference image is cropped to whole cells (the output at its size);
/rollout/generate's log-probs equal the trainer's recompute; the family's refusals are 400s naming the field.
"""

from __future__ import annotations

import pytest
import torch

from common.builtin import ensure_builtin
from common.config.engine import Limits
from common.diffusion.params import to_params
from family_harness import InProcess, gradient_picture, max_diff
from rl import TrainerPolicy, Trajectory
from router.client import EngineClient

MODEL = "tiny-flux2-klein"
TOL = 1e-5
REQ = dict(prompt="a kite over the dunes", seed=3, num_inference_steps=3)


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


@pytest.mark.parametrize("over, edit", [({"guidance_scale": 4.0}, False),
                                        ({"height": 48, "width": 80, "guidance_scale": 1.0}, False),
                                        ({"guidance_scale": 2.0}, True)],
                         ids=["cfg", "wide-no-guidance", "edit"])
def test_generate_equals_the_in_process_run(client, local, over, edit, record_property):
    body = {**REQ, **over}
    image = gradient_picture(100, 70, seed=1) if edit else None  # 70 wide, 100 tall
    got = torch.as_tensor(client.generate(**body, **({"image": image} if edit else {}))["samples"][0]["output"])
    p = to_params(body, local.info, Limits(), image_sizes=[image.size] if edit else None)
    want = local.frames(local.run(p, image=None if image is None else [image]).latents, p)[0]
    assert got.shape == want.shape == (1, p.height, p.width, 3) and got.std() > 1e-3
    if edit:
        assert (p.height, p.width) == (96, 64)  # the reference's size, cropped to whole 16-pixel cells
    d = max_diff(got, want)
    record_property("max_diff", d)
    assert d <= TOL


def test_rollout_log_probs_equal_the_trainers_recompute(client):
    body = {**REQ, "guidance_scale": 3.0, "sde_step_indices": [0, 1]}
    sample = client.rollout(**body, return_trajectory=True)["samples"][0]
    trainer = TrainerPolicy(ensure_builtin(MODEL))
    with torch.no_grad():
        again = trainer.log_probs(Trajectory.from_sample(sample), sample["log_prob_steps"], trainer.params(**body))
    assert max_diff(again, torch.as_tensor(sample["log_probs"])) <= TOL


def test_refusals_name_their_field(eng):
    import base64
    import io

    buf = io.BytesIO()
    gradient_picture(40, 96).save(buf, format="PNG")  # a side under the pipeline's 64 pixels
    small = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    assert eng.http.get("/health").json()["pipeline"] == "Flux2KleinPipeline"
    for body, field in (({"image": small}, "image"), ({"negative_prompt": "blurry"}, "negative_prompt"),
                        ({"height": 40}, "height"), ({"true_cfg_scale": 2.0}, "true_cfg_scale"),
                        ({"num_frames": 5}, "num_frames"),
                        ({"image": ["data:image/png;base64,AAAA"] * 5}, "image")):
        r = eng.http.post("/generate", json={"prompt": "a kite", **body})
        assert r.status_code == 400 and r.json()["error"]["field"] == field, (body, r.text)


def test_openai_images_are_the_pixels_of_generate(eng):
    """``/v1/images/generations`` through the official client: each PNG is ``/generate``'s frames as
    round(255 x), byte for byte; the served model lists its family."""
    from openai_checks import assert_images_are_the_pixels_of_generate

    assert_images_are_the_pixels_of_generate(eng, {**REQ, "guidance_scale": 4.0})
