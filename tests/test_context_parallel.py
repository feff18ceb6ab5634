"""diffusers' Ulysses context parallelism on this CPU machine: two gloo ranks give the one-process output.

The ground the multi-device denoise worker stands on: the CPU shim (common/diffusion/context_parallel.py) and
diffusers' own all-to-alls, on the tiny and small models, for a batch of samples at different timesteps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers import WanTransformer3DModel

from common.builtin import ensure_builtin
from common.runtime.exit_now import exit_now

# CI runs these (heavy): launched engines' processes are their subject:
# gloo ranks in spawned processes.
pytestmark = pytest.mark.heavy

TOL = 1e-5


def _inputs(model: WanTransformer3DModel):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, model.config.in_channels, 2, 8, 8, generator=g)
    text = torch.randn(2, 512, model.config.text_dim, generator=g)
    return dict(hidden_states=x, timestep=torch.tensor([700.0, 300.0]), encoder_hidden_states=text,
                return_dict=False)


def _rank(rank: int, world: int, rendezvous: str, name: str, out_path: str) -> None:
    from common.diffusion.context_parallel import enable_context_parallel, settled

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        model = WanTransformer3DModel.from_pretrained(ensure_builtin(name) / "transformer").eval()
        enable_context_parallel(model, world)
        with torch.no_grad():
            out = settled(model(**_inputs(model))[0])
        if rank == 0:
            torch.save(out, out_path)
        dist.barrier()  # no rank tears the group down while another still has collectives in flight
    finally:
        dist.destroy_process_group()
    exit_now(0)  # as a worker's ranks leave: the interpreter's teardown after gloo can abort


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_two_ulysses_ranks_equal_one_process(name, tmp_path):
    model = WanTransformer3DModel.from_pretrained(ensure_builtin(name) / "transformer").eval()
    with torch.no_grad():
        ref = model(**_inputs(model))[0]
    out_path = str(tmp_path / "out.pt")
    mp.start_processes(_rank, args=(2, str(tmp_path / "rendezvous"), name, out_path), nprocs=2,
                       start_method="spawn", join=True)
    out = torch.load(out_path)
    assert out.shape == ref.shape and (out - ref).abs().max().item() <= TOL


def test_a_degree_that_does_not_divide_the_heads_is_refused(tmp_path):
    """tiny-alt has 3 heads: two Ulysses ranks cannot split them, and the rank says so before any forward."""
    mp.start_processes(_refused, args=(str(tmp_path / "rendezvous"), str(tmp_path / "why.txt")), nprocs=1,
                       start_method="spawn", join=True)
    assert "must divide the model's 3 attention heads" in (tmp_path / "why.txt").read_text()


def _refused(rank: int, rendezvous: str, why_path: str) -> None:
    from common.diffusion.context_parallel import enable_context_parallel

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    try:
        model = WanTransformer3DModel.from_pretrained(ensure_builtin("tiny-alt") / "transformer")
        try:
            enable_context_parallel(model, 2)
        except ValueError as e:
            open(why_path, "w").write(str(e))
        dist.barrier()  # no rank tears the group down while another still has collectives in flight
    finally:
        dist.destroy_process_group()
    exit_now(0)  # as a worker's ranks leave: the interpreter's teardown after gloo can abort


def _leader_and_follower(rank: int, world: int, rendezvous: str, cfg: int, out_path: str) -> None:
    from common.families import read_model
    from common.diffusion.policy import Policy
    from denoise_worker.parallel_forward import Follower, ParallelForward, ParallelLayout

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        layout = ParallelLayout.create(cfg, world // cfg)
        policy = Policy.load(read_model(ensure_builtin("tiny")), torch.float32, "cpu")
        layout.prepare(policy)
        if rank:
            Follower(policy, layout, torch.device("cpu")).run()
        else:
            run = ParallelForward(policy, layout)
            with torch.no_grad():
                outs = [run("transformer", _rows(policy.experts["transformer"], k)) for k in range(3)]
            run.stop()
            torch.save(outs, out_path)
        dist.barrier()  # no rank tears the group down while another still has collectives in flight
    finally:
        dist.destroy_process_group()
    exit_now(0)  # as a worker's ranks leave: the interpreter's teardown after gloo can abort


def _call(model, k: int) -> dict:
    """Forward k: 4 rows, the first ``cond_rows`` conditional; k = 2 has no unconditional rows."""
    g = torch.Generator().manual_seed(10 + k)
    x = torch.randn(4, model.config.in_channels, 2, 8, 8, generator=g)
    text = torch.randn(4, 512, model.config.text_dim, generator=g)
    return dict(hidden_states=x, timestep=torch.tensor([900.0, 600.0, 900.0, 600.0]) - k,
                encoder_hidden_states=text, cond_rows=[2, 2, 4][k])


def _rows(model, k: int):
    from common.diffusion.rows import Rows
    from common.families.wan.binding import WAN

    c = _call(model, k)
    texts = list(c["encoder_hidden_states"].split(1))
    return Rows.of(WAN, c["hidden_states"], c["timestep"], texts, [None] * 4, c["cond_rows"])


# four spawned ranks (~20 s) are heavy: the two-rank layouts cover both mechanisms
@pytest.mark.parametrize("world, cfg", [(2, 1), (2, 2), pytest.param(4, 2, marks=pytest.mark.heavy)],
                         ids=["ulysses2", "cfg2", "cfg2-ulysses2"])
def test_the_leader_hands_each_forward_to_its_followers(world, cfg, tmp_path):
    """Only the leader has the inputs; the followers get them over the group and run their share: the
    sequence split by diffusers' Ulysses, the unconditional rows on the second CFG group, or both."""
    model = WanTransformer3DModel.from_pretrained(ensure_builtin("tiny") / "transformer").eval()
    with torch.no_grad():
        refs = []
        for k in range(3):
            call = _call(model, k)
            call.pop("cond_rows")
            refs.append(model(**call, return_dict=False)[0])
    out_path = str(tmp_path / "out.pt")
    mp.start_processes(_leader_and_follower, args=(world, str(tmp_path / "rendezvous"), cfg, out_path),
                       nprocs=world, start_method="spawn", join=True)
    for out, ref in zip(torch.load(out_path), refs):
        assert out.shape == ref.shape and (out - ref).abs().max().item() <= TOL
