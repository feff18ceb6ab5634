"""LTX-2 on a multi-device denoise worker, in process: what the leader sends its followers and what each CFG
group computes.

- The forward's ``grid`` (an ``Ltx2Layout``: both streams' geometry, the frame rate, STG's block, the
  cross-timestep switch) travels as plain data through msgpack and comes back equal; each row's guidance-pass
  kind travels with the texts.
- CFG parallel: the rows of a step (a request with all four passes beside one with CFG alone), conditional rows
  first as CFG parallel orders them, rebuilt from the wire and run as the two groups run them (the conditional
  rows; the unconditional, STG-perturbed and modality-isolated ones) equal the forward of them all within 1e-5.
- Ulysses is refused at launch, naming why; CFG parallel is accepted. Heavy: with diffusers' own plan on two
  gloo ranks the forward fails (it splits the video tokens but not their 4-dim split rotary embeddings).

The launched engines (CFG parallel equal to one device, frames and rollouts) are in tests/test_multi_device.py.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from common.builtin import ensure_builtin
from common.runtime.exit_now import exit_now
from common.config.engine import WorkerSpec
from common.diffusion.rows import Rows
from common.families.layouts import layout_problem
from common.families.ltx2.transformer import CONDITIONAL, ISOLATED, PERTURBED, ROW_KIND
from family_harness import ModuleModels, max_diff

# CFG alone: STG and modality guidance off on both streams (the built-in's audio fields turn them on)
CFG_ONLY = dict(stg_scale=0.0, modality_scale=1.0, audio_stg_scale=0.0, audio_modality_scale=1.0)
TOL = 1e-5
models = ModuleModels()


@pytest.fixture(scope="module", autouse=True)
def _module():
    yield from models.module_scope()


def engine():
    return models.engine(ensure_builtin("tiny-ltx2"))


def _inputs(eng):
    every = eng.task(eng.params(prompt="a drum solo", negative_prompt="blurry", guidance_scale=4.0, stg_scale=1.0,
                                modality_scale=3.0, num_frames=9, seed=2, n=2))
    cfg = eng.task(eng.params(prompt="rain on a tin roof", negative_prompt="blurry", guidance_scale=3.0,
                              **CFG_ONLY, num_frames=9, seed=5))
    eng.step([cfg])  # another step
    return [every.model_input(), cfg.model_input()]


def _over_the_wire(eng, rows: Rows) -> Rows:
    """``rows`` as a follower rebuilds them from the leader's header (msgpack) and tensors."""
    latents = eng.family.latents
    header = msgspec.msgpack.decode(msgspec.msgpack.encode({"grid": latents.layout_to_wire(rows.grid),
                                                            "text_of": rows.text_of}))
    return Rows(rows.hidden_states.clone(), rows.timestep.clone(), {k: v.clone() for k, v in rows.texts.items()},
                header["text_of"], rows.loras, rows.cond_rows, latents.layout_from_wire(header["grid"]), rows.guidance)


def test_the_layout_and_the_row_kinds_travel_as_plain_data():
    eng = engine()
    x = _inputs(eng)[0]
    rows, _ = eng.policy.rows_of("transformer", [x], guidance_last=True)
    back = _over_the_wire(eng, rows)
    assert back.grid == x.grid and back.grid is not x.grid
    kinds = rows.texts[ROW_KIND][torch.tensor(rows.text_of)].tolist()
    assert kinds == [CONDITIONAL] * 2 + [CONDITIONAL] * 2 + [PERTURBED] * 2 + [ISOLATED] * 2  # cond, uncond, STG, iso


def test_cfg_parallel_groups_equal_one_forward():
    eng = engine()
    inputs = _inputs(eng)
    rows, _ = eng.policy.rows_of("transformer", inputs, guidance_last=True)
    assert rows.cond_rows == 3 and rows.n == 2 * 4 + 2
    with torch.no_grad():
        whole = eng.policy.local("transformer", rows)
        wired = _over_the_wire(eng, rows)
        groups = torch.cat([eng.policy.local("transformer", wired, 0, rows.cond_rows),
                            eng.policy.local("transformer", wired, rows.cond_rows, rows.n)])
    diff = max_diff(groups, whole)
    print(f"\n[ltx2 cfg parallel] groups vs one forward {diff:.3g}")
    assert diff <= TOL * max(1.0, whole.abs().max().item())


def test_ulysses_is_refused_naming_why_and_cfg_parallel_is_not():
    info = engine().info
    ulysses = WorkerSpec(role="denoise", index=0, devices=["cpu", "cpu"], ulysses=2)
    problem = layout_problem(info, [ulysses])
    assert "ulysses" in problem and "rotary" in problem and "cfg works" in problem
    cfg = WorkerSpec(role="denoise", index=0, devices=["cpu", "cpu"], cfg_parallel=True)
    assert layout_problem(info, [cfg]) is None


def _ulysses_rank(rank: int, world: int, rendezvous: str, out_path: str) -> None:
    import torch.distributed as dist

    from common.diffusion.context_parallel import enable_context_parallel, settled

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        eng = engine()
        rows, _ = eng.policy.rows_of("transformer", _inputs(eng)[:1])
        enable_context_parallel(eng.policy.experts["transformer"], world)
        try:
            with torch.no_grad():
                out = settled(eng.policy.local("transformer", rows))
        except RuntimeError as e:
            out = str(e)
        if rank == 0:
            torch.save(out, out_path)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    exit_now(0)  # as a worker's ranks leave: the interpreter's teardown after gloo can abort


@pytest.mark.heavy  # two spawned gloo ranks (about 6 s)
def test_diffusers_plan_does_not_give_one_device_on_two_ranks(tmp_path):
    """Why Ulysses is refused: with diffusers' own _cp_plan on two ranks the forward fails (or parts from one
    device). Should diffusers' plan come to fit, this fails: then LTX-2 can set context_parallel."""
    import torch.multiprocessing as mp

    eng = engine()
    rows, _ = eng.policy.rows_of("transformer", _inputs(eng)[:1])
    with torch.no_grad():
        ref = eng.policy.local("transformer", rows)
    out_path = str(tmp_path / "out.pt")
    mp.start_processes(_ulysses_rank, args=(2, str(tmp_path / "rendezvous"), out_path), nprocs=2,
                       start_method="spawn", join=True)
    out = torch.load(out_path)
    print(f"\n[ltx2 ulysses 2] {out if isinstance(out, str) else max_diff(out, ref)}")
    assert isinstance(out, str) or max_diff(out, ref) > TOL
