"""The flow-matching SDE step and its log-probability (common/diffusion/sde.py)."""

import math

import numpy as np
import pytest
import torch

from common.diffusion.sde import SDE_TYPES, SdeStep, log_prob_of, sde_step

SHAPE = (2, 4, 3, 5, 6)
NOISE_LEVEL = {"sde": 0.7, "cps": 0.8}
SIGMA_MAX = 0.95
# (sigma, sigma_next): the first step (sigma == 1 uses sigma_max), middle steps, the last step (sigma_next == 0)
SDE_PAIRS = [(1.0, 0.95), (0.95, 0.85), (0.6, 0.5), (0.3, 0.29), (0.2, 0.05), (0.05, 0.0)]
CPS_PAIRS = [(1.0, 0.95), (0.95, 0.85), (0.6, 0.5), (0.3, 0.29), (0.2, 0.05)]


def inputs(shape=SHAPE, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    v = torch.randn(shape, generator=g).to(dtype)
    eps = torch.randn(shape, generator=g)
    return x, v, eps


def f32(value: float) -> float:
    """The float32 value the step works with, as a Python float."""
    return float(np.float32(value))


def reference(sde_type, x, v, eps, s, s_next, s_max, noise_level):
    """Straight float64 transcription of the formulas for ONE sample (numpy arrays of any shape)."""
    x, v, eps = (np.asarray(t, dtype=np.float64) for t in (x, v, eps))
    s, s_next, s_max = f32(s), f32(s_next), f32(s_max)
    dt = s_next - s
    if sde_type == "sde":
        std = noise_level * math.sqrt(s / (1 - (s_max if s == 1 else s)))
        mean = x * (1 + std ** 2 / (2 * s) * dt) + v * (1 + std ** 2 * (1 - s) / (2 * s)) * dt
        sd = std * math.sqrt(-dt)
        x_next = mean + sd * eps
        elem = -((x_next - mean) ** 2) / (2 * sd ** 2) - math.log(sd) - math.log(math.sqrt(2 * math.pi))
    else:
        std = s_next * math.sin(noise_level * math.pi / 2)
        x0 = x - s * v
        x1 = x + (1 - s) * v
        mean = x0 * (1 - s_next) + x1 * math.sqrt(s_next ** 2 - std ** 2)
        sd = std
        x_next = mean + std * eps
        elem = -((x_next - mean) ** 2)
    return x_next, mean, sd, elem.mean()


def non_batch_dims(t):
    return tuple(range(1, t.ndim))


# ---------------------------------------------------------------- against the float64 reference


@pytest.mark.parametrize("sde_type,pair", [("sde", p) for p in SDE_PAIRS] + [("cps", p) for p in CPS_PAIRS])
def test_matches_float64_reference(sde_type, pair):
    s, s_next = pair
    nl = NOISE_LEVEL[sde_type]
    x, v, eps = inputs()
    out = sde_step(v, x, s, s_next, SIGMA_MAX, sde_type=sde_type, noise_level=nl, noise=eps)
    assert isinstance(out, SdeStep)
    for t in (out.prev_sample, out.mean, out.noise_scale, out.log_prob):
        assert t.dtype == torch.float32
    assert out.noise_scale.shape == (SHAPE[0], 1, 1, 1, 1)
    assert out.log_prob.shape == (SHAPE[0],)
    for i in range(SHAPE[0]):
        x_next, mean, sd, lp = reference(sde_type, x[i], v[i], eps[i], s, s_next, SIGMA_MAX, nl)
        np.testing.assert_allclose(out.mean[i].double().numpy(), mean, rtol=0, atol=2e-6)
        np.testing.assert_allclose(out.prev_sample[i].double().numpy(), x_next, rtol=0, atol=2e-6)
        assert out.noise_scale[i].item() == pytest.approx(sd, rel=1e-6)
        assert out.log_prob[i].item() == pytest.approx(lp, rel=2e-6, abs=1e-7)


def test_first_step_uses_sigma_max():
    x, v, eps = inputs()
    a = sde_step(v, x, 1.0, 0.9, 0.9, noise=eps)
    b = sde_step(v, x, 1.0, 0.9, 0.8, noise=eps)
    expected = 0.7 * math.sqrt(1 / (1 - f32(0.9))) * math.sqrt(-(f32(0.9) - 1))
    assert a.noise_scale.flatten()[0].item() == pytest.approx(expected, rel=1e-6)
    assert not torch.equal(a.mean, b.mean)
    # away from sigma == 1, sigma_max is not used
    c = sde_step(v, x, 0.9, 0.8, 0.9, noise=eps)
    d = sde_step(v, x, 0.9, 0.8, 0.5, noise=eps)
    assert torch.equal(c.prev_sample, d.prev_sample) and torch.equal(c.log_prob, d.log_prob)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_per_sample_sigmas_equal_each_sample_alone(sde_type):
    sigma = torch.tensor([1.0, 0.6, 0.2])
    sigma_next = torch.tensor([0.95, 0.5, 0.05])
    sigma_max = torch.tensor([0.95, 0.9, 0.8])
    x, v, eps = inputs((3, 4, 2, 5, 6), seed=1)
    nl = NOISE_LEVEL[sde_type]
    batched = sde_step(v, x, sigma, sigma_next, sigma_max, sde_type=sde_type, noise_level=nl, noise=eps)
    for i in range(3):
        alone = sde_step(v[i:i + 1], x[i:i + 1], sigma[i].item(), sigma_next[i].item(), sigma_max[i].item(),
                         sde_type=sde_type, noise_level=nl, noise=eps[i:i + 1])
        assert torch.equal(batched.mean[i:i + 1], alone.mean)
        assert torch.equal(batched.prev_sample[i:i + 1], alone.prev_sample)
        assert torch.equal(batched.noise_scale[i:i + 1], alone.noise_scale)
        torch.testing.assert_close(batched.log_prob[i:i + 1], alone.log_prob, rtol=1e-6, atol=1e-7)
        _, _, _, lp = reference(sde_type, x[i], v[i], eps[i], sigma[i].item(), sigma_next[i].item(),
                                sigma_max[i].item(), nl)
        assert batched.log_prob[i].item() == pytest.approx(lp, rel=2e-6, abs=1e-7)


def test_sigma_forms_are_equivalent():
    x, v, eps = inputs()
    ref = sde_step(v, x, 0.6, 0.5, SIGMA_MAX, noise=eps)
    for s, s_next, s_max in [
        (torch.tensor(0.6), torch.tensor(0.5), torch.tensor(SIGMA_MAX)),
        (torch.tensor([0.6]), torch.tensor([0.5]), torch.tensor([SIGMA_MAX])),
        (torch.full((2,), 0.6, dtype=torch.float64), torch.full((2,), 0.5), SIGMA_MAX),
    ]:
        out = sde_step(v, x, s, s_next, s_max, noise=eps)
        assert torch.equal(out.prev_sample, ref.prev_sample) and torch.equal(out.log_prob, ref.log_prob)


def test_sde_log_prob_is_the_gaussian_density():
    x, v, _ = inputs((3, 16, 2, 8, 8), seed=2)
    for s, s_next in [(1.0, 0.95), (0.6, 0.5), (0.2, 0.0)]:
        out = sde_step(v, x, s, s_next, SIGMA_MAX, generator=torch.Generator().manual_seed(3))
        dist = torch.distributions.Normal(out.mean.double(), out.noise_scale.double())
        expected = dist.log_prob(out.prev_sample.double()).mean(non_batch_dims(x))
        torch.testing.assert_close(out.log_prob.double(), expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_noise_scale_is_the_std_around_the_mean(sde_type):
    x, v, _ = inputs((2, 16, 8, 32, 32), seed=4)
    out = sde_step(v, x, 0.7, 0.6, SIGMA_MAX, sde_type=sde_type, noise_level=NOISE_LEVEL[sde_type],
                   generator=torch.Generator().manual_seed(5))
    z = ((out.prev_sample - out.mean) / out.noise_scale).double()
    for i in range(z.shape[0]):
        assert abs(z[i].std().item() - 1) < 0.01
        assert abs(z[i].mean().item()) < 0.01


# ---------------------------------------------------------------- evaluation mode / rollout == recompute


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_evaluation_reproduces_the_sampled_log_prob_without_rng(sde_type):
    x, v, _ = inputs()
    nl = NOISE_LEVEL[sde_type]
    g = torch.Generator().manual_seed(7)
    taken = sde_step(v, x, 0.8, 0.7, SIGMA_MAX, sde_type=sde_type, noise_level=nl, generator=g)
    g_state, global_state = g.get_state(), torch.get_rng_state()
    for gen in (g, None):
        again = sde_step(v, x, 0.8, 0.7, SIGMA_MAX, sde_type=sde_type, noise_level=nl, generator=gen,
                         prev_sample=taken.prev_sample)
        assert torch.equal(again.log_prob, taken.log_prob)
        assert torch.equal(again.mean, taken.mean)
        assert torch.equal(again.prev_sample, taken.prev_sample)
    assert torch.equal(g.get_state(), g_state)
    assert torch.equal(torch.get_rng_state(), global_state)
    lp = log_prob_of(v, x, taken.prev_sample, 0.8, 0.7, SIGMA_MAX, sde_type=sde_type, noise_level=nl)
    assert torch.equal(lp, taken.log_prob)


def test_whole_trajectory_rollout_equals_recompute():
    from diffusers import FlowMatchEulerDiscreteScheduler

    sched = FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    sched.set_timesteps(8)
    sigmas = sched.sigmas
    x, _, _ = inputs((1, 4, 2, 6, 6), seed=8)
    g = torch.Generator().manual_seed(9)
    w = torch.randn(x.shape[1:], generator=torch.Generator().manual_seed(10))
    traj, log_probs = [x], []
    for i in range(len(sigmas) - 1):
        v = torch.tanh(traj[-1] * w)  # a stand-in "model" depending on the latents
        step = sde_step(v, traj[-1], sigmas[i], sigmas[i + 1], sigmas[1], generator=g)
        traj.append(step.prev_sample)
        log_probs.append(step.log_prob)
    for i in range(len(sigmas) - 1):
        v = torch.tanh(traj[i] * w)
        lp = log_prob_of(v, traj[i], traj[i + 1], sigmas[i], sigmas[i + 1], sigmas[1],
                         sde_type="sde", noise_level=0.7)
        assert torch.equal(lp, log_probs[i])


# ---------------------------------------------------------------- deterministic limits


def test_small_noise_level_tends_to_euler():
    x, v, eps = inputs()
    for s, s_next in [(1.0, 0.95), (0.6, 0.5), (0.2, 0.0)]:
        euler = x + (torch.tensor(s_next) - torch.tensor(s)) * v
        out = sde_step(v, x, s, s_next, SIGMA_MAX, noise_level=1e-6, noise=eps)
        assert out.log_prob is not None
        torch.testing.assert_close(out.mean, euler, rtol=0, atol=1e-5)


def test_ode_is_exactly_euler():
    x, v, _ = inputs()
    state = torch.get_rng_state()
    out = sde_step(v, x, 0.6, 0.5, SIGMA_MAX, sde_type="ode")
    dt = torch.tensor(0.5) - torch.tensor(0.6)
    assert torch.equal(out.prev_sample, x + dt * v)
    assert torch.equal(out.mean, out.prev_sample)
    assert out.log_prob is None
    assert torch.equal(out.noise_scale, torch.zeros(SHAPE[0], 1, 1, 1, 1))
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("sde_type,s,s_next,nl", [
    ("sde", 0.6, 0.5, 0.0), ("cps", 0.6, 0.5, 0.0), ("cps", 0.2, 0.0, 0.8), ("sde", 0.5, 0.5, 0.7),
])
def test_deterministic_steps(sde_type, s, s_next, nl):
    x, v, _ = inputs()
    g = torch.Generator().manual_seed(0)
    g_state = g.get_state()
    out = sde_step(v, x, s, s_next, SIGMA_MAX, sde_type=sde_type, noise_level=nl, generator=g)
    ode = sde_step(v, x, s, s_next, SIGMA_MAX, sde_type="ode")
    assert out.log_prob is None
    assert torch.equal(out.prev_sample, ode.prev_sample) and torch.equal(out.mean, ode.mean)
    assert torch.equal(out.noise_scale, torch.zeros(SHAPE[0], 1, 1, 1, 1))
    assert torch.equal(g.get_state(), g_state)
    if sde_type == "cps" and nl > 0:
        # the formula itself lands on x0 = x - s v at sigma_next == 0
        _, mean, _, _ = reference("cps", x[0], v[0], np.zeros(SHAPE[1:]), s, s_next, SIGMA_MAX, nl)
        np.testing.assert_allclose(out.mean[0].double().numpy(), mean, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="deterministic"):
        log_prob_of(v, x, out.prev_sample, s, s_next, SIGMA_MAX, sde_type=sde_type, noise_level=nl)


# ---------------------------------------------------------------- noise and RNG


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_one_randn_per_step_from_the_generator(sde_type):
    x, v, _ = inputs()
    nl = NOISE_LEVEL[sde_type]
    g1, g2, g3 = (torch.Generator().manual_seed(11) for _ in range(3))
    a = sde_step(v, x, 0.8, 0.7, SIGMA_MAX, sde_type=sde_type, noise_level=nl, generator=g1)
    b = sde_step(v, x, 0.8, 0.7, SIGMA_MAX, sde_type=sde_type, noise_level=nl, generator=g2)
    assert torch.equal(a.prev_sample, b.prev_sample) and torch.equal(a.log_prob, b.log_prob)
    eps = torch.randn(x.shape, generator=g3, dtype=torch.float32, device="cpu")
    assert torch.equal(g1.get_state(), g3.get_state())
    c = sde_step(v, x, 0.8, 0.7, SIGMA_MAX, sde_type=sde_type, noise_level=nl, noise=eps)
    assert torch.equal(a.prev_sample, c.prev_sample) and torch.equal(a.log_prob, c.log_prob)
    # a second step continues the same stream
    d = sde_step(v, x, 0.8, 0.7, SIGMA_MAX, sde_type=sde_type, noise_level=nl, generator=g1)
    e = sde_step(v, x, 0.8, 0.7, SIGMA_MAX, sde_type=sde_type, noise_level=nl,
                 noise=torch.randn(x.shape, generator=g3))
    assert torch.equal(d.prev_sample, e.prev_sample)
    assert not torch.equal(a.prev_sample, d.prev_sample)


def test_given_noise_consumes_no_rng():
    x, v, eps = inputs()
    state = torch.get_rng_state()
    sde_step(v, x, 0.8, 0.7, SIGMA_MAX, noise=eps)
    assert torch.equal(torch.get_rng_state(), state)
    sde_step(v, x, 0.8, 0.7, SIGMA_MAX)  # default: torch's global CPU generator
    assert not torch.equal(torch.get_rng_state(), state)


# ---------------------------------------------------------------- gradients and dtypes


@pytest.mark.parametrize("sde_type", ["sde", "cps"])
def test_gradient_flows_into_model_output(sde_type):
    x, v, eps = inputs()
    nl = NOISE_LEVEL[sde_type]
    with torch.no_grad():
        taken = sde_step(v, x, 0.8, 0.7, SIGMA_MAX, sde_type=sde_type, noise_level=nl, noise=eps)
    # the trainer's policy differs from the rollout's, so the gradient is not zero
    v_new = (v + 0.05 * torch.randn(v.shape, generator=torch.Generator().manual_seed(12))).requires_grad_(True)
    lp = log_prob_of(v_new, x, taken.prev_sample, 0.8, 0.7, SIGMA_MAX, sde_type=sde_type, noise_level=nl)
    assert lp.requires_grad and lp.shape == (SHAPE[0],)
    lp.sum().backward()
    grad = v_new.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0
    # sampling with grad enabled treats the drawn x_next as data too: same gradient as evaluating it
    v_sampled = v_new.detach().clone().requires_grad_(True)
    sampled = sde_step(v_sampled, x, 0.8, 0.7, SIGMA_MAX, sde_type=sde_type, noise_level=nl, noise=eps)
    sampled.log_prob.sum().backward()
    v_again = v_new.detach().clone().requires_grad_(True)
    log_prob_of(v_again, x, sampled.prev_sample.detach(), 0.8, 0.7, SIGMA_MAX, sde_type=sde_type,
                noise_level=nl).sum().backward()
    torch.testing.assert_close(v_sampled.grad, v_again.grad, rtol=0, atol=0)


def test_bf16_inputs_are_upcast():
    x, v, eps = inputs(dtype=torch.bfloat16)
    for sde_type in ("sde", "cps", "ode"):
        low = sde_step(v, x, 0.8, 0.7, SIGMA_MAX, sde_type=sde_type, noise=eps.bfloat16())
        high = sde_step(v.float(), x.float(), 0.8, 0.7, SIGMA_MAX, sde_type=sde_type, noise=eps.bfloat16().float())
        for a, b in ((low.prev_sample, high.prev_sample), (low.mean, high.mean), (low.noise_scale, high.noise_scale)):
            assert a.dtype == torch.float32 and torch.equal(a, b)
        if sde_type != "ode":
            assert low.log_prob.dtype == torch.float32 and torch.equal(low.log_prob, high.log_prob)
    taken = sde_step(v, x, 0.8, 0.7, SIGMA_MAX, noise=eps)
    again = sde_step(v, x, 0.8, 0.7, SIGMA_MAX, prev_sample=taken.prev_sample.bfloat16())
    assert again.prev_sample.dtype == torch.float32


# ---------------------------------------------------------------- argument checks


def _call(**over):
    x, v, eps = inputs()
    kw = dict(model_output=v, sample=x, sigma=0.8, sigma_next=0.7, sigma_max=SIGMA_MAX)
    kw.update(over)
    return sde_step(**kw)


@pytest.mark.parametrize("over,match", [
    (dict(sde_type="euler"), "sde_type"),
    (dict(noise_level=-0.1), "noise_level"),
    (dict(noise_level=float("nan")), "noise_level"),
    (dict(sde_type="cps", noise_level=1.5), "noise_level"),
    (dict(sigma=0.5, sigma_next=0.6), "sigma_next"),
    (dict(sigma=1.2, sigma_next=0.6), "sigma"),
    (dict(sigma_next=-0.1), "sigma_next"),
    (dict(sigma=float("inf")), "sigma"),
    (dict(sigma=torch.tensor([0.8, 0.8, 0.8])), "sigma"),
    (dict(sigma=torch.full((2, 1), 0.8)), "sigma"),
    (dict(sigma="0.8"), "sigma"),
    (dict(sigma=1.0, sigma_max=1.0), "sigma_max"),
    (dict(model_output=torch.zeros(2, 4, 3, 5)), "model_output"),
    (dict(noise=torch.zeros(2, 4, 3, 5, 7)), "noise"),
    (dict(prev_sample=torch.zeros(1, 4, 3, 5, 6)), "prev_sample"),
    (dict(noise=torch.zeros(SHAPE), prev_sample=torch.zeros(SHAPE)), "not both"),
    (dict(sample=torch.zeros(3), model_output=torch.zeros(3)), "ndim"),
    (dict(sigma=torch.tensor([0.8, 0.2]), sigma_next=torch.tensor([0.7, 0.0]), sde_type="cps",
          noise_level=0.8), "mixes"),
])
def test_bad_arguments(over, match):
    with pytest.raises(ValueError, match=match):
        _call(**over)


def test_sde_types_constant():
    assert SDE_TYPES == ("sde", "cps", "ode", "flow_grpo_wan", "dance_grpo")
