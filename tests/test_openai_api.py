"""The OpenAI-style API through the official ``openai`` client, and ``/generate``'s file outputs.

Images are PNGs of the same pixels ``/generate`` gives for the same seed (8-bit rounding only); a video job
completes with an MP4 that PyAV decodes to the requested frames and size, faithful to the float frames;
progress comes from the denoise worker's steps; bad input is a 4xx in the engine's error shape.
"""

from __future__ import annotations

import base64
import io
import math
import time

import numpy as np
import openai
import pytest
import torch
from PIL import Image

from common.protocol.http_tensors import body_to_tensor
from router.api.media import decode_mp4, to_uint8

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks OpenAI's video API so

BASE = dict(prompt="a lighthouse at dusk", negative_prompt="blurry", num_inference_steps=4, guidance_scale=4.0)
LUMA = torch.tensor([0.299, 0.587, 0.114])


@pytest.fixture(scope="module")
def engine(engine_factory):
    return engine_factory("tiny", extra=["--max-jobs", "4"])


@pytest.fixture(scope="module")
def client(engine):
    with openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def _frames(engine, **fields) -> torch.Tensor:
    """``/generate``'s float frames [n, F, H, W, 3] for the same request."""
    r = engine.http.post("/generate", json={**BASE, **fields})
    assert r.status_code == 200, r.text
    return torch.stack([body_to_tensor(s["output"]) for s in r.json()["samples"]])


def _psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    return 10 * math.log10(1.0 / ((a - b) ** 2).mean().item())


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_images_are_the_same_pixels_as_generate(client, engine):
    wan = {k: v for k, v in BASE.items() if k != "prompt"}
    r = client.images.generate(prompt=BASE["prompt"], n=2, size="48x32", response_format="b64_json",
                               extra_body={**wan, "seed": 7})
    pngs = [np.array(Image.open(io.BytesIO(base64.b64decode(d.b64_json)))) for d in r.data]
    ref = _frames(engine, seed=7, n=2, width=48, height=32, num_frames=1)
    assert [p.shape for p in pngs] == [(32, 48, 3)] * 2
    for png, frames in zip(pngs, ref):
        assert np.array_equal(png, to_uint8(frames)[0])  # round(255 * x): nothing else differs
    assert not np.array_equal(pngs[0], pngs[1])  # seeds 7 and 8


def test_generate_answers_files(engine):
    ref = _frames(engine, seed=2)[0]
    mp4 = engine.http.post("/generate", json={**BASE, "seed": 2, "output_type": "mp4"})
    assert mp4.status_code == 200 and mp4.headers["content-type"] == "video/mp4"
    assert mp4.headers["x-seed"] == "2" and mp4.headers["x-request-id"]
    frames = torch.from_numpy(decode_mp4(mp4.content)).float() / 255
    assert frames.shape == ref.shape
    assert _psnr(frames @ LUMA, ref @ LUMA) >= 30
    by_accept = engine.http.post("/generate", json={**BASE, "seed": 2}, headers={"Accept": "video/mp4"})
    assert by_accept.headers["content-type"] == "video/mp4" and by_accept.content == mp4.content
    png = engine.http.post("/generate", json={**BASE, "seed": 2, "num_frames": 1}, headers={"Accept": "image/png"})
    assert png.headers["content-type"] == "image/png"
    assert np.array_equal(np.array(Image.open(io.BytesIO(png.content))), to_uint8(_frames(engine, seed=2,
                                                                                           num_frames=1)[0])[0])
    two = engine.http.post("/generate", json={**BASE, "seed": 2, "n": 2, "output_type": "mp4"}).json()
    files = [base64.b64decode(s["output"]["data"]) for s in two["samples"]]
    assert [s["output"]["media_type"] for s in two["samples"]] == ["video/mp4"] * 2
    first = torch.from_numpy(decode_mp4(files[0])).float() / 255
    assert _psnr(first @ LUMA, ref @ LUMA) >= 30 and files[1] != files[0]  # sample 0 is seed 2
    roll = engine.http.post("/rollout/generate", json={**BASE, "seed": 2, "output_type": "mp4"}).json()["samples"][0]
    assert roll["output"]["media_type"] == "video/mp4" and "log_probs" in roll  # a rollout keeps its log-probs
    bad = engine.http.post("/generate", json={**BASE, "output_type": "png"})  # 5 frames do not fit a PNG
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "output_type"


def test_video_job_completes_with_an_mp4_of_the_requested_frames(client, engine):
    wan = {k: v for k, v in BASE.items() if k != "prompt"}
    video = client.videos.create_and_poll(prompt=BASE["prompt"], size="48x32", seconds="0.25",
                                          extra_body={**wan, "seed": 5}, poll_interval_ms=50)
    assert video.status == "completed" and video.progress == 100 and video.error is None
    assert (video.size, video.seconds, video.model) == ("48x32", "0.25", "tiny")
    assert video.completed_at >= video.created_at and video.expires_at > video.completed_at
    mp4 = client.videos.download_content(video.id).read()
    frames = torch.from_numpy(decode_mp4(mp4)).float() / 255
    ref = _frames(engine, seed=5, width=48, height=32, num_frames=5)[0]
    assert frames.shape == (5, 32, 48, 3) == ref.shape  # 16 fps * 0.25 s + 1
    # yuv420p keeps luma at full resolution; the random-weight model's frames are per-pixel colour noise,
    # which half-resolution chroma cannot hold (their RGB PSNR is about 18 dB: docs/api.md).
    assert _psnr(frames @ LUMA, ref @ LUMA) >= 30
    assert client.videos.delete(video.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve(video.id)


def test_progress_rises_through_intermediate_values(client):
    # Long enough for several of the denoise worker's reports (one each 0.5 s) on a fast machine: 1000 steps
    # at 128 x 128 take ~5 s on 2 quiet cores.
    video = client.videos.create(prompt="a slow fox", size="128x128", seconds="0.25",
                                 extra_body={"num_inference_steps": 1000, "seed": 1})
    seen = []
    while video.status in ("queued", "in_progress"):
        time.sleep(0.05)
        video = client.videos.retrieve(video.id)
        seen.append(video.progress)
    assert video.status == "completed", video.error
    inside = sorted({p for p in seen if 5 < p < 90})
    assert len(inside) >= 2, seen  # the denoise worker's step count, reported as it goes
    assert seen == sorted(seen)  # never goes back
    client.videos.delete(video.id)


def test_jobs_are_listed_bounded_and_refused_clearly(client, engine):
    slow = {"num_inference_steps": 400}
    running = client.videos.create(prompt="held", size="64x64", seconds="0.25", extra_body=slow)
    with pytest.raises(openai.ConflictError):  # 409: no content before it completes
        client.videos.download_content(running.id).read()
    held = [running] + [client.videos.create(prompt=f"held {i}", size="32x32", seconds="0.25") for i in range(3)]
    with pytest.raises(openai.RateLimitError) as e:  # --max-jobs 4
        client.videos.create(prompt="one too many", seconds="0.25")
    assert e.value.body["type"] == "too_many_jobs"
    listed = [v.id for v in client.videos.list(order="asc").data]
    assert listed == [v.id for v in held]
    page = client.videos.list(order="asc", limit=2, after=held[0].id)
    assert [v.id for v in page.data] == [v.id for v in held[1:3]]
    for v in held:
        while client.videos.retrieve(v.id).status not in ("completed", "failed"):
            time.sleep(0.05)
        client.videos.delete(v.id)
    assert client.videos.list().data == []


def test_images_take_step_caching_as_generate_does(client, engine):
    cache = {"method": "first_block", "threshold": 1.0}  # the random tiny model: most steps reuse an output
    wan = {k: v for k, v in BASE.items() if k != "prompt"}
    r = client.images.generate(prompt=BASE["prompt"], size="48x32", extra_body={**wan, "seed": 3, "cache": cache})
    png = np.array(Image.open(io.BytesIO(base64.b64decode(r.data[0].b64_json))))
    cached = _frames(engine, seed=3, width=48, height=32, num_frames=1, cache=cache)
    assert np.array_equal(png, to_uint8(cached)[0, 0])
    assert not np.array_equal(png, to_uint8(_frames(engine, seed=3, width=48, height=32, num_frames=1))[0, 0])
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="x", extra_body={"cache": {"method": "teacache", "threshold": 0}})
    assert e.value.body["field"] == "cache.threshold"


@pytest.mark.parametrize("fields, field", [
    ({"size": "40x32"}, "size"),  # not a multiple of 16
    ({"size": "4096x4096"}, "size"),  # beyond --max-height: the field the client sent
    ({"size": "big"}, "size"),
    ({"seconds": "abc"}, "seconds"),
    ({"seconds": "0.3"}, "seconds"),  # 5.8 frames
    ({"seconds": "-1"}, "seconds"),
    ({"model": "sora-2"}, "model"),
])
def test_bad_video_fields_are_400_naming_the_field(client, fields, field):
    with pytest.raises(openai.BadRequestError) as e:
        client.videos.create(prompt="x", **fields)
    assert e.value.body["type"] == "invalid_request" and e.value.body["field"] == field


def test_unknown_jobs_and_images_refusals(client, engine):
    with pytest.raises(openai.NotFoundError):
        client.videos.retrieve("video_0000")
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="x", response_format="url")
    assert e.value.body["field"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        client.images.generate(prompt="x", size="17x16")
    assert e.value.body["field"] == "size"
    r = engine.http.get("/v1/videos", params={"limit": "0"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "limit"


def test_a_failed_job_reports_its_error_and_the_engine_goes_on(client, engine):
    video = client.videos.create_and_poll(prompt="too slow", size="64x64", seconds="0.25", poll_interval_ms=50,
                                          extra_body={"num_inference_steps": 400, "timeout_s": 0.2})
    assert video.status == "failed" and video.error.code == "timeout"
    client.videos.delete(video.id)
    ok = client.videos.create_and_poll(prompt="fine", size="32x32", seconds="0.25", poll_interval_ms=50)
    assert ok.status == "completed"
    client.videos.delete(ok.id)
    assert engine.http.get("/health").status_code == 200


def test_the_mp4_keeps_smooth_frames_faithfully():
    """What yuv420p loses on natural video is small: a smooth moving gradient keeps well over 30 dB RGB."""
    from router.api.media import mp4_bytes

    x, y = torch.linspace(0, 1, 64).view(1, -1), torch.linspace(0, 1, 48).view(-1, 1)
    frames = torch.stack([torch.stack([0.5 + 0.4 * torch.sin(2 * math.pi * (x + 0.05 * t)).expand(48, 64),
                                       (0.2 + 0.6 * y).expand(48, 64), 0.5 + 0.3 * torch.cos(math.pi * (x + y))], -1)
                          for t in range(9)])
    back = torch.from_numpy(decode_mp4(mp4_bytes(frames, 16))).float() / 255
    assert back.shape == frames.shape and _psnr(back, frames) >= 30
