"""FLUX.2 [klein] rollouts in process (tests/family_harness.py): each step variant's log-probs over an SDE window
equal ``rl.TrainerPolicy``'s recompute from the returned trajectory within 1e-5 (CFG with the empty prompt and
without, an edit with a reference image, the serving schedule); requests batched with others of the same model
at other steps each equal their run alone within 1e-5."""

from __future__ import annotations

import pytest
import torch

from common.builtin import ensure_builtin
from common.protocol.messages import (LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS,
                                      TRAJECTORY_TIMESTEPS, RolloutParams)
from family_harness import ModuleModels, compare_tasks, gradient_picture, max_diff
from rl import Trajectory

TOL = 1e-5
STEPS = 4
models = ModuleModels()


@pytest.fixture(scope="module", autouse=True)
def _module():
    yield from models.module_scope()


def rollout(eng, sde_type: str, guidance_scale: float, n: int = 2, seed: int = 3, **rollout_fields):
    return eng.params(num_inference_steps=STEPS, n=n, seed=seed, prompt="a kite over the dunes",
                      guidance_scale=guidance_scale,
                      rollout=RolloutParams(sde_type=sde_type, noise_level=0.8 if sde_type == "cps" else 0.7,
                                            return_trajectory=True, **rollout_fields))


# (step variant, guidance scale, with a reference image, rollout fields)
CASES = {
    "sde-cfg": ("sde", 4.0, False, dict(sde_step_indices=[0, 1])),
    "cps-no-guidance": ("cps", 1.0, False, dict(sde_step_indices=[1, 2])),
    "flow_grpo_wan-serving-schedule": ("flow_grpo_wan", 3.0, False, dict(sde_step_indices=[0, 2], schedule="serving")),
    "dance_grpo-edit-window": ("dance_grpo", 2.0, True, dict(sde_window_size=2)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_trainer_recomputes_the_log_probs(case, record_property):
    sde_type, scale, edit, fields = CASES[case]
    model_dir = ensure_builtin("tiny-flux2-klein")
    eng, trainer = models.engine(model_dir), models.trainer(model_dir)
    torch.set_num_threads(1)
    if "sde_window_size" in fields:  # the window this seed picks, as the router resolves it
        fields = dict(sde_step_indices=trainer.params("a kite", num_inference_steps=STEPS, seed=3, rollout=True,
                                                      **fields).rollout.sde_step_indices)
    image = gradient_picture(70, 90, seed=2) if edit else None
    p = rollout(eng, sde_type, scale, **fields)
    task = eng.run(p, image=image)
    ex = task.extras()
    inputs = None if image is None else trainer.image(p, image)
    embeddings = trainer.embeddings(p, inputs)
    assert (embeddings[1] is not None) == (scale > 1)
    steps = ex[LOG_PROB_STEPS.name]
    assert steps.tolist() == fields["sde_step_indices"]
    diffs = {}
    for i in range(p.n):
        sample = Trajectory(ex[TRAJECTORY_LATENTS.name][i], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])
        with torch.no_grad():
            got = trainer.log_probs(sample, steps, p, embeddings=embeddings, image=inputs)
        diffs[i] = max_diff(got, ex[LOG_PROBS.name][i])
    record_property("diffs", diffs)
    assert all(d <= TOL for d in diffs.values()), diffs


def test_requests_batched_at_other_steps_equal_their_runs_alone():
    """A CFG rollout, an unguided generation and a CFG generation of another prompt, started one step apart, in
    shared forwards: each equals its run alone."""
    eng = models.engine(ensure_builtin("tiny-flux2-klein"))
    made = [rollout(eng, "sde", 4.0, seed=11, sde_step_indices=[1, 2]),
            eng.params(num_inference_steps=STEPS, seed=12, guidance_scale=1.0),
            eng.params(num_inference_steps=STEPS, seed=13, guidance_scale=2.0, prompt="a tram in the rain")]
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
    diffs = [compare_tasks(a, b) for a, b in zip(alone, tasks)]
    assert all(d <= TOL for d in diffs), diffs
