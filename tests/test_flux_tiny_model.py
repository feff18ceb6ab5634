"""The tiny FLUX.1 model generator: deterministic files in FluxPipeline's layout, loadable by FluxPipeline,
prompt- and guidance-dependent images (embedded guidance and true CFG), and spec validation."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from common.builtin import BUILTINS
from common.builtin.__main__ import main as builtin_main
from common.builtin.build import build as build_tiny_flux
from common.builtin.specs.flux import SPECS, TinyFluxSpec, transformer_config
from common.builtin.tokenizer.clip import CLIP_L_PAD_TOKEN

PROMPTS = ("A small red fox runs in the forest at dawn, cinematic lighting.",
           "A giant silver robot swims over the ocean at night.")

# A spec unlike tiny-flux in every part: no guidance embedding, no single-stream blocks, other text
# encoder and VAE sizes, a static shift and a non-square default request.
ALT_SPEC = TinyFluxSpec(
    name="tiny-flux-alt",
    num_layers=2,
    num_single_layers=0,
    num_attention_heads=3,
    attention_head_dim=12,
    axes_dims_rope=(2, 6, 4),
    guidance_embeds=False,
    clip_l_hidden_size=24,
    clip_l_num_layers=1,
    clip_l_num_heads=3,
    clip_l_intermediate_size=40,
    t5_d_model=40,
    t5_d_kv=12,
    t5_d_ff=56,
    t5_num_layers=1,
    t5_num_heads=3,
    t5_vocab_size=320,
    vae_block_out_channels=(6, 6, 12, 12),
    vae_layers_per_block=2,
    vae_norm_num_groups=3,
    use_dynamic_shifting=False,
    shift=2.0,
    seed=7,
    height=48,
    width=80,
    num_inference_steps=3,
    guidance_scale=0.0,
    true_cfg_scale=1.5,
    max_sequence_length=24,
)


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _load(model_dir: Path):
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(pipe, prompt: str, **request) -> np.ndarray:
    return pipe(prompt, generator=torch.Generator("cpu").manual_seed(0), output_type="np", **request).images


def _check_image(image: np.ndarray, height: int, width: int) -> None:
    assert image.shape == (1, height, width, 3)
    assert np.isfinite(image).all() and image.min() >= 0.0 and image.max() <= 1.0


@pytest.fixture(scope="module")
def tiny_flux_dir(tmp_path_factory) -> Path:
    return build_tiny_flux(SPECS["tiny-flux"], tmp_path_factory.mktemp("tiny-flux"))


@pytest.fixture(scope="module")
def tiny_flux_pipe(tiny_flux_dir):
    return _load(tiny_flux_dir)


def test_build_is_byte_identical_and_leaves_global_state(tmp_path, tiny_flux_dir):
    torch.manual_seed(1234)
    rng_before = torch.get_rng_state()
    again = build_tiny_flux(SPECS["tiny-flux"], tmp_path / "again")
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert torch.get_default_dtype() == torch.float32

    first, second = _digests(tiny_flux_dir), _digests(again)
    assert first == second
    for part in ("model_index.json", "serving_defaults.json", "transformer/diffusion_pytorch_model.safetensors",
                 "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json",
                 "text_encoder/model.safetensors", "text_encoder_2/model.safetensors", "tokenizer/tokenizer.json",
                 "tokenizer_2/tokenizer.json"):
        assert part in first
    assert not any(p.startswith("text_encoder_3") or p.startswith("tokenizer_3") for p in first)


def test_model_index_is_flux_pipelines(tiny_flux_dir):
    index = json.loads((tiny_flux_dir / "model_index.json").read_text())
    assert index["_class_name"] == "FluxPipeline"
    assert index["transformer"] == ["diffusers", "FluxTransformer2DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKL"]
    assert index["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    # FluxPipeline pools CLIPTextModel's output (no projection head).
    assert index["text_encoder"] == ["transformers", "CLIPTextModel"]
    assert index["text_encoder_2"] == ["transformers", "T5EncoderModel"]


def test_serving_defaults_and_configs(tiny_flux_dir):
    spec = SPECS["tiny-flux"]
    text = (tiny_flux_dir / "serving_defaults.json").read_text()
    assert text.endswith("}\n")
    assert json.loads(text) == {"height": 64, "width": 64, "num_inference_steps": 4, "guidance_scale": 3.5,
                                "true_cfg_scale": 1.0, "max_sequence_length": 32}
    transformer = json.loads((tiny_flux_dir / "transformer" / "config.json").read_text())
    assert transformer["_class_name"] == "FluxTransformer2DModel"
    assert (transformer["in_channels"], transformer["patch_size"], transformer["out_channels"]) == (64, 1, None)
    assert transformer["joint_attention_dim"] == spec.t5_d_model
    assert transformer["pooled_projection_dim"] == spec.clip_l_hidden_size
    assert transformer["guidance_embeds"] is True
    assert sum(transformer["axes_dims_rope"]) == transformer["attention_head_dim"] == spec.attention_head_dim
    vae = json.loads((tiny_flux_dir / "vae" / "config.json").read_text())
    assert (vae["latent_channels"], vae["scaling_factor"], vae["shift_factor"]) == (16, 0.3611, 0.1159)
    assert len(vae["block_out_channels"]) == 4
    assert not vae["use_quant_conv"] and not vae["use_post_quant_conv"]
    scheduler = json.loads((tiny_flux_dir / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["_class_name"] == "FlowMatchEulerDiscreteScheduler"
    assert {k: scheduler[k] for k in ("num_train_timesteps", "shift", "use_dynamic_shifting", "base_shift",
                                      "max_shift", "base_image_seq_len", "max_image_seq_len")} == {
        "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "base_shift": 0.5,
        "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096}


def test_loaded_components(tiny_flux_pipe):
    from transformers import CLIPTextModel, T5EncoderModel

    pipe = tiny_flux_pipe
    assert type(pipe.text_encoder) is CLIPTextModel and type(pipe.text_encoder_2) is T5EncoderModel
    assert pipe.tokenizer.pad_token == CLIP_L_PAD_TOKEN and pipe.tokenizer_max_length == 77
    assert pipe.vae_scale_factor == 8
    embeds, pooled, text_ids = pipe.encode_prompt(PROMPTS[0], prompt_2=None, max_sequence_length=32)
    assert embeds.shape == (1, 32, pipe.transformer.config.joint_attention_dim)
    assert pooled.shape == (1, pipe.transformer.config.pooled_projection_dim)
    assert text_ids.shape == (32, 3)


@pytest.mark.parametrize("height, width", [(64, 64), (32, 48)])
def test_pipeline_gives_prompt_dependent_images(tiny_flux_pipe, height, width):
    request = dict(height=height, width=width, num_inference_steps=2, guidance_scale=3.5, max_sequence_length=32)
    first, second = (_generate(tiny_flux_pipe, p, **request) for p in PROMPTS)
    for image in (first, second):
        _check_image(image, height, width)
    assert np.abs(first - second).max() > 1e-3
    # Deterministic given the generator.
    assert np.array_equal(first, _generate(tiny_flux_pipe, PROMPTS[0], **request))


def test_embedded_guidance_changes_the_image(tiny_flux_pipe):
    request = dict(height=64, width=64, num_inference_steps=2, max_sequence_length=32)
    low, high = (_generate(tiny_flux_pipe, PROMPTS[0], guidance_scale=g, **request) for g in (1.0, 3.5))
    _check_image(low, 64, 64)
    assert np.abs(low - high).max() > 1e-3


def test_true_cfg_with_a_negative_prompt(tiny_flux_pipe):
    request = dict(height=64, width=64, num_inference_steps=2, guidance_scale=3.5, max_sequence_length=32)
    plain = _generate(tiny_flux_pipe, PROMPTS[0], **request)
    cfg = _generate(tiny_flux_pipe, PROMPTS[0], true_cfg_scale=2.0, negative_prompt="x", **request)
    _check_image(cfg, 64, 64)
    assert np.abs(cfg - plain).max() > 1e-3
    # Without a negative prompt, true_cfg_scale alone changes nothing.
    assert np.array_equal(plain, _generate(tiny_flux_pipe, PROMPTS[0], true_cfg_scale=2.0, **request))


def test_non_default_spec_builds_and_runs(tmp_path):
    model_dir = build_tiny_flux(ALT_SPEC, tmp_path / "alt")
    pipe = _load(model_dir)
    config = pipe.transformer.config
    assert (config.num_layers, config.num_single_layers, config.num_attention_heads) == (2, 0, 3)
    assert tuple(config.axes_dims_rope) == (2, 6, 4) and not config.guidance_embeds
    assert pipe.text_encoder.config.hidden_size == 24 and pipe.text_encoder_2.config.d_model == 40
    assert not pipe.scheduler.config.use_dynamic_shifting
    request = dict(height=48, width=80, num_inference_steps=2, max_sequence_length=24)
    first, second = (_generate(pipe, p, **request) for p in PROMPTS)
    _check_image(first, 48, 80)
    assert np.abs(first - second).max() > 1e-3
    cfg = _generate(pipe, PROMPTS[0], true_cfg_scale=1.5, negative_prompt="x", **request)
    _check_image(cfg, 48, 80)


def test_cli_and_weights_dtype(tmp_path, capsys):
    from safetensors import safe_open

    builtin_main(["tiny-flux", "--out", str(tmp_path), "--dtype", "bfloat16"])
    out = tmp_path / "tiny-flux"
    assert Path(capsys.readouterr().out.strip()) == out.resolve()
    with safe_open(out / "transformer" / "diffusion_pytorch_model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    pipe = _load(out)
    pipe.to(torch.float32)
    image = _generate(pipe, PROMPTS[0], height=32, width=32, num_inference_steps=1, max_sequence_length=16)
    _check_image(image, 32, 32)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(axes_dims_rope=(4, 6, 8)), "sum to attention_head_dim"),
        (dict(axes_dims_rope=(4, 5, 7)), "even"),
        (dict(axes_dims_rope=(8, 8)), "axes_dims_rope"),
        (dict(num_layers=0), "transformer sizes"),
        (dict(height=72), "multiples of 16"),
        (dict(width=8), "multiples of 16"),
        (dict(vae_block_out_channels=(4,)), "vae_block_out_channels"),  # no downsampling
        (dict(vae_norm_num_groups=3), "vae_norm_num_groups"),
        (dict(clip_l_num_heads=5), "clip_l_hidden_size"),
        (dict(t5_d_ff=0), "T5 sizes"),
        (dict(t5_vocab_size=16), "t5_vocab_size"),
        (dict(base_image_seq_len=4096), "max_image_seq_len"),
        (dict(shift=0.0), "shift"),
        (dict(max_sequence_length=513), "max_sequence_length"),
        (dict(num_inference_steps=0), "num_inference_steps"),
        (dict(true_cfg_scale=0.5), "true_cfg_scale"),
        (dict(weights_dtype="int8"), "weights_dtype"),  # (float16 is a stored dtype)
    ],
)
def test_spec_validation(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SPECS["tiny-flux"], **change)


def test_named_specs_and_builtins():
    from diffusers import FluxTransformer2DModel

    assert {"tiny-flux", "small-flux"} <= set(BUILTINS)
    assert all(BUILTINS[name] is spec for name, spec in SPECS.items())
    tiny, small = SPECS["tiny-flux"], SPECS["small-flux"]
    assert (tiny.height, tiny.width, tiny.num_inference_steps, tiny.guidance_scale) == (64, 64, 4, 3.5)
    assert (small.height, small.width, small.num_inference_steps) == (256, 256, 10)
    for spec in SPECS.values():
        assert spec.guidance_embeds and spec.true_cfg_scale == 1.0
        assert sum(spec.axes_dims_rope) == spec.attention_head_dim
    with torch.device("meta"):
        params = sum(p.numel() for p in FluxTransformer2DModel(**transformer_config(small)).parameters())
    assert 15e6 <= params <= 25e6
