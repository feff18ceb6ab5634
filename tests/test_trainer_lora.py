"""Training a LoRA on the trainer's side (rl.lora): only the adapter trains, its state dict round-trips, and the
engine runs the pushed adapter exactly as the trainer's peft layers do (log-probs recomputed to <= 1e-5,
at scale 1 and at a request's lora_scale)."""

import pytest
import torch

from diffusers import WanPipeline, WanTransformer3DModel

from common.diffusion.weight_storage import settle
from rl import TrainerPolicy, Trajectory
from rl.lora import (DEFAULT_TARGETS, add_lora, lora_config, lora_metadata, lora_parameters, lora_state_dict,
                     push_lora, save_lora, set_lora_scale)
from router.client import EngineClient, EngineHTTPError

RECOMPUTE_TOL = 1e-5
RANK, ALPHA = 4, 8.0  # alpha != rank: the scaling alpha / r = 2 must reach the engine


def _randomise_lora_b(model, seed, std=0.3):
    """peft starts lora_B at zero (the adapter is the base model): give it values so it changes the output."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 16, 2, 4, 4, generator=g)
    text = torch.randn(1, 512, 32, generator=g)
    return dict(hidden_states=x, timestep=torch.tensor([700.0]), encoder_hidden_states=text, return_dict=False)


def _fake_trajectory(steps=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    return Trajectory(torch.randn(steps + 1, 16, 2, 4, 4, generator=g), sigmas[:-1] * 1000, sigmas)


@pytest.fixture
def lora_policy(tiny_dir):
    policy = TrainerPolicy(tiny_dir)
    add_lora(policy, RANK, ALPHA, seed=0)
    return policy


# --- without an engine --------------------------------------------------------------------------


def test_only_lora_parameters_train(lora_policy):
    model = lora_policy.transformer
    base = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" not in n}
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    assert len(lora) == 2 * 4 * 2 * 2  # A and B x 4 projections x 2 attentions x 2 blocks
    assert all(model.get_parameter(n).requires_grad for n in lora)
    assert not any(model.get_parameter(n).requires_grad for n in base)
    assert {id(p) for p in lora_parameters(lora_policy)} == {id(model.get_parameter(n)) for n in lora}
    optim = torch.optim.Adam(lora_parameters(lora_policy), lr=1e-2)
    traj = _fake_trajectory()
    lp = lora_policy.log_probs(traj, [1, 2], lora_policy.params("a fox", "blurry", guidance_scale=4.0))
    assert lp.requires_grad
    (-lp.mean()).backward()
    for n, p in model.named_parameters():
        assert (p.grad is not None) == (n in lora), n
    optim.step()
    for n, p in model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n
    assert any(not torch.equal(model.get_parameter(n), v) for n, v in lora.items() if "lora_B" in n)
    assert lora_policy.text_encoder is not None  # untouched: the encoder has no adapter


def test_fresh_adapter_is_the_base_model_and_seed_is_reproducible(tiny_dir, lora_policy):
    # Laid out as the trainer's copy (Policy.load settles it): kernels round by alignment, not by bytes alone.
    base = settle(WanTransformer3DModel.from_pretrained(tiny_dir / "transformer"))
    with torch.no_grad():
        assert torch.equal(lora_policy.transformer(**_inputs())[0], base(**_inputs())[0])
    again = TrainerPolicy(tiny_dir)
    rng = torch.get_rng_state()
    add_lora(again, RANK, ALPHA, seed=0)
    assert torch.equal(torch.get_rng_state(), rng)  # the seed does not move the global generator
    a, b = lora_state_dict(lora_policy), lora_state_dict(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_state_dict_names_and_round_trip(tiny_dir, lora_policy):
    _randomise_lora_b(lora_policy.transformer, 1)
    sd = lora_state_dict(lora_policy)
    assert "blocks.0.attn1.to_q.lora_A.weight" in sd and "blocks.1.attn2.to_out.0.lora_B.weight" in sd
    assert all(k.endswith((".lora_A.weight", ".lora_B.weight")) for k in sd)
    assert sd["blocks.0.attn1.to_q.lora_A.weight"].shape == (RANK, 24)
    assert all(v.device.type == "cpu" and not v.requires_grad for v in sd.values())
    cfg = lora_config(lora_policy)
    assert (cfg.r, cfg.lora_alpha, set(cfg.target_modules)) == (RANK, ALPHA, set(DEFAULT_TARGETS))
    with torch.no_grad():
        want = lora_policy.transformer(**_inputs())[0]
        fresh = WanTransformer3DModel.from_pretrained(tiny_dir / "transformer")
        assert not torch.allclose(fresh(**_inputs())[0], want, atol=1e-4)  # the adapter matters
        fresh.load_lora_adapter(sd, prefix=None, adapter_name="back", metadata=lora_metadata(lora_policy))
        settle(fresh)
        assert torch.equal(fresh(**_inputs())[0], want)
        # A copy: training on does not change what was taken.
        lora_policy.transformer.get_submodule("blocks.0.attn1.to_k").lora_A["default"].weight.add_(1.0)
    key = "blocks.0.attn1.to_k.lora_A.weight"
    assert torch.equal(lora_state_dict(lora_policy)[key], sd[key] + 1.0)


def test_save_lora_loads_into_diffusers_pipeline_at_any_scale(tiny_dir, lora_policy, tmp_path):
    _randomise_lora_b(lora_policy.transformer, 2)
    path = save_lora(lora_policy, tmp_path / "ad")
    assert path.name == "pytorch_lora_weights.safetensors"
    pipe = WanPipeline.from_pretrained(tiny_dir, dtype=torch.float32)
    pipe.load_lora_weights(tmp_path / "ad", adapter_name="disk")
    settle(pipe.transformer)
    cfg = pipe.transformer.peft_config["disk"]
    assert (cfg.r, cfg.lora_alpha) == (RANK, ALPHA)
    with torch.no_grad():
        for scale in (1.0, 0.5, 0.0):
            set_lora_scale(lora_policy, scale)
            pipe.set_adapters(["disk"], [scale])
            assert torch.equal(pipe.transformer(**_inputs())[0], lora_policy.transformer(**_inputs())[0])


def test_scale_is_the_engines_formula(lora_policy):
    """peft's layer adds s * (alpha / r) * B (A x): the delta the engine adds per sample."""
    _randomise_lora_b(lora_policy.transformer, 3)
    layer = lora_policy.transformer.get_submodule("blocks.0.attn2.to_v")
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    x = torch.randn(3, 24)
    with torch.no_grad():
        for s in (1.0, 0.5):
            set_lora_scale(lora_policy, s)
            delta = layer(x) - layer.base_layer(x)
            assert torch.allclose(delta, s * (ALPHA / RANK) * (x @ a.T) @ b.T, atol=1e-6)
    assert all(p.requires_grad for p in lora_parameters(lora_policy))  # set_adapters keeps them trainable


def test_add_lora_checks(tiny_dir):
    policy = TrainerPolicy(tiny_dir)
    with pytest.raises(ValueError, match="add_lora first"):
        lora_state_dict(policy)
    with pytest.raises(ValueError, match="transformer_2"):
        add_lora(policy, 4, expert="transformer_2")
    with pytest.raises(ValueError, match="rank"):
        add_lora(policy, 0)


def test_two_experts_each_get_their_own_adapter():
    from common.builtin import ensure_builtin

    policy = TrainerPolicy(ensure_builtin("tiny-moe"))
    add_lora(policy, 2, seed=0)
    add_lora(policy, 4, expert="transformer_2", seed=1)  # freezing again keeps the first adapter trainable
    assert len(lora_parameters(policy, "transformer")) == len(lora_parameters(policy, "transformer_2")) == 32
    assert len(lora_parameters(policy)) == 64
    assert lora_state_dict(policy, "transformer_2")["blocks.0.attn1.to_q.lora_A.weight"].shape[0] == 4
    assert not any(p.requires_grad for m in policy.experts.values() for n, p in m.named_parameters()
                   if "lora_" not in n)


# --- against the engine -------------------------------------------------------------------------

REQ = dict(prompt="a red kite over the sea", negative_prompt="blurry", seed=3, num_inference_steps=6,
           guidance_scale=4.0, return_trajectory=True)


@pytest.fixture(scope="module")
def lora_root(tmp_path_factory):
    return tmp_path_factory.mktemp("loras")


@pytest.fixture(scope="module")
def client(engine_factory, lora_root):
    eng = engine_factory("tiny", extra=["--weight-root", str(lora_root)])
    with EngineClient(eng.url) as c:
        yield c


@pytest.fixture(scope="module")
def pushed(tiny_dir, client):
    policy = TrainerPolicy(tiny_dir)
    add_lora(policy, RANK, ALPHA, seed=0)
    _randomise_lora_b(policy.transformer, 7)
    answer = push_lora(client, policy, "trained")
    return policy, answer


def _gap(policy, sample, req=REQ):
    with torch.no_grad():
        mine = policy.log_probs(Trajectory.from_sample(sample), sample["log_prob_steps"], policy.params(**req))
    return (mine - sample["log_probs"]).abs().max().item()


@pytest.mark.heavy  # engine-level adapter rollouts and pushes: tests/test_lora.py
def test_pushed_adapter_recomputes_on_the_trainer(client, pushed):
    policy, answer = pushed
    base = client.rollout(**REQ)["samples"][0]
    s = client.rollout(**REQ, lora_name="trained")["samples"][0]
    assert s["lora_name"] == "trained" and s["lora_version"] == answer["lora_version"]
    # A rollout's own log-probs depend only on its noise: the adapter shows in the trajectory and the recompute.
    moved = (s["trajectory"]["latents"] - base["trajectory"]["latents"]).abs().max().item()
    assert moved > 1e-2
    assert _gap(policy, s) <= RECOMPUTE_TOL
    try:
        set_lora_scale(policy, 0.0)  # the trainer's base model
        assert _gap(policy, s) > 1e-3 and _gap(policy, base) <= RECOMPUTE_TOL
    finally:
        set_lora_scale(policy, 1.0)
    names = [a["lora_name"] for a in client.lora_adapters()]
    assert "trained" in names


@pytest.mark.heavy  # engine-level adapter rollouts and pushes: tests/test_lora.py
def test_lora_scale_needs_the_trainers_scale(client, pushed):
    policy, _ = pushed
    s = client.rollout(**REQ, lora_name="trained", lora_scale=0.5)["samples"][0]
    try:
        assert _gap(policy, s) > 1e-3  # at scale 1 the trainer computes another policy
        set_lora_scale(policy, 0.5)
        assert _gap(policy, s) <= RECOMPUTE_TOL
    finally:
        set_lora_scale(policy, 1.0)


@pytest.mark.heavy  # engine-level adapter rollouts and pushes: tests/test_lora.py
def test_repush_after_a_step_and_disk_load_agree(client, pushed, lora_root):
    policy, first = pushed
    with torch.no_grad():
        for p in lora_parameters(policy):
            p.mul_(1.5)
    again = push_lora(client, policy, "trained")
    assert again["lora_version"] > first["lora_version"]
    s = client.rollout(**REQ, lora_name="trained")["samples"][0]
    assert s["lora_version"] == again["lora_version"] and _gap(policy, s) <= RECOMPUTE_TOL
    save_lora(policy, lora_root / "step1")
    client.load_lora_adapter("from-disk", str(lora_root / "step1"))
    d = client.rollout(**REQ, lora_name="from-disk")["samples"][0]
    assert d["lora_name"] == "from-disk"
    assert (d["log_probs"] - s["log_probs"]).abs().max().item() <= RECOMPUTE_TOL
    client.unload_lora_adapter("from-disk")
    with pytest.raises(EngineHTTPError) as e:
        client.rollout(**REQ, lora_name="from-disk")
    assert e.value.status == 400 and e.value.error["field"] == "lora_name"


@pytest.mark.heavy  # a second Wan model's engine; test_lora.py's covers it
def test_second_expert_adapter_from_memory_and_disk(engine_factory, lora_root):
    """A LoRA on transformer_2 only (the low-noise expert): pushed with module=transformer_2, or saved in
    diffusers' format and loaded with load_into_transformer_2; the trainer recomputes the steps of both experts."""
    from common.builtin import ensure_builtin

    policy = TrainerPolicy(ensure_builtin("tiny-moe"))
    add_lora(policy, 2, 4.0, expert="transformer_2", seed=0)
    _randomise_lora_b(policy.experts["transformer_2"], 11)
    save_lora(policy, lora_root / "moe", expert="transformer_2")
    req = {**REQ, "guidance_scale_2": 3.0}
    with EngineClient(engine_factory("tiny-moe", extra=["--weight-root", str(lora_root)]).url) as c:
        assert push_lora(c, policy, "t2", expert="transformer_2")["experts"] == ["transformer_2"]
        c.load_lora_adapter("t2-disk", str(lora_root / "moe"), load_into_transformer_2=True)
        base = c.rollout(**req)["samples"][0]
        for name in ("t2", "t2-disk"):
            s = c.rollout(**req, lora_name=name)["samples"][0]
            assert not torch.equal(s["trajectory"]["latents"], base["trajectory"]["latents"])
            with torch.no_grad():
                mine = policy.log_probs(Trajectory.from_sample(s), s["log_prob_steps"], policy.params(**req))
            assert (mine - s["log_probs"]).abs().max().item() <= RECOMPUTE_TOL, name
    steps = Trajectory.from_sample(s).timesteps
    assert {policy.policy.expert_for(t) for t in steps} == {"transformer", "transformer_2"}
