"""The tiny Qwen-Image model generator: deterministic files in QwenImagePipeline's layout, a Qwen2 tokenizer
whose template prefix is the pipeline's 34 dropped tokens, runnable generations (with and without true CFG,
batched prompts of different lengths) and spec validation."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from common.builtin.build import build as build_tiny_qwen_image
from common.builtin.specs.qwen_image import (
    LATENTS_MEAN,
    LATENTS_STD,
    SCHEDULER_CONFIG,
    SPECS,
    TinyQwenImageSpec,
    transformer_config,
)
from common.builtin.tokenizer.qwen import (
    ENDOFTEXT_TOKEN,
    IM_END_TOKEN,
    IM_START_TOKEN,
    PROMPT_PREFIX,
    PROMPT_TEMPLATE,
    PROMPT_TEMPLATE_START_IDX,
    qwen2_tokenizer as build_tokenizer,
)

PROMPTS = ("A small red fox runs in the forest at dawn, cinematic lighting.",
           "A giant silver robot swims over the ocean at night.")
ODD_PROMPT = "Zyx QUIRK 42 !?#@ caf\u00e9 \u732b \U0001f98a"
# The template's closing tokens after the prompt: <|im_end|>, "\n", <|im_start|>, "assistant", "\n".
CLOSING_TOKENS = 5
REPO_ROOT = Path(__file__).resolve().parents[1]


def _digests(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _generate(pipe, prompt, **request) -> np.ndarray:
    request = dict(num_inference_steps=2, max_sequence_length=64, output_type="np") | request
    return pipe(prompt, generator=torch.Generator("cpu").manual_seed(0), **request).images


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_qwen_image(SPECS["tiny-qwen-image"], tmp_path_factory.mktemp("tiny-qwen-image"))


@pytest.fixture(scope="module")
def pipe(tiny_dir):
    from diffusers import QwenImagePipeline

    pipe = QwenImagePipeline.from_pretrained(tiny_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_build_is_byte_identical_and_leaves_global_state(tmp_path, tiny_dir):
    torch.manual_seed(1234)
    rng_before = torch.get_rng_state()
    again = build_tiny_qwen_image(SPECS["tiny-qwen-image"], tmp_path / "again")
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert torch.get_default_dtype() == torch.float32

    first, second = _digests(tiny_dir), _digests(again)
    assert first == second
    for part in ("model_index.json", "serving_defaults.json", "transformer/config.json",
                 "transformer/diffusion_pytorch_model.safetensors", "vae/config.json",
                 "vae/diffusion_pytorch_model.safetensors", "scheduler/scheduler_config.json",
                 "text_encoder/config.json", "text_encoder/model.safetensors", "tokenizer/tokenizer.json",
                 "tokenizer/tokenizer_config.json"):
        assert part in first
    index = json.loads((tiny_dir / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert {k: tuple(v) for k, v in index.items() if not k.startswith("_")} == {
        "transformer": ("diffusers", "QwenImageTransformer2DModel"),
        "vae": ("diffusers", "AutoencoderKLQwenImage"),
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
        "text_encoder": ("transformers", "Qwen2_5_VLForConditionalGeneration"),
        "tokenizer": ("transformers", "Qwen2Tokenizer"),
    }


def test_tokenizer_is_the_same_in_another_process(tiny_dir):
    code = ("import hashlib, tempfile, pathlib\n"
            "from common.builtin.tokenizer.qwen import qwen2_tokenizer as build_tokenizer\n"
            "d = pathlib.Path(tempfile.mkdtemp()); build_tokenizer().save_pretrained(d)\n"
            "print(hashlib.sha256((d / 'tokenizer.json').read_bytes()).hexdigest())\n")
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                         check=True).stdout.split()[-1]
    assert out == _digests(tiny_dir)["tokenizer/tokenizer.json"]


def test_serving_defaults_and_configs(tiny_dir):
    spec = SPECS["tiny-qwen-image"]
    text = (tiny_dir / "serving_defaults.json").read_text()
    assert text.endswith("}\n")
    assert json.loads(text) == {"height": 64, "width": 64, "num_inference_steps": 4, "true_cfg_scale": 4.0,
                                "max_sequence_length": 64}
    transformer = json.loads((tiny_dir / "transformer" / "config.json").read_text())
    assert (transformer["in_channels"], transformer["out_channels"], transformer["patch_size"]) == (64, 16, 2)
    assert transformer["joint_attention_dim"] == spec.text_hidden_size
    assert sum(transformer["axes_dims_rope"]) == transformer["attention_head_dim"]
    assert transformer["guidance_embeds"] is False
    vae = json.loads((tiny_dir / "vae" / "config.json").read_text())
    assert vae["z_dim"] == 16 and vae["temperal_downsample"] == [False, True, True]
    assert vae["latents_mean"] == list(LATENTS_MEAN) and vae["latents_std"] == list(LATENTS_STD)
    scheduler = json.loads((tiny_dir / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["_class_name"] == "FlowMatchEulerDiscreteScheduler"
    assert {k: scheduler[k] for k in SCHEDULER_CONFIG} == SCHEDULER_CONFIG
    encoder = json.loads((tiny_dir / "text_encoder" / "config.json").read_text())
    tokenizer = build_tokenizer()
    assert encoder["text_config"]["vocab_size"] == len(tokenizer)
    assert encoder["text_config"]["hidden_size"] == spec.text_hidden_size
    assert encoder["text_config"]["rope_parameters"]["mrope_section"] == [2, 3, 3]
    assert encoder["vision_config"]["out_hidden_size"] == spec.text_hidden_size
    assert encoder["image_token_id"] == tokenizer.convert_tokens_to_ids("<|image_pad|>")


def test_tokenizer_loads_and_drops_exactly_the_system_prefix(tiny_dir):
    from transformers import AutoTokenizer, Qwen2Tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_dir / "tokenizer")
    assert type(tokenizer) is Qwen2Tokenizer
    assert (tokenizer.pad_token, tokenizer.eos_token) == (ENDOFTEXT_TOKEN, IM_END_TOKEN)
    assert 256 < len(tokenizer) <= 1000
    assert len(tokenizer) == len(build_tokenizer())

    # The template's prefix (up to and including "<|im_start|>user\n") is exactly the tokens the pipeline drops.
    prefix = tokenizer(PROMPT_PREFIX).input_ids
    assert len(prefix) == PROMPT_TEMPLATE_START_IDX == 34
    assert tokenizer.convert_ids_to_tokens(prefix[:3]) == [IM_START_TOKEN, "system", "\u010a"]
    assert tokenizer.convert_ids_to_tokens(prefix[-3:]) == [IM_START_TOKEN, "user", "\u010a"]
    for prompt in (*PROMPTS, ODD_PROMPT, "a"):
        ids = tokenizer(PROMPT_TEMPLATE.format(prompt)).input_ids
        kept = ids[PROMPT_TEMPLATE_START_IDX:]
        assert ids[:PROMPT_TEMPLATE_START_IDX] == prefix
        # What is left is the prompt's own tokens and the template's closing ones.
        assert kept[:-CLOSING_TOKENS] == tokenizer(prompt).input_ids
        assert tokenizer.convert_ids_to_tokens(kept[-CLOSING_TOKENS:]) == [
            IM_END_TOKEN, "\u010a", IM_START_TOKEN, "assistant", "\u010a"]
        # Byte-level: nothing is lost, non-ASCII included.
        assert tokenizer.decode(ids) == PROMPT_TEMPLATE.format(prompt)
    # Common corpus words are single tokens.
    assert len(tokenizer(" the forest at dawn").input_ids) == 4


@pytest.mark.parametrize("height, width", [(64, 64), (32, 48)])
def test_pipeline_runs_with_and_without_true_cfg(pipe, height, width):
    plain = _generate(pipe, PROMPTS[0], height=height, width=width, true_cfg_scale=4.0)
    guided = _generate(pipe, PROMPTS[0], height=height, width=width, true_cfg_scale=4.0, negative_prompt=" ")
    for image in (plain, guided):
        assert image.shape == (1, height, width, 3)
        assert np.isfinite(image).all() and image.min() >= 0.0 and image.max() <= 1.0
    assert np.abs(plain - guided).max() > 1e-4


def test_images_depend_on_the_prompt_and_are_deterministic(pipe):
    first, second = (_generate(pipe, p, height=64, width=64) for p in PROMPTS)
    assert np.abs(first - second).max() > 1e-3
    assert np.array_equal(first, _generate(pipe, PROMPTS[0], height=64, width=64))


def test_prompts_of_different_lengths_in_one_call(pipe):
    short, long = "a red fox", PROMPTS[0]
    embeds, mask = pipe.encode_prompt([short, long], max_sequence_length=64)
    n_short = len(pipe.tokenizer(short).input_ids) + CLOSING_TOKENS
    n_long = len(pipe.tokenizer(long).input_ids) + CLOSING_TOKENS
    assert embeds.shape == (2, n_long, SPECS["tiny-qwen-image"].text_hidden_size)
    assert mask is not None and mask.sum(dim=1).tolist() == [n_short, n_long]

    # The padded prompt's image matches its own unbatched one (same starting latents for both).
    generator = torch.Generator("cpu").manual_seed(3)
    latents = torch.randn(2, 4 * 4, 64, generator=generator)
    request = dict(height=64, width=64, num_inference_steps=2, max_sequence_length=64, output_type="np")
    batched = pipe([short, long], latents=latents, **request).images
    assert batched.shape == (2, 64, 64, 3) and np.isfinite(batched).all()
    alone = pipe(short, latents=latents[:1], **request).images
    np.testing.assert_allclose(batched[:1], alone, atol=1e-4)
    guided = pipe([short, long], negative_prompt=[" ", "blurry"], true_cfg_scale=4.0, latents=latents,
                  **request).images
    assert guided.shape == (2, 64, 64, 3) and np.isfinite(guided).all()


def test_bfloat16_weights(tmp_path):
    from safetensors import safe_open

    model_dir = build_tiny_qwen_image(dataclasses.replace(SPECS["tiny-qwen-image"], weights_dtype="bfloat16"), tmp_path / "bf16")
    for part in ("transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
        with safe_open(model_dir / part, "pt") as f:
            assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(axes_dims_rope=(4, 6, 8)), "sum to attention_head_dim"),
        (dict(axes_dims_rope=(4, 12)), "three positive even"),
        (dict(axes_dims_rope=(3, 6, 7)), "three positive even"),
        (dict(text_num_heads=3), "text_hidden_size"),
        (dict(text_num_kv_heads=3, text_num_heads=2), "text_num_kv_heads"),
        (dict(text_hidden_size=48, text_num_heads=2, text_num_kv_heads=1), "multiple of 16"),
        (dict(vision_hidden_size=12), "vision_hidden_size"),
        (dict(vae_dim_mult=(1,)), "vae_dim_mult"),  # no downsampling
        (dict(vae_num_res_blocks=0), "vae_num_res_blocks"),
        (dict(height=72), "multiples of 16"),
        (dict(width=0), "multiples of 16"),
        (dict(max_sequence_length=1025), "max_sequence_length"),
        (dict(num_inference_steps=1), "num_inference_steps"),
        (dict(true_cfg_scale=0.5), "true_cfg_scale"),
        (dict(weights_dtype="int8"), "weights_dtype"),  # (float16 is a stored dtype)
        (dict(num_layers=0), "transformer sizes"),
    ],
)
def test_spec_validation(change, message):
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(SPECS["tiny-qwen-image"], **change)


def test_named_specs_and_registration():
    from diffusers import QwenImageTransformer2DModel

    from common.builtin import BUILTINS

    for name in ("tiny-qwen-image", "small-qwen-image"):
        assert isinstance(BUILTINS[name], TinyQwenImageSpec) and BUILTINS[name] is SPECS[name]
    tiny, small = SPECS["tiny-qwen-image"], SPECS["small-qwen-image"]
    assert (tiny.height, tiny.width, tiny.num_inference_steps, tiny.max_sequence_length) == (64, 64, 4, 64)
    assert (small.height, small.width, small.num_inference_steps, small.true_cfg_scale) == (256, 256, 10, 4.0)
    with torch.device("meta"):
        model = QwenImageTransformer2DModel(**transformer_config(small))
    assert 15e6 <= sum(p.numel() for p in model.parameters()) <= 25e6
