"""LTX-2's decode side (common/families/ltx2/decoder.py) against diffusers' ``LTX2Pipeline`` itself.

The model directory is made here with the real diffusers classes: a timestep-conditioned video VAE and
random latents statistics on both VAEs (so that the decode noise and both de-normalisations count), and a
transformer whose output projections are zero. Its velocity is then exactly 0 (x0 = x, velocity (x - x0) / s =
0, Euler x + dt * 0 = x), so the pipeline's denoising loop hands the latents it was given, bit for bit, to its
own decode tail: the pipeline decodes exactly the latents the engine's decoder is given. Given latents, the
pipeline still draws their (zero-weighted) noise from its generator, video then audio, as it draws the initial
noise; the decode noise comes after, as the engine's decoder replays.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common.protocol.messages import GenerationParams
from tests.family_harness import max_diff

diffusers = pytest.importorskip("diffusers")
from diffusers import (  # noqa: E402
    AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video, FlowMatchEulerDiscreteScheduler, LTX2Pipeline,
    LTX2VideoTransformer3DModel)
from diffusers.pipelines.ltx2 import LTX2TextConnectors  # noqa: E402
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder  # noqa: E402

from common.families.ltx2.decoder import Ltx2Decoder  # noqa: E402
from common.families.ltx2.geometry import Ltx2Geometry  # noqa: E402

HEIGHT, WIDTH, FRAMES = 64, 96, 9  # non-square; video latents [4, 5, 32, 48]
CAPTION = 16  # the connectors' width (the text side is not what this test is about)
NO_GUIDANCE = dict(guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0,
                   audio_guidance_scale=1.0, audio_stg_scale=0.0, audio_modality_scale=1.0,
                   audio_guidance_rescale=0.0, spatio_temporal_guidance_blocks=None, use_cross_timestep=False)


def _components() -> dict:
    """Tiny components; both streams' tokens 4 wide (video: 4 latent channels, patch 1; audio: 2 channels x
    8 mel bins / 4)."""
    torch.manual_seed(0)
    vae = AutoencoderKLLTX2Video(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8,), decoder_block_out_channels=(8,),
        layers_per_block=(1,), decoder_layers_per_block=(1, 1), spatio_temporal_scaling=(True,),
        decoder_spatio_temporal_scaling=(True,), decoder_inject_noise=(False, False), downsample_type=("spatial",),
        upsample_residual=(False,), upsample_factor=(1,), timestep_conditioning=True, patch_size=1, patch_size_t=1,
        encoder_causal=True, decoder_causal=False, scaling_factor=0.8)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8)
    for m in (vae, audio_vae):  # statistics that are not the identity
        m.latents_mean.copy_(torch.randn_like(m.latents_mean) * 0.3)
        m.latents_std.copy_(torch.rand_like(m.latents_std) + 0.5)
    vocoder = LTX2Vocoder(
        in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
        resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]], leaky_relu_negative_slope=0.1,
        output_sampling_rate=16000)
    transformer = LTX2VideoTransformer3DModel(
        in_channels=4, out_channels=4, patch_size=1, patch_size_t=1, num_attention_heads=2, attention_head_dim=8,
        cross_attention_dim=16, audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2,
        audio_attention_head_dim=4, audio_cross_attention_dim=8, num_layers=1, qk_norm="rms_norm_across_heads",
        caption_channels=CAPTION, rope_double_precision=False, rope_type="split")
    for p in [*transformer.proj_out.parameters(), *transformer.audio_proj_out.parameters()]:
        torch.nn.init.zeros_(p)  # velocity 0: the loop leaves the given latents as they are
    connectors = LTX2TextConnectors(
        caption_channels=CAPTION, text_proj_in_factor=2, video_connector_num_attention_heads=2,
        video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_theta=10000.0,
        rope_double_precision=False, causal_temporal_positioning=False, rope_type="split")
    return dict(scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, audio_vae=audio_vae, text_encoder=None,
                tokenizer=None, connectors=connectors, transformer=transformer, vocoder=vocoder)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("ltx2-decode")
    pipe = LTX2Pipeline(**_components())
    pipe.save_pretrained(path)
    return path, pipe


def _params(seed: int, n: int = 1, frame_rate: float = 25.0, size=(HEIGHT, WIDTH), frames=FRAMES,
            **fields) -> GenerationParams:
    return GenerationParams(prompt="", negative_prompt="", height=size[0], width=size[1], num_frames=frames,
                            num_inference_steps=2, guidance_scale=1.0, seed=seed, n=n,
                            fields={"frame_rate": frame_rate, **fields})


def _pipeline_tail(pipe, joint: torch.Tensor, geo: Ltx2Geometry, seed: int, frame_rate: float, **decode):
    """The pipeline's frames [1, F, H, W, 3] and waveform for one sample's joint latents."""
    video, audio = geo.split(joint)
    # The pipeline normalises given audio latents itself: hand it them de-normalised.
    audio = LTX2Pipeline._denormalize_audio_latents(audio, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
    out = pipe(prompt_embeds=torch.randn(1, 6, CAPTION * 2, generator=torch.Generator().manual_seed(1)),
               prompt_attention_mask=torch.ones(1, 6, dtype=torch.long), height=HEIGHT, width=WIDTH,
               num_frames=FRAMES, frame_rate=frame_rate, num_inference_steps=2, latents=video.clone(),
               audio_latents=audio, generator=torch.Generator().manual_seed(seed), output_type="pt",
               **NO_GUIDANCE, **decode)
    return out.frames.permute(0, 1, 3, 4, 2), out.audio


def _joint(geo: Ltx2Geometry, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, geo.tokens, geo.channels, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("frame_rate,decode", [(25.0, dict(decode_timestep=0.05)),
                                               (16.0, dict(decode_timestep=0.1, decode_noise_scale=0.4))])
def test_frames_and_waveform_equal_the_pipelines_tail(model, frame_rate, decode):
    """A request's two samples (seeds 7 and 8) decoded in one call equal the pipeline run on each alone, with
    decode noise and a decode timestep on a timestep-conditioned VAE."""
    path, pipe = model
    decoder = Ltx2Decoder.load(SimpleNamespace(path=path), torch.float32, torch.device("cpu"))
    params = _params(7, n=2, frame_rate=frame_rate, **decode)
    geo = decoder.geometry(params, HEIGHT, WIDTH)
    joint = _joint(geo, 2, seed=3)
    got = decoder.decode_rows(joint, [(params, 0), (params, 1)], HEIGHT, WIDTH)
    assert got.sample_rate == pipe.vocoder.config.output_sampling_rate
    for i in range(2):
        frames, audio = _pipeline_tail(pipe, joint[i:i + 1], geo, 7 + i, frame_rate, **decode)
        assert got.frames[i:i + 1].shape == frames.shape == (1, FRAMES, HEIGHT, WIDTH, 3)
        assert got.audio[i:i + 1].shape == audio.shape
        assert max_diff(got.frames[i:i + 1], frames) <= 1e-5
        assert max_diff(got.audio[i:i + 1], audio) <= 1e-5


def test_decode_noise_follows_the_seed_and_the_timestep(model):
    """The decode noise is the sample's own: another seed changes the frames, a zero decode timestep and
    noise scale decodes the latents alone (the same frames whatever the seed); the waveform never depends
    on either."""
    path, _ = model
    decoder = Ltx2Decoder.load(SimpleNamespace(path=path), torch.float32, torch.device("cpu"))
    geo = decoder.geometry(_params(0), HEIGHT, WIDTH)
    joint = _joint(geo, 1, seed=5)

    def run(seed, **fields):
        return decoder.decode_rows(joint, [(_params(seed, **fields), 0)], HEIGHT, WIDTH)

    a, b = run(1, decode_timestep=0.05), run(2, decode_timestep=0.05)
    assert max_diff(a.frames, b.frames) > 1e-3
    assert max_diff(a.audio, b.audio) == 0
    assert max_diff(run(1, decode_timestep=0.0).frames, run(2, decode_timestep=0.0).frames) == 0


def test_the_decode_stage_batches_by_streams_and_carries_the_waveform(model, tmp_path):
    """Requests whose streams have the same shapes decode in one group (split at the stage's batch size); one
    whose joint latents have the same shape but other streams (more frames at a higher rate: 24 video + 5
    audio tokens against 20 + 9) in its own; each result equals its request decoded alone and carries its
    waveform and the vocoder's rate."""
    from common.protocol.messages import AUDIO, LATENTS, OUTPUT, PROTOCOL_VERSION, DecodeRequest, Route
    from common.config.engine import EngineConfig, WorkerSpec
    from decode_worker.stage import DecodeStage

    path, _ = model
    config = EngineConfig(model=str(path), workers=[WorkerSpec(role="decode", index=0)], router_endpoint="",
                          runtime_dir=str(tmp_path), max_batch_size=2)
    stage = DecodeStage(config, config.workers[0])
    # What load() takes from the family's binding: its latents part's size rule and its decoder.
    latents_part = SimpleNamespace(size=lambda info, height, width, fields: (height, width))
    stage.info = SimpleNamespace(family=SimpleNamespace(latents=latents_part))
    decoder = stage.decoder = Ltx2Decoder.load(SimpleNamespace(path=path), torch.float32, torch.device("cpu"))
    calls = []
    decode_rows = decoder.decode_rows
    decoder.decode_rows = lambda latents, rows, h, w: calls.append([(p.seed, i) for p, i in rows]) or decode_rows(
        latents, rows, h, w)

    small = (4, 4)  # 2 x 2 video tokens per latent frame
    requests = [_params(7, n=2, size=small, decode_timestep=0.05), _params(11, size=small, decode_timestep=0.1),
                _params(13, size=small, frames=11, frame_rate=55.0, decode_timestep=0.05)]
    geos = [decoder.batch_key(p) for p in requests]
    assert geos[0].tokens == geos[2].tokens and geos[0] != geos[2]  # same shape on the wire, other streams
    items = [(DecodeRequest(v=PROTOCOL_VERSION, request_id=f"r{k}", route=Route(encoder=0, denoise=0, decode=0),
                            params=p), {LATENTS.name: _joint(g, p.n, seed=20 + k)})
             for k, (p, g) in enumerate(zip(requests, geos))]
    out = stage.process_batch(items)
    assert calls == [[(7, 0), (7, 1)], [(11, 0)], [(13, 0)]]
    for (msg, tensors), fwd in zip(items, out):
        alone = decode_rows(tensors[LATENTS.name], [(msg.params, i) for i in range(msg.params.n)], *small)
        assert fwd.tensors[OUTPUT.name].shape == (msg.params.n, msg.params.num_frames, *small, 3)
        assert fwd.msg.info["audio_sample_rate"] == 16000
        assert max_diff(fwd.tensors[OUTPUT.name], alone.frames) <= 1e-5
        assert max_diff(fwd.tensors[AUDIO.name], alone.audio) <= 1e-5
