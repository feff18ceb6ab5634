"""``kl_reference: "pinned"``: the weights ``POST /pin_reference`` copied, as a rollout's KL reference.

A pin copies every expert's current weights (:func:`pinned_copy`) into a :class:`Pinned` the stage keeps until
the next pin replaces it. A request with ``return_kl`` and ``kl_reference: "pinned"`` takes the copy held when it
starts (:attr:`DenoiseTask.reference`) and keeps it to its last step. Its reference velocity comes from a forward
of its own on that copy (other weights: it cannot share the policy's forward), on the step's own model input with
no adapter; :func:`denoise_worker.reference.record_kl` turns it into the step's KL and reference log-prob as for
``base``. A restarted worker holds no pin: such a request then fails with an error naming the missing pin rather
than falling back to another reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from common.diffusion.policy import Policy
from denoise_worker.step_plan import StepPlan
from denoise_worker.reference import stochastic_now, wants_kl
from denoise_worker.task import DenoiseTask

NO_PIN = ("kl_reference pinned: this denoise worker holds no pinned reference (none was pinned since it "
          "started); POST /pin_reference again")


@dataclass(frozen=True)
class Pinned:
    policy: Policy  # the copied experts (no adapters are ever applied to them)
    weight_version: int  # the worker's weight version when pinned

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for m in self.policy.experts.values() for t in m.state_dict().values())


def pinned_copy(policy: Policy, fresh: Callable[[], dict[str, torch.nn.Module]]) -> Policy:
    """A policy whose experts hold copies of ``policy``'s current weights: ``fresh()`` (new modules of the same
    model, as a resume loads them: no hooks, no compiled wrappers) filled with the live values."""
    copies = fresh()
    with torch.no_grad():
        for name, model in copies.items():
            model.load_state_dict(policy.experts[name].state_dict())
    return Policy(policy.info, copies)


def needs_pinned(task: DenoiseTask) -> bool:
    return task.reference is not None and wants_kl(task) and stochastic_now(task)


def with_pinned(tasks: list[DenoiseTask], plans: list[StepPlan]) -> list[StepPlan]:
    """``plans`` (one per task) where the tasks with a pinned reference compute its velocity after their own."""
    return [_with_forward(task, plan) if needs_pinned(task) else plan for task, plan in zip(tasks, plans)]


def _with_forward(task: DenoiseTask, plan: StepPlan) -> StepPlan:
    return replace(plan, pinned=replace(plan.model_input, lora=None))
