"""Answers with sound, in process: the router's answer functions (router/api/bodies.py, media.py, sound.py) on
hand-built results whose waveform is known (a chirp, and clicks at the start of given video frames).

- ``mp4``: one H.264 and one AAC stream; the track decodes (PyAV) to the waveform within the codec's loss, with
  no lag (cross-correlation peak at lag 0, each click at its frame's first sample, both streams starting at 0),
  its length the waveform's within one codec frame; the video plays at the request's ``frame_rate``.
- ``wav``: round-trips within 16-bit quantisation.
- JSON and msgpack answers carry each sample's ``audio`` and ``sample_rate``.
- A model without sound answers as before: its MP4 is the existing ``mp4_bytes`` output byte for byte, its
  JSON answer gains no field, and ``wav`` there is a 400 naming ``output_type``.

The codec bound: AAC is perceptual, so samples do not come back exactly. A correlation above 0.99 means an
error energy under about 2% of the signal's (SNR above 17 dB; measured 35 dB and more on the chirp at
96 kb/s per channel), and it also catches a lost sync: one sample of lag at the chirp's 3 kHz top already
lowers the correlation of that band to cos(2 pi 3000 / 24000) = 0.71.
"""

from __future__ import annotations

import base64
import io
import json
from fractions import Fraction

import av
import msgpack
import numpy as np
import pytest
import torch
from starlette.requests import Request

from common.protocol.http_tensors import decode_tensors
from common.protocol.messages import AUDIO, OUTPUT, GenerationParams, Route
from router.api import media
from router.api.bodies import MSGPACK, encode_response, media_response, samples_payload
from router.api.sound import decode_mp4_audio, decode_wav
from router.link.join import Outcome

RATE = 24000  # LTX-2's vocoder output rate in diffusers' examples
FRAMES, HEIGHT, WIDTH = 17, 32, 48
MAX_LAG = 2  # samples: "at lag 0 within a few samples"


def _request(accept: str = "") -> Request:
    return Request({"type": "http", "method": "POST", "path": "/generate", "headers": [(b"accept", accept.encode())]})


def _info(model: str):
    from common.builtin import ensure_builtin
    from common.families import read_model

    return read_model(ensure_builtin(model))


def _params(frame_rate: float | None, n: int = 1) -> GenerationParams:
    fields = {} if frame_rate is None else {"frame_rate": frame_rate}
    return GenerationParams(prompt="a fox", negative_prompt="", height=HEIGHT, width=WIDTH, num_frames=FRAMES,
                            num_inference_steps=2, guidance_scale=1.0, seed=7, n=n, fields=fields)


def _waveform(fps: float, channels: int, seed: int = 0) -> tuple[np.ndarray, list[int]]:
    """[channels, samples] as long as the video: channel 0 a chirp from 200 Hz to 3.2 kHz (phase shifted by
    ``seed``), channel 1 (if any) a click at the first sample of every other frame; the clicks' positions."""
    samples = round(FRAMES / fps * RATE)
    t = np.arange(samples) / RATE
    chirp = 0.5 * np.sin(2 * np.pi * (200 * t + 0.5 * 3000 * t ** 2 / t[-1]) + seed)
    clicks = [round(k / fps * RATE) for k in range(0, FRAMES, 2)]
    wave = np.zeros((channels, samples), np.float32)
    wave[0] = chirp
    if channels > 1:
        wave[1, clicks] = 0.9
    return wave, clicks


def _outcome(frames: torch.Tensor, wave: np.ndarray | None) -> Outcome:
    tensors = {OUTPUT.name: frames}
    info = {"weight_version": 0, "scheduler": "FlowMatchEulerDiscreteScheduler"}
    if wave is not None:
        tensors[AUDIO.name] = torch.from_numpy(wave)
        info["audio_sample_rate"] = RATE
    return Outcome(tensors, {"encode_s": 0.1}, info, Route(encoder=0, denoise=0, decode=0))


def _frames(n: int = 1) -> torch.Tensor:
    return torch.rand(n, FRAMES, HEIGHT, WIDTH, 3, generator=torch.Generator().manual_seed(0))


def _lag(reference: np.ndarray, decoded: np.ndarray, span: int) -> int:
    """The shift of ``decoded`` against ``reference`` (positive: late) where their cross-correlation peaks."""
    lo, hi = span, len(reference) - span
    scores = [float(np.dot(decoded[lo + lag:hi + lag], reference[lo:hi])) for lag in range(-span, span + 1)]
    return int(np.argmax(scores)) - span


@pytest.mark.parametrize("fps,channels", [(24.0, 2), (23.976, 2), (25.0, 1)])
def test_mp4_carries_the_waveform_in_sync(fps, channels):
    wave, clicks = _waveform(fps, channels)
    rate = media.video_fps(_params(fps), _info("tiny-ltx2"))  # LTX-2 takes the request's frame_rate
    assert rate == fps
    answer = media_response("r1", [7], _outcome(_frames(), wave[None]), 1, "mp4", rate, 0.5, _request(), bare=True)
    assert answer.media_type == "video/mp4"
    data = answer.body

    with av.open(io.BytesIO(data)) as container:
        video, audio = container.streams.video, container.streams.audio
        assert len(video) == 1 and len(audio) == 1 and len(container.streams) == 2
        assert video[0].codec_context.name == "h264" and audio[0].codec_context.name == "aac"
        assert audio[0].rate == RATE and audio[0].channels == channels
        assert video[0].average_rate == Fraction(fps).limit_denominator(1001)  # the request's frame_rate
        frame_size = audio[0].codec_context.frame_size
        video_pts = [float(f.pts * f.time_base) for f in container.decode(video=0)]
    assert len(video_pts) == FRAMES and video_pts[0] == 0.0
    assert np.allclose(video_pts, np.arange(FRAMES) / float(Fraction(fps).limit_denominator(1001)), atol=1e-3)

    pcm, decoded_rate, start = decode_mp4_audio(data)
    assert decoded_rate == RATE and start == 0.0  # the first sample plays with the first frame
    samples = wave.shape[1]
    assert 0 <= pcm.shape[1] - samples < frame_size  # padded to whole codec frames, at most one more
    decoded = pcm[:, :samples]
    assert np.corrcoef(wave[0], decoded[0])[0, 1] > 0.99
    assert abs(_lag(wave[0], decoded[0], round(RATE / fps))) <= MAX_LAG  # within one video frame's lags
    if channels > 1:  # each click where its frame starts
        half = round(RATE / fps) // 2
        for at in clicks[1:]:
            window = np.abs(decoded[1, at - half:at + half])
            assert abs(int(np.argmax(window)) - half) <= MAX_LAG, at



def test_the_opus_track_of_a_build_without_aac_is_in_sync(monkeypatch):
    """Where PyAV has no AAC encoder the track is Opus, which decodes at 48 kHz: every other sample is the
    waveform's (nothing above 12 kHz to alias), within the codec's loss, with no lag."""
    from router.api import sound

    monkeypatch.setattr(sound, "mp4_audio_codec", lambda: "libopus")
    wave, _ = _waveform(24.0, 1)
    data = media.mp4_bytes(_frames()[0], 24.0, media.Sound(torch.from_numpy(wave), RATE))
    with av.open(io.BytesIO(data)) as container:
        assert [(s.type, s.codec_context.name) for s in container.streams] == [("video", "h264"), ("audio", "opus")]
    pcm, decoded_rate, start = decode_mp4_audio(data)
    assert decoded_rate == 2 * RATE and start == 0.0
    decoded = pcm[0, ::2]
    samples = wave.shape[1]
    assert 0 <= len(decoded) - samples < RATE // 50  # within one Opus frame (20 ms)
    assert np.corrcoef(wave[0], decoded[:samples])[0, 1] > 0.99
    assert abs(_lag(wave[0], decoded[:samples], RATE // 24)) <= MAX_LAG

def test_each_sample_file_carries_its_own_sound():
    """n = 2 as files in a JSON answer: sample i's MP4 holds sample i's waveform."""
    waves = np.stack([_waveform(24.0, 1, seed=s)[0] for s in (0, 1)])
    assert np.corrcoef(waves[0, 0], waves[1, 0])[0, 1] < 0.9  # the two differ
    answer = media_response("r2", [7, 8], _outcome(_frames(2), waves), 2, "mp4", 24.0, 0.5, _request(), bare=False)
    body = json.loads(answer.body)
    for i, sample in enumerate(body["samples"]):
        assert sample["output"]["media_type"] == "video/mp4" and "audio" not in sample  # the file holds it
        pcm, _, _ = decode_mp4_audio(base64.b64decode(sample["output"]["data"]))
        assert np.corrcoef(waves[i, 0], pcm[0, :waves.shape[2]])[0, 1] > 0.99


def test_wav_round_trips_within_16_bit_quantisation():
    wave, _ = _waveform(24.0, 2)
    wave[0, :3] = (1.5, -2.0, 1.0)  # beyond full scale: clipped, as a player would
    answer = media_response("r3", [7], _outcome(_frames(), wave[None]), 1, "wav", 24.0, 0.5, _request(), bare=True)
    assert answer.media_type == "audio/wav" and answer.headers["x-seed"] == "7"
    pcm, rate = decode_wav(answer.body)
    assert rate == RATE and pcm.shape == wave.shape
    assert np.abs(pcm - np.clip(wave, -1, 1)).max() <= 0.5 / 32767 + 1e-7  # half a 16-bit step


@pytest.mark.parametrize("accept", ["", MSGPACK])
def test_json_and_msgpack_answers_carry_audio_and_sample_rate(accept):
    waves = np.stack([_waveform(24.0, 2, seed=s)[0] for s in (0, 1)])
    frames = _frames(2)
    request = _request(accept)
    response = encode_response(samples_payload("r4", [7, 8], _outcome(frames, waves), 2, 0.5, bool(accept)), request)
    raw = msgpack.unpackb(response.body, raw=False) if accept else json.loads(response.body)
    answer = decode_tensors(raw)
    for i, sample in enumerate(answer["samples"]):
        assert sample["sample_rate"] == RATE
        assert sample["audio"].dtype == torch.float32 and torch.equal(sample["audio"], torch.from_numpy(waves[i]))
        assert torch.equal(sample["output"], frames[i])
    if not accept:  # JSON: the same base64 encoding as the frames
        assert isinstance(raw["samples"][0]["audio"]["data"], str)
    else:
        assert isinstance(raw["samples"][0]["audio"]["data"], bytes)


def test_a_model_without_sound_answers_as_before():
    frames = _frames()
    silent = _outcome(frames, None)
    fps = media.video_fps(_params(None), _info("tiny"))  # a family without a frame_rate field: the model's rate
    assert fps == 16
    mp4 = media_response("r5", [7], silent, 1, "mp4", fps, 0.5, _request(), bare=True).body
    assert mp4 == media.mp4_bytes(frames[0], 16)  # the existing function's output, byte for byte
    with av.open(io.BytesIO(mp4)) as container:
        assert [s.type for s in container.streams] == ["video"]
    png_frames = frames[:, :1]
    png = media_response("r5", [7], _outcome(png_frames, None), 1, "png", fps, 0.5, _request(), bare=True).body
    assert png == media.png_bytes(png_frames[0])

    plain = samples_payload("r5", [7], silent, 1, 0.5, False)
    wave, _ = _waveform(24.0, 1)
    sounding = samples_payload("r5", [7], _outcome(frames, wave[None]), 1, 0.5, False)
    audio_keys = {"audio", "sample_rate"}
    assert not audio_keys & set(plain["samples"][0])
    assert {k: v for k, v in sounding["samples"][0].items() if k not in audio_keys} == plain["samples"][0]


def test_wav_from_a_model_without_sound_is_a_400():
    from common.config.engine import Limits
    from router.request.schemas import GenerateBody
    from router.core.errors import FieldError
    from router.core.request_params import makes_sound, to_params

    info = _info("tiny")
    assert not makes_sound(info) and makes_sound(_info("tiny-ltx2"))
    with pytest.raises(FieldError) as e:
        to_params(GenerateBody(prompt="a fox", output_type="wav"), info, Limits())
    assert e.value.field == "output_type"
    assert to_params(GenerateBody(prompt="a fox", output_type="mp4"), info, Limits()).output_type == "frames"


def test_the_schema_offers_wav_only_from_a_model_with_sound(tmp_path):
    """/openapi.json's output_type: wav where the model directory has a vocoder (the same rule as the 400)."""
    from common.config.engine import EngineConfig
    from common.config.topology import parse_topology
    from router.api.body_facts import body_facts
    from router.core.request_params import makes_sound

    silent, sounding = _info("tiny"), _info("tiny-ltx2")
    assert makes_sound(sounding) and not makes_sound(silent)
    config = EngineConfig(model=str(silent.path), workers=parse_topology("encoder=1,denoise=1,decode=1", tmp_path),
                          router_endpoint=f"ipc://{tmp_path}/router.sock", runtime_dir=str(tmp_path))
    silent_enum, sounding_enum = (set(body_facts(config, info)["GenerateBody"]["properties"]["output_type"]["enum"])
                                  for info in (silent, sounding))
    assert silent_enum == {"frames", "latent", "mp4", "png"}
    assert sounding_enum == {"frames", "latent", "mp4", "png", "wav"}
