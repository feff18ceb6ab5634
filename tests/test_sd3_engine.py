"""SD3 end to end: a launched engine on tiny-sd3 against diffusers' StableDiffusion3Pipeline and the trainer.

One engine per module (real processes, ZeroMQ, HTTP on loopback): serving frames and latents equal diffusers
with and without CFG; requests at different steps batched and a GRPO group equal each alone; rollout
log-probs equal the trainer's recompute; PNG answers and the official openai client's images; weight sync
from disk, a gloo weights group and shared memory with checksums; the family in /health and /v1/models; the fields SD3 has no use
for refused; CFG parallel over two ranks equal one device; Ulysses refused at launch.
"""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from common.diffusion.weights import save_weights, state_dict_checksum
from common.families import read_model
from common.builtin import ensure_builtin
from conftest import ROOT, Engine, reference_pipeline, solo_then_concurrent
from common.runtime.engine_process import free_port
from rl import TrainerPolicy, Trajectory, WeightsGroup
from router.client import EngineClient

TOL = 1e-4
REQ = dict(prompt="a fox at dawn", negative_prompt="blurry", seed=3, num_inference_steps=4, guidance_scale=4.5)


@pytest.fixture(scope="session")
def sd3_dir():
    return ensure_builtin("tiny-sd3")


@pytest.fixture(scope="module")
def engine(tmp_path_factory, lora_root):
    e = Engine(tmp_path_factory.mktemp("sd3"), "tiny-sd3", "encoder=1,denoise=1,decode=1",
               ["--weight-root", str(lora_root), "--weight-sync-from-memory"])
    yield e
    e.stop()


@pytest.fixture(scope="module")
def client(engine):
    with EngineClient(engine.url) as c:
        yield c


@pytest.fixture(scope="module")
def pipe(sd3_dir):
    from diffusers import StableDiffusion3Pipeline

    return reference_pipeline(StableDiffusion3Pipeline.from_pretrained(sd3_dir, dtype=torch.float32))


def _reference(pipe, sd3_dir, output_type, **over) -> torch.Tensor:
    r = {**REQ, **over}
    d = read_model(sd3_dir).defaults
    out = pipe(prompt=r["prompt"], negative_prompt=r["negative_prompt"], height=r.get("height", d["height"]),
               width=r.get("width", d["width"]), num_inference_steps=r["num_inference_steps"],
               guidance_scale=r["guidance_scale"], max_sequence_length=r.get("max_sequence_length",
                                                                             d["max_sequence_length"]),
               generator=torch.Generator("cpu").manual_seed(r["seed"]), output_type=output_type).images
    return torch.as_tensor(np.asarray(out))[0]


def _diff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def _scaled(a, b) -> float:
    """Batched forwards round apart by ~1e-7 per forward: compared relative to the tensor's scale (SD3's
    latents reach ~7), as tests/test_multi_device.py does."""
    return _diff(a, b) / max(1.0, b.float().abs().max().item())


@pytest.mark.parametrize("over", [{}, {"guidance_scale": 1.0}, {"height": 48, "width": 80, "seed": 5},
                                  {"max_sequence_length": 24}], ids=["cfg", "no-cfg", "non-square", "msl"])
def test_frames_and_latents_equal_diffusers(client, pipe, sd3_dir, over):
    req = {**REQ, **over}
    frames = client.generate(**req)["samples"][0]["output"]
    ref = _reference(pipe, sd3_dir, "np", **over)
    assert frames.shape == (1, *ref.shape) and frames.std() > 1e-3
    assert _diff(frames[0], ref) <= TOL
    latents = client.generate(**req, output_type="latent")["samples"][0]["output"]
    assert _diff(latents, _reference(pipe, sd3_dir, "latent", **over)) <= TOL


def test_batched_requests_and_a_group_equal_each_alone(client):
    reqs = [("/generate", {**REQ, "output_type": "latent", "num_inference_steps": 8, "seed": 10}),
            ("/generate", {**REQ, "output_type": "latent", "prompt": "a red kite", "seed": 11}),
            ("/rollout/generate", {**REQ, "prompt": "two cats", "guidance_scale": 3.0, "seed": 12})]
    solo, together = solo_then_concurrent(client, reqs)
    for a, b in zip(solo, together):
        assert _scaled(a["output"], b["output"]) <= 1e-5
    assert max(s["batch"] for s in together) > 1  # they did share forwards
    group = client.rollout(**REQ, n=3, return_trajectory=True)["samples"]
    for i, s in enumerate(group):
        alone = client.rollout(**{**REQ, "seed": REQ["seed"] + i}, return_trajectory=True)["samples"][0]
        assert _scaled(s["log_probs"], alone["log_probs"]) <= 1e-5
        assert _scaled(s["trajectory"]["latents"], alone["trajectory"]["latents"]) <= 1e-5


@pytest.mark.parametrize("rollout", [{"sde_type": "sde", "noise_level": 0.7},
                                     {"sde_type": "cps", "noise_level": 0.8, "sde_step_indices": [0, 1]}],
                         ids=["sde", "cps-window"])
def test_rollout_log_probs_equal_the_trainers_recompute(client, sd3_dir, rollout):
    s = client.rollout(**REQ, return_trajectory=True, **rollout)["samples"][0]
    tr = Trajectory.from_sample(s)
    steps = REQ["num_inference_steps"]
    assert tr.latents.shape == (steps + 1, 16, 8, 8) and tr.sigmas.shape == (steps + 1,) and tr.sigmas[-1] == 0
    assert tr.timesteps.shape == (steps,) and 0 <= tr.timesteps.min() and tr.timesteps.max() <= 1000
    trainer = TrainerPolicy(sd3_dir)
    with torch.no_grad():
        again = trainer.log_probs(tr, s["log_prob_steps"], trainer.params(**REQ, **rollout))
    assert _diff(again, s["log_probs"]) <= 1e-5


def test_png_and_the_openai_images_api(client, engine):
    import openai

    frames = client.generate(**REQ)["samples"][0]["output"]
    r = engine.http.post("/generate", json={**REQ, "output_type": "png"})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    png = torch.from_numpy(np.asarray(Image.open(io.BytesIO(r.content)))).float() / 255
    assert png.shape == frames.shape[1:] and _diff(png, frames[0]) <= 1 / 255 + 1e-6
    with openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0) as c:
        model = c.models.list().data[0]
        assert model.id == "tiny-sd3" and model.model_extra["family"] == "sd3"
        out = c.images.generate(prompt=REQ["prompt"], size="64x64", n=2)
        assert len(out.data) == 2 and out.data[0].b64_json
        with pytest.raises(openai.BadRequestError):  # an image family makes no videos
            c.videos.create(prompt="a fox", seconds="4")


def test_health_names_the_family_and_unused_fields_are_refused(client, engine):
    health = engine.http.get("/health").json()
    assert health["family"] == "sd3" and health["pipeline"] == "StableDiffusion3Pipeline"
    for body, field in (({"num_frames": 9}, "num_frames"), ({"guidance_scale_2": 2.0}, "guidance_scale_2"),
                        ({"height": 40}, "height"), ({"max_sequence_length": 600}, "max_sequence_length")):
        r = engine.http.post("/generate", json={"prompt": "a fox", **body})
        assert r.status_code == 400 and r.json()["error"]["field"] == field, (body, r.text)
    assert client.generate(prompt="a fox", num_frames=1)["samples"][0]["output"].shape[0] == 1


def _steps_counted(engine) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(engine.http.get("/metrics").text)}
    return sum(s.value for s in families["disagg_denoise_steps"].samples if s.name.endswith("_total"))


def test_metrics_count_an_image_requests_steps(client, engine):
    before = _steps_counted(engine)
    client.generate(**REQ, n=2)
    assert _steps_counted(engine) - before == 2 * REQ["num_inference_steps"]  # one per sample per step


def _changed(sd3_dir, seed: int) -> dict[str, torch.Tensor]:
    trainer = TrainerPolicy(sd3_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainer.transformer.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return {k: v.detach().clone() for k, v in trainer.transformer.state_dict().items()}


def test_weight_sync_from_disk_a_gloo_group_and_shared_memory(client, sd3_dir, lora_root):
    base = client.generate(**REQ, output_type="latent")["samples"][0]
    new = _changed(sd3_dir, 1)
    save_weights(new, lora_root / "sd3-step-1")
    reply = client.update_weights_from_disk(str(lora_root / "sd3-step-1"))
    assert reply["sha256"] == state_dict_checksum(new)
    after = client.generate(**REQ, output_type="latent")["samples"][0]
    assert after["weight_version"] == base["weight_version"] + 1 and _diff(after["output"], base["output"]) > 1e-3
    other = _changed(sd3_dir, 2)
    with WeightsGroup(client, "127.0.0.1", free_port(), timeout_s=60, bucket_bytes=32 << 10) as group:  # gloo
        assert group.push(other)["sha256"] == state_dict_checksum(other)
    assert client.weights_checksum()["weight_version"] == after["weight_version"] + 1
    original = TrainerPolicy(sd3_dir).transformer.state_dict()
    reply = client.update_weights_from_tensors(original)  # back to the start-up weights, through shared memory
    assert reply["sha256"] == state_dict_checksum(original)
    assert torch.equal(client.generate(**REQ, output_type="latent")["samples"][0]["output"], base["output"])


@pytest.mark.heavy  # a CFG-parallel engine: tests/test_multi_device.py runs one by default
def test_cfg_parallel_equals_one_device(client, tmp_path_factory, lora_root):
    e = Engine(tmp_path_factory.mktemp("sd3-cfg"), "tiny-sd3", "encoder=1,denoise=1:cfg,decode=1", [])
    try:
        with EngineClient(e.url) as c:
            for path, body in (("/generate", {**REQ, "output_type": "latent"}),
                               ("/rollout/generate", {**REQ, "n": 2, "return_trajectory": True})):
                got, want = c._post(path, body)["samples"], client._post(path, body)["samples"]
                for a, b in zip(got, want):
                    assert _scaled(a["output"], b["output"]) <= 1e-5
            assert len(e.http.get("/health").json()["workers"]) == 3
    finally:
        e.stop()


def test_ulysses_is_refused_at_launch():
    r = subprocess.run([sys.executable, "launch.py", "--model", "tiny-sd3", "--port", "0",
                        "--topology", "encoder=1,denoise=1:ulysses=2,decode=1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "no context-parallel plan" in r.stderr, r.stderr[-2000:]


def test_an_unknown_pipeline_class_ends_the_launcher_in_one_line(tmp_path, sd3_dir):
    import json
    import shutil

    d = tmp_path / "model"
    shutil.copytree(sd3_dir, d)
    index = json.loads((d / "model_index.json").read_text())
    (d / "model_index.json").write_text(json.dumps({**index, "_class_name": "MochiPipeline"}))
    r = subprocess.run([sys.executable, "launch.py", "--model", str(d), "--port", "0"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    last = r.stderr.strip().splitlines()[-1]
    assert r.returncode != 0 and "MochiPipeline" in last and "StableDiffusion3Pipeline" in last and "WanPipeline" in last


@pytest.mark.heavy
def test_a_request_on_a_killed_denoise_worker_runs_again_equal(tmp_path_factory):
    import os
    import signal
    import time
    from concurrent.futures import ThreadPoolExecutor

    e = Engine(tmp_path_factory.mktemp("sd3-rerun"), "tiny-sd3", "encoder=1,denoise=1,decode=1", [])
    body = {**REQ, "num_inference_steps": 400, "output_type": "latent"}
    try:
        with EngineClient(e.url) as c:
            want = c._post("/generate", body)
            pool = ThreadPoolExecutor(1)
            fut = pool.submit(lambda: EngineClient(e.url)._post("/generate", body))
            deadline = time.monotonic() + 30
            while not [w for w in e.http.get("/health").json()["workers"] if w["role"] == "denoise"
                       and w["outstanding"]]:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            time.sleep(0.3)
            pid = next(w["pid"] for w in e.http.get("/health").json()["workers"] if w["role"] == "denoise")
            os.kill(pid, signal.SIGKILL)
            got = fut.result(timeout=180)
            pool.shutdown()
        assert got["attempts"] == 2 and want["attempts"] == 1
        assert torch.equal(got["samples"][0]["output"], want["samples"][0]["output"])
    finally:
        e.stop()


@pytest.mark.heavy
def test_compiled_workers_equal_eager(client, tmp_path_factory):
    e = Engine(tmp_path_factory.mktemp("sd3-compile"), "tiny-sd3", "encoder=1,denoise=1,decode=1", ["--compile"])
    try:
        with EngineClient(e.url) as c:
            for path, body in (("/generate", {**REQ, "output_type": "latent"}),
                               ("/rollout/generate", {**REQ, "n": 2})):
                got, want = c._post(path, body)["samples"], client._post(path, body)["samples"]
                for a, b in zip(got, want):
                    assert _scaled(a["output"], b["output"]) <= 1e-4
                    if "log_probs" in b:
                        assert _diff(a["log_probs"], b["log_probs"]) <= 1e-4
        assert "Recompiling" not in e.log_text().split("ready on")[-1]  # nothing compiled after the warm-up
    finally:
        e.stop()
