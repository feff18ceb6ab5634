"""The tiny SD3 model generator: deterministic files, loadable by StableDiffusion3Pipeline, prompt-dependent
images, round-tripping CLIP tokenizers and spec validation."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import string
from pathlib import Path

import numpy as np
import pytest
import torch

from common.builtin.build import build as build_tiny_sd3
from common.builtin.specs.sd3 import SPECS, TinySD3Spec
from common.builtin.tokenizer.clip import (
    BOS_TOKEN,
    CLIP_G_PAD_TOKEN,
    CLIP_L_PAD_TOKEN,
    EOS_TOKEN,
    clip_tokenizer as build_clip_tokenizer,
)

PROMPTS = ("A small red fox runs in the forest at dawn, cinematic lighting.",
           "A giant silver robot swims over the ocean at night.")
# Every printable ASCII character, upper case and unknown words included.
ODD_PROMPT = "Zyx QUIRK 42 " + string.punctuation

# A spec unlike tiny-sd3 in every part: SD3.5-style blocks, other text encoder and VAE sizes and a
# non-square default request.
ALT_SPEC = TinySD3Spec(
    name="tiny-sd3-alt",
    num_layers=3,
    num_attention_heads=3,
    attention_head_dim=8,
    sample_size=4,
    pos_embed_max_size=16,
    dual_attention_layers=(0,),
    qk_norm="rms_norm",
    clip_l_hidden_size=24,
    clip_l_num_layers=1,
    clip_l_num_heads=3,
    clip_l_intermediate_size=40,
    clip_l_projection_dim=16,
    clip_g_hidden_size=40,
    clip_g_num_layers=3,
    clip_g_num_heads=4,
    clip_g_intermediate_size=56,
    clip_g_projection_dim=24,
    t5_d_model=72,
    t5_d_kv=12,
    t5_d_ff=88,
    t5_num_layers=1,
    t5_num_heads=3,
    t5_vocab_size=320,
    vae_block_out_channels=(6, 6, 12, 12),
    vae_layers_per_block=2,
    vae_norm_num_groups=3,
    shift=2.0,
    seed=7,
    height=48,
    width=80,
    num_inference_steps=3,
    guidance_scale=3.0,
    max_sequence_length=24,
)


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _load(model_dir: Path):
    from diffusers import StableDiffusion3Pipeline

    pipe = StableDiffusion3Pipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _generate(pipe, prompt: str, **request) -> np.ndarray:
    return pipe(prompt, generator=torch.Generator("cpu").manual_seed(0), output_type="np", **request).images


@pytest.fixture(scope="module")
def tiny_sd3_dir(tmp_path_factory) -> Path:
    return build_tiny_sd3(SPECS["tiny-sd3"], tmp_path_factory.mktemp("tiny-sd3"))


def test_build_is_byte_identical_and_leaves_global_state(tmp_path, tiny_sd3_dir):
    torch.manual_seed(1234)
    rng_before = torch.get_rng_state()
    again = build_tiny_sd3(SPECS["tiny-sd3"], tmp_path / "again")
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert torch.get_default_dtype() == torch.float32

    first, second = _digests(tiny_sd3_dir), _digests(again)
    assert first == second
    for part in ("model_index.json", "serving_defaults.json", "transformer/diffusion_pytorch_model.safetensors",
                 "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json",
                 "text_encoder/model.safetensors", "text_encoder_2/model.safetensors",
                 "text_encoder_3/model.safetensors", "tokenizer/tokenizer.json", "tokenizer_2/tokenizer.json",
                 "tokenizer_3/tokenizer.json"):
        assert part in first


def test_serving_defaults_and_configs(tiny_sd3_dir):
    spec = SPECS["tiny-sd3"]
    text = (tiny_sd3_dir / "serving_defaults.json").read_text()
    assert text.endswith("}\n")
    assert json.loads(text) == {"height": 64, "width": 64, "num_inference_steps": 4, "guidance_scale": 4.5,
                                "max_sequence_length": 32}
    transformer = json.loads((tiny_sd3_dir / "transformer" / "config.json").read_text())
    assert transformer["joint_attention_dim"] == spec.t5_d_model
    assert transformer["pooled_projection_dim"] == spec.clip_l_projection_dim + spec.clip_g_projection_dim
    assert transformer["caption_projection_dim"] == spec.num_attention_heads * spec.attention_head_dim
    vae = json.loads((tiny_sd3_dir / "vae" / "config.json").read_text())
    assert (vae["latent_channels"], vae["scaling_factor"], vae["shift_factor"]) == (16, 1.5305, 0.0609)
    assert not vae["use_quant_conv"] and not vae["use_post_quant_conv"]
    scheduler = json.loads((tiny_sd3_dir / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["_class_name"] == "FlowMatchEulerDiscreteScheduler"
    assert (scheduler["num_train_timesteps"], scheduler["shift"]) == (1000, 3.0)


def test_pipeline_gives_prompt_dependent_images(tiny_sd3_dir):
    pipe = _load(tiny_sd3_dir)
    assert pipe.tokenizer.pad_token == CLIP_L_PAD_TOKEN and pipe.tokenizer_2.pad_token == CLIP_G_PAD_TOKEN
    request = dict(height=64, width=64, num_inference_steps=2, guidance_scale=4.5, max_sequence_length=32)
    first, second = (_generate(pipe, p, **request) for p in PROMPTS)
    for image in (first, second):
        assert image.shape == (1, 64, 64, 3)
        assert np.isfinite(image).all() and image.min() >= 0.0 and image.max() <= 1.0
    assert np.abs(first - second).max() > 1e-3
    # Deterministic given the generator.
    assert np.array_equal(first, _generate(pipe, PROMPTS[0], **request))


@pytest.mark.parametrize("pad_token", [CLIP_L_PAD_TOKEN, CLIP_G_PAD_TOKEN])
def test_clip_tokenizer_round_trips(tmp_path, pad_token):
    from transformers import AutoTokenizer, CLIPTokenizer

    tokenizer = build_clip_tokenizer(pad_token)
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (BOS_TOKEN, EOS_TOKEN, pad_token)
    assert tokenizer.model_max_length == 77
    tokenizer.save_pretrained(tmp_path)

    prompts = [*PROMPTS, ODD_PROMPT, ""]
    padded = dict(padding="max_length", max_length=77, truncation=True)
    expected = tokenizer(prompts, **padded).input_ids
    for cls in (AutoTokenizer, CLIPTokenizer):
        loaded = cls.from_pretrained(tmp_path)
        assert type(loaded) is CLIPTokenizer
        assert loaded.pad_token == pad_token and loaded.model_max_length == 77
        assert loaded(prompts, **padded).input_ids == expected

    # No printable character falls back to unk (which is <|endoftext|>, as in CLIP).
    ids = tokenizer(ODD_PROMPT).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert tokenizer.eos_token_id not in ids[1:-1]
    # Common corpus words are single tokens.
    assert len(tokenizer("the forest").input_ids) == 4


def test_both_tokenizers_share_the_vocabulary():
    clip_l, clip_g = build_clip_tokenizer(CLIP_L_PAD_TOKEN), build_clip_tokenizer(CLIP_G_PAD_TOKEN)
    assert clip_l.get_vocab() == clip_g.get_vocab()
    assert clip_l(PROMPTS[0]).input_ids == clip_g(PROMPTS[0]).input_ids
    # As in CLIP: "!" is id 0, the special tokens are the last two.
    assert clip_g.pad_token_id == 0
    assert (clip_l.bos_token_id, clip_l.eos_token_id) == (len(clip_l) - 2, len(clip_l) - 1)


def test_non_default_spec_builds_and_runs(tmp_path):
    model_dir = build_tiny_sd3(ALT_SPEC, tmp_path / "alt")
    pipe = _load(model_dir)
    config = pipe.transformer.config
    assert (config.num_layers, config.num_attention_heads, config.attention_head_dim) == (3, 3, 8)
    assert tuple(config.dual_attention_layers) == (0,) and config.qk_norm == "rms_norm"
    assert pipe.text_encoder_2.config.hidden_size == 40 and pipe.text_encoder_3.config.d_model == 72
    request = dict(height=48, width=80, num_inference_steps=2, guidance_scale=3.0, max_sequence_length=24)
    first, second = (_generate(pipe, p, **request) for p in PROMPTS)
    assert first.shape == (1, 48, 80, 3)
    assert np.isfinite(first).all() and first.min() >= 0.0 and first.max() <= 1.0
    assert np.abs(first - second).max() > 1e-3


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(clip_l_hidden_size=64, clip_g_hidden_size=64), "t5_d_model"),
        (dict(height=72), "multiples of 16"),
        (dict(width=64 * 16), "pos_embed_max_size"),
        (dict(dual_attention_layers=(2,)), "dual_attention_layers"),
        (dict(vae_block_out_channels=(4,)), "vae_block_out_channels"),  # no downsampling
        (dict(vae_norm_num_groups=3), "vae_norm_num_groups"),
        (dict(clip_g_num_heads=5), "clip_g_hidden_size"),
        (dict(qk_norm="l2"), "qk_norm"),
        (dict(max_sequence_length=513), "max_sequence_length"),
        (dict(weights_dtype="int8"), "weights_dtype"),  # (float16 is a stored dtype)
    ],
)
def test_spec_validation(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SPECS["tiny-sd3"], **change)


def test_named_specs_fit_their_requests():
    for spec in SPECS.values():
        assert spec.clip_l_hidden_size + spec.clip_g_hidden_size <= spec.t5_d_model
        assert max(spec.height, spec.width) <= 16 * spec.pos_embed_max_size
    small = SPECS["small-sd3"]
    assert (small.height, small.width, small.num_inference_steps, small.max_sequence_length) == (256, 256, 10, 64)
    assert small.dual_attention_layers == (0, 1) and small.qk_norm == "rms_norm"
