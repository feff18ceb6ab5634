"""SD3 on the family layer, in process: the denoise worker's own path (text table, tasks, batched forwards,
joint steps, decoder) against diffusers' ``StableDiffusion3Pipeline`` and the trainer's recompute.

Two tiny SD3 configurations other than the built-in tiny-sd3 (one SD3.5-style: dual attention in its first
block, RMS query/key norms, a shift of 2; one SD3.0-style with layer-norm query/key norms and a non-square
default size), built into pytest temp directories. Everything in float32 on the CPU, seeded.

1. Serving equals the pipeline on the same directory and seed: latents and frames within 1e-4.
2. Rollouts (SDE, and cps on a window of steps): the recorded log-probs equal ``TrainerPolicy.log_probs``
   recomputed from the trajectory within 1e-5; the trajectory and rollout scheduler follow the convention.
3. Batching: requests at different steps sharing forwards, and a group of 3, equal their runs alone.
4. ``--compile``'s building blocks on SD3: compiled forwards equal eager ones within 1e-4.
5. The router's field rules for an image family.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import msgspec
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from common.config.engine import Limits
from common.diffusion import schedulers
from common.diffusion.model_info import ModelInfo
from common.diffusion.policy import ModelInput, Policy
from common.families import read_model
from common.builtin import ensure_builtin
from common.builtin.build import build as build_tiny_sd3
from common.builtin.specs.sd3 import SPECS
from common.protocol.messages import (
    LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, TRAJECTORY_TIMESTEPS, GenerationParams,
    RolloutParams,
)
from rl import TrainerPolicy, Trajectory
from router.core.request_params import to_params
from router.core.errors import FieldError
from router.request.schemas import GenerateBody
from conftest import reference_pipeline
from family_harness import CPU, DTYPE, InProcess, compare_tasks, max_diff

TOL = 1e-4  # against diffusers: other batch layouts of the same maths (the text encoders batch both prompts)
RECOMPUTE_TOL = 1e-5
BATCH_TOL = 1e-5
COMPILE_TOL = 1e-4

BASE = SPECS["tiny-sd3"]
# SD3.5-style: dual attention in the first block, RMS query/key norms; other widths, heads and layers, other
# text encoders, shift 2 (the rollout scheduler must take the serving one's, not SD3's 3).
SPEC_X = dataclasses.replace(
    BASE, name="sd3-test-x", num_layers=3, num_attention_heads=3, attention_head_dim=8, dual_attention_layers=(0,),
    qk_norm="rms_norm", clip_l_hidden_size=24, clip_l_num_heads=3, clip_l_intermediate_size=40,
    clip_l_projection_dim=16, clip_g_hidden_size=40, clip_g_num_layers=1, clip_g_num_heads=4,
    clip_g_intermediate_size=56, clip_g_projection_dim=24, t5_d_model=72, t5_d_kv=12, t5_d_ff=88, t5_num_heads=3,
    shift=2.0, seed=5, num_inference_steps=4, guidance_scale=4.5, max_sequence_length=32)
# SD3.0-style blocks with layer-norm query/key norms, one wide layer, a wider VAE and a non-square default size.
SPEC_Y = dataclasses.replace(
    BASE, name="sd3-test-y", num_layers=1, num_attention_heads=4, attention_head_dim=12, qk_norm="layer_norm",
    sample_size=4, pos_embed_max_size=16, clip_l_hidden_size=16, clip_l_num_layers=1, clip_l_num_heads=2,
    clip_l_intermediate_size=32, clip_l_projection_dim=8, clip_g_hidden_size=32, clip_g_num_heads=2,
    clip_g_intermediate_size=48, clip_g_projection_dim=16, t5_d_model=64, t5_d_kv=8, t5_d_ff=96, t5_num_layers=1,
    t5_num_heads=4, t5_vocab_size=300, vae_block_out_channels=(8, 8, 16, 16), vae_norm_num_groups=8, shift=3.0,
    seed=11, height=80, width=48, num_inference_steps=3, guidance_scale=3.0, max_sequence_length=24)


# --- the model directories, the pipelines and the in-process engine --------------------------------------

@pytest.fixture(scope="module", autouse=True)
def _module_state():
    """The worker's forwards set torch's thread count (denoise_worker/threads.py): other modules get theirs back,
    and none keeps this module's pipelines and engines."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    _PIPES.clear()
    _ENGINES.clear()


@pytest.fixture(scope="module")
def dir_x(tmp_path_factory) -> Path:
    return build_tiny_sd3(SPEC_X, tmp_path_factory.mktemp("sd3-x"))


@pytest.fixture(scope="module")
def dir_y(tmp_path_factory) -> Path:
    return build_tiny_sd3(SPEC_Y, tmp_path_factory.mktemp("sd3-y"))


_PIPES: dict[str, object] = {}


def sd3_pipe(model_dir: Path):
    """diffusers' own StableDiffusion3Pipeline on ``model_dir``, one per directory."""
    from diffusers import StableDiffusion3Pipeline

    key = str(model_dir)
    if key not in _PIPES:
        _PIPES[key] = reference_pipeline(StableDiffusion3Pipeline.from_pretrained(model_dir, dtype=DTYPE))
    return _PIPES[key]


def diffusers_sd3(model_dir: Path, p: GenerationParams, output_type: str) -> torch.Tensor:
    """The pipeline's latents [1, 16, H/8, W/8] or frames [1, H, W, 3] for request ``p``."""
    out = sd3_pipe(model_dir)(
        prompt=p.prompt, negative_prompt=p.negative_prompt, height=p.height, width=p.width,
        num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
        max_sequence_length=p.max_sequence_length, generator=torch.Generator("cpu").manual_seed(p.seed),
        output_type=output_type).images
    return out if output_type == "latent" else torch.from_numpy(out)


InProcessSD3 = InProcess  # the generic path on an SD3 directory
_ENGINES: dict[str, InProcessSD3] = {}


def engine_for(model_dir: Path) -> InProcessSD3:
    if str(model_dir) not in _ENGINES:
        _ENGINES[str(model_dir)] = InProcessSD3(model_dir)
    return _ENGINES[str(model_dir)]


@pytest.fixture(scope="module")
def eng_x(dir_x) -> InProcessSD3:
    return engine_for(dir_x)


@pytest.fixture(scope="module")
def trainer_x(dir_x) -> TrainerPolicy:
    return TrainerPolicy(dir_x)


# --- 1. serving equals diffusers ---------------------------------------------------------------------------

PARITY = {
    "cfg": ("x", dict(guidance_scale=4.5, negative_prompt="blurry, low quality", seed=1)),
    "no-cfg": ("x", dict(guidance_scale=1.0, seed=2, prompt="a lighthouse on a cliff at night")),
    "non-square": ("x", dict(height=48, width=80, seed=3, negative_prompt="dark")),
    "max-sequence-length": ("x", dict(max_sequence_length=20, seed=4, negative_prompt="noisy",
                                      prompt="a small red fox runs through the forest at dawn with cinematic light")),
    "other-config": ("y", dict(seed=5, negative_prompt="blurry")),
    "other-config-square-no-cfg": ("y", dict(height=64, width=64, guidance_scale=1.0, seed=6,
                                             max_sequence_length=40)),
}


@pytest.mark.parametrize("case", list(PARITY), ids=list(PARITY))
def test_serving_equals_diffusers(case, dir_x, dir_y, record_property):
    which, over = PARITY[case]
    model_dir = dir_x if which == "x" else dir_y
    eng = engine_for(model_dir)
    p = eng.params(**over)
    task = eng.run(p)
    assert type(task.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler" and task.sde is None
    latents = task.latents
    assert latents.shape == (1, 16, p.height // 8, p.width // 8)
    ref_latents = diffusers_sd3(model_dir, p, "latent")
    frames = eng.frames(latents, p)
    ref_frames = diffusers_sd3(model_dir, p, "np")
    assert frames.shape == (1, 1, p.height, p.width, 3) and ref_frames.shape == (1, p.height, p.width, 3)
    d_lat, d_img = max_diff(latents, ref_latents), max_diff(frames[:, 0], ref_frames)
    record_property("max_diff", {"latents": d_lat, "frames": d_img})
    print(f"\n[{case}] latents {d_lat:.3g} frames {d_img:.3g}")
    assert frames.std() > 1e-3  # a picture, not a constant
    assert d_lat <= TOL and d_img <= TOL


def test_the_two_configurations_differ_from_tiny_sd3(eng_x, dir_y):
    cx = eng_x.policy.experts["transformer"].config
    cy = engine_for(dir_y).policy.experts["transformer"].config
    assert tuple(cx.dual_attention_layers) == (0,) and cx.qk_norm == "rms_norm" and cx.num_layers == 3
    assert cy.qk_norm == "layer_norm" and cy.num_attention_heads == 4 and cy.joint_attention_dim == 64
    assert (eng_x.info.flow_shift, engine_for(dir_y).info.defaults["height"]) == (2.0, 80)
    base = BASE.num_layers, BASE.num_attention_heads, BASE.attention_head_dim, BASE.qk_norm, BASE.t5_d_model
    for c in (cx, cy):
        assert (c.num_layers, c.num_attention_heads, c.attention_head_dim, c.qk_norm, c.joint_attention_dim) != base


# --- 2. rollouts against the trainer's recompute ------------------------------------------------------------

ROLLOUTS = {
    "sde": dict(rollout=RolloutParams(sde_type="sde", noise_level=0.7, return_trajectory=True),
                negative_prompt="blurry", seed=7),
    "cps-window": dict(rollout=RolloutParams(sde_type="cps", noise_level=0.8, sde_step_indices=[1, 2],
                                             return_trajectory=True),
                       negative_prompt="blurry", seed=8, num_inference_steps=5, max_sequence_length=24),
}


@pytest.mark.parametrize("case", list(ROLLOUTS), ids=list(ROLLOUTS))
def test_rollout_log_probs_equal_trainer_recompute(case, eng_x, trainer_x, record_property):
    p = eng_x.params(**ROLLOUTS[case])
    r = p.rollout
    task = eng_x.run(p)
    # The rollout scheduler: flow-match Euler with the serving scheduler's shift, on the convention.
    assert isinstance(task.scheduler, FlowMatchEulerDiscreteScheduler)
    assert task.scheduler.config.shift == eng_x.serving_template.config.shift == SPEC_X.shift
    assert schedulers.check_flow_match_convention(task.scheduler) <= 1e-3
    out = task.extras()
    T = p.num_inference_steps
    steps = out[LOG_PROB_STEPS.name].tolist()
    assert steps == (r.sde_step_indices if r.sde_step_indices is not None else list(range(T)))
    log_probs = out[LOG_PROBS.name]
    assert log_probs.shape == (1, len(steps)) and log_probs.dtype == torch.float32
    assert torch.isfinite(log_probs).all()
    # The trajectory: T+1 latents from the seed's noise to the output, T+1 sigmas ending at 0, T timesteps.
    traj = Trajectory(out[TRAJECTORY_LATENTS.name][0], out[TRAJECTORY_TIMESTEPS.name], out[TRAJECTORY_SIGMAS.name])
    assert traj.latents.shape == (T + 1, *eng_x.info.latent_shape(p.height, p.width)[1:])
    assert traj.sigmas.shape == (T + 1,) and traj.sigmas[-1].item() == 0.0
    assert traj.timesteps.shape == (T,)
    assert (traj.timesteps >= 0).all() and (traj.timesteps <= 1000).all()
    assert torch.allclose(traj.timesteps.double(), traj.sigmas[:-1].double() * 1000, atol=1e-3)
    # x_0 is the pipeline's own draw: randn((1, 16, H/8, W/8)) from a CPU generator seeded with the seed.
    noise = torch.randn((1, 16, p.height // 8, p.width // 8), generator=torch.Generator("cpu").manual_seed(p.seed))
    assert torch.equal(traj.latents[0], noise[0]) and torch.equal(traj.latents[-1], task.latents[0])
    with torch.no_grad():
        again = trainer_x.log_probs(traj, steps, p)
    d = max_diff(again, log_probs[0])
    record_property("max_diff", d)
    print(f"\n[{case}] log-probs {d:.3g} (values {log_probs[0].tolist()})")
    assert d <= RECOMPUTE_TOL


# --- 3. batching -------------------------------------------------------------------------------------------

MODES = {
    "serving": (None, 2.0),
    "sde": (RolloutParams(sde_type="sde", noise_level=0.7, return_trajectory=True), 1.0),
}


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_requests_at_different_steps_share_forwards_and_equal_their_runs_alone(mode, eng_x, record_property):
    rollout, guidance_b = MODES[mode]
    pa = eng_x.params(prompt="a red kite over the sea", negative_prompt="blurry", seed=3, guidance_scale=4.5,
                      num_inference_steps=5, rollout=rollout)
    pb = eng_x.params(prompt="a quiet harbour at dusk", negative_prompt="", seed=11, guidance_scale=guidance_b,
                      num_inference_steps=5, rollout=rollout)
    a = eng_x.task(pa)
    for _ in range(2):  # a alone for two steps
        eng_x.step([a])
    b = eng_x.task(pb)
    before = eng_x.shared_forwards
    while not (a.done and b.done):
        eng_x.step([t for t in (a, b) if not t.done])
    assert eng_x.shared_forwards - before == 3  # steps 2-4 of a with steps 0-2 of b
    diffs = [compare_tasks(a, eng_x.run(pa)), compare_tasks(b, eng_x.run(pb))]
    record_property("max_diff", diffs)
    print(f"\n[{mode}] batched vs alone {diffs}")
    assert max_diff(a.latents, b.latents) > 1e-2
    assert max(diffs) <= BATCH_TOL


@pytest.mark.parametrize("mode", list(MODES), ids=list(MODES))
def test_a_group_equals_each_seed_alone(mode, eng_x, record_property):
    rollout, _ = MODES[mode]
    p = eng_x.params(prompt="a heron in the reeds", negative_prompt="blurry", seed=20, guidance_scale=4.5, n=3,
                     rollout=rollout)
    group = eng_x.run(p)
    assert group.latents.shape[0] == 3
    ext = group.extras()
    diffs = []
    for i in range(3):
        alone = eng_x.run(msgspec.structs.replace(p, seed=p.seed + i, n=1))
        one = alone.extras()
        d = [max_diff(group.latents[i : i + 1], alone.latents)]
        for name in (LOG_PROBS.name, TRAJECTORY_LATENTS.name):
            if name in one:
                d.append(max_diff(ext[name][i : i + 1], one[name]))
        diffs.append(max(d))
    record_property("max_diff", diffs)
    print(f"\n[{mode}] group vs alone {diffs}")
    assert max_diff(group.latents[0], group.latents[1]) > 1e-2
    assert max(diffs) <= BATCH_TOL


# --- 4. --compile's building blocks on SD3 ------------------------------------------------------------------

def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _no_grad(fn, *args):
    """``fn(*args)`` without gradients, as the denoise worker runs, and the graphs dynamo compiled for it."""
    before = _graphs()
    with torch.no_grad():
        out = fn(*args)
    return out, _graphs() - before


@pytest.fixture(scope="module")
def compiled_y(dir_y):
    """The one-layer configuration (the cheapest to compile) through inductor, as tests/test_compile.py does,
    warmed up at its default request (80x48, 77 + 24 text tokens); and its eager twin."""
    from common.diffusion.compiled import compile_experts, warm_up

    eager = engine_for(dir_y)
    torch.set_num_threads(eager.max_threads)  # as a --compile worker: its one thread count (graphs guard on it)
    compiled = Policy.load(eager.info, DTYPE, CPU)
    compile_experts(compiled.experts, log_recompiles=False)
    before = _graphs()
    seconds = warm_up(compiled)
    assert list(seconds) == ["transformer"] and _graphs() - before >= 1  # the warm-up did compile
    print(f"\n[compile] warm-up {seconds['transformer']:.1f}s")
    return eager, compiled


def _texts(eng: InProcessSD3, prompt: str, negative: str):
    """A prompt's and a negative prompt's conditioning through the encoder and the text table, at the
    model's default token budget (the warm-up's)."""
    task = eng.task(eng.params(prompt=prompt, negative_prompt=negative, guidance_scale=4.0))
    return task.cond, task.uncond


@pytest.mark.heavy  # compiling a family's transformer takes 10-25 s here: tests/test_compile.py covers compiling by default
def test_compiled_forwards_equal_eager(compiled_y, record_property):
    eager, compiled = compiled_y
    g = torch.Generator().manual_seed(9)
    shape = eager.info.latent_shape(eager.info.defaults["height"], eager.info.defaults["width"])[1:]

    def latents(n):
        return torch.randn(n, *shape, generator=g)

    prompt, negative = _texts(eager, "a red fox in the snow", "blurry")
    other, _ = _texts(eager, "a boat on a calm lake", "blurry")
    single = ModelInput(latents(1), torch.tensor(900.0), prompt, negative, 4.5)  # one forward of [uncond, cond]
    got, graphs = _no_grad(compiled.velocity, single)
    d_single = max_diff(got, _no_grad(eager.policy.velocity, single)[0])
    assert graphs == 0  # the warm-up compiled it
    batched = [ModelInput(latents(2), torch.tensor(900.0), prompt, negative, 4.0),
               ModelInput(latents(1), torch.tensor(600.0), other, None, 1.0),
               ModelInput(latents(1), torch.tensor(700.0), other, negative, 5.0)]
    got, graphs = _no_grad(compiled.batched_velocity, batched)
    want = _no_grad(eager.policy.batched_velocity, batched)[0]
    d_batched = max(max_diff(a, b) for a, b in zip(got, want))
    assert graphs == 0  # 7 rows: the warm-up's graph of any batch above 1
    record_property("max_diff", {"guided": d_single, "batched": d_batched})
    print(f"\n[compile] guided {d_single:.3g} batched {d_batched:.3g}")
    assert d_single <= COMPILE_TOL and d_batched <= COMPILE_TOL
    assert max_diff(got[0], got[2][:1].expand_as(got[0])) > 1e-3  # the rows are not all the same


# --- 5. the router's field rules for an image family ---------------------------------------------------------

def _params(info: ModelInfo, **body) -> GenerationParams:
    return to_params(GenerateBody(prompt="a fox", **body), info, Limits())


@pytest.mark.parametrize("body, field", [
    (dict(num_frames=9), "num_frames"),
    (dict(guidance_scale_2=2.0), "guidance_scale_2"),
    (dict(height=40), "height"),
    (dict(width=72), "width"),
    (dict(max_sequence_length=600), "max_sequence_length"),
], ids=["num-frames", "guidance-scale-2", "height", "width", "max-sequence-length"])
def test_router_refuses_fields_sd3_does_not_take(dir_x, body, field):
    info = read_model(dir_x)
    with pytest.raises(FieldError) as e:
        _params(info, **body)
    assert e.value.field == field


def test_router_fills_sd3_defaults(dir_x):
    info = read_model(dir_x)
    assert info.family.family == "sd3" and not info.family.video
    p = _params(info)
    assert p.max_sequence_length == info.defaults["max_sequence_length"] == SPEC_X.max_sequence_length
    assert (p.num_frames, p.height, p.width) == (1, SPEC_X.height, SPEC_X.width)
    assert (p.num_inference_steps, p.guidance_scale) == (SPEC_X.num_inference_steps, SPEC_X.guidance_scale)
    assert _params(info, num_frames=1, max_sequence_length=77).max_sequence_length == 77
    assert _params(info, height=48, width=80).height == 48


def test_router_takes_frames_for_a_video_family():
    info = read_model(ensure_builtin("tiny"))
    assert info.family.video
    assert _params(info, num_frames=9).num_frames == 9
