"""FLUX.1 and Qwen-Image end to end: a launched engine per family (tiny-flux, tiny-qwen-image; real processes,
ZeroMQ, HTTP on loopback) against diffusers' pipelines and the trainer.

Serving frames and packed latents equal the pipeline (true CFG with a negative prompt, an explicit ``mu``);
requests at different steps batched and a group equal each alone; rollout log-probs equal the trainer's
recompute; PNG answers and the official openai client's images; the family in /health; the model-dependent
fields refused; LoRA adapters from disk and from the trainer's memory in concurrent requests (against diffusers'
loaders, solo runs and the trainer's recompute); weight sync through shared memory; CFG parallel (true CFG) and
Ulysses equal to one device; ``--compile`` equal to eager, nothing compiled after the warm-up.
"""

from __future__ import annotations

import io
from collections import Counter

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from PIL import Image

from common.diffusion.weights import state_dict_checksum
from common.families import read_model
from common.builtin import ensure_builtin
from conftest import Engine, solo_then_concurrent
from rl import TrainerPolicy, Trajectory
from router.client import EngineClient

TOL = 1e-4
REQ = dict(prompt="a fox at dawn", negative_prompt="blurry", true_cfg_scale=2.5, seed=3, num_inference_steps=4)


@pytest.fixture(scope="module", params=["tiny-flux", "tiny-qwen-image"])
def model(request):
    return request.param


@pytest.fixture(scope="module")
def model_dir(model):
    return ensure_builtin(model)


@pytest.fixture(scope="module")
def engine(model, tmp_path_factory, lora_root):
    e = Engine(tmp_path_factory.mktemp(model), model, "encoder=1,denoise=1,decode=1",
               ["--weight-sync-from-memory", "--weight-root", str(lora_root)])
    yield e
    e.stop()


@pytest.fixture(scope="module")
def client(engine):
    with EngineClient(engine.url) as c:
        yield c


@pytest.fixture(scope="module")
def pipe(model_dir):
    import diffusers

    p = getattr(diffusers, read_model(model_dir).family.pipeline).from_pretrained(model_dir, dtype=torch.float32)
    p.set_progress_bar_config(disable=True)
    return p


def _reference(pipe, model_dir, output_type, **over) -> torch.Tensor:
    r = {**REQ, **over}
    info = read_model(model_dir)
    d = info.defaults
    template = pipe.scheduler
    if r.get("mu") is not None:  # the pipelines take no mu: base and max shift both mu give it at every length
        pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            {**template.config, "base_shift": r["mu"], "max_shift": r["mu"]})
    kwargs = dict(prompt=r["prompt"], negative_prompt=r.get("negative_prompt"), true_cfg_scale=r["true_cfg_scale"],
                  height=r.get("height", d["height"]), width=r.get("width", d["width"]),
                  num_inference_steps=r["num_inference_steps"], max_sequence_length=d["max_sequence_length"],
                  generator=torch.Generator("cpu").manual_seed(r["seed"]), output_type=output_type)
    if info.transformer_config.get("guidance_embeds"):
        kwargs["guidance_scale"] = r.get("guidance_scale", d["guidance_scale"])
    try:
        out = pipe(**kwargs).images
    finally:
        pipe.scheduler = template
    return torch.as_tensor(np.asarray(out))[0]


def _diff(a, b) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def _scaled(a, b) -> float:
    return _diff(a, b) / max(1.0, b.float().abs().max().item())


@pytest.mark.parametrize("over", [{}, {"mu": 0.9, "height": 48, "width": 80}], ids=["true-cfg", "mu-non-square"])
def test_frames_and_packed_latents_equal_diffusers(client, pipe, model_dir, over):
    req = {**REQ, **over}
    frames = client.generate(**req)["samples"][0]["output"]
    ref = _reference(pipe, model_dir, "np", **over)
    assert frames.shape == (1, *ref.shape) and frames.std() > 1e-3
    assert _diff(frames[0], ref) <= TOL
    latents = client.generate(**req, output_type="latent")["samples"][0]["output"]
    h, w = req.get("height", 64), req.get("width", 64)
    assert latents.shape == ((h // 16) * (w // 16), 64)  # packed, as the pipeline returns them
    assert _diff(latents, _reference(pipe, model_dir, "latent", **over)) <= TOL


def test_batched_requests_a_group_and_the_trainers_recompute(client, model_dir):
    reqs = [("/generate", {**REQ, "output_type": "latent", "num_inference_steps": 8, "seed": 10}),
            ("/generate", {"prompt": "a red kite over a long beach", "output_type": "latent", "seed": 11,
                           "num_inference_steps": 4, "mu": 1.0}),
            ("/rollout/generate", {**REQ, "prompt": "two cats", "seed": 12})]
    solo, together = solo_then_concurrent(client, reqs)
    for a, b in zip(solo, together):
        assert _scaled(a["output"], b["output"]) <= 1e-5
    assert max(s["batch"] for s in together) > 1
    group = client.rollout(**REQ, n=3, return_trajectory=True, mu=0.8)["samples"]
    trainer = TrainerPolicy(model_dir)
    for i, s in enumerate(group):
        alone = client.rollout(**{**REQ, "seed": REQ["seed"] + i}, return_trajectory=True, mu=0.8)["samples"][0]
        assert _scaled(s["log_probs"], alone["log_probs"]) <= 1e-5
        tr = Trajectory.from_sample(s)
        assert tr.latents.shape == (REQ["num_inference_steps"] + 1, 16, 64)
        with torch.no_grad():
            again = trainer.log_probs(tr, s["log_prob_steps"], trainer.params(**REQ, mu=0.8))
        assert _diff(again, s["log_probs"]) <= 1e-5


def test_png_openai_images_health_and_refused_fields(client, engine, model):
    import openai

    frames = client.generate(**REQ)["samples"][0]["output"]
    r = engine.http.post("/generate", json={**REQ, "output_type": "png"})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    png = torch.from_numpy(np.asarray(Image.open(io.BytesIO(r.content)))).float() / 255
    assert _diff(png, frames[0]) <= 1 / 255 + 1e-6
    with openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0) as c:
        assert c.models.list().data[0].model_extra["family"] == read_model(ensure_builtin(model)).family.family
        out = c.images.generate(prompt=REQ["prompt"], size="64x32", n=2,
                                extra_body={"negative_prompt": "blurry", "true_cfg_scale": 2.0})
        assert len(out.data) == 2 and Image.open(io.BytesIO(__import__("base64").b64decode(out.data[0].b64_json))
                                                 ).size == (64, 32)
    health = engine.http.get("/health").json()
    assert health["pipeline"] in ("FluxPipeline", "QwenImagePipeline")
    refused = [({"num_frames": 9}, "num_frames"), ({"guidance_scale_2": 2.0}, "guidance_scale_2"),
               ({"true_cfg_scale": 3.0}, "true_cfg_scale"), ({"mu": 1e9}, "mu")]
    if model == "tiny-qwen-image":  # no guidance embedding
        refused.append(({"guidance_scale": 3.0}, "guidance_scale"))
    for body, field in refused:
        r = engine.http.post("/generate", json={"prompt": "a fox", **body})
        assert r.status_code == 400 and r.json()["error"]["field"] == field, (body, r.text)


def _lora_reference(pipe, model_dir, output_type, adapter, **over) -> torch.Tensor:
    """:func:`_reference` with ``adapter`` (path, scale) loaded by diffusers' ``load_lora_weights`` and activated
    by ``set_adapters``; None: the base model."""
    if adapter is None:
        return _reference(pipe, model_dir, output_type, **over)
    pipe.load_lora_weights(str(adapter[0]), adapter_name="ref")
    try:
        pipe.set_adapters(["ref"], [adapter[1]])
        return _reference(pipe, model_dir, output_type, **over)
    finally:
        pipe.unload_lora_weights()


def test_adapters_from_disk_and_memory_concurrently(client, model, model_dir, pipe, lora_root, record_property):
    """Adapter A from a diffusers LoRA file (the family's save_lora_weights), B pushed from the trainer's memory
    (rl.lora): concurrent requests mixing A, B and none each equal their solo run and diffusers' loaders on
    the same file (B: as rl.lora.save_lora writes it); a rollout with B equals the trainer's recompute. Before
    the weight-sync test, so the engine holds the directory's weights (the diffusers reference's)."""
    import lora_fixtures as lf
    from rl.lora import add_lora, push_lora, save_lora

    family = read_model(model_dir).family
    root = lora_root / f"test_packed_engine-{model}"
    a = lf.make_diffusers_lora(model_dir, root / "a", rank=4, alpha=8, target_modules=family.transformer.lora_targets, seed=1)
    trainer = TrainerPolicy(model_dir)
    add_lora(trainer, 2, 6.0, seed=0)  # alpha / r = 3 must reach the engine
    lf.randomise_lora(trainer.transformer, seed=7)
    files = {"A": a.path, "B": save_lora(trainer, root / "b").parent}
    disk = client.load_lora_adapter("A", str(a.path))
    try:
        mem = push_lora(client, trainer, "B")
        assert disk["rank"] == 4 and mem["rank"] == 2, (disk, mem)
        # A, B and none; true CFG on some; frames and packed latents; at other scales.
        plan = [("A", 1.0, "np", 1, True), ("B", 1.0, "latent", 2, False), (None, None, "np", 3, True),
                ("A", 0.6, "latent", 4, False), ("B", 0.5, "np", 5, True), (None, None, "latent", 6, False)]
        reqs, overs = [], []
        for name, scale, kind, seed, cfg in plan:
            over = {"prompt": f"a kite {seed % 3}", "seed": seed, "num_inference_steps": 8}
            if not cfg:
                over.update(negative_prompt=None, true_cfg_scale=1.0)
            body = {**REQ, **over, "output_type": "latent" if kind == "latent" else "frames"}
            if not cfg:  # no negative prompt: the router's default true_cfg_scale, 1
                del body["negative_prompt"], body["true_cfg_scale"]
            if name is not None:
                body.update(lora_name=name, lora_scale=scale)
            reqs.append(("/generate", body))
            overs.append(over)
        solo, mixed = solo_then_concurrent(client, reqs)
        count = Counter(body.get("lora_name") for _, body in reqs)
        assert any(m["batch"] > count[m["lora_name"]] for m in mixed), [m["batch"] for m in mixed]  # shared forwards
        diffs: dict[str, float] = {}
        for (name, scale, kind, seed, cfg), over, (_, body), s, m in zip(plan, overs, reqs, solo, mixed):
            assert s["lora_name"] == m["lora_name"] == name
            diffs["solo"] = max(diffs.get("solo", 0.0), _scaled(m["output"], s["output"]))
            assert diffs["solo"] <= 1e-5, name
            got = m["output"][0] if kind == "np" else m["output"]
            want = _lora_reference(pipe, model_dir, kind, None if name is None else (files[name], scale), **over)
            diffs[f"diffusers-{name}"] = max(diffs.get(f"diffusers-{name}", 0.0), _diff(got, want))
            assert diffs[f"diffusers-{name}"] <= TOL, (name, scale, kind)
            if seed <= 2:  # the adapters change the output
                plain = {k: v for k, v in body.items() if k not in ("lora_name", "lora_scale")}
                assert _diff(client._post("/generate", plain)["samples"][0]["output"], m["output"]) > 1e-3

        # A rollout with the adapter from memory: the trainer recomputes its log-probs.
        s = client.rollout(**{**REQ, "seed": 9}, lora_name="B", return_trajectory=True)["samples"][0]
        assert s["lora_name"] == "B" and s["lora_version"] == mem["lora_version"]
        with torch.no_grad():
            again = trainer.log_probs(Trajectory.from_sample(s), s["log_prob_steps"],
                                      trainer.params(**{**REQ, "seed": 9}, lora_name="B"))
        diffs["recompute"] = _diff(again, s["log_probs"])
        record_property("max_diff", diffs)
        print(f"\n[{model} LoRA] batches {[m['batch'] for m in mixed]} {diffs}")
        assert diffs["recompute"] <= 1e-5
    finally:
        for name in ("A", "B"):
            client.unload_lora_adapter(name)
    assert not [x for x in client.lora_adapters() if x.get("lora_name") in ("A", "B")]


def test_weight_sync_through_shared_memory(client, model_dir):
    base = client.generate(**REQ, output_type="latent")["samples"][0]
    trainer = TrainerPolicy(model_dir)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in trainer.transformer.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    new = {k: v.detach().clone() for k, v in trainer.transformer.state_dict().items()}
    assert client.update_weights_from_tensors(new)["sha256"] == state_dict_checksum(new)
    changed = client.generate(**REQ, output_type="latent")["samples"][0]
    assert _diff(changed["output"], base["output"]) > 1e-3
    original = TrainerPolicy(model_dir).transformer.state_dict()
    client.update_weights_from_tensors(original)
    assert torch.equal(client.generate(**REQ, output_type="latent")["samples"][0]["output"], base["output"])


@pytest.mark.heavy
def test_cfg_parallel_equals_one_device(client, model, tmp_path_factory):
    e = Engine(tmp_path_factory.mktemp(model + "-cfg"), model, "encoder=1,denoise=1:cfg,decode=1", [])
    try:
        with EngineClient(e.url) as c:
            for path, body in (("/generate", {**REQ, "output_type": "latent"}),
                               ("/rollout/generate", {**REQ, "n": 2, "return_trajectory": True})):
                got, want = c._post(path, body)["samples"], client._post(path, body)["samples"]
                for a, b in zip(got, want):
                    assert _scaled(a["output"], b["output"]) <= 1e-5
    finally:
        e.stop()


@pytest.mark.heavy
def test_ulysses_over_two_ranks_equals_one_device(client, model, tmp_path_factory):
    """diffusers' context-parallel plan of the transformer (FLUX's splits the position ids too; Qwen-Image's
    the text mask), two gloo ranks on the CPU."""
    e = Engine(tmp_path_factory.mktemp(model + "-ulysses"), model, "encoder=1,denoise=1:ulysses=2,decode=1", [])
    try:
        with EngineClient(e.url) as c:
            body = {**REQ, "output_type": "latent", "n": 2}
            got, want = c._post("/generate", body)["samples"], client._post("/generate", body)["samples"]
            for a, b in zip(got, want):
                assert _scaled(a["output"], b["output"]) <= 1e-5
    finally:
        e.stop()


@pytest.mark.heavy
def test_compiled_engine_equals_eager(client, model, tmp_path_factory, record_property):
    """--compile: the denoise worker's transformer through torch.compile, warmed up at the default request;
    requests with texts of other lengths (Qwen-Image pads and masks a forward of several), with and without
    true CFG, a rollout group and all of them at once equal the module's eager engine and compile nothing."""
    e = Engine(tmp_path_factory.mktemp(model + "-compile"), model, "encoder=1,denoise=1,decode=1", ["--compile"])
    reqs = [("/generate", {**REQ, "output_type": "latent", "num_inference_steps": 6, "seed": 10}),
            ("/generate", {"prompt": "a red kite over a long beach at noon", "output_type": "latent", "seed": 11,
                           "num_inference_steps": 4}),
            ("/rollout/generate", {**REQ, "prompt": "two cats", "n": 2, "seed": 12, "return_trajectory": True})]
    try:
        with EngineClient(e.url) as c:
            diffs = {"output": 0.0, "log_probs": 0.0}
            for path, body in reqs:
                got, want = c._post(path, body)["samples"], client._post(path, body)["samples"]
                assert len(got) == len(want) == body.get("n", 1)
                for a, b in zip(got, want):
                    diffs["output"] = max(diffs["output"], _scaled(a["output"], b["output"]))
                    if "log_probs" in b:  # and the trajectory the trainer recomputes them from
                        diffs["log_probs"] = max(diffs["log_probs"], _diff(a["log_probs"], b["log_probs"]))
                        diffs["output"] = max(diffs["output"], _scaled(a["trajectory"]["latents"],
                                                                       b["trajectory"]["latents"]))
            solo, together = solo_then_concurrent(c, reqs)
            assert max(s["batch"] for s in together) > 1
            for a, b in zip(together, solo):
                diffs["output"] = max(diffs["output"], _scaled(a["output"], b["output"]))
        record_property("max_diff", diffs)
        print(f"\n[{model} --compile] {diffs}")
        assert diffs["output"] <= 1e-4 and diffs["log_probs"] <= 1e-4
        assert "Recompiling" not in e.log_text().split("ready on")[-1]  # nothing compiled after the warm-up
    finally:
        e.stop()
