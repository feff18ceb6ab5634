"""Wan image-to-video on the family layer, in process: the workers' own path (tests/family_harness.py: the
encoder worker's image side, the denoise worker's tasks and batched forwards, the decoder) against diffusers'
``WanImageToVideoPipeline`` / ``WanPipeline`` and the trainer's recompute.

Three tiny configurations other than the built-in ones, built into pytest temp directories:

- ``clip``: Wan2.1 I2V-like, a CLIP image encoder with other sizes than tiny-wan-i2v's, another flow shift;
- ``a14b``: Wan2.2 I2V-A14B-like, no image encoder, two experts with another boundary;
- ``ti2v``: Wan2.2 TI2V-5B-like, ``expand_timesteps`` with the 48-channel, 16x VAE, other widths.

1. Serving equals the pipeline on the same directory, image and seed (latents and frames within 1e-4): CFG on
   and off, a non-square size, an image of another size that must be resized, a last image where the model
   takes one; TI2V's text-to-video equals ``WanPipeline(expand_timesteps=True)``.
2. Rollouts: log-probs equal ``TrainerPolicy.log_probs`` with the image within 1e-5; trajectories hold the
   noise latents only; TI2V leaves frame 0 out of the log-prob.
3. Batching: requests with different images at different steps share forwards and equal their runs alone
   within 1e-5; a group of 3 equals each seed alone.
4. The router's rules: ``image`` required, optional or refused by model; ``last_image`` only where the model
   conditions on one; TI2V's sizes are multiples of 32.
"""

from __future__ import annotations

import dataclasses

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from common.config.engine import Limits
from common.families import read_model
from common.builtin import ensure_builtin
from common.builtin.build import build as build_tiny_wan_i2v
from common.builtin.specs.wan_i2v import SPECS as I2V_SPECS
from common.protocol.messages import LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, RolloutParams
from conftest import reference_pipeline
from family_harness import InProcess, compare_tasks, max_diff
from rl import TrainerPolicy, Trajectory
from router.core.request_params import to_params
from router.core.errors import FieldError
from router.request.schemas import GenerateBody

TOL = 1e-4
RECOMPUTE_TOL = 1e-5
BATCH_TOL = 1e-5

CLIP = dataclasses.replace(
    I2V_SPECS["tiny-wan-i2v"], name="wan-i2v-test-clip", num_attention_heads=3, attention_head_dim=8,
    vision_hidden_size=24, vision_heads=3, vision_layers=1, vision_intermediate_size=40, vision_image_size=48,
    vision_patch_size=16, flow_shift=2.0, seed=21, height=32, width=48)
A14B = dataclasses.replace(
    I2V_SPECS["tiny-wan-i2v-a14b"], name="wan-i2v-test-a14b", num_layers=1, boundary_ratio=0.8, flow_shift=4.0,
    seed=22, height=48, width=32)
TI2V = dataclasses.replace(
    I2V_SPECS["tiny-wan-ti2v"], name="wan-i2v-test-ti2v", num_attention_heads=3, attention_head_dim=8,
    ffn_dim=40, seed=23, height=64, width=96)
SPECS = {"clip": CLIP, "a14b": A14B, "ti2v": TI2V}


def picture(h: int, w: int, seed: int) -> Image.Image:
    """A smooth seeded RGB picture (the VAE sees structure, not only noise), of another size than requested."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(6 * x + seed), np.cos(5 * y - seed), np.sin(4 * (x + y))], axis=-1)
    noisy = 127.5 * (1 + base) + rng.normal(0, 12, (h, w, 3))
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8))


IMAGE, OTHER, LAST = picture(40, 24, 1), picture(70, 50, 2), picture(24, 40, 3)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    out = {}
    for key, spec in SPECS.items():
        out[key] = InProcess(build_tiny_wan_i2v(spec, tmp_path_factory.mktemp(spec.name)))
    return out


def _params(eng: InProcess, **over):
    d = eng.info.defaults
    return eng.params(**{"num_frames": d["num_frames"], "negative_prompt": "blurry, still", "seed": 3, **over})


def _pipe(eng: InProcess, text_to_video: bool = False):
    import diffusers

    cls = diffusers.WanPipeline if text_to_video else diffusers.WanImageToVideoPipeline
    return reference_pipeline(cls.from_pretrained(eng.info.path, dtype=torch.float32))


def _reference(eng: InProcess, p, output_type: str, image=None, last_image=None) -> torch.Tensor:
    kwargs = dict(prompt=p.prompt, negative_prompt=p.negative_prompt, height=p.height, width=p.width,
                  num_frames=p.num_frames, num_inference_steps=p.num_inference_steps,
                  guidance_scale=p.guidance_scale, generator=torch.Generator("cpu").manual_seed(p.seed),
                  output_type=output_type, max_sequence_length=p.max_sequence_length)
    if p.fields.get("guidance_scale_2") is not None:
        kwargs["guidance_scale_2"] = p.fields["guidance_scale_2"]
    if image is None:
        out = _pipe(eng, text_to_video=True)(**kwargs).frames
    else:
        out = _pipe(eng)(image=image, last_image=last_image, **kwargs).frames
    return torch.as_tensor(out)


PARITY = {
    "clip-cfg": ("clip", {}, False),
    "clip-no-cfg": ("clip", {"guidance_scale": 1.0}, False),
    "a14b-last-image": ("a14b", {"guidance_scale_2": 2.0}, True),
    "a14b-non-square": ("a14b", {"height": 32, "width": 64}, False),
    "ti2v-image": ("ti2v", {}, False),
    "ti2v-square": ("ti2v", {"height": 64, "width": 64, "guidance_scale": 1.0}, False),
}


@pytest.mark.parametrize("case", list(PARITY), ids=list(PARITY))
def test_serving_equals_diffusers(case, engines, record_property):
    key, over, with_last = PARITY[case]
    eng = engines[key]
    p = _params(eng, **over)
    last = LAST if with_last else None
    task = eng.run(p, image=IMAGE, last_image=last)
    latents = task.output_latents()
    d_lat = max_diff(latents, _reference(eng, p, "latent", IMAGE, last))
    d_frames = max_diff(eng.frames(latents, p)[0], _reference(eng, p, "np", IMAGE, last)[0])
    record_property("max_abs_diff", max(d_lat, d_frames))
    print(f"\n[{case}] latents {d_lat:.3g} frames {d_frames:.3g}")
    assert d_lat <= TOL and d_frames <= TOL


def test_the_image_conditions_the_video(engines):
    """Another image gives another video, and frame 0 of TI2V's result is the image's latent exactly."""
    for key, eng in engines.items():
        p = _params(eng)
        a, b = eng.run(p, image=IMAGE).output_latents(), eng.run(p, image=OTHER).output_latents()
        assert max_diff(a, b) > 1e-2, key
    eng = engines["ti2v"]
    p = _params(eng)
    wire = eng.image_wire(p, IMAGE)
    assert torch.equal(eng.run(p, image=IMAGE).output_latents()[:, :, :1], wire["image_condition"][None])


def test_ti2v_text_to_video_equals_wan_pipeline(engines):
    eng = engines["ti2v"]
    p = _params(eng)
    task = eng.run(p)
    assert max_diff(task.output_latents(), _reference(eng, p, "latent")) <= TOL


# --- 2. rollouts --------------------------------------------------------------------------------------------


def _rollout(p, **over):
    return msgspec.structs.replace(p, output_type="latent", rollout=RolloutParams(
        sde_type=over.get("sde_type", "sde"), noise_level=0.7, return_trajectory=True,
        sde_step_indices=over.get("window")))


ROLLOUTS = {"clip-sde": ("clip", {}), "a14b-cps-window": ("a14b", {"sde_type": "cps", "window": [0, 2]}),
            "ti2v-sde": ("ti2v", {})}


@pytest.mark.parametrize("case", list(ROLLOUTS), ids=list(ROLLOUTS))
def test_rollout_log_probs_equal_trainer_recompute(case, engines, record_property):
    key, over = ROLLOUTS[case]
    eng = engines[key]
    p = _rollout(_params(eng), **over)
    task = eng.run(p, image=IMAGE)
    ex = task.extras()
    traj = ex[TRAJECTORY_LATENTS.name][0]
    assert traj.shape[1:] == task.latents.shape[1:] and traj.shape[1] == eng.info.latent_channels  # noise only
    trainer = TrainerPolicy(eng.info.path)
    image = trainer.image(p, IMAGE)
    with torch.no_grad():
        mine = trainer.log_probs(Trajectory(traj, ex["trajectory.timesteps"], ex["trajectory.sigmas"]),
                                 ex[LOG_PROB_STEPS.name], p, image=image)
    d = max_diff(mine, ex[LOG_PROBS.name][0])
    record_property("max_abs_diff", d)
    print(f"\n[{case}] recompute {d:.3g}")
    assert ex[LOG_PROBS.name].numel() > 0 and d <= RECOMPUTE_TOL


def test_ti2v_frame_0_is_left_out_of_the_log_prob(engines):
    """The engine's TI2V log-prob is the Gaussian log-density averaged over frames 1.. only: recomputed here
    from the trajectory with the same sde_step on the frames alone, and different from the all-frame average."""
    from common.diffusion.policy import step_at
    from common.diffusion.step_variants import Sde

    eng = engines["ti2v"]
    p = _rollout(_params(eng))
    task = eng.run(p, image=IMAGE)
    ex = task.extras()
    traj, sigmas = ex[TRAJECTORY_LATENTS.name][0], ex["trajectory.sigmas"]
    trainer = TrainerPolicy(eng.info.path)
    image = trainer.image(p, IMAGE)
    cond, uncond = trainer.embeddings(p, image)
    i = 1
    with torch.no_grad():
        v = trainer.velocity(traj[i : i + 1], ex["trajectory.timesteps"][i], cond, uncond, p, image)
    later = step_at(sigmas, i, v[:, :, 1:], traj[i : i + 1, :, 1:], Sde(noise_level=0.7),
                    prev_sample=traj[i + 1 : i + 2, :, 1:]).log_prob[0]
    every = step_at(sigmas, i, v, traj[i : i + 1], Sde(noise_level=0.7),
                    prev_sample=traj[i + 1 : i + 2]).log_prob[0]
    engine = ex[LOG_PROBS.name][0, i]
    assert abs(engine - later) <= RECOMPUTE_TOL and abs(engine - every) > 1e-4, (engine, later, every)


# --- 3. batching --------------------------------------------------------------------------------------------


def _advance_together(eng: InProcess, tasks) -> None:
    """The worker's loop: each round, the oldest unfinished task and those on its expert share a forward."""
    while not all(t.done for t in tasks):
        live = [t for t in tasks if not t.done]
        expert = eng.policy.expert_for(live[0].timestep)
        eng.step([t for t in live if eng.policy.expert_for(t.timestep) == expert])


@pytest.mark.parametrize("key", list(SPECS))
@pytest.mark.parametrize("mode", ["serving", "sde"])
def test_requests_with_different_images_batched_equal_their_runs_alone(key, mode, engines, record_property):
    eng = engines[key]
    base = _params(eng)
    reqs = [(base, IMAGE), (msgspec.structs.replace(base, seed=8, prompt="a boat"), OTHER),
            (msgspec.structs.replace(base, seed=9, guidance_scale=1.0), LAST)]
    if mode == "sde":
        reqs = [(_rollout(p), im) for p, im in reqs]
    alone = [eng.run(p, image=im) for p, im in reqs]
    before = eng.shared_forwards
    tasks = [eng.task(reqs[0][0], image=reqs[0][1])]
    eng.step(tasks)  # the first request is a step ahead of the others
    tasks += [eng.task(p, image=im) for p, im in reqs[1:]]
    _advance_together(eng, tasks)
    assert eng.shared_forwards > before
    d = max(compare_tasks(t, a) for t, a in zip(tasks, alone))
    record_property("max_abs_diff", d)
    # Of the latents' scale, as tests/test_multi_device.py's: they reach 5.3 here, where 1e-5 is 20 float32 steps
    # (1.1e-5 seen with the weights 64-byte aligned, 6.4e-6 with them where the safetensors file put them).
    scale = max(1.0, max(a.latents.abs().max().item() for a in alone))
    assert d <= BATCH_TOL * scale, (key, mode, d, scale)


@pytest.mark.parametrize("key", list(SPECS))
def test_a_group_equals_each_seed_alone(key, engines):
    eng = engines[key]
    p = _rollout(_params(eng, n=3))
    group = eng.run(p, image=IMAGE)
    for i in range(3):
        one = eng.run(msgspec.structs.replace(p, n=1, seed=p.seed + i), image=IMAGE)
        assert max_diff(group.latents[i : i + 1], one.latents) <= BATCH_TOL
        assert max_diff(group.extras()[LOG_PROBS.name][i], one.extras()[LOG_PROBS.name][0]) <= BATCH_TOL


# --- 4. the router's rules --------------------------------------------------------------------------------------


def _check(info, **body):
    return to_params(GenerateBody(prompt="a fox", **body), info, Limits())


def _refused(info, field: str, **body) -> str:
    with pytest.raises(FieldError) as e:
        _check(info, **body)
    assert e.value.field == field, (field, str(e.value))
    return str(e.value)


def test_router_rules_for_images(engines):
    clip, a14b, ti2v = (engines[k].info for k in ("clip", "a14b", "ti2v"))
    assert "makes videos from an image" in _refused(clip, "image")
    assert _check(clip, image="x").num_frames == clip.defaults["num_frames"]  # the pixels: router/request/images.py
    assert "first-last-frame" in _refused(clip, "last_image", image="x", last_image="y")
    assert _check(a14b, image="x", last_image="y")
    # one frame has no frames between the two (the pipeline's would be -1): refused, not a worker's error
    assert "two frames or more" in _refused(a14b, "num_frames", image="x", last_image="y", num_frames=1)
    assert "needs image" in _refused(ti2v, "last_image", last_image="y")
    assert "512" in _refused(clip, "max_sequence_length", image="x", max_sequence_length=64)
    assert _check(a14b, image="x", max_sequence_length=64).max_sequence_length == 64
    _check(ti2v)  # text-to-video
    _check(ti2v, image="x")
    _refused(ti2v, "last_image", image="x", last_image="y")
    assert "multiple of 32" in _refused(ti2v, "height", height=48, image="x")
    for name in ("tiny", "tiny-sd3"):  # text-only models
        assert "takes no image" in _refused(read_model(ensure_builtin(name)), "image", image="x")


# --- 5. LoRA ------------------------------------------------------------------------------------------------

# The attention projections (Wan's default targets) plus the image cross-attention's own keys and values.
I2V_TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "add_k_proj", "add_v_proj")


def test_lora_equals_diffusers_and_mixed_adapters_with_images_share_a_forward(engines, tmp_path, record_property):
    import lora_fixtures as lf
    from common.diffusion.lora import build_adapter
    from common.diffusion.lora_format import read_lora

    eng = engines["clip"]
    model_dir = eng.info.path
    a = lf.make_diffusers_lora(model_dir, tmp_path / "a", rank=4, alpha=8, target_modules=I2V_TARGETS, seed=1)
    b = lf.make_peft_lora(model_dir, tmp_path / "b", rank=2, alpha=2, target_modules=["ffn.net.0.proj", "to_v"],
                          seed=2)
    adapters = {}
    for name, ad in (("a", a), ("b", b)):
        adapters[name] = build_adapter(name, 1, read_lora(str(ad.path), None), eng.policy.experts, 64)
        eng.policy.cover(adapters[name])
    p = _params(eng)
    pipe = _pipe(eng)
    twins = {"a": a.path, "b": lf.diffusers_twin(b, tmp_path / "b-twin")}
    diffs = {}
    for name, scale in (("a", 0.8), ("b", 1.0)):
        got = eng.run(p, lora=(adapters[name], scale), image=IMAGE).output_latents()
        pipe.load_lora_weights(str(twins[name]), adapter_name=name)
        try:
            pipe.set_adapters([name], [scale])
            want = torch.as_tensor(pipe(image=IMAGE, prompt=p.prompt, negative_prompt=p.negative_prompt,
                                        height=p.height, width=p.width, num_frames=p.num_frames,
                                        num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                                        generator=torch.Generator("cpu").manual_seed(p.seed),
                                        output_type="latent").frames)
        finally:
            pipe.unload_lora_weights()
        assert max_diff(got, eng.run(p, image=IMAGE).output_latents()) > 1e-3  # the adapter changes the output
        diffs[name] = max_diff(got, want)
    jobs = [(_params(eng, seed=5), (adapters["a"], 1.0), IMAGE), (_params(eng, seed=6), (adapters["b"], 0.5), OTHER),
            (_params(eng, seed=7), None, LAST)]
    tasks = [eng.task(jp, lo, image=im) for jp, lo, im in jobs[:1]]
    eng.step(tasks)
    tasks += [eng.task(jp, lo, image=im) for jp, lo, im in jobs[1:]]
    _advance_together(eng, tasks)
    diffs["mixed"] = max(max_diff(t.latents, eng.run(jp, lo, image=im).latents) for t, (jp, lo, im) in zip(tasks, jobs))
    record_property("max_diff", diffs)
    print(f"\n[clip] LoRA {diffs}")
    assert diffs["a"] <= TOL and diffs["b"] <= TOL and diffs["mixed"] <= BATCH_TOL


# --- 6. --compile's building blocks on image to video -------------------------------------------------------

COMPILE_TOL = 1e-4


@pytest.mark.heavy  # compiling a family's transformer takes 10-25 s here: tests/test_compile.py covers compiling by default
@pytest.mark.parametrize("key", ["clip", "ti2v"])
def test_compiled_forwards_with_images_equal_eager(key, engines, record_property):
    """An I2V model (condition channels, CLIP's image tokens) and TI2V (a timestep per token, frame 0 from
    the image) through inductor, warmed up as a --compile worker: a guided sample and a batch of requests with
    different images (and, on TI2V, one without) equal eager, and nothing compiles after the warm-up."""
    from common.diffusion.compiled import compile_experts, uncompile, warm_up
    from common.diffusion.policy import Policy
    from test_sd3 import _graphs, _no_grad

    eager = engines[key]
    torch.set_num_threads(eager.max_threads)  # as a --compile worker: its one thread count (graphs guard on it)
    compiled = Policy.load(eager.info, torch.float32, "cpu")
    compile_experts(compiled, log_recompiles=False)
    try:
        before = _graphs()
        warm_up(compiled)
        assert _graphs() > before
        p = _params(eager)
        tasks = [eager.task(p, image=IMAGE), eager.task(msgspec.structs.replace(p, seed=5, prompt="a boat"),
                                                        image=OTHER),
                 eager.task(msgspec.structs.replace(p, seed=6, guidance_scale=1.0),
                            image=None if key == "ti2v" else LAST)]
        single = tasks[0].model_input()
        got, graphs = _no_grad(compiled.velocity, single)
        d_single = max_diff(got, _no_grad(eager.policy.velocity, single)[0])
        assert graphs == 0
        inputs = [t.model_input() for t in tasks]
        got, graphs = _no_grad(compiled.batched_velocity, inputs)
        want = _no_grad(eager.policy.batched_velocity, inputs)[0]
        d_batched = max(max_diff(a, b) for a, b in zip(got, want))
        assert graphs == 0
    finally:
        uncompile(compiled.experts)
    record_property("max_diff", {"guided": d_single, "batched": d_batched})
    print(f"\n[{key}] compiled guided {d_single:.3g} batched {d_batched:.3g}")
    assert d_single <= COMPILE_TOL and d_batched <= COMPILE_TOL


# --- 7. the encoder worker's image side -------------------------------------------------------------------------


def test_the_encoder_stage_encodes_an_image_once_per_size_and_a_bad_one_fails_alone(engines):
    """The encoder worker's own stage: its tensors are the image side's; a group (one request) and a repeated
    image cost one encode (its cache keys on the pixels and the request's size and frames), another size
    encodes again; a request whose image cannot be encoded fails alone."""
    from common.config.engine import EngineConfig, WorkerSpec
    from common.protocol.messages import PROTOCOL_VERSION, EncodeRequest, Route
    from encoder_worker.stage import EncoderStage

    eng = engines["clip"]
    stage = EncoderStage(EngineConfig(model=str(eng.info.path), workers=[], router_endpoint="", runtime_dir="/tmp"),
                         WorkerSpec(role="encoder", index=0))
    stage.load()
    calls = []
    real = stage.images.wire_tensors
    stage.images.wire_tensors = lambda *a: calls.append(a[2:]) or real(*a)  # a spy: the real encoder runs

    def request(rid: str, **over):
        return EncodeRequest(v=PROTOCOL_VERSION, request_id=rid, route=Route(encoder=0, denoise=0, decode=0),
                             params=_params(eng, **over))

    pixels = {"image": torch.from_numpy(np.asarray(IMAGE).copy())}
    out = stage.process_batch([(request("a", n=3), pixels), (request("b", seed=9), dict(pixels))])
    assert len(calls) == 1
    want = eng.image_wire(_params(eng), IMAGE)
    for fwd in out:
        assert all(torch.equal(fwd.tensors[k], want[k]) for k in want)
        assert "image_encode_s" in fwd.msg.timings
    stage.process_batch([(request("c", height=48, width=32), dict(pixels))])
    assert len(calls) == 2 and calls[-1] == (48, 32, eng.info.defaults["num_frames"])
    broken = {"image": torch.zeros(4, 4, 2, dtype=torch.uint8)}  # not RGB: the worker refuses it, not the batch
    out = stage.process_batch([(request("d"), broken), (request("e"), dict(pixels))])
    assert isinstance(out[0], BaseException) and not isinstance(out[1], BaseException)


# --- 8. first-last-frame (Wan2.1 FLF2V: both frames' CLIP tokens) ---------------------------------------------


def test_first_last_frame_model_equals_diffusers_and_the_trainer(tmp_path, record_property):
    spec = dataclasses.replace(CLIP, name="wan-i2v-test-flf2v", first_last_frame=True, seed=24)
    eng = InProcess(build_tiny_wan_i2v(spec, tmp_path / "flf2v"))
    assert eng.info.transformer_config["pos_embed_seq_len"] == 2 * spec.image_tokens
    p = _params(eng)
    task = eng.run(p, image=IMAGE, last_image=LAST)
    d = max_diff(task.output_latents(), _reference(eng, p, "latent", IMAGE, LAST))
    assert max_diff(task.output_latents(), eng.run(p, image=IMAGE, last_image=OTHER).output_latents()) > 1e-2
    r = _rollout(p)
    batched = [eng.task(r, image=IMAGE, last_image=LAST), eng.task(msgspec.structs.replace(r, seed=8), image=OTHER,
                                                                     last_image=IMAGE)]
    _advance_together(eng, batched)
    ex = batched[0].extras()
    trainer = TrainerPolicy(eng.info.path)
    image = trainer.image(r, IMAGE, last_image=LAST)
    with torch.no_grad():
        mine = trainer.log_probs(Trajectory(ex[TRAJECTORY_LATENTS.name][0], ex["trajectory.timesteps"],
                                            ex["trajectory.sigmas"]), ex[LOG_PROB_STEPS.name], r, image=image)
    alone = eng.run(msgspec.structs.replace(r, seed=8), image=OTHER, last_image=IMAGE)
    record_property("max_abs_diff", d)
    assert d <= TOL
    assert max_diff(mine, ex[LOG_PROBS.name][0]) <= BATCH_TOL  # rows of two requests in one forward
    assert compare_tasks(batched[1], alone) <= BATCH_TOL
    assert "between two frames" in _refused(eng.info, "last_image", image="x")
    assert _check(eng.info, image="x", last_image="y")
