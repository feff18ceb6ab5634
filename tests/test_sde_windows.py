"""Random SDE windows (``sde_window_size`` / ``sde_window_range``) and the solver after them (``ode_solver``),
in process on every family's tiny model (tests/family_harness.py):

1. The window is picked from the seed (Flow-GRPO-Fast's ``randint(lo, hi - size)``): the same seed gives the same
   window, seeds spread it over every start of the range, a group shares it, the task reports it.
2. Steps outside the window carry no log-prob and are the Euler step (a float64 recompute from the trainer's
   velocity); the window's log-probs equal ``TrainerPolicy.log_probs`` within 1e-5.
3. ``ode_solver: "serving"``: the final latents equal a serving run this test makes itself (the diffusers class
   of the model's scheduler config, set to the remaining sigmas, stepped with the trainer's velocity) from the
   window's last latent, within 1e-5; the window's log-probs are the ``euler`` run's, bit for bit; requests at
   different windows batched together equal their runs alone.
4. Bad window fields fail with a FieldError naming the field.
"""

from __future__ import annotations

import diffusers
import pytest
import torch

from common.builtin import ensure_builtin
from common.config.engine import Limits
from common.diffusion import windows
from common.diffusion.params import FieldError, to_params
from common.families import read_model
from common.protocol.messages import LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, \
    TRAJECTORY_TIMESTEPS
from family_harness import ModuleModels, compare_tasks, max_diff, negative_for
from rl import Trajectory
from test_wan_i2v import picture

TOL = 1e-5
MODELS = ["tiny", "tiny-sd3", "tiny-flux", "tiny-qwen-image", "tiny-sana", "tiny-wan-i2v", "tiny-z-image", "tiny-flux2-klein",
          "tiny-hunyuan-video15"]
STEPS = 6
# Windows of 2 steps starting at 0 or 1: at least 3 steps come after, so a multistep solver reaches its order.
WINDOW = dict(num_inference_steps=STEPS, sde_window_size=2, sde_window_range=[0, 3], sde_type="sde",
              noise_level=0.7, return_trajectory=True)
IMAGE = picture(40, 24, 1)
_MODELS = ModuleModels()


@pytest.fixture(scope="module", autouse=True)
def _drop_models():
    yield
    _MODELS.clear()


def _setup(name: str, seed: int, **over):
    model_dir = ensure_builtin(name)
    eng, trainer = _MODELS.engine(model_dir), _MODELS.trainer(model_dir)
    p = trainer.params("a red kite over the sea", negative_for(eng.info, " "), seed=seed, **{**WINDOW, **over})
    takes_image = eng.family.condition.image_input(eng.info) == "required"  # (optional ones: own tests)
    image = IMAGE if takes_image else None
    return eng, trainer, p, image, (trainer.image(p, IMAGE) if takes_image else None)


def _trajectory(ex: dict) -> Trajectory:
    return Trajectory(ex[TRAJECTORY_LATENTS.name][0], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])


def test_the_seed_picks_the_window_and_seeds_spread_it():
    info, limits = read_model(ensure_builtin("tiny")), Limits()
    request = dict(prompt="p", num_inference_steps=8, sde_window_size=3, sde_window_range=[1, 7])
    picked = {to_params({**request, "seed": s}, info, limits).rollout.sde_window[0] for s in range(64)}
    assert picked == set(range(1, 5))  # randint(1, 7 - 3): both ends reachable, nothing outside
    for seed in (0, 5, 2**62):
        a, b = (to_params({**request, "seed": seed}, info, limits).rollout for _ in range(2))
        group = to_params({**request, "seed": seed, "n": 4}, info, limits).rollout
        assert a.sde_window == b.sde_window == group.sde_window == list(windows.pick_window(seed, 3, [1, 7], 8))
        assert a.sde_step_indices == list(range(*a.sde_window))
    # Without a range: anywhere in [0, steps].
    full = {tuple(to_params({"prompt": "p", "num_inference_steps": 4, "sde_window_size": 2, "seed": s}, info,
                            limits).rollout.sde_window) for s in range(64)}
    assert full == {(0, 2), (1, 3), (2, 4)}


@pytest.mark.parametrize("name", MODELS)
def test_outside_the_window_euler_inside_the_trainers_log_probs(name, record_property):
    eng, trainer, p, image, inputs = _setup(name, seed=11)
    start, stop = p.rollout.sde_window
    task = eng.run(p, image=image)
    ex = task.extras()
    assert task.window_info() == {"sde_window": [start, stop]}
    assert ex[LOG_PROB_STEPS.name].tolist() == list(range(start, stop))
    traj = _trajectory(ex)
    assert traj.latents.shape[0] == STEPS + 1
    cond, uncond = trainer.embeddings(p, inputs)
    euler = 0.0
    with torch.no_grad():
        for i in [i for i in range(STEPS) if not start <= i < stop]:
            x = traj.latents[i : i + 1]
            v = trainer.velocity(x, traj.timesteps[i], cond, uncond, p, inputs).double()
            want = x.double() + (traj.sigmas[i + 1].double() - traj.sigmas[i].double()) * v
            euler = max(euler, max_diff(want, traj.latents[i + 1 : i + 2]))
        again = trainer.log_probs(traj, list(range(start, stop)), p, embeddings=(cond, uncond), image=inputs)
    d = max_diff(again, ex[LOG_PROBS.name][0])
    record_property("max_diff", max(euler, d))
    print(f"\n[{name}] window {start}..{stop}: Euler outside {euler:.3g}, log-probs {d:.3g}")
    assert euler <= TOL and d <= TOL


def _serving_run(info, x, traj: Trajectory, start: int, velocity) -> torch.Tensor:
    """The model's serving scheduler, made here from its config, over sigmas[start:] as they are."""
    config = info.scheduler_config
    scheduler = getattr(diffusers, config["_class_name"]).from_config(config)
    k = STEPS - start
    scheduler.set_timesteps(k, **({"mu": 1.0} if config.get("use_dynamic_shifting") else {}))
    scheduler.sigmas = traj.sigmas[start:].clone().to(scheduler.sigmas.dtype)
    scheduler.timesteps = traj.timesteps[start:].clone()
    scheduler.set_begin_index(0)
    for i in range(start, STEPS):
        x = scheduler.step(velocity(x, traj.timesteps[i]), traj.timesteps[i], x, return_dict=False)[0]
    return x


@pytest.mark.parametrize("name", MODELS)
def test_serving_solver_after_the_window(name, record_property):
    eng, trainer, p, image, inputs = _setup(name, seed=4, ode_solver="serving")
    _, _, p_euler, _, _ = _setup(name, seed=4)
    start, stop = p.rollout.sde_window
    assert p_euler.rollout.sde_window == [start, stop]
    served, plain = eng.run(p, image=image), eng.run(p_euler, image=image)
    assert served.rule.after_from == stop
    assert torch.equal(served.rule.after.sigmas, served.scheduler.sigmas[stop:])  # kept, not shifted again
    s_ex, e_ex = served.extras(), plain.extras()
    assert torch.equal(s_ex[LOG_PROBS.name], e_ex[LOG_PROBS.name])
    assert torch.equal(s_ex[TRAJECTORY_LATENTS.name][:, : stop + 1], e_ex[TRAJECTORY_LATENTS.name][:, : stop + 1])
    traj = _trajectory(s_ex)
    assert traj.latents.shape[0] == STEPS + 1
    cond, uncond = trainer.embeddings(p, inputs)
    with torch.no_grad():
        mine = _serving_run(eng.info, traj.latents[stop : stop + 1], traj, stop,
                            lambda x, t: trainer.velocity(x, t, cond, uncond, p, inputs))
    d = max_diff(mine, traj.latents[-1:])
    vs_euler = max_diff(traj.latents[-1:], _trajectory(e_ex).latents[-1:])
    record_property("max_diff", d)
    print(f"\n[{name}] {type(served.rule.after).__name__} after {stop}: vs own run {d:.3g}, vs Euler {vs_euler:.3g}")
    assert d <= TOL
    if "Euler" not in type(served.rule.after).__name__:  # a higher-order solver lands elsewhere than Euler
        assert vs_euler > 100 * TOL


def test_windows_and_serving_steps_batched_with_others_equal_their_runs_alone(record_property):
    """Requests at different windows (one in its serving steps while the other takes SDE steps) share forwards
    and give what each gives alone."""
    model_dir = ensure_builtin("tiny")
    eng, trainer = _MODELS.engine(model_dir), _MODELS.trainer(model_dir)
    ps = [trainer.params("a red kite", " ", seed=4, ode_solver="serving", **WINDOW),
          trainer.params("a green boat", " ", seed=11, n=2, ode_solver="serving", **WINDOW),
          trainer.params("a blue house", " ", seed=11, **WINDOW)]
    assert [p.rollout.sde_window for p in ps] == [[0, 2], [1, 3], [1, 3]]
    tasks = [eng.task(p) for p in ps]
    before = eng.shared_forwards
    while not tasks[0].done:
        eng.step(tasks)
    assert eng.shared_forwards - before == STEPS
    d = max(compare_tasks(t, eng.run(p)) for t, p in zip(tasks, ps))
    record_property("max_diff", d)
    assert d <= TOL


@pytest.mark.parametrize("over, field", [
    (dict(sde_window_size=7), "sde_window_size"),  # larger than the 6 steps
    (dict(sde_window_size=3, sde_window_range=[2, 4]), "sde_window_range"),  # does not fit in the range
    (dict(sde_window_size=2, sde_window_range=[0, 7]), "sde_window_range"),  # past the last step
    (dict(sde_window_size=2, sde_window_range=[4, 2]), "sde_window_range"),
    (dict(sde_window_size=0), "sde_window_size"),
    (dict(sde_window_range=[0, 3]), "sde_window_range"),  # a range needs a size
    (dict(sde_window_size=2, sde_step_indices=[1]), "sde_window_size"),  # both kinds of window
    (dict(ode_solver="rk4"), "ode_solver"),
])
def test_bad_window_fields_name_the_field(over, field):
    info = read_model(ensure_builtin("tiny"))
    with pytest.raises(FieldError) as e:
        to_params({"prompt": "p", "num_inference_steps": STEPS, **over}, info, Limits())
    assert e.value.field == field
