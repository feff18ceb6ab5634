"""CPU only: how many intra-op threads a transformer forward gets."""

from __future__ import annotations

import torch

from common.diffusion.parts.text import HIDDEN, text_kwargs
from common.diffusion.policy import ModelInput

# Multiply-accumulates (roughly samples x tokens x width^2 x blocks) below which a forward runs on one thread.
SMALL_FORWARD = 5e7


def size_threads(model: torch.nn.Module, inputs: list[ModelInput], max_threads: int, image_tokens: int) -> None:
    """All of the worker's threads for forwards big enough to gain from them, one for small ones
    (``image_tokens``: the forward's image sequence, an edit's reference tokens included).

    On a small forward, waking threads costs more than it saves: measured on
    the tiny model, one thread halves the denoise CPU time per request, while
    a compute-bound model needs every core for its latency.
    """
    if max_threads == 1:
        return
    cfg = model.config
    # (Some configs name the width and depth dim and n_layers.)
    width = cfg.num_attention_heads * cfg.attention_head_dim if "num_attention_heads" in cfg else cfg.get("dim", 1)
    # Transformer blocks: FLUX has double- and single-stream ones.
    blocks = cfg.get("num_layers", cfg.get("n_layers", 1)) + cfg.get("num_single_layers", 0)
    tokens = image_tokens + text_kwargs(inputs[0].cond)[HIDDEN].shape[1]
    rows = sum(x.row_count for x in inputs)
    threads = max_threads if rows * tokens * width * width * blocks >= SMALL_FORWARD else 1
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)
