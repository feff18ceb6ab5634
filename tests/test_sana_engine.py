"""SANA end to end on the session's shared tiny-sana engine (real processes, ZeroMQ, HTTP on loopback).

/generate equals the workers' path in process (tests/family_harness.py) with binning on (a size snapped to its
bin and resized back) and off; a size that is no multiple of 32 with binning off and ``clean_caption`` are 400s
naming their field; /rollout/generate log-probs equal the trainer's recompute; the official openai client's
images equal /generate's; a sleep / wake cycle (the transformer dropped, reloaded from disk) answers as before.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch
from PIL import Image

from common.builtin import ensure_builtin
from common.config.engine import Limits
from common.diffusion.params import to_params
from family_harness import InProcess, max_diff
from rl import TrainerPolicy, Trajectory
from router.client import EngineClient

MODEL = "tiny-sana"
TOL = 1e-5
REQ = dict(prompt="a fox at dawn", negative_prompt="blurry", seed=3, num_inference_steps=4)


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


def _frames(client, **body) -> torch.Tensor:
    return torch.as_tensor(client.generate(**body)["samples"][0]["output"])


@pytest.mark.parametrize("over", [{}, {"height": 200, "width": 96}, {"height": 96, "width": 160,
                                                                     "use_resolution_binning": False}],
                         ids=["default", "binned-resized-back", "binning-off"])
def test_generate_equals_the_in_process_run(client, local, over, record_property):
    body = {**REQ, **over}
    got = _frames(client, **body)
    p = to_params(body, local.info, Limits())
    want = local.frames(local.run(p).latents, p)[0]
    assert got.shape == want.shape == (1, p.height, p.width, 3) and got.std() > 1e-3
    d = max_diff(got, want)
    record_property("max_diff", d)
    assert d <= TOL


def test_refusals_name_their_field(eng):
    assert eng.http.get("/health").json()["pipeline"] == "SanaPipeline"
    for body, field in (({"height": 200, "width": 64, "use_resolution_binning": False}, "height"),
                        ({"height": 64, "width": 100, "use_resolution_binning": False}, "width"),
                        ({"clean_caption": True}, "clean_caption"), ({"true_cfg_scale": 2.0}, "true_cfg_scale"),
                        ({"use_resolution_binning": "yes"}, "use_resolution_binning")):
        r = eng.http.post("/generate", json={"prompt": "a fox", **body})
        assert r.status_code == 400 and r.json()["error"]["field"] == field, (body, r.text)


def test_rollout_log_probs_equal_the_trainers_recompute(client):
    body = {**REQ, "height": 96, "width": 160}
    sample = client.rollout(**body, return_trajectory=True)["samples"][0]
    trainer = TrainerPolicy(ensure_builtin(MODEL))
    with torch.no_grad():
        again = trainer.log_probs(Trajectory.from_sample(sample), sample["log_prob_steps"], trainer.params(**body))
    assert len(sample["log_probs"]) == REQ["num_inference_steps"]
    assert max_diff(again, torch.as_tensor(sample["log_probs"])) <= 1e-5


def test_openai_images_equal_generate(eng, client):
    import openai

    with openai.OpenAI(base_url=eng.url + "/v1", api_key="unused", max_retries=0) as c:
        assert c.models.list().data[0].model_extra["family"] == "sana"
        out = c.images.generate(prompt=REQ["prompt"], size="160x96", n=1,
                                extra_body={k: REQ[k] for k in ("negative_prompt", "seed", "num_inference_steps")})
    png = Image.open(io.BytesIO(base64.b64decode(out.data[0].b64_json)))
    assert png.size == (160, 96)
    frames = _frames(client, **REQ, height=96, width=160)
    assert max_diff(torch.from_numpy(np.array(png)).float() / 255, frames[0]) <= 1 / 255 + 1e-6


def test_a_sleep_wake_cycle_answers_as_before(client):
    before = _frames(client, **REQ)
    client.release_memory_occupation(["transformer"], level=2)
    assert client.is_sleeping()["is_sleeping"]
    client.resume_memory_occupation(["transformer"], reload="disk")
    assert torch.equal(_frames(client, **REQ), before)
