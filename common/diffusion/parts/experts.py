"""The experts part: which of a model's transformers runs a timestep, and the guidance scale each one uses.

- :class:`OneExpert`: ``transformer`` alone, at the request's guidance scale;
- :class:`BoundarySplit`: two experts split by timestep (Wan2.2, as diffusers' ``WanPipeline``): a directory with
  ``transformer_2`` and ``boundary_ratio`` in its ``model_index.json`` runs ``transformer`` (high noise) for
  ``t >= boundary_ratio * num_train_timesteps`` and ``transformer_2`` (low noise) below it, the latter guided with
  the request's ``guidance_scale_2`` where it gives one (:data:`GUIDANCE_SCALE_2`, a request field of the family's).

The denoise worker and a trainer's recompute both ask the policy (``Policy.expert_for``), which asks this part.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from common.diffusion.request_fields import RequestField, field_value
from common.protocol.messages import EXPERT_NAMES

if TYPE_CHECKING:
    from common.diffusion.model_facts import ModelFacts

FIRST, SECOND = EXPERT_NAMES  # the directory's transformer/ and transformer_2/


@dataclass(frozen=True)
class OneExpert:
    def names(self, info: "ModelFacts") -> tuple[str, ...]:
        """The experts a denoise worker loads from the directory."""
        return (FIRST,)

    def expert_for(self, info: "ModelFacts", experts: Collection[str], timestep) -> str:
        """The expert of ``experts`` (those loaded) that runs ``timestep``."""
        return FIRST

    def scales(self, params) -> tuple[tuple[str, float], ...]:
        """(expert, guidance scale) for each expert a request (``GenerationParams``) guides at a scale of its own
        instead of its classifier-free guidance scale."""
        return ()


def _two_experts(info: "ModelFacts") -> str | None:
    return None if info.boundary_ratio is not None else "only two-expert models (with boundary_ratio) take it"


GUIDANCE_SCALE_2 = RequestField("guidance_scale_2", float, "two-expert models: guidance of the low-noise expert",
                                minimum=0.0, maximum=100.0, model_check=_two_experts)


@dataclass(frozen=True)
class BoundarySplit(OneExpert):
    """A high-noise and a low-noise expert, split at the directory's ``boundary_ratio`` (see the module docstring);
    a directory without ``transformer_2`` has the first alone."""

    def names(self, info):
        return EXPERT_NAMES if info.has_transformer_2 else (FIRST,)

    def expert_for(self, info, experts, timestep):
        ratio = info.boundary_ratio
        if ratio is None or SECOND not in experts or timestep >= ratio * info.num_train_timesteps:
            return FIRST
        return SECOND

    def scales(self, params):
        value = field_value(params, GUIDANCE_SCALE_2.name)
        return () if value is None else ((SECOND, value),)
