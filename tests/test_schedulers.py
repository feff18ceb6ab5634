"""Request-local schedulers rebuilt from templates equal diffusers schedulers set up directly."""

import copy

import msgspec
import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

from common.protocol.messages import GenerationParams
from common.protocol.errors import RequestError
from common.diffusion import schedulers

WAN_UNIPC = dict(
    prediction_type="flow_prediction",
    use_flow_sigmas=True,
    num_train_timesteps=1000,
    flow_shift=3.0,
)
BASE = GenerationParams(
    prompt="p", negative_prompt="", height=32, width=32, num_frames=5,
    num_inference_steps=8, guidance_scale=5.0, seed=0,
)


def params(**kw):
    return msgspec.structs.replace(BASE, **kw)


def unipc(**over):
    return UniPCMultistepScheduler(**{**WAN_UNIPC, **over})


def assert_same_schedule(a, b, atol=0.0):
    torch.testing.assert_close(a.timesteps.double(), b.timesteps.double(), rtol=0, atol=atol)
    torch.testing.assert_close(a.sigmas.double(), b.sigmas.double(), rtol=0, atol=atol)
    assert a.num_inference_steps == b.num_inference_steps


@pytest.mark.parametrize("shift", [1.0, 3.0, 5.0])
@pytest.mark.parametrize("steps", [1, 4, 7, 50])
def test_step_count_matches_diffusers(shift, steps):
    template = unipc(flow_shift=shift)
    direct = unipc(flow_shift=shift)
    direct.set_timesteps(steps)
    assert_same_schedule(schedulers.build(template, params(num_inference_steps=steps)), direct)


def test_sigmas_match_diffusers_for_both_kinds():
    sig = [1.0, 0.8, 0.55, 0.3, 0.1]
    for template in (unipc(), schedulers.rollout_template_for(unipc())):
        direct = type(template).from_config(template.config)
        direct.set_timesteps(sigmas=np.asarray(sig, dtype=np.float64))
        assert_same_schedule(schedulers.build(template, params(sigmas=sig)), direct)


def test_mu_reaches_a_dynamically_shifted_scheduler():
    template = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15)
    for mu in (0.3, 1.1):
        direct = FlowMatchEulerDiscreteScheduler.from_config(template.config)
        direct.set_timesteps(6, mu=mu)
        built = schedulers.build(template, params(num_inference_steps=6, mu=mu))
        assert_same_schedule(built, direct)
    other = schedulers.build(template, params(num_inference_steps=6, mu=0.3))
    assert not torch.equal(other.sigmas, built.sigmas)  # mu really changed the schedule


@pytest.mark.parametrize("kind", ["serving", "rollout"])
def test_caller_timesteps_are_run_as_given(kind):
    template = unipc(flow_shift=3.0)
    if kind == "rollout":
        template = schedulers.rollout_template_for(template)
    # UniPC runs integer timesteps (as in diffusers); the rollout Euler takes fractional ones.
    ts = [999.0, 937.0, 800.0, 610.0, 300.0, 42.0] if kind == "serving" else [999.0, 937.5, 800.0, 610.25, 42.0]
    built = schedulers.build(template, params(timesteps=ts))
    # Flow-match convention: sigma = t / 1000, and the timesteps are exactly the caller's.
    assert built.timesteps.double().tolist() == ts
    np.testing.assert_allclose(built.sigmas[:-1].double().numpy(), np.array(ts) / 1000, atol=2e-6)
    assert built.sigmas[-1] == 0


def test_rollout_template_copies_shift_and_training_steps():
    for shift in (3.0, 5.0):
        r = schedulers.rollout_template_for(unipc(flow_shift=shift, num_train_timesteps=1000))
        assert isinstance(r, FlowMatchEulerDiscreteScheduler)
        assert r.config.shift == shift and r.config.num_train_timesteps == 1000


def test_custom_sigmas_rejected_where_unsupported():
    class NoSigmas(FlowMatchEulerDiscreteScheduler):
        def set_timesteps(self, num_inference_steps=None, device=None):
            return super().set_timesteps(num_inference_steps, device=device)

    with pytest.raises(RequestError, match="sigmas"):
        schedulers.build(NoSigmas(), params(sigmas=[1.0, 0.5]))


def _state(s):
    return {k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v)) for k, v in vars(s).items()}


def _equal_state(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


def test_template_untouched_and_requests_isolated_after_many_requests():
    template = unipc()
    before = _state(template)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 2, 4, 4, generator=gen)
    reference = None
    for i in range(60):
        p = params(num_inference_steps=3 + i % 5, sigmas=None if i % 3 else [1.0, 0.6, 0.2])
        s = schedulers.build(template, p)
        assert s is not template
        lat = x.clone()
        for t in s.timesteps:
            lat = s.step(torch.ones_like(lat) * 0.1, t, lat, return_dict=False)[0]
        if p.sigmas is not None:
            if reference is None:
                reference = lat
            assert torch.equal(lat, reference)  # same request, same result, whatever ran before
    _equal_state(before, _state(template))


def test_a_schedule_the_config_cannot_make_is_a_request_error():
    """Exponential sigmas with a linear time shift and a negative mu (a short sequence) reach a sigma <= 0, in
    diffusers' own pipeline too: the request is refused naming the field, as a 400, never a worker's crash."""
    config = dict(use_dynamic_shifting=True, base_shift=0.25, max_shift=1.5, base_image_seq_len=256,
                  max_image_seq_len=1024, time_shift_type="linear", use_exponential_sigmas=True)
    direct = FlowMatchEulerDiscreteScheduler(**config)
    with pytest.raises(ValueError):
        direct.set_timesteps(sigmas=np.linspace(1.0, 1 / 3, 3), mu=-0.134)
    with pytest.raises(RequestError) as refused:
        schedulers.build(FlowMatchEulerDiscreteScheduler(**config), params(num_inference_steps=3), mu=-0.134,
                         default_sigmas=True)
    assert str(refused.value).startswith("num_inference_steps: ") and refused.value.status == 400
