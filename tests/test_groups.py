"""A request's n samples as one unit: every sample equals the same sample run alone.

The group's samples share one prompt encoding, one message per stage, one
scheduler and one SDE step on the stacked tensors; SDE requests at the same
step of the same schedule step together. None of that may change a sample:
each one is compared with the request of its seed alone (n=1), and with the
trainer's recompute of its log-probs.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.protocol.messages import (
    LOG_PROBS, OUTPUT, PROTOCOL_VERSION, TRAJECTORY_LATENTS, GenerationParams, Result, RolloutParams, Route,
)
from common.diffusion import schedulers
from common.diffusion.model_info import ModelInfo
from common.families import read_model
from common.diffusion.policy import ModelInput
from common.diffusion.sde import sde_step
from denoise_worker.joint_step import advance_all
from denoise_worker.packing import forward_parts
from denoise_worker.task import DenoiseTask
from launch import parse_args
from rl import TrainerPolicy, Trajectory
from router.client import EngineClient
from router.link.join import Pending, PendingTable

TOL = 1e-5
FRAMES_TOL = 1e-4  # frames: the VAE decodes the group's latents in one call, and its convolutions round apart
MAX_BATCH = parse_args([]).max_batch_size  # the engine's default --max-batch-size (8)
BASE = dict(prompt="a heron in the reeds", negative_prompt="blurry", seed=40, num_inference_steps=5,
            guidance_scale=4.0, output_type="latent")


@pytest.fixture(scope="module")
def engine(shared_engine):
    return shared_engine("tiny")


@pytest.fixture(scope="module")
def client(engine):
    with EngineClient(engine.url) as c:
        yield c


def _run(client, path: str, body: dict) -> dict:
    return client._post(path, body)


def _alone(client, path: str, body: dict, n: int) -> list[dict]:
    """The samples of ``body`` with n samples, each as its own request (seed + i, n=1), one after another."""
    return [_run(client, path, {**body, "seed": body["seed"] + i, "n": 1})["samples"][0] for i in range(n)]


def _max_diff(a: dict, b: dict) -> float:
    """The largest difference between two samples' output, log-probs and trajectory latents."""
    diffs = [(a["output"] - b["output"]).abs().max().item()]
    if "log_probs" in a:
        assert a["log_prob_steps"].tolist() == b["log_prob_steps"].tolist()
        diffs.append((a["log_probs"] - b["log_probs"]).abs().max().item() if a["log_probs"].numel() else 0.0)
    if "trajectory" in a:
        diffs.append((a["trajectory"]["latents"] - b["trajectory"]["latents"]).abs().max().item())
        assert torch.equal(a["trajectory"]["sigmas"], b["trajectory"]["sigmas"])
    return max(diffs)


CASES = {
    "serving-unipc": ("/generate", {}),
    "serving-frames": ("/generate", {"output_type": "frames"}),
    "rollout-false": ("/rollout/generate", {"rollout": False}),
    "sde-trajectory": ("/rollout/generate", {"return_trajectory": True}),
    "cps": ("/rollout/generate", {"sde_type": "cps", "noise_level": 0.8, "return_trajectory": True}),
    "sde-window": ("/rollout/generate", {"sde_step_indices": [1, 3], "return_trajectory": True}),
    "no-cfg": ("/rollout/generate", {"guidance_scale": 1.0}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_group_samples_equal_each_sample_alone(client, case):
    path, over = CASES[case]
    body = {**BASE, **over}
    n = 4
    group = _run(client, path, {**body, "n": n})
    alone = _alone(client, path, body, n)
    assert [s["seed"] for s in group["samples"]] == [body["seed"] + i for i in range(n)]
    assert all(s["batch"] == n for s in group["samples"])  # one unit: every sample in every step
    assert all(s["batch"] == 1 for s in alone)
    for g, a in zip(group["samples"], alone):
        assert g["scheduler"] == a["scheduler"]
        assert _max_diff(g, a) <= (FRAMES_TOL if body["output_type"] == "frames" else TOL), case
    outs = [s["output"] for s in group["samples"]]
    assert all(not torch.equal(outs[0], o) for o in outs[1:])  # each sample its own noise
    assert group["timings"]["denoise_s"] > 0


def test_group_log_probs_equal_the_trainers_recompute(client, tiny_dir):
    body = {**BASE, "return_trajectory": True, "n": 3, "seed": 7}
    samples = _run(client, "/rollout/generate", body)["samples"]
    policy = TrainerPolicy(tiny_dir)
    for s in samples:
        with torch.no_grad():
            again = policy.log_probs(Trajectory.from_sample(s), s["log_prob_steps"], policy.params(**body))
        assert again.shape == s["log_probs"].shape == (body["num_inference_steps"],)
        assert (again - s["log_probs"]).abs().max().item() <= TOL


def test_a_group_larger_than_the_batch_runs_in_parts(client):
    n = MAX_BATCH + 3
    body = {**BASE, "n": n, "return_trajectory": True}
    group = _run(client, "/rollout/generate", body)["samples"]
    assert len(group) == n
    for i in (0, MAX_BATCH - 1, MAX_BATCH, n - 1):  # both sides of the cut
        alone = _run(client, "/rollout/generate", {**body, "seed": body["seed"] + i, "n": 1})["samples"][0]
        assert _max_diff(group[i], alone) <= TOL


def test_concurrent_groups_equal_their_runs_alone(client):
    """Groups of different prompts at once: two SDE groups that step together, a serving group beside them."""
    reqs = [
        ("/rollout/generate", {**BASE, "prompt": "a fox", "n": 3, "seed": 1}),
        ("/rollout/generate", {**BASE, "prompt": "a boat", "n": 2, "seed": 50, "return_trajectory": True}),
        ("/generate", {**BASE, "prompt": "a bell", "n": 3, "seed": 9}),
    ]
    alone = [_run(client, p, b)["samples"] for p, b in reqs]
    with ThreadPoolExecutor(len(reqs)) as pool:
        together = list(pool.map(lambda r: _run(client, *r)["samples"], reqs))
    assert max(s["batch"] for g in together for s in g) > 3  # they really shared steps
    for a, t in zip(alone, together):
        for sa, st in zip(a, t, strict=True):
            assert _max_diff(st, sa) <= TOL


# --- in process: the joint step, the forward parts, the join ---------------------------------------------

@pytest.fixture(scope="module")
def templates(tiny_dir):
    info = read_model(tiny_dir)
    serving = schedulers.load_serving_template(info)
    return info, serving, schedulers.rollout_template_for(serving)


def _task(templates, seed: int, n: int, rollout: RolloutParams | None) -> DenoiseTask:
    info, serving, rollout_t = templates
    p = GenerationParams(prompt="p", negative_prompt="", height=32, width=32, num_frames=5, num_inference_steps=4,
                         guidance_scale=4.0, seed=seed, n=n, rollout=rollout)
    return DenoiseTask.create(p, torch.zeros(1, 4, 8), None, info, serving, rollout_t, torch.device("cpu"))


def _velocity(step: int, shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 + step))


@pytest.mark.parametrize("rollout", [RolloutParams(), RolloutParams(sde_type="cps", noise_level=0.5),
                                     RolloutParams(sde_step_indices=[0, 2]), None],
                         ids=["sde", "cps", "window", "unipc"])
def test_joint_step_is_each_sample_alone_bit_for_bit(templates, rollout):
    """A group of 3 and a request of 1 at the same step take one joint step; each sample equals its solo task
    given the same model output: bit for bit for the latents (elementwise), within rounding for log-probs."""
    group, other = _task(templates, 10, 3, rollout), _task(templates, 13, 1, rollout)
    solos = [_task(templates, 10 + i, 1, rollout) for i in range(4)]
    while not group.done:
        v = _velocity(group.step, (4, *group.latents.shape[1:]))
        assert advance_all([group, other], [v[:3], v[3:]]) == [None, None]
        for i, solo in enumerate(solos):
            assert advance_all([solo], [v[i : i + 1]]) == [None]
    stepped = torch.cat([group.latents, other.latents])
    if rollout is None:  # UniPC's step mixes past outputs with einsum: rounding, not bits
        torch.testing.assert_close(stepped, torch.cat([s.latents for s in solos]), rtol=0, atol=1e-6)
        return
    assert torch.equal(stepped, torch.cat([s.latents for s in solos]))
    lp = torch.cat([group.extras()[LOG_PROBS.name], other.extras()[LOG_PROBS.name]])
    solo_lp = torch.cat([s.extras()[LOG_PROBS.name] for s in solos])
    assert lp.shape == (4, len(solos[0].record.log_prob_steps)) and lp.shape[1] > 0
    torch.testing.assert_close(lp, solo_lp, rtol=1e-6, atol=1e-6)


def test_tasks_at_other_steps_or_settings_step_apart(templates):
    a, b = _task(templates, 1, 2, RolloutParams()), _task(templates, 2, 2, RolloutParams(noise_level=0.3))
    c = _task(templates, 3, 1, RolloutParams())
    advance_all([c], [_velocity(0, c.latents.shape)])  # c is one step ahead
    assert len({a.step_key(), b.step_key(), c.step_key()}) == 3
    before = [t.step for t in (a, b, c)]
    errors = advance_all([a, b, c], [_velocity(9, t.latents.shape) for t in (a, b, c)])
    assert errors == [None] * 3 and [t.step for t in (a, b, c)] == [s + 1 for s in before]


def test_sde_step_with_one_generator_per_sample_draws_each_samples_own_noise():
    x, v = torch.randn(3, 4, 2, 3, 3), torch.randn(3, 4, 2, 3, 3)
    joint = sde_step(v, x, 0.8, 0.7, 0.95, generator=[torch.Generator().manual_seed(s) for s in (5, 6, 7)])
    for i, s in enumerate((5, 6, 7)):
        alone = sde_step(v[i : i + 1], x[i : i + 1], 0.8, 0.7, 0.95, generator=torch.Generator().manual_seed(s))
        assert torch.equal(joint.prev_sample[i : i + 1], alone.prev_sample)
    with pytest.raises(ValueError, match="one per sample"):
        sde_step(v, x, 0.8, 0.7, 0.95, generator=[torch.Generator()])


def _input(n: int) -> ModelInput:
    return ModelInput(torch.zeros(n, 4, 2, 2, 2), torch.tensor(500.0), torch.zeros(1, 3, 8), None, 1.0)


def test_forward_parts_fill_forwards_and_cut_large_requests():
    parts = forward_parts([_input(3), _input(4), _input(10), _input(1)], max_batch=8)
    sizes = [[(i, x.n) for i, x in part] for part in parts]
    assert sizes == [[(0, 3), (1, 4)], [(2, 8)], [(2, 2), (3, 1)]]
    assert all(sum(x.n for _, x in part) <= 8 for part in parts)


def test_a_result_with_the_wrong_number_of_samples_is_refused():
    async def run():
        table = PendingTable()
        p = table.add("r", Pending(asyncio.get_running_loop().create_future(), Route(encoder=0, denoise=0, decode=0),
                                   samples=4))
        assert table.samples == 4
        msg = Result(v=PROTOCOL_VERSION, request_id="r", stage="denoise")
        table.resolve(msg, {OUTPUT.name: torch.zeros(3, 16, 2, 4, 4), TRAJECTORY_LATENTS.name: torch.zeros(4, 1)})
        e = p.future.exception()
        assert e.status == 502 and "output holds 3 samples" in e.message

    asyncio.run(run())


def test_a_forward_that_shares_its_text_equals_each_request_alone(tiny_dir):
    """Requests sharing a prompt, a negative prompt, an adapter (also on text-side Linears) or none: the
    model sees each distinct (text, adapter) once, and every request's output equals its forward alone."""
    from common.diffusion.lora import build_adapter
    from common.diffusion.lora_format import ExpertLora
    from common.diffusion.policy import Policy

    policy = Policy.load(read_model(tiny_dir), torch.float32, "cpu")
    model = policy.experts["transformer"]
    g = torch.Generator().manual_seed(3)
    d = model.config.text_dim
    prompt, other, negative = (torch.randn(1, 512, d, generator=g) for _ in range(3))

    def lora(path):
        linear = model.get_submodule(path)
        return (torch.randn(4, linear.in_features, generator=g) * 0.3,
                torch.randn(linear.out_features, 4, generator=g) * 0.3, 2.0)

    paths = ["blocks.0.attn2.to_k", "blocks.1.attn2.to_v", "blocks.0.attn2.to_q", "blocks.1.ffn.net.0.proj",
             "condition_embedder.text_embedder.linear_1"]
    adapter = build_adapter("t", 1, {"transformer": ExpertLora({p: lora(p) for p in paths})}, policy.experts, 8)
    policy.cover(adapter)

    def latents(n):
        return torch.randn(n, 16, 2, 4, 4, generator=g)

    inputs = [ModelInput(latents(3), torch.tensor(900.0), prompt, negative, 4.0),
              ModelInput(latents(2), torch.tensor(700.0), prompt, negative, 5.0),  # the same texts, another step
              ModelInput(latents(2), torch.tensor(900.0), prompt, negative, 4.0, lora=(adapter, 0.8)),
              ModelInput(latents(1), torch.tensor(500.0), other, None, 1.0, lora=(adapter, 0.8))]
    seen: list[int] = []
    hook = model.blocks[0].attn2.to_k.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[0]))
    try:
        joint = policy.batched_velocity(inputs)
    finally:
        hook.remove()
    assert seen == [5]  # (prompt, negative) x (base, adapter), and (other, adapter): not the 15 rows
    for x, v in zip(inputs, joint):
        torch.testing.assert_close(v, policy.velocity(x), rtol=0, atol=TOL)
    base = policy.velocity(ModelInput(inputs[2].latents, inputs[2].timestep, prompt, negative, 4.0))
    assert (base - joint[2]).abs().max() > 1e-3  # the adapter did act
