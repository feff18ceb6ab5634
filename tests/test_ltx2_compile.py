"""``--compile`` on LTX-2 (heavy: compiling its transformer takes about 20 s here; tests/test_compile.py covers
compiling by default): the warm-up builds its examples from the parts (the latents part's ``Ltx2Layout`` of the
default request, its four guidance passes), after which a request's guided forward (cond and uncond in one
forward, then the STG-perturbed and the modality-isolated pass) compiles nothing and equals eager, and rows
of two requests with other pass sets at other steps equal eager too (their new row count compiles the frames
after diffusers' STG block once: its ``if all_perturbed`` on a tensor breaks the graph there)."""

from __future__ import annotations

import pytest
import torch

from common.builtin import ensure_builtin
from common.diffusion.compiled import compile_experts, warm_up
from common.diffusion.policy import Policy
from family_harness import ModuleModels, max_diff
from test_compile import _graphs, _run as _no_grad

# CFG alone: STG and modality guidance off on both streams (the built-in's audio fields turn them on)
CFG_ONLY = dict(stg_scale=0.0, modality_scale=1.0, audio_stg_scale=0.0, audio_modality_scale=1.0)
COMPILE_TOL = 1e-4  # compiled kernels fuse and round apart from eager (tests/test_compile.py)
models = ModuleModels()


@pytest.fixture(scope="module", autouse=True)
def _module():
    yield from models.module_scope()


@pytest.mark.heavy
def test_compiled_forwards_equal_eager(record_property):
    eng = models.engine(ensure_builtin("tiny-ltx2"))
    torch.set_num_threads(eng.max_threads)  # as a --compile worker: its one thread count (graphs guard on it)
    compiled = Policy.load(eng.info, torch.float32, "cpu")
    compile_experts(compiled, log_recompiles=False)
    before = _graphs()
    seconds = warm_up(compiled)
    assert list(seconds) == ["transformer"] and _graphs() - before >= 1  # the warm-up did compile
    every = eng.task(eng.params(prompt="a drum solo", negative_prompt="blurry", guidance_scale=4.0, stg_scale=1.0,
                                modality_scale=3.0, guidance_rescale=0.5, num_frames=9, seed=2))
    cfg = eng.task(eng.params(prompt="rain on a tin roof", negative_prompt="blurry", guidance_scale=3.0,
                              **CFG_ONLY, num_frames=9, seed=5))
    eng.step([cfg])
    torch.set_num_threads(eng.max_threads)  # (the harness sized it for its step)
    single = every.model_input()
    got, graphs = _no_grad(compiled.velocity, single)
    diffs = {"guided": max_diff(got, _no_grad(eng.policy.velocity, single)[0])}
    assert graphs == 0  # the warm-up compiled it
    inputs = [single, cfg.model_input()]
    got, graphs = _no_grad(compiled.batched_velocity, inputs)
    want = _no_grad(eng.policy.batched_velocity, inputs)[0]
    diffs["batched"] = max(max_diff(a, b) for a, b in zip(got, want))
    record_property("max_diff", diffs)
    print(f"\n[ltx2 compile] warm-up {seconds['transformer']:.1f}s, {diffs}, {graphs} graphs for the new row count")
    assert max(diffs.values()) <= COMPILE_TOL
