"""LoRA adapters end to end: parity with diffusers' WanPipeline + load_lora_weights + set_adapters, mixed batches,
two experts, rollouts and the trainer's recompute, adapters from the trainer's memory, and refused input.

Three engines in process: ``tiny`` (a weight root, --max-loras 6, --max-lora-rank 16), ``moe`` (tiny-moe: two
experts) and ``keyed`` (tiny with API and admin keys, no weight root and two denoise workers); a launched one for
the restarted worker; tiny-alt's (other widths, heads and layers) starts for its heavy test alone. The adapters are written by peft's and diffusers'
own savers (tests/lora_fixtures.py).
"""

from __future__ import annotations

import math
import os
import signal
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import lora_fixtures as lf
from conftest import solo_then_concurrent
from common.diffusion.model_info import ModelInfo
from common.families import read_model
from router.client import EngineClient, EngineHTTPError

PARITY_TOL = 1e-4  # against diffusers, fp32
# Frames: the VAE amplifies the latents' rounding; the FFN adapter at scale 1.3 measured 1.1e-4 here (its
# latents stay within PARITY_TOL).
FRAMES_PARITY_TOL = 2e-4
BATCH_TOL = 1e-5  # a request in a mixed batch against the same request alone
MAX_LORAS = 6
MAX_RANK = 16
API_KEY = "api-" + uuid.uuid4().hex
ADMIN_KEY = "admin-" + uuid.uuid4().hex


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def _request(model_dir: Path, **over) -> dict:
    d = read_model(model_dir).defaults
    req = dict(prompt="a fox at dawn", negative_prompt="blurry", seed=1, height=d["height"], width=d["width"],
               num_frames=d["num_frames"], num_inference_steps=d["num_inference_steps"],
               guidance_scale=d["guidance_scale"])
    req.update(over)
    return req


def _lora_fields(name, scale) -> dict:
    if name is None:
        return {}
    return {"lora_name": name} if scale is None else {"lora_name": name, "lora_scale": scale}


def _sample(c: EngineClient, req: dict, name=None, scale=None, output_type="frames", rollout=False) -> dict:
    body = {**req, **_lora_fields(name, scale), "output_type": output_type}
    s = (c.rollout if rollout else c.generate)(**body)["samples"][0]
    assert s["lora_name"] == name, s.get("lora_name")
    assert (s["lora_version"] is None) == (name is None), s.get("lora_version")
    return s


def _output(c, req, name=None, scale=None, output_type="frames") -> torch.Tensor:
    return _sample(c, req, name, scale, output_type)["output"]


def _reference(model_dir, adapters, req, output_type) -> torch.Tensor:
    return lf.diffusers_lora_output(model_dir, adapters, **req, output_type="np" if output_type == "frames"
                                    else "latent")


def _listed(c: EngineClient) -> dict[str, dict]:
    got = c.lora_adapters()
    return {a["lora_name"]: a for a in (got["adapters"] if isinstance(got, dict) else got)}


def _rank_alpha(r: dict, rank: int, alpha: float) -> bool:
    """The answer's rank and alpha (or scale = alpha / rank, as the engine reports it)."""
    if r["rank"] != rank:
        return False
    if "alpha" in r:
        return math.isclose(r["alpha"], alpha)
    return math.isclose(r["scale"], alpha / rank)


def _error(call) -> EngineHTTPError:
    with pytest.raises(EngineHTTPError) as e:
        call()
    return e.value


def _mentions(err: EngineHTTPError, *words: str) -> bool:
    msg = (err.error.get("message") or "").lower()
    return any(w.lower() in msg for w in words)


# --- engines and adapters -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(engine_factory, lora_root, made):
    """The three engines, in process, started once the adapters are written (a model loaded on another thread of
    this process would race accelerate's process-wide meta-device patch)."""
    root = ["--weight-root", str(lora_root)]
    one = "encoder=1,denoise=1,decode=1"
    return {
        "tiny": engine_factory("tiny", one, [*root, "--max-loras", str(MAX_LORAS), "--max-lora-rank", str(MAX_RANK)]),
        "moe": engine_factory("tiny-moe", one, root),
        "keyed": engine_factory("tiny", "encoder=1,denoise=2,decode=1",
                                ["--api-key", API_KEY, "--admin-key", ADMIN_KEY]),
    }


@pytest.fixture(scope="module")
def client(engines):
    with EngineClient(engines["tiny"].url) as c:
        yield c


@pytest.fixture(scope="module")
def made(tiny_dir, alt_dir, moe_dir, lora_root, tiny_lora, tmp_path_factory) -> dict[str, lf.Adapter]:
    """Every adapter these tests load; all below the engines' weight root except ``outside``."""
    d = lora_root / "test_lora"
    return {
        "a": tiny_lora,  # diffusers with metadata: rank 4, alpha 8 (scale 2), attention projections
        "a0": lf.make_diffusers_lora(tiny_dir, d / "a0", 4, 8, lf.ATTN, seed=1, with_metadata=False),  # alpha = r
        "b": lf.make_diffusers_lora(tiny_dir, d / "b", 8, 4, lf.FFN + ["attn2.to_k"], seed=2),
        "p": lf.make_peft_lora(tiny_dir, d / "p", 6, 12, ["to_q", "to_v", "ffn.net.2"], seed=3),
        "r1": lf.make_diffusers_lora(tiny_dir, d / "r1", 2, 2, ["to_out.0", "ffn.net.0.proj"], seed=4),
        "r2": lf.make_diffusers_lora(tiny_dir, d / "r2", 2, 3, ["to_out.0", "ffn.net.0.proj"], seed=5),
        "big": lf.make_diffusers_lora(tiny_dir, d / "big", 2 * MAX_RANK, 2 * MAX_RANK, ["to_q"], seed=6),
        # tiny-alt: other widths/heads/layers; mixed ranks and alphas (rank_pattern, alpha_pattern), modules
        # outside the blocks, rank 3 and 5.
        "x": lf.make_diffusers_lora(alt_dir, d / "x", 3, 5, ["attn1.to_k", "attn1.to_v", "attn2.to_out.0",
                                                             "ffn.net.0.proj", "proj_out", "text_embedder.linear_2"],
                                    seed=7, rank_pattern={"ffn.net.0.proj": 5}, alpha_pattern={"proj_out": 2.0}),
        "y": lf.make_peft_lora(alt_dir, d / "y", 5, 3, ["to_q", "ffn.net.2", "time_embedder.linear_1"], seed=8,
                               prefixed=False),
        # tiny-moe: a part per expert in one file (plus the second part alone, for load_into_transformer_2)
        "e": lf.make_two_expert_lora(moe_dir, d / "e", {"transformer": (4, 4, lf.ATTN),
                                                        "transformer_2": (8, 16, lf.FFN + ["attn2.to_v"])}, seed=9),
        "outside": lf.make_diffusers_lora(tiny_dir, tmp_path_factory.mktemp("outside") / "o", 4, 8, lf.ATTN, seed=1),
    }


@pytest.fixture(scope="module")
def loaded(client, made) -> dict[str, dict]:
    """a, a0, b and p loaded into the tiny engine; their load answers."""
    return {name: client.load_lora_adapter(name, str(made[name].path)) for name in ("a", "a0", "b", "p")}


# --- the reference itself -----------------------------------------------------------------------------------


def test_reference_adapters_behave_as_diffusers_defines_them(tiny_dir, tiny_lora, lora_root):
    """No engine: the adapters change diffusers' output; scale 0 is the base model; a file without metadata is
    read with alpha = rank (so at scale alpha/rank it equals the file with metadata at scale 1)."""
    req = _request(tiny_dir, seed=11)
    no_meta = lf.make_diffusers_lora(tiny_dir, lora_root / "reference-no-meta", 4, 8, lf.ATTN, seed=1,
                                     with_metadata=False)
    base = _reference(tiny_dir, [], req, "latent")
    with_a = _reference(tiny_dir, [(tiny_lora.path, "a", 1.0, False)], req, "latent")
    assert _max_diff(with_a, base) > 1e-1
    assert torch.equal(_reference(tiny_dir, [(tiny_lora.path, "a", 0.0, False)], req, "latent"), base)
    assert _max_diff(_reference(tiny_dir, [(no_meta.path, "a0", 2.0, False)], req, "latent"), with_a) <= 1e-6
    assert _max_diff(_reference(tiny_dir, [(no_meta.path, "a0", 1.0, False)], req, "latent"), with_a) > 1e-2
    assert torch.equal(_reference(tiny_dir, [], req, "latent"), base)  # the adapters were unloaded again


# --- loading and parity -------------------------------------------------------------------------------------


def test_load_answers_and_list(client, loaded, made):
    expect = {"a": (4, 8.0), "a0": (4, 4.0), "b": (8, 4.0), "p": (6, 12.0)}
    for name, r in loaded.items():
        rank, alpha = expect[name]
        assert r["lora_name"] == name and isinstance(r["lora_version"], int)
        assert _rank_alpha(r, rank, alpha), r
        assert r["experts"] == ["transformer"], r
        assert r["target_modules"], r
        suffixes = tuple(made[name].target_modules)
        assert all(str(m).endswith(suffixes) for m in r["target_modules"]), r["target_modules"]
        assert len(r["sha256"]) == 64 and int(r["sha256"], 16) >= 0
        assert len(r["workers"]) == 1 and r["seconds"] >= 0
    assert loaded["a"]["sha256"] != loaded["b"]["sha256"]
    listed = _listed(client)
    assert set(listed) >= set(loaded)
    for name, r in loaded.items():
        for k in ("lora_version", "rank", "alpha", "scale", "target_modules", "experts", "sha256"):
            assert listed[name].get(k) == r.get(k), (name, k)


PARITY = [
    ("a", 1.0, {}),
    ("a", 0.6, {"seed": 2}),
    ("a0", 1.0, {"seed": 3}),  # no metadata: alpha = rank, as diffusers assumes
    ("b", 1.3, {"seed": 4, "num_inference_steps": 5}),  # other modules, rank 8, alpha < rank
    ("p", None, {"seed": 5}),  # peft folder; lora_scale left at its default, 1.0
    ("p", 0.8, {"seed": 6, "guidance_scale": 1.0}),  # CFG off: one pass
]


@pytest.mark.parametrize("name,scale,over", PARITY,
                         ids=["meta-s1", "meta-s0.6", "no-metadata", "ffn-rank8-s1.3", "peft", "peft-no-cfg"])
def test_adapter_matches_diffusers(tiny_dir, client, loaded, made, name, scale, over):
    req = _request(tiny_dir, **over)
    path = lf.diffusers_twin(made["p"], made["p"].path.parent / "p-twin") if name == "p" else made[name].path
    adapters = [(path, name, 1.0 if scale is None else scale, False)]
    for output_type in ("frames", "latent"):
        got = _output(client, req, name, scale, output_type)
        tol = FRAMES_PARITY_TOL if output_type == "frames" else PARITY_TOL
        assert _max_diff(got, _reference(tiny_dir, adapters, req, output_type)) <= tol, output_type
        assert _max_diff(got, _output(client, req, None, None, output_type)) > 1e-2  # the adapter matters


def test_rslora_and_half_precision_files_match_diffusers(tiny_dir, client, loaded, lora_root):
    """rsLoRA (scaling alpha / sqrt(r)) in the metadata, and factors stored in float16."""
    import peft
    from diffusers import WanPipeline

    sd, _ = lf.lora_state_dict(tiny_dir, 4, 8, lf.ATTN, seed=13)
    files = {"rs": (sd, peft.LoraConfig(r=4, lora_alpha=8, target_modules=lf.ATTN, use_rslora=True)),
             "fp16": ({k: v.half() for k, v in sd.items()}, lf.lora_config(4, 8, lf.ATTN))}
    req = _request(tiny_dir, seed=14)
    for name, (tensors, config) in files.items():
        path = lora_root / "test_lora" / name
        WanPipeline.save_lora_weights(path, transformer_lora_layers=tensors,
                                      transformer_lora_adapter_metadata=config.to_dict())
        client.load_lora_adapter(name, str(path))
        try:
            got = _output(client, req, name, 0.9, "latent")
            assert _max_diff(got, _reference(tiny_dir, [(path, name, 0.9, False)], req, "latent")) <= PARITY_TOL
        finally:
            client.unload_lora_adapter(name)


def test_scale_zero_is_the_base_model(tiny_dir, client, loaded, made):
    req = _request(tiny_dir, seed=7)
    zero = _output(client, req, "a", 0.0, "latent")
    assert _max_diff(zero, _output(client, req, None, None, "latent")) <= BATCH_TOL
    assert _max_diff(zero, _reference(tiny_dir, [], req, "latent")) <= PARITY_TOL
    assert _max_diff(zero, _reference(tiny_dir, [(made["a"].path, "a", 0.0, False)], req, "latent")) <= PARITY_TOL


@pytest.fixture(scope="module")
def alt_engine(engine_factory, lora_root):
    return engine_factory("tiny-alt", extra=["--weight-root", str(lora_root)])


@pytest.mark.heavy  # an engine of a second Wan model (~20 s): tiny's adapters match diffusers by default
def test_other_configuration_matches_diffusers(alt_dir, alt_engine, made):
    """tiny-alt (other widths, heads, layers), other target modules (outside the blocks too), ranks 3 and 5, a
    rank_pattern and an alpha_pattern, and an unprefixed peft folder."""
    with EngineClient(alt_engine.url) as c:
        r = c.load_lora_adapter("x", str(made["x"].path))
        assert r["rank"] in (3, 5) and r["experts"] == ["transformer"]  # r 3, one module of rank 5
        assert c.load_lora_adapter("y", str(made["y"].path))["rank"] == 5
        y_ref = lf.diffusers_twin(made["y"], made["y"].path.parent / "y-twin")
        for name, path, scale, over in (("x", made["x"].path, 1.0, {}), ("x", made["x"].path, 0.7, {"seed": 2}),
                                        ("y", y_ref, 1.0, {"seed": 3})):
            req = _request(alt_dir, **over)
            for output_type in ("frames", "latent"):
                got = _output(c, req, name, scale, output_type)
                ref = _reference(alt_dir, [(path, name, scale, False)], req, output_type)
                assert _max_diff(got, ref) <= PARITY_TOL, (name, scale, output_type)
            assert _max_diff(got, _output(c, req, None, None, "latent")) > 1e-2


# --- batching -----------------------------------------------------------------------------------------------


def _run_solo_and_mixed(c: EngineClient, reqs):
    return solo_then_concurrent(c, reqs)


def _assert_mixed_equal_solo(reqs, solo, mixed):
    for (_, body), a, b in zip(reqs, solo, mixed):
        assert a["batch"] == 1
        assert a["lora_name"] == b["lora_name"] == body.get("lora_name")
        assert a["lora_version"] == b["lora_version"]
        assert _max_diff(a["output"], b["output"]) <= BATCH_TOL
        if "log_probs" in a:
            assert a["log_prob_steps"].tolist() == b["log_prob_steps"].tolist()
            assert _max_diff(a["log_probs"], b["log_probs"]) <= BATCH_TOL


def _shared_across_adapters(reqs, mixed) -> bool:
    """True when some sample shared a forward with more requests than carry its adapter: then requests with
    different adapters (or none) went through one forward."""
    count = Counter(body.get("lora_name") for _, body in reqs)
    return any(m["batch"] > count[body.get("lora_name")] for (_, body), m in zip(reqs, mixed))


def test_mixed_adapters_share_forwards_and_equal_solo_runs(client, loaded):
    plan = [("a", 1.0), ("b", None), (None, None), ("a", 0.5), ("p", 1.0), ("b", 0.7), (None, None), ("a0", 1.2)]
    reqs = []
    for i, (name, scale) in enumerate(plan):
        body = dict(prompt=f"mix {i % 3}", seed=60 + i, num_inference_steps=3 + i % 5,
                    guidance_scale=(1.0, 4.0, 6.0)[i % 3], output_type="latent", **_lora_fields(name, scale))
        if i % 2:
            body.update(sde_type=("sde", "cps")[i % 4 // 2], noise_level=0.7, return_trajectory=True)
            reqs.append(("/rollout/generate", body))
        else:
            reqs.append(("/generate", body))
    solo, mixed = _run_solo_and_mixed(client, reqs)
    assert max(m["batch"] for m in mixed) >= 3
    assert _shared_across_adapters(reqs, mixed), [m["batch"] for m in mixed]
    _assert_mixed_equal_solo(reqs, solo, mixed)


# --- two experts --------------------------------------------------------------------------------------------


def test_two_experts_match_diffusers(moe_dir, engines, made):
    e = made["e"]
    with EngineClient(engines["moe"].url) as c:
        r = c.load_lora_adapter("e", str(e.path))
        assert sorted(r["experts"]) == ["transformer", "transformer_2"], r
        r2 = c.load_lora_adapter("e2", str(e.expert_2_path), load_into_transformer_2=True)
        assert r2["experts"] == ["transformer_2"] and r2["rank"] == 8, r2
        both = [(e.path, "e", None, False), (e.expert_2_path, "e", None, True)]
        for name, adapters, scale, over in (("e", both, 1.0, {}), ("e", both, 0.6, {"seed": 2}),
                                            ("e2", [(e.expert_2_path, "e2", None, True)], 1.0, {"seed": 3})):
            req = _request(moe_dir, **over)
            adapters = [(p, n, scale, into_2) for p, n, _, into_2 in adapters]
            for output_type in ("frames", "latent"):
                got = _output(c, req, name, scale, output_type)
                assert _max_diff(got, _reference(moe_dir, adapters, req, output_type)) <= PARITY_TOL, (name, scale)
        # Each expert's part is applied: with only the first part the output differs.
        req = _request(moe_dir)
        first_only = _reference(moe_dir, [(e.path, "e", 1.0, False)], req, "latent")
        assert _max_diff(_output(c, req, "e", 1.0, "latent"), first_only) > 1e-2

        plan = [("e", None), ("e2", 0.8), (None, None), ("e", 0.6), ("e2", None), (None, None)]
        reqs = [("/generate", dict(prompt=f"moe {i % 2}", seed=80 + i, num_inference_steps=4 + i % 3,
                                   output_type="latent", **_lora_fields(n, s))) for i, (n, s) in enumerate(plan)]
        solo, mixed = _run_solo_and_mixed(c, reqs)
        assert max(m["batch"] for m in mixed) > 1
        _assert_mixed_equal_solo(reqs, solo, mixed)


# --- rollouts -----------------------------------------------------------------------------------------------


ROLLOUT = dict(prompt="a red kite over the sea", negative_prompt="blurry", seed=3, num_inference_steps=6,
               guidance_scale=4.0, return_trajectory=True)


def _trainer_with_adapter(tiny_dir, adapter: lf.Adapter, name: str, scale: float):
    """The trainer's copy of the policy with the same adapter put in by peft (scale via set_adapters)."""
    import peft
    from rl import TrainerPolicy

    policy = TrainerPolicy(tiny_dir)
    model = policy.transformer
    model.add_adapter(lf.lora_config(adapter.rank, adapter.alpha, adapter.target_modules), adapter_name=name)
    result = peft.set_peft_model_state_dict(model, adapter.state_dict, adapter_name=name)
    assert not [k for k in result.unexpected_keys if "lora" in k]
    model.set_adapters([name], [scale])
    return policy


def test_rollout_with_adapter_replace_and_unload(tiny_dir, client, made):
    from rl import Trajectory

    r = client.load_lora_adapter("r", str(made["r1"].path))
    v1 = r["lora_version"]
    try:
        s = _sample(client, ROLLOUT, "r", 0.9, "latent", rollout=True)
        T = ROLLOUT["num_inference_steps"]
        assert s["lora_version"] == v1
        assert s["log_probs"].shape == (T,) and torch.isfinite(s["log_probs"]).all()
        base = _sample(client, ROLLOUT, None, None, "latent", rollout=True)
        # Same seed, same noise: the adapter changes the trajectory (a sample's own log-probs are the noise's).
        assert _max_diff(s["trajectory"]["latents"], base["trajectory"]["latents"]) > 1e-2

        # The trainer recomputes the same log-probs with peft's LoRA layers on its own copy, and other ones
        # without them.
        policy = _trainer_with_adapter(tiny_dir, made["r1"], "r", 0.9)
        args = (Trajectory.from_sample(s), s["log_prob_steps"], policy.params(**ROLLOUT))
        with torch.no_grad():
            again = policy.log_probs(*args)
            policy.transformer.disable_adapters()
            without = policy.log_probs(*args)
        assert _max_diff(again, s["log_probs"]) <= BATCH_TOL
        assert _max_diff(without, s["log_probs"]) > 1e-2

        # Replacing the adapter bumps its version; requests see the new one.
        r2 = client.load_lora_adapter("r", str(made["r2"].path))
        assert r2["lora_version"] == v1 + 1 and r2["sha256"] != r["sha256"]
        assert _rank_alpha(r2, 2, 3.0), r2
        assert _listed(client)["r"]["lora_version"] == v1 + 1
        s2 = _sample(client, ROLLOUT, "r", 0.9, "latent", rollout=True)
        assert s2["lora_version"] == v1 + 1
        assert _max_diff(s2["trajectory"]["latents"], s["trajectory"]["latents"]) > 1e-3
    finally:
        client.unload_lora_adapter("r")
    assert "r" not in _listed(client)
    for call in (lambda: client.rollout(**{**ROLLOUT, "lora_name": "r"}),
                 lambda: client.generate(ROLLOUT["prompt"], seed=3, lora_name="r")):
        err = _error(call)
        assert err.status == 400 and err.error.get("field") == "lora_name", err.error


def test_rollout_return_kl_answers_what_the_trainer_recomputes(tiny_dir, client, loaded, made):
    """``return_kl`` through the engine: ``kl`` and ``ref_log_probs`` per SDE step beside ``log_probs``, the
    reference rows counted in ``transformer_passes``, the trainer's recompute (its adapter off) the same."""
    from rl import Trajectory

    req = {**ROLLOUT, "return_kl": True, "sde_step_indices": [0, 2, 3]}
    s = _sample(client, req, "a", 0.9, "latent", rollout=True)
    assert s["kl"].shape == s["ref_log_probs"].shape == s["log_probs"].shape == (3,)
    assert s["transformer_passes"] == 2 * (ROLLOUT["num_inference_steps"] + 3)
    policy = _trainer_with_adapter(tiny_dir, made["a"], "a", 0.9)
    with torch.no_grad():
        kl, ref = policy.kl(Trajectory.from_sample(s), s["log_prob_steps"], policy.params(**req))
    assert _max_diff(kl, s["kl"]) <= BATCH_TOL and _max_diff(ref, s["ref_log_probs"]) <= BATCH_TOL
    assert (s["kl"] > 0).all()


def test_replacing_an_adapter_in_flight_keeps_each_request_on_one_version(client, made):
    """A request runs from its first step to its last on the adapter version it reports: one being denoised
    when its adapter is replaced finishes on the old version, one sent after runs on the new one."""
    long = dict(prompt="a long one", seed=5, height=64, width=64, num_frames=9, num_inference_steps=250,
                output_type="latent")  # about 1.3 s of denoising here; encoding takes a few ms
    v1 = client.load_lora_adapter("v", str(made["r1"].path))["lora_version"]
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(_sample, client, long, "v", None, "latent")
            time.sleep(0.4)
            v2 = client.load_lora_adapter("v", str(made["r2"].path))["lora_version"]
            second = pool.submit(_sample, client, {**long, "seed": 6}, "v", None, "latent")
            first, second = first.result(), second.result()
        assert v2 == v1 + 1
        assert first["lora_version"] == v1 and second["lora_version"] == v2
        assert _max_diff(second["output"], _output(client, {**long, "seed": 6}, "v", None, "latent")) <= BATCH_TOL
        client.load_lora_adapter("v", str(made["r1"].path))  # r1 again, as version v1 + 2
        solo = _sample(client, long, "v", None, "latent")
        assert solo["lora_version"] == v1 + 2
        assert _max_diff(first["output"], solo["output"]) <= BATCH_TOL
    finally:
        client.unload_lora_adapter("v")


def test_unknown_adapter_is_refused(client):
    for call in (client.generate, client.rollout):
        err = _error(lambda: call("a fox", lora_name="no-such-adapter"))
        assert err.status == 400 and err.error.get("field") == "lora_name", err.error
        assert _mentions(err, "no-such-adapter"), err.error
    err = _error(lambda: client.unload_lora_adapter("no-such-adapter"))
    assert err.status in (400, 404) and _mentions(err, "no-such-adapter"), err.error


# --- from the trainer's memory ------------------------------------------------------------------------------


def test_adapter_from_memory_equals_from_disk(tiny_dir, client, engines, loaded, made):
    a = made["a"]
    req = _request(tiny_dir, seed=8)
    disk = _output(client, req, "a", 0.7, "latent")
    try:
        r = client.load_lora_adapter_from_tensors("a_mem", a.state_dict, rank=4, alpha=8)
        assert _rank_alpha(r, 4, 8.0) and r["experts"] == ["transformer"], r
        assert torch.equal(_output(client, req, "a_mem", 0.7, "latent"), disk)
        # Without alpha: alpha = rank, as the file without metadata.
        client.load_lora_adapter_from_tensors("a0_mem", a.state_dict, rank=4)
        assert torch.equal(_output(client, req, "a0_mem", 0.7, "latent"), _output(client, req, "a0", 0.7, "latent"))
    finally:
        for name in ("a_mem", "a0_mem"):
            if name in _listed(client):
                client.unload_lora_adapter(name)

    # An engine without a weight root takes adapters from memory (with the admin key) into each of its denoise
    # workers, and both serve the same.
    with EngineClient(engines["keyed"].url, api_key=ADMIN_KEY) as admin, \
            EngineClient(engines["keyed"].url, api_key=API_KEY) as user:
        r = admin.load_lora_adapter_from_tensors("a", a.state_dict, rank=4, alpha=8)
        assert sorted(w["index"] for w in r["workers"]) == [0, 1]
        assert {w["sha256"] for w in r["workers"]} == {r["sha256"]}
        routes = set()
        for _ in range(4):  # one after another: the routing alternates between the idle workers
            s = _sample(user, req, "a", 0.7, "latent")
            routes.add(s["route"]["denoise"])
            assert _max_diff(s["output"], disk) <= 1e-6
        assert routes == {0, 1}
        assert _max_diff(disk, _reference(tiny_dir, [(a.path, "a", 0.7, False)], req, "latent")) <= PARITY_TOL


def test_keys_and_roots_guard_adapter_loads(engines, made):
    eng = engines["keyed"]
    a = made["a"]
    with EngineClient(eng.url, api_key=ADMIN_KEY) as admin, EngineClient(eng.url, api_key=API_KEY) as user, \
            EngineClient(eng.url) as anonymous:
        before = _listed(user)
        # No weight root: loading from disk is off (403), even with the admin key.
        err = _error(lambda: admin.load_lora_adapter("d", str(a.path)))
        assert err.status == 403 and err.error.get("type") == "forbidden", err.error
        assert _mentions(err, "weight-root", "weight root"), err.error
        # The API key alone may not change adapters (403); no key at all is 401.
        for c, status in ((user, 403), (anonymous, 401)):
            for call in (lambda: c.load_lora_adapter("d", str(a.path)),
                         lambda: c.load_lora_adapter_from_tensors("d", a.state_dict, rank=4),
                         lambda: c.unload_lora_adapter("a")):
                err = _error(call)
                assert err.status == status, (status, err.error)
        assert _listed(user) == before


# --- refused input ------------------------------------------------------------------------------------------


def _sd(made) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in made["a"].state_dict.items()}


def _pair(module: str, a_shape, b_shape) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"{module}.lora_A.weight": torch.randn(a_shape, generator=g),
            f"{module}.lora_B.weight": torch.randn(b_shape, generator=g)}


def _file(root: Path, case: str, sd: dict, prefix="transformer.", metadata=None) -> Path:
    return lf.write_raw_lora(root / "bad" / case, {prefix + k: v for k, v in sd.items()}, metadata)


Q = "blocks.0.attn1.to_q"


def _with(made, extra=None, **changes):
    sd = _sd(made)
    sd.update(extra or {})
    for key, fn in changes.items():
        sd[key.replace("__", ".")] = fn(sd[key.replace("__", ".")])
    return sd


def _nan(t):
    t = t.clone()
    t.view(-1)[3] = float("nan")
    return t


def _inf(t):
    t = t.clone()
    t.view(-1)[0] = float("-inf")
    return t


def _bad_cases(made, root: Path, outside: Path):
    """(id, how: "file" path [+ kwargs] | "tensors" state dict rank alpha, words one of which the message has)."""
    A = made["a"].state_dict[f"{Q}.lora_A.weight"]
    r, d_in = A.shape
    d_out = made["a"].state_dict[f"{Q}.lora_B.weight"].shape[0]
    link = root / "bad" / "link-outside"
    if not link.exists():
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(outside, target_is_directory=True)
    return [
        ("unknown-module", "file", _file(root, "unknown", _with(made, _pair("blocks.0.attn1.to_nope", (r, d_in),
                                                                            (d_out, r)))), {}, ["to_nope"]),
        ("missing-block", "file", _file(root, "block", _with(made, _pair("blocks.9.attn1.to_q", (r, d_in),
                                                                          (d_out, r)))), {}, ["blocks.9"]),
        ("conv-not-linear", "file", _file(root, "conv", _with(made, _pair("patch_embedding", (r, d_in),
                                                                           (d_out, r)))), {}, ["patch_embedding"]),
        ("container-not-linear", "file", _file(root, "container", _with(made, _pair("blocks.0.ffn", (r, d_in),
                                                                                     (d_out, r)))), {},
         ["blocks.0.ffn"]),
        ("lora_A-in-features", "file", _file(root, "a-in", _with(made, _pair(Q, (r, d_in + 1), (d_out, r)))), {},
         [str(d_in + 1)]),
        ("lora_B-out-features", "file", _file(root, "b-out", _with(made, _pair(Q, (r, d_in), (d_out + 1, r)))), {},
         [str(d_out + 1)]),
        ("ranks-disagree", "file", _file(root, "ranks", _with(made, _pair(Q, (r, d_in), (d_out, r - 1)))), {},
         [Q]),
        ("rank-above-max", "file", made["big"].path, {}, [str(2 * MAX_RANK), str(MAX_RANK)]),
        ("nan", "file", _file(root, "nan", _with(made, **{f"{Q}__lora_B__weight": _nan})), {},
         ["finite", "nan"]),
        ("inf", "file", _file(root, "inf", _with(made, **{f"{Q}__lora_A__weight": _inf})), {},
         ["finite", "inf"]),
        ("metadata-rank-disagrees", "file", _file(root, "meta-rank", _sd(made),
                                                  metadata={"transformer.r": 8, "transformer.lora_alpha": 8}), {},
         ["rank"]),
        ("dora", "file", _file(root, "dora", _sd(made), metadata={"transformer.r": 4, "transformer.lora_alpha": 8,
                                                                  "transformer.use_dora": True}), {}, ["dora"]),
        ("not-a-lora-key", "file", _file(root, "base-key", _with(made, {f"{Q}.weight": torch.zeros(d_out, d_in)})),
         {}, [f"{Q}.weight"]),
        ("second-expert-on-one-expert-model", "file", _file(root, "t2", _sd(made), prefix="transformer_2."), {},
         ["transformer_2"]),
        ("load_into_transformer_2-on-one-expert-model", "file", made["a"].path, {"load_into_transformer_2": True},
         ["transformer_2"]),
        ("outside-the-root", "file", made["outside"].path, {}, ["outside"]),
        ("symlink-out-of-the-root", "file", link, {}, ["outside"]),
        ("missing-path", "file", root / "bad" / "does-not-exist", {}, ["exist", "not found", "no such"]),
        ("tensors-nan", "tensors", _with(made, **{f"{Q}__lora_B__weight": _nan}), {"rank": 4}, ["finite", "nan"]),
        ("tensors-rank-disagrees", "tensors", _sd(made), {"rank": 8}, ["rank"]),
        ("tensors-unknown-module", "tensors", _with(made, _pair("blocks.1.attn2.to_nope", (r, d_in), (d_out, r))),
         {"rank": 4}, ["to_nope"]),
        ("tensors-rank-above-max", "tensors",
         _pair(Q, (2 * MAX_RANK, d_in), (d_out, 2 * MAX_RANK)), {"rank": 2 * MAX_RANK},
         [str(2 * MAX_RANK), str(MAX_RANK)]),
    ]


BAD_IDS = ["unknown-module", "missing-block", "conv-not-linear", "container-not-linear", "lora_A-in-features",
           "lora_B-out-features", "ranks-disagree", "rank-above-max", "nan", "inf", "metadata-rank-disagrees", "dora",
           "not-a-lora-key", "second-expert-on-one-expert-model", "load_into_transformer_2-on-one-expert-model",
           "outside-the-root", "symlink-out-of-the-root", "missing-path", "tensors-nan", "tensors-rank-disagrees",
           "tensors-unknown-module", "tensors-rank-above-max"]


@pytest.fixture(scope="module")
def bad_cases(made, lora_root):
    cases = {c[0]: c[1:] for c in _bad_cases(made, lora_root, made["outside"].path)}
    assert list(cases) == BAD_IDS
    return cases


@pytest.mark.parametrize("case", BAD_IDS)
def test_bad_adapter_is_refused_and_changes_nothing(tiny_dir, client, loaded, bad_cases, case):
    how, what, kwargs, words = bad_cases[case]
    req = _request(tiny_dir, seed=9)
    before, out_before = _listed(client), _output(client, req, "a", None, "latent")
    # Half the attempts would replace the loaded adapter "a", half would add a new one.
    name = "a" if BAD_IDS.index(case) % 2 == 0 else "bad"
    if how == "file":
        err = _error(lambda: client.load_lora_adapter(name, str(what), **kwargs))
    else:
        err = _error(lambda: client.load_lora_adapter_from_tensors(name, what, **kwargs))
    assert err.status == 400, err.error
    assert _mentions(err, *words), (words, err.error)
    assert _listed(client) == before
    assert torch.equal(_output(client, req, "a", None, "latent"), out_before)


def test_more_adapters_than_max_loras_are_refused(tiny_dir, client, loaded, made):
    before = _listed(client)
    req = _request(tiny_dir, seed=10)
    out_before = _output(client, req, "a", None, "latent")
    fillers = [f"fill{i}" for i in range(MAX_LORAS - len(before))]
    try:
        for name in fillers:
            client.load_lora_adapter(name, str(made["r1"].path))
        assert len(_listed(client)) == MAX_LORAS
        full = _listed(client)
        for call in (lambda: client.load_lora_adapter("one-too-many", str(made["r1"].path)),
                     lambda: client.load_lora_adapter_from_tensors("one-too-many", made["a"].state_dict, rank=4)):
            err = _error(call)
            assert err.status == 400 and _mentions(err, str(MAX_LORAS), "max-loras"), err.error
            assert _listed(client) == full
        # Replacing one that is loaded does not add one: allowed at the limit.
        if fillers:
            again = client.load_lora_adapter(fillers[0], str(made["r2"].path))
            assert again["lora_version"] == full[fillers[0]]["lora_version"] + 1
    finally:
        for name in fillers:
            if name in _listed(client):
                client.unload_lora_adapter(name)
    assert _listed(client) == before
    assert torch.equal(_output(client, req, "a", None, "latent"), out_before)


# --- worker restarts (a launched engine of its own) -------------------------------------------------------------


@pytest.mark.heavy  # it kills a launched engine's denoise worker: CI
def test_a_restarted_denoise_worker_serves_the_loaded_adapters(tiny_dir, engine_factory, lora_root, made):
    eng = engine_factory("tiny", extra=["--weight-root", str(lora_root)], launched=True)
    client = EngineClient(eng.url)
    for name in ("a", "b"):
        client.load_lora_adapter(name, str(made[name].path))
    req = _request(tiny_dir, seed=12)
    before, listed = _output(client, req, "a", 0.8, "latent"), _listed(client)
    pid = next(w["pid"] for w in eng.http.get("/health").json()["workers"] if w["role"] == "denoise")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        d = next(w for w in eng.http.get("/health").json()["workers"] if w["role"] == "denoise")
        if d["state"] == "ready" and d["pid"] not in (None, pid):
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the denoise worker was not restarted")
    assert _listed(client) == listed
    assert torch.equal(_output(client, req, "a", 0.8, "latent"), before)
