"""One transformer forward run by a denoise worker's ranks together: the leader's call, the followers' loop.

The ranks form a mesh of ``cfg`` x ``ulysses`` (:class:`ParallelLayout`). The
leader (global rank 0) calls :meth:`ParallelForward.__call__` where it would
call the model; the call and its inputs go to every follower
(:mod:`common.transport.forward_link`). With CFG parallel (``cfg=2``) the rows
before ``cond_rows`` (the conditional passes) run on CFG group 0 and the rest
(the unconditional ones) on group 1, whose first rank sends its output to the
leader; within a group, diffusers' Ulysses (``ulysses`` ranks,
:func:`common.wan.context_parallel.enable_ulysses` on the group's sub-mesh)
splits the sequence and gathers the output. Followers run :func:`follow` until
the leader's ``stop``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.transport.forward_link import receive_call, send_call
from common.wan.context_parallel import enable_ulysses, settled

FORWARD, STOP = "forward", "stop"


@dataclass
class ParallelLayout:
    """Where this rank sits: its CFG group and the mesh its Ulysses ranks share."""

    cfg: int
    ulysses: int
    mesh: object  # DeviceMesh ("cfg", "ring", "ulysses")

    @classmethod
    def create(cls, cfg: int, ulysses: int, device_type: str = "cpu") -> "ParallelLayout":
        from torch.distributed.device_mesh import init_device_mesh

        if cfg not in (1, 2) or ulysses < 1 or dist.get_world_size() != cfg * ulysses:
            raise ValueError(f"a layout of cfg {cfg} x ulysses {ulysses} needs {cfg * ulysses} ranks, "
                             f"the group has {dist.get_world_size()}")
        mesh = init_device_mesh(device_type, (cfg, 1, ulysses), mesh_dim_names=("cfg", "ring", "ulysses"))
        return cls(cfg, ulysses, mesh)

    @property
    def cfg_rank(self) -> int:
        return self.mesh.get_local_rank("cfg")

    @property
    def sends_for_group(self) -> bool:
        """The rank that hands its CFG group's output to the leader (group 1's first rank)."""
        return self.cfg_rank == 1 and self.mesh.get_local_rank("ulysses") == 0

    def prepare(self, model: torch.nn.Module) -> None:
        """Sequence parallelism over this rank's CFG group, when it has several ranks."""
        if self.ulysses > 1:
            enable_ulysses(model, self.ulysses, mesh=self.mesh["ring", "ulysses"])


def _rows(inputs: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {k: v[start:stop] for k, v in inputs.items()}


class ParallelForward:
    """The leader's side: each call runs on every rank of the layout."""

    def __init__(self, experts: dict[str, torch.nn.Module], layout: ParallelLayout):
        self.experts, self.layout = experts, layout

    def __call__(self, expert: str, hidden_states: torch.Tensor, timestep: torch.Tensor,
                 encoder_hidden_states: torch.Tensor, cond_rows: int | None = None) -> torch.Tensor:
        """The model's output for every row. ``cond_rows``: with CFG parallel, the rows before it run on group 0
        and the rest on group 1 (None: all on group 0)."""
        inputs = {"hidden_states": hidden_states, "timestep": timestep, "encoder_hidden_states": encoder_hidden_states}
        n = hidden_states.shape[0]
        split = n if self.layout.cfg == 1 or cond_rows is None else cond_rows
        send_call(FORWARD, inputs, expert=expert, split=split)
        model = self.experts[expert]
        mine = settled(model(**_rows(inputs, 0, split), return_dict=False)[0])
        if split == n:
            return mine
        theirs = torch.empty((n - split, *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
        dist.recv(theirs, src=self.layout.mesh.mesh[1, 0, 0].item())
        return torch.cat([mine, theirs])

    def stop(self) -> None:
        send_call(STOP)


@torch.no_grad()
def follow(experts: dict[str, torch.nn.Module], layout: ParallelLayout, device: torch.device | str = "cpu") -> int:
    """A follower's loop: run its share of each forward the leader sends until it says stop; how many it ran."""
    ran = 0
    while True:
        call, inputs = receive_call(device)
        if call.op == STOP:
            return ran
        split, n = call.fields["split"], inputs["hidden_states"].shape[0]
        start, stop = (0, split) if layout.cfg_rank == 0 else (split, n)
        if start == stop:
            continue  # nothing for this CFG group (no unconditional rows)
        out = settled(experts[call.fields["expert"]](**_rows(inputs, start, stop), return_dict=False)[0])
        if layout.sends_for_group:
            dist.send(out.contiguous(), dst=0)
        ran += 1
