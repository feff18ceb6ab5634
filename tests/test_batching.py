"""Continuous batching: requests at different steps share forwards; results equal their unbatched runs."""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import solo_then_concurrent
from router.client import EngineClient

TOL = 1e-5


def _mix(n: int, seed0: int = 0) -> list[tuple[str, dict]]:
    """Same latent shape (so they can batch); rollout and eval, different steps, CFG on and off."""
    out = []
    for i in range(n):
        body = dict(prompt=f"batch {i % 4}", seed=seed0 + i, num_inference_steps=3 + i % 5,
                    guidance_scale=(1.0, 4.0, 6.0)[i % 3], output_type="latent")
        if i % 2:
            body.update(sde_type=("sde", "cps")[i % 4 // 2], noise_level=0.7, return_trajectory=True)
            out.append(("/rollout/generate", body))
        else:
            out.append(("/generate", body))
    return out


def _run_solo_and_mixed(url: str, reqs):
    with EngineClient(url) as c:
        return solo_then_concurrent(c, reqs)


def _assert_close(solo, mixed):
    for a, b in zip(solo, mixed):
        assert a["batch"] == 1
        assert (a["output"] - b["output"]).abs().max().item() <= TOL
        if "log_probs" in a:
            assert a["log_prob_steps"].tolist() == b["log_prob_steps"].tolist()
            assert torch.allclose(a["log_probs"], b["log_probs"], rtol=0, atol=TOL)


@pytest.fixture(scope="module")
def engine(shared_engine):
    return shared_engine("tiny")


def test_mixed_requests_batch_and_equal_unbatched(engine):
    solo, mixed = _run_solo_and_mixed(engine.url, _mix(12))
    assert max(m["batch"] for m in mixed) >= 3  # they really shared forwards
    _assert_close(solo, mixed)


def test_texts_of_different_lengths_never_fail_their_batch_mates(engine):
    """Requests sent at once, one of them with another max_sequence_length (Wan's transformer takes no text
    mask, so its text cannot share a forward with longer ones): each answered, equal to its run alone; the two
    of one text length shared forwards, the other ran in forwards of its own."""
    steps = dict(num_inference_steps=100, output_type="latent")  # long enough to overlap on a loaded machine
    reqs = [("/generate", dict(prompt="a fox", seed=1, **steps)),
            ("/generate", dict(prompt="a cat", seed=2, max_sequence_length=1, **steps)),
            ("/generate", dict(prompt="a kite over a grey winter sea", seed=3, **steps))]
    solo, mixed = _run_solo_and_mixed(engine.url, reqs)
    assert [m["batch"] for m in mixed] == [2, 1, 2]
    _assert_close(solo, mixed)


def test_max_batch_size_is_honoured(engine_factory):
    eng = engine_factory("tiny", extra=["--max-batch-size", "2"])
    solo, mixed = _run_solo_and_mixed(eng.url, _mix(8, seed0=50))
    assert max(m["batch"] for m in mixed) == 2
    _assert_close(solo, mixed)


@pytest.mark.heavy  # an engine of a second Wan model; two experts batch in process
def test_two_experts_batch_per_expert(engine_factory):
    eng = engine_factory("tiny-moe")
    reqs = [(p, {**b, "num_inference_steps": 4 + i % 3}) for i, (p, b) in enumerate(_mix(8, seed0=90))]
    solo, mixed = _run_solo_and_mixed(eng.url, reqs)
    assert max(m["batch"] for m in mixed) > 1
    _assert_close(solo, mixed)


def test_router_picks_the_least_loaded_instance(shared_engine):
    """With one denoise worker busy on a long request, new requests go to the idle one (not round robin)."""
    eng = shared_engine("tiny", "encoder=1,denoise=2,decode=1")
    long = dict(prompt="long", seed=1, height=128, width=128, num_frames=9, num_inference_steps=300,
                output_type="latent")
    with EngineClient(eng.url) as c, ThreadPoolExecutor(2) as pool:
        busy = pool.submit(c.generate, **long)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            rows = [w for w in eng.http.get("/health").json()["workers"] if w["role"] == "denoise"]
            if any(w["outstanding"] for w in rows):
                break
            time.sleep(0.02)
        taken = next(w["index"] for w in rows if w["outstanding"])
        shorts = [c.generate(f"short {i}", seed=i, output_type="latent")["samples"][0]["route"]["denoise"]
                  for i in range(5)]
        assert busy.result()["samples"][0]["route"]["denoise"] == taken
    assert shorts == [1 - taken] * 5


def test_batched_text_encoding_equals_unbatched_and_diffusers(tiny_dir):
    from conftest import diffusers_pipe
    from common.families.wan.text import WanTextEncoder
    from encoder_worker.prompt_cache import EmbeddingCache

    te = WanTextEncoder.load(tiny_dir, torch.float32, "cpu")
    prompts = ["a fox at dawn", "", "Two  cats &amp; a dog\n", "a much longer prompt about a kite over the sea"]
    batched = te.encode(prompts)
    pipe = diffusers_pipe(tiny_dir)
    for p, b in zip(prompts, batched):
        assert torch.equal(b, te.encode_one(p))
        with torch.no_grad():  # as the pipeline's own __call__ runs it
            ref = pipe._get_t5_prompt_embeds(p, max_sequence_length=512)[0]
        assert torch.equal(ref[: b.shape[0]], b) and not ref[b.shape[0]:].any()
    size = [b.numel() * b.element_size() for b in batched]
    cache = EmbeddingCache(max_bytes=size[2] + size[3])  # room for the last two only
    for p, b in zip(prompts, batched):
        cache.put(p, b)
    assert cache.bytes == size[2] + size[3]
    assert cache.get(prompts[0]) is None and cache.get(prompts[1]) is None  # least recently used went first
    assert torch.equal(cache.get(prompts[2]), batched[2]) and torch.equal(cache.get(prompts[3]), batched[3])
