"""The tiny Wan image-to-video model generator: deterministic files in the layouts of Wan2.1 I2V, Wan2.2
I2V-A14B and Wan2.2 TI2V-5B, loaded and run by diffusers' own pipelines (image-dependent videos from images
of another size than the request), and spec validation."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.builtin import BUILTINS, ensure_builtin
from common.builtin.build import build as build_tiny_wan_i2v
from common.builtin.specs.wan import transformer_config as wan_transformer_config
from common.builtin.specs.wan_i2v import (
    SPECS,
    WAN22_LATENTS_MEAN,
    TinyWanI2VSpec,
    transformer_config,
    vae_config,
)

PROMPT = "A small red fox runs in the forest at dawn, cinematic lighting."

# Wan2.1 I2V with other sizes everywhere: a wider CLIP on 48 px images in 16 px patches (10 tokens), three
# heads, another text encoder and VAE width, a non-square 9-frame request.
ALT_CLIP = TinyWanI2VSpec(
    name="tiny-wan-i2v-alt",
    image_encoder=True,
    vision_hidden_size=24,
    vision_layers=3,
    vision_heads=3,
    vision_intermediate_size=40,
    vision_image_size=48,
    vision_patch_size=16,
    num_attention_heads=3,
    attention_head_dim=8,
    ffn_dim=48,
    freq_dim=8,
    text_dim=24,
    text_heads=3,
    text_d_ff=40,
    text_d_kv=8,
    vae_base_dim=6,
    seed=13,
    height=32,
    width=48,
    num_frames=9,
    num_inference_steps=3,
    guidance_scale=4.0,
)
# Wan2.2-style image-to-video with one expert and no image encoder, without guidance, portrait.
ALT_PLAIN = TinyWanI2VSpec(name="tiny-wan-i2v-plain", seed=14, height=48, width=32, num_inference_steps=2,
                           guidance_scale=1.0)
ALL_SPECS = {**SPECS, ALT_CLIP.name: ALT_CLIP, ALT_PLAIN.name: ALT_PLAIN}


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _image(seed: int, width: int = 40, height: int = 24) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _load(cls_name: str, model_dir: Path):
    import diffusers

    pipe = getattr(diffusers, cls_name).from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _request(spec: TinyWanI2VSpec) -> dict:
    return dict(height=spec.height, width=spec.width, num_frames=spec.num_frames,
                num_inference_steps=spec.num_inference_steps, guidance_scale=spec.guidance_scale)


def _generate(pipe, image=None, **request) -> np.ndarray:
    args = dict(prompt=PROMPT, generator=torch.Generator("cpu").manual_seed(0), output_type="np", **request)
    if image is not None:
        args["image"] = image
    return pipe(**args).frames


def _check_video(frames: np.ndarray, spec: TinyWanI2VSpec, **request) -> None:
    height, width = request.get("height", spec.height), request.get("width", spec.width)
    assert frames.shape == (1, request.get("num_frames", spec.num_frames), height, width, 3)
    assert np.isfinite(frames).all() and frames.min() >= 0.0 and frames.max() <= 1.0


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    return {name: build_tiny_wan_i2v(spec, tmp_path_factory.mktemp(name)) for name, spec in ALL_SPECS.items()}


@pytest.mark.parametrize("name", sorted(ALL_SPECS))
def test_build_is_byte_identical_and_leaves_global_state(name, model_dirs, tmp_path):
    torch.manual_seed(1234)
    rng_before = torch.get_rng_state()
    again = build_tiny_wan_i2v(ALL_SPECS[name], tmp_path / "again")
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert torch.get_default_dtype() == torch.float32
    assert _digests(model_dirs[name]) == _digests(again)


@pytest.mark.parametrize("name", sorted(ALL_SPECS))
def test_model_index_and_configs(name, model_dirs):
    spec, model_dir = ALL_SPECS[name], model_dirs[name]
    index = json.loads((model_dir / "model_index.json").read_text())
    assert index["_class_name"] == ("WanPipeline" if spec.expand_timesteps else "WanImageToVideoPipeline")
    assert index["transformer"] == ["diffusers", "WanTransformer3DModel"]
    assert index["transformer_2"] == (["diffusers", "WanTransformer3DModel"] if spec.two_experts else [None, None])
    assert index["vae"] == ["diffusers", "AutoencoderKLWan"]
    assert index["text_encoder"] == ["transformers", "UMT5EncoderModel"]
    assert index["scheduler"] == ["diffusers", "UniPCMultistepScheduler"]
    assert index["boundary_ratio"] == spec.boundary_ratio
    assert index["expand_timesteps"] is spec.expand_timesteps
    files = _digests(model_dir)
    if spec.expand_timesteps:
        # WanPipeline has no image components at all.
        assert "image_encoder" not in index and "image_processor" not in index
    elif spec.image_encoder:
        assert index["image_encoder"] == ["transformers", "CLIPVisionModel"]
        assert index["image_processor"] == ["transformers", "CLIPImageProcessor"]
        processor = json.loads((model_dir / "image_processor" / "preprocessor_config.json").read_text())
        side = spec.vision_image_size
        assert processor["image_processor_type"] == "CLIPImageProcessor"
        assert processor["size"] == {"shortest_edge": side}
        assert processor["crop_size"] == {"height": side, "width": side}
        assert processor["do_center_crop"] and processor["resample"] == 3
        vision = json.loads((model_dir / "image_encoder" / "config.json").read_text())
        assert vision["architectures"] == ["CLIPVisionModel"]
        assert (vision["hidden_size"], vision["image_size"], vision["patch_size"]) == (
            spec.vision_hidden_size, spec.vision_image_size, spec.vision_patch_size)
    else:
        # Saved as null components, as diffusers saves Wan2.2 I2V-A14B.
        assert index["image_encoder"] == [None, None] and index["image_processor"] == [None, None]
        assert not any(p.startswith("image_") for p in files)

    transformer = json.loads((model_dir / "transformer" / "config.json").read_text())
    # TI2V: the 48 latent channels; I2V: 16 noise, 4 mask and 16 first-frame channels in, 16 out.
    channels = (48, 48) if spec.expand_timesteps else (36, 16)
    assert (transformer["in_channels"], transformer["out_channels"]) == channels
    inner = spec.num_attention_heads * spec.attention_head_dim
    assert transformer["image_dim"] == (spec.vision_hidden_size if spec.image_encoder else None)
    assert transformer["added_kv_proj_dim"] == (inner if spec.image_encoder else None)
    vae = json.loads((model_dir / "vae" / "config.json").read_text())
    assert vae["z_dim"] == transformer["out_channels"] == len(vae["latents_mean"]) == len(vae["latents_std"])
    scheduler = json.loads((model_dir / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["flow_shift"] == spec.flow_shift and scheduler["prediction_type"] == "flow_prediction"
    assert json.loads((model_dir / "serving_defaults.json").read_text()) == _request(spec)


def test_wan22_vae_config(model_dirs):
    vae = json.loads((model_dirs["tiny-wan-ti2v"] / "vae" / "config.json").read_text())
    assert {k: vae[k] for k in ("z_dim", "is_residual", "in_channels", "out_channels", "patch_size",
                                "scale_factor_spatial", "scale_factor_temporal", "temperal_downsample")} == {
        "z_dim": 48, "is_residual": True, "in_channels": 12, "out_channels": 12, "patch_size": 2,
        "scale_factor_spatial": 16, "scale_factor_temporal": 4, "temperal_downsample": [False, True, True]}
    assert (vae["base_dim"], vae["decoder_base_dim"]) == (4, 6)
    assert vae["latents_mean"] == list(WAN22_LATENTS_MEAN)
    # The Wan2.1 layouts keep the Wan2.1 VAE.
    wan21 = json.loads((model_dirs["tiny-wan-i2v"] / "vae" / "config.json").read_text())
    assert (wan21["z_dim"], wan21["is_residual"], wan21["patch_size"], wan21["scale_factor_spatial"]) == (
        16, False, None, 8)


# small-wan-i2v (~9 s) is a second size of tiny-wan-i2v: heavy
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.heavy) if n == "small-wan-i2v" else n
                                  for n in sorted(ALL_SPECS)])
def test_image_to_video_with_diffusers_pipeline(name, model_dirs):
    spec = ALL_SPECS[name]
    # diffusers runs every layout's image-to-video with WanImageToVideoPipeline, TI2V's too.
    pipe = _load("WanImageToVideoPipeline", model_dirs[name])
    assert (pipe.image_encoder is not None) == spec.image_encoder
    assert pipe.vae_scale_factor_spatial == spec.vae_spatial_stride
    request = _request(spec)
    # 40x24 images: resized by the pipeline to the request, and by CLIPImageProcessor to its crop.
    first, second = (_generate(pipe, _image(seed), **request) for seed in (1, 2))
    for frames in (first, second):
        _check_video(frames, spec)
    assert np.abs(first - second).max() > 1e-3
    assert np.array_equal(first, _generate(pipe, _image(1), **request))


def test_clip_image_embeddings(model_dirs):
    spec = ALL_SPECS["tiny-wan-i2v-alt"]
    pipe = _load("WanImageToVideoPipeline", model_dirs[spec.name])
    tokens = (spec.vision_image_size // spec.vision_patch_size) ** 2 + 1
    embeds = pipe.encode_image(_image(1), torch.device("cpu"))
    assert embeds.shape == (1, tokens, spec.vision_hidden_size)
    # Any image size is cropped to the encoder's; different images differ.
    other = pipe.encode_image(_image(2, width=17, height=50), torch.device("cpu"))
    assert other.shape == embeds.shape and (embeds - other).abs().max() > 1e-3


def test_both_experts_run(model_dirs):
    spec = SPECS["tiny-wan-i2v-a14b"]
    pipe = _load("WanImageToVideoPipeline", model_dirs[spec.name])
    calls = {"transformer": 0, "transformer_2": 0}
    for name in calls:
        getattr(pipe, name).register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    _generate(pipe, _image(1), **_request(spec))
    # Two forwards (guidance) per step: timesteps 999/937 on the high-noise expert, 833/625 on the other.
    assert calls == {"transformer": 4, "transformer_2": 4}


def test_ti2v_text_to_video_with_wan_pipeline(model_dirs):
    spec = SPECS["tiny-wan-ti2v"]
    pipe = _load("WanPipeline", model_dirs[spec.name])
    assert pipe.config.expand_timesteps and pipe.vae_scale_factor_spatial == 16
    request = dict(height=32, width=64, num_frames=5, num_inference_steps=2, guidance_scale=5.0)
    text_only = _generate(pipe, **request)
    _check_video(text_only, spec, **request)
    i2v = _generate(_load("WanImageToVideoPipeline", model_dirs[spec.name]), _image(1), **request)
    _check_video(i2v, spec, **request)
    assert np.abs(text_only - i2v).max() > 1e-3


def test_builtins_and_cache(tmp_path):
    for name, spec in SPECS.items():
        assert BUILTINS[name] is spec and isinstance(spec, TinyWanI2VSpec)
    assert (SPECS["tiny-wan-i2v"].height, SPECS["tiny-wan-ti2v"].height) == (32, 64)
    model_dir = ensure_builtin("tiny-wan-i2v-a14b", tmp_path)
    assert model_dir.name.startswith("tiny-wan-i2v-a14b-")
    assert ensure_builtin("tiny-wan-i2v-a14b", tmp_path) == model_dir
    # The transformer is the Wan text-to-video builder's with the image-to-video channels.
    spec = SPECS["tiny-wan-i2v"]
    changed = {k for k, v in transformer_config(spec).items() if wan_transformer_config(spec)[k] != v}
    assert changed == {"in_channels", "image_dim", "added_kv_proj_dim"}
    assert vae_config(SPECS["tiny-wan-i2v-a14b"])["z_dim"] == 16


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(height=48), "multiples of 32"),
        (dict(width=80), "multiples of 32"),
        (dict(expand_timesteps=False), "expand_timesteps goes with the Wan2.2 VAE"),
        (dict(vae_layout="wan2.1"), "expand_timesteps goes with the Wan2.2 VAE"),
        (dict(image_encoder=True), "one expert and no image encoder"),
        (dict(two_experts=True, boundary_ratio=0.9), "one expert and no image encoder"),
        (dict(vae_layout="wan3"), "vae_layout"),
        (dict(vae_decoder_base_dim=0), "vae_decoder_base_dim"),
        (dict(num_frames=6), "4k\\+1"),
    ],
)
def test_ti2v_spec_validation(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SPECS["tiny-wan-ti2v"], **change)


@pytest.mark.parametrize(
    "base, change, message",
    [
        ("tiny-wan-i2v", dict(two_experts=True, boundary_ratio=0.9), "one expert"),
        ("tiny-wan-i2v", dict(vision_heads=3), "multiple of vision_heads"),
        ("tiny-wan-i2v", dict(vision_patch_size=5), "multiple of vision_patch_size"),
        ("tiny-wan-i2v", dict(vision_layers=0), "vision sizes"),
        ("tiny-wan-i2v", dict(height=40), "multiples of 16"),
        ("tiny-wan-i2v-a14b", dict(boundary_ratio=None), "boundary_ratio"),
        ("tiny-wan-i2v-a14b", dict(expand_timesteps=True), "expand_timesteps goes with the Wan2.2 VAE"),
        ("tiny-wan-i2v-a14b", dict(vae_layout="wan2.2"), "expand_timesteps goes with the Wan2.2 VAE"),
    ],
)
def test_spec_validation(base, change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SPECS[base], **change)
