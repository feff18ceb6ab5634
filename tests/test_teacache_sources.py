"""Where each model's TeaCache polynomial comes from, and no teacache on a guess: a family without a published
polynomial serves teacache only with the model directory's own ``step_cache.json`` (the built-in models carry
the one fitted on them; a real checkpoint gets one from bench/fit_teacache.py), else a request is refused
naming ``cache.method`` and ``--cache teacache`` ends the launcher in one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from common.diffusion.cache_signals import SETTINGS_FILE, cache_problem, teacache_settings, teacache_source
from common.families import read_model
from common.builtin import ensure_builtin
from conftest import ROOT

PUBLISHED = {"tiny": "Wan2.1-T2V-1.3B", "tiny-wan-i2v": "Wan2.1-I2V-14B-480P"}
FITTED = {"tiny-sd3": "small-sd3-smooth", "tiny-flux": "small-flux-smooth",
          "tiny-qwen-image": "small-qwen-image-smooth", "tiny-sd3-smooth": "small-sd3-smooth",
          "tiny-ltx2": "small-ltx2-smooth", "tiny-flux2-klein": "small-flux2-klein-smooth",
          "tiny-flux2-klein-smooth": "small-flux2-klein-smooth", "tiny-hunyuan-video15": "small-hunyuan-video15-smooth",
          "tiny-hunyuan-video15-i2v": "small-hunyuan-video15-smooth"}


@pytest.mark.parametrize("name", [*PUBLISHED, *FITTED])
def test_each_built_in_says_where_its_polynomial_comes_from(name):
    info = read_model(ensure_builtin(name))
    source = teacache_source(info)
    if name in PUBLISHED:
        assert source.startswith("published: TeaCache4Wan2.1") and PUBLISHED[name] in source
        assert not (info.path / SETTINGS_FILE).exists()
        assert teacache_settings(info)[0] == info.family.transformer.teacache_coefficients
    else:
        assert source == f"fitted on the built-in {FITTED[name]} (random weights) by bench/fit_teacache.py --degree 1"
        assert info.family.transformer.teacache_coefficients is None  # nothing the family would hand a real checkpoint
        written = json.loads((info.path / SETTINGS_FILE).read_text())["teacache_coefficients"]
        assert teacache_settings(info)[0] == tuple(written) and len(written) == 2
    assert cache_problem("teacache", info.family, [], info) is None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A directory of an SD3 checkpoint that no one fitted a polynomial for: tiny-sd3 without its file."""
    out = tmp_path_factory.mktemp("ckpt") / "sd3"
    shutil.copytree(ensure_builtin("tiny-sd3"), out)
    (out / SETTINGS_FILE).unlink()
    return out


def test_a_checkpoint_without_a_polynomial_refuses_teacache_and_says_how_to_fit_one(checkpoint):
    info = read_model(checkpoint)
    assert teacache_source(info) is None and teacache_settings(info)[0] == ()
    problem = cache_problem("teacache", info.family, [], info)
    assert "no published TeaCache polynomial" in problem and "bench/fit_teacache.py MODEL_DIR --write" in problem
    assert cache_problem("first_block", info.family, [], info) is None  # needs no polynomial
    (checkpoint / SETTINGS_FILE).write_text(json.dumps({"teacache_coefficients": [0.5, 0.01]}))
    try:
        info = read_model(checkpoint)
        assert cache_problem("teacache", info.family, [], info) is None
        assert teacache_settings(info)[0] == (0.5, 0.01) and teacache_source(info) == str(checkpoint / SETTINGS_FILE)
    finally:
        (checkpoint / SETTINGS_FILE).unlink()


def test_launch_with_teacache_by_default_on_it_ends_in_one_line(checkpoint):
    r = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--model", str(checkpoint), "--port", "0",
                        "--cache", "teacache"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr and "starting" not in r.stderr, r.stderr
    assert r.stderr.splitlines()[-1].startswith(
        "launch.py: error: --cache: StableDiffusion3Pipeline has no published TeaCache polynomial"), r.stderr


@pytest.mark.parametrize("name", ["tiny-sana", "tiny-z-image", "tiny-z-image-smooth"])
def test_built_ins_without_a_fitted_polynomial_refuse_teacache(name):
    """SANA and Z-Image have no published polynomial and their built-ins carry none (SANA: none fitted; Z-Image:
    its modulated input does not predict its output's change there, R^2 0.05): teacache is refused saying how
    to fit one, first_block serves (tests/test_step_cache.py runs them with it)."""
    info = read_model(ensure_builtin(name))
    assert info.family.transformer.teacache_coefficients is None and not (info.path / SETTINGS_FILE).exists()
    assert teacache_source(info) is None
    problem = cache_problem("teacache", info.family, [], info)
    assert "no published TeaCache polynomial" in problem and "bench/fit_teacache.py MODEL_DIR --write" in problem
    assert cache_problem("first_block", info.family, [], info) is None
