"""A text encoder that is a diffusers pipeline's own ``encode_prompt``, run on the pipeline loaded with its
tokenizers and text encoders only.

The encoder worker and a trainer (``rl.TrainerPolicy``) both encode with it, so that a trainer's recompute
sees exactly the embeddings the engine's transformer saw. A family's subclass names the pipeline and its text
encoders' classes and turns ``encode_prompt``'s output into each prompt's wire tensors (``wire_tensors``).
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import torch
from common.diffusion.loading import load_component

# The pipeline's components a text-only pipeline leaves out.
NOT_TEXT = ("transformer", "scheduler", "vae")


class PipelineTextEncoder:
    PIPELINE: ClassVar[str] = ""  # the diffusers pipeline class
    # Each text encoder's component (its tokenizer's is the same with "tokenizer") and transformers class.
    ENCODERS: ClassVar[dict[str, str]] = {}

    def __init__(self, pipe):
        self.pipe = pipe  # a PIPELINE holding only the tokenizers and text encoders
        self.device = pipe.text_encoder.device

    @classmethod
    def load(cls, model_dir: str | Path, dtype: torch.dtype, device):
        """The encoders of ``model_dir`` in ``dtype`` on ``device``, in eval mode, without gradients."""
        # Imported here: the other stages need none of transformers' models.
        import diffusers
        import transformers

        path = Path(model_dir)
        parts = {}
        for component, model_class in cls.ENCODERS.items():
            tokenizer = component.replace("text_encoder", "tokenizer")
            parts[tokenizer] = transformers.AutoTokenizer.from_pretrained(path / tokenizer)
            model = load_component(getattr(transformers, model_class), path / component, dtype)
            parts[component] = model.to(device).eval().requires_grad_(False)
        return cls(getattr(diffusers, cls.PIPELINE)(**parts, **dict.fromkeys(NOT_TEXT)))
