"""GPU machines with at least two GPUs only: multi-device denoise workers over NCCL, ring attention included.

Each layout's engine is compared with a one-GPU engine in bfloat16 on the tiny model: the same request gives
latents within bfloat16 rounding of the one-GPU run (ring attention merges partial attentions on cuDNN, the
one-GPU run uses torch's default attention), far closer than another seed's.
"""

from __future__ import annotations

import pytest
import torch

from conftest import Engine
from router.client import EngineClient

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                reason="needs two GPUs")
LAYOUTS = {"ulysses2": "ulysses=2", "ring2": "ring=2", "cfg2": "cfg"}
BODY = dict(prompt="a heron in the reeds", negative_prompt="blurry", seed=40, num_inference_steps=4,
            guidance_scale=4.0, output_type="latent", n=2)
BF16_TOL = 0.05  # relative to the latents' scale


def _latents(engine: Engine, **over) -> torch.Tensor:
    with EngineClient(engine.url) as c:
        return torch.stack([s["output"].float() for s in c._post("/generate", {**BODY, **over})["samples"]])


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory):
    e = Engine(tmp_path_factory.mktemp("engine"), "tiny", "encoder=1,denoise=1,decode=1", ["--dtype", "bfloat16"])
    yield e
    e.stop()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_multi_gpu_workers_equal_one_gpu(layout, one_gpu, tmp_path_factory):
    engine = Engine(tmp_path_factory.mktemp("engine"), "tiny", f"encoder=1,denoise=1:{LAYOUTS[layout]},decode=1",
                    ["--dtype", "bfloat16"])
    try:
        ref, other = _latents(one_gpu), _latents(one_gpu, seed=41)
        got = _latents(engine)
        scale = ref.abs().max().item()
        assert (got - ref).abs().max().item() <= BF16_TOL * scale < (other - ref).abs().max().item()
    finally:
        engine.stop()
