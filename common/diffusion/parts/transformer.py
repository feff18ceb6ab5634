"""The transformer part: how an expert is loaded and called, and where its pieces are.

The stages and the shared machinery (rows, step caching, shared text, compile, context parallel, LoRA) ask
this part instead of knowing a transformer class: its call on batched rows (:meth:`TransformerPart.forward`),
the timestep embedding that modulates its blocks (TeaCache's signal) and TeaCache's polynomial, the
dimensions compile makes dynamic, whether diffusers has its context-parallel plan, a trainer's LoRA targets,
its block list (first-block caching), and its text-only cross-attentions (shared text rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from common.diffusion.loading import load_component, load_single_file

if TYPE_CHECKING:
    from common.diffusion.model_facts import ModelFacts

ATTENTION_PROJECTIONS = ("to_q", "to_k", "to_v", "to_out.0")
# Both streams' attention projections of a joint-attention (MM-DiT) block.
JOINT_ATTENTION_PROJECTIONS = ("attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out",
                               "attn.to_k", "attn.to_out.0", "attn.to_q", "attn.to_v")


@dataclass(frozen=True, kw_only=True)
class TransformerPart:
    model_class: str  # the diffusers class of ``transformer/`` (and ``transformer_2/``)
    # The model's list of transformer blocks (its attribute): first-block caching probes the first.
    block_list: str = "transformer_blocks"
    # Dimensions of the transformer's tensor keywords (besides the batch) that vary between requests of one
    # latent shape: ``compile_experts`` makes them dynamic, one graph for every value (a text of its own
    # length); every other dimension is static (fixed-length texts: a graph each).
    compile_dynamic: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Class names of the model's blocks that ``compile_experts`` compiles one by one instead of the whole model
    # (diffusers' "regional compilation"): for a forward whose own code loops over rows or branches on tensor
    # values, which would break its graph and fix the batch size after the break. ``compile_dynamic`` then
    # names the blocks' parameters.
    compile_blocks: tuple[str, ...] = ()
    context_parallel: bool = False  # diffusers has a context-parallel plan for it (Ulysses / ring)
    # Why not, in the launcher's refusal (a family whose diffusers plan exists but does not fit says so).
    no_context_parallel: str = "has no context-parallel plan in diffusers"
    splits_text: bool = False  # that plan splits the text's sequence too (then its length must divide)
    # A trainer's default LoRA target modules (peft's ``target_modules``: suffixes of the Linear paths).
    lora_targets: tuple[str, ...] = ATTENTION_PROJECTIONS
    # TeaCache's published polynomial (highest power first) from the relative change of
    # :meth:`modulated_input` between steps to that of the output, where one exists, and where it comes from
    # (None: none is published; a model directory then needs its own step_cache.json, which overrides both);
    # the steps it always computes first. common/diffusion/cache_signals.py.
    teacache_coefficients: tuple[float, ...] | None = None
    teacache_source: str | None = None
    teacache_warmup: int = 1

    def load(self, path: Path, dtype: torch.dtype, file: Path | None = None) -> torch.nn.Module:
        """The expert in folder ``path``; with ``file`` (``--transformer-file``) its weights from that one
        checkpoint file instead, its config still from ``path`` (common/diffusion/loading.py)."""
        import diffusers

        cls = getattr(diffusers, self.model_class)
        return load_component(cls, path, dtype) if file is None else load_single_file(cls, file, path, dtype)

    def forward(self, model: torch.nn.Module, hidden_states: torch.Tensor, timestep: torch.Tensor,
                text: dict[str, torch.Tensor], grid: tuple[int, int], guidance: torch.Tensor | None) -> torch.Tensor:
        """The transformer's output for batched rows of one size (``grid``: the latents part's token grid);
        ``text``: each keyword's [B, ...] tensor; ``guidance``: the rows' embedded guidance [B] (or None)."""
        return model(hidden_states=hidden_states, timestep=timestep, return_dict=False, **text)[0]

    @property
    def has_modulated_input(self) -> bool:
        return type(self).modulated_input is not TransformerPart.modulated_input

    def modulated_input(self, model: torch.nn.Module, timestep: torch.Tensor, text: dict[str, torch.Tensor],
                        guidance: torch.Tensor | None) -> torch.Tensor:
        """The timestep embedding that modulates the transformer's blocks, [B, ...], for rows' timesteps [B]
        (as :meth:`forward` takes them), text keywords [B, ...] and embedded guidance [B] (or None)."""
        raise NotImplementedError(f"{self.model_class} has no timestep-modulated input")

    def blocks(self, model: torch.nn.Module) -> torch.nn.ModuleList:
        return getattr(model, self.block_list)

    def block_residual(self, block: torch.nn.Module, args: tuple, kwargs: dict, output) -> torch.Tensor:
        """A block's residual (output - input) per row, float32 [B, ...], from its forward hook's arguments:
        first-block caching's signal. Default: the latent stream diffusers' block registry names."""
        from diffusers.hooks._helpers import TransformerBlockRegistry

        index = TransformerBlockRegistry.get(type(block)).return_hidden_states_index
        before = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        after = output if isinstance(output, torch.Tensor) else output[index]
        return (after - before).float()

    def shares_text(self, info: "ModelFacts") -> bool:
        """Whether text-only activations can be computed once per distinct text (common/diffusion/shared_text.py):
        a cross-attention model's (:meth:`cross_attentions`); a joint-attention model's text stream depends on
        the latents."""
        return False

    def cross_attentions(self, model: torch.nn.Module) -> list:
        """The attention modules whose keys and values come from the text alone (shared text rows)."""
        return []
