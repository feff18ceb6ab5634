"""What a trainer asks of a rollout's answer, on every family (the registry's tiny built-ins), in one process: the
denoise worker's own task (tests/family_harness.py) for a group with its own seeds, the trajectory entries its
SDE steps need and the conditioning; then SGLang's answer built from that outcome.

- ``seeds``: each sample's generator is its own seed's (its initial noise is the draw of that seed, as diffusers
  draws it);
- ``trajectory_steps: "sde"``: x_i and x_{i+1} of each SDE step, the very latents of the whole trajectory;
- ``return_conditioning``: equal bit for bit to what ``rl.TrainerPolicy`` computes for the same request (its
  text encoder and image side), so a trainer may skip its own;
- SGLang's answer of that outcome reads back with its reader: log-probs over every step, 0 without an SDE.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from common.builtin import ensure_builtin
from common.diffusion import schedulers
from common.families import read_model
from common.diffusion.rollout_params import serving_has_flow_sigmas
from common.config.engine import Limits
from common.diffusion.conditioning import grouped
from common.diffusion.parts.text import text_kwargs
from common.protocol.messages import CONDITIONING, LOG_PROB_STEPS, LOG_PROBS, OUTPUT, TRAJECTORY_LATENTS
from edit_models import SLOW_MODELS
from family_builtins import tiny_per_pipeline
from denoise_worker.task import initial_noise
from family_harness import ModuleModels, max_diff
from router.request.schemas import RolloutBody
from router.core.errors import FieldError
from router.core.request_params import to_params
from router.link.join import Outcome
from router.peers.sglang import answer
from router.peers.sglang.translate import Plan
from test_peer_sglang import read

models = ModuleModels()


@pytest.fixture(scope="module", autouse=True)
def _models():
    yield from models.module_scope()


@pytest.mark.parametrize("pipeline,model", sorted(tiny_per_pipeline().items()))
def test_caller_sigmas_are_taken_as_given_on_every_family(pipeline, model):
    """``sigmas_as_given``: the rollout schedule holds the caller's sigmas themselves (no shift, static or
    dynamic), its timesteps ``sigmas * num_train_timesteps``; without it the family's shift applies as before."""
    info = read_model(ensure_builtin(model))
    serving = schedulers.load_serving_template(info)
    template = schedulers.rollout_template_for(serving)
    given = [0.95, 0.6, 0.25]
    image = "x" if info.family.condition.image_input(info) == "required" else None
    for as_given in (True, False):
        body = RolloutBody(prompt="a fox", sigmas=given, sigmas_as_given=as_given, image=image)
        p = to_params(body, info, Limits(), None, {"image": torch.zeros(64, 96, 3, dtype=torch.uint8)} if image else {})
        s = schedulers.build(template, p, image_seq_len=info.family.latents.seq_len(info, p),
                             default_sigmas=info.family.guidance.default_sigmas, mu=info.family.latents.mu(info, p))
        exact = torch.equal(s.sigmas[:-1], torch.tensor(given, dtype=s.sigmas.dtype))
        assert exact == as_given or (not as_given and info.flow_shift == 1.0 and not info.dynamic_shifting)
        if as_given:
            assert torch.equal(s.timesteps, (torch.tensor(given) * info.num_train_timesteps).to(s.timesteps.dtype))
    if serving_has_flow_sigmas(info) and not type(serving).__name__.startswith("FlowMatch"):  # its own grid: refused
        with pytest.raises(FieldError) as refused:
            to_params(RolloutBody(prompt="a fox", sigmas=given, sigmas_as_given=True, schedule="serving", image=image),
                      info, Limits(), None, {"image": torch.zeros(64, 96, 3, dtype=torch.uint8)} if image else {})
        assert refused.value.field == "sigmas_as_given"


def _image(info):
    if info.family.condition.image_input(info) is None:
        return None
    rng = np.random.default_rng(1)
    return Image.fromarray(rng.integers(0, 256, (64, 96, 3), dtype=np.uint8))


# The Qwen-Image edit models' cases (10 to 13 s each) are heavy (tests/edit_models.py); FLUX.1 Kontext covers edits here.
CASES = [pytest.param(p, m, marks=pytest.mark.heavy) if any(getattr(s, "marks", ()) and s.values[0] == m
                                                             for s in SLOW_MODELS) else (p, m)
         for p, m in sorted(tiny_per_pipeline().items())]


@pytest.mark.parametrize("pipeline,model", CASES)
def test_a_rollout_answers_what_a_trainer_asks_on_every_family(pipeline, model):
    model_dir = ensure_builtin(model)
    eng, trainer = models.engine(model_dir), models.trainer(model_dir)
    info, image = eng.info, _image(eng.info)
    pixels = {} if image is None else {"image": torch.from_numpy(np.array(image))}
    body = RolloutBody(prompt="a red fox", seeds=[5, 9], num_inference_steps=2, sde_step_indices=[0],
                       return_trajectory=True, trajectory_steps="sde", return_conditioning=True,
                       image="x" if image is not None else None)
    p = to_params(body, info, Limits(), None, pixels)
    assert (p.n, p.seed, [p.sample_seed(i) for i in range(2)]) == (2, 5, [5, 9])
    assert p.rollout.trajectory_steps == [0, 1]
    threads = eng.max_threads  # each image side at the same thread count (the VAE's GroupNorm sums per thread)
    torch.set_num_threads(threads)
    task = eng.run(p, image=image)
    extras = task.extras()

    # trajectory_steps: the entries [0, 1] of 0..2, [n, 2, *latent]; seeds: entry 0 is each sample's initial
    # noise, drawn from its own seed's generator (which then draws its SDE noise)
    traj = extras[TRAJECTORY_LATENTS.name]
    assert traj.shape[:2] == (2, 2) and extras["trajectory.steps"].tolist() == [0, 1]
    for i, seed in enumerate((5, 9)):
        one = msgspec.structs.replace(p, seed=seed, seeds=None, n=1)
        assert torch.equal(traj[i, 0], initial_noise(info, one, [torch.Generator().manual_seed(seed)])[0])

    # return_conditioning: the trainer's own embeddings and image side, bit for bit
    env = grouped({k.removeprefix(CONDITIONING.name): v for k, v in extras.items() if CONDITIONING.names(k)})
    torch.set_num_threads(threads)
    image_inputs = None if image is None else trainer.image(p, image)
    cond, uncond = trainer.embeddings(p, image_inputs)
    for got, want in ((env["cond"], cond), (env.get("uncond"), uncond)):
        if want is None:
            assert got is None
            continue
        assert set(got) == set(text_kwargs(want))
        for k, t in text_kwargs(want).items():
            assert torch.equal(got[k], t), (k, max_diff(got[k], t))
    if image_inputs is not None and image_inputs.condition is not None:
        given = env["image"]
        cond_image = image_inputs.condition
        if isinstance(cond_image, torch.Tensor):
            assert torch.equal(given["condition"], cond_image)
        else:
            assert torch.equal(given["reference_latents"], cond_image.tokens)
            assert given["reference_grids"].tolist() == [list(g) for g in cond_image.grids]
    guidance = info.family.guidance.embedded(info, p.guidance_scale)
    assert (env.get("guidance") is None) == (guidance is None)

    # SGLang's answer of this outcome
    latents = task.output_latents()
    frames = torch.cat([eng.decoded(latents[i:i + 1], p).frames for i in range(2)])
    outcome = Outcome({OUTPUT.name: frames, **extras}, {}, {}, None)
    plan = Plan(seed=5, steps=2, rollout=True, sde_type="sde", noise_level=0.7, no_const=False, dit_trajectory=True,
                return_steps=[0, 1], peak_memory=False)
    samples = read(msgspec.msgpack.decode(answer.encode(answer.samples("r", "a red fox", plan, outcome, 2, 1.0))))
    for i, s in enumerate(samples):
        lp = s["rollout_log_probs"]
        assert lp.shape == (2,) and lp[1] == 0
        assert lp[0] == extras[LOG_PROBS.name][i][extras[LOG_PROB_STEPS.name].tolist().index(0)]
        assert torch.equal(s["dit_trajectory"]["latents"], traj[i])
        assert torch.equal(s["generated_output"], frames[i].permute(3, 0, 1, 2))
        assert set(s["denoising_env"]["pos_cond_kwargs"]) == set(text_kwargs(cond))
