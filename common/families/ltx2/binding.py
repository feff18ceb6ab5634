"""LTX-2 (``LTX2Pipeline``, ``LTX2ImageToVideoPipeline``): video and audio denoised jointly.

- encoder: Gemma3's hidden states through the pipeline's text connectors, a video and an audio context and
  their mask (:mod:`common.families.ltx2.text`); image-to-video: the image's first-frame latent
  (:mod:`common.families.ltx2.image`);
- denoise: ``LTX2VideoTransformer3DModel`` on both streams of one ``[S_v + S_a, C]`` tensor (the narrower
  stream zero-padded where their widths differ: :mod:`~common.families.ltx2.geometry`), CFG / STG / modality
  guidance and rescale per stream on x0 (:mod:`~common.families.ltx2.guidance`), each pass a row of the batched
  forward;
- schedule: flow-match Euler with dynamic shifting (``mu`` from the video tokens), sigmas ``linspace(1, 1/N, N)``,
  one schedule for both streams;
- decode: ``AutoencoderKLLTX2Video`` for the frames, ``AutoencoderKLLTX2Audio`` and the vocoder for the waveform
  (:mod:`common.families.ltx2.decoder`).

Either pipeline's directory serves both tasks (:func:`~common.diffusion.tasks.serving_both`): a request with an
image is image-to-video, one without text-to-video.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.diffusion.binding import Binding
from common.diffusion.parts.condition import NoCondition
from common.diffusion.parts.latents import Geometry
from common.diffusion.request_fields import NUM_FRAMES
from common.diffusion.tasks import serving_both
from common.families.ltx2.condition import Ltx2FirstFrame
from common.families.ltx2.decoder import Ltx2Decoder
from common.families.ltx2.fields import DEFAULTS, FIELDS, frame_rate
from common.families.ltx2.geometry import audio_token_width, video_compression
from common.families.ltx2.guidance import Ltx2Guidance
from common.families.ltx2.image import IMAGE_CRF, load_conditioner
from common.families.ltx2.latents import Ltx2Latents
from common.families.ltx2.text import MAX_SEQUENCE_LENGTH, Ltx2Text
from common.families.ltx2.transformer import CONDITIONAL, ROW_KIND, Ltx2Transformer


def geometry(path, transformer_config: dict) -> Geometry:
    spatial, temporal = video_compression(path)
    # The streams' widths may differ (geometry.py pads the narrower); the audio tokens must fit the transformer.
    audio = int(transformer_config.get("audio_in_channels", 128))
    if audio != audio_token_width(path):
        raise ValueError(f"{path}: transformer audio_in_channels {audio} is not the width of the audio tokens the "
                         f"pipeline makes, {audio_token_width(path)} (audio_vae latent_channels x mel_bins / 4)")
    return Geometry(latent_channels=int(transformer_config.get("in_channels", 128)), vae_scale_spatial=spatial,
                    vae_scale_temporal=temporal,
                    patch_size=(transformer_config.get("patch_size_t", 1), transformer_config.get("patch_size", 1),
                                transformer_config.get("patch_size", 1)))


@dataclass(frozen=True, kw_only=True)
class Ltx2PassText(Ltx2Text):
    """The text part, with each text's guidance-pass kind (transformer.py) stacked beside its tensors."""

    def stack(self, texts):
        kinds = [t.get(ROW_KIND) for t in texts]
        stacked = super().stack([{k: v for k, v in t.items() if k != ROW_KIND} for t in texts])
        if all(k is None for k in kinds):
            return stacked
        like = next(k for k in kinds if k is not None)
        return {**stacked, ROW_KIND: torch.cat([torch.full_like(like, CONDITIONAL) if k is None else k
                                                for k in kinds])}


_COMMON = dict(text=Ltx2PassText(), latents=Ltx2Latents(geometry=geometry), transformer=Ltx2Transformer(),
               decoder=Ltx2Decoder, guidance=Ltx2Guidance(), fps=24, size_multiple=32, defaults=DEFAULTS,
               request_fps=frame_rate, words=("ltx",))

# One checkpoint for both tasks (Lightricks/LTX-2 names LTX2Pipeline; LTX2ImageToVideoPipeline loads the same
# directory): either class's directory serves both, a request's image picking image-to-video.
LTX2, LTX2_I2V = serving_both(
    Binding(family="ltx2", pipeline="LTX2Pipeline", condition=NoCondition(),
            request_fields=(NUM_FRAMES, MAX_SEQUENCE_LENGTH, *FIELDS), **_COMMON),
    Binding(family="ltx2-i2v", pipeline="LTX2ImageToVideoPipeline", condition=Ltx2FirstFrame(loader=load_conditioner),
            request_fields=(NUM_FRAMES, MAX_SEQUENCE_LENGTH, *FIELDS, IMAGE_CRF), **_COMMON))
