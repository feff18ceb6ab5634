"""Resuming a rollout from given latents (``initial_latents`` with the remaining ``sigmas``), in process on every
built-in family: the workers' own path (tests/family_harness.py) and the router's checks of the field.

1. A deterministic (``ode``) rollout resumed from its own step-k latent with ``sigmas[k:]`` ends where the
   uninterrupted run ends (1e-5), on the same sigmas from step k on.
2. A stochastic rollout resumed from another rollout's step-k latent, on a new seed: the trainer's recompute
   (``TrainerPolicy.log_probs``) on the joined trajectory gives both parts' log-probs (1e-5).
3. A bad ``initial_latents`` (shape, dtype, NaN, not a tensor; on /generate) is a FieldError naming the field.
4. The denoise worker's stage tags each step a rollout took (a partial answer's and a whole one's) with the weight
   version and the adapter version it ran on.
Through the engine (partial answers' per-step weight versions, a weight update in between): tests/test_rollout.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.builtin import ensure_builtin
from common.config.engine import Limits
from common.protocol.http_tensors import tensor_to_body
from common.protocol.messages import (
    LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, TRAJECTORY_TIMESTEPS, RolloutParams,
)
from family_harness import ModuleModels, max_diff
from rl import Trajectory
from router.core.errors import FieldError
from router.request.schemas import GenerateBody, RolloutBody
from router.core.request_params import initial_latents, to_params

TOL = 1e-5
STEPS, K = 4, 2
SIGMAS = np.linspace(1.0, 1.0 / STEPS, STEPS).tolist()  # the caller's schedule (before the scheduler's shift)
FAMILIES = ["tiny", "tiny-sd3", "tiny-flux", "tiny-qwen-image", "tiny-sana", "tiny-wan-i2v", "tiny-z-image", "tiny-flux2-klein",
            "tiny-hunyuan-video15"]
_MODELS = ModuleModels()


@pytest.fixture(scope="module", autouse=True)
def _drop_models():
    yield
    _MODELS.clear()


def _image(name: str):
    if name != "tiny-wan-i2v":
        return None
    from test_wan_i2v import IMAGE

    return IMAGE


def _params(eng, sigmas, seed, sde_type, **over):
    # A family whose own mu depends on the step count too (FLUX.2 [klein]): the whole schedule's, given to both.
    mu = eng.family.latents.mu(eng.info, eng.params(sigmas=SIGMAS, num_inference_steps=STEPS, num_frames=1))
    return eng.params(sigmas=list(sigmas), num_inference_steps=len(sigmas), seed=seed, num_frames=1, mu=mu, **over,
                      rollout=RolloutParams(sde_type=sde_type, noise_level=0.7, return_trajectory=True))


def _trajectory(task, i: int = 0) -> Trajectory:
    ex = task.extras()
    return Trajectory(ex[TRAJECTORY_LATENTS.name][i], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])


@pytest.mark.parametrize("name", FAMILIES)
def test_a_deterministic_rollout_resumed_at_step_k_ends_where_the_whole_run_ends(name, record_property):
    eng, image = _MODELS.engine(ensure_builtin(name)), _image(name)
    whole = eng.run(_params(eng, SIGMAS, 0, "ode"), image=image)
    x_k = whole.extras()[TRAJECTORY_LATENTS.name][:, K]
    resumed = eng.run(_params(eng, SIGMAS[K:], 5, "ode"), image=image, initial_latents=x_k)
    # The remaining sigmas give the whole run's schedule from step k on (the shift acts on each sigma alone).
    assert max_diff(resumed.scheduler.sigmas, whole.scheduler.sigmas[K:]) <= 1e-6
    assert torch.equal(_trajectory(resumed).latents[0], x_k[0])
    d = max_diff(resumed.output_latents(), whole.output_latents())
    record_property("max_diff", d)
    assert d <= TOL, (name, d)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_resumed_stochastic_rollout_joins_its_prefix_for_the_trainer(name, record_property):
    """The first k steps from one rollout (seed 3, cancelled there), the rest from its resumption on a new seed
    (7): the joined trajectory's recompute gives every log-prob the two answers hold."""
    model_dir = ensure_builtin(name)
    eng, image = _MODELS.engine(model_dir), _image(name)
    first = eng.run(_params(eng, SIGMAS, 3, "sde"), image=image)
    head = _trajectory(first)
    rest_p = _params(eng, SIGMAS[K:], 7, "sde")
    rest = eng.run(rest_p, image=image, initial_latents=head.latents[K:K + 1])
    tail = _trajectory(rest)
    joined = Trajectory(torch.cat([head.latents[:K + 1], tail.latents[1:]]),
                        torch.cat([head.timesteps[:K], tail.timesteps]),
                        torch.cat([head.sigmas[:K], tail.sigmas]))
    assert max_diff(joined.sigmas, head.sigmas) <= 1e-6 and max_diff(joined.timesteps, head.timesteps) <= 1e-3
    engine_log_probs = torch.cat([first.extras()[LOG_PROBS.name][0, :K], rest.extras()[LOG_PROBS.name][0]])
    assert rest.extras()[LOG_PROB_STEPS.name].tolist() == list(range(STEPS - K))  # the resumed request's own steps
    trainer = _MODELS.trainer(model_dir)
    with torch.no_grad():
        again = trainer.log_probs(joined, range(STEPS), rest_p,
                                  image=None if image is None else trainer.image(rest_p, image))
    d = max_diff(again, engine_log_probs)
    record_property("max_diff", d)
    assert d <= TOL, (name, d)
    # Not the cancelled rollout's continuation: its own noise (the new seed) after step k.
    assert not torch.equal(tail.latents[-1], head.latents[-1])


def test_one_row_of_initial_latents_starts_every_sample():
    eng = _MODELS.engine(ensure_builtin("tiny"))
    x = torch.randn(eng.family.latents.shape(eng.info, eng.params().height, eng.params().width, 1),
                    generator=torch.Generator().manual_seed(1))
    task = eng.task(_params(eng, SIGMAS[K:], 0, "sde", n=3), initial_latents=x)
    assert task.latents.shape[0] == 3 and all(torch.equal(row, x[0]) for row in task.latents)


def _router_params(info, **fields):
    body = RolloutBody.model_validate({"prompt": "a kite", "sigmas": SIGMAS[K:], "num_frames": 1, **fields})
    params = to_params(body, info, Limits())
    return initial_latents(body, info, params)


def test_bad_initial_latents_are_a_field_error_naming_it():
    eng = _MODELS.engine(ensure_builtin("tiny"))
    p = eng.params()
    good = torch.zeros(eng.family.latents.shape(eng.info, p.height, p.width, 1))
    for binary in (False, True):  # base64 in JSON, the raw bytes in msgpack
        body = tensor_to_body(good + 1, binary)
        body["data"] = bytes(body["data"]) if binary else body["data"]  # as msgpack decodes it
        got = _router_params(eng.info, initial_latents=body)["initial_latents"]
        assert torch.equal(got, good + 1)
    assert _router_params(eng.info) == {}
    nan = good.clone()
    nan.view(-1)[3] = float("nan")
    for bad, says in ((torch.zeros(*good.shape[:-1], good.shape[-1] + 1), "shape"),
                      (torch.zeros(2, *good.shape[1:]), "shape"),  # n is 1
                      (good[0], "shape"),  # no leading sample axis
                      (good.to(torch.int32), "dtype"),
                      (nan, "finite")):
        with pytest.raises(FieldError) as e:
            _router_params(eng.info, initial_latents=tensor_to_body(bad, False))
        assert e.value.field == "initial_latents" and says in e.value.message, e.value.message
    for not_a_tensor in ([1.0, 2.0], {"dtype": "float32", "shape": [1], "data": "AAAA"},
                         {"dtype": "bogus", "shape": [1], "data": ""}):
        with pytest.raises((FieldError, ValueError)) as e:
            _router_params(eng.info, initial_latents=not_a_tensor)
        assert "initial_latents" in str(e.value), e.value
    for not_resumable in ({"sde_type": "flow_grpo_wan"}, {"rollout": False}, {"ode_solver": "serving"},
                          {"schedule": "serving"}, {"share_prefix": True, "n": 2}, {"initial_noise_seed": 3}):
        with pytest.raises(FieldError) as e:
            _router_params(eng.info, initial_latents=tensor_to_body(good, False), **not_resumable)
        assert e.value.field == "initial_latents", not_resumable
    with pytest.raises(FieldError) as e:  # resuming is a rollout's
        to_params(GenerateBody.model_validate({"prompt": "a kite", "initial_latents": tensor_to_body(good, False)}),
                  eng.info, Limits())
    assert e.value.field == "initial_latents"


def test_the_denoise_stage_tags_each_step_with_its_weight_and_adapter_versions(tmp_path, tiny_dir):
    """The worker's own stage: a rollout with an adapter (version 7) cancelled for its partial answer after 2
    steps, and one run to its end: one weight version and one adapter version per step taken."""
    from common.protocol.control import LoadLora, LoraTensor
    from common.protocol.messages import PROTOCOL_VERSION
    from family_harness import InStage
    from lora_fixtures import ATTN, lora_state_dict

    st = InStage(_MODELS.engine(tiny_dir), tmp_path)
    sd, _ = lora_state_dict(tiny_dir, 4, 8, ATTN, seed=1)
    names = sorted(sd)
    st.stage.adapters.load(LoadLora(v=PROTOCOL_VERSION, request_id="l", lora_name="pol", version=7, lora_rank=4,
                                    lora_alpha=8, lora_tensors=[LoraTensor(name=k, shape=list(sd[k].shape))
                                                                for k in names]),
                           {"lora.blob": torch.cat([sd[k].reshape(-1) for k in names])})
    st.stage.weight_version = 3
    p = _params(st.eng, SIGMAS, 0, "sde", lora_name="pol")
    st.stage.accept(*st.message("cut", p))
    for _ in range(2):
        assert st.stage.work() == []
    _, cut = st.stage.cancel("cut", partial=True)
    assert cut.msg.info["steps_done"] == 2
    assert cut.msg.info["step_weight_versions"] == [3, 3] and cut.msg.info["step_lora_versions"] == [7, 7]
    whole = st.serve({"whole": (p, None)})["whole"]
    assert whole.msg.info["step_weight_versions"] == [3] * STEPS and whole.msg.info["step_lora_versions"] == [7] * STEPS
    serving = st.serve({"plain": (st.eng.params(), None)})["plain"]  # serving answers carry no step tags
    assert "step_weight_versions" not in serving.msg.info
