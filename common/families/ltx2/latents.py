"""LTX-2's latents part: both streams in one ``[S_v + S_a, C]`` tensor per sample (geometry.py), drawn as the
pipeline draws them (video noise, then audio noise, from one generator), and the layout a forward needs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from common.diffusion.parts.latents import LatentsPart
from common.families.ltx2.fields import DEFAULTS, STG_BLOCK, CROSS_TIMESTEP, conditioning_frame_rate, frame_rate
from common.diffusion.request_fields import field_value
from common.families.ltx2.geometry import STREAMS, Ltx2Geometry


@dataclass(frozen=True)
class Ltx2Layout:
    """What a forward's rows share beyond their tensors: the streams' geometry, the frame rate the positions
    are conditioned on, STG's block and the cross-timestep switch (forward-wide arguments of the model)."""

    geometry: Ltx2Geometry
    fps: float
    stg_block: int
    cross_timestep: bool


def geometry_of(info, params) -> Ltx2Geometry:
    return Ltx2Geometry.of(info.path, params.height, params.width, params.num_frames, frame_rate(params))


def _default_geometry(info, height: int, width: int, num_frames: int) -> Ltx2Geometry:
    rate = float(info.defaults.get("frame_rate", DEFAULTS["frame_rate"]))
    return Ltx2Geometry.of(info.path, height, width, num_frames, rate)


@dataclass(frozen=True, kw_only=True)
class Ltx2Latents(LatentsPart):
    video: bool = True
    streams: tuple[str, ...] = STREAMS

    def stream_masks(self, info, params):
        return {k: m[None].float() for k, m in geometry_of(info, params).stream_masks().items()}

    def shape(self, info, height, width, num_frames=1):
        """At the directory's default frame rate (the audio's length depends on it: see :meth:`request_shape`)."""
        g = _default_geometry(info, height, width, num_frames)
        return (1, g.tokens, g.width)

    def request_shape(self, info, params):
        g = geometry_of(info, params)
        return (1, g.tokens, g.width)

    def draw(self, info, params, generator: torch.Generator) -> torch.Tensor:
        g = geometry_of(info, params)
        video = torch.randn((1, *g.video_shape), generator=generator, dtype=torch.float32)
        audio = torch.randn((1, *g.audio_shape), generator=generator, dtype=torch.float32)
        return g.join(g.pack_video(video), g.pack_audio(audio))

    def image_seq_len(self, info, height, width, num_frames=1):
        """The video tokens: the pipeline's ``mu`` reads ``latents.shape[1]`` of the video stream alone."""
        return _default_geometry(info, height, width, num_frames).video_tokens

    def seq_len(self, info, params):
        return geometry_of(info, params).video_tokens

    def layout(self, info, params) -> Ltx2Layout:
        return Ltx2Layout(geometry_of(info, params), conditioning_frame_rate(params),
                          int(_or_default(field_value(params, STG_BLOCK.name), DEFAULTS["stg_block"])),
                          bool(_or_default(field_value(params, CROSS_TIMESTEP.name), DEFAULTS["use_cross_timestep"])))

    def layout_to_wire(self, grid: Ltx2Layout) -> dict:
        return {"geometry": dataclasses.asdict(grid.geometry), "fps": grid.fps, "stg_block": grid.stg_block,
                "cross_timestep": grid.cross_timestep}

    def layout_from_wire(self, value: dict) -> Ltx2Layout:
        return Ltx2Layout(Ltx2Geometry(**{k: int(v) for k, v in value["geometry"].items()}), float(value["fps"]),
                          int(value["stg_block"]), bool(value["cross_timestep"]))


def _or_default(value, default):
    return default if value is None else value
