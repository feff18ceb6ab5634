"""Answers with sound from a launched engine on ``tiny-ltx2``: the waveform the decode worker makes reaches every
answer that carries video.

- ``/generate`` frames: each sample's ``audio`` [channels, samples] and ``sample_rate`` (the vocoder's output
  rate, read from the model directory);
- ``/generate`` mp4 and wav of the same request: the very files the router's functions make of that answer's
  frames and waveform (byte for byte), the MP4 at the request's ``frame_rate`` with one video and one audio
  stream, the WAV within 16-bit quantisation of the waveform;
- the official ``openai`` client's videos API: the job's content is that MP4 with its audio stream.

The codec's fidelity and sync are proven in process (tests/test_media_audio.py); here the plumbing end to end.
The page plays the MP4 with its sound: tests/test_web_page.py style, heavy.
"""

from __future__ import annotations

import io
import json

import av
import numpy as np
import openai
import pytest

from common.protocol.http_tensors import body_to_tensor
from router.api import media
from router.api.sound import Sound, decode_wav, wav_bytes

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the client marks OpenAI's video API so

MODEL = "tiny-ltx2"
FIELDS = dict(prompt="a drum in the rain", width=64, height=64, num_frames=9, num_inference_steps=2, seed=3)


@pytest.fixture(scope="module")
def engine(shared_engine):
    # Shared (tests/test_ltx2_engine.py's too): the one video job made here stays listed, which no other module
    # depends on.
    return shared_engine(MODEL)


def _vocoder_rate(engine) -> int:
    from common.builtin import ensure_builtin

    config = json.loads((ensure_builtin(MODEL) / "vocoder" / "config.json").read_text())
    return int(config["output_sampling_rate"])


def _post(engine, **fields):
    r = engine.http.post("/generate", json={**FIELDS, **fields})
    assert r.status_code == 200, r.text
    return r


def _streams(mp4: bytes) -> tuple[list[str], int, float]:
    with av.open(io.BytesIO(mp4)) as c:
        return [s.type for s in c.streams], c.streams.audio[0].rate, float(c.streams.video[0].average_rate)


def test_generate_answers_carry_the_sound(engine):
    rate = _vocoder_rate(engine)
    sample = _post(engine, frame_rate=12.0).json()["samples"][0]
    frames, audio = body_to_tensor(sample["output"]), body_to_tensor(sample["audio"])
    assert sample["sample_rate"] == rate and audio.ndim == 2 and audio.shape[1] > 0
    sound = Sound(audio, rate)

    mp4 = _post(engine, frame_rate=12.0, output_type="mp4")
    assert mp4.headers["content-type"] == "video/mp4"
    assert mp4.content == media.mp4_bytes(frames, 12.0, sound)  # the router's file of that answer, exactly
    assert _streams(mp4.content) == (["video", "audio"], rate, 12.0)

    wav = _post(engine, frame_rate=12.0, output_type="wav")
    assert wav.headers["content-type"] == "audio/wav" and wav.content == wav_bytes(sound)
    pcm, wav_rate = decode_wav(wav.content)
    assert wav_rate == rate
    assert np.abs(pcm - audio.clamp(-1, 1).numpy()).max() <= 0.5 / 32767 + 1e-7


def test_the_videos_api_content_has_the_sound(engine):
    rate = _vocoder_rate(engine)
    with openai.OpenAI(base_url=engine.url + "/v1", api_key="unused", max_retries=0) as client:
        video = client.videos.create_and_poll(
            prompt=FIELDS["prompt"], size="64x64", poll_interval_ms=50,
            extra_body={k: FIELDS[k] for k in ("num_frames", "num_inference_steps", "seed")})
        assert video.status == "completed", video.error
        content = client.videos.download_content(video.id).read()
    types, audio_rate, fps = _streams(content)
    assert types == ["video", "audio"] and audio_rate == rate
    assert content == _post(engine, output_type="mp4").content  # /generate's MP4 of the same fields
