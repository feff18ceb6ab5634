"""Edit rollouts on the three edit models (Qwen-Image-Edit, Qwen-Image-Edit-Plus, FLUX.1 Kontext), in process
(tests/family_harness.py: the encoder worker's text and image sides, the denoise worker's tasks and forwards).

1. A rollout of each step variant (sde, cps, Flow-GRPO's Wan step on the serving schedule, DanceGRPO's) over an
   SDE window, with ``return_kl`` against the base model and a LoRA (a diffusers file of the family's own
   pipeline, or a peft folder): the trajectory holds the noise tokens only (the reference tokens are a
   constant of the request), and the trainer's recompute (``rl.TrainerPolicy`` with the images and the same
   adapter put in by peft) equals the engine's log-probs, KL and reference log-probs within 1e-5.
2. A group: the encoder worker's own stage encodes its images once (the image side's calls counted through its
   cache, the text encoder's too); ``initial_noise_seed`` + ``share_prefix`` branching equals each sample run
   alone.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch

from common.protocol.messages import (
    KL, LOG_PROB_STEPS, LOG_PROBS, REF_LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, TRAJECTORY_TIMESTEPS,
)
from edit_models import SLOW_MODELS, EditModels, images_for, no_grad, rollout_params
from family_harness import max_diff
from rl import Trajectory

TOL = 1e-5
STEPS, WINDOW = 3, [1, 2]
models = EditModels()


@pytest.fixture(scope="module", autouse=True)
def _module():
    yield from models.module_scope()


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Of max(1, |want|): a KL of hundreds (cps near its last step) carries float32 rounding of its size."""
    return ((got.double() - want.double()).abs() / want.double().abs().clamp(min=1)).max().item()


# (model, step variant, schedule, adapter format, CFG): every variant and both formats over the three models.
CASES = {
    "edit-sde-file-cfg": ("tiny-qwen-image-edit", "sde", "rollout", "file", True),
    "edit-flow_grpo_wan-peft": ("tiny-qwen-image-edit", "flow_grpo_wan", "serving", "peft", False),
    "plus-cps-peft-cfg": ("tiny-qwen-image-edit-plus", "cps", "rollout", "peft", True),
    "plus-dance_grpo-file": ("tiny-qwen-image-edit-plus", "dance_grpo", "rollout", "file", False),
    "kontext-sde-peft": ("tiny-flux-kontext", "sde", "rollout", "peft", False),
    "kontext-dance_grpo-file-cfg": ("tiny-flux-kontext", "dance_grpo", "rollout", "file", True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_edit_rollout_is_the_noise_tokens_and_the_trainer_recomputes_it(case, tmp_path_factory,
                                                                            record_property):
    model, sde_type, schedule, kind, cfg = CASES[case]
    m = models.get(model, tmp_path_factory)
    eng, images = m.eng, images_for(model)
    # Both sides' encoders on one thread count (the worker's forwards take one: denoise_worker/threads.py): the
    # text encoders' reductions split by it, and their rounding shows in a KL as 2e-5 (Kontext).
    torch.set_num_threads(1)
    p = rollout_params(eng, sde_type, steps=STEPS, cfg=cfg, sde_step_indices=WINDOW, schedule=schedule,
                       return_kl=True, kl_reference="base")
    task = eng.run(p, lora=m.lora(kind), image=images)
    ex = task.extras()
    # The noise tokens alone: the latents, the trajectory and so the log-probs; the references are not in them.
    seq = eng.family.latents.image_seq_len(eng.info, p.height, p.width, 1)
    assert task.image is not None and task.image.tokens.shape[1] > 0
    assert task.latents.shape == (p.n, seq, task.image.tokens.shape[2])
    traj = ex[TRAJECTORY_LATENTS.name]
    assert traj.shape == (p.n, STEPS + 1, seq, task.latents.shape[2])
    window = [i for i in WINDOW if sde_type != "cps" or i < STEPS - 1]  # cps's last step draws no noise
    assert ex[LOG_PROB_STEPS.name].tolist() == window
    assert ex[LOG_PROBS.name].shape == ex[KL.name].shape == (p.n, len(window))
    assert (ex[KL.name] > 0).all()  # the adapter moves every step's mean off the base model's

    trainer = models.trainer_with(m, kind)
    image = trainer.image(p, images)
    i = p.n - 1  # the second sample's rows of the engine's forwards
    sample = Trajectory(traj[i], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])
    embeddings = no_grad(trainer.embeddings, p, image)
    steps = ex[LOG_PROB_STEPS.name]
    log_probs = no_grad(trainer.log_probs, sample, steps, p, embeddings=embeddings, image=image)
    kl, ref = no_grad(trainer.kl, sample, steps, p, embeddings=embeddings, image=image)
    diffs = {"log_probs": max_diff(log_probs, ex[LOG_PROBS.name][i]), "kl": rel_diff(kl, ex[KL.name][i]),
             "ref_log_probs": rel_diff(ref, ex[REF_LOG_PROBS.name][i])}
    record_property("max_diff", diffs)
    print(f"\n[{case}] trainer vs engine {diffs}")
    assert max(diffs.values()) <= TOL, diffs


# --- groups -------------------------------------------------------------------------------------------------


def _encoder_stage(eng):
    from common.config.engine import EngineConfig, WorkerSpec
    from encoder_worker.stage import EncoderStage

    stage = EncoderStage(EngineConfig(model=str(eng.info.path), workers=[], router_endpoint="", runtime_dir="/tmp"),
                         WorkerSpec(role="encoder", index=0))
    stage.load()
    return stage


def _spy(obj, name: str, calls: list) -> None:
    real = getattr(obj, name)
    setattr(obj, name, lambda *a: calls.append(a) or real(*a))  # the real one runs


@pytest.mark.parametrize("model", SLOW_MODELS)
def test_a_group_encodes_its_images_once_and_branches_as_its_samples_alone(model, tmp_path_factory,
                                                                           record_property):
    from common.protocol.messages import EDIT_IMAGES, PROTOCOL_VERSION, EncodeRequest, Route

    m = models.get(model, tmp_path_factory)
    eng, images = m.eng, images_for(model, many=True)
    p = rollout_params(eng, steps=STEPS, n=2, sde_step_indices=WINDOW, share_prefix=True)

    stage = _encoder_stage(eng)
    image_calls, text_calls = [], []
    _spy(stage.images, "wire_tensors", image_calls)
    _spy(stage.text_encoder, "wire_tensors", text_calls)
    pixels = {f.name: torch.from_numpy(np.asarray(im).copy()) for f, im in zip(EDIT_IMAGES, images)}

    def request(rid: str, params):
        return EncodeRequest(v=PROTOCOL_VERSION, request_id=rid, route=Route(encoder=0, denoise=0, decode=0),
                             params=params)

    out = stage.process_batch([(request("group", p), pixels)])
    again = stage.process_batch([(request("again", msgspec.structs.replace(p, seed=9)), dict(pixels))])
    assert len(image_calls) == 1 and len(text_calls) == 1  # the group, then a re-run: one encode of each
    want = eng.image_wire(p, images)
    for fwd in out + again:
        assert set(want) <= set(fwd.tensors) and all(torch.equal(fwd.tensors[k], want[k]) for k in want)

    group = eng.run(p, image=images)
    ex = group.extras()
    traj = ex[TRAJECTORY_LATENTS.name]
    k = WINDOW[0]
    for i in range(1, p.n):  # one prefix, then a branch per sample
        assert torch.equal(traj[i, : k + 1], traj[0, : k + 1])
        assert max_diff(traj[i, k + 1], traj[0, k + 1]) > 1e-3
    worst = 0.0
    for i in range(p.n):
        alone = eng.run(msgspec.structs.replace(p, seed=p.seed + i, n=1, rollout=msgspec.structs.replace(
            p.rollout, share_prefix=False, initial_noise_seed=p.seed)), image=images)
        ax = alone.extras()
        worst = max(worst, max_diff(traj[i], ax[TRAJECTORY_LATENTS.name][0]),
                    max_diff(ex[LOG_PROBS.name][i], ax[LOG_PROBS.name][0]),
                    max_diff(group.latents[i], alone.latents[0]))
    record_property("max_abs_diff", worst)
    print(f"\n[{model}] branched group vs alone {worst:.3g}")
    assert worst <= TOL
