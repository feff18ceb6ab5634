"""Groups that share their initial noise and branch from a shared prefix (denoise_worker/branching.py).

Every sample of a ``share_prefix`` group is compared with the request of its own seed alone (``n=1``,
``initial_noise_seed=seed``), which shares nothing with any other request: trajectory, log-probs and final
latents. The forwards are counted where the policy runs them, and the trainer recomputes a branched
sample's log-probs from its answer.
"""

from __future__ import annotations

import numpy as np
import pydantic
import pytest
import torch
from PIL import Image

from common.builtin import ensure_builtin
from common.config.engine import Limits
from common.diffusion import params as conversion
from common.protocol.messages import (
    LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, TRAJECTORY_TIMESTEPS, CacheParams,
    RolloutParams,
)
from family_harness import ModuleModels, max_diff, negative_for
from rl import Trajectory
from router.request.schemas import RolloutBody
from router.core import errors
from router.core.request_params import to_params

TOL = 1e-5
N, K = 4, 2  # a group of 4 whose SDE window starts at step K
_MODELS = ModuleModels()
FAMILIES = ["tiny", "tiny-sd3", "tiny-flux", "tiny-qwen-image", "tiny-sana", "tiny-wan-i2v", "tiny-z-image", "tiny-flux2-klein",
            "tiny-hunyuan-video15"]


@pytest.fixture(scope="module", autouse=True)
def _clear_models():
    yield
    _MODELS.clear()


def _picture() -> Image.Image:
    y, x = np.mgrid[0:40, 0:24] / 40
    rgb = np.stack([np.sin(6 * x), np.cos(5 * y), np.sin(4 * (x + y))], axis=-1)
    return Image.fromarray((127.5 * (1 + rgb)).astype(np.uint8))


IMAGE = _picture()


def _image(eng):
    return IMAGE if eng.family.condition.image_input(eng.info) == "required" else None  # (optional: own tests)


def _params(eng, steps: int, **rollout):
    d = eng.info.defaults
    over = dict(seed=7, n=N, num_inference_steps=steps, num_frames=d["num_frames"] if eng.family.video else 1,
                negative_prompt=negative_for(eng.info, "blurry") or "")  # (the router's "" where refused)
    r = RolloutParams(sde_step_indices=[K, K + 1], return_trajectory=True, **rollout)
    return eng.params(**over, rollout=r)


class RowCounter:
    """The rows the policy's forwards actually take (a CFG input counts its two branches)."""

    def __init__(self, policy):
        self.policy, self.rows = policy, 0
        self.inner = policy.batched_velocity

    def __call__(self, inputs):
        self.rows += sum(x.n * (1 if x.uncond is None else 2) for x in inputs)
        return self.inner(inputs)

    def __enter__(self):
        self.policy.batched_velocity = self
        return self

    def __exit__(self, *exc):
        del self.policy.batched_velocity  # the class's method again


def _replace(p, **over):
    import msgspec

    return msgspec.structs.replace(p, **over)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_branched_group_equals_its_samples_alone(name, record_property):
    eng = _MODELS.engine(ensure_builtin(name))
    steps = 5
    p = _params(eng, steps, share_prefix=True)
    with RowCounter(eng.policy) as counted:
        group = eng.run(p, image=_image(eng))
    cfg = 2 if group.uncond is not None else 1
    # The forwards: one row per step of the prefix, then every sample's own.
    assert counted.rows == (K + N * (steps - K)) * cfg, counted.rows
    counts = group.pass_counts()
    assert counts["prefix_transformer_passes"] == K * cfg
    assert counts["transformer_passes"] == [(steps - K) * cfg] * N
    ex = group.extras()
    traj = ex[TRAJECTORY_LATENTS.name]
    assert traj.shape[:2] == (N, steps + 1) and ex[LOG_PROBS.name].shape == (N, 2)
    for i in range(1, N):  # the prefix is one computation; the first SDE step branches
        assert torch.equal(traj[i, :K + 1], traj[0, :K + 1])
        assert max_diff(traj[i, K + 1], traj[0, K + 1]) > 1e-3
    worst = 0.0
    for i in range(N):
        alone = eng.run(_replace(p, seed=p.seed + i, n=1, rollout=_replace(
            p.rollout, share_prefix=False, initial_noise_seed=p.seed)), image=_image(eng))
        ax = alone.extras()
        assert torch.equal(ax[LOG_PROB_STEPS.name], ex[LOG_PROB_STEPS.name])
        worst = max(worst, max_diff(traj[i], ax[TRAJECTORY_LATENTS.name][0]),
                    max_diff(ex[LOG_PROBS.name][i], ax[LOG_PROBS.name][0]),
                    max_diff(group.output_latents()[i], alone.output_latents()[0]))
    record_property("max_abs_diff", worst)
    print(f"\n[{name}] group vs alone {worst:.3g}, rows {counted.rows} (not {N * steps * cfg})")
    assert worst <= TOL


@pytest.mark.parametrize("name", FAMILIES)
def test_the_trainer_recomputes_a_branched_samples_log_probs(name, record_property):
    eng = _MODELS.engine(ensure_builtin(name))
    p = _params(eng, 4, share_prefix=True)
    ex = eng.run(p, image=_image(eng)).extras()
    trainer = _MODELS.trainer(ensure_builtin(name))
    image = None if _image(eng) is None else trainer.image(p, IMAGE)
    worst = 0.0
    with torch.no_grad():
        for i in range(N):
            tr = Trajectory(ex[TRAJECTORY_LATENTS.name][i], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])
            again = trainer.log_probs(tr, ex[LOG_PROB_STEPS.name], p, image=image)
            worst = max(worst, max_diff(again, ex[LOG_PROBS.name][i]))
    record_property("max_abs_diff", worst)
    assert worst <= TOL


def test_a_prefix_shares_forwards_with_other_requests_and_a_group_without_it_agrees():
    """A group in its one-row prefix steps together with another request (one forward, one joint step), and
    equals the same group without share_prefix (which shares the noise but computes every row)."""
    eng = _MODELS.engine(ensure_builtin("tiny"))
    p = _params(eng, 4, share_prefix=True)
    other = _replace(p, prompt="a quiet harbour", seed=3, n=2, rollout=_replace(p.rollout, share_prefix=False,
                                                                                initial_noise_seed=None))
    a, b = eng.task(p), eng.task(other)
    shared_before = eng.shared_forwards
    while not a.done:
        eng.step([a, b])
    assert eng.shared_forwards - shared_before == 4
    full = eng.run(_replace(p, rollout=_replace(p.rollout, share_prefix=False, initial_noise_seed=p.seed)))
    assert max_diff(a.extras()[TRAJECTORY_LATENTS.name], full.extras()[TRAJECTORY_LATENTS.name]) <= TOL
    assert max_diff(a.extras()[LOG_PROBS.name], full.extras()[LOG_PROBS.name]) <= TOL
    assert max_diff(b.extras()[LOG_PROBS.name], eng.run(other).extras()[LOG_PROBS.name]) <= TOL
    assert full.pass_counts()["transformer_passes"] == [4 * (1 if full.uncond is None else 2)] * N
    assert "prefix_transformer_passes" not in full.pass_counts()


def test_an_answer_cut_inside_the_prefix_has_every_sample():
    eng = _MODELS.engine(ensure_builtin("tiny"))
    task = eng.task(_params(eng, 4, share_prefix=True))
    eng.step([task])
    assert task.n == 1 and task.output_latents().shape[0] == N
    ex = task.extras()
    assert ex[TRAJECTORY_LATENTS.name].shape[:2] == (N, 2) and ex[LOG_PROBS.name].shape == (N, 0)
    assert task.pass_counts() == {"transformer_passes": [0] * N, "cached_steps": [0] * N,
                                  "prefix_transformer_passes": 2}


BAD = [
    (dict(share_prefix=True, cache={"method": "teacache"}), "cache"),
    (dict(share_prefix=True, rollout=False), "share_prefix"),
    (dict(initial_noise_seed=-1), "initial_noise_seed"),
    (dict(initial_noise_seed=2**63), "initial_noise_seed"),
    (dict(share_prefix="yes"), "share_prefix"),
]


@pytest.mark.parametrize("fields,field", BAD, ids=[f for _, f in BAD])
def test_bad_fields_are_refused_naming_them(fields, field):
    info = _MODELS.engine(ensure_builtin("tiny")).info
    try:
        body = RolloutBody(prompt="a fox", n=2, **fields)
    except pydantic.ValidationError as e:  # the router's 400 names the body's field
        assert [err["loc"][0] for err in e.errors()] == [field]
    else:
        with pytest.raises(errors.FieldError) as e:
            to_params(body, info, Limits())
        assert e.value.field == field
    if field != "share_prefix" or "rollout" in fields:  # the conversion a trainer calls refuses it too
        with pytest.raises(conversion.FieldError) as e:
            conversion.to_params({"prompt": "a fox", "n": 2, "sde_type": "sde", **fields}, info, Limits())
        assert e.value.field == field


def test_the_engine_default_cache_leaves_a_shared_prefix_alone():
    info = _MODELS.engine(ensure_builtin("tiny")).info
    default = CacheParams(method="teacache", threshold=0.1)
    p = to_params(RolloutBody(prompt="a fox", n=2, share_prefix=True), info, Limits(), default)
    assert p.cache is None and p.rollout.share_prefix and p.rollout.initial_noise_seed is None
    assert to_params(RolloutBody(prompt="a fox", n=2), info, Limits(), default).cache == default


def _computed_rows(engine) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    r = engine.http.get("/metrics")
    return sum(s.value for family in text_string_to_metric_families(r.text) for s in family.samples
               if s.name == "disagg_denoise_row_steps_total" and s.labels.get("kind") == "computed")


def test_through_the_engine_a_branched_group_answers_each_samples_solo_run(shared_engine):
    """The HTTP path end to end: the answer's samples, their forwards, and each one as its own request."""
    from router.client import EngineClient

    body = dict(prompt="a heron in the reeds", negative_prompt="blurry", seed=40, num_inference_steps=5,
                guidance_scale=4.0, output_type="latent", sde_step_indices=[K, K + 1], return_trajectory=True)
    engine = shared_engine("tiny")
    with EngineClient(engine.url) as client:
        before = _computed_rows(engine)
        group = client._post("/rollout/generate", {**body, "n": N, "share_prefix": True})["samples"]
        assert [s["seed"] for s in group] == [40 + i for i in range(N)]
        assert all(s["prefix_transformer_passes"] == 2 * K and s["transformer_passes"] == 2 * (5 - K)
                   for s in group)
        assert _computed_rows(engine) - before == 2 * K + N * 2 * (5 - K)  # the prefix counted once
        for i in (0, N - 1):
            alone = client._post("/rollout/generate", {**body, "seed": 40 + i, "initial_noise_seed": 40})["samples"][0]
            assert "prefix_transformer_passes" not in alone and alone["transformer_passes"] == 10
            for key in ("output", "log_probs"):
                assert (group[i][key] - alone[key]).abs().max().item() <= TOL
            assert (group[i]["trajectory"]["latents"] - alone["trajectory"]["latents"]).abs().max().item() <= TOL
