"""Wan image-to-video end to end: a launched engine on ``tiny-wan-i2v`` (real processes, ZeroMQ, HTTP on
loopback), the image sent as a request field and turned into tensors by the encoder worker.

Frames and latents equal diffusers' ``WanImageToVideoPipeline`` on the same directory, image and seed (an
image of another size than the video, a non-square video); a rollout's log-probs equal the trainer's
recompute with the same image; a group and concurrent requests with different images equal each alone;
the MP4 and the OpenAI video job (``input_reference`` as a multipart file and as a data: URL); every bad
image of tests/test_images.py's corpus, the decompression bombs and an image on a text-to-video model
answered 400 naming the field, with the worker pids unchanged and a reference request equal before and after.
Heavy: TI2V (``tiny-wan-ti2v``) text-to-video and image-to-video through an engine; CFG parallel and Ulysses
over 2 ranks equal one device for I2V.
"""

from __future__ import annotations

import base64
import io
import time

import httpx
import numpy as np
import pytest
import torch
from PIL import Image

from common.diffusion.weights import state_dict_checksum
from common.builtin import ensure_builtin
from conftest import Engine, reference_pipeline, solo_then_concurrent
from rl import TrainerPolicy, Trajectory
from router.client import EngineClient, image_field
from test_images import BOMBS, REFUSED
from test_wan_i2v import picture

TOL = 1e-4
RECOMPUTE_TOL = 1e-5
BATCH_TOL = 1e-5
IMAGE, OTHER = picture(40, 24, 1), picture(70, 50, 2)
REQ = dict(prompt="a fox at dawn", negative_prompt="blurry", seed=3, num_inference_steps=4)


@pytest.fixture(scope="module")
def model_dir():
    return ensure_builtin("tiny-wan-i2v")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    e = Engine(tmp_path_factory.mktemp("wan-i2v"), "tiny-wan-i2v", "encoder=1,denoise=1,decode=1",
               ["--weight-sync-from-memory"])
    yield e
    e.stop()


@pytest.fixture(scope="module")
def client(engine):
    with EngineClient(engine.url) as c:
        yield c


@pytest.fixture(scope="module")
def pipe(model_dir):
    from diffusers import WanImageToVideoPipeline

    return reference_pipeline(WanImageToVideoPipeline.from_pretrained(model_dir, dtype=torch.float32))


def _reference(pipe, output_type: str, image=IMAGE, **over) -> torch.Tensor:
    r = {**REQ, **over}
    out = pipe(image=image, prompt=r["prompt"], negative_prompt=r["negative_prompt"],
               height=r.get("height", 32), width=r.get("width", 32), num_frames=r.get("num_frames", 5),
               num_inference_steps=r["num_inference_steps"], guidance_scale=r.get("guidance_scale", 5.0),
               generator=torch.Generator("cpu").manual_seed(r["seed"]), output_type=output_type).frames
    return torch.as_tensor(np.asarray(out))[0]


def _diff(a, b) -> float:
    return (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("over", [{}, {"height": 48, "width": 32, "num_frames": 9}], ids=["default", "non-square"])
def test_frames_and_latents_equal_diffusers(client, pipe, over):
    frames = client.generate(**REQ, **over, image=IMAGE)["samples"][0]["output"]
    latents = client.generate(**REQ, **over, image=IMAGE, output_type="latent")["samples"][0]["output"]
    assert _diff(frames, _reference(pipe, "np", **over)) <= TOL
    assert _diff(latents, _reference(pipe, "latent", **over)) <= TOL


def test_a_rollout_a_group_and_concurrent_images(client, model_dir):
    s = client.rollout(**REQ, image=IMAGE, n=2, return_trajectory=True)["samples"]
    trainer = TrainerPolicy(model_dir)
    p = trainer.params(**REQ)
    image = trainer.image(p, IMAGE)
    for sample in s:
        assert sample["trajectory"]["latents"].shape[1] == 16  # the noise latents, not the 36 input channels
        with torch.no_grad():
            mine = trainer.log_probs(Trajectory.from_sample(sample), sample["log_prob_steps"], p, image=image)
        assert _diff(mine, sample["log_probs"]) <= RECOMPUTE_TOL
    alone = client.rollout(**{**REQ, "seed": REQ["seed"] + 1}, image=IMAGE)["samples"][0]
    assert _diff(alone["output"], s[1]["output"]) <= BATCH_TOL  # the group's second sample is seed + 1 alone
    reqs = [("/generate", {**REQ, "seed": seed, "image": image_field(im), "output_type": "latent",
                           "num_inference_steps": 10})
            for seed, im in ((1, IMAGE), (2, OTHER), (3, IMAGE), (4, OTHER))]
    solo, mixed = solo_then_concurrent(client, reqs)
    assert any(m["batch"] > 1 for m in mixed), [m["batch"] for m in mixed]
    for a, b in zip(solo, mixed):
        assert _diff(a["output"], b["output"]) <= BATCH_TOL
    assert _diff(solo[0]["output"], solo[1]["output"]) > 1e-2  # the image matters


def test_mp4_and_openai_video_jobs_with_input_reference(client, engine):
    import av
    from openai import OpenAI

    r = httpx.post(f"{engine.url}/generate", json={**REQ, "image": image_field(IMAGE), "output_type": "mp4"},
                   timeout=60)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
    api = OpenAI(base_url=f"{engine.url}/v1", api_key="unused")
    png = io.BytesIO()
    IMAGE.save(png, format="PNG")
    extra = {"negative_prompt": REQ["negative_prompt"], "seed": 3, "num_inference_steps": 4}
    job = api.videos.create_and_poll(prompt=REQ["prompt"], size="32x32", input_reference=("fox.png", png.getvalue(),
                                     "image/png"), extra_body=extra, poll_interval_ms=50)
    assert job.status == "completed", job
    by_file = api.videos.download_content(job.id).read()
    data_url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    created = httpx.post(f"{engine.url}/v1/videos", json={"prompt": REQ["prompt"], "size": "32x32", **extra,
                                                          "input_reference": {"image_url": data_url}}).json()
    for _ in range(400):
        state = httpx.get(f"{engine.url}/v1/videos/{created['id']}").json()
        if state["status"] in ("completed", "failed"):
            break
        time.sleep(0.05)
    by_url = httpx.get(f"{engine.url}/v1/videos/{created['id']}/content").content
    assert by_file == by_url == r.content  # one image, one seed: the same MP4 three ways
    with av.open(io.BytesIO(by_file)) as f:
        assert sum(1 for _ in f.decode(video=0)) == 5
    bad = httpx.post(f"{engine.url}/v1/videos", json={"prompt": "x", "input_reference": {"image_url": "http://a/b.png"}})
    assert bad.status_code == 400 and bad.json()["error"]["field"] == "input_reference"


def _pids(client) -> dict:
    return {(w["role"], w["index"]): w["pid"] for w in client.health()["workers"]}


def test_bad_images_are_400s_and_disturb_nothing(client, engine):
    before = _pids(client)
    reference = client.generate(**REQ, image=IMAGE, output_type="latent")["samples"][0]["output"]
    corpus = {**{k: v for k, (v, _) in REFUSED.items()},
              **{f"bomb_{k}": base64.b64encode(raw).decode() for k, raw in BOMBS.items()}}
    for field in ("image", "last_image"):
        for name, value in corpus.items():
            body = {**REQ, "image": image_field(IMAGE), field: value}
            r = httpx.post(f"{engine.url}/generate", json=body, timeout=60)
            assert r.status_code == 400, (field, name, r.status_code, r.text[:300])
            err = r.json()["error"]
            # A CLIP model has no first-last-frame conditioning: every last_image is refused as such.
            assert err["field"] == field and err["type"] == "invalid_request", (field, name, err)
    missing = httpx.post(f"{engine.url}/generate", json=REQ)
    assert missing.status_code == 400 and missing.json()["error"]["field"] == "image"
    assert _pids(client) == before
    after = client.generate(**REQ, image=IMAGE, output_type="latent")["samples"][0]["output"]
    assert torch.equal(after, reference)


@pytest.mark.heavy  # test_edit_requests.py's tiny refuses an image
def test_an_image_on_a_text_to_video_model_is_a_400(shared_engine):
    e = shared_engine("tiny")
    r = httpx.post(f"{e.url}/generate", json={"prompt": "a fox", "image": image_field(IMAGE)})
    assert r.status_code == 400 and r.json()["error"]["field"] == "image", r.text


def test_weights_pushed_from_the_trainer_and_its_recompute(client, model_dir):
    """The RL loop's step: the trainer changes its weights and pushes them through shared memory; a rollout
    then runs on them (log-probs equal the trainer's recompute with its new weights); the old weights back
    give the old output bit for bit."""
    base = client.generate(**REQ, image=IMAGE, output_type="latent")["samples"][0]["output"]
    trainer = TrainerPolicy(model_dir)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.transformer.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    new = {k: v.detach().clone() for k, v in trainer.transformer.state_dict().items()}
    assert client.update_weights_from_tensors(new)["sha256"] == state_dict_checksum(new)
    s = client.rollout(**REQ, image=IMAGE, return_trajectory=True)["samples"][0]
    assert _diff(s["output"], base) > 1e-3
    with torch.no_grad():
        p = trainer.params(**REQ)
        mine = trainer.log_probs(Trajectory.from_sample(s), s["log_prob_steps"], p, image=trainer.image(p, IMAGE))
    assert _diff(mine, s["log_probs"]) <= RECOMPUTE_TOL
    client.update_weights_from_tensors(TrainerPolicy(model_dir).transformer.state_dict())
    assert torch.equal(client.generate(**REQ, image=IMAGE, output_type="latent")["samples"][0]["output"], base)


# --- heavy: TI2V through an engine, multi-device I2V ---------------------------------------------------------


@pytest.mark.heavy
def test_ti2v_engine_text_and_image_to_video_equal_diffusers(engine_factory):
    from diffusers import WanImageToVideoPipeline, WanPipeline

    model_dir = ensure_builtin("tiny-wan-ti2v")
    e = engine_factory("tiny-wan-ti2v")
    kw = dict(prompt=REQ["prompt"], negative_prompt="blurry", num_inference_steps=4, guidance_scale=5.0,
              height=64, width=64, num_frames=5, output_type="latent")
    with EngineClient(e.url) as c:
        t2v = c.generate(**REQ, height=64, width=64, output_type="latent")["samples"][0]["output"]
        i2v = c.generate(**REQ, height=64, width=64, image=IMAGE, output_type="latent")["samples"][0]["output"]
        roll = c.rollout(**REQ, height=64, width=64, image=IMAGE, return_trajectory=True)["samples"][0]
    refs = []
    for cls, extra in ((WanPipeline, {}), (WanImageToVideoPipeline, {"image": IMAGE})):
        pipe = reference_pipeline(cls.from_pretrained(model_dir, dtype=torch.float32))
        refs.append(pipe(**kw, **extra, generator=torch.Generator("cpu").manual_seed(3)).frames[0])
    assert _diff(t2v, refs[0]) <= TOL and _diff(i2v, refs[1]) <= TOL
    trainer = TrainerPolicy(model_dir)
    with torch.no_grad():
        p = trainer.params(**REQ, height=64, width=64)
        mine = trainer.log_probs(Trajectory.from_sample(roll), roll["log_prob_steps"], p, image=trainer.image(p, IMAGE))
    assert _diff(mine, roll["log_probs"]) <= RECOMPUTE_TOL


@pytest.mark.heavy
@pytest.mark.parametrize("layout", ["cfg", "ulysses=2"])
def test_multi_device_i2v_equals_one_device(client, engine_factory, layout):
    e = engine_factory("tiny-wan-i2v", f"encoder=1,denoise=1:{layout},decode=1")
    with EngineClient(e.url) as c:
        for body in ({**REQ, "output_type": "latent"}, {**REQ, "n": 2}):
            one = client.rollout(**body, image=IMAGE)["samples"]
            many = c.rollout(**body, image=IMAGE)["samples"]
            for a, b in zip(one, many):
                scale = a["output"].abs().max().item()
                assert _diff(a["output"], b["output"]) <= BATCH_TOL * max(1.0, scale)
                assert _diff(a["log_probs"], b["log_probs"]) <= BATCH_TOL * max(1.0, scale)


@pytest.mark.heavy
def test_compiled_workers_with_images_equal_eager(client, engine_factory):
    e = engine_factory("tiny-wan-i2v", extra=["--compile"], launched=True)  # it reads the log
    with EngineClient(e.url) as c:
        for path, body in (("/generate", {**REQ, "output_type": "latent", "image": image_field(IMAGE)}),
                           ("/rollout/generate", {**REQ, "n": 2, "image": image_field(OTHER)})):
            got, want = c._post(path, body)["samples"], client._post(path, body)["samples"]
            for a, b in zip(got, want):
                assert _diff(a["output"], b["output"]) <= TOL * max(1.0, b["output"].abs().max().item())
                if "log_probs" in b:
                    assert _diff(a["log_probs"], b["log_probs"]) <= TOL
    assert "Recompiling" not in e.log_text().split("ready on")[-1]  # nothing compiled after the warm-up
