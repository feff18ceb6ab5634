"""LTX-2 rollouts over both streams: the trainer recomputes the joint and each stream's log-probs; an SDE on one
stream leaves the other on its ODE; requests batched with others at other steps equal their runs alone; all of it
also on models whose streams' token widths differ (the narrower stream zero-padded, its padding in no statistic
and left at 0)."""

from __future__ import annotations

import numpy as np
import PIL.Image
import pytest
import torch

from common.builtin import ensure_builtin
from common.diffusion.params import FieldError
from common.families.ltx2.latents import geometry_of
from common.protocol.messages import (LOG_PROB_STEPS, LOG_PROBS, STREAM_LOG_PROBS, TRAJECTORY_LATENTS,
                                      TRAJECTORY_SIGMAS, TRAJECTORY_TIMESTEPS, RolloutParams)
from family_harness import ModuleModels, compare_tasks, max_diff
from rl import Trajectory
from test_ltx2 import NARROW_AUDIO, WIDE_AUDIO, WIDE_AUDIO_I2V

TOL = 1e-5
STEPS = 3
models = ModuleModels()
GUIDED = dict(guidance_scale=3.0, stg_scale=1.0, modality_scale=2.0, guidance_rescale=0.5, audio_guidance_scale=5.0,
              negative_prompt="blurry, silent")
# No pass beyond the conditional one (an audio field at 0 takes the video's).
UNGUIDED = dict(guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, audio_guidance_scale=0.0, audio_stg_scale=0.0,
                audio_modality_scale=0.0)


@pytest.fixture(scope="module", autouse=True)
def _module():
    yield from models.module_scope()


def picture(seed: int = 0) -> PIL.Image.Image:
    rng = np.random.RandomState(seed)
    return PIL.Image.fromarray(rng.randint(0, 256, (40, 56, 3), dtype=np.uint8)).resize((70, 50))


def rollout(eng, sde_type: str, guided: bool, n: int = 2, seed: int = 3, num_frames: int = 9, **rollout_fields):
    over = GUIDED if guided else UNGUIDED
    noise_level = 0.8 if sde_type == "cps" else 0.7
    return eng.params(num_inference_steps=STEPS, n=n, seed=seed, prompt="a dog barks at the sea",
                      num_frames=num_frames,
                      rollout=RolloutParams(sde_type=sde_type, noise_level=noise_level, return_trajectory=True,
                                            **rollout_fields), **over)


# (model, step variant, guided, the SDE's streams)
CASES = {
    "sde-guided-both": ("tiny-ltx2", "sde", True, None),
    "cps-video-only": ("tiny-ltx2", "cps", False, ["video"]),
    "flow_grpo_wan-audio-only-guided": ("tiny-ltx2", "flow_grpo_wan", True, ["audio"]),
    "i2v-dance_grpo-both": ("tiny-ltx2-i2v", "dance_grpo", True, None),
    # the streams' widths apart
    "audio-wider-sde-guided-both": (WIDE_AUDIO, "sde", True, None),
    "audio-narrower-cps-video-only": (NARROW_AUDIO, "cps", False, ["video"]),
    "audio-wider-i2v-flow_grpo_wan-both": (WIDE_AUDIO_I2V, "flow_grpo_wan", True, None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_trainer_recomputes_the_joint_and_each_streams_log_probs(case, record_property):
    model, sde_type, guided, chosen = CASES[case]
    model_dir = ensure_builtin(model)
    eng = models.engine(model_dir)
    torch.set_num_threads(1)
    image = picture() if getattr(model, "name", model).endswith("i2v") else None
    p = rollout(eng, sde_type, guided, sde_streams=chosen, sde_step_indices=[0, 1])
    task = eng.run(p, image=image)
    ex = task.extras()
    streams = chosen or ["video", "audio"]
    assert sorted(k for k in ex if k.startswith("log_probs_")) == sorted(f"log_probs_{s}" for s in streams)

    trainer = models.trainer(model_dir)
    inputs = None if image is None else trainer.image(p, image)
    embeddings = trainer.embeddings(p, inputs)
    steps = ex[LOG_PROB_STEPS.name]
    diffs = {}
    g = geometry_of(eng.info, p)
    for i in range(p.n):
        sample = Trajectory(ex[TRAJECTORY_LATENTS.name][i], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])
        with torch.no_grad():
            got = trainer.log_probs_by_stream(sample, steps, p, embeddings=embeddings, image=inputs)
        assert sorted(got) == sorted(["log_probs", *(f"log_probs_{s}" for s in streams)])
        for name, values in got.items():
            diffs[f"{name}[{i}]"] = max_diff(values, ex[name][i])
        if chosen is not None:  # the stream left out took its Euler step at every SDE step
            other = 1 if chosen == ["video"] else 0
            for k in steps.tolist():
                x = sample.latents[k : k + 1]
                with torch.no_grad():
                    v = trainer.velocity(x, sample.timesteps[k], *embeddings, p, inputs, sample.sigmas[k])
                euler = x + (sample.sigmas[k + 1] - sample.sigmas[k]) * v
                diffs[f"ode step {k}[{i}]"] = max_diff(g.split(sample.latents[k + 1 : k + 2])[other],
                                                       g.split(euler)[other])
    record_property("diffs", diffs)
    assert all(d <= TOL for d in diffs.values()), diffs  # (a NaN fails too)
    if chosen is None and image is None:  # the joint Gaussian is the element-weighted average of the streams'
        v, a = ex[STREAM_LOG_PROBS["video"].name], ex[STREAM_LOG_PROBS["audio"].name]
        sizes = g.video_tokens * g.channels, g.audio_tokens * g.audio_channels
        weighted = (sizes[0] * v + sizes[1] * a) / sum(sizes)
        assert max_diff(weighted, ex[LOG_PROBS.name]) <= TOL
    trajectory = ex[TRAJECTORY_LATENTS.name]
    assert trajectory.shape[-1] == g.width == max(g.channels, g.audio_channels)
    padding = 1 - sum(m.float() for m in g.stream_masks().values())  # the narrower stream's
    assert bool(padding.any()) == (g.channels != g.audio_channels)
    assert torch.equal(trajectory * padding, torch.zeros_like(trajectory))  # left at 0 at every step


@pytest.mark.parametrize("model", ["tiny-ltx2", NARROW_AUDIO], ids=["tiny-ltx2", "audio-narrower"])
def test_requests_batched_at_other_steps_equal_their_runs_alone(model):
    """A guided rollout (four passes a sample), a CFG-only generation and an unguided rollout with the SDE on the
    audio alone, started one step apart, in shared forwards: each equals its run alone."""
    eng = models.engine(ensure_builtin(model))
    made = [rollout(eng, "sde", True, seed=11),
            eng.params(num_inference_steps=STEPS, seed=12, num_frames=9, **{**UNGUIDED, "guidance_scale": 4.0},
                       negative_prompt="noise"),
            rollout(eng, "cps", False, n=1, seed=13, sde_streams=["audio"])]
    alone = [eng.run(p) for p in made]
    tasks = [eng.task(made[0])]
    eng.step(tasks)
    tasks.append(eng.task(made[1]))
    eng.step(tasks)
    tasks.append(eng.task(made[2]))
    before = eng.shared_forwards
    while not all(t.done for t in tasks):
        eng.step([t for t in tasks if not t.done])
    assert eng.shared_forwards > before
    # Of the latents' size (about 5 here): a forward of other rows rounds its float32 sums otherwise.
    scale = max(a.latents.abs().max().item() for a in alone)
    diffs = [compare_tasks(a, b) for a, b in zip(alone, tasks)]
    assert all(d <= TOL * max(1.0, scale) for d in diffs), (diffs, scale)


def test_an_image_to_video_request_of_one_latent_frame_has_no_video_log_probs():
    """Its video tokens are all the image's: the joint log-prob is the audio's, and an SDE on the video alone
    is refused (it would move nothing)."""
    from common.protocol.errors import RequestError

    eng = models.engine(ensure_builtin("tiny-ltx2-i2v"))
    task = eng.run(rollout(eng, "sde", False, n=1, num_frames=1), image=picture())
    ex = task.extras()
    assert STREAM_LOG_PROBS["video"].name not in ex
    assert torch.isfinite(ex[LOG_PROBS.name]).all()
    assert max_diff(ex[LOG_PROBS.name], ex[STREAM_LOG_PROBS["audio"].name]) <= TOL
    with pytest.raises(RequestError, match="sde_streams"):
        eng.task(rollout(eng, "sde", False, n=1, num_frames=1, sde_streams=["video"]), image=picture())


@pytest.mark.parametrize("model, streams, why", [
    ("tiny-ltx2", ["speech"], "among"), ("tiny-ltx2", ["video", "video"], "distinct"),
    ("tiny-flux", ["video"], "one latent stream")])
def test_sde_streams_are_checked(model, streams, why):
    trainer = models.trainer(ensure_builtin(model))
    with pytest.raises(FieldError) as e:
        trainer.params("a dog", rollout=True, sde_streams=streams)
    assert e.value.field == "sde_streams" and why in str(e.value)
