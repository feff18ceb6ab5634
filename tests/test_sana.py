"""SANA on the family layer, in process: the workers' own path (tests/family_harness.py) against diffusers'
``SanaPipeline`` and the trainer's recompute.

Two tiny configurations other than the built-in ones, built into pytest temp directories (other widths,
heads, text encoder, ``flow_shift`` and ``timestep_scale``). Everything float32 on the CPU, seeded.

1. Serving (the directory's DPM-Solver) equals the pipeline on the same directory and seed (latents and frames
   within 1e-4): with and without CFG, a non-square size snapped to its resolution bin and resized back, a
   negative prompt (encoded without the instruction), another ``max_sequence_length``, another ``flow_shift``.
2. Rollouts (flow-match Euler with the serving shift): log-probs equal ``TrainerPolicy.log_probs`` within 1e-5.
3. Batching: requests at different steps with texts of other ``max_sequence_length`` (padded and masked in one
   forward), and a group of 3, equal their runs alone within 1e-5.
4. LoRA: a diffusers file (``SanaLoraLoaderMixin``'s format) against diffusers' loader; an adapter of the
   convolution feed-forward is refused naming it.
5. Step caching: first-block caching skips steps and stays near the full run; teacache is refused (no
   published polynomial).
6. Request fields: binning, sizes and ``clean_caption``.
7. Compile (heavy): compiled forwards equal eager ones, nothing compiled after the warm-up.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from common.diffusion import schedulers
from common.diffusion.cache_signals import cache_problem
from common.diffusion.request_fields import field_value
from common.families import read_model
from common.builtin.specs.sana import SPECS
from common.protocol.messages import (
    LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, TRAJECTORY_TIMESTEPS, CacheParams,
    RolloutParams,
)
from family_harness import DTYPE, InProcess, ModuleModels, compare_tasks, max_diff
from rl import Trajectory

TOL = 1e-4
RECOMPUTE_TOL = 1e-5
BATCH_TOL = 1e-5

# Wider heads and text encoder, three blocks, flow_shift 2; the second: one block, other heads, flow_shift 4.5
# and a timestep scale, another seed.
SANA_X = dataclasses.replace(SPECS["tiny-sana"], name="sana-test-x", num_layers=3, attention_head_dim=12,
                             cross_attention_head_dim=12, text_hidden_size=48, text_num_heads=3, flow_shift=2.0,
                             seed=5, max_sequence_length=48)
SANA_Y = dataclasses.replace(SPECS["tiny-sana"], name="sana-test-y", num_layers=1, num_attention_heads=3,
                             num_cross_attention_heads=3, cross_attention_head_dim=8, latent_channels=8,
                             vae_block_out_channels=(4, 8, 8, 8, 16, 16), flow_shift=4.5, timestep_scale=0.5,
                             seed=11, num_inference_steps=3, guidance_scale=3.0)
CONFIGS = {"x": SANA_X, "y": SANA_Y}
_DIRS: dict[str, Path] = {}
_MODELS = ModuleModels()


@pytest.fixture(scope="module", autouse=True)
def _module_state():
    yield from _MODELS.module_scope(_DIRS)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    def get(which: str) -> Path:
        if which not in _DIRS:
            _DIRS[which] = CONFIGS[which].build(tmp_path_factory.mktemp(which))
        return _DIRS[which]
    return get


def engine(dirs, which: str) -> InProcess:
    return _MODELS.engine(dirs(which))


pipe_for = _MODELS.pipe


def diffusers_output(model_dir: Path, p, output_type: str) -> torch.Tensor:
    out = pipe_for(model_dir)(
        prompt=p.prompt, negative_prompt=p.negative_prompt, guidance_scale=p.guidance_scale, height=p.height,
        width=p.width, num_inference_steps=p.num_inference_steps, max_sequence_length=p.max_sequence_length,
        use_resolution_binning=field_value(p, "use_resolution_binning") is not False,
        generator=torch.Generator("cpu").manual_seed(p.seed), output_type=output_type).images
    return out if output_type == "latent" else torch.from_numpy(np.asarray(out))


def made_size(eng: InProcess, p) -> tuple[int, int]:
    return eng.family.latents.size(eng.info, p.height, p.width, p.fields)


# --- 1. serving equals diffusers ---------------------------------------------------------------------------

PARITY = {
    "cfg": ("x", dict(seed=1)),
    "no-cfg": ("x", dict(seed=2, guidance_scale=1.0)),
    "non-square-binned": ("x", dict(seed=3, height=96, width=160, negative_prompt="blurry, low quality")),
    "tall-binned-other-length": ("x", dict(seed=4, height=200, width=64, max_sequence_length=20,
                                           prompt="a quiet harbour at dusk with small fishing boats and gulls")),
    "other-shift-and-scale": ("y", dict(seed=5, negative_prompt="dark")),
    "other-shift-no-cfg": ("y", dict(seed=6, guidance_scale=1.0, height=384, width=640)),
    # Binning off: the requested size itself (multiples of 32), no resize.
    "binning-off": ("x", dict(seed=7, height=96, width=160, use_resolution_binning=False)),
    "binning-off-other-shift": ("y", dict(seed=8, height=64, width=128, use_resolution_binning=False,
                                          guidance_scale=1.0)),
}


@pytest.mark.parametrize("case", list(PARITY), ids=list(PARITY))
def test_serving_equals_diffusers(case, dirs, record_property):
    which, over = PARITY[case]
    eng = engine(dirs, which)
    p = eng.params(**over)
    task = eng.run(p)
    assert type(task.scheduler).__name__ == "DPMSolverMultistepScheduler" and task.sde is None
    h, w = made_size(eng, p)
    assert task.latents.shape == (1, eng.info.latent_channels, h // 32, w // 32)  # at the bin's size
    ref_latents = diffusers_output(dirs(which), p, "latent")
    frames = eng.frames(task.latents, p)
    ref_frames = diffusers_output(dirs(which), p, "np")
    assert frames.shape == (1, 1, p.height, p.width, 3)  # resized back to the requested size
    d_lat, d_img = max_diff(task.latents, ref_latents), max_diff(frames[:, 0], ref_frames)
    record_property("max_diff", {"latents": d_lat, "frames": d_img})
    assert frames.std() > 1e-3
    assert d_lat <= TOL and d_img <= TOL


def test_the_instruction_is_for_the_prompt_only(dirs):
    """A text encoded as a prompt (behind the instruction) differs from the same text as a negative prompt,
    and each equals the pipeline's encode_prompt rows."""
    from common.diffusion import text_roles
    from common.protocol.messages import PROMPT_EMBEDS

    eng = engine(dirs, "x")
    pipe = pipe_for(dirs("x"))
    as_prompt, as_negative = text_roles.encode(eng.encoder, [("a red fox", False), ("a red fox", True)], 48)
    embeds, mask, neg, neg_mask = pipe.encode_prompt("a red fox", negative_prompt="a red fox", max_sequence_length=48,
                                                     complex_human_instruction=eng.encoder.instruction)
    for wire, (e, m) in ((as_prompt, (embeds, mask)), (as_negative, (neg, neg_mask))):
        n = int(m.sum())
        assert torch.equal(wire[PROMPT_EMBEDS.name], e[0, :n]) and bool(m[0, :n].all())
    a, b = as_prompt[PROMPT_EMBEDS.name], as_negative[PROMPT_EMBEDS.name]
    assert a.shape != b.shape or max_diff(a, b) > 1e-2


# --- 2. rollouts against the trainer's recompute ------------------------------------------------------------

ROLLOUTS = {
    "sde-cfg": ("x", dict(rollout=RolloutParams(sde_type="sde", noise_level=0.7, return_trajectory=True),
                          negative_prompt="blurry", seed=7)),
    "cps-window-binned": ("x", dict(rollout=RolloutParams(sde_type="cps", noise_level=0.8, sde_step_indices=[1, 2],
                                                          return_trajectory=True),
                                    guidance_scale=1.0, height=96, width=160, seed=8)),
    "sde-other-shift": ("y", dict(rollout=RolloutParams(sde_type="sde", noise_level=0.9, return_trajectory=True),
                                  seed=9)),
}


@pytest.mark.parametrize("case", list(ROLLOUTS), ids=list(ROLLOUTS))
def test_rollout_log_probs_equal_trainer_recompute(case, dirs, record_property):
    which, over = ROLLOUTS[case]
    eng = engine(dirs, which)
    p = eng.params(**over)
    r = p.rollout
    task = eng.run(p)
    # Flow-match Euler rebuilt with the serving DPM-Solver's flow_shift and training steps.
    want = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=CONFIGS[which].flow_shift)
    want.set_timesteps(p.num_inference_steps)
    assert type(eng.serving_template).__name__ == "DPMSolverMultistepScheduler"
    assert torch.equal(task.scheduler.sigmas, want.sigmas)
    assert schedulers.check_flow_match_convention(task.scheduler) <= 1e-3
    out = task.extras()
    steps = out[LOG_PROB_STEPS.name].tolist()
    T = p.num_inference_steps
    assert steps == (r.sde_step_indices if r.sde_step_indices is not None else list(range(T)))
    log_probs = out[LOG_PROBS.name]
    assert log_probs.shape == (1, len(steps)) and torch.isfinite(log_probs).all()
    traj = Trajectory(out[TRAJECTORY_LATENTS.name][0], out[TRAJECTORY_TIMESTEPS.name], out[TRAJECTORY_SIGMAS.name])
    h, w = made_size(eng, p)
    noise = torch.randn((1, eng.info.latent_channels, h // 32, w // 32),
                        generator=torch.Generator("cpu").manual_seed(p.seed))
    assert torch.equal(traj.latents[0], noise[0])  # the pipeline's draw, at the bin's size
    with torch.no_grad():
        again = _MODELS.trainer(dirs(which)).log_probs(traj, steps, p)
    d = max_diff(again, log_probs[0])
    record_property("max_diff", d)
    assert d <= RECOMPUTE_TOL


# --- 3. batching ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["serving", "sde"])
def test_requests_at_different_steps_share_forwards_and_equal_their_runs_alone(mode, dirs, record_property):
    eng = engine(dirs, "x")
    rollout = RolloutParams(sde_type="sde", noise_level=0.7, return_trajectory=True) if mode == "sde" else None
    # Another max_sequence_length: its texts are padded and masked in the shared forward.
    pa = eng.params(prompt="a red kite", negative_prompt="blurry", seed=3, num_inference_steps=5, rollout=rollout)
    pb = eng.params(prompt="a quiet harbour at dusk with small fishing boats", guidance_scale=2.0, seed=11,
                    num_inference_steps=5, rollout=rollout, max_sequence_length=24)
    a = eng.task(pa)
    eng.step([a])
    b = eng.task(pb)
    before = eng.shared_forwards
    while not (a.done and b.done):
        eng.step([t for t in (a, b) if not t.done])
    assert eng.shared_forwards - before == 4
    diffs = [compare_tasks(a, eng.run(pa)), compare_tasks(b, eng.run(pb))]
    record_property("max_diff", diffs)
    assert max_diff(a.latents, b.latents) > 1e-2
    assert max(diffs) <= BATCH_TOL


def test_a_group_equals_its_samples_alone(dirs, record_property):
    eng = engine(dirs, "x")
    pg = eng.params(seed=20, n=3, negative_prompt="blurry", height=96, width=160,
                    rollout=RolloutParams(sde_type="sde", noise_level=0.7, return_trajectory=True))
    group = eng.run(pg)
    diffs = []
    for i in range(3):
        alone = eng.run(msgspec.structs.replace(pg, seed=pg.seed + i, n=1))
        diffs.append(max_diff(group.latents[i : i + 1], alone.latents))
        diffs.append(max_diff(group.extras()[LOG_PROBS.name][i : i + 1], alone.extras()[LOG_PROBS.name]))
    record_property("max_diff", diffs)
    assert max_diff(group.latents[0], group.latents[1]) > 1e-2
    assert max(diffs) <= BATCH_TOL


# --- 4. LoRA -------------------------------------------------------------------------------------------------

def test_lora_equals_diffusers(dirs, tmp_path, record_property):
    import lora_fixtures as lf
    from common.diffusion.lora import build_adapter
    from common.diffusion.lora_format import read_lora

    eng, model_dir = engine(dirs, "x"), dirs("x")
    targets = ["attn1.to_q", "attn1.to_v", "attn2.to_k", "attn2.to_out.0"]  # (the engine adapts Linears only)
    ad = lf.make_diffusers_lora(model_dir, tmp_path / "a", rank=4, alpha=8, target_modules=targets, seed=1)
    adapter = build_adapter("a", 1, read_lora(str(ad.path), None), eng.policy.experts, 64)
    eng.policy.cover(adapter)
    p = eng.params(seed=3, negative_prompt="blurry")
    got = eng.run(p, lora=(adapter, 0.8)).latents
    pipe = pipe_for(model_dir)
    pipe.load_lora_weights(str(ad.path), adapter_name="a")
    try:
        pipe.set_adapters(["a"], [0.8])
        want = diffusers_output(model_dir, p, "latent")
    finally:
        pipe.unload_lora_weights()
    d = max_diff(got, want)
    record_property("max_diff", d)
    assert max_diff(got, eng.run(p).latents) > 1e-3  # the adapter changes the output
    assert d <= TOL


def test_an_adapter_of_the_convolution_feed_forward_is_refused_naming_it(dirs, tmp_path):
    """SANA's feed-forward is 1x1 and depthwise convolutions (GLUMBConv): an adapter diffusers saves for them is
    refused, naming the module and the Linear-only rule (a 400 on /v1/load_lora_adapter), before any weight."""
    import lora_fixtures as lf
    from common.diffusion.lora_format import LoraError, read_lora

    ad = lf.make_diffusers_lora(dirs("x"), tmp_path / "conv", rank=4, alpha=8,
                                target_modules=["attn1.to_q", "ff.conv_inverted"], seed=1)
    with pytest.raises(LoraError, match=r"transformer_blocks\.0\.ff\.conv_inverted: .* adapt a convolution; "
                                        "adapters apply to Linear layers only"):
        read_lora(str(ad.path), None)


# --- 5. step caching -----------------------------------------------------------------------------------------

def test_first_block_caching_skips_steps_and_teacache_is_refused(dirs):
    eng = engine(dirs, "x")
    p = eng.params(seed=4, num_inference_steps=8, guidance_scale=1.0)
    full = eng.run(p)
    cached = eng.run(msgspec.structs.replace(p, cache=CacheParams(method="first_block", threshold=0.5)))
    assert sum(cached.cache.cached_steps) > 0
    assert 0 < max_diff(cached.latents, full.latents) < 0.5 * full.latents.abs().max().item()
    assert "no published TeaCache polynomial" in cache_problem("teacache", eng.family, [], eng.info)
    assert cache_problem("first_block", eng.family, [], eng.info) is None
    assert read_model(dirs("x")).family.family == "sana"


# --- 6. request fields ---------------------------------------------------------------------------------------

def test_request_fields_binning_and_clean_caption(dirs):
    """Binning on takes any size (snapped, the requested one kept); off, sizes are multiples of 32 or refused
    naming the field; clean_caption true is refused naming it; the pipeline's defaults are the binding's."""
    import inspect

    from diffusers import SanaPipeline

    from common.config.engine import Limits
    from common.diffusion.params import FieldError, to_params
    from common.families.sana.binding import SANA

    info = engine(dirs, "x").info
    p = to_params({"prompt": "a fox", "height": 200, "width": 70}, info, Limits())
    assert (p.height, p.width) == (200, 70) and p.fields["use_resolution_binning"] is True
    assert info.family.latents.size(info, 200, 70, p.fields) != (200, 70)
    off = to_params({"prompt": "a fox", "height": 96, "width": 160, "use_resolution_binning": False}, info, Limits())
    assert info.family.latents.size(info, 96, 160, off.fields) == (96, 160)
    for bad, name in (({"height": 200, "width": 64}, "height"), ({"height": 64, "width": 70}, "width")):
        with pytest.raises(FieldError) as e:
            to_params({"prompt": "a fox", "use_resolution_binning": False, **bad}, info, Limits())
        assert e.value.field == name and "multiple of 32" in e.value.message
    with pytest.raises(FieldError) as e:
        to_params({"prompt": "a fox", "clean_caption": True}, info, Limits())
    assert e.value.field == "clean_caption"
    assert "clean_caption" not in to_params({"prompt": "a fox", "clean_caption": False}, info, Limits()).fields
    call = inspect.signature(SanaPipeline.__call__).parameters
    assert {k: SANA.defaults[k] for k in ("num_inference_steps", "guidance_scale", "max_sequence_length")} == \
        {k: call[k].default for k in ("num_inference_steps", "guidance_scale", "max_sequence_length")}
# --- 7. compile --------------------------------------------------------------------------------------------

COMPILE_TOL = 1e-4


@pytest.mark.heavy  # compiling a family's transformer takes 10-25 s here: tests/test_compile.py covers compiling by default
def test_compiled_forwards_equal_eager(dirs, record_property):
    """The one-block configuration through inductor, warmed up at its default request: a guided forward, rows
    of two requests with texts of two budgets (padded and masked to the longest) and a group of rows at the
    shorter budget alone (the text length is dynamic) equal eager, nothing compiled after the warm-up."""
    from common.diffusion.compiled import compile_experts, warm_up
    from common.diffusion.policy import ModelInput, Policy
    from test_compile import _graphs, _run as _no_grad

    eager = engine(dirs, "y")
    threads = torch.get_num_threads()
    torch.set_num_threads(eager.max_threads)  # as a --compile worker: its one thread count (graphs guard on it)
    try:
        compiled = Policy.load(eager.info, DTYPE, torch.device("cpu"))
        compile_experts(compiled, log_recompiles=False)
        before = _graphs()
        seconds = warm_up(compiled)
        assert list(seconds) == ["transformer"] and _graphs() - before >= 1  # the warm-up did compile
        d = eager.info.defaults
        shape = eager.info.latent_shape(d["height"], d["width"])[1:]
        g = torch.Generator().manual_seed(9)

        def latents(n):
            return torch.randn(n, *shape, generator=g)

        def texts(prompt, negative, length):
            task = eager.task(eager.params(prompt=prompt, negative_prompt=negative, guidance_scale=4.0,
                                           max_sequence_length=length))
            return task.cond, task.uncond

        prompt, negative = texts("a red fox in the snow", "blurry", d["max_sequence_length"])
        other, short_negative = texts("a boat on a calm lake", "blurry", 24)
        single = ModelInput(latents(1), torch.tensor(900.0), prompt, negative, 4.5)
        got, graphs = _no_grad(compiled.velocity, single)
        diffs = {"guided": max_diff(got, _no_grad(eager.policy.velocity, single)[0])}
        assert graphs == 0  # the warm-up compiled it
        batches = {"batched": [ModelInput(latents(2), torch.tensor(900.0), prompt, negative, 4.0),
                               ModelInput(latents(1), torch.tensor(600.0), other, None, 1.0)],
                   "short": [ModelInput(latents(3), torch.tensor(700.0), other, short_negative, 3.0)]}
        for name, inputs in batches.items():
            got, graphs = _no_grad(compiled.batched_velocity, inputs)
            want = _no_grad(eager.policy.batched_velocity, inputs)[0]
            diffs[name] = max(max_diff(a, b) for a, b in zip(got, want))
            assert graphs == 0, name  # other batch sizes, budgets and texts than the warm-up's: its graphs
    finally:
        torch.set_num_threads(threads)
    record_property("max_diff", diffs)
    print(f"\n[sana compile] warm-up {seconds['transformer']:.1f}s {diffs}")
    assert max(diffs.values()) <= COMPILE_TOL
