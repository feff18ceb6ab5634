"""The local engine (local_engine/: the stages and the router's core in this process) against the launched engine
(launch.py, its worker processes, ZeroMQ, HTTP) on the same requests: every answer equal bit for bit.

On ``tiny`` by default: serving (frames, latents), rollouts with a trajectory, SDE windows, groups that branch
from a shared prefix, a resumed rollout, KL against the adapter-free reference and a pinned one, LoRA adapters
(from a file and from memory), a weight push from memory, streaming, and a bad field's error body. Every
family's tiny built-in (the registry) with DISAGG_HEAVY=1 or in CI: serving and a rollout group.
"""

from __future__ import annotations

import pytest
import torch

import lora_fixtures as lf
from common.builtin import ensure_builtin
from common.families import read_model
from family_builtins import tiny_per_pipeline
from local_engine import LocalEngine
from router.client import EngineClient, EngineHTTPError

FLAGS = ("--max-batch-size", "8", "--weight-sync-from-memory")
BASE = dict(prompt="a heron in the reeds", negative_prompt="blurry", seed=40, num_inference_steps=4,
            guidance_scale=4.0, height=32, width=32, num_frames=5)
ROLLOUTS = {
    "group-kl": dict(n=3, return_trajectory=True, return_kl=True, noise_level=0.7),
    "window": dict(n=2, sde_step_indices=[1, 2], return_trajectory=True),
    "branching": dict(n=3, share_prefix=True, sde_step_indices=[2, 3], return_trajectory=True),
    "cps-serving-after": dict(sde_type="cps", sde_step_indices=[0], ode_solver="serving"),
}
# What differs between two runs of one request: when and how long, not what.
VOLATILE = {"timings", "peak_memory", "request_id"}


def same(a, b, where: str = "answer") -> None:
    """Equal bit for bit: tensors by ``torch.equal``, dicts and lists item by item (timings aside)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where}: differs by {(a.float() - b.float()).abs().max().item():.3g}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) - VOLATILE == set(b) - VOLATILE, (where, set(a) ^ set(b))
        for k in set(a) - VOLATILE:
            same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif where.endswith("_s") or where.endswith(".total_s"):
        return
    else:
        assert a == b, (where, a, b)


@pytest.fixture(scope="module")
def pair(engine_factory, lora_root, tiny_lora):
    """The same flags, launched and local, on ``tiny``; both with ``tiny_lora`` loaded as ``a``."""
    flags = [*FLAGS, "--weight-root", str(lora_root)]
    launched = EngineClient(engine_factory("tiny", extra=flags, launched=True).url)
    local = LocalEngine("tiny", *flags)
    for c in (launched, local):
        c.load_lora_adapter("a", str(tiny_lora.path))
    yield launched, local
    local.close()
    launched.close()


def both(pair, method: str, *args, **kwargs):
    launched, local = pair
    return getattr(launched, method)(*args, **kwargs), getattr(local, method)(*args, **kwargs)


@pytest.mark.parametrize("output_type", ["frames", "latent"])
def test_serving_is_the_launched_engines(pair, output_type):
    same(*both(pair, "generate", **BASE, n=2, output_type=output_type))
    same(*both(pair, "generate", **BASE, lora_name="a", output_type=output_type))


@pytest.mark.parametrize("case", list(ROLLOUTS))
def test_rollouts_are_the_launched_engines(pair, case):
    launched, local = both(pair, "rollout", **BASE, **ROLLOUTS[case], lora_name="a", output_type="latent")
    same(launched, local)
    assert "log_probs" in local["samples"][0]


def test_a_resumed_rollout_and_a_pinned_reference_are_the_launched_engines(pair):
    first = pair[1].rollout(**BASE, n=2, return_trajectory=True, output_type="latent")["samples"][0]
    resume = first["trajectory"]["latents"][None, 2]  # x_2 of sample 0, and the sigmas it has left
    rest = [float(s) for s in first["trajectory"]["sigmas"][2:-1]]
    same(*both(pair, "rollout", **{**BASE, "num_inference_steps": len(rest)}, initial_latents=resume, sigmas=rest,
               sigmas_as_given=True, return_trajectory=True, output_type="latent"))
    for c in pair:
        c.pin_reference()
    same(*both(pair, "rollout", **BASE, lora_name="a", return_kl=True, kl_reference="pinned",
               output_type="latent"))


def test_streaming_and_errors_are_the_launched_engines(pair):
    launched, local = (list(c.stream(**BASE, n=2, output_type="latent")) for c in pair)
    key = lambda item: item.get("index", 99)  # noqa: E731  (samples come as they are decoded)
    same(sorted(launched, key=key), sorted(local, key=key))
    errors = []
    for c in pair:
        with pytest.raises(EngineHTTPError) as refused:
            c.generate(**{**BASE, "height": 31})
        errors.append((refused.value.status, refused.value.error))
    assert errors[0] == errors[1] and errors[0][0] == 400 and errors[0][1]["field"] == "height"


def test_weights_and_adapters_from_memory_are_the_launched_engines(pair, tiny_dir):
    model = lf._load_transformer(tiny_dir, "transformer")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    pushed = both(pair, "update_weights_from_tensors", model.state_dict())
    assert pushed[0]["sha256"] == pushed[1]["sha256"] and pushed[1]["weight_version"] == pushed[0]["weight_version"]
    state, _ = lf.lora_state_dict(tiny_dir, 4, 8.0, lf.ATTN, seed=9)
    both(pair, "load_lora_adapter_from_tensors", "mem", state, rank=4, alpha=8.0)
    same(*both(pair, "rollout", **BASE, n=2, lora_name="mem", return_kl=True, output_type="latent"))
    same(*both(pair, "lora_adapters"))


@pytest.mark.heavy
@pytest.mark.parametrize("pipeline,model", sorted(tiny_per_pipeline().items()))
def test_every_family_is_the_launched_engines(pipeline, model, tmp_path):
    from conftest import Engine
    from test_rollout_answers import _image

    info = read_model(ensure_builtin(model))
    image = _image(info)
    fields = dict(prompt="a red fox", seed=7, num_inference_steps=3, output_type="latent",
                  **({} if image is None else {"image": image}))
    engine = Engine(tmp_path, model, "encoder=1,denoise=1,decode=1", list(FLAGS))  # stopped here: one at a time
    launched, local = EngineClient(engine.url), LocalEngine(model, *FLAGS)
    try:
        same(launched.generate(**fields), local.generate(**fields))
        same(launched.rollout(**fields, n=2, return_trajectory=True), local.rollout(**fields, n=2,
                                                                                     return_trajectory=True))
    finally:
        local.close()
        launched.close()
        engine.stop()
