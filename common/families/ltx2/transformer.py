"""LTX-2's transformer part: ``LTX2VideoTransformer3DModel`` on both streams of the joint latents.

A forward's rows may be different guidance passes of their requests (``ROW_KIND`` beside each row's text):
the conditional and unconditional passes, STG's perturbed pass (self-attention skipped in the STG block:
the model's per-row ``perturbation_mask``) and modality guidance's isolated pass (the audio-to-video and
video-to-audio cross-attentions off). The model switches isolation for a whole forward only, so an isolated
row's cross-attention outputs are zeroed by hooks (installed once per model, a no-op on other forwards): the
block then adds exactly 0, as if it had skipped them.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from common.diffusion.opaque import opaque_like
from common.diffusion.parts.transformer import TransformerPart
from common.families.ltx2.latents import Ltx2Layout

ROW_KIND = "ltx2_row_kind"  # beside a pass's text tensors: [1] per text, one of the kinds below
CONDITIONAL, PERTURBED, ISOLATED = 0.0, 1.0, 2.0
AUDIO_HIDDEN = "audio_encoder_hidden_states"
MASK = "encoder_attention_mask"


class _Isolation:
    """Hooks on a model's cross-modal attentions, installed once (a compiled model guards on its hooks: hooks
    added per forward would compile it again each time), that scale their outputs by ``keep`` [B] (0: an
    isolated row) while a forward with isolated rows runs. Under torch.compile the hook is one opaque op that
    reads ``keep`` at run time: no guard on it."""

    def __init__(self, model: torch.nn.Module):
        self.keep: torch.Tensor | None = None
        self._opaque = opaque_like(self._scaled)  # (an opaque op's output may not be its input: a copy then)
        for block in model.transformer_blocks:
            for attn in (block.audio_to_video_attn, block.video_to_audio_attn):
                attn.register_forward_hook(self._hook)

    def _hook(self, _module, _args, output: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return self._opaque(output)
        return output if self.keep is None else self._scaled(output)

    def _scaled(self, output: torch.Tensor) -> torch.Tensor:
        return output.clone() if self.keep is None else output * self.keep.to(output.dtype)[:, None, None]

    @contextmanager
    def rows(self, keep: torch.Tensor):
        self.keep = keep
        try:
            yield
        finally:
            self.keep = None


_ISOLATIONS: "weakref.WeakKeyDictionary[torch.nn.Module, _Isolation]" = weakref.WeakKeyDictionary()


def _isolation(model: torch.nn.Module) -> _Isolation:
    if model not in _ISOLATIONS:
        _ISOLATIONS[model] = _Isolation(model)
    return _ISOLATIONS[model]


@dataclass(frozen=True, kw_only=True)
class Ltx2Transformer(TransformerPart):
    model_class: str = "LTX2VideoTransformer3DModel"
    # diffusers' _cp_plan splits the video tokens and the text, and 3-dim rotary embeddings only: the split
    # ones (4-dim) stay whole and the forward fails on two ranks; splitting them too, the masked attentions fail
    # (tests/test_ltx2_parallel.py).
    no_context_parallel: str = ("has a context-parallel plan in diffusers that splits the video tokens but leaves "
                                "their split rotary embeddings whole (its forward fails on two ranks)")

    def forward(self, model, hidden_states, timestep, text, grid: Ltx2Layout, guidance):
        g = grid.geometry
        text = dict(text)
        kind = text.pop(ROW_KIND, None)
        # Each stream in its own memory, as the pipeline's two tensors: in bf16 a linear layer on a strided view
        # rounds otherwise than on a contiguous tensor.
        video, audio = (stream.contiguous() for stream in g.split(hidden_states))
        if timestep.dim() == 2:  # image-to-video: a timestep per token; the audio tokens' is the row's
            video_t, row_t = timestep[:, :g.video_tokens], timestep[:, g.video_tokens]
        else:
            video_t = row_t = timestep
        perturbed = kind is not None and bool((kind == PERTURBED).any())
        isolated = kind is not None and bool((kind == ISOLATED).any())
        isolation = _isolation(model)  # installed at the model's first forward, before any graph is compiled
        kwargs = dict(hidden_states=video, audio_hidden_states=audio, timestep=video_t, audio_timestep=row_t,
                      sigma=row_t, audio_encoder_attention_mask=text.get(MASK),
                      num_frames=g.latent_frames, height=g.latent_height, width=g.latent_width, fps=grid.fps,
                      audio_num_frames=g.audio_frames, use_cross_timestep=grid.cross_timestep, return_dict=False,
                      **text)
        if perturbed:  # 0 on the perturbed rows: the STG block's self-attention gives its values
            kwargs["spatio_temporal_guidance_blocks"] = [grid.stg_block]
            kwargs["perturbation_mask"] = (kind != PERTURBED).to(video.dtype)
        if isolated:
            with isolation.rows((kind != ISOLATED).to(video.dtype)):
                out_video, out_audio = model(**kwargs)
        else:
            out_video, out_audio = model(**kwargs)
        return g.join(out_video, out_audio)

    def modulated_input(self, model, timestep, text, guidance):
        """Both streams' timestep embeddings (TeaCache's signal over the two streams)."""
        t = timestep if timestep.dim() == 1 else timestep[:, -1]
        video, _ = model.time_embed(t.flatten(), batch_size=t.shape[0], hidden_dtype=next(model.parameters()).dtype)
        audio, _ = model.audio_time_embed(t.flatten(), batch_size=t.shape[0],
                                          hidden_dtype=next(model.parameters()).dtype)
        return torch.cat([video.reshape(t.shape[0], -1), audio.reshape(t.shape[0], -1)], dim=1)

    def block_residual(self, block, args, kwargs, output):
        """Both streams' residuals side by side per row: a step skips only when video and audio barely moved."""
        video, audio = output
        return torch.cat([(video - kwargs["hidden_states"]).float().flatten(1),
                          (audio - kwargs["audio_hidden_states"]).float().flatten(1)], dim=1)
