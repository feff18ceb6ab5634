"""HunyuanVideo 1.5 rollouts: every step variant's log-probs equal the trainer's recompute (``rl.TrainerPolicy``,
guided through the guider's combination, image-to-video with its condition channels and SigLIP embeds); requests
batched with others at other steps each equal their runs alone."""

from __future__ import annotations

import pytest
import torch

from common.builtin import ensure_builtin
from common.protocol.messages import (LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS,
                                      TRAJECTORY_TIMESTEPS)
from family_harness import ModuleModels, compare_tasks, max_diff
from family_harness import gradient_picture as picture
from rl import Trajectory

TOL = 1e-5
STEPS = 3
models = ModuleModels()

# (model, step variant, guidance_scale, the SDE steps: indices or a window)
CASES = {
    "sde-guided": ("tiny-hunyuan-video15", "sde", 6.0, dict(sde_step_indices=[0, 1])),
    "cps-unguided": ("tiny-hunyuan-video15", "cps", 1.0, dict(sde_step_indices=[1, 2])),
    "flow_grpo_wan-guided": ("tiny-hunyuan-video15", "flow_grpo_wan", 4.0, dict(sde_step_indices=[0, 2])),
    "i2v-dance_grpo-window": ("tiny-hunyuan-video15-i2v", "dance_grpo", 5.0, dict(sde_window_size=2)),
}


@pytest.fixture(scope="module", autouse=True)
def _module():
    yield from models.module_scope()


def rollout_params(trainer, sde_type: str, guidance: float, image=None, n: int = 2, seed: int = 3, **steps):
    """A rollout's params as the router makes them (the trainer's conversion is the router's)."""
    extra = {} if image is None else {"image": image}
    return trainer.params('a lighthouse sign saying "NORTH" at dusk', "blurry", num_inference_steps=STEPS, n=n,
                          seed=seed, guidance_scale=guidance, sde_type=sde_type,
                          noise_level=0.8 if sde_type == "cps" else 0.7, return_trajectory=True, **steps, **extra)


@pytest.mark.parametrize("case", list(CASES))
def test_the_trainer_recomputes_the_log_probs(case, record_property):
    model, sde_type, guidance, steps = CASES[case]
    model_dir = ensure_builtin(model)
    eng, trainer = models.engine(model_dir), models.trainer(model_dir)
    image = picture(50, 70) if model.endswith("i2v") else None
    p = rollout_params(trainer, sde_type, guidance, image, **steps)
    ex = eng.run(p, image=image).extras()
    inputs = None if image is None else trainer.image(p, image)
    embeddings = trainer.embeddings(p, inputs)
    assert (embeddings[1] is None) == (guidance == 1.0)
    diffs = {}
    for i in range(p.n):
        sample = Trajectory(ex[TRAJECTORY_LATENTS.name][i], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])
        with torch.no_grad():
            got = trainer.log_probs(sample, ex[LOG_PROB_STEPS.name], p, embeddings=embeddings, image=inputs)
        diffs[i] = max_diff(got, ex[LOG_PROBS.name][i])
    record_property("diffs", diffs)
    assert ex[LOG_PROBS.name].shape == (p.n, len(ex[LOG_PROB_STEPS.name])) and torch.isfinite(ex[LOG_PROBS.name]).all()
    assert len(ex[LOG_PROB_STEPS.name]) >= 1
    assert all(d <= TOL for d in diffs.values()), diffs


@pytest.mark.parametrize("model", ["tiny-hunyuan-video15", "tiny-hunyuan-video15-i2v"])
def test_requests_batched_at_other_steps_equal_their_runs_alone(model):
    """A guided rollout, a guided generation with another prompt and an unguided rollout, started one step apart,
    in shared forwards: each equals its run alone."""
    model_dir = ensure_builtin(model)
    eng, trainer = models.engine(model_dir), models.trainer(model_dir)
    image = picture(50, 70) if model.endswith("i2v") else None
    extra = {} if image is None else {"image": image}
    made = [rollout_params(trainer, "sde", 6.0, image, seed=11, sde_step_indices=[0, 1]),
            trainer.params("a quiet harbour", "noise", num_inference_steps=STEPS, seed=12, guidance_scale=3.0, **extra),
            rollout_params(trainer, "cps", 1.0, image, n=1, seed=13, sde_step_indices=[1])]
    alone = [eng.run(p, image=image) for p in made]
    tasks = [eng.task(made[0], image=image)]
    eng.step(tasks)
    tasks.append(eng.task(made[1], image=image))
    eng.step(tasks)
    tasks.append(eng.task(made[2], image=image))
    before = eng.shared_forwards
    while not all(t.done for t in tasks):
        eng.step([t for t in tasks if not t.done])
    assert eng.shared_forwards > before
    scale = max(a.latents.abs().max().item() for a in alone)  # batched float32 sums round otherwise
    diffs = [compare_tasks(a, b) for a, b in zip(alone, tasks)]
    assert all(d <= TOL * max(1.0, scale) for d in diffs), (diffs, scale)
