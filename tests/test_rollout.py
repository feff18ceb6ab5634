"""RL rollout on the serving engine: scheduler switch, log-probs vs trainer recompute, weight sync, two experts."""

import logging
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, WanTransformer3DModel

from common.diffusion.model_info import ModelInfo
from common.families import read_model
from common.diffusion.sde import sde_step
from common.diffusion.windows import pick_window
from common.diffusion.weights import state_dict_checksum
from conftest import diffusers_generate
from common.diffusion import schedulers
from rl import TrainerPolicy, Trajectory
from router.client import EngineClient, EngineHTTPError

RECOMPUTE_TOL = 1e-5
UNIPC = "UniPCMultistepScheduler"
EULER = "FlowMatchEulerDiscreteScheduler"


@pytest.fixture(scope="module")
def weights_dir(tmp_path_factory):
    """Where the weight-sync tests write; the engines may read weights only below it."""
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def engine(engine_factory, weights_dir):
    return engine_factory("tiny", extra=["--weight-root", str(weights_dir)])


@pytest.fixture(scope="module")
def launched(engine_factory, weights_dir):
    """For the tests of the worker processes: their logs and a restart."""
    return engine_factory("tiny", extra=["--weight-root", str(weights_dir)], launched=True)


@pytest.fixture(scope="module")
def client(engine):
    with EngineClient(engine.url) as c:
        yield c


@pytest.fixture(scope="module")
def policy(tiny_dir):
    return TrainerPolicy(tiny_dir)


BASE = dict(prompt="a red kite over the sea", negative_prompt="blurry", seed=3, num_inference_steps=6,
            guidance_scale=4.0, return_trajectory=True)


def _recompute_max_diff(policy, req, sample):
    traj = Trajectory.from_sample(sample)
    with torch.no_grad():
        again = policy.log_probs(traj, sample["log_prob_steps"], policy.params(**req))
    assert again.shape == sample["log_probs"].shape
    return (again - sample["log_probs"]).abs().max().item()


@pytest.mark.parametrize("over", [{}, {"sde_type": "cps", "noise_level": 0.8, "seed": 8},
                                  {"guidance_scale": 1.0, "seed": 5}], ids=["sde", "cps", "no-cfg"])
def test_rollout_log_probs_equal_trainer_recompute(client, policy, over):
    req = {**BASE, **over}
    s = client.rollout(**req)["samples"][0]
    assert s["scheduler"] == EULER and s["schedule"] == "rollout"
    assert s["log_prob_steps"].tolist() == list(range(req["num_inference_steps"] - (req.get("sde_type") == "cps")))
    assert s["log_probs"].dtype == torch.float32 and torch.isfinite(s["log_probs"]).all()
    assert _recompute_max_diff(policy, req, s) <= RECOMPUTE_TOL


def test_flow_grpo_wan_on_the_serving_schedule(client, policy, tiny_dir):
    """Flow-GRPO's Wan step on Wan's own UniPC schedule: its sigmas and integer timesteps, recomputed by the
    trainer from the trajectory."""
    req = {**BASE, "sde_type": "flow_grpo_wan", "schedule": "serving", "seed": 9}
    s = client.rollout(**req)["samples"][0]
    assert s["scheduler"] == UNIPC and s["schedule"] == "serving"
    unipc = schedulers.load_serving_template(read_model(tiny_dir))
    unipc.set_timesteps(req["num_inference_steps"])
    traj = Trajectory.from_sample(s)
    assert torch.equal(traj.timesteps, unipc.timesteps.float()) and torch.equal(traj.sigmas, unipc.sigmas.float())
    assert _recompute_max_diff(policy, req, s) <= RECOMPUTE_TOL


def test_trajectory_facts(client, policy, tiny_dir):
    """x_0 is the seed's noise, timesteps follow the flow-match convention, and the noise scale is right."""
    req = {**BASE, "height": 64, "width": 64, "num_frames": 9}
    s = client.rollout(**req)["samples"][0]
    traj = Trajectory.from_sample(s)
    T = req["num_inference_steps"]
    info = read_model(tiny_dir)
    assert traj.latents.shape == (T + 1, *info.latent_shape(64, 64, 9)[1:])
    assert traj.timesteps.shape == (T,) and traj.sigmas.shape == (T + 1,)
    noise = torch.randn(info.latent_shape(64, 64, 9), generator=torch.Generator("cpu").manual_seed(req["seed"]))
    assert torch.equal(traj.latents[0], noise[0])
    assert torch.allclose(traj.timesteps.double(), traj.sigmas[:-1].double() * 1000, atol=1e-3)
    assert torch.equal(s["output"], traj.latents[-1])
    p = policy.params(**req)
    cond, uncond = policy.embeddings(p)
    z = []
    with torch.no_grad():
        for i in range(T - 1):  # the last step lands on sigma 0 where the noise is tiny; skip it
            x = traj.latents[i : i + 1]
            v = policy.velocity(x, traj.timesteps[i], cond, uncond, p)
            st = sde_step(v, x, traj.sigmas[i], traj.sigmas[i + 1], traj.sigmas[1], noise_level=0.7,
                          prev_sample=traj.latents[i + 1 : i + 2])
            z.append(((traj.latents[i + 1 : i + 2] - st.mean) / st.noise_scale).flatten())
    z = torch.cat(z)
    assert abs(z.std().item() - 1.0) < 0.05 and abs(z.mean().item()) < 0.05


def test_sde_window_and_ode_steps(client, policy):
    req = {**BASE, "sde_step_indices": [1, 3], "seed": 12}
    s = client.rollout(**req)["samples"][0]
    assert s["log_prob_steps"].tolist() == [1, 3] and s["log_probs"].shape == (2,)
    assert _recompute_max_diff(policy, req, s) <= RECOMPUTE_TOL
    traj = Trajectory.from_sample(s)
    p = policy.params(**req)
    cond, uncond = policy.embeddings(p)
    with torch.no_grad():
        for i in (0, 2, 4, 5):  # outside the window: deterministic Euler steps
            x = traj.latents[i : i + 1]
            v = policy.velocity(x, traj.timesteps[i], cond, uncond, p).float()
            euler = x + (traj.sigmas[i + 1] - traj.sigmas[i]) * v
            assert (euler - traj.latents[i + 1 : i + 2]).abs().max().item() <= 1e-5
    ode = client.rollout(**{**req, "sde_type": "ode", "sde_step_indices": None})["samples"][0]
    assert ode["log_probs"].numel() == 0 and ode["scheduler"] == EULER
    again = client.rollout(**{**req, "sde_type": "ode", "sde_step_indices": None, "seed": 99})["samples"][0]
    assert not torch.equal(ode["output"], again["output"])  # the seed still sets the initial noise


def test_seeded_window_is_reported_and_the_serving_solver_follows_it(client, policy):
    """The window picked from the request's seed is in the answer (each sample of the group has it) and is the
    one the trainer's params resolve; with the serving solver after it, the window's log-probs still recompute."""
    req = {**BASE, "seed": 12, "n": 2, "sde_window_size": 2, "sde_window_range": [1, 5], "ode_solver": "serving"}
    answer = client.rollout(**req)
    window = policy.params(**req).rollout.sde_window
    assert [s["sde_window"] for s in answer["samples"]] == [window, window] == [list(pick_window(12, 2, [1, 5], 6))] * 2
    s = answer["samples"][0]
    assert s["log_prob_steps"].tolist() == list(range(*window)) and s["scheduler"] == EULER
    assert _recompute_max_diff(policy, req, s) <= RECOMPUTE_TOL


def test_same_request_same_trajectory(client):
    a = client.rollout(**BASE)["samples"][0]
    b = client.rollout(**BASE)["samples"][0]
    c = client.rollout(**{**BASE, "seed": BASE["seed"] + 1})["samples"][0]
    assert torch.equal(a["trajectory"]["latents"], b["trajectory"]["latents"])
    assert torch.equal(a["log_probs"], b["log_probs"])
    assert not torch.equal(a["log_probs"], c["log_probs"])


def test_rollout_false_is_generate(client):
    req = dict(prompt="a lighthouse", seed=4, num_inference_steps=5, guidance_scale=5.0)
    g = client.generate(**req, output_type="latent")["samples"][0]
    r = client.rollout(**req, rollout=False)["samples"][0]
    assert r["scheduler"] == UNIPC and "log_probs" not in r
    assert torch.equal(g["output"], r["output"])
    frames = client.rollout(**req, rollout=False, output_type="frames")["samples"][0]["output"]
    assert torch.equal(frames, client.generate(**req)["samples"][0]["output"])


def test_mixed_concurrent_requests_equal_solo_runs(client):
    reqs = []
    for i in range(8):
        rollout = i % 2 == 0
        reqs.append(dict(prompt=f"scene {i}", seed=40 + i, num_inference_steps=3 + i % 4, rollout=rollout,
                         guidance_scale=1.0 if i % 3 == 0 else 5.0, return_trajectory=rollout,
                         sde_type="cps" if i % 4 == 2 else "sde", noise_level=0.8 if i % 4 == 2 else 0.7,
                         height=32 if i < 4 else 48))
    solo = [client.rollout(**r)["samples"][0] for r in reqs]
    with ThreadPoolExecutor(8) as pool:
        mixed = list(pool.map(lambda r: client.rollout(**r)["samples"][0], reqs))
    # Requests that shared a batched forward round differently: within 1e-5 (fp32), not bit for bit.
    assert max(b["batch"] for b in mixed) > 1
    for r, a, b in zip(reqs, solo, mixed):
        assert b["scheduler"] == (EULER if r["rollout"] else UNIPC)
        assert a["batch"] == 1
        assert (a["output"] - b["output"]).abs().max().item() <= 1e-5
        if r["rollout"]:
            assert (a["log_probs"] - b["log_probs"]).abs().max().item() <= 1e-5


def test_rollout_frames_carry_log_probs(client, policy):
    req = {**BASE, "output_type": "frames", "seed": 21}
    s = client.rollout(**req)["samples"][0]
    assert s["output"].shape == (5, 32, 32, 3) and s["log_probs"].shape == (6,)
    assert _recompute_max_diff(policy, req, s) <= RECOMPUTE_TOL


def test_convention_check_rejects_mismatch_and_logs_once(caplog):
    template = schedulers.rollout_template_for(schedulers.load_serving_template(read_model(
        __import__("common.builtin", fromlist=["x"]).ensure_builtin("tiny"))))
    bad = FlowMatchEulerDiscreteScheduler.from_config(template.config)
    bad.set_timesteps(timesteps=[900.0, 600.0, 300.0])  # diffusers shifts the sigmas but not these timesteps
    with pytest.raises(schedulers.ConventionError, match="flow-match convention"):
        schedulers.check_flow_match_convention(bad)
    schedulers._logged_conventions.clear()
    with caplog.at_level(logging.INFO, logger="disagg.denoise"):
        for steps in (3, 5, 8):
            good = FlowMatchEulerDiscreteScheduler.from_config(template.config)
            good.set_timesteps(steps)
            schedulers.check_flow_match_convention(good)
    assert sum("satisfies" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.heavy  # a launched engine's worker process: CI
def test_convention_logged_once_per_worker_process(launched):
    with EngineClient(launched.url) as client:
        for seed in range(3):
            client.rollout(**{**BASE, "seed": seed, "return_trajectory": False})
    assert launched.log_text().count("satisfies timesteps == sigmas[:-1]") == 1


def test_validation_of_rollout_fields(client):
    bad = [({"sde_type": "brownian"}, "sde_type"), ({"noise_level": -0.1}, "noise_level"),
           ({"sde_step_indices": [0, 6]}, "sde_step_indices"), ({"sde_step_indices": [1, 1]}, "sde_step_indices"),
           ({"return_trajectory": "yes"}, "return_trajectory"),
           ({"sde_type": "cps", "noise_level": 1.5}, "noise_level"),  # cps's std needs noise_level <= 1
           ({"sde_window_size": 7}, "sde_window_size"),  # more than the 6 steps
           ({"sde_window_size": 2, "sde_window_range": [0, 7]}, "sde_window_range"),
           ({"sde_window_size": 2, "sde_step_indices": [1]}, "sde_window_size"), ({"ode_solver": "rk4"}, "ode_solver")]
    for over, field in bad:
        with pytest.raises(EngineHTTPError) as e:
            client.rollout(**{**BASE, **over})
        assert e.value.status == 400 and e.value.error["field"] == field


# --- weight sync ---------------------------------------------------------------------------


def _perturbed_transformer(model_dir, subdir, scale, seed):
    model = WanTransformer3DModel.from_pretrained(model_dir / subdir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale * (p.abs().mean() + 1e-3))
    return model


def test_weight_update_changes_outputs_and_version(client, tiny_dir, alt_dir, weights_dir):
    work = weights_dir / "update"
    work.mkdir()
    before = client.rollout(**BASE)
    v0 = before["weight_version"]
    sum0 = client.weights_checksum()["sha256"]
    new = _perturbed_transformer(tiny_dir, "transformer", 0.5, 1)
    new.save_pretrained(work / "new")
    res = client.update_weights_from_disk(work / "new")
    assert res["weight_version"] == v0 + 1 and res["sha256"] == state_dict_checksum(new)
    ck = client.weights_checksum()
    assert ck["sha256"] == state_dict_checksum(new) != sum0 and ck["weight_version"] == v0 + 1
    after = client.rollout(**BASE)
    assert after["weight_version"] == v0 + 1 and after["samples"][0]["weight_version"] == v0 + 1
    assert not torch.equal(before["samples"][0]["output"], after["samples"][0]["output"])
    # A single safetensors file works too, and a bad update changes nothing.
    from common.diffusion.weights import save_weights

    orig = WanTransformer3DModel.from_pretrained(tiny_dir / "transformer")
    save_weights(orig, work / "orig.safetensors")
    wrong = WanTransformer3DModel.from_pretrained(alt_dir / "transformer")
    wrong.save_pretrained(work / "wrong")
    (work / "notes.txt").write_text("not weights")
    for path in (work / "missing", work / "wrong", work / "notes.txt"):
        with pytest.raises(EngineHTTPError) as e:
            client.update_weights_from_disk(path)
        assert e.value.status == 400
    assert client.weights_checksum()["sha256"] == state_dict_checksum(new)
    res = client.update_weights_from_disk(work / "orig.safetensors")
    assert res["weight_version"] == v0 + 2 and res["sha256"] == sum0
    restored = client.rollout(**BASE)
    assert torch.equal(restored["samples"][0]["output"], before["samples"][0]["output"])


def test_update_of_missing_expert_is_refused(client):
    with pytest.raises(EngineHTTPError) as e:
        client.update_weights_from_disk("/nonexistent", module="transformer_2")
    assert e.value.status == 400 and e.value.error["field"] == "module"


def test_a_partial_rollout_resumed_after_a_weight_update_tags_each_step_with_its_version(client, engine, tiny_dir,
                                                                                         weights_dir):
    """Aborted with return_partial: each step taken is tagged with the weight version it ran on; after an update
    the rollout resumes from its last latent with the remaining sigmas, each step tagged with the new version.
    Bad initial_latents are 400s naming the field, and the engine serves on."""
    from common.diffusion.weights import save_weights
    from common.protocol.http_tensors import body_to_tensor, tensor_to_body
    from test_cancel import _denoising, _post

    steps = 300
    sigmas = [1.0 - i / steps for i in range(steps)]
    body = {**BASE, "n": 2, "sigmas": sigmas, "num_inference_steps": steps, "return_partial": True}
    with ThreadPoolExecutor(1) as pool:
        partial = pool.submit(_post, engine, "/rollout/generate", body, "resume-1")
        _denoising(engine, "resume-1")
        assert client.abort_request("resume-1") == ["resume-1"]
        first = partial.result(timeout=60).json()
    k, v0 = first["steps_done"], first["weight_version"]
    assert first["partial"] is True and 0 < k < steps
    for sample in first["samples"]:
        assert sample["step_weight_versions"] == [v0] * k and "step_lora_versions" not in sample
    work = weights_dir / "resume"
    work.mkdir()
    save_weights(WanTransformer3DModel.from_pretrained(tiny_dir / "transformer"), work / "same.safetensors")
    v1 = client.update_weights_from_disk(work / "same.safetensors")["weight_version"]
    assert v1 == v0 + 1
    head = [{key: body_to_tensor(t) for key, t in sample["trajectory"].items()} for sample in first["samples"]]
    x_k = torch.stack([h["latents"][k] for h in head])  # each sample's last latent
    good = tensor_to_body(x_k, binary=False)
    nan = x_k.clone()
    nan[1, 0, 0, 0, 0] = float("nan")
    rest = {**BASE, "n": 2, "seed": 11, "sigmas": sigmas[k:], "num_inference_steps": steps - k}
    for bad in (tensor_to_body(x_k[:, :, :, :-1], False), tensor_to_body(x_k.to(torch.int32), False),
                tensor_to_body(nan, False), tensor_to_body(torch.cat([x_k, x_k[:1]]), False), [1.0, 2.0],
                {**good, "data": good["data"][:-8]}):
        r = _post(engine, "/rollout/generate", {**rest, "initial_latents": bad}, "resume-bad")
        assert r.status_code == 400 and r.json()["error"]["field"].startswith("initial_latents"), r.text
    resumed = client.rollout(**rest, initial_latents=x_k)  # the client's spelling: a torch tensor
    assert resumed["weight_version"] == v1 and "partial" not in resumed
    for i, sample in enumerate(resumed["samples"]):
        assert sample["step_weight_versions"] == [v1] * (steps - k)
        tail = sample["trajectory"]
        assert torch.equal(tail["latents"][0], x_k[i])
        # The remaining sigmas continue the aborted rollout's schedule (the scheduler shifts each one alone).
        assert abs(tail["sigmas"][0].item() - head[i]["sigmas"][k].item()) <= 1e-6
        assert tail["latents"].shape[0] == steps - k + 1 and torch.isfinite(sample["log_probs"]).all()


def test_a_pinned_reference_is_the_weights_pinned_before_an_update(client, tiny_dir, weights_dir):
    """kl_reference "pinned": a 400 naming it before any pin; after POST /pin_reference and a weight update from
    disk, a rollout's kl and ref_log_probs equal the trainer's recompute with one copy holding the new weights
    and another the pinned ones."""
    from common.diffusion.weights import load_into

    req = {**BASE, "return_kl": True, "kl_reference": "pinned"}
    with pytest.raises(EngineHTTPError) as e:
        client.rollout(**req)
    assert e.value.status == 400 and e.value.error["field"] == "kl_reference"
    work = weights_dir / "pinned"
    work.mkdir()
    models = {name: _perturbed_transformer(tiny_dir, "transformer", 0.3, seed) for name, seed in (("old", 11),
                                                                                                   ("new", 12))}
    models["old"].save_pretrained(work / "old")
    models["new"].save_pretrained(work / "new")
    old = client.update_weights_from_disk(work / "old")["weight_version"]
    pin = client.pin_reference()
    assert pin["weight_version"] == old and pin["experts"] == ["transformer"]
    new = client.update_weights_from_disk(work / "new")["weight_version"]
    sample = client.rollout(**req)["samples"][0]
    assert sample["weight_version"] == new == old + 1
    trainers = {}
    for name, model in models.items():
        trainers[name] = TrainerPolicy(tiny_dir)
        load_into(trainers[name].transformer, model.state_dict())
    trainer = trainers["new"]
    with torch.no_grad():
        kl, ref = trainer.kl(Trajectory.from_sample(sample), sample["log_prob_steps"], trainer.params(**req),
                             reference=trainers["old"])
    assert kl.shape == sample["kl"].shape == sample["log_probs"].shape
    assert (kl - sample["kl"]).abs().max() <= RECOMPUTE_TOL * max(1.0, kl.abs().max().item())
    assert (ref - sample["ref_log_probs"]).abs().max() <= RECOMPUTE_TOL * max(1.0, ref.abs().max().item())
    assert (sample["kl"] > 0).all()


# --- two experts -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe(engine_factory, weights_dir):
    from common.builtin import ensure_builtin

    d = ensure_builtin("tiny-moe")
    eng = engine_factory("tiny-moe", extra=["--weight-root", str(weights_dir)])
    with EngineClient(eng.url) as c:
        yield d, c


@pytest.mark.parametrize("over", [{}, {"guidance_scale_2": 2.0, "seed": 6}, {"guidance_scale": 1.0, "seed": 2}])
def test_two_experts_match_diffusers(moe, over):
    d, c = moe
    info = read_model(d)
    assert info.boundary_ratio is not None and info.has_transformer_2
    req = dict(prompt="a fox at dawn", negative_prompt="", seed=1, height=32, width=32, num_frames=5,
               num_inference_steps=info.defaults["num_inference_steps"], guidance_scale=5.0)
    req.update(over)
    got = c.generate(**req)["samples"][0]["output"]
    ref = diffusers_generate(d, **req)
    assert (got - ref).abs().max().item() <= 1e-4


def test_two_expert_rollout_recompute_and_separate_sync(moe, weights_dir):
    work = weights_dir / "moe"
    work.mkdir()
    d, c = moe
    policy = TrainerPolicy(d)
    req = {**BASE, "num_inference_steps": 6, "guidance_scale_2": 3.0}
    s = c.rollout(**req)["samples"][0]
    traj = Trajectory.from_sample(s)
    with torch.no_grad():
        again = policy.log_probs(traj, s["log_prob_steps"], policy.params(**req))
    assert (again - s["log_probs"]).abs().max().item() <= RECOMPUTE_TOL
    t1, t2 = c.weights_checksum("transformer")["sha256"], c.weights_checksum("transformer_2")["sha256"]
    assert t1 == state_dict_checksum(policy.experts["transformer"]) and t1 != t2
    new2 = _perturbed_transformer(d, "transformer_2", 0.5, 3)
    new2.save_pretrained(work / "t2")
    c.update_weights_from_disk(work / "t2", module="transformer_2")
    assert c.weights_checksum("transformer")["sha256"] == t1
    assert c.weights_checksum("transformer_2")["sha256"] == state_dict_checksum(new2)


# --- a configuration other than the default ----------------------------------------------


@pytest.mark.heavy  # a second Wan model's engine: tiny's rollouts are the default
def test_other_configuration_rollout_recompute(shared_engine, alt_dir):
    eng = shared_engine("tiny-alt")
    policy = TrainerPolicy(alt_dir)
    with EngineClient(eng.url) as c:
        for over in ({}, {"sde_type": "cps", "noise_level": 0.8}):
            req = {**BASE, **over, "height": 32, "width": 48, "num_frames": 9}
            s = c.rollout(**req)["samples"][0]
            assert _recompute_max_diff(policy, req, s) <= RECOMPUTE_TOL
            traj = Trajectory.from_sample(s)
            assert torch.allclose(traj.timesteps.double(), traj.sigmas[:-1].double() * 1000, atol=1e-3)
            ref = FlowMatchEulerDiscreteScheduler(shift=5.0)  # tiny-alt's flow_shift
            ref.set_timesteps(req["num_inference_steps"])
            assert torch.allclose(traj.sigmas, ref.sigmas.float())


# --- last: it kills the tiny engine's denoise worker ------------------------------------------


@pytest.mark.heavy  # it kills a launched engine's denoise worker: CI
def test_a_restarted_denoise_worker_gets_the_weight_updates_again(launched, tiny_dir, weights_dir):
    engine, client = launched, EngineClient(launched.url)
    work = weights_dir / "restart"
    work.mkdir()
    new = _perturbed_transformer(tiny_dir, "transformer", 0.3, 7)
    new.save_pretrained(work / "new")
    version = client.update_weights_from_disk(work / "new")["weight_version"]
    client.pin_reference()  # the router forgets it when the worker that held it dies
    before = client.rollout(**BASE)["samples"][0]
    pid = next(w["pid"] for w in client.health()["workers"] if w["role"] == "denoise")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        d = next(w for w in engine.http.get("/health").json()["workers"] if w["role"] == "denoise")
        if d["state"] == "ready" and d["pid"] not in (None, pid):
            break
        assert time.monotonic() < deadline, "the denoise worker was not restarted"
        time.sleep(0.1)
    ck = client.weights_checksum()
    assert ck["sha256"] == state_dict_checksum(new) and ck["weight_version"] == version
    after = client.rollout(**BASE)["samples"][0]
    assert after["weight_version"] == version and torch.equal(after["output"], before["output"])
    # It holds no pinned reference (pinned above): the router forgot the pin.
    with pytest.raises(EngineHTTPError) as e:
        client.rollout(**BASE, return_kl=True, kl_reference="pinned")
    assert e.value.status == 400 and e.value.error["field"] == "kl_reference"
