"""Z-Image, FLUX.2 [klein] and HunyuanVideo 1.5 on a multi-device denoise worker, in process: what the leader
sends its followers and what each CFG group computes.

- The forward's ``grid`` (FLUX.2's edit: a ``TokenLayout`` of the noise tokens and each reference image's)
  travels as plain data through msgpack and comes back equal.
- CFG parallel: the rows of a step (two guided requests at different steps, texts of different lengths;
  HunyuanVideo 1.5 I2V with its image condition and SigLIP embeds), conditional rows first as CFG parallel
  orders them, rebuilt from the wire and run as the two groups run them, equal the forward of them all within
  1e-5.
- Ulysses: FLUX.2 [klein]'s transformer has a context-parallel plan in diffusers, and two gloo ranks with it give
  the one-device forward (heavy: spawned ranks); Z-Image's and HunyuanVideo 1.5's have none, so the launcher
  refuses ulysses for them, naming why, and accepts CFG parallel.

The launched engines (CFG parallel and FLUX.2's Ulysses equal to one device) are in tests/test_multi_device.py.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from common.builtin import ensure_builtin
from common.config.engine import Limits, WorkerSpec
from common.diffusion.params import to_params
from common.diffusion.parts.reference import TokenLayout
from common.diffusion.rows import Rows
from common.families.layouts import layout_problem
from common.runtime.exit_now import exit_now
from family_harness import ModuleModels, gradient_picture, max_diff

TOL = 1e-5
models = ModuleModels()
# model: (request overrides, an image's (height, width) or None)
CASES = {
    "z-image": ("tiny-z-image", {"guidance_scale": 4.0, "cfg_normalization": 1.0}, None),
    "flux2-klein": ("tiny-flux2-klein", {"guidance_scale": 4.0, "height": 48, "width": 64}, None),  # 3 x 4 tokens
    "flux2-klein-edit": ("tiny-flux2-klein", {"guidance_scale": 3.0}, (100, 70)),
    "hunyuan-video15": ("tiny-hunyuan-video15", {"guidance_scale": 5.0}, None),
    "hunyuan-video15-i2v": ("tiny-hunyuan-video15-i2v", {"guidance_scale": 5.0}, (50, 70)),
}


@pytest.fixture(scope="module", autouse=True)
def _module():
    yield from models.module_scope()


def _inputs(case: str):
    """The engine and the model inputs of one shared forward: a request at its second step beside another (other
    prompt, seed and text length) at its first."""
    model, over, size = CASES[case]
    eng = models.engine(ensure_builtin(model))
    image = None if size is None else gradient_picture(*size, seed=2)
    sizes = [] if image is None else [image.size]
    negative = {} if model == "tiny-flux2-klein" else {"negative_prompt": "blurry"}  # klein's negative: empty
    made = [to_params({"prompt": prompt, "seed": seed, "num_inference_steps": 3, "n": n, **negative, **over},
                      eng.info, Limits(), image_sizes=sizes)
            for prompt, seed, n in (("a heron in the reeds", 4, 2), ("a red kite over the dunes at dusk", 7, 1))]
    first = eng.task(made[0], image=image)
    eng.step([first])  # another step than the second's
    second = eng.task(made[1], image=image)
    return eng, [first.model_input(), second.model_input()]


def _over_the_wire(eng, rows: Rows) -> Rows:
    """``rows`` as a follower rebuilds them from the leader's header (msgpack) and tensors."""
    latents = eng.family.latents
    header = msgspec.msgpack.decode(msgspec.msgpack.encode({"grid": latents.layout_to_wire(rows.grid),
                                                            "text_of": rows.text_of}))
    return Rows(rows.hidden_states.clone(), rows.timestep.clone(), {k: v.clone() for k, v in rows.texts.items()},
                header["text_of"], rows.loras, rows.cond_rows, latents.layout_from_wire(header["grid"]), rows.guidance)


@pytest.mark.parametrize("case", list(CASES))
def test_cfg_parallel_groups_from_the_wire_equal_one_forward(case, record_property):
    eng, inputs = _inputs(case)
    rows, _ = eng.policy.rows_of("transformer", inputs, guidance_last=True)
    assert rows.cond_rows == 3 and rows.n == 6  # conditional rows first: 2 + 1, then the unconditional ones
    wired = _over_the_wire(eng, rows)
    assert wired.grid == rows.grid and wired.text_of == rows.text_of
    if case == "flux2-klein-edit":
        assert isinstance(wired.grid, TokenLayout) and wired.grid.references and wired.grid is not rows.grid
    with torch.no_grad():
        whole = eng.policy.local("transformer", rows)
        groups = torch.cat([eng.policy.local("transformer", wired, 0, rows.cond_rows),
                            eng.policy.local("transformer", wired, rows.cond_rows, rows.n)])
    diff = max_diff(groups, whole)
    record_property("max_diff", diff)
    assert whole.std() > 1e-3 and diff <= TOL * max(1.0, whole.abs().max().item())


@pytest.mark.parametrize("model, ulysses", [("tiny-z-image", False), ("tiny-flux2-klein", True),
                                            ("tiny-hunyuan-video15", False), ("tiny-hunyuan-video15-i2v", False)])
def test_ulysses_where_diffusers_has_a_plan_and_cfg_parallel_everywhere(model, ulysses):
    info = models.engine(ensure_builtin(model)).info
    problem = layout_problem(info, [WorkerSpec(role="denoise", index=0, devices=["cpu", "cpu"], ulysses=2)])
    if ulysses:
        assert problem is None
    else:
        assert "no context-parallel plan in diffusers" in problem and "cfg works" in problem
    cfg = WorkerSpec(role="denoise", index=0, devices=["cpu", "cpu"], cfg_parallel=True)
    assert layout_problem(info, [cfg]) is None


def _ulysses_rank(rank: int, world: int, rendezvous: str, case: str, out_path: str) -> None:
    import torch.distributed as dist

    from common.diffusion.context_parallel import enable_context_parallel, settled

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        eng, inputs = _inputs(case)
        rows, _ = eng.policy.rows_of("transformer", inputs)
        enable_context_parallel(eng.policy.experts["transformer"], world)
        with torch.no_grad():
            out = settled(eng.policy.local("transformer", rows))
        if rank == 0:
            torch.save(out, out_path)
        dist.barrier()  # no rank tears the group down while another still has collectives in flight
    finally:
        dist.destroy_process_group()
    exit_now(0)  # as a worker's ranks leave: the interpreter's teardown after gloo can abort


@pytest.mark.heavy  # two spawned gloo ranks per case
@pytest.mark.parametrize("case", ["flux2-klein", "flux2-klein-edit"])
def test_flux2_klein_on_two_ulysses_ranks_equals_one_device(case, tmp_path, record_property):
    """diffusers' own plan splits the noise tokens (and an edit's reference tokens after them) and the text."""
    import torch.multiprocessing as mp

    eng, inputs = _inputs(case)
    rows, _ = eng.policy.rows_of("transformer", inputs)
    with torch.no_grad():
        ref = eng.policy.local("transformer", rows)
    out_path = str(tmp_path / "out.pt")
    mp.start_processes(_ulysses_rank, args=(2, str(tmp_path / "rendezvous"), case, out_path), nprocs=2,
                       start_method="spawn", join=True)
    out = torch.load(out_path)
    diff = max_diff(out, ref)
    record_property("max_diff", diff)
    assert out.shape == ref.shape and diff <= TOL * max(1.0, ref.abs().max().item())
