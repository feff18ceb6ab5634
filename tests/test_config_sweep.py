"""The configuration sweep: per family (the registry's pipelines), configurations drawn at random over the knobs
its pipeline and models read (common/builtin/sweep.py: widths, heads, patches, latent and VAE sizes, text
encoders, the scheduler's shift, dynamic shifting and its bounds, time-shift type, terminal shift, Karras or
exponential sigmas, guidance embeddings, experts, the request), each built as a tiny model in a temp directory and
then either served equal to the family's diffusers pipeline or refused when the engine reads the directory
(launch), in one line naming the property. For each one served:

- serving: the engine's final latents equal the pipeline's (``output_type="latent"``) within 1e-4 of their scale;
- rollouts: an SDE rollout's log-probs equal ``rl.TrainerPolicy``'s recompute from the trajectory within 1e-5;
- batching: the rollout and a serving request of another seed, stepped in shared forwards one step apart, each
  equal to its run alone within 1e-5.

``DISAGG_SWEEP_N`` configurations per family (default 1, in CI too) of sweep ``DISAGG_SWEEP_SEED`` (default
0), printed at the end of the run; any case is rebuilt from (pipeline, seed, index) with
``common.builtin.sweep.build_drawn``.
"""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest
import torch
from PIL import Image

from common.builtin.sweep import base_specs, build_drawn, describe
from common.families.checkpoints import checkpoint_problem
from common.config.engine import Limits
from common.protocol.errors import RequestError
from common.protocol.messages import LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, TRAJECTORY_TIMESTEPS
from family_harness import InProcess, InStage, max_diff, negative_for
from pipeline_reference import pipeline_for, pipeline_outputs
from router.request.schemas import GenerateBody, RolloutBody
from router.core.request_params import to_params
from rl import TrainerPolicy, Trajectory

SEED = int(os.environ.get("DISAGG_SWEEP_SEED", "0"))
PER_FAMILY = int(os.environ.get("DISAGG_SWEEP_N", "1"))
SERVE_TOL = 1e-4  # of the latents' scale
RECOMPUTE_TOL = 1e-5
BATCH_TOL = 1e-5  # of the latents' scale
CASES = [(pipeline, i) for pipeline in sorted(base_specs()) for i in range(PER_FAMILY)]
# Over 30 s a case (the pipelines resize every reference to a 1024 x 1024 area for the VAE): CI runs them; the
# default suite's Qwen-Image edit cases are tests/test_qwen_image_edit.py's and tests/test_edit_rollouts.py's.
HEAVY = {"QwenImageEditPipeline", "QwenImageEditPlusPipeline"}


@pytest.fixture(scope="module", autouse=True)
def _threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _picture(seed: int) -> Image.Image:
    """A smooth picture of another size and aspect than any request's."""
    coarse = np.random.RandomState(seed).randint(0, 256, (5, 7, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((104, 80), Image.BILINEAR)


def _images(info, seed: int) -> dict:
    """The request's pictures where the model and its pipeline class take them (required or optional): ``image``,
    and ``last_image`` where the model needs one (first-last-frame)."""
    import diffusers

    condition = info.family.condition
    takes = inspect.signature(getattr(diffusers, info.family.pipeline).__call__).parameters
    out = {} if condition.image_input(info) is None or "image" not in takes else {"image": _picture(seed)}
    if out and condition.last_image_input(info) == "required":
        out["last_image"] = _picture(seed + 1)
    return out


def _params(eng, images: dict, body=GenerateBody, **fields):
    """A request as the router makes it (its checks, the size an image decides), with its pictures."""
    if negative_for(eng.info, "blurry") is not None:
        fields["negative_prompt"] = "blurry"
    pixels = {k: torch.from_numpy(np.array(v)) for k, v in images.items()}
    return to_params(body(prompt="a red fox in the snow", **{k: "x" for k in images}, **fields), eng.info, Limits(),
                     None, pixels)


def _refusal(model_dir) -> str | None:
    """Why launch.py refuses the directory (its files, its configs, the facts the engine reads), or None."""
    return checkpoint_problem(model_dir)


def _turn(st: InStage) -> list:
    """One turn of the stage: (request id, what it sent on) for each request it finished."""
    return [(msg.request_id, outcome) for msg, outcome in st.stage.work()]


def _scaled(a: torch.Tensor, b: torch.Tensor) -> float:
    return max_diff(a, b) / max(1.0, b.float().abs().max().item())


@pytest.mark.parametrize("pipeline,index", [pytest.param(p, i, marks=[pytest.mark.heavy] if p in HEAVY else [])
                                            for p, i in CASES], ids=[f"{p}-{i}" for p, i in CASES])
def test_a_drawn_configuration_is_served_equal_or_refused_at_launch(pipeline, index, tmp_path, record_property):
    spec, configs, model_dir = build_drawn(pipeline, SEED, index, tmp_path / "model")
    what = f"sweep seed {SEED} case {pipeline}-{index}: {describe(spec, configs)}"
    record_property("config", what)
    refused = _refusal(model_dir)
    if refused is not None:  # refused when read: one line naming why
        assert "\n" not in refused and len(refused) < 400, what
        pytest.skip(f"refused at launch: {refused}")
    eng = InProcess(model_dir)
    info, images = eng.info, _images(eng.info, index)
    image, last = images.get("image"), images.get("last_image")
    threads = eng.max_threads

    # serving against the pipeline on the same directory: latents where the pipeline returns them in the
    # engine's layout, else the frames both decode them to
    pipe = pipeline_for(model_dir)
    p = _params(eng, images, seed=index + 1)
    torch.set_num_threads(threads)
    try:
        want = pipeline_outputs(pipe, info, p, images)
    except ValueError as e:  # a request the pipeline cannot run either: the engine refuses it, naming a field
        with pytest.raises(RequestError) as refused:
            eng.run(p, image=image, last_image=last)
        assert "\n" not in str(refused.value), what
        pytest.skip(f"the pipeline cannot run the default request ({e}); the engine answers {refused.value}")
    torch.set_num_threads(threads)
    got = eng.run(p, image=image, last_image=last).output_latents()
    if got[0].shape == want.shape:
        diffs = {"latents": _scaled(got[0], want)}
    else:
        torch.set_num_threads(threads)
        want = pipeline_outputs(pipe, info, p, images, "np")
        diffs = {"frames": max_diff(eng.frames(got, p)[0], want)}
    record_property("diffs", diffs)
    assert max(diffs.values()) <= SERVE_TOL, (what, diffs)
    del pipe

    # a rollout, recomputed by the trainer
    roll = _params(eng, images, RolloutBody, seed=index + 7, n=2, sde_type="sde", noise_level=0.7,
                   return_trajectory=True)
    torch.set_num_threads(threads)
    task = eng.run(roll, image=image, last_image=last)
    ex = task.extras()
    trainer = TrainerPolicy(model_dir)
    inputs = None if image is None else trainer.image(roll, image, last)
    embeddings = trainer.embeddings(roll, inputs)
    for i in range(roll.n):
        sample = Trajectory(ex[TRAJECTORY_LATENTS.name][i], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])
        with torch.no_grad():
            again = trainer.log_probs(sample, ex[LOG_PROB_STEPS.name], roll, embeddings=embeddings, image=inputs)
        diffs[f"log_probs.{i}"] = max_diff(again, ex[LOG_PROBS.name][i])
    record_property("diffs", diffs)
    assert max(v for k, v in diffs.items() if k.startswith("log_probs")) <= RECOMPUTE_TOL, (what, diffs)

    # the rollout and a serving request held by the denoise worker's own stage, the second joining a step later
    # (its batch choice: one expert, one size a forward), against each run alone
    st = InStage(eng, tmp_path / "stage")
    other = _params(eng, images, seed=index + 30)
    held = {"roll": roll, "other": other}
    alone = {rid: st.serve({rid: (q, image)}, last)[rid] for rid, q in held.items()}
    shared, real = [], st.stage.denoiser.run  # the requests of each batched step
    st.stage.denoiser.run = lambda batch: shared.append(len(batch)) or real(batch)
    st.stage.accept(*st.message("roll", roll, image, last))
    together = dict(_turn(st))
    st.stage.accept(*st.message("other", other, image, last))
    while st.stage.has_work():
        together.update(_turn(st))
    diffs["batched"] = max(_scaled(together[rid].tensors[name], t) for rid in held
                           for name, t in alone[rid].tensors.items() if t.is_floating_point() and t.numel())
    record_property("diffs", diffs)
    record_property("shared_forwards", sum(n > 1 for n in shared))  # none where an expert split parts them
    assert diffs["batched"] <= BATCH_TOL, (what, diffs)
