"""``return_kl``: each SDE step's KL against the reference (the same model with the request's adapter off) and
the drawn step's log-prob under it, on every family, in process (tests/family_harness.py).

- With an adapter, ``kl`` and ``ref_log_probs`` equal a float64 recompute of the formulas from velocities the
  test computes itself (the adapter on, then off, each request alone), within 1e-5; the KL is clearly > 0. Without
  an adapter the KL is 0 and ``ref_log_probs`` are ``log_probs``, and no reference rows run.
- A request with ``return_kl`` batched with other requests answers what it answers alone, and its reference rows
  run in the step's own forward (one forward per step, counted).
- A request with step caching gets the same KL on its SDE steps (never cached) and counts the reference's rows.
- ``rl.TrainerPolicy.kl`` (peft's LoRA layers disabled for the reference) recomputes the engine's numbers.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from msgspec.structs import replace

import pytest
import torch

import lora_fixtures as lf
from common.builtin import ensure_builtin
from common.config.engine import Limits
from common.diffusion.lora import build_adapter
from common.diffusion.lora_format import read_lora
from common.diffusion.params import FieldError, to_params
from common.diffusion.policy import ModelInput, Policy
from common.diffusion.weights import load_into
from common.protocol.messages import (
    KL, LOG_PROB_STEPS, LOG_PROBS, REF_LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, TRAJECTORY_TIMESTEPS,
    GenerationParams, RolloutParams,
)
from denoise_worker.pinned import pinned_copy
from family_harness import CPU, DTYPE, InProcess, ModuleModels, max_diff, negative_for
from test_wan_i2v import picture

MODELS = ["tiny", "tiny-sd3", "tiny-flux", "tiny-qwen-image", "tiny-sana", "tiny-wan-i2v", "tiny-wan-ti2v", "tiny-z-image",
          "tiny-flux2-klein", "tiny-hunyuan-video15"]
IMAGE = picture(40, 24, 1)
SCALE = 0.8
TOL = 1e-5


def rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to max(1, |want|): a log-prob of -8 (or a KL of 400, cps near its last step)
    carries float32 rounding of its size."""
    return ((got.double() - want.double()).abs() / want.double().abs().clamp(min=1)).max().item()
STEPS = 3

_MODELS = ModuleModels()


@pytest.fixture(scope="module", autouse=True)
def _clear():
    yield
    _MODELS.clear()


@dataclass
class Made:
    eng: InProcess
    files: lf.Adapter  # what the trainer loads with peft
    adapter: object  # the engine's LoraAdapter of the same file
    image: object  # image-to-video models: the first frame

    def lora(self):
        return (self.adapter, SCALE)


_MADE: dict[str, Made] = {}


def made(model: str, tmp_path_factory) -> Made:
    if model not in _MADE:
        model_dir = ensure_builtin(model)
        eng = _MODELS.engine(model_dir)
        files = lf.make_diffusers_lora(model_dir, tmp_path_factory.mktemp(f"lora-{model}"), rank=4, alpha=8,
                                       target_modules=eng.family.transformer.lora_targets, seed=1)
        adapter = build_adapter("a", 1, read_lora(str(files.path), None), eng.policy.experts, 64)
        eng.policy.cover(adapter)
        optional = model == "tiny-wan-ti2v"  # (the other optional images: their families' own tests)
        image = IMAGE if eng.family.condition.image_input(eng.info) == "required" or optional else None
        _MADE[model] = Made(eng, files, adapter, image)
    return _MADE[model]


def params(m: Made, sde_type: str = "sde", steps: int = STEPS, seed: int = 3, n: int = 2, **rollout) -> GenerationParams:
    """A guided rollout with ``return_kl`` (and its trajectory) of the family's own fields."""
    eng = m.eng
    over = dict(num_frames=eng.info.defaults.get("num_frames", 1), seed=seed, n=n, num_inference_steps=steps,
                negative_prompt=negative_for(eng.info, "blurry") or "")  # (the router's "" where refused)
    if eng.family.cfg_field == "true_cfg_scale":
        over["true_cfg_scale"] = 2.0
    r = RolloutParams(sde_type=sde_type, return_kl=True, return_trajectory=True, **rollout)
    return eng.params(rollout=r, **over)


def run(m: Made, p: GenerationParams, lora=None):
    task = m.eng.run(p, lora=lora, image=m.image)
    return task, task.extras()


# --- the independent recompute ------------------------------------------------------------------------------


def counted(model: str, t: torch.Tensor) -> torch.Tensor:
    """The elements a log-prob averages over, [n, -1] (TI2V: frame 0 is the image's, not a Gaussian step)."""
    if model == "tiny-wan-ti2v":
        t = t[:, :, 1:]
    return t.flatten(1)


def expected(model: str, sde_type: str, noise_level: float, sigmas: torch.Tensor, i: int, x, x_next, v, v_ref):
    """float64 ([n] KL, [n] reference log-prob) of step i from the formulas of docs/rollout.md."""
    s, s1, s_max, s_min = (float(sigmas[j]) for j in (i, i + 1, 1, -1))
    dt = s1 - s
    x, x_next, v, v_ref = (t.double() for t in (x, x_next, v, v_ref))
    if sde_type != "cps":  # Flow-GRPO's SDE mean, each with its own std
        std = {"sde": lambda: noise_level * math.sqrt(s / (1 - (s_max if s == 1 else s))),
               "flow_grpo_wan": lambda: s_min + (s_max - s_min) * s,
               "dance_grpo": lambda: noise_level}[sde_type]()
        sd = std * math.sqrt(-dt)

        def mean(u):
            return x * (1 + std ** 2 / (2 * s) * dt) + u * (1 + std ** 2 * (1 - s) / (2 * s)) * dt

        def log_prob(m):
            return -(x_next - m) ** 2 / (2 * sd ** 2) - math.log(sd) - math.log(math.sqrt(2 * math.pi))
    else:  # cps
        sd = s1 * math.sin(noise_level * math.pi / 2)

        def mean(u):
            return (x - s * u) * (1 - s1) + (x + (1 - s) * u) * math.sqrt(s1 ** 2 - sd ** 2)

        def log_prob(m):
            return -(x_next - m) ** 2
    kl = (mean(v) - mean(v_ref)) ** 2 / (2 * sd ** 2)
    return counted(model, kl).mean(1), counted(model, log_prob(mean(v_ref))).mean(1)


def recomputed(m: Made, model: str, task, ex, sde_type: str, noise_level: float, reference=None):
    """Per step of ``log_prob_steps``: the float64 KL and reference log-prob, [n, K] each, from velocities
    computed here, each request alone (the policy's with the request's adapter, the reference's without; the
    reference: ``reference``, a pinned copy, else the policy)."""
    eng, p = m.eng, task.params
    traj, sigmas = ex[TRAJECTORY_LATENTS.name], ex[TRAJECTORY_SIGMAS.name]
    kls, refs = [], []
    for i in ex[LOG_PROB_STEPS.name].tolist():
        x, t = traj[:, i], ex[TRAJECTORY_TIMESTEPS.name][i]
        with torch.no_grad():
            v, v_ref = (policy.velocity(ModelInput.of(eng.info, p, x, t, task.cond, task.uncond, lora, task.image))
                        for policy, lora in ((eng.policy, task.lora), (reference or eng.policy, None)))
        kl, ref = expected(model, sde_type, noise_level, sigmas, i, x, traj[:, i + 1], v, v_ref)
        kls.append(kl)
        refs.append(ref)
    return torch.stack(kls, 1), torch.stack(refs, 1)


# --- the engine against the formula -------------------------------------------------------------------------


# Besides sde on every family: cps, Flow-GRPO's Wan step on Wan's serving (UniPC) schedule, DanceGRPO's step.
VARIANTS = [(m, "sde", "rollout") for m in MODELS] + [("tiny", "cps", "rollout"), ("tiny", "flow_grpo_wan", "serving"),
                                                     ("tiny-flux", "dance_grpo", "rollout")]


@pytest.mark.parametrize("model,sde_type,schedule", VARIANTS)
def test_kl_equals_a_float64_recompute_from_the_base_models_velocity(model, sde_type, schedule, tmp_path_factory,
                                                                      record_property):
    m = made(model, tmp_path_factory)
    noise_level = 0.8 if sde_type == "cps" else 0.7
    p = params(m, sde_type, noise_level=noise_level, schedule=schedule)
    task, ex = run(m, p, m.lora())
    kl, ref = ex[KL.name], ex[REF_LOG_PROBS.name]
    K = len(ex[LOG_PROB_STEPS.name])
    assert kl.shape == ref.shape == ex[LOG_PROBS.name].shape == (p.n, K)
    assert K == (STEPS - 1 if sde_type == "cps" else STEPS)  # cps's last step (sigma_next 0) draws no noise
    want_kl, want_ref = recomputed(m, model, task, ex, sde_type, noise_level)
    record_property("kl", kl.tolist())
    record_property("max |kl - recompute| / max(1, |recompute|)", rel_diff(kl, want_kl))
    record_property("max |ref_log_probs - recompute| / max(1, |recompute|)", rel_diff(ref, want_ref))
    assert rel_diff(kl, want_kl) <= TOL
    assert rel_diff(ref, want_ref) <= TOL
    assert (kl > 0).all() and kl.mean() > 100 * TOL  # the adapter moves every step's mean
    assert max_diff(ref, ex[LOG_PROBS.name]) > 100 * TOL
    # The reference rows count as forwards: one per SDE step and CFG branch.
    branches = 1 if task.uncond is None else 2
    assert task.pass_counts()["transformer_passes"] == [(STEPS + K) * branches] * p.n


@pytest.mark.parametrize("model", ["tiny", "tiny-qwen-image"])
def test_without_an_adapter_the_kl_is_zero_and_no_reference_rows_run(model, tmp_path_factory):
    m = made(model, tmp_path_factory)
    task, ex = run(m, params(m))
    assert torch.equal(ex[KL.name], torch.zeros(2, STEPS))
    assert torch.equal(ex[REF_LOG_PROBS.name], ex[LOG_PROBS.name])
    branches = 1 if task.uncond is None else 2
    assert task.pass_counts()["transformer_passes"] == [STEPS * branches] * 2


# --- batched with other requests ----------------------------------------------------------------------------


class Forwards:
    """Every batched forward of ``eng``'s policy: its inputs' (samples, has an adapter)."""

    def __init__(self, eng: InProcess):
        self.eng, self.calls = eng, []

    def __enter__(self):
        real = self.eng.policy.batched_velocity

        def record(inputs):
            self.calls.append([(x.n, x.lora is not None) for x in inputs])
            return real(inputs)
        self.eng.policy.batched_velocity = record
        return self

    def __exit__(self, *exc):
        del self.eng.policy.batched_velocity


@pytest.mark.parametrize("model", ["tiny", "tiny-flux"])
def test_batched_with_other_requests_equals_alone_and_the_reference_rows_share_the_forward(model,
                                                                                         tmp_path_factory):
    m = made(model, tmp_path_factory)
    eng = m.eng
    window = [1, 2]
    a = params(m, steps=4, sde_step_indices=window)
    base = params(m, steps=4, seed=9, n=1)  # a rollout of the base model, return_kl too
    plain = eng.params(seed=11, num_inference_steps=4, num_frames=a.num_frames)  # serving, with the adapter
    with Forwards(eng) as alone:
        solo_task, solo = run(m, a, m.lora())
    # One forward per step; the SDE steps' forward holds the reference input (the request without its adapter).
    assert alone.calls == [[(2, True)], [(2, True), (2, False)], [(2, True), (2, False)], [(2, True)]]
    assert solo[LOG_PROB_STEPS.name].tolist() == window

    jobs = [(a, m.lora()), (base, None), (plain, m.lora())]
    tasks = [eng.task(*jobs[0], image=m.image)]
    with Forwards(eng) as mixed:
        eng.step(tasks)  # the others join one step later: every request at its own step
        tasks += [eng.task(jp, lora, image=m.image) for jp, lora in jobs[1:]]
        while not all(t.done for t in tasks):
            eng.step([t for t in tasks if not t.done])
    # Still one forward per step, the reference rows beside the other requests' rows.
    assert len(mixed.calls) == 5
    assert mixed.calls[2] == [(2, True), (2, False), (1, False), (1, True)]
    got = tasks[0].extras()
    for name in (KL.name, REF_LOG_PROBS.name, LOG_PROBS.name, TRAJECTORY_LATENTS.name):
        assert max_diff(got[name], solo[name]) <= TOL, name
    assert (got[KL.name] > 0).all()
    branches = 1 if tasks[0].uncond is None else 2
    assert tasks[0].pass_counts() == solo_task.pass_counts() == {
        "transformer_passes": [(4 + len(window)) * branches] * 2, "cached_steps": [0, 0]}
    assert torch.equal(tasks[1].extras()[KL.name], torch.zeros(1, 4))


def test_a_caching_request_computes_its_kl_on_its_sde_steps_and_counts_the_reference_rows(tmp_path_factory):
    from common.protocol.messages import CacheParams

    m = made("tiny", tmp_path_factory)
    p = params(m, steps=8, sde_step_indices=[1, 2])
    plain_task, plain = run(m, p, m.lora())
    cached_task, cached = run(m, replace(p, cache=CacheParams(method="first_block", threshold=1.0)), m.lora())
    counts = cached_task.pass_counts()
    assert counts["cached_steps"][0] > 0  # steps after the window reuse outputs
    # Every computed row-step plus the reference's two branches at each of the two SDE steps.
    assert counts["transformer_passes"] == [2 * 8 - c + 2 * 2 for c in counts["cached_steps"]]
    # The window comes before any reuse: the same steps, the same numbers (each branch its own rows).
    for name in (KL.name, REF_LOG_PROBS.name):
        assert max_diff(cached[name], plain[name]) <= TOL, name


# --- a pinned reference -------------------------------------------------------------------------------------


def pin(eng: InProcess) -> Policy:
    """What POST /pin_reference makes on a worker: a copy of the policy's current weights."""
    return pinned_copy(eng.policy, lambda: Policy.load(eng.info, DTYPE, CPU).experts)


def run_pinned(m: Made, p: GenerationParams, reference: Policy, lora=None):
    task = m.eng.task(p, lora, image=m.image)
    task.reference = reference  # as the stage gives a request with kl_reference "pinned" its copy
    while not task.done:
        m.eng.step([task])
    return task, task.extras()


@contextmanager
def updated(eng: InProcess, seed: int):
    """The policy's weights moved as a weight update moves them (load_into every expert), then put back."""
    g = torch.Generator().manual_seed(seed)
    before = {name: {k: v.clone() for k, v in e.state_dict().items()} for name, e in eng.policy.experts.items()}
    for name, state in before.items():
        load_into(eng.policy.experts[name], {k: v + 0.02 * torch.randn(v.shape, generator=g) if v.is_floating_point()
                                             else v for k, v in state.items()})
    try:
        yield
    finally:
        for name, state in before.items():
            load_into(eng.policy.experts[name], state)


def test_a_reference_pinned_from_the_current_weights_gives_kl_zero(tmp_path_factory):
    m = made("tiny", tmp_path_factory)
    task, ex = run_pinned(m, params(m), pin(m.eng))
    assert ex[KL.name].shape == (2, STEPS)
    assert ex[KL.name].abs().max() <= 1e-6  # the same weights: the same velocity, up to rounding
    assert max_diff(ex[REF_LOG_PROBS.name], ex[LOG_PROBS.name]) <= TOL
    # The reference's forwards are counted: its own, one per SDE step and CFG branch.
    assert task.pass_counts()["transformer_passes"] == [2 * STEPS * 2] * 2


@pytest.mark.parametrize("model,adapter", [("tiny", False), ("tiny", True), ("tiny-flux", False),
                                           ("tiny-wan-ti2v", False), ("tiny-moe", False)])
def test_a_pinned_reference_is_the_weights_pinned_before_a_weight_update(model, adapter, tmp_path_factory,
                                                                         record_property):
    m = made(model, tmp_path_factory)
    p = params(m)
    reference = pin(m.eng)
    with updated(m.eng, seed=5):
        task, ex = run_pinned(m, p, reference, m.lora() if adapter else None)
        want_kl, want_ref = recomputed(m, model, task, ex, "sde", 0.7, reference=reference)
    kl, ref = ex[KL.name], ex[REF_LOG_PROBS.name]
    record_property("kl", kl.tolist())
    record_property("max |kl - recompute| / max(1, |recompute|)", rel_diff(kl, want_kl))
    assert kl.shape == ref.shape == ex[LOG_PROBS.name].shape == (p.n, STEPS)
    assert rel_diff(kl, want_kl) <= TOL
    assert rel_diff(ref, want_ref) <= TOL
    assert (kl > 0).all() and kl.mean() > 100 * TOL  # the update moved every step's mean
    policy = m.eng.policy  # two experts (tiny-moe): the steps run on both, each against its own copy
    assert {policy.expert_for(t) for t in ex[TRAJECTORY_TIMESTEPS.name]} == set(policy.experts)
    # The copy kept the pinned weights: after the update is undone, the same request has kl 0 again.
    assert run_pinned(m, p, reference)[1][KL.name].abs().max() <= 1e-6


def test_the_worker_pins_on_its_control_and_a_pinned_request_batched_with_others_answers_as_alone(tmp_path,
                                                                                                  tmp_path_factory):
    """The denoise worker's own stage (tests/family_harness.py's InStage): a pinned request before any pin is
    refused naming the missing pin; asleep, the pin is refused (503); PinReference copies the weights at the
    worker's version; after a weight change a pinned request batched with another rollout answers what it answers
    alone, with kl > 0; a new pin replaces the copy (kl 0 again)."""
    from common.protocol.control import PinReference, PinReply, ReleaseMemory, ResumeMemory
    from common.protocol.errors import RequestError, Sleeping
    from common.protocol.messages import PROTOCOL_VERSION
    from family_harness import InStage

    m = made("tiny", tmp_path_factory)
    st = InStage(m.eng, tmp_path)
    stage = st.stage
    head = dict(v=PROTOCOL_VERSION, request_id="c")
    p = params(m, kl_reference="pinned")
    with pytest.raises(RequestError, match="no pinned reference"):
        stage.accept(*st.message("early", p))
    stage.release_memory(ReleaseMemory(**head, level=1))
    with pytest.raises(Sleeping):
        stage.controls.pin(PinReference(**head))
    stage.resume_memory(ResumeMemory(**head))
    stage.weight_version = 6
    reply = stage.controls.pin(PinReference(**head))
    assert isinstance(reply, PinReply) and reply.weight_version == 6 and reply.experts == ["transformer"]
    assert reply.nbytes == sum(t.numel() * t.element_size() for t in stage.policy.experts["transformer"].state_dict()
                               .values())
    model = stage.policy.experts["transformer"]
    g = torch.Generator().manual_seed(2)
    load_into(model, {k: v + 0.02 * torch.randn(v.shape, generator=g) for k, v in model.state_dict().items()})
    other = params(m, seed=8, n=1, kl_reference="base")
    both = st.serve({"a": (p, None), "b": (other, None)})
    alone = st.serve({"a": (p, None)})["a"]
    assert both["a"].msg.info["batch"] == 3 and alone.msg.info["batch"] == 2  # the steps were shared
    kl = both["a"].tensors[KL.name]
    assert kl.shape == (2, STEPS) and (kl > 0).all()
    for name in (KL.name, REF_LOG_PROBS.name, LOG_PROBS.name):
        assert max_diff(both["a"].tensors[name], alone.tensors[name]) <= TOL, name
    assert torch.equal(both["b"].tensors[KL.name], torch.zeros(1, STEPS))  # base, no adapter: the policy itself
    stage.controls.pin(PinReference(**head))  # the moved weights are now the reference
    assert st.serve({"a": (p, None)})["a"].tensors[KL.name].abs().max() <= 1e-6


# --- the trainer's recompute --------------------------------------------------------------------------------


def trainer_with_adapter(m: Made):
    """The trainer's copy with the same adapter put in by peft, at the request's scale."""
    import peft

    trainer = _MODELS.trainer(m.eng.info.path)
    model = trainer.transformer
    if "a" not in getattr(model, "peft_config", {}):
        model.add_adapter(lf.lora_config(m.files.rank, m.files.alpha, m.files.target_modules), adapter_name="a")
        result = peft.set_peft_model_state_dict(model, m.files.state_dict, adapter_name="a")
        assert not [k for k in result.unexpected_keys if "lora" in k]
        model.set_adapters(["a"], [SCALE])
    return trainer


@pytest.mark.parametrize("model,sde_type,schedule", [(m, "sde", "rollout") for m in MODELS]
                         + [("tiny", "flow_grpo_wan", "serving")])
def test_the_trainers_recompute_equals_the_engines_kl(model, sde_type, schedule, tmp_path_factory, record_property):
    from rl import Trajectory

    m = made(model, tmp_path_factory)
    p = params(m, sde_type, schedule=schedule)
    task, ex = run(m, p, m.lora())
    trainer = trainer_with_adapter(m)
    image = None if m.image is None else trainer.image(p, m.image)
    steps = ex[LOG_PROB_STEPS.name]
    trajectory = Trajectory(ex[TRAJECTORY_LATENTS.name][0], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])
    trainer.transformer.requires_grad_(False)  # a frozen copy (peft's enable_adapters would turn grads on)
    grads = {name: p.requires_grad for name, p in trainer.transformer.named_parameters()}
    with torch.no_grad():
        kl, ref = trainer.kl(trajectory, steps, p, image=image)
        log_probs = trainer.log_probs(trajectory, steps, p, image=image)
    record_property("max |trainer - engine| kl, ref_log_probs", (max_diff(kl, ex[KL.name][0]),
                                                                 max_diff(ref, ex[REF_LOG_PROBS.name][0])))
    assert max_diff(kl, ex[KL.name][0]) <= TOL
    assert max_diff(ref, ex[REF_LOG_PROBS.name][0]) <= TOL
    assert max_diff(log_probs, ex[LOG_PROBS.name][0]) <= TOL  # the adapter is back on after kl()
    assert grads == {name: p.requires_grad for name, p in trainer.transformer.named_parameters()}
    assert (kl > 0).all()


# --- the fields ---------------------------------------------------------------------------------------------


def test_return_kl_needs_the_rollout_scheduler_and_a_known_reference():
    info = _MODELS.engine(ensure_builtin("tiny")).info
    ok = to_params({"prompt": "p", "return_kl": True}, info, Limits())
    assert ok.rollout.return_kl and ok.rollout.kl_reference == "base"
    for fields, name in (({"return_kl": True, "rollout": False}, "return_kl"),
                         ({"return_kl": True, "kl_reference": "frozen"}, "kl_reference"),
                         ({"return_kl": "yes"}, "return_kl")):
        with pytest.raises(FieldError) as e:
            to_params({"prompt": "p", **fields}, info, Limits())
        assert e.value.field == name


def test_the_router_knows_a_pin_only_when_every_worker_pinned():
    """PinControl over a stand-in for the workers' replies: a pinned request is a 400 naming kl_reference until
    a pin succeeds on all of them; a pin that failed on one, or a worker's restart, forgets it."""
    import asyncio

    from common.protocol.control import PinReply
    from router.control.pin import PinControl
    from router.control.weights import WeightControl
    from router.core.errors import EngineError, FieldError as Refused

    fail = []

    async def control(role, kind, **fields):
        assert role == "denoise" and fields == {}
        return [EngineError(503, "sleeping", "asleep", "denoise", "") if i in fail else
                PinReply(v=1, request_id="c", role=role, index=i, weight_version=4, experts=["transformer"],
                         nbytes=8, pin_s=0.0) for i in range(2)]

    weights = WeightControl(control)
    weights.version = 4
    pins = PinControl(weights)
    info = _MODELS.engine(ensure_builtin("tiny")).info
    pinned = to_params({"prompt": "p", "return_kl": True, "kl_reference": "pinned"}, info, Limits())
    pins.check(to_params({"prompt": "p", "return_kl": True}, info, Limits()))  # base needs no pin

    def refused() -> bool:
        try:
            pins.check(pinned)
        except Refused as e:  # the router's 400
            assert e.status == 400 and e.field == "kl_reference" and "/pin_reference" in e.message
            return True
        return False

    assert refused()
    answer = asyncio.run(pins.pin())
    assert answer["weight_version"] == 4 and [w["index"] for w in answer["workers"]] == [0, 1]
    assert not refused()
    pins.forget()  # a denoise worker restarted
    assert refused()
    asyncio.run(pins.pin())
    fail.append(1)
    with pytest.raises(EngineError):
        asyncio.run(pins.pin())
    assert refused()  # the workers may hold different copies now
