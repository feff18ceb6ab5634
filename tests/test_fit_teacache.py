"""bench/fit_teacache.py on the tiny SD3 model with a smooth time embedding, in process (a few seconds):
it fits a degree-4 polynomial over the range of changes it measured, ``--write`` stores it where
``cache_signals.teacache_settings`` reads it, and the reuse share it predicts from the recorded changes is the
one a cached request of the same prompts then takes."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import math

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import fit_teacache  # noqa: E402

from common.diffusion.cache_signals import SETTINGS_FILE, teacache_settings  # noqa: E402
from common.families import read_model  # noqa: E402
from common.builtin import ensure_builtin  # noqa: E402
from common.protocol.messages import CacheParams  # noqa: E402
from family_harness import InProcess  # noqa: E402

STEPS = 12


def test_fit_writes_settings_that_teacache_reads_and_predicts_its_skips(tmp_path, capsys):
    model = tmp_path / "tiny-sd3-smooth"
    shutil.copytree(ensure_builtin("tiny-sd3-smooth"), model)
    (model / SETTINGS_FILE).unlink()  # as a checkpoint that no one fitted a polynomial for
    family_coefficients, warmup = teacache_settings(read_model(model))
    assert family_coefficients == ()

    result = fit_teacache.main([str(model), "--prompts", "1", "--steps", str(STEPS)])
    assert not (model / SETTINGS_FILE).exists()  # nothing written without --write
    coefficients = result["coefficients"]
    assert len(coefficients) == 5 and all(math.isfinite(c) for c in coefficients)
    lo, hi = result["x_range"]
    assert 0 < lo < hi
    out = capsys.readouterr().out
    assert "fitted teacache_coefficients" in out and "x range covered" in out
    line = fit_teacache.main([str(model), "--prompts", "1", "--steps", str(STEPS), "--degree", "1"])
    assert len(line["coefficients"]) == 2 and line["x_range"] == result["x_range"]

    written = fit_teacache.main([str(model), "--prompts", "1", "--steps", str(STEPS), "--write"])
    assert written["coefficients"] == coefficients  # deterministic
    data = json.loads((model / SETTINGS_FILE).read_text())
    assert data["teacache_warmup"] == warmup and data["source"].startswith("fitted on this directory by bench/fit_teacache.py")
    assert teacache_settings(read_model(model)) == (tuple(coefficients), warmup)
    assert family_coefficients != tuple(coefficients)

    # The predicted reuse at 0.08 (from the recorded changes, with the fitted polynomial) is what a cached
    # request of the same prompt takes with the written settings.
    eng = InProcess(model)
    p = eng.params(prompt=fit_teacache.PROMPTS[0], negative_prompt=fit_teacache.NEGATIVE, num_inference_steps=STEPS,
                   cache=CacheParams(method="teacache", threshold=0.08))
    counts = eng.run(p).pass_counts()
    total = STEPS * 2  # two CFG branches, one sample
    assert counts["cached_steps"][0] + counts["transformer_passes"][0] == total
    assert counts["cached_steps"][0] == round(written["shares"][0.08][0] * total)
