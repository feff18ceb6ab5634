"""diffusers' Ulysses context parallelism on this CPU machine: two gloo ranks give the one-process output.

The ground the multi-device denoise worker stands on: the CPU shim (common/wan/context_parallel.py) and
diffusers' own all-to-alls, on the tiny and small models, for a batch of samples at different timesteps.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from diffusers import WanTransformer3DModel

from common.wan.tiny_model import ensure_tiny_model

TOL = 1e-5


def _inputs(model: WanTransformer3DModel):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, model.config.in_channels, 2, 8, 8, generator=g)
    text = torch.randn(2, 512, model.config.text_dim, generator=g)
    return dict(hidden_states=x, timestep=torch.tensor([700.0, 300.0]), encoder_hidden_states=text,
                return_dict=False)


def _rank(rank: int, world: int, rendezvous: str, name: str, out_path: str) -> None:
    from common.wan.context_parallel import enable_ulysses, settled

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        model = WanTransformer3DModel.from_pretrained(ensure_tiny_model(name) / "transformer").eval()
        enable_ulysses(model, world)
        with torch.no_grad():
            out = settled(model(**_inputs(model))[0])
        if rank == 0:
            torch.save(out, out_path)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_two_ulysses_ranks_equal_one_process(name, tmp_path):
    model = WanTransformer3DModel.from_pretrained(ensure_tiny_model(name) / "transformer").eval()
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
    from common.wan.context_parallel import enable_ulysses

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=0, world_size=1)
    try:
        model = WanTransformer3DModel.from_pretrained(ensure_tiny_model("tiny-alt") / "transformer")
        try:
            enable_ulysses(model, 2)
        except ValueError as e:
            open(why_path, "w").write(str(e))
    finally:
        dist.destroy_process_group()


def _leader_and_follower(rank: int, world: int, rendezvous: str, out_path: str) -> None:
    from common.wan.context_parallel import enable_ulysses
    from denoise_worker.parallel_forward import ParallelForward, follow

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        model = WanTransformer3DModel.from_pretrained(ensure_tiny_model("tiny") / "transformer").eval()
        enable_ulysses(model, world)
        experts = {"transformer": model}
        if rank:
            assert follow(experts) == 2
            return
        run = ParallelForward(experts)
        inputs = _inputs(model)
        with torch.no_grad():
            outs = [run("transformer", inputs["hidden_states"], inputs["timestep"] - k,
                        inputs["encoder_hidden_states"]) for k in range(2)]
        run.stop()
        torch.save(torch.stack(outs), out_path)
    finally:
        dist.destroy_process_group()


def test_the_leader_hands_each_forward_to_its_follower(tmp_path):
    """Only the leader has the inputs; the follower gets them over the group, and both run diffusers' Ulysses."""
    model = WanTransformer3DModel.from_pretrained(ensure_tiny_model("tiny") / "transformer").eval()
    inputs = _inputs(model)
    with torch.no_grad():
        ref = torch.stack([model(**{**inputs, "timestep": inputs["timestep"] - k})[0] for k in range(2)])
    out_path = str(tmp_path / "out.pt")
    mp.start_processes(_leader_and_follower, args=(2, str(tmp_path / "rendezvous"), out_path), nprocs=2,
                       start_method="spawn", join=True)
    assert (torch.load(out_path) - ref).abs().max().item() <= TOL
