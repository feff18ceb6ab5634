"""bench/bf16.py on the tiny Wan model at 2 steps: float32 serving equals diffusers, bf16 differs from float32,
and a rollout recomputed in its own dtype gives its log-probs exactly while another dtype does not."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import pytest  # noqa: E402

from bench import bf16  # noqa: E402


@pytest.mark.heavy  # about 10 s (six copies of the model loaded), 25 s on a loaded machine
def test_bf16_bench_on_tiny():
    r = bf16.bench_model("tiny", 2)
    s = r["serving"]
    assert s["compared"] == "latents" and s["guided"]
    assert s["f32_parity"]["max"] <= 1e-4  # the comparison is set up as the parity tests'
    assert 0 < s["own_f32"]["max"] < s["scale"]  # bf16 rounds, and stays within the latents' scale
    for label in ("no_cfg", "cfg"):
        x = r["rollout"][label]
        assert x["sde_steps"] >= 1 and x["abs_log_prob"] > 0
        assert x["bf16/bf16"]["max"] == 0.0 and x["f32/f32"]["max"] == 0.0  # the same dtype and layout: exact
        assert 0 < x["bf16/f32"]["max"] < 0.1 and 0 < x["f32/bf16"]["max"] < 0.1
    assert "| tiny |" in bf16.serving_row(r) and "| tiny | CFG |" in bf16.rollout_row(r, "cfg", bf16._columns([r]))
