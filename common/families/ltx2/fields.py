"""LTX-2's request fields: the frame rate, each stream's guidance, STG's blocks, the decode timestep.

The audio guidance fields follow ``LTX2Pipeline.__call__``: left out, the pipeline signature's default; 0, the
video field's value (its ``audio_x or x``).
The pipeline's prompt enhancement and duration head are not served: like any field a family does not declare,
theirs are 400s naming them.
"""

from __future__ import annotations

from common.diffusion.request_fields import FROM_MODEL, RequestField, field_value

FRAME_RATE = RequestField("frame_rate", float, "frames per second of the video (and of the MP4); the audio's "
                          "length follows the video's duration", default=FROM_MODEL, minimum=1.0, maximum=120.0,
                          aliases=("fps",))
MOTION_SPEED = RequestField("motion_speed", float, "motion relative to real time: the positions are conditioned "
                            "on frame_rate / motion_speed", default=FROM_MODEL, minimum=0.05, maximum=20.0)
STG_SCALE = RequestField("stg_scale", float, "spatio-temporal guidance (a pass with self-attention skipped in "
                         "the STG blocks); 0: off", default=FROM_MODEL, minimum=0.0, maximum=100.0)
MODALITY_SCALE = RequestField("modality_scale", float, "modality guidance (a pass with the audio-video "
                              "cross-attention off); on above 1", default=FROM_MODEL, minimum=0.0, maximum=100.0)
GUIDANCE_RESCALE = RequestField("guidance_rescale", float, "rescale of the guided x0 prediction toward the "
                                "conditional one's std; 0: off", default=FROM_MODEL, minimum=0.0, maximum=1.0)
AUDIO = {name: RequestField(f"audio_{name}", float, f"the audio stream's {name} (0: the video's)",
                            default=FROM_MODEL, minimum=0.0, maximum=100.0 if name != "guidance_rescale" else 1.0)
         for name in ("guidance_scale", "stg_scale", "modality_scale", "guidance_rescale")}
STG_BLOCK = RequestField("stg_block", int, "the transformer block whose self-attention the STG pass skips "
                         "(the pipeline's spatio_temporal_guidance_blocks, one block)", default=FROM_MODEL,
                         minimum=0, maximum=255)
CROSS_TIMESTEP = RequestField("use_cross_timestep", bool, "the audio-video cross-attention modulated by the other "
                              "stream's sigma (LTX-2.3 and later; false: LTX-2.0)", default=FROM_MODEL)
DECODE_TIMESTEP = RequestField("decode_timestep", float, "the timestep the video VAE decodes at (VAEs with "
                               "timestep conditioning)", default=FROM_MODEL, minimum=0.0, maximum=1.0)
DECODE_NOISE_SCALE = RequestField("decode_noise_scale", float, "noise mixed into the latents before a "
                                  "timestep-conditioned decode (left out: decode_timestep)", minimum=0.0, maximum=1.0)
# The pipeline's own defaults (its __call__ signature) for the fields above.
DEFAULTS = {"height": 512, "width": 768, "num_frames": 121, "num_inference_steps": 30, "guidance_scale": 3.0,
            "max_sequence_length": 1024,
            "frame_rate": 24.0, "motion_speed": 1.0, "stg_scale": 1.0, "modality_scale": 3.0,
            "guidance_rescale": 0.7, "audio_guidance_scale": 7.0, "audio_stg_scale": 1.0, "audio_modality_scale": 3.0,
            "audio_guidance_rescale": 0.7, "stg_block": 28, "use_cross_timestep": True, "decode_timestep": 0.0}

FIELDS = (FRAME_RATE, MOTION_SPEED, STG_SCALE, MODALITY_SCALE, GUIDANCE_RESCALE, *AUDIO.values(), STG_BLOCK,
          CROSS_TIMESTEP, DECODE_TIMESTEP, DECODE_NOISE_SCALE)


def stream_value(params, name: str) -> tuple[float, float]:
    """(video, audio) values of guidance field ``name``: the audio one falls back to the video one when 0 (or
    absent), as ``LTX2Pipeline.__call__``'s ``audio_x = audio_x or x``."""
    video = float(field_value(params, name) or 0.0)
    return video, float(field_value(params, f"audio_{name}") or video)


def frame_rate(params) -> float:
    return float(field_value(params, FRAME_RATE.name) or DEFAULTS["frame_rate"])


def conditioning_frame_rate(params) -> float:
    """The frame rate the positions are conditioned on (diffusers' ``conditioning_frame_rate``)."""
    from diffusers.pipelines.ltx2.utils import conditioning_frame_rate as rate

    return rate(frame_rate(params), float(field_value(params, MOTION_SPEED.name) or 1.0))
