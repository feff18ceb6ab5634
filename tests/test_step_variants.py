"""The step variants (common/diffusion/step_variants.py): each registered one against its own float64
recompute, the registry against the wire's names, names and objects giving the same step, the refusals."""

import math
from typing import get_args, get_type_hints

import msgspec
import numpy as np
import pytest
import torch

from common.diffusion.sde import log_prob_of, sde_step
from common.diffusion.step_variants import STEP_VARIANTS, Cps, Ode, Sde, StepVariant, step_variant
from common.protocol.messages import SDE_TYPES, RolloutParams

SHAPE = (2, 3, 4, 5)
SIGMA_MAX = 0.95
PAIRS = [(1.0, 0.95), (0.95, 0.85), (0.6, 0.5), (0.3, 0.29), (0.2, 0.05)]
NOISE_LEVELS = {"sde": 0.7, "cps": 0.8, "ode": 0.7, "flow_grpo_wan": 0.7, "dance_grpo": 0.3}


def _f32(value: float) -> float:
    return float(np.float32(value))


def _sde(x, v, eps, s, s_next, s_max, nl):
    dt = s_next - s
    std = nl * math.sqrt(s / (1 - (s_max if s == 1 else s)))
    mean = x * (1 + std ** 2 / (2 * s) * dt) + v * (1 + std ** 2 * (1 - s) / (2 * s)) * dt
    sd = std * math.sqrt(-dt)
    x_next = mean + sd * eps
    lp = (-((x_next - mean) ** 2) / (2 * sd ** 2) - math.log(sd) - math.log(math.sqrt(2 * math.pi))).mean()
    return x_next, mean, sd, lp


def _cps(x, v, eps, s, s_next, s_max, nl):
    std = s_next * math.sin(nl * math.pi / 2)
    mean = (x - s * v) * (1 - s_next) + (x + (1 - s) * v) * math.sqrt(s_next ** 2 - std ** 2)
    x_next = mean + std * eps
    return x_next, mean, std, (-((x_next - mean) ** 2)).mean()


def _ode(x, v, eps, s, s_next, s_max, nl):
    mean = x + (s_next - s) * v
    return mean, mean, 0.0, None


def _gaussian_sde(x, v, eps, s, s_next, std):
    """``sde``'s mean and Gaussian log-prob with the diffusion coefficient ``std`` (a number)."""
    dt = s_next - s
    mean = x * (1 + std ** 2 / (2 * s) * dt) + v * (1 + std ** 2 * (1 - s) / (2 * s)) * dt
    sd = std * math.sqrt(-dt)
    x_next = mean + sd * eps
    lp = (-((x_next - mean) ** 2) / (2 * sd ** 2) - math.log(sd) - math.log(math.sqrt(2 * math.pi))).mean()
    return x_next, mean, sd, lp


def _flow_grpo_wan(x, v, eps, s, s_next, s_max, nl):  # sde_step's default sigma_min: 0
    return _gaussian_sde(x, v, eps, s, s_next, 0.0 + (s_max - 0.0) * s)


def _dance_grpo(x, v, eps, s, s_next, s_max, nl):
    return _gaussian_sde(x, v, eps, s, s_next, nl)


# One float64 transcription per variant of the design notes' formula, for ONE sample: a variant added to
# the registry without its own here fails test_every_variant_has_a_reference.
REFERENCES = {"sde": _sde, "cps": _cps, "ode": _ode, "flow_grpo_wan": _flow_grpo_wan, "dance_grpo": _dance_grpo}


def test_every_variant_has_a_reference():
    assert set(REFERENCES) == set(STEP_VARIANTS)


def test_the_registry_names_the_wire_values():
    """RolloutParams.sde_type's Literal (strictly decoded on the wire) lists exactly the registered variants."""
    assert get_args(get_type_hints(RolloutParams)["sde_type"]) == tuple(STEP_VARIANTS) == SDE_TYPES
    for name, cls in STEP_VARIANTS.items():
        assert cls.name == name and issubclass(cls, StepVariant)
        assert msgspec.convert({"sde_type": name}, RolloutParams).sde_type == name
    with pytest.raises(msgspec.ValidationError, match="sde_type"):
        msgspec.convert({"sde_type": "euler"}, RolloutParams)


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("name", list(STEP_VARIANTS))
def test_each_variant_matches_its_float64_recompute(name, pair):
    s, s_next = pair
    nl = NOISE_LEVELS[name]
    g = torch.Generator().manual_seed(0)
    x, v, eps = (torch.randn(SHAPE, generator=g) for _ in range(3))
    out = sde_step(v, x, s, s_next, SIGMA_MAX, sde_type=STEP_VARIANTS[name](nl), noise=eps)
    for i in range(SHAPE[0]):
        x_next, mean, sd, lp = REFERENCES[name](*(t[i].double().numpy() for t in (x, v, eps)),
                                                _f32(s), _f32(s_next), _f32(SIGMA_MAX), nl)
        np.testing.assert_allclose(out.mean[i].double().numpy(), mean, rtol=0, atol=2e-6)
        np.testing.assert_allclose(out.prev_sample[i].double().numpy(), x_next, rtol=0, atol=2e-6)
        assert out.noise_scale[i].item() == pytest.approx(sd, rel=1e-6)
        if lp is None:
            assert out.log_prob is None and STEP_VARIANTS[name].deterministic
        else:
            assert out.log_prob[i].item() == pytest.approx(lp, rel=2e-6, abs=1e-7)


@pytest.mark.parametrize("name", list(STEP_VARIANTS))
def test_a_name_and_its_object_take_the_same_step(name):
    nl = NOISE_LEVELS[name]
    g = torch.Generator().manual_seed(1)
    x, v, eps = (torch.randn(SHAPE, generator=g) for _ in range(3))
    by_name = sde_step(v, x, 0.6, 0.5, SIGMA_MAX, sde_type=name, noise_level=nl, noise=eps)
    by_object = sde_step(v, x, 0.6, 0.5, SIGMA_MAX, sde_type=step_variant(name, nl), noise=eps)
    assert torch.equal(by_name.prev_sample, by_object.prev_sample) and torch.equal(by_name.mean, by_object.mean)
    if by_name.log_prob is not None:
        assert torch.equal(by_name.log_prob, by_object.log_prob)
        again = log_prob_of(v, x, by_name.prev_sample, 0.6, 0.5, SIGMA_MAX, sde_type=STEP_VARIANTS[name](nl))
        assert torch.equal(again, by_name.log_prob)


def test_an_unknown_name_is_refused_with_the_names():
    names = r"\('sde', 'cps', 'ode', 'flow_grpo_wan', 'dance_grpo'\)"
    with pytest.raises(ValueError, match=r"unknown sde_type 'euler'; expected one of " + names):
        step_variant("euler", 0.7)
    x = torch.zeros(SHAPE)
    with pytest.raises(ValueError, match=r"expected one of " + names):
        sde_step(x, x, 0.6, 0.5, SIGMA_MAX, sde_type="euler")


@pytest.mark.parametrize("make,level,match", [
    (Cps, 1.5, "cps noise_level must be in"),
    (Sde, -0.1, "noise_level must be >= 0"),
    (Ode, float("nan"), "finite"),
    (Sde, True, "finite"),
])
def test_each_variant_checks_its_noise_level(make, level, match):
    with pytest.raises(ValueError, match=match):
        make(level)


def test_noise_level_ranges_and_defaults():
    assert Sde(1.5).noise_level == 1.5 and Cps(1).noise_level == 1.0 and isinstance(Cps(1).noise_level, float)
    assert step_variant("sde") == Sde(0.7)  # sde_step's default noise level
    assert Sde(0.7) != Cps(0.7) and Sde(0.7) != Sde(0.8)  # equal settings only: the denoise worker's step key
    assert [n for n, cls in STEP_VARIANTS.items() if cls.deterministic] == ["ode"]


def test_a_variant_object_carries_its_own_noise_level():
    assert step_variant(Cps(0.8), 0.8) == Cps(0.8)
    with pytest.raises(ValueError, match="carries its own"):
        step_variant(Cps(0.8), 0.5)
