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


def cfg_on(scale: float) -> bool:
    """``ClassifierFreeGuidance._is_cfg_enabled`` for an enabled guider with its defaults."""
    return not math.isclose(scale, 1.0)


@dataclass(frozen=True, kw_only=True)
class HunyuanVideo15Guidance(Guidance):
    default_sigmas: bool = True  # the pipeline's linspace(1, 0, N + 1)[:-1]

    def uses_cfg(self, params) -> bool:
        """The guider runs its second pass at any scale but 1, below 1 too."""
        return cfg_on(self.scale(params))

    def combine(self, x, outs, scale):
        if len(outs) == 1:  # one pass (or a step-caching branch run alone)
            return outs[0]
        cond, uncond = outs[0], outs[1]
        return uncond + scale * (cond - uncond)


@dataclass(frozen=True, kw_only=True)
class HunyuanVideo15I2VGuidance(HunyuanVideo15Guidance):
    """Image-to-video's guidance, whose refusal hook (the family's request check) also refuses a size:
    ``HunyuanVideo15ImageToVideoPipeline`` has no height or width, it takes the aspect bucket nearest the image."""

    def refusal(self, info, request):
        for name in ("height", "width"):
            if request.get(name) is not None:
                return name, (f"{info.family.pipeline} takes no {name}: the output's size is the aspect bucket "
                              f"nearest the image's, got {request[name]!r}")
        return super().refusal(info, request)
