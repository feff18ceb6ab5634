"""LTX-2 end to end on the session's shared tiny-ltx2 engine (real processes, ZeroMQ, HTTP on loopback).

/generate equals the workers' path in process (tests/family_harness.py) with every guidance on and at another
frame rate; /rollout/generate's joint and per-stream log-probs equal the trainer's recompute, with the SDE on both
streams and on one; LTX-2's refusals are 400s naming their field.
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

MODEL = "tiny-ltx2"
TOL = 1e-5
REQ = dict(prompt="a dog barks by the sea", negative_prompt="blurry, silent", seed=3, num_inference_steps=3,
           stg_scale=1.0, modality_scale=2.0, guidance_rescale=0.5, audio_guidance_scale=6.0)


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


@pytest.mark.parametrize("over", [{}, {"height": 96, "width": 64, "num_frames": 17, "frame_rate": 12.0}],
                         ids=["default", "tall-12fps"])
def test_generate_equals_the_in_process_run(client, local, over, record_property):
    body = {**REQ, **over}
    got = torch.as_tensor(client.generate(**body)["samples"][0]["output"])
    p = to_params(body, local.info, Limits())
    want = local.frames(local.run(p).latents, p)[0]
    assert got.shape == want.shape == (p.num_frames, p.height, p.width, 3) and got.std() > 1e-3
    d = max_diff(got, want)
    record_property("max_diff", d)
    assert d <= TOL


@pytest.mark.parametrize("streams", [None, ["audio"]], ids=["both", "audio-only"])
def test_rollout_log_probs_equal_the_trainers_recompute(client, streams):
    body = {**REQ, "sde_step_indices": [0, 1], **({} if streams is None else {"sde_streams": streams})}
    sample = client.rollout(**body, return_trajectory=True)["samples"][0]
    trainer = TrainerPolicy(ensure_builtin(MODEL))
    with torch.no_grad():
        again = trainer.log_probs_by_stream(Trajectory.from_sample(sample), sample["log_prob_steps"],
                                            trainer.params(**body))
    assert sorted(again) == sorted(k for k in sample if k.startswith("log_probs"))
    assert len(again) == (3 if streams is None else 2)
    for name, values in again.items():
        assert max_diff(values, torch.as_tensor(sample[name])) <= TOL, name


def test_refusals_name_their_field(eng):
    assert eng.http.get("/health").json()["pipeline"] == "LTX2Pipeline"
    for body, field in (({"height": 48}, "height"), ({"num_frames": 13}, "num_frames"),
                        ({"enable_prompt_enhancement": True}, "enable_prompt_enhancement"),
                        ({"frame_rate": 0.5}, "frame_rate"), ({"true_cfg_scale": 2.0}, "true_cfg_scale"),
                        ({"image": "data:image/png;base64,AAAA"}, "image")):
        r = eng.http.post("/generate", json={"prompt": "a dog", **body})
        assert r.status_code == 400 and r.json()["error"]["field"] == field, (body, r.text)
    r = eng.http.post("/rollout/generate", json={"prompt": "a dog", "sde_streams": ["speech"]})
    assert r.status_code == 400 and r.json()["error"]["field"] == "sde_streams", r.text
