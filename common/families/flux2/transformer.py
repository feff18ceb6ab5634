"""``Flux2Transformer2DModel`` as ``Flux2KleinPipeline`` calls it.

Position ids have four axes (t, h, w, l): a text token's are (0, 0, 0, l), a noise token's (0, row, col, 0), the
tokens of the k-th reference image (k from 0) (10 + 10 k, row, col, 0), as the pipeline's ``_prepare_text_ids``,
``_prepare_latent_ids`` and ``_prepare_image_ids``. The timestep goes in / 1000, no guidance embedding; with
references the output is the noise tokens' (``noise_pred[:, :latents.size(1)]``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.diffusion.parts.reference import TokenLayout
from common.diffusion.parts.text import HIDDEN
from common.diffusion.parts.transformer import JOINT_ATTENTION_PROJECTIONS, TransformerPart

REFERENCE_T = 10  # the k-th reference image's t coordinate: REFERENCE_T * (k + 1)


def grid_ids(t: int, rows: int, cols: int) -> torch.Tensor:
    """[rows * cols, 4] ids (t, row, col, 0), row-major."""
    return torch.cartesian_prod(torch.tensor([t]), torch.arange(rows), torch.arange(cols), torch.arange(1))


def image_ids(grid) -> torch.Tensor:
    """The noise tokens' ids, then each reference's (a plain grid: the noise tokens alone)."""
    if not isinstance(grid, TokenLayout):
        return grid_ids(0, *grid)
    refs = [grid_ids(REFERENCE_T * (k + 1), *g) for k, g in enumerate(grid.references)]
    return torch.cat([grid_ids(0, *grid.noise), *refs])


def text_ids(length: int) -> torch.Tensor:
    return torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(length))


@dataclass(frozen=True, kw_only=True)
class Flux2Transformer(TransformerPart):
    model_class: str = "Flux2Transformer2DModel"
    context_parallel: bool = True  # Flux2Transformer2DModel has a _cp_plan (3-D ids, as passed here)
    splits_text: bool = True  # its plan splits encoder_hidden_states and txt_ids
    # The double-stream blocks' attention projections of both streams.
    lora_targets: tuple[str, ...] = JOINT_ATTENTION_PROJECTIONS
    # The image tokens are the noise's and then any reference images' (none to three, each its own size): under
    # --compile their count is dynamic, so a request without references runs the graphs the warm-up compiled
    # with one (and a reference of another size compiles nothing).
    compile_dynamic: dict[str, tuple[int, ...]] = field(
        default_factory=lambda: {"hidden_states": (1,), "img_ids": (1,)})

    def forward(self, model, hidden_states, timestep, text, grid, guidance) -> torch.Tensor:
        rows, device = hidden_states.shape[0], hidden_states.device
        hidden = text[HIDDEN]
        out = model(hidden_states=hidden_states, timestep=timestep.to(hidden_states.dtype) / 1000, guidance=None,
                    encoder_hidden_states=hidden,
                    txt_ids=text_ids(hidden.shape[1]).to(device).expand(rows, -1, -1),
                    img_ids=image_ids(grid).to(device).expand(rows, -1, -1), return_dict=False)[0]
        return out[:, :grid.noise_tokens] if isinstance(grid, TokenLayout) else out

    # No published TeaCache polynomial: teacache needs the directory's step_cache.json.
    def modulated_input(self, model, timestep, text, guidance) -> torch.Tensor:
        t = timestep.to(text[HIDDEN].dtype) / 1000 * 1000  # as forward: t / 1000, scaled back by the model
        return model.time_guidance_embed(t, None)
