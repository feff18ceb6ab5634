"""Step caching per request (common/diffusion/step_cache.py), in process: the workers' own path
(tests/family_harness.py) on the built-in ``-smooth`` models, whose time embedding moves a few percent per
step as a trained model's does (so that steps really are skipped).

Per family (Wan text to video, SD3, FLUX, Qwen-Image, Wan image to video, SANA) and method (``teacache``,
``first_block``; SANA has no TeaCache polynomial: ``first_block`` alone), float32 on the CPU:

1. Isolation: a caching request batched with three others joined at later steps (caching and not, other
   methods, thresholds, CFG and group sizes) equals its run alone (latents within 1e-5) with the same pass
   counts, and so does each of the others; a request with and without caching, side by side in one batch, each
   equal their runs alone. Every sample of a group equals its seed alone (each row's decisions are its own).
2. Counts: ``transformer_passes + cached_steps == steps x branches`` per sample; a threshold far below every
   change computes every step and equals the request without caching.
3. Rollouts: a rollout's SDE steps always compute (no row skipped inside its window), its log-probs equal the
   trainer's recompute within 1e-5; a window over every step caches nothing.
4. Two experts (Wan2.2): the state is reset at the switch, the second expert's first step computes every row
   and no output of the first expert is reused by the second.
5. LoRA: a caching request with an adapter batched with one without equals its run alone.
6. ``--compile``: a compiled policy serving caching requests of several skip patterns (so forwards of varying
   row counts) equals eager and compiles nothing beyond its first graphs.
7. :class:`RequestCache`'s rules on known signals, ``parse_flag`` and ``threshold_problem``.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from common.diffusion import step_cache
from common.diffusion.cache_signals import cache_problem
from common.diffusion.step_cache import METHODS, RequestCache, parse_flag, rel_l1, rescale, threshold_problem
from common.builtin import ensure_builtin
from common.protocol.messages import (
    LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, TRAJECTORY_TIMESTEPS, CacheParams,
    RolloutParams,
)
from denoise_worker.denoiser import Denoiser, Request
from family_harness import MAX_BATCH, InProcess, compare_tasks, max_diff
from rl import TrainerPolicy, Trajectory
from test_wan_i2v import picture

BATCH_TOL = 1e-5  # rows of other requests in one forward round apart in float32
RECOMPUTE_TOL = 1e-5
COMPILE_TOL = 1e-4  # compiled kernels fuse and round apart from eager (tests/test_compile.py)
STEPS = 12

FAMILIES = ["tiny-smooth", "tiny-sd3-smooth", "tiny-flux-smooth", "tiny-qwen-image-smooth", "tiny-wan-i2v-smooth",
            "tiny-sana-smooth", "tiny-z-image-smooth", "tiny-flux2-klein-smooth", "tiny-hunyuan-video15-smooth"]
# No TeaCache polynomial for SANA (none published, none fitted on its built-ins: tests/test_teacache_sources.py):
# it serves first_block alone.
# Nor for Z-Image: on small-z-image-smooth its modulated input does not predict the output's change (a line fitted
# by bench/fit_teacache.py: R^2 0.05), so its built-ins carry none.
NO_TEACACHE = {"tiny-sana-smooth", "tiny-z-image-smooth"}
CASES = [(model, method) for model in FAMILIES for method in METHODS
         if not (method == "teacache" and model in NO_TEACACHE)]
# HunyuanVideo 1.5's tiny model costs about 0.25 s a forward (its 729 vision tokens ride along every row): its
# cases run with the heavy tests; test_hunyuan_video15_first_block_residual_is_the_video_streams stays default.
HEAVY = {"tiny-hunyuan-video15-smooth"}


def marked(cases: list) -> list:
    """``cases`` (models, or (model, method) pairs) with the HEAVY models' marked heavy."""
    model = lambda c: c[0] if isinstance(c, tuple) else c  # noqa: E731
    return [pytest.param(*(c if isinstance(c, tuple) else (c,)), marks=pytest.mark.heavy) if model(c) in HEAVY
            else c for c in cases]
# Thresholds at which every family skips some steps of the test's requests at 12 steps (measured: teacache at
# 0.3 caches 6-18 of 24 row-steps, Wan image to video's 2 only, 4 at 0.6; first_block at 0.3 caches 8-18).
THRESHOLDS = {"teacache": 0.3, "first_block": 0.3}
OVERRIDES = {("tiny-wan-i2v-smooth", "teacache"): 0.6}
IMAGES = [picture(40, 24, 1), picture(70, 50, 2), picture(24, 40, 3), picture(32, 32, 4)]

_ENGINES: dict[str, InProcess] = {}
_TRAINERS: dict[str, TrainerPolicy] = {}


@pytest.fixture(scope="module", autouse=True)
def _module_state():
    """After the module: the thread count as it was (the harness sizes it per forward), no model kept."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    for made in (_ENGINES, _TRAINERS):
        made.clear()


def engine(model: str) -> InProcess:
    if model not in _ENGINES:
        _ENGINES[model] = InProcess(ensure_builtin(model))
    return _ENGINES[model]


def cache(model: str, method: str, scale: float = 1.0) -> CacheParams:
    return CacheParams(method=method, threshold=OVERRIDES.get((model, method), THRESHOLDS[method]) * scale)


def no_cfg(eng: InProcess) -> dict:
    return {eng.family.cfg_field: 1.0}


def params(eng: InProcess, **over):
    """The model's defaults at ``STEPS`` steps with a negative prompt, and its classifier-free guidance on
    (FLUX's true CFG too)."""
    d = eng.info.defaults
    fields = dict(num_inference_steps=STEPS, negative_prompt="blurry", seed=3, num_frames=d.get("num_frames", 1))
    if eng.family.cfg_field == "true_cfg_scale":
        fields["true_cfg_scale"] = 2.5
    return eng.params(**{**fields, **over})


def image_for(eng: InProcess, i: int = 0):
    """Image-to-video models: one of the test pictures (each request its own); other models: none."""
    return IMAGES[i % len(IMAGES)] if eng.family.condition.image_input(eng.info) == "required" else None


def branches(eng: InProcess, p) -> int:
    return 2 if eng.family.guidance.uses_cfg(p) else 1


def run_joined(eng: InProcess, jobs: list[dict], policy=None) -> list:
    """Jobs (``p``, ``image``, ``lora``, ``join``: the step of the first job's at which it joins) stepped
    together as the worker batches them, each from its own step (``policy``: another policy's forwards, with
    the thread count as it is)."""
    tasks, step = [None] * len(jobs), 0
    while not all(t is not None and t.done for t in tasks):
        for i, job in enumerate(jobs):
            if tasks[i] is None and job.get("join", 0) <= step:
                tasks[i] = eng.task(job["p"], lora=job.get("lora"), image=job.get("image"))
        live = [t for t in tasks if t is not None and not t.done]
        if policy is None:
            eng.step(live)
        else:  # the Denoiser on another policy, threads as they are
            other = Denoiser(policy, torch.device("cpu"), MAX_BATCH, size_threads_on_cpu=False)
            with torch.no_grad():
                assert [out.error for out in other.run([Request(str(i), t) for i, t in enumerate(live)])
                        if out.error is not None] == []
        step += 1
    return tasks


def alone(eng: InProcess, job: dict):
    return eng.run(job["p"], lora=job.get("lora"), image=job.get("image"))


def check_counts(task, steps: int, n: int, b: int) -> None:
    counts = task.pass_counts()
    assert len(counts["transformer_passes"]) == len(counts["cached_steps"]) == n
    for passes, cached in zip(counts["transformer_passes"], counts["cached_steps"]):
        assert passes + cached == steps * b, counts


# --- 1. isolation --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model,method", marked(CASES))
def test_a_caching_request_batched_with_three_others_equals_its_run_alone(model, method, record_property):
    eng = engine(model)
    other = next((m for m in METHODS if m != method and (model, m) in CASES), method)
    jobs = [dict(p=params(eng, cache=cache(model, method))),
            dict(p=params(eng, prompt="a quiet harbour at dusk with small fishing boats", seed=4,
                          num_inference_steps=STEPS - 2, **no_cfg(eng)), join=2),
            dict(p=params(eng, prompt="a kite", seed=5, n=2, cache=cache(model, other)), join=3),
            dict(p=params(eng, prompt="snow on a pine", seed=6, num_inference_steps=STEPS + 2,
                          cache=cache(model, method, 0.5), **no_cfg(eng)), join=5)]
    for i, job in enumerate(jobs):
        job["image"] = image_for(eng, i)
    before = eng.shared_forwards
    together = run_joined(eng, jobs)
    assert eng.shared_forwards > before
    diffs = []
    for job, t in zip(jobs, together):
        solo = alone(eng, job)
        diffs.append(compare_tasks(t, solo))
        assert t.pass_counts() == solo.pass_counts()
        check_counts(t, job["p"].num_inference_steps, job["p"].n, branches(eng, job["p"]))
    counts = [t.pass_counts() for t in together]
    record_property("max_diff", diffs)
    record_property("counts", counts)
    print(f"\n[{model} {method}] batched vs alone {diffs} {counts}")
    assert sum(together[0].cache.cached_steps) > 0 and sum(together[2].cache.cached_steps) > 0
    assert max(diffs) <= BATCH_TOL


@pytest.mark.parametrize("model,method", marked(CASES))
def test_cached_and_uncached_rows_in_one_batch_each_equal_their_runs_alone(model, method):
    """The same request with and without caching, side by side from the first step: the cached one skips rows
    that the other computes in the same forwards."""
    eng = engine(model)
    image = image_for(eng)
    jobs = [dict(p=params(eng, cache=cache(model, method)), image=image), dict(p=params(eng), image=image)]
    cached, plain = run_joined(eng, jobs)
    assert sum(cached.cache.cached_steps) > 0 and plain.cache is None
    assert max_diff(cached.latents, plain.latents) > 1e-3  # the skipped steps change the output
    assert compare_tasks(cached, alone(eng, jobs[0])) <= BATCH_TOL
    assert compare_tasks(plain, alone(eng, jobs[1])) <= BATCH_TOL


@pytest.mark.parametrize("model,method", marked(CASES))
def test_each_sample_of_a_group_equals_its_seed_alone(model, method):
    """Decisions are per sample (first_block) or shared by samples of one timestep (teacache): a group's
    sample ``i`` takes the skips of the request of seed + i alone."""
    eng = engine(model)
    p = params(eng, n=2, seed=7, cache=cache(model, method))
    group = eng.run(p, image=image_for(eng))
    check_counts(group, STEPS, 2, branches(eng, p))
    counts = group.pass_counts()
    for i in range(2):
        solo = eng.run(msgspec.structs.replace(p, n=1, seed=p.seed + i), image=image_for(eng))
        assert max_diff(group.latents[i : i + 1], solo.latents) <= BATCH_TOL
        assert [counts["transformer_passes"][i], counts["cached_steps"][i]] == [
            solo.pass_counts()["transformer_passes"][0], solo.pass_counts()["cached_steps"][0]]
    if method == "teacache":  # one decision per branch for every sample
        assert len(set(counts["cached_steps"])) == 1


# --- 2. counts -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", marked(FAMILIES))
def test_counts_and_a_tiny_threshold_computes_everything(model):
    eng = engine(model)
    image = image_for(eng)
    assert [m for m in METHODS if cache_problem(m, eng.family, [], eng.info) is None] == \
        [m for m in METHODS if (model, m) in CASES]  # NO_TEACACHE is the families' own answer
    for method in [m for m in METHODS if (model, m) in CASES]:
        for over in ({}, no_cfg(eng)):
            plain = eng.run(params(eng, **over), image=image)
            assert plain.pass_counts() == {"transformer_passes": [STEPS * branches(eng, plain.params)],
                                           "cached_steps": [0]}
            p = params(eng, cache=CacheParams(method=method, threshold=1e-6), **over)
            task = eng.run(p, image=image)
            assert task.pass_counts() == plain.pass_counts(), (method, over)
            # One branch alone takes the same forward as without caching; with CFG the two branches are two
            # pieces of one forward where the uncached request takes two passes: float32 rounding apart.
            tol = 0.0 if branches(eng, p) == 1 else BATCH_TOL
            assert max_diff(task.latents, plain.latents) <= tol, (method, over)


def test_samples_of_a_first_block_group_take_their_own_skips():
    """The per-sample counts of a first_block group differ where its samples' residuals do (found among a
    few seeds), and each still adds up to steps x branches."""
    eng = engine("tiny-smooth")
    seen = []
    for seed in range(4):
        p = params(eng, n=2, seed=seed, cache=CacheParams(method="first_block", threshold=0.2))
        task = eng.run(p)
        check_counts(task, STEPS, 2, 2)
        seen.append(task.pass_counts()["cached_steps"])
    assert any(a != b for a, b in seen), seen


def test_hunyuan_video15_first_block_residual_is_the_video_streams():
    """diffusers' block registry has no entry for HunyuanVideo 1.5's block: the family's ``block_residual`` reads
    its video stream (first input, first output), as a hook of the test's own on the first block sees it, per
    row of two requests of other texts and steps in one probe."""

    from common.diffusion.cache_signals import first_block_residuals

    eng = engine("tiny-hunyuan-video15-smooth")
    tasks = [eng.task(params(eng, **no_cfg(eng))), eng.task(params(eng, prompt="a kite", seed=4, n=2, **no_cfg(eng)))]
    eng.step(tasks[1:])
    inputs = [t.model_input() for t in tasks]
    model = eng.policy.experts["transformer"]
    seen = []
    handle = model.transformer_blocks[0].register_forward_hook(
        lambda m, args, out: seen.append((out[0] - args[0]).float().flatten(1)))
    try:
        with torch.no_grad():
            for x in inputs:
                eng.policy.velocity(x)
    finally:
        handle.remove()
    probed = first_block_residuals(eng.policy, "transformer", inputs)
    assert [p.shape[0] for p in probed] == [1, 2]
    for want, got in zip(seen, probed):
        assert max_diff(got.flatten(1), want) <= BATCH_TOL
    assert max_diff(probed[1][:1], probed[1][1:]) > 1e-3  # each row its own


# --- 3. rollouts ---------------------------------------------------------------------------------------------

WINDOW = [0, 1, 2, 3]


def _recorded(task) -> list[tuple[int, list[list[bool]]]]:
    """Each (step, per-branch row mask) the task's cache decides from now on."""
    seen, decide = [], task.cache.decide

    def recording(step, expert, forced, signals):
        masks = decide(step, expert, forced, signals)
        seen.append((step, [m.tolist() for m in masks]))
        return masks

    task.cache.decide = recording
    return seen


def _run_recorded(eng: InProcess, p, image=None):
    task = eng.task(p, image=image)
    seen = _recorded(task)
    while not task.done:
        eng.step([task])
    return task, seen


def _trainer_log_probs(eng: InProcess, model: str, task, image) -> torch.Tensor:
    if model not in _TRAINERS:
        _TRAINERS[model] = TrainerPolicy(eng.info.path)
    trainer, p, ex = _TRAINERS[model], task.params, task.extras()
    traj = Trajectory(ex[TRAJECTORY_LATENTS.name][0], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])
    inputs = None if image is None else trainer.image(p, image)
    with torch.no_grad():
        return trainer.log_probs(traj, ex[LOG_PROB_STEPS.name], p, image=inputs)


@pytest.mark.parametrize("model,method", marked(CASES))
def test_rollout_sde_steps_compute_and_log_probs_equal_the_trainers(model, method, record_property):
    eng = engine(model)
    image = image_for(eng)
    rollout = RolloutParams(sde_type="sde", noise_level=0.7, sde_step_indices=WINDOW, return_trajectory=True)
    p = params(eng, rollout=rollout, cache=cache(model, method))
    task, seen = _run_recorded(eng, p, image)
    assert [s for s, _ in seen] == list(range(STEPS))
    skipped = [s for s, masks in seen if not all(all(m) for m in masks)]
    assert skipped and not set(skipped) & set(WINDOW), skipped  # ODE steps outside the window only
    assert sum(task.cache.cached_steps) > 0
    check_counts(task, STEPS, 1, branches(eng, p))
    log_probs = task.extras()[LOG_PROBS.name]
    assert log_probs.shape == (1, len(WINDOW))
    d = max_diff(_trainer_log_probs(eng, model, task, image), log_probs[0])
    record_property("max_diff", d)
    print(f"\n[{model} {method}] rollout skipped steps {skipped}, log-probs {d:.3g}")
    assert d <= RECOMPUTE_TOL
    everywhere = msgspec.structs.replace(p, rollout=msgspec.structs.replace(rollout, sde_step_indices=None))
    full = eng.run(everywhere, image=image)
    assert full.pass_counts()["cached_steps"] == [0]


# --- 4. two experts ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", list(METHODS))
def test_two_experts_reset_the_state_at_the_switch(method):
    eng = engine("tiny-moe-smooth")
    p = params(eng, num_inference_steps=16, cache=CacheParams(method=method, threshold=0.3))
    task = eng.task(p)
    seen, experts, outputs = _recorded(task), [], []
    while not task.done:
        experts.append(eng.policy.expert_for(task.timestep))
        eng.step([task])
        outputs.append([None if o is None else o.clone() for o in task.cache.outputs])
    switch = experts.index("transformer_2")
    assert 0 < switch < len(experts) - 1 and set(experts[switch:]) == {"transformer_2"}
    masks = dict(seen)
    assert all(all(m) for m in masks[switch])  # the second expert's first step computes every row
    skipped = [s for s, m in seen if not all(all(r) for r in m)]
    print(f"\n[two experts {method}] switch at step {switch}, skipped {skipped}")
    assert any(s > switch for s in skipped), skipped
    if method == "first_block":  # (teacache's warm-up on Wan, 5 steps, lasts until about the switch)
        assert any(s < switch for s in skipped), skipped
    for b in range(2):  # the outputs kept after the switch are the second expert's own
        assert not torch.equal(outputs[switch][b], outputs[switch - 1][b])
    check_counts(task, 16, 1, 2)
    assert compare_tasks(task, eng.run(p)) == 0.0


# --- 5. LoRA -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", list(METHODS))
def test_a_caching_request_with_an_adapter_batched_with_one_without_equals_its_run_alone(method, tmp_path):
    import lora_fixtures as lf
    from common.diffusion.lora import build_adapter
    from common.diffusion.lora_format import read_lora

    model = "tiny-smooth"
    eng = engine(model)
    written = lf.make_diffusers_lora(eng.info.path, tmp_path / "lora", rank=4, alpha=8, target_modules=lf.ATTN,
                                     seed=1)
    adapter = build_adapter(f"cache-{method}", 1, read_lora(str(written.path), None), eng.policy.experts, 64)
    eng.policy.cover(adapter)
    jobs = [dict(p=params(eng, cache=cache(model, method)), lora=(adapter, 0.8)),
            dict(p=params(eng, seed=4, prompt="a kite", cache=cache(model, method)), join=2)]
    together = run_joined(eng, jobs)
    solos = [alone(eng, job) for job in jobs]
    assert sum(together[0].cache.cached_steps) > 0
    assert max_diff(solos[0].latents, eng.run(jobs[0]["p"]).latents) > 1e-3  # the adapter acts
    for t, solo in zip(together, solos):
        assert compare_tasks(t, solo) <= BATCH_TOL
        assert t.pass_counts() == solo.pass_counts()


# --- 6. --compile --------------------------------------------------------------------------------------------

@pytest.mark.heavy  # compiling: tests/test_compile.py by default
def test_compiled_policy_serves_caching_requests_without_recompiling(record_property):
    """Inductor as tests/test_compile.py, warmed up at the default request (which includes a guided caching
    request's two branches as two rows of different texts). Requests whose skips give forwards of 1, 2, 3, ...
    rows (partial groups, one branch or both, with and without a plan), each equal to eager (and with eager's
    skips), compile nothing (the first_block probe, eager, leaves no hook behind to guard on)."""
    from common.diffusion.compiled import compile_experts, warm_up
    from common.diffusion.policy import Policy
    from test_sd3 import _graphs

    model = "tiny-smooth"
    eng = engine(model)
    torch.set_num_threads(eng.max_threads)  # as a --compile worker: one thread count (graphs guard on it)
    compiled = Policy.load(eng.info, eng.policy.dtype, "cpu")
    compile_experts(compiled, log_recompiles=False)
    before = _graphs()
    warm_up(compiled)
    assert _graphs() > before
    rounds = [[dict(p=params(eng, cache=cache(model, "first_block")))],
              [dict(p=params(eng, n=2, seed=4, cache=cache(model, "first_block"))),
               dict(p=params(eng, seed=5, cache=cache(model, "teacache")), join=1),
               dict(p=params(eng, n=3, seed=6, cache=CacheParams(method="first_block", threshold=0.15)), join=2),
               dict(p=params(eng, seed=7, **no_cfg(eng), cache=cache(model, "first_block", 0.5)), join=3),
               dict(p=params(eng, seed=8), join=4)],
              [dict(p=params(eng, seed=9, **no_cfg(eng), cache=cache(model, "teacache"))),
               dict(p=params(eng, n=2, seed=10, cache=cache(model, "teacache", 0.5)), join=2)]]
    graphs, diffs = [], []
    for jobs in rounds:
        torch.set_num_threads(eng.max_threads)  # (the eager runs size their threads per forward)
        before = _graphs()
        got = run_joined(eng, jobs, compiled)
        graphs.append(_graphs() - before)
        for job, t in zip(jobs, got):
            want = alone(eng, job)
            assert t.pass_counts() == want.pass_counts()
            diffs.append(max_diff(t.latents, want.latents) / max(1.0, want.latents.abs().max().item()))
        assert any(sum(t.pass_counts()["cached_steps"]) for t in got)
    record_property("graphs", graphs)
    record_property("max_diff", diffs)
    print(f"\n[compile] graphs {graphs} diffs {diffs}")
    assert graphs == [0, 0, 0], graphs
    assert max(diffs) <= COMPILE_TOL


# --- 7. the rules --------------------------------------------------------------------------------------------

def _signal(scale: float, n: int = 1) -> torch.Tensor:
    return torch.ones(n, 4) * scale


def test_teacache_accumulates_the_rescaled_change_until_the_threshold():
    rc = RequestCache(CacheParams(method="teacache", threshold=0.25), n=2, branches=1, steps=10,
                      coefficients=(2.0, 0.0))  # rescaled = 2 x change
    decisions = []
    for step, scale in enumerate([1.0, 1.05, 1.05 ** 2, 1.05 ** 3, 1.05 ** 4, 1.05 ** 5]):
        (mask,) = rc.decide(step, "transformer", False, [_signal(scale)])
        rc.output(0, mask, torch.full((2, 4), float(step)) if mask.any() else None)
        decisions.append(mask.tolist())
    # step 0: warm-up; then +0.1 per step: 0.1, 0.2 skip, 0.3 computes (and restarts), 0.1, 0.2 skip
    assert decisions == [[True, True], [False, False], [False, False], [True, True], [False, False],
                         [False, False]]
    assert rc.accumulated[0] == pytest.approx(0.2, rel=1e-5)
    assert rc.transformer_passes == [2, 2] and rc.cached_steps == [4, 4]
    # A polynomial that goes negative counts the raw change instead.
    rc = RequestCache(CacheParams(method="teacache", threshold=0.25), n=1, branches=1, steps=10,
                      coefficients=(1.0, -1.0))
    (mask,) = rc.decide(0, "transformer", False, [_signal(1.0)])
    rc.output(0, mask, torch.zeros(1, 4))
    assert not rc.decide(1, "transformer", False, [_signal(1.1)])[0].any()
    assert rc.accumulated[0] == pytest.approx(0.1, rel=1e-5)
    assert float(rescale((1.0, -2.0, 3.0), torch.tensor(2.0))) == 3.0  # x^2 - 2x + 3 at 2
    assert rel_l1(_signal(1.1), _signal(1.0)).tolist() == pytest.approx([0.1])


def test_first_block_decides_per_row_against_its_last_computed_residual():
    rc = RequestCache(CacheParams(method="first_block", threshold=0.1), n=3, branches=1, steps=10)
    base = torch.tensor([[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    (m,) = rc.decide(0, "transformer", False, [base])
    out = rc.output(0, m, torch.full((3, 2), 10.0))
    assert m.tolist() == [True] * 3 and out.tolist() == [[10.0] * 2] * 3
    # row 0 drifts 6% a step, row 1 jumps 50%, row 2 stays
    (m,) = rc.decide(1, "transformer", False, [base * torch.tensor([[1.06], [1.5], [1.0]])])
    assert m.tolist() == [False, True, False]
    out = rc.output(0, m, torch.full((1, 2), 20.0))
    assert out[:, 0].tolist() == [10.0, 20.0, 10.0]
    # row 0 compares with step 0's residual (12% away now), not step 1's (6%); row 1 with step 1's
    (m,) = rc.decide(2, "transformer", False, [base * torch.tensor([[1.12], [1.5], [1.0]])])
    assert m.tolist() == [True, False, False]
    out = rc.output(0, m, torch.full((1, 2), 30.0))
    assert out[:, 0].tolist() == [30.0, 20.0, 10.0]
    assert rc.transformer_passes == [2, 2, 1] and rc.cached_steps == [1, 1, 2]
    # every row skipping: no forward at all, the outputs as they were
    (m,) = rc.decide(3, "transformer", False, [base * torch.tensor([[1.12], [1.5], [1.0]])])
    assert not m.any() and rc.output(0, m, None)[:, 0].tolist() == [30.0, 20.0, 10.0]


def test_forced_steps_warm_up_last_step_and_an_expert_switch_compute():
    for method in METHODS:
        rc = RequestCache(CacheParams(method=method, threshold=1.0), n=1, branches=2, steps=6, warmup=2)
        same = [_signal(1.0), _signal(1.0)]
        got = []
        for step, expert, forced in [(0, "transformer", False), (1, "transformer", False), (2, "transformer", False),
                                     (3, "transformer", True), (4, "transformer_2", False), (5, "transformer_2", False)]:
            masks = rc.decide(step, expert, forced, same if rc.wants_signal(step) else None)
            got.append([m.item() for m in masks])
            for b, m in enumerate(masks):
                rc.output(b, m, torch.full((int(m.sum()), 4), float(step)) if m.any() else None)
        # warm-up (2 steps), unchanged signal: skip, forced: compute, switch: compute and reset, last: compute
        assert got == [[True, True], [True, True], [False, False], [True, True], [True, True], [True, True]], method
        assert rc.expert == "transformer_2" and rc.transformer_passes == [10] and rc.cached_steps == [2]
        assert not rc.wants_signal(5) and rc.forced(5) and rc.forced(1) and not rc.forced(2)


def test_parse_flag_and_threshold_problem():
    assert parse_flag("teacache") == CacheParams(method="teacache", threshold=METHODS["teacache"].default_threshold)
    assert parse_flag("first_block:0.2") == CacheParams(method="first_block", threshold=0.2)
    assert parse_flag("teacache:2") == CacheParams(method="teacache", threshold=2.0)
    for bad, match in [("nope", "unknown cache method"), ("first_block:0", r"\(0, 1.0\]"),
                       ("first_block:1.5", r"\(0, 1.0\]"), ("teacache:-1", r"\(0, 2.0\]"), ("teacache:x", "float"),
                       ("", "unknown cache method")]:
        with pytest.raises(ValueError, match=match):
            parse_flag(bad)
    assert threshold_problem("teacache", 0.1) is None and threshold_problem("first_block", 1.0) is None
    for method, value in [("teacache", 0.0), ("teacache", 2.5), ("first_block", -0.1), ("first_block", 1.01)]:
        assert method in threshold_problem(method, value)
    assert set(step_cache.METHODS) == {"teacache", "first_block"}
