"""LTX-2 served equal to diffusers' ``LTX2Pipeline`` / ``LTX2ImageToVideoPipeline``: both streams' latents, the
frames and the waveform, on the built-ins and on another configuration, with each guidance on and off."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from common.builtin import BUILTINS, ensure_builtin
from common.builtin.build import build as build_builtin
from common.builtin.specs.ltx2 import SPECS
from common.families import read_model
from common.families.ltx2.latents import geometry_of
from family_harness import ModuleModels, max_diff
from family_harness import gradient_picture as picture

TOL = 1e-4
# Other widths, depth, STG block, text budget and vocoder than the built-in's.
LTX2_X = dataclasses.replace(SPECS["tiny-ltx2"], name="ltx2-test-x", num_layers=3, num_attention_heads=3,
                             attention_head_dim=8, audio_num_attention_heads=1, audio_attention_head_dim=12,
                             text_num_layers=3, connector_num_registers=16, stg_block=2, seed=7,
                             vocoder_upsample_factors=(4, 5, 8), vocoder_output_sampling_rate=16000)

LTX2_X_I2V = dataclasses.replace(LTX2_X, name="ltx2-test-x-i2v", image_to_video=True)
OTHER = {LTX2_X.name: LTX2_X, LTX2_X_I2V.name: LTX2_X_I2V}
# The streams' token widths apart (LTX2Pipeline runs such a model; the engine pads the narrower stream): audio
# tokens 32 wide (8 latent channels x 16 mel bins / 4) beside the video's 16, and 8 wide (2 channels).
WIDE_AUDIO = dataclasses.replace(SPECS["tiny-ltx2"], name="ltx2-test-wide-audio", audio_latent_channels=8, seed=5)
WIDE_AUDIO_I2V = dataclasses.replace(WIDE_AUDIO, name="ltx2-test-wide-audio-i2v", image_to_video=True)
NARROW_AUDIO = dataclasses.replace(SPECS["tiny-ltx2"], name="ltx2-test-narrow-audio", audio_latent_channels=2,
                                   seed=6)
WIDTHS_APART = {s.name: s for s in (WIDE_AUDIO, WIDE_AUDIO_I2V, NARROW_AUDIO)}

_MODELS = ModuleModels()
_DIRS: dict[str, object] = {}

# The audio fields at 0: the video field's value (the pipeline's `audio_x or x`).
OFF = dict(stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_guidance_scale=0.0, audio_stg_scale=0.0,
           audio_modality_scale=0.0, audio_guidance_rescale=0.0)
CASES = {
    "no-guidance": dict(model="tiny-ltx2", guidance_scale=1.0, **OFF),
    "cfg": dict(model="tiny-ltx2", guidance_scale=4.0, **OFF),
    "cfg-stg": dict(model="tiny-ltx2", guidance_scale=4.0, **{**OFF, "stg_scale": 1.5}),
    "all-rescale": dict(model="tiny-ltx2", guidance_scale=3.0, stg_scale=1.0, modality_scale=3.0,
                        guidance_rescale=0.7, audio_guidance_scale=7.0, audio_stg_scale=0.5,
                        audio_modality_scale=2.0, audio_guidance_rescale=0.3),
    # another configuration, frame rate and a non-square size; audio guidance alone turns CFG on
    "x-16fps": dict(model="ltx2-test-x", guidance_scale=1.0, height=96, width=64, num_frames=17, frame_rate=16.0,
                    **{**OFF, "audio_guidance_scale": 5.0, "modality_scale": 2.0}),
    # the audio fields left out: the pipeline signature's defaults on both sides
    "i2v": dict(model="tiny-ltx2-i2v", guidance_scale=4.0, stg_scale=1.0, modality_scale=2.0, guidance_rescale=0.5,
                image=(50, 70)),
    # another configuration's image-to-video
    "x-i2v-tall": dict(model="ltx2-test-x-i2v", guidance_scale=3.0, height=96, width=64, stg_scale=1.0,
                       modality_scale=1.0, guidance_rescale=0.0, audio_guidance_scale=0.0, audio_stg_scale=0.0,
                       audio_modality_scale=0.0, audio_guidance_rescale=0.0, image_crf=0, image=(70, 40)),
    # the streams' widths apart: every pass, and rescale (a std over each stream's own elements, no padding)
    "audio-wider": dict(model="ltx2-test-wide-audio", guidance_scale=3.0, stg_scale=1.0, modality_scale=2.0,
                        guidance_rescale=0.7, audio_guidance_scale=5.0, audio_stg_scale=0.5,
                        audio_modality_scale=3.0, audio_guidance_rescale=0.4),
    "audio-narrower": dict(model="ltx2-test-narrow-audio", guidance_scale=4.0, stg_scale=1.0, modality_scale=2.0,
                           guidance_rescale=0.5, height=96, width=64, num_frames=17, frame_rate=16.0),
    # the image's frame-0 tokens padded to the audio's width
    "audio-wider-i2v": dict(model="ltx2-test-wide-audio-i2v", guidance_scale=3.0, stg_scale=1.0, modality_scale=2.0,
                            guidance_rescale=0.5, image=(50, 70)),
}


@pytest.fixture(scope="module", autouse=True)
def _module_state():
    yield from _MODELS.module_scope(_DIRS)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    def get(which: str):
        if which not in _DIRS:
            _DIRS[which] = (ensure_builtin(which) if which in BUILTINS
                            else ensure_builtin(WIDTHS_APART[which]) if which in WIDTHS_APART
                            else build_builtin(OTHER[which], tmp_path_factory.mktemp(which)))
        return _DIRS[which]
    return get



def request(eng, case: dict):
    """The case as the engine's params and as the pipeline's call (the same values)."""
    case = {k: v for k, v in case.items() if k not in ("model", "image")}
    d = eng.info.defaults
    size = dict(height=case.pop("height", d["height"]), width=case.pop("width", d["width"]),
                num_frames=case.pop("num_frames", d["num_frames"]))
    rate = case.pop("frame_rate", 24.0)
    p = eng.params(**size, num_inference_steps=3, frame_rate=rate, negative_prompt="blurry, silent",
                   **{k: v for k, v in case.items() if v is not None})
    call = dict(prompt=p.prompt, negative_prompt=p.negative_prompt, num_inference_steps=3, frame_rate=rate,
                max_sequence_length=p.max_sequence_length, spatio_temporal_guidance_blocks=[d["stg_block"]],
                generator=torch.Generator().manual_seed(p.seed), **size, **case)
    return p, call


def pipeline_latents(pipe, lat: torch.Tensor, eng, p):
    """The engine's joint latents as the pipeline's ``output_type="latent"`` gives them (both de-normalised)."""
    from diffusers import LTX2Pipeline

    g = geometry_of(eng.info, p)
    video, audio = g.split(lat)
    video = LTX2Pipeline._denormalize_latents(g.unpack_video(video), pipe.vae.latents_mean, pipe.vae.latents_std,
                                              pipe.vae.config.scaling_factor)
    audio = LTX2Pipeline._denormalize_audio_latents(audio, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
    return video, g.unpack_audio(audio)


@pytest.mark.parametrize("name", list(CASES))
def test_serving_equals_the_pipeline(name, dirs, record_property):
    case = CASES[name]
    model_dir = dirs(case["model"])
    eng, pipe = _MODELS.engine(model_dir), _MODELS.pipe(model_dir)
    p, call = request(eng, case)
    image = None if "image" not in case else picture(*case["image"])
    extra = {} if image is None else {"image": image}
    task = eng.run(p, image=image)
    lat = task.output_latents()
    video, audio = pipeline_latents(pipe, lat, eng, p)
    ref = pipe(**call, **extra, output_type="latent")
    out = eng.decoded(lat, p)
    call["generator"] = torch.Generator().manual_seed(p.seed)
    shown = pipe(**call, **extra, output_type="pt")
    diffs = {"video latents": max_diff(video, ref.frames), "audio latents": max_diff(audio, ref.audio),
             "frames": max_diff(out.frames[0], shown.frames[0].permute(0, 2, 3, 1)),
             "waveform": max_diff(out.audio, shown.audio)}
    record_property("diffs", diffs)
    assert out.sample_rate == pipe.vocoder.config.output_sampling_rate
    assert all(d <= TOL for d in diffs.values()), diffs


def test_each_guidance_changes_both_streams(dirs):
    """Not a vacuous match: turning each pass on changes the video and the audio latents."""
    eng = _MODELS.engine(dirs("tiny-ltx2"))
    base = dict(guidance_scale=4.0, **OFF)
    runs = {}
    for name, over in {"cfg": {}, "stg": {"stg_scale": 2.0}, "modality": {"modality_scale": 3.0},
                       "rescale": {"guidance_rescale": 0.9}}.items():
        p, _ = request(eng, {**base, **over})
        runs[name] = geometry_of(eng.info, p).split(eng.run(p).output_latents())
    for name in ("stg", "modality", "rescale"):
        for k in (0, 1):
            assert max_diff(runs[name][k], runs["cfg"][k]) > 1e-3, (name, k)


def test_the_launcher_reads_models_whose_streams_widths_differ(dirs, tmp_path):
    """The launcher's read of a directory (``launch.model_info``) takes both; a transformer whose audio width is
    not the audio tokens' the pipeline packs (its forward would fail) is refused naming ``audio_in_channels``."""
    from launch import model_info

    for name in ("ltx2-test-wide-audio", "ltx2-test-narrow-audio"):
        info = model_info(dirs(name))
        assert info.family.pipeline == "LTX2Pipeline" and info.latent_channels == 16
    bad = shutil.copytree(dirs("ltx2-test-narrow-audio"), tmp_path / "bad")
    config = bad / "audio_vae" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "latent_channels": 4}))
    with pytest.raises(ValueError, match="audio_in_channels 8 is not .* 16 "):
        read_model(bad)
