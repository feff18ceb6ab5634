"""Z-Image's transformer part: ``ZImageTransformer2DModel`` called as ``ZImagePipeline`` calls it.

The model takes lists (one ``[C, 1, H', W']`` latent and one ``[L, D]`` text per row, each text its own length),
the timestep as ``(1000 - t) / 1000``, and predicts the negated velocity: the pipeline steps on ``-output``,
which this part returns (negation is exact, so guidance on it equals the pipeline's on the raw outputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from common.diffusion.parts.text import HIDDEN
from common.diffusion.parts.transformer import TransformerPart

MASK = "encoder_hidden_states_mask"  # MaskedText's: 1 on a row's real text tokens in a padded forward


def model_time(timestep: torch.Tensor) -> torch.Tensor:
    """The transformer's time input for scheduler timesteps (the pipeline's ``(1000 - t) / 1000``)."""
    return (1000 - timestep) / 1000


@dataclass(frozen=True, kw_only=True)
class ZImageTransformer(TransformerPart):
    model_class: str = "ZImageTransformer2DModel"
    # first_block probes the first noise-refiner block: the latent tokens alone, of one length for every row
    # of a grid (the main ``layers`` run [latents, text] padded to the longest row of the forward, so a row's
    # residual there would change shape with the rows it is batched with).
    block_list: str = "noise_refiner"
    # Under --compile the blocks are compiled, not the model: its forward takes a list per row and loops over
    # them (the list's length, each text's length: a graph each). A block's tokens ([B, L, D], L the padded
    # image, text or image + text sequence of the forward's longest row) are dynamic in their length too. The
    # texts' keywords say that texts vary in length: the warm-up runs texts of two lengths in one forward (the
    # masked blocks' graphs).
    compile_blocks: tuple[str, ...] = ("ZImageTransformerBlock",)
    compile_dynamic: dict[str, tuple[int, ...]] = field(
        default_factory=lambda: {"x": (1,), "attn_mask": (1,), "freqs_cis": (1,), HIDDEN: (1,), MASK: (1,)})

    def forward(self, model, hidden_states, timestep, text, grid, guidance) -> torch.Tensor:
        embeds, mask = text[HIDDEN], text.get(MASK)
        lengths = [embeds.shape[1]] * embeds.shape[0] if mask is None else mask.sum(dim=1).tolist()
        caps = [embeds[i, : int(n)] for i, n in enumerate(lengths)]
        t = model_time(timestep.expand(hidden_states.shape[0]))
        out = model(list(hidden_states.unsqueeze(2).unbind(0)), t, caps, return_dict=False)[0]
        return -torch.stack(out).squeeze(2)

    # No published TeaCache polynomial for this signal: teacache needs the directory's step_cache.json.
    def modulated_input(self, model, timestep, text, guidance) -> torch.Tensor:
        return model.t_embedder(model_time(timestep.float()) * model.t_scale).type_as(text[HIDDEN])
