"""The leader-to-follower link of a multi-device denoise worker: calls and tensors over a gloo group, no pickle."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.runtime.exit_now import exit_now
from common.transport.forward_link import receive_call, send_call


def _tensors(step: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return {"latents": torch.randn(2, 16, 2, 4, 4, generator=g),
            "text": torch.randn(1, 8, 32, generator=g).to(torch.bfloat16),
            "timestep": torch.tensor([700.0, 300.0]) - step,
            "rows": torch.arange(step + 1, dtype=torch.int64),
            "mask": torch.rand(3, generator=g) > 0.5,
            "empty": torch.zeros(0, 4)}


def _rank(rank: int, world: int, rendezvous: str, report: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    try:
        if rank == 0:
            for step in range(3):
                send_call("forward", _tensors(step), expert="transformer", step=step, scales=[1.0, 4.5])
            send_call("stop")
        else:
            _follow(rank, report)
        dist.barrier()  # no rank tears the group down while another still has collectives in flight
    finally:
        dist.destroy_process_group()
    exit_now(0)  # as a worker's ranks leave: the interpreter's teardown after gloo can abort


def _follow(rank: int, report: str) -> None:
    seen = []
    while True:
        call, tensors = receive_call()
        if call.op == "stop":
            break
        want = _tensors(call.fields["step"])
        assert list(tensors) == list(want) and call.fields["expert"] == "transformer"
        assert call.fields["scales"] == [1.0, 4.5]
        for name, t in want.items():
            assert tensors[name].dtype == t.dtype and torch.equal(tensors[name], t), name
        seen.append(call.fields["step"])
    with open(f"{report}.{rank}", "w") as f:
        f.write(",".join(map(str, seen)))


def test_every_follower_gets_each_call_and_its_tensors_in_order(tmp_path):
    report = str(tmp_path / "seen")
    mp.start_processes(_rank, args=(3, str(tmp_path / "rendezvous"), report), nprocs=3, start_method="spawn", join=True)
    for rank in (1, 2):
        assert open(f"{report}.{rank}").read() == "0,1,2"
