"""Served in bf16, the engine equals diffusers' pipeline in bf16 bit for bit where both hold the latents in float32
between steps (SANA, which also guides in float32 as its pipeline does; Z-Image); bench/bf16.py measures every
family."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bf16 import Model, _pipeline_latents  # noqa: E402


@pytest.mark.parametrize("name", ["tiny-sana", "tiny-z-image"])
def test_bf16_serving_equals_the_pipeline_in_bf16(name):
    model = Model(name)
    p = model.params(3, True, rollout=False)  # with CFG: SANA's guidance in float32
    assert model.family.guidance.uses_cfg(p)
    got = model.engine("bf16").run(p, model.image).output_latents()[0]
    ref = _pipeline_latents(model.pipeline_output("bf16", p, "latent"))
    assert (got.float() - ref.float()).abs().max().item() == 0.0
