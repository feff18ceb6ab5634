"""A short soak: many small mixed requests at concurrency 32, some invalid; nothing lost, memory flat."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))

from soak import run_soak  # noqa: E402


# Slow (~21 s of 160 requests); concurrent mixed requests equal their solo runs by default: test_reliability.py
@pytest.mark.heavy
def test_short_soak(shared_engine):
    eng = shared_engine("tiny", "encoder=1,denoise=2,decode=1")
    res = run_soak(eng.url, n=160, concurrency=32, invalid_share=0.1, seed=1, warmup=40)
    assert res["lost"] == 0, res
    assert res["failed"] == 0, res["unexpected_examples"]
    assert res["statuses"].get(400, 0) == res["invalid_sent"] > 0
    assert res["answered_as_expected"] == 160
    for worker, start in res["memory_mb_after_warmup"].items():
        assert res["memory_mb_end"][worker] - start < 100, (worker, start, res["memory_mb_end"][worker])
    assert eng.http.get("/health").status_code == 200
