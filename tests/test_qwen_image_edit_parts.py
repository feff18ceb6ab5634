"""Qwen-Image-Edit's and Qwen-Image-Edit-Plus's leaf modules against diffusers' own pipelines on the built-in
models: the processor without torchvision, the text side (prompt_embeds of encode_prompt with the images as
the pipeline resizes them) and the image side (reference latents as prepare_latents makes image_latents),
each on images of other sizes and aspects than the output."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from common.builtin import ensure_builtin
from common.families.qwen_image import edit_images
from common.families.qwen_image.edit_images import (QwenImageEditConditioner, QwenImageEditPlusConditioner,
                                                    edit_output_size, edit_plus_output_size)
from common.families.qwen_image.edit_text import QwenImageEditPlusTextEncoder, QwenImageEditTextEncoder
from common.families.qwen_image.processor import load_processor

PROMPT, NEGATIVE = "make the fox blue", "blurry"
_CALLS: dict = {}


def picture(height: int, width: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module", autouse=True)
def _threads():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(threads)
    _CALLS.clear()


def diffusers_run(name: str, images: list) -> dict:
    """What diffusers' pipeline on built-in ``name`` computes from ``images``: each encode_prompt's embeddings
    (trimmed to its mask) and prepare_latents' image_latents, from one call with true CFG (one step)."""
    import diffusers

    key = (name, tuple(im.size for im in images))
    if key in _CALLS:
        return _CALLS[key]
    path = ensure_builtin(name)
    pipe_cls = getattr(diffusers, json.loads((path / "model_index.json").read_text())["_class_name"])
    pipe = pipe_cls.from_pretrained(path, processor=load_processor(path))
    seen = {"text": [], "latents": None}
    encode, prepare = pipe.encode_prompt, pipe.prepare_latents

    def encode_spy(*args, **kwargs):
        embeds, mask = encode(*args, **kwargs)
        seen["text"].append(embeds[0] if mask is None else embeds[0, : int(mask[0].sum())])
        return embeds, mask

    def prepare_spy(*args, **kwargs):
        latents, image_latents = prepare(*args, **kwargs)
        seen["latents"] = image_latents[0]
        return latents, image_latents

    pipe.encode_prompt, pipe.prepare_latents = encode_spy, prepare_spy
    pipe(image=images if len(images) > 1 else images[0], prompt=PROMPT, negative_prompt=NEGATIVE,
         true_cfg_scale=4.0, num_inference_steps=2, height=32, width=32, output_type="latent",
         generator=torch.Generator("cpu").manual_seed(0))
    _CALLS[key] = seen
    return seen


CASES = {
    # One image, wider than tall: resized to calculate_dimensions(1024 * 1024, 3 / 2) for both sides.
    "edit": ("tiny-qwen-image-edit", QwenImageEditTextEncoder, QwenImageEditConditioner, [(200, 300)]),
    # Two images of other aspects: each at its own size, "Picture 1:", "Picture 2:".
    "plus-2": ("tiny-qwen-image-edit-plus", QwenImageEditPlusTextEncoder, QwenImageEditPlusConditioner,
               [(200, 300), (150, 120)]),
    "plus-3": ("tiny-qwen-image-edit-plus", QwenImageEditPlusTextEncoder, QwenImageEditPlusConditioner,
               [(200, 300), (150, 120), (96, 96)]),
}


def _images(sizes) -> list:
    return [picture(h, w, seed) for seed, (h, w) in enumerate(sizes)]


# Plus's cases are heavy: tests/test_qwen_image_edit.py's serving parity covers both sides end to end.
PLUS = [pytest.param(c, marks=pytest.mark.heavy) for c in ("plus-2", "plus-3")]


@pytest.mark.parametrize("case", ["edit", *PLUS])
def test_text_side_equals_encode_prompt(case):
    name, encoder_cls, _, sizes = CASES[case]
    images = _images(sizes)
    expected = diffusers_run(name, images)["text"]
    encoder = encoder_cls.load(ensure_builtin(name), torch.float32, "cpu")
    got = encoder.wire_tensors([PROMPT, NEGATIVE], 64, [images, images])
    assert len(expected) == 2
    for wire, ref in zip(got, expected):
        assert wire["prompt_embeds"].shape == ref.shape
        assert torch.equal(wire["prompt_embeds"], ref)
    # The VL really sees the images: another image changes the embeddings.
    other = encoder.wire_tensors([PROMPT], 64, [[picture(200, 300, 7)] + images[1:]])[0]["prompt_embeds"]
    assert other.shape == got[0]["prompt_embeds"].shape and not torch.allclose(other, got[0]["prompt_embeds"])


@pytest.mark.parametrize("case", ["edit", *PLUS])
def test_image_side_equals_prepare_latents(case):
    name, _, conditioner_cls, sizes = CASES[case]
    images = _images(sizes)
    expected = diffusers_run(name, images)["latents"]
    conditioner = conditioner_cls.load(ensure_builtin(name), torch.float32, "cpu")
    wire = conditioner.wire_tensors(images, 32, 32, {})
    latents, grids = wire["reference_latents"], wire["reference_grids"]
    assert latents.shape == expected.shape and torch.equal(latents, expected)
    # Each reference at a 1024x1024 area at its aspect ratio, 16 pixels a token on the built-in's 8x VAE
    # (independently recomputed).
    assert grids.dtype == torch.int64 and grids.shape == (len(images), 2)
    for (rows, cols), (h, w) in zip(grids.tolist(), sizes):
        assert abs(rows * cols * 256 - 1024 * 1024) < 0.1 * 1024 * 1024
        assert abs(cols / rows - w / h) < 0.1
    assert int(grids.prod(dim=1).sum()) == latents.shape[0]


def test_default_output_size_is_the_pipelines():
    """Edit sizes the output by the first image, Plus by the last, as the pipelines (height=None): floored to
    whole tokens of the directory's VAE (``multiple_of = vae_scale_factor * 2``; 32x floors 32-pixel sizes)."""
    from types import SimpleNamespace

    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    sizes = [(300, 200), (120, 150)]  # (width, height), as PIL
    for scale in (8, 16, 32):
        info, step = SimpleNamespace(vae_scale_spatial=scale), scale * 2
        for size_of, which in ((edit_output_size, 0), (edit_plus_output_size, -1)):
            width, height, _ = calculate_dimensions(1024 * 1024, sizes[which][0] / sizes[which][1])
            assert size_of(info, sizes, {}) == (height // step * step, width // step * step)
    info = SimpleNamespace(vae_scale_spatial=8)
    assert edit_images.area_size(picture(200, 300, 0).size) == edit_output_size(info, [(300, 200)], {})
    assert edit_output_size(SimpleNamespace(vae_scale_spatial=32), [(300, 200)], {}) == (832, 1216)  # not 1248


def test_processor_without_torchvision_expands_image_tokens(tmp_path):
    """The processor of a directory laid out as the real checkpoint (processor/ with preprocessor_config.json
    and the tokenizer's files): one <|image_pad|> per merged 28x28 patch of smart_resize's size."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    path = ensure_builtin("tiny-qwen-image-edit")
    config = json.loads((path / "processor" / "preprocessor_config.json").read_text())
    assert config["image_processor_type"] == "Qwen2VLImageProcessor"
    processor = load_processor(path)
    tokenizer = processor.tokenizer
    image = picture(200, 300, 0)
    text = ["Picture 1: <|vision_start|><|image_pad|><|vision_end|>a fox", "short"]
    out = processor(text=text, images=[image], padding=True, return_tensors="pt")
    h, w = smart_resize(200, 300, factor=28, min_pixels=config["size"]["shortest_edge"],
                        max_pixels=config["size"]["longest_edge"])
    assert out["image_grid_thw"].tolist() == [[1, h // 14, w // 14]]
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert int((out["input_ids"][0] == pad).sum()) == (h // 28) * (w // 28)
    assert out["pixel_values"].shape[0] == (h // 14) * (w // 14)
    assert out["attention_mask"][1].sum() < out["attention_mask"][0].sum()  # padded
    # A processor folder without tokenizer files takes the model's tokenizer/ (same ids).
    bare = tmp_path / "model"
    (bare / "processor").mkdir(parents=True)
    shutil.copy(path / "processor" / "preprocessor_config.json", bare / "processor")
    shutil.copytree(path / "tokenizer", bare / "tokenizer")
    again = load_processor(bare)(text=text, images=[image], padding=True, return_tensors="pt")
    assert all(torch.equal(out[k], again[k]) for k in out)
