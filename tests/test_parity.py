"""End to end: the launched engine's outputs equal diffusers' WanPipeline on the same directory."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from common.diffusion.model_info import ModelInfo
from common.families import read_model
from conftest import diffusers_generate
from router.client import EngineClient

TOL = 1e-4
# Concurrent requests share batched forwards and one VAE decode; float32 matmuls over other batch shapes round
# apart, and the decoder's convolutions widen that on the frames.
BATCHED_FRAMES_TOL = 2e-4


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def _request(info: ModelInfo, **over):
    d = info.defaults
    req = dict(prompt="a fox at dawn", negative_prompt="blurry", seed=1, height=d["height"], width=d["width"],
               num_frames=d["num_frames"], num_inference_steps=d["num_inference_steps"],
               guidance_scale=d["guidance_scale"])
    req.update(over)
    return req


@pytest.fixture(scope="module")
def tiny_engine(shared_engine):
    return shared_engine("tiny")


@pytest.fixture(scope="module")
def tiny_client(tiny_engine):
    with EngineClient(tiny_engine.url) as c:
        yield c


@pytest.mark.parametrize(
    "over",
    [
        {},
        {"guidance_scale": 1.0},  # CFG off: no unconditional pass
        {"sigmas": [1.0, 0.7, 0.45, 0.2, 0.05], "seed": 3},
        {"seed": 11, "prompt": "Two  cats &amp; a dog\n", "num_inference_steps": 6},
    ],
    ids=["default", "cfg-off", "custom-sigmas", "cleaned-prompt"],
)
def test_frames_match_diffusers(tiny_dir, tiny_client, over):
    info = read_model(tiny_dir)
    req = _request(info, **over)
    got = tiny_client.generate(**req)["samples"][0]["output"]
    ref = diffusers_generate(tiny_dir, **req)
    assert got.shape == (req["num_frames"], req["height"], req["width"], 3)
    assert got.std() > 1e-3  # a real picture, not a constant
    assert _max_diff(got, ref) <= TOL


def test_latents_match_diffusers(tiny_dir, tiny_client):
    info = read_model(tiny_dir)
    req = _request(info, seed=5)
    got = tiny_client.generate(**req, output_type="latent")["samples"][0]["output"]
    ref = diffusers_generate(tiny_dir, **req, output_type="latent")
    assert _max_diff(got, ref) <= TOL


def test_n_samples_use_consecutive_seeds(tiny_dir, tiny_client):
    info = read_model(tiny_dir)
    req = _request(info, seed=20)
    out = tiny_client.generate(**req, n=3, output_type="latent")
    assert [s["seed"] for s in out["samples"]] == [20, 21, 22]
    for s in out["samples"]:
        ref = diffusers_generate(tiny_dir, **{**req, "seed": s["seed"]}, output_type="latent")
        assert _max_diff(s["output"], ref) <= TOL
    assert _max_diff(out["samples"][0]["output"], out["samples"][1]["output"]) > 1e-2
    assert set(out["timings"]) == {"encode_s", "denoise_s", "decode_s", "total_s"}


def test_json_and_msgpack_bodies_agree(tiny_dir, tiny_engine):
    info = read_model(tiny_dir)
    req = _request(info, seed=9, output_type="latent")
    with EngineClient(tiny_engine.url, binary=False) as js, EngineClient(tiny_engine.url, binary=True) as mp:
        a = js.generate(**req)["samples"][0]["output"]
        b = mp.generate(**req)["samples"][0]["output"]
    assert torch.equal(a, b)


@pytest.mark.heavy  # test_batching.py's least-loaded test covers two denoise workers
def test_two_denoise_workers(tiny_dir, shared_engine):
    eng = shared_engine("tiny", "encoder=1,denoise=2,decode=1")
    health = eng.http.get("/health").json()
    assert [w["role"] for w in health["workers"]].count("denoise") == 2
    info = read_model(tiny_dir)
    reqs = [_request(info, seed=100 + i, prompt=f"prompt {i}") for i in range(6)]
    with EngineClient(eng.url) as c, ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda r: c.generate(**r), reqs))
    used = {o["samples"][0]["route"]["denoise"] for o in outs}
    assert used == {0, 1}  # both instances served
    for r, o in zip(reqs, outs):
        assert _max_diff(o["samples"][0]["output"], diffusers_generate(tiny_dir, **r)) <= BATCHED_FRAMES_TOL


@pytest.mark.heavy  # a second Wan model; tiny's parity is the default
def test_other_configuration_matches_diffusers(alt_dir, shared_engine):
    """A model with other widths, heads, layers, flow_shift and a non-square size."""
    eng = shared_engine("tiny-alt")
    info = read_model(alt_dir)
    assert info.defaults["height"] != info.defaults["width"]
    with EngineClient(eng.url) as c:
        for over in ({}, {"guidance_scale": 1.0, "seed": 4}, {"sigmas": [0.95, 0.6, 0.3], "seed": 2}):
            req = _request(info, **over)
            got = c.generate(**req)["samples"][0]["output"]
            assert _max_diff(got, diffusers_generate(alt_dir, **req)) <= TOL
