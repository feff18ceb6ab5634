"""``stream: true`` (router/api/stream.py, the decode worker's one-sample-a-turn decode) on the shared ``tiny`` engine:
each sample once, as soon as it is decoded, equal to the whole answer; refusals before the stream as usual; a
client that goes away mid-stream cancels the rest."""

from __future__ import annotations

import json
import re
import time

import httpx
import msgpack
import pytest
import torch

from common.protocol.http_tensors import decode_tensors

BODY = {"prompt": "a heron", "seed": 3, "n": 3, "num_inference_steps": 3, "output_type": "frames",
        "return_trajectory": True, "sde_step_indices": [1]}


@pytest.fixture(scope="module")
def url(shared_engine):
    return shared_engine("tiny").url


def _lines(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url + "/rollout/generate", json=body, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"] == "application/x-ndjson"
        return [decode_tensors(json.loads(line)) for line in r.iter_lines()]


def test_each_sample_once_equal_to_the_whole_answer(url):
    items = _lines(url, {**BODY, "stream": True})
    whole = decode_tensors(httpx.post(url + "/rollout/generate", json=BODY, timeout=120).json())
    *samples, done = items
    assert sorted(s["index"] for s in samples) == [0, 1, 2] and done["done"] is True
    assert done["request_id"] and set(done["timings"]) >= {"encode_s", "denoise_s", "decode_s", "total_s"}
    for s in samples:
        want = whole["samples"][s["index"]]
        assert s["seed"] == want["seed"] == 3 + s["index"]
        assert torch.equal(s["log_probs"], want["log_probs"])
        assert torch.equal(s["trajectory"]["latents"], want["trajectory"]["latents"])
        assert (s["output"] - want["output"]).abs().max() <= 1e-4  # decoded alone, not in a batch of 3

    as_bytes = _lines(url, {**BODY, "stream": True, "output_dtype": "uint8"})
    for s in as_bytes[:-1]:
        mine = next(x for x in samples if x["index"] == s["index"])["output"]
        assert s["output"].dtype == torch.uint8 and torch.equal(s["output"], (mine * 255).round().to(torch.uint8))


def test_the_python_client_streams(url):
    from router.client import EngineClient

    with EngineClient(url) as client:
        items = list(client.stream("a heron", n=2, num_inference_steps=2, output_type="frames", output_dtype="uint8"))
    assert sorted(i["index"] for i in items[:-1]) == [0, 1] and items[-1]["done"] is True
    assert items[0]["output"].dtype == torch.uint8 and items[0]["log_probs"].shape == (2,)


def test_msgpack_items_back_to_back(url):
    unpacker, items = msgpack.Unpacker(raw=False), []
    with httpx.stream("POST", url + "/generate", json={"prompt": "a heron", "n": 2, "num_inference_steps": 2,
                                                       "stream": True}, headers={"Accept": "application/msgpack"},
                      timeout=120) as r:
        assert r.headers["content-type"] == "application/msgpack"
        for chunk in r.iter_bytes():
            unpacker.feed(chunk)
            items.extend(unpacker)
    assert [i.get("index") for i in items[:-1]] in ([0, 1], [1, 0]) and items[-1]["done"] is True
    assert isinstance(items[0]["output"]["data"], bytes)


def test_refused_before_the_stream_and_cancelled_when_the_client_leaves(url):
    r = httpx.post(url + "/generate", json={"prompt": "x", "n": 2, "stream": True, "output_type": "mp4"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["field"] == "stream"
    r = httpx.post(url + "/rollout/generate", json={**BODY, "stream": True, "output_type": "latent",
                                                    "output_dtype": "uint8"}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["field"] == "output_dtype"

    def cancelled() -> float:
        text = httpx.get(url + "/metrics", timeout=30).text
        return sum(float(v) for v in re.findall(r'^disagg_cancelled_total\{reason="[^"]*disconnect[^"]*"\} (\S+)',
                                                text, re.M))

    before = cancelled()
    # Frames large enough that decoding the other seven samples outlasts noticing the client's departure.
    big = {**BODY, "n": 8, "height": 192, "width": 192, "num_frames": 17, "stream": True}
    with httpx.stream("POST", url + "/rollout/generate", json=big, timeout=120) as r:
        assert r.status_code == 200
        next(r.iter_lines())  # the first sample; then the client goes away
    deadline = time.monotonic() + 30
    while cancelled() == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cancelled() == before + 1
    assert httpx.post(url + "/generate", json={"prompt": "x", "num_inference_steps": 2}, timeout=60).status_code == 200
