"""HunyuanVideo 1.5 end to end on the session's shared tiny-hunyuan-video15 engine (real processes, ZeroMQ, HTTP
on loopback): /generate equals the workers' path in process (tests/family_harness.py), guided with quoted text
and unguided at a non-square size; /rollout/generate's log-probs equal the trainer's recompute; refusals are 400s
naming their field."""

from __future__ import annotations

import pytest
import torch

from common.builtin import ensure_builtin
from common.config.engine import Limits
from common.diffusion.params import to_params
from family_harness import InProcess, max_diff
from rl import TrainerPolicy, Trajectory
from router.client import EngineClient

MODEL = "tiny-hunyuan-video15"
TOL = 1e-5
REQ = dict(prompt='a neon sign saying "OPEN" in the rain', negative_prompt="blurry", seed=3, num_inference_steps=3)


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


@pytest.mark.parametrize("over", [{}, {"height": 64, "width": 32, "num_frames": 9, "guidance_scale": 1.0}],
                         ids=["guided", "tall-unguided"])
def test_generate_equals_the_in_process_run(client, local, over, record_property):
    body = {**REQ, **over}
    got = torch.as_tensor(client.generate(**body)["samples"][0]["output"])
    p = to_params(body, local.info, Limits())
    want = local.frames(local.run(p).latents, p)[0]
    assert got.shape == want.shape == (p.num_frames, p.height, p.width, 3) and got.std() > 1e-3
    d = max_diff(got, want)
    record_property("max_diff", d)
    assert d <= TOL


def test_rollout_log_probs_equal_the_trainers_recompute(client):
    body = {**REQ, "sde_step_indices": [0, 1]}
    sample = client.rollout(**body, return_trajectory=True)["samples"][0]
    trainer = TrainerPolicy(ensure_builtin(MODEL))
    with torch.no_grad():
        again = trainer.log_probs(Trajectory.from_sample(sample), sample["log_prob_steps"], trainer.params(**body))
    assert max_diff(again, torch.as_tensor(sample["log_probs"])) <= TOL


def test_refusals_name_their_field(eng):
    assert eng.http.get("/health").json()["pipeline"] == "HunyuanVideo15Pipeline"
    for body, field in (({"height": 40}, "height"), ({"num_frames": 6}, "num_frames"),
                        ({"max_sequence_length": 256}, "max_sequence_length"), ({"true_cfg_scale": 2.0}, "true_cfg_scale"),
                        ({"guidance_scale_2": 2.0}, "guidance_scale_2"),
                        ({"image": "data:image/png;base64,AAAA"}, "image")):
        r = eng.http.post("/generate", json={"prompt": "a dog", **body})
        assert r.status_code == 400 and r.json()["error"]["field"] == field, (body, r.text)


def test_openai_video_job_is_an_mp4_of_the_requested_frames(eng):
    """``/v1/videos`` through the official client: the job's MP4 decodes to the requested frames at the model's
    size, faithful to ``/generate``'s float frames (luma: yuv420p halves the chroma of random-weight noise)."""
    import math

    import openai

    from common.protocol.http_tensors import body_to_tensor
    from router.api.media import decode_mp4

    fields = {k: v for k, v in REQ.items() if k != "prompt"}
    with openai.OpenAI(base_url=eng.url + "/v1", api_key="unused", max_retries=0) as c:
        video = c.videos.create_and_poll(prompt=REQ["prompt"], extra_body={**fields, "num_frames": 5},
                                         poll_interval_ms=50)
        assert video.status == "completed", video.error
        mp4 = c.videos.download_content(video.id).read()
        c.videos.delete(video.id)
    frames = torch.from_numpy(decode_mp4(mp4)).float() / 255
    r = eng.http.post("/generate", json={**REQ, "num_frames": 5})
    assert r.status_code == 200, r.text
    ref = body_to_tensor(r.json()["samples"][0]["output"])
    assert frames.shape == ref.shape and frames.shape[0] == 5 and video.size == f"{ref.shape[2]}x{ref.shape[1]}"
    luma = torch.tensor([0.299, 0.587, 0.114])
    assert 10 * math.log10(1.0 / ((frames @ luma - ref @ luma) ** 2).mean().item()) >= 30
