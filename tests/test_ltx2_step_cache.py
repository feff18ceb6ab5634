"""Step caching (``first_block``, ``teacache``) on LTX-2, in process, on the ``-smooth`` built-ins (a time
embedding that moves a few percent per step, as a trained model's: common/builtin/smooth_time.py).

- Every guidance pass of a request (cond, uncond, STG-perturbed, modality-isolated: four per sample) is a
  branch of its own: ``transformer_passes + cached_steps`` is steps x 4, each method skips steps (the counts
  are in the assertion message and docs/architecture.md's step-caching section), text to video and image to
  video.
- The first block's residual covers both streams (the block returns video and audio): the probe's signal per
  row is the video tokens' residual beside the audio tokens'.
- A caching request batched with others joined at later steps (another method, another set of passes,
  no caching) equals its run alone (both streams within 1e-5) with the same counts; a threshold below every
  change computes every step and equals the request without caching.
- A rollout's SDE steps always compute every pass; its log-probs equal the trainer's recompute within 1e-5.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.builtin import ensure_builtin
from common.diffusion.cache_signals import cache_problem, first_block_residuals
from common.diffusion.step_cache import METHODS
from common.protocol.messages import (LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS,
                                     TRAJECTORY_TIMESTEPS, CacheParams, RolloutParams)
from family_harness import ModuleModels, compare_tasks, max_diff
from rl import Trajectory
from test_step_cache import IMAGES, WINDOW, _run_recorded, run_joined

BATCH_TOL = 1e-5
STEPS = 12
THRESHOLDS = {"teacache": 0.3, "first_block": 0.3}  # tests/test_step_cache.py's
# CFG alone: STG and modality guidance off on both streams (the built-in's audio fields turn them on)
CFG_ONLY = dict(stg_scale=0.0, modality_scale=1.0, audio_stg_scale=0.0, audio_modality_scale=1.0)
ALL_PASSES = dict(guidance_scale=4.0, stg_scale=1.0, modality_scale=3.0, guidance_rescale=0.5)
models = ModuleModels()


@pytest.fixture(scope="module", autouse=True)
def _module():
    yield from models.module_scope()


def engine(model: str):
    return models.engine(ensure_builtin(f"{model}-smooth"))


def params(eng, method: str | None = None, threshold: float | None = None, **over):
    fields = dict(num_inference_steps=STEPS, seed=3, negative_prompt="blurry", num_frames=9, **ALL_PASSES)
    if method is not None:
        fields["cache"] = CacheParams(method=method, threshold=threshold or THRESHOLDS[method])
    return eng.params(**{**fields, **over})


def image(model: str, i: int = 0):
    return IMAGES[i] if model.endswith("i2v") else None


@pytest.mark.parametrize("model", ["tiny-ltx2", "tiny-ltx2-i2v"])
def test_each_pass_is_a_branch_and_each_method_skips_steps(model, record_property):
    eng = engine(model)
    assert all(cache_problem(m, eng.family, [], eng.info) is None for m in METHODS)  # the built-in's step_cache.json
    counts = {}
    for method in METHODS:
        task = eng.run(params(eng, method), image=image(model))
        assert task.branches == 4 and task.cache.branches == 4  # cond, uncond, perturbed, isolated
        counts[method] = task.pass_counts()
    message = f"{model}, {STEPS} steps x 4 branches: {counts}"
    record_property("counts", counts)
    print(f"\n{message}")
    for c in counts.values():
        assert c["transformer_passes"][0] + c["cached_steps"][0] == STEPS * 4, message
        assert c["cached_steps"][0] > 0, message


def test_the_first_block_residual_covers_both_streams():
    eng = engine("tiny-ltx2")
    p = params(eng)
    task = eng.task(p)
    x = task.model_input()
    g = x.grid.geometry
    residual = first_block_residuals(eng.policy, "transformer", [x])[0]
    model = eng.policy.experts["transformer"]
    video_width = model.config.num_attention_heads * model.config.attention_head_dim
    audio_width = model.config.audio_num_attention_heads * model.config.audio_attention_head_dim
    assert residual.shape == (1, g.video_tokens * video_width + (g.tokens - g.video_tokens) * audio_width)
    # the audio part is the audio stream's: it moves when only the audio latents move
    moved = x.latents.clone()
    moved[:, g.video_tokens:] += 0.5
    again = first_block_residuals(eng.policy, "transformer", [dataclasses.replace(x, latents=moved)])[0]
    split = g.video_tokens * video_width
    assert max_diff(again[:, split:], residual[:, split:]) > 1e-3


@pytest.mark.parametrize("method", list(METHODS))
def test_a_caching_request_batched_with_others_equals_its_run_alone(method, record_property):
    eng = engine("tiny-ltx2")
    other = next(m for m in METHODS if m != method)
    jobs = [dict(p=params(eng, method)),
            dict(p=params(eng, prompt="a quiet harbour at dusk", seed=4, **CFG_ONLY), join=2),
            dict(p=params(eng, other, prompt="a kite over a beach", seed=5, modality_scale=1.0, audio_modality_scale=1.0),
                 join=3)]  # CFG and STG: three passes
    before = eng.shared_forwards
    together = run_joined(eng, jobs)
    assert [t.branches for t in together] == [4, 2, 3]
    assert eng.shared_forwards > before
    diffs = []
    for job, t in zip(jobs, together):
        solo = eng.run(job["p"])
        diffs.append(compare_tasks(t, solo))
        assert t.pass_counts() == solo.pass_counts()
    record_property("max_diff", diffs)
    print(f"\n[ltx2 {method}] batched vs alone {diffs} {[t.pass_counts() for t in together]}")
    assert sum(together[0].cache.cached_steps) > 0
    assert max(diffs) <= BATCH_TOL


@pytest.mark.parametrize("method", list(METHODS))
def test_a_tiny_threshold_computes_every_step_and_equals_no_caching(method):
    eng = engine("tiny-ltx2")
    plain = eng.run(params(eng))
    task = eng.run(params(eng, method, threshold=1e-6))
    assert task.pass_counts() == plain.pass_counts() == {"transformer_passes": [STEPS * 4], "cached_steps": [0]}
    # four pieces of one forward where the uncached request takes its passes apart: float32 rounding apart
    assert max_diff(task.latents, plain.latents) <= BATCH_TOL
    assert not torch.equal(task.latents, eng.run(params(eng, method)).latents)  # skipping steps does change it


@pytest.mark.parametrize("method", list(METHODS))
def test_rollout_sde_steps_compute_and_log_probs_equal_the_trainers(method, record_property):
    eng = engine("tiny-ltx2")
    rollout = RolloutParams(sde_type="sde", noise_level=0.7, sde_step_indices=WINDOW, return_trajectory=True)
    task, seen = _run_recorded(eng, params(eng, method, rollout=rollout))
    skipped = [s for s, masks in seen if not all(all(m) for m in masks)]
    assert skipped and not set(skipped) & set(WINDOW), skipped  # ODE steps outside the window only
    log_probs = task.extras()[LOG_PROBS.name]
    assert log_probs.shape == (1, len(WINDOW))
    ex = task.extras()
    traj = Trajectory(ex[TRAJECTORY_LATENTS.name][0], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])
    with torch.no_grad():
        recomputed = models.trainer(eng.info.path).log_probs(traj, ex[LOG_PROB_STEPS.name], task.params)
    d = max_diff(recomputed, log_probs[0])
    record_property("max_diff", d)
    print(f"\n[ltx2 {method}] rollout skipped steps {skipped}, log-probs {d:.3g}")
    assert d <= 1e-5
