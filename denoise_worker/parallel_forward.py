"""One transformer forward run by a denoise worker's ranks together: the leader's call, the followers' loop.

The leader (rank 0) calls :meth:`ParallelForward.__call__` where it would call
the model; the call and its inputs go to every follower
(:mod:`common.transport.forward_link`), then all ranks run the same forward on
the same inputs. With Ulysses enabled on every rank's copy of the model
(:func:`common.wan.context_parallel.enable_ulysses`), diffusers splits the
sequence inside and gathers the output on every rank; the leader returns it.
Followers run :func:`follow` until the leader's ``stop``.
"""

from __future__ import annotations

import torch

from common.transport.forward_link import receive_call, send_call
from common.wan.context_parallel import settled

FORWARD, STOP = "forward", "stop"


class ParallelForward:
    """The leader's side: each call runs on every rank of ``group`` (the default group when None)."""

    def __init__(self, experts: dict[str, torch.nn.Module], group=None):
        self.experts, self.group = experts, group

    def __call__(self, expert: str, hidden_states: torch.Tensor, timestep: torch.Tensor,
                 encoder_hidden_states: torch.Tensor) -> torch.Tensor:
        inputs = {"hidden_states": hidden_states, "timestep": timestep, "encoder_hidden_states": encoder_hidden_states}
        send_call(FORWARD, inputs, group=self.group, expert=expert)
        return settled(self.experts[expert](**inputs, return_dict=False)[0])

    def stop(self) -> None:
        send_call(STOP, group=self.group)


@torch.no_grad()
def follow(experts: dict[str, torch.nn.Module], device: torch.device | str = "cpu", group=None) -> int:
    """A follower's loop: run each forward the leader sends until it says stop; how many it ran."""
    ran = 0
    while True:
        call, inputs = receive_call(device, group)
        if call.op == STOP:
            return ran
        settled(experts[call.fields["expert"]](**inputs, return_dict=False)[0])  # the leader keeps the output
        ran += 1
