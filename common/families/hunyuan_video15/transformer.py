"""HunyuanVideo 1.5's transformer part: ``HunyuanVideo15Transformer3DModel`` called as the pipeline calls it.

The latents come in with the condition channels already joined (condition.py); the text keywords are the
text part's. A text-to-video model's ``image_embeds`` are zeros of ``[B, 729, image_embed_dim]`` (the pipeline's
``vision_num_semantic_tokens``), which the model recognises as "no image" (all zeros over the batch).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.diffusion.parts.transformer import JOINT_ATTENTION_PROJECTIONS, TransformerPart
from common.families.hunyuan_video15.text import IMAGE

VISION_TOKENS = 729  # HunyuanVideo15Pipeline.vision_num_semantic_tokens


@dataclass(frozen=True, kw_only=True)
class HunyuanVideo15Transformer(TransformerPart):
    model_class: str = "HunyuanVideo15Transformer3DModel"
    lora_targets: tuple[str, ...] = JOINT_ATTENTION_PROJECTIONS
    # Under --compile the blocks are compiled, not the model: its forward branches on the image embeds' values
    # and reorders each row's text tokens by its mask in a Python loop over the batch (graph breaks after which
    # the batch size is fixed, a graph per size). The blocks see the batch alone vary (the texts are fixed-length).
    compile_blocks: tuple[str, ...] = ("HunyuanVideo15TransformerBlock",)

    def forward(self, model, hidden_states, timestep, text, grid, guidance):
        text = dict(text)
        if IMAGE not in text:
            text[IMAGE] = torch.zeros(hidden_states.shape[0], VISION_TOKENS, model.config.image_embed_dim,
                                      dtype=hidden_states.dtype, device=hidden_states.device)
        return model(hidden_states=hidden_states, timestep=timestep.to(hidden_states.dtype), return_dict=False,
                     **text)[0]

    def block_residual(self, block, args, kwargs, output):
        """The video stream's residual (diffusers' block registry has no entry for this block: it takes the
        video then the text stream and returns them in that order)."""
        before = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return (output[0] - before).float()

    def modulated_input(self, model, timestep, text, guidance):
        """The timestep embedding that modulates every block (TeaCache's signal)."""
        return model.time_embed(timestep.to(next(model.parameters()).dtype))
