"""HunyuanVideo 1.5's guidance: the directory's ``guider`` (``ClassifierFreeGuidance``) with a request's
``guidance_scale`` as its scale.

The pipeline runs the unconditional pass whenever the guider's CFG is on: enabled and, in diffusers' own
formulation, a scale not close to 1 (below 1 too: ``math.isclose(scale, 1.0)`` is the only off switch); then
``uncond + scale * (cond - uncond)`` (``ClassifierFreeGuidance.forward``'s order: the shift first). The guider's
other settings (rescale, the original formulation, a step window) are checked at load to be its defaults
(binding.py): the combination below is the guider's for them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.diffusion.parts.guidance import Guidance
from common.diffusion.request_fields import field_value


def cfg_on(scale: float) -> bool:
    """``ClassifierFreeGuidance._is_cfg_enabled`` for an enabled guider with its defaults."""
    return not math.isclose(scale, 1.0)


@dataclass(frozen=True, kw_only=True)
class HunyuanVideo15Guidance(Guidance):
    default_sigmas: bool = True  # the pipeline's linspace(1, 0, N + 1)[:-1]

    def scale(self, params) -> float:
        """The policy's switch (2: a second pass, 1: none); the scale itself is :meth:`settings`."""
        return 2.0 if cfg_on(float(field_value(params, self.field))) else 1.0

    def settings(self, params) -> float:
        return float(field_value(params, self.field))

    def combine(self, x, outs, scale):
        if len(outs) == 1 or x.settings is None:  # one pass (or a step-caching branch run alone)
            return outs[0]
        cond, uncond = outs[0], outs[1]
        return uncond + x.settings * (cond - uncond)
