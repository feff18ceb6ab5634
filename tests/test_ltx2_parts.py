"""LTX-2's encoder-side parts against diffusers' own pipelines on one directory of another configuration than
the built-ins (a wider, deeper Gemma3 and connectors): the text part's wire tensors are the connector outputs
``LTX2Pipeline.__call__`` computes (recorded by wrapping ``connectors.forward`` during a real call), with and
without a negative prompt; the I2V image side's latent is the ``init_latents`` frame
``LTX2ImageToVideoPipeline.__call__`` builds (recorded from ``prepare_latents``' return, where frame 0 is the
image's latent exactly), for an image that must be resized, with and without CRF re-compression."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from common.builtin import ensure_builtin
from common.builtin.specs.ltx2 import SPECS
from common.families.ltx2.image import Ltx2ImageConditioner
from common.families.ltx2.text import TEXT, Ltx2TextEncoder
from common.families.ltx2.text import AUDIO_PROMPT_EMBEDS
from common.protocol.messages import PROMPT_EMBEDS, PROMPT_MASK

ALT = dataclasses.replace(SPECS["tiny-ltx2"], name="tiny-ltx2-alt", seed=7, text_hidden_size=48, text_num_layers=3,
                          connector_num_heads=3, connector_num_registers=16)
MAX_LEN = 48  # not the pipeline's 1024; a multiple of the registers
PROMPT, NEGATIVE = "  a red fox jumps over a fence  ", "blurry, static"
FIELDS = (PROMPT_EMBEDS.name, AUDIO_PROMPT_EMBEDS.name, PROMPT_MASK.name)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_builtin(ALT, tmp_path_factory.mktemp("ltx2-cache"))


def _recorded_connectors(pipe, **call):
    seen = []
    forward = pipe.connectors.forward

    def record(*args, **kwargs):
        out = forward(*args, **kwargs)
        seen.append(out)
        return out

    pipe.connectors.forward = record
    pipe(height=32, width=32, num_frames=9, num_inference_steps=2, output_type="latent",
         max_sequence_length=MAX_LEN, generator=torch.Generator().manual_seed(0), **call)
    assert len(seen) == 1
    return seen[0]


@pytest.mark.parametrize("guided", [True, False], ids=["cfg", "no-cfg"])
def test_text_wire_tensors_are_the_pipelines_connector_outputs(model_dir, guided):
    from diffusers import LTX2Pipeline

    pipe = LTX2Pipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    # The pipeline's audio_guidance_scale defaults to 7 (not to guidance_scale): set it too for a call without CFG.
    scale = 4.0 if guided else 1.0
    call = dict(prompt=PROMPT, guidance_scale=scale, audio_guidance_scale=scale, stg_scale=0.0, modality_scale=1.0)
    if guided:
        call["negative_prompt"] = NEGATIVE
    video, audio, mask = _recorded_connectors(pipe, **call)
    texts = [NEGATIVE, PROMPT] if guided else [PROMPT]
    encoder = Ltx2TextEncoder.load(model_dir, torch.float32, "cpu")
    wires = encoder.wire_tensors(texts, MAX_LEN)
    assert video.shape[1] == MAX_LEN and video.shape[2] == ALT.text_hidden_size
    for i, wire in enumerate(wires):
        assert set(wire) == set(FIELDS)
        torch.testing.assert_close(wire[PROMPT_EMBEDS.name], video[i], rtol=0, atol=1e-5)
        torch.testing.assert_close(wire[AUDIO_PROMPT_EMBEDS.name], audio[i], rtol=0, atol=1e-5)
        assert torch.equal(wire[PROMPT_MASK.name], mask[i])
    # A text's tensors do not depend on its batch mates (the pipeline runs [negative, positive] together).
    alone = encoder.wire_tensors([PROMPT], MAX_LEN)[0]
    mates = encoder.wire_tensors(["a much longer prompt about a cat asleep on a warm roof", PROMPT], MAX_LEN)[1]
    for name in FIELDS:
        torch.testing.assert_close(alone[name], wires[-1][name], rtol=0, atol=1e-5)
        torch.testing.assert_close(mates[name], wires[-1][name], rtol=0, atol=1e-5)


def test_a_budget_the_registers_do_not_divide_is_refused_naming_the_field(model_dir):
    encoder = Ltx2TextEncoder.load(model_dir, torch.float32, "cpu")
    with pytest.raises(ValueError, match="max_sequence_length"):
        encoder.wire_tensors([PROMPT], MAX_LEN + 4)


def test_texts_of_other_budgets_share_a_forward_as_alone(model_dir):
    """A row's transformer output with its text stacked beside a longer one (padded, masked) equals alone."""
    from diffusers import LTX2VideoTransformer3DModel

    encoder = Ltx2TextEncoder.load(model_dir, torch.float32, "cpu")
    short = TEXT.conditioning(encoder.wire_tensors([PROMPT], MAX_LEN)[0], MAX_LEN).tensors
    long = TEXT.conditioning(encoder.wire_tensors([NEGATIVE], 2 * MAX_LEN)[0], 2 * MAX_LEN).tensors
    model = LTX2VideoTransformer3DModel.from_pretrained(model_dir / "transformer").eval()
    gen = torch.Generator().manual_seed(3)
    video = torch.randn(2, 8, ALT.latent_channels, generator=gen)
    audio = torch.randn(2, 5, ALT.latent_channels, generator=gen)

    def run(texts, rows):
        kw = dict(encoder_hidden_states=texts["encoder_hidden_states"],
                  audio_encoder_hidden_states=texts["audio_encoder_hidden_states"],
                  encoder_attention_mask=texts["encoder_attention_mask"],
                  audio_encoder_attention_mask=texts["encoder_attention_mask"])
        with torch.no_grad():
            return model(hidden_states=video[:rows], audio_hidden_states=audio[:rows], timestep=torch.full((rows,), 500.0),
                         num_frames=2, height=2, width=2, fps=24.0, audio_num_frames=5, return_dict=False, **kw)

    together = run(TEXT.stack([short, long]), 2)
    alone = run(TEXT.stack([short]), 1)
    assert TEXT.stack([short, long])["encoder_attention_mask"][0, MAX_LEN:].eq(0).all()
    for a, b in zip(alone, together):
        torch.testing.assert_close(b[:1], a, rtol=0, atol=1e-5)


def _image():
    import PIL.Image

    rng = np.random.RandomState(0)  # smooth-ish content so that the codec keeps something of it
    base = rng.rand(7, 9, 3)
    pixels = np.kron(base, np.ones((8, 8, 1)))[:50, :70]
    return PIL.Image.fromarray((pixels * 255).astype(np.uint8))


@pytest.mark.parametrize("crf", [None, 0], ids=["default-crf", "no-crf"])
def test_image_latent_is_the_pipelines_init_latents(model_dir, crf):
    from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline

    pipe = LTX2ImageToVideoPipeline.from_pretrained(model_dir)
    pipe.set_progress_bar_config(disable=True)
    seen = []
    prepare = pipe.prepare_latents
    pipe.prepare_latents = lambda *a, **k: seen.append(prepare(*a, **k)) or seen[-1]
    height, width = 64, 96  # the 70x50 image is resized
    pipe(image=_image(), prompt=PROMPT, height=height, width=width, num_frames=9, num_inference_steps=2,
         guidance_scale=1.0, audio_guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, output_type="latent", max_sequence_length=MAX_LEN, image_crf=crf,
         generator=torch.Generator().manual_seed(0))
    latents, mask = seen[0]
    unpacked = LTX2Pipeline._unpack_latents(latents, 2, height // 32, width // 32)  # frame 0: init_latents exactly
    conditioner = Ltx2ImageConditioner.load(model_dir, torch.float32, "cpu")
    params = SimpleNamespace(height=height, width=width, num_frames=9, fields={} if crf is None else {"image_crf": crf})
    wire = conditioner.wire_tensors([_image()], None, params)["image_condition"]
    assert wire.shape == (ALT.latent_channels, 1, height // 32, width // 32)
    torch.testing.assert_close(wire, unpacked[0, :, :1], rtol=0, atol=1e-5)
    if crf is None:  # the default (Gemma3's 33) re-compresses: not what the raw image gives
        assert conditioner.default_crf == 33
        raw = conditioner.wire_tensors([_image()], None, SimpleNamespace(height=height, width=width, fields={"image_crf": 0}))
        assert (raw["image_condition"] - wire).abs().max() > 1e-3
