"""FLUX.1 and Qwen-Image on the family layer, in process: the workers' own path (tests/family_harness.py)
against diffusers' ``FluxPipeline`` / ``QwenImagePipeline`` and the trainer's recompute.

Per family, two tiny configurations other than the built-in ones, built into pytest temp directories
(FLUX: one FLUX.1-dev-like with embedded guidance, one FLUX.1-schnell-like without, other widths and shift
settings; Qwen-Image: two widths, rotary axes and shift settings). Everything float32 on the CPU, seeded.

1. Serving equals the pipeline on the same directory and seed (packed latents and frames within 1e-4):
   without ``mu`` (the pipeline's ``calculate_shift``), with an explicit ``mu``, at two sizes (two sequence
   lengths, two ``mu``), with and without true CFG.
2. Rollouts: log-probs equal ``TrainerPolicy.log_probs`` within 1e-5, with the request's ``mu`` and
   without; the rollout scheduler's sigmas are the serving scheduler's (the same ``mu`` and sigmas).
3. Batching: requests at different steps sharing forwards, texts of different lengths in one forward,
   two sizes side by side, and a group of 3 equal their runs alone within 1e-5.
4. The router's rules: ``mu`` on a family without dynamic shifting, true CFG without a negative prompt,
   ``guidance_scale`` on a transformer without a guidance embedding: each a FieldError naming the field.
5. LoRA: diffusers files and peft folders against diffusers' loaders; mixed adapters in one batch.
6. ``--compile``'s building blocks: compiled forwards (true CFG, FLUX's embedded guidance, rows of requests with
   texts of other lengths) equal eager ones, and nothing compiles after the warm-up.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from common.config.engine import Limits
from common.diffusion import schedulers
from common.diffusion.policy import ModelInput, Policy
from common.families import read_model
from common.builtin import ensure_builtin
from common.builtin.build import build as build_builtin
from common.builtin.specs.flux import SPECS as FLUX_SPECS
from common.builtin.specs.qwen_image import SPECS as QWEN_SPECS
from common.protocol.messages import (
    LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, TRAJECTORY_TIMESTEPS, GenerationParams,
    RolloutParams,
)
from family_harness import CPU, DTYPE, InProcess, ModuleModels, compare_tasks, max_diff
from rl import Trajectory
from router.core.request_params import to_params
from router.core.errors import FieldError
from router.request.schemas import GenerateBody
from test_sd3 import _graphs, _no_grad

TOL = 1e-4
RECOMPUTE_TOL = 1e-5
BATCH_TOL = 1e-5

# FLUX.1-dev-like (embedded guidance) with other widths, rotary axes, text encoders and shift settings: the
# sequence-length range is narrowed so that 48x80 and 64x64 get clearly different mu.
FLUX_X = dataclasses.replace(
    FLUX_SPECS["tiny-flux"], name="flux-test-x", num_layers=2, num_single_layers=1, num_attention_heads=3,
    attention_head_dim=12, axes_dims_rope=(2, 4, 6), clip_l_hidden_size=24, clip_l_num_heads=3,
    clip_l_intermediate_size=40, t5_d_model=40, t5_d_kv=8, t5_d_ff=56, t5_num_heads=5, base_shift=0.3,
    max_shift=1.4, base_image_seq_len=8, max_image_seq_len=64, seed=5, num_inference_steps=4, max_sequence_length=24)
# FLUX.1-schnell-like: no guidance embedding, one double-stream block, a wider VAE, a non-square default size.
FLUX_Y = dataclasses.replace(
    FLUX_SPECS["tiny-flux"], name="flux-test-y", guidance_embeds=False, num_layers=1, num_single_layers=2,
    num_attention_heads=2, attention_head_dim=20, axes_dims_rope=(4, 8, 8), t5_d_model=48, t5_num_layers=1,
    vae_block_out_channels=(8, 8, 16, 16), vae_norm_num_groups=8, shift=1.0, base_shift=0.6, max_shift=1.0,
    base_image_seq_len=16, max_image_seq_len=128, seed=11, height=80, width=48, num_inference_steps=3,
    max_sequence_length=20)
# Qwen-Image with other widths, heads, rotary axes and text encoder; its scheduler's shift settings are
# rewritten after the build (SCHEDULERS), the second one with another terminal sigma.
QWEN_X = dataclasses.replace(
    QWEN_SPECS["tiny-qwen-image"], name="qwen-test-x", num_layers=3, num_attention_heads=3, attention_head_dim=12,
    axes_dims_rope=(2, 4, 6), text_hidden_size=48, text_num_heads=3, text_num_kv_heads=1, text_intermediate_size=40,
    seed=5, num_inference_steps=4, max_sequence_length=48)
QWEN_Y = dataclasses.replace(
    QWEN_SPECS["tiny-qwen-image"], name="qwen-test-y", num_layers=1, attention_head_dim=20, axes_dims_rope=(4, 8, 8),
    vae_base_dim=4, seed=11, height=80, width=48, num_inference_steps=3, max_sequence_length=32)
# FLUX_X with one block of each kind: the cheapest FLUX.1-dev-like model to compile (section 6).
FLUX_X1 = dataclasses.replace(FLUX_X, name="flux-test-x1", num_layers=1, num_single_layers=1)
SPECS = {"flux-x": (FLUX_X, build_builtin), "flux-y": (FLUX_Y, build_builtin),
         "flux-x1": (FLUX_X1, build_builtin),
         "qwen-x": (QWEN_X, build_builtin), "qwen-y": (QWEN_Y, build_builtin)}
SCHEDULERS = {"qwen-x": dict(base_image_seq_len=8, max_image_seq_len=64, max_shift=1.2),
              "qwen-y": dict(base_shift=0.4, max_shift=0.8, base_image_seq_len=16, max_image_seq_len=256,
                             shift_terminal=0.05)}


@pytest.fixture(scope="module", autouse=True)
def _module_state():
    yield from _MODELS.module_scope(_DIRS)


_DIRS: dict[str, Path] = {}
_MODELS = ModuleModels()


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    def get(which: str) -> Path:
        if which not in _DIRS:
            spec, build = SPECS[which]
            _DIRS[which] = build(spec, tmp_path_factory.mktemp(which))
            if which in SCHEDULERS:
                file = _DIRS[which] / "scheduler" / "scheduler_config.json"
                file.write_text(json.dumps({**json.loads(file.read_text()), **SCHEDULERS[which]}))
        return _DIRS[which]
    return get


def engine(dirs, which: str) -> InProcess:
    return _MODELS.engine(dirs(which))


pipe_for = _MODELS.pipe


def diffusers_output(model_dir: Path, p: GenerationParams, output_type: str) -> torch.Tensor:
    """The family's pipeline on request ``p``: packed latents [1, seq, 64], or frames [1, H, W, 3].

    The pipelines take no ``mu``: an explicit one is given to them through a scheduler whose base and max
    shift are both ``mu`` (``calculate_shift`` then returns it at every sequence length)."""
    pipe = pipe_for(model_dir)
    template = pipe.scheduler
    if p.mu is not None:
        pipe.scheduler = FlowMatchEulerDiscreteScheduler.from_config(
            {**template.config, "base_shift": p.mu, "max_shift": p.mu})
    guided = p.fields.get("true_cfg_scale", 1.0) > 1
    kwargs = dict(prompt=p.prompt, negative_prompt=p.negative_prompt if guided else None,
                  true_cfg_scale=p.fields.get("true_cfg_scale"), height=p.height, width=p.width,
                  num_inference_steps=p.num_inference_steps, max_sequence_length=p.max_sequence_length,
                  generator=torch.Generator("cpu").manual_seed(p.seed), output_type=output_type, sigmas=p.sigmas)
    if read_model(model_dir).transformer_config.get("guidance_embeds"):
        kwargs["guidance_scale"] = p.guidance_scale
    try:
        out = pipe(**kwargs).images
    finally:
        pipe.scheduler = template
    return out if output_type == "latent" else torch.from_numpy(np.asarray(out))


# --- 1. serving equals diffusers ---------------------------------------------------------------------------

PARITY = {
    "flux-embedded-guidance": ("flux-x", dict(seed=1)),
    "flux-true-cfg": ("flux-x", dict(true_cfg_scale=2.5, negative_prompt="blurry, low quality", seed=2)),
    "flux-explicit-mu": ("flux-x", dict(mu=0.9, seed=3, true_cfg_scale=2.0, negative_prompt="dark")),
    "flux-other-size": ("flux-x", dict(height=48, width=80, seed=4)),
    "flux-schnell-like": ("flux-y", dict(seed=5)),
    "flux-schnell-like-cfg-sigmas": ("flux-y", dict(seed=6, height=64, width=64, true_cfg_scale=3.0,
                                                    negative_prompt="noisy", sigmas=[1.0, 0.7, 0.3])),
    "qwen-no-cfg": ("qwen-x", dict(seed=1)),
    "qwen-true-cfg": ("qwen-x", dict(true_cfg_scale=4.0, negative_prompt=" ", seed=2)),
    "qwen-explicit-mu": ("qwen-x", dict(mu=0.7, seed=3, true_cfg_scale=3.0, negative_prompt="blurry")),
    "qwen-other-size": ("qwen-x", dict(height=48, width=80, seed=4, true_cfg_scale=4.0, negative_prompt="dark")),
    "qwen-other-config": ("qwen-y", dict(seed=5, true_cfg_scale=2.0, negative_prompt="a grey blur")),
}


def _no_cfg(eng: InProcess, over: dict) -> dict:
    """A case without a negative prompt runs without true CFG, as the router (and the pipelines) do."""
    return over if "negative_prompt" in over else {**over, "true_cfg_scale": 1.0}


@pytest.mark.parametrize("case", list(PARITY), ids=list(PARITY))
def test_serving_equals_diffusers(case, dirs, record_property):
    which, over = PARITY[case]
    eng = engine(dirs, which)
    p = eng.params(**_no_cfg(eng, over))
    task = eng.run(p)
    assert type(task.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and task.sde is None
    seq = (p.height // 16) * (p.width // 16)
    assert task.latents.shape == (1, seq, 64)  # packed, as the pipelines return them
    ref_latents = diffusers_output(dirs(which), p, "latent")
    frames = eng.frames(task.latents, p)
    ref_frames = diffusers_output(dirs(which), p, "np")
    assert frames.shape == (1, 1, p.height, p.width, 3) and ref_frames.shape == (1, p.height, p.width, 3)
    d_lat, d_img = max_diff(task.latents, ref_latents), max_diff(frames[:, 0], ref_frames)
    record_property("max_diff", {"latents": d_lat, "frames": d_img})
    print(f"\n[{case}] latents {d_lat:.3g} frames {d_img:.3g}")
    assert frames.std() > 1e-3
    assert d_lat <= TOL and d_img <= TOL


@pytest.mark.parametrize("which", ["flux-x", "qwen-x"])
def test_mu_follows_the_sequence_length_unless_given(which, dirs):
    """Two sizes: two mu from calculate_shift, so two schedules; an explicit mu overrides both."""
    eng = engine(dirs, which)
    small, large = eng.params(height=32, width=32), eng.params(height=64, width=96)
    cfg = eng.serving_template.config
    sched = {}
    for name, p in (("small", small), ("large", large)):
        seq = eng.family.latents.image_seq_len(eng.info, p.height, p.width)
        sched[name] = schedulers.build(eng.serving_template, p, image_seq_len=seq, default_sigmas=True)
        want = FlowMatchEulerDiscreteScheduler.from_config(cfg)
        want.set_timesteps(sigmas=np.linspace(1.0, 1 / p.num_inference_steps, p.num_inference_steps),
                           mu=schedulers.calculate_shift(seq, cfg))
        assert torch.equal(sched[name].sigmas, want.sigmas)
    assert not torch.allclose(sched["small"].sigmas, sched["large"].sigmas)
    given = [schedulers.build(eng.serving_template, msgspec.structs.replace(p, mu=0.8), image_seq_len=seq,
                              default_sigmas=True) for p, seq in ((small, 4), (large, 24))]
    assert torch.equal(given[0].sigmas, given[1].sigmas)


# --- 2. rollouts against the trainer's recompute ------------------------------------------------------------

ROLLOUTS = {
    "flux-sde": ("flux-x", dict(rollout=RolloutParams(sde_type="sde", noise_level=0.9, return_trajectory=True),
                                seed=7)),
    "flux-sde-mu-true-cfg": ("flux-x", dict(rollout=RolloutParams(sde_type="sde", noise_level=0.7,
                                                                  return_trajectory=True),
                                            mu=1.1, true_cfg_scale=2.0, negative_prompt="blurry", seed=8)),
    "flux-cps-window": ("flux-y", dict(rollout=RolloutParams(sde_type="cps", noise_level=0.8, sde_step_indices=[1],
                                                             return_trajectory=True), seed=9)),
    "qwen-sde-cfg": ("qwen-x", dict(rollout=RolloutParams(sde_type="sde", noise_level=0.7, return_trajectory=True),
                                    true_cfg_scale=4.0, negative_prompt=" ", seed=7)),
    "qwen-sde-mu": ("qwen-x", dict(rollout=RolloutParams(sde_type="sde", noise_level=0.8, return_trajectory=True),
                                   mu=0.6, seed=8, height=48, width=80)),
}


@pytest.mark.parametrize("case", list(ROLLOUTS), ids=list(ROLLOUTS))
def test_rollout_log_probs_equal_trainer_recompute(case, dirs, record_property):
    which, over = ROLLOUTS[case]
    eng = engine(dirs, which)
    p = eng.params(**_no_cfg(eng, over))
    r = p.rollout
    task = eng.run(p)
    # The rollout scheduler is flow-match Euler with the serving one's config, mu and sigmas.
    assert isinstance(task.scheduler, FlowMatchEulerDiscreteScheduler)
    assert schedulers.check_flow_match_convention(task.scheduler) <= 1e-3
    seq = eng.family.latents.image_seq_len(eng.info, p.height, p.width)
    serving = schedulers.build(eng.serving_template, p, image_seq_len=seq, default_sigmas=True)
    assert torch.allclose(task.scheduler.sigmas, serving.sigmas, atol=1e-6)
    out = task.extras()
    T = p.num_inference_steps
    steps = out[LOG_PROB_STEPS.name].tolist()
    assert steps == (r.sde_step_indices if r.sde_step_indices is not None else list(range(T)))
    log_probs = out[LOG_PROBS.name]
    assert log_probs.shape == (1, len(steps)) and torch.isfinite(log_probs).all()
    traj = Trajectory(out[TRAJECTORY_LATENTS.name][0], out[TRAJECTORY_TIMESTEPS.name], out[TRAJECTORY_SIGMAS.name])
    assert traj.latents.shape == (T + 1, seq, 64)  # packed
    assert torch.allclose(traj.timesteps.double(), traj.sigmas[:-1].double() * 1000, atol=1e-3)
    # x_0: the pipeline's own draw, randn((1, 16, 2 * rows, 2 * cols)) packed.
    noise = torch.randn((1, 16, p.height // 8, p.width // 8), generator=torch.Generator("cpu").manual_seed(p.seed))
    packed = noise.view(1, 16, p.height // 16, 2, p.width // 16, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, seq, 64)
    assert torch.equal(traj.latents[0], packed[0])
    with torch.no_grad():
        again = _MODELS.trainer(dirs(which)).log_probs(traj, steps, p)
    d = max_diff(again, log_probs[0])
    record_property("max_diff", d)
    print(f"\n[{case}] log-probs {d:.3g}")
    assert d <= RECOMPUTE_TOL


# --- 3. batching -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["flux-x", "qwen-x"])
@pytest.mark.parametrize("mode", ["serving", "sde"])
def test_requests_at_different_steps_share_forwards_and_equal_their_runs_alone(which, mode, dirs, record_property):
    eng = engine(dirs, which)
    rollout = RolloutParams(sde_type="sde", noise_level=0.7, return_trajectory=True) if mode == "sde" else None
    # Prompts of different lengths: Qwen-Image's texts are padded and masked in the shared forward.
    pa = eng.params(prompt="a red kite", negative_prompt="blurry", true_cfg_scale=3.0, seed=3, num_inference_steps=5,
                    rollout=rollout, guidance_scale=2.5)
    pb = eng.params(prompt="a quiet harbour at dusk with small fishing boats and gulls", true_cfg_scale=1.0,
                    seed=11, num_inference_steps=5, rollout=rollout, mu=0.9)
    a = eng.task(pa)
    for _ in range(2):
        eng.step([a])
    b = eng.task(pb)
    before = eng.shared_forwards
    while not (a.done and b.done):
        eng.step([t for t in (a, b) if not t.done])
    assert eng.shared_forwards - before == 3
    diffs = [compare_tasks(a, eng.run(pa)), compare_tasks(b, eng.run(pb))]
    record_property("max_diff", diffs)
    print(f"\n[{which} {mode}] batched vs alone {diffs}")
    assert max_diff(a.latents, b.latents) > 1e-2
    assert max(diffs) <= BATCH_TOL


@pytest.mark.parametrize("which", ["flux-x", "qwen-x"])
def test_two_sizes_side_by_side_and_a_group_equal_their_runs_alone(which, dirs, record_property):
    """Two sizes never share a forward (their packed shapes may even agree: 32x64 and 64x32); each, and
    each sample of a group, equals its run alone."""
    eng = engine(dirs, which)
    pa = eng.params(height=32, width=64, seed=4, negative_prompt="blurry", true_cfg_scale=2.0)
    pb = eng.params(height=64, width=32, seed=5, true_cfg_scale=1.0)
    pg = eng.params(seed=20, n=3, negative_prompt="blurry", true_cfg_scale=2.0,
                    rollout=RolloutParams(sde_type="sde", noise_level=0.7, return_trajectory=True))
    tasks = [eng.task(p) for p in (pa, pb, pg)]
    assert tasks[0].latents.shape == tasks[1].latents.shape  # the same packed shape, other position ids
    while not all(t.done for t in tasks):  # as the worker: one forward per (shape, size) group
        for t in tasks:
            if not t.done:
                eng.step([t])
    diffs = [compare_tasks(tasks[0], eng.run(pa)), compare_tasks(tasks[1], eng.run(pb))]
    assert max_diff(tasks[0].latents, tasks[1].latents) > 1e-2
    for i in range(3):
        alone = eng.run(msgspec.structs.replace(pg, seed=pg.seed + i, n=1))
        diffs.append(max_diff(tasks[2].latents[i : i + 1], alone.latents))
        diffs.append(max_diff(tasks[2].extras()[LOG_PROBS.name][i : i + 1], alone.extras()[LOG_PROBS.name]))
    record_property("max_diff", diffs)
    assert max(diffs) <= BATCH_TOL


# --- 4. the router's rules -----------------------------------------------------------------------------------

def _params(info, **body):
    return to_params(GenerateBody(prompt="a fox", **body), info, Limits())


def test_router_rules_for_the_packed_families(dirs):
    flux, schnell, qwen = (engine(dirs, w).info for w in ("flux-x", "flux-y", "qwen-x"))
    sd3 = read_model(ensure_builtin("tiny-sd3"))
    # mu: only a dynamically shifting scheduler takes one.
    assert _params(flux, mu=0.5).mu == 0.5
    with pytest.raises(FieldError) as e:
        _params(sd3, mu=0.5)
    assert e.value.field == "mu"
    # true CFG: with a negative prompt only; the default scale without one is 1 (no CFG), as the pipelines.
    assert _params(qwen).fields["true_cfg_scale"] == 1.0
    assert _params(qwen, negative_prompt=" ").fields["true_cfg_scale"] == 4.0  # QwenImagePipeline's default
    assert _params(flux, negative_prompt="x", true_cfg_scale=3.0).fields["true_cfg_scale"] == 3.0
    with pytest.raises(FieldError) as e:
        _params(flux, true_cfg_scale=3.0)
    assert e.value.field == "true_cfg_scale"
    with pytest.raises(FieldError) as e:
        _params(sd3, true_cfg_scale=3.0)
    assert e.value.field == "true_cfg_scale"
    # guidance_scale: FLUX.1-dev's embedded guidance; refused where the transformer has no guidance embedding.
    assert _params(flux, guidance_scale=5.0).guidance_scale == 5.0
    for info in (schnell, qwen):
        with pytest.raises(FieldError) as e:
            _params(info, guidance_scale=5.0)
        assert e.value.field == "guidance_scale"
    # Qwen-Image's terminal sigma needs two steps at least (one gives diffusers NaN).
    with pytest.raises(FieldError) as e:
        _params(qwen, num_inference_steps=1)
    assert e.value.field == "num_inference_steps"
    assert _params(flux, num_inference_steps=1).num_inference_steps == 1
    # Image families: one frame; sizes in multiples of 16.
    with pytest.raises(FieldError) as e:
        _params(flux, num_frames=5)
    assert e.value.field == "num_frames"
    with pytest.raises(FieldError) as e:
        _params(qwen, height=40)
    assert e.value.field == "height"


# --- 5. LoRA -------------------------------------------------------------------------------------------------

# A peft adapter on other modules: the single-stream MLP (FLUX), the feed-forwards (Qwen-Image), the
# modulations and the text input projection.
PEFT_TARGETS = {"flux-x": ["attn.to_q", "attn.add_v_proj", "proj_mlp", "norm1.linear", "context_embedder"],
                "qwen-x": ["attn.to_q", "attn.add_v_proj", "img_mlp.net.2", "txt_mod.1", "txt_in"]}


@pytest.mark.parametrize("which", ["flux-x", "qwen-x"])
def test_lora_equals_diffusers_and_mixed_adapters_share_a_forward(which, dirs, tmp_path, record_property):
    import lora_fixtures as lf
    from common.diffusion.lora import build_adapter
    from common.diffusion.lora_format import read_lora

    eng, model_dir = engine(dirs, which), dirs(which)
    a = lf.make_diffusers_lora(model_dir, tmp_path / "a", rank=4, alpha=8, target_modules=eng.family.transformer.lora_targets,
                               seed=1)
    b = lf.make_peft_lora(model_dir, tmp_path / "b", rank=2, alpha=2, target_modules=PEFT_TARGETS[which], seed=2)
    adapters = {}
    for name, ad in (("a", a), ("b", b)):
        adapters[name] = build_adapter(name, 1, read_lora(str(ad.path), None), eng.policy.experts, 64)
        eng.policy.cover(adapters[name])
    p = eng.params(seed=3, negative_prompt="blurry", true_cfg_scale=2.0)
    pipe = pipe_for(model_dir)
    diffs = {}
    # diffusers reads the peft folder's twin in its own format (its loader takes base_model.model. keys for BFL's).
    twins = {"a": a.path, "b": lf.diffusers_twin(b, tmp_path / "b-twin")}
    for name, scale in (("a", 0.8), ("b", 1.0)):
        got = eng.run(p, lora=(adapters[name], scale)).latents
        pipe.load_lora_weights(str(twins[name]), adapter_name=name)
        try:
            pipe.set_adapters([name], [scale])
            want = diffusers_output(model_dir, p, "latent")
        finally:
            pipe.unload_lora_weights()
        assert max_diff(got, eng.run(p).latents) > 1e-3  # the adapter changes the output
        diffs[name] = max_diff(got, want)
    # Mixed in one batch at different steps: adapter a, adapter b, the base model.
    jobs = [(eng.params(seed=5, num_inference_steps=5), (adapters["a"], 1.0)),
            (eng.params(seed=6, num_inference_steps=5, negative_prompt="x", true_cfg_scale=2.0), (adapters["b"], 0.5)),
            (eng.params(seed=7, num_inference_steps=5), None)]
    tasks = [eng.task(jp, lo) for jp, lo in jobs[:1]]
    eng.step(tasks)
    tasks += [eng.task(jp, lo) for jp, lo in jobs[1:]]
    while not all(t.done for t in tasks):
        eng.step([t for t in tasks if not t.done])
    diffs["mixed"] = max(max_diff(t.latents, eng.run(jp, lo).latents) for t, (jp, lo) in zip(tasks, jobs))
    record_property("max_diff", diffs)
    print(f"\n[{which}] LoRA {diffs}")
    assert diffs["a"] <= TOL and diffs["b"] <= TOL and diffs["mixed"] <= BATCH_TOL


# --- 6. --compile's building blocks on the packed families ----------------------------------------------------

# Of the tensor's scale: FLUX's sinusoidal embeddings of timestep x 1000 and guidance x 1000 turn inductor's
# last-bit differences in their frequencies into ~1e-5 of outputs that reach ~25 with true CFG (measured: with
# timestep and guidance 0 the compiled forward is within 1e-6 of eager).
COMPILE_TOL = 1e-4


def _scaled(a: torch.Tensor, b: torch.Tensor) -> float:
    return max_diff(a, b) / max(1.0, b.abs().max().item())


@pytest.mark.heavy  # compiling a family's transformer takes 10-25 s here: tests/test_compile.py covers compiling by default
@pytest.mark.parametrize("which", ["flux-x1", "qwen-y"])
def test_compiled_forwards_equal_eager(which, dirs, record_property):
    """One compile per family (inductor, as tests/test_compile.py), warmed up at the default request; then
    a guided sample, rows of three requests at other timesteps (texts of other lengths: Qwen-Image pads and
    masks them; FLUX: each its own embedded guidance) and a group without CFG, against eager forwards."""
    from common.diffusion.compiled import compile_experts, warm_up

    eager = engine(dirs, which)
    torch.set_num_threads(eager.max_threads)  # as a --compile worker: its one thread count (graphs guard on it)
    compiled = Policy.load(eager.info, DTYPE, CPU)
    compile_experts(compiled, log_recompiles=False)
    before = _graphs()
    seconds = warm_up(compiled)
    assert list(seconds) == ["transformer"] and _graphs() - before >= 1  # the warm-up did compile
    print(f"\n[{which} compile] warm-up {seconds['transformer']:.1f}s")
    fox = eager.task(eager.params(prompt="a red fox in the snow", negative_prompt="blurry", true_cfg_scale=3.0))
    boat = eager.task(eager.params(prompt="a small boat on a calm lake at dawn, gulls overhead",
                                   negative_prompt="blurry", true_cfg_scale=3.0))
    x = fox.model_input()  # the default request's latent shape, token grid and embedded guidance (or None)
    g = torch.Generator().manual_seed(9)

    def rows(n, t, task, cfg, guidance):
        return ModelInput(torch.randn(n, *x.latents.shape[1:], generator=g), torch.tensor(t), task.cond,
                          task.uncond if cfg > 1 else None, cfg, grid=x.grid,
                          embedded_guidance=None if x.embedded_guidance is None else guidance)

    single = rows(1, 900.0, fox, 3.0, 3.5)  # true CFG: two forwards of one row
    got, graphs = _no_grad(compiled.velocity, single)
    diffs = {"guided": _scaled(got, _no_grad(eager.policy.velocity, single)[0])}
    assert graphs == 0  # the warm-up compiled it
    batches = {"batched": [rows(2, 900.0, fox, 4.0, 3.5), rows(1, 600.0, boat, 1.0, 2.0),
                           rows(1, 700.0, boat, 5.0, 5.0)],
               "group": [rows(3, 800.0, boat, 1.0, 4.0)]}  # one text on every row: no mask, no padding
    for name, inputs in batches.items():
        got, graphs = _no_grad(compiled.batched_velocity, inputs)
        want = _no_grad(eager.policy.batched_velocity, inputs)[0]
        diffs[name] = max(_scaled(a, b) for a, b in zip(got, want))
        assert graphs == 0, name  # other batch sizes, text lengths and masks than the warm-up's: its graphs
        rows_out = torch.cat(got)
        assert max_diff(rows_out[:1], rows_out[-1:]) > 1e-3  # the rows are not all the same
    record_property("max_diff", diffs)
    print(f"\n[{which} compile] {diffs}")
    assert max(diffs.values()) <= COMPILE_TOL
