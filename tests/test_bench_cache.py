"""bench/cache.py end to end on a tiny model with few steps: every configuration answered, the pass counts add
up, the uncached rows are the reference; and its flags."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import cache  # noqa: E402

STEPS = 6


def _check(res: dict, model: str, thresholds: list[float]) -> dict:
    (m,) = [m for m in res["models"] if m["model"] == model]
    assert m["branches"] == 2  # CFG on
    assert [r["label"] for r in m["single"]] == ["none"] + [f"{method} {t:g}" for method in cache.METHODS
                                                            for t in thresholds]
    assert [r["label"] for r in m["concurrent"]] == ["none", "teacache 0.08", "first_block 0.08"]
    for r in m["single"] + m["concurrent"]:
        assert r["transformer_passes"] + r["cached_steps"] == STEPS * 2, r["label"]
        assert r["latency_p50_s"] > 0
    for rows in (m["single"], m["concurrent"]):
        assert rows[0]["cached_steps"] == 0 and rows[0]["identical"] and rows[0]["max_abs_diff"] == 0
        assert rows[0]["speedup"] == 1.0
    # Rows that reuse outputs differ from the uncached ones; rows that compute every step differ by rounding
    # (their CFG branches run as pieces of their own) or not at all.
    for r in m["single"][1:]:
        if r["cached_steps"]:
            assert 0 < r["max_abs_diff"] <= 1 and r["psnr_min_db"] < 80, r
        else:
            assert r["max_abs_diff"] < 1e-3, r
    assert m["concurrent"][0]["req_per_s"] > 0 and m["concurrent"][0]["throughput_ratio"] == 1.0
    assert set(m["targets"]) == {"teacache", "first_block"}
    return m


@pytest.mark.heavy  # the bench script in a process of its own, end to end: CI
def test_runs_end_to_end_on_a_tiny_video_model(tmp_path):
    out = tmp_path / "cache.json"
    res = cache.main(["--models", "tiny-smooth", "--steps", str(STEPS), "--requests", "1", "--concurrency", "2",
                      "--thresholds", "0.08", "0.5", "--json", str(out)])
    m = _check(res, "tiny-smooth", [0.08, 0.5])
    assert m["request"]["num_frames"] == 5 and m["request"]["guidance_scale"] == 5.0
    # first_block at 0.5 reuses some steps of this model (teacache: Wan computes its first 5 steps and the last)
    assert next(r for r in m["single"] if r["label"] == "first_block 0.5")["cached_steps"] > 0
    saved = json.loads(out.read_text())
    assert saved["models"][0]["model"] == "tiny-smooth" and saved["config"]["steps"] == STEPS


@pytest.mark.heavy
def test_runs_end_to_end_on_a_tiny_image_model_with_true_cfg(tmp_path):
    res = cache.main(["--models", "tiny-flux-smooth", "--steps", str(STEPS), "--requests", "1",
                      "--concurrency", "2", "--thresholds", "0.5"])
    m = _check(res, "tiny-flux-smooth", [0.5])
    assert "num_frames" not in m["request"] and m["request"]["true_cfg_scale"] == 4.0
    assert next(r for r in m["single"] if r["label"] == "teacache 0.5")["cached_steps"] > 0


def test_difference_and_flags():
    a = [torch.zeros(2, 4, 4, 3)]
    assert cache.difference(a, a) == (0.0, None)
    d, psnr = cache.difference(a, [torch.full((2, 4, 4, 3), 0.1)])
    assert d == pytest.approx(0.1) and psnr == pytest.approx(20.0)
    assert cache.frames01(torch.full((1, 2, 2, 3), 255, dtype=torch.uint8)).max() == 1.0
    args = cache.parse_args([])
    assert args.models == ["small-smooth", "small-flux-smooth"] and args.steps == 50
    assert 0.08 in args.thresholds and args.concurrency == 16
    with pytest.raises(SystemExit):
        cache.parse_args(["--methods", "first_block", "--thresholds", "1.5"])  # first_block takes (0, 1]
