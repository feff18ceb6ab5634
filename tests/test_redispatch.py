"""Nothing lost when a worker dies: the requests it held run again and are answered as if nothing happened.

A request in flight on a denoise worker, on the only encoder and on the only decode worker is SIGKILLed with
its worker; it is answered 200 with what the same request gives on an undisturbed engine (max abs diff 0.0:
latents, frames, rollout log-probs and trajectories, against an engine of the same topology that is never
touched), and the answer says it took 2 attempts. With one instance of the role, the re-run waits for the
restarted worker. A rollout whose weights changed between
attempts is refused (409 ``weights_changed``); serving runs again on the new weights. A request that kills
its worker on every attempt (a poison request, by the fault-injection variable) fails after its attempts and
the engine goes on serving.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from common.runtime.engine_process import EngineProcess
from common.runtime.worker import FAULT_ENV
from router.client import EngineClient, EngineHTTPError

# CI runs these (heavy): launched engines' processes are their subject:
# every test kills, stops or fails a worker process.
pytestmark = pytest.mark.heavy

# A few seconds of denoising on the tiny model: long enough to be killed in flight.
LONG = dict(height=64, width=64, num_frames=9, num_inference_steps=150, output_type="latent")
SHORT = dict(num_inference_steps=4)


@pytest.fixture(scope="module")
def weights_root(tmp_path_factory, tiny_dir):
    root = tmp_path_factory.mktemp("weights")
    shutil.copytree(tiny_dir / "transformer", root / "transformer")  # the same weights: only the version moves
    return root


@pytest.fixture(scope="module")
def engine(tmp_path_factory, weights_root):
    e = EngineProcess("tiny", "encoder=1,denoise=2,decode=1", extra=["--weight-root", str(weights_root)],
                      workdir=tmp_path_factory.mktemp("engine"))
    yield e
    e.stop()


@pytest.fixture(scope="module")
def undisturbed(shared_engine) -> EngineClient:
    """An engine of the same topology whose workers are never touched (the session's): the answers to compare
    with."""
    with EngineClient(shared_engine("tiny", "encoder=1,denoise=2,decode=1", launched=True).url) as c:
        yield c


def _workers(engine) -> dict[tuple[str, int], dict]:
    return {(w["role"], w["index"]): w for w in engine.http.get("/health").json()["workers"]}


def _wait_healthy(engine, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while engine.http.get("/health").status_code != 200:
        assert time.monotonic() < deadline, engine.log()
        time.sleep(0.1)


def _in_background(call) -> Future:
    pool = ThreadPoolExecutor(1)
    fut = pool.submit(call)
    pool.shutdown(wait=False)
    return fut


def _same(got: dict, want: dict) -> None:
    assert len(got["samples"]) == len(want["samples"])
    for g, w in zip(got["samples"], want["samples"]):
        assert (g["output"] - w["output"]).abs().max().item() == 0.0
        for key in ("log_probs", "log_prob_steps"):
            if key in w:
                assert torch.equal(g[key], w[key]), key
        for name, t in w.get("trajectory", {}).items():
            assert torch.equal(g["trajectory"][name], t), name


def _busiest_denoise(engine) -> dict:
    deadline = time.monotonic() + 10
    while True:
        busy = [w for (role, _), w in _workers(engine).items() if role == "denoise" and w["outstanding"]]
        if busy:
            return busy[0]
        assert time.monotonic() < deadline, "the request never reached a denoise worker"
        time.sleep(0.02)


@pytest.mark.parametrize("path, body", [
    ("/generate", dict(prompt="a heron in the reeds", seed=3, **LONG)),
    ("/rollout/generate", dict(prompt="a boat at dawn", seed=4, n=2, return_trajectory=True, noise_level=0.7,
                               **LONG)),
], ids=["serving", "rollout"])
def test_a_request_on_a_killed_denoise_worker_is_answered_as_if_undisturbed(engine, undisturbed, path, body):
    want = undisturbed._post(path, body)
    assert want["attempts"] == 1
    fut = _in_background(lambda: EngineClient(engine.url)._post(path, body))
    victim = _busiest_denoise(engine)
    time.sleep(0.1)  # some steps in, well before the last (a fast machine runs the 150 in well under a second)
    os.kill(victim["pid"], signal.SIGKILL)
    got = fut.result(timeout=120)
    assert got["attempts"] == 2
    _same(got, want)
    _wait_healthy(engine)
    assert "running it again (attempt 2 of 3)" in engine.log_text()


def _held_in(engine, role: str, call) -> tuple[dict, int]:
    """``call()`` while the only ``role`` worker is stopped (SIGSTOP), then that worker SIGKILLed: the request
    was in it. Returns the answer and the killed pid."""
    pid = _workers(engine)[(role, 0)]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        fut = _in_background(call)
        time.sleep(1.0)  # sent, and (for decode) through the encoder and denoise workers
    finally:
        os.kill(pid, signal.SIGKILL)
    return fut.result(timeout=120), pid


@pytest.mark.parametrize("role, body", [
    ("encoder", dict(prompt="a fox in the snow", seed=5, output_type="latent", **SHORT)),
    ("decode", dict(prompt="a lighthouse", seed=6, output_type="frames", **SHORT)),
])
def test_the_only_encoder_or_decode_worker_killed_the_request_waits_for_its_restart(engine, undisturbed, role,
                                                                                     body):
    want = undisturbed.generate(**body)
    got, killed = _held_in(engine, role, lambda: EngineClient(engine.url).generate(**body))
    assert got["attempts"] == 2 and _workers(engine)[(role, 0)]["pid"] != killed
    _same(got, want)
    _wait_healthy(engine)


def test_a_rollout_whose_weights_changed_between_attempts_is_refused(engine, weights_root):
    body = dict(prompt="a kite", seed=8, **SHORT)
    before = EngineClient(engine.url).generate(**body)["weight_version"]
    update = threading.Thread(
        target=lambda: EngineClient(engine.url).update_weights_from_disk(weights_root / "transformer"))
    pid = _workers(engine)[("encoder", 0)]["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        rollout = _in_background(lambda: EngineClient(engine.url).rollout(**body))
        serving = _in_background(lambda: EngineClient(engine.url).generate(**body))
        time.sleep(0.5)
        update.start()  # the denoise workers are idle: the update lands while both requests wait in the encoder
        update.join(timeout=60)
    finally:
        os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineHTTPError) as e:
        rollout.result(timeout=120)
    assert e.value.status == 409 and e.value.error["type"] == "weights_changed"
    assert f"({before}, None) -> ({before + 1}, None)" in e.value.error["message"]
    answered = serving.result(timeout=120)  # serving runs again, on the new weights, and says so
    assert answered["attempts"] == 2 and answered["weight_version"] == before + 1
    _wait_healthy(engine)


@pytest.mark.heavy  # an engine of its own whose workers die and restart three times: CI runs it
def test_a_poison_request_fails_after_its_attempts_and_the_engine_serves_on(tmp_path):
    e = EngineProcess("tiny", "encoder=1,denoise=2,decode=1", workdir=tmp_path,
                      env={FAULT_ENV: "denoise:poison pill"})
    try:
        c = EngineClient(e.url)
        want = c.generate("a quiet lake", seed=1, **SHORT)
        t0 = time.monotonic()
        with pytest.raises(EngineHTTPError) as err:
            c.generate("a poison pill", seed=1, **SHORT)
        assert err.value.status == 503 and err.value.error["type"] == "worker_lost"
        assert err.value.error["message"].endswith("(attempt 3 of 3)")
        assert e.log_text().count(f"its prompt contains ${FAULT_ENV}'s text") == 3
        assert time.monotonic() - t0 < 60
        _wait_healthy(e)
        got = c.generate("a quiet lake", seed=1, **SHORT)
        assert got["attempts"] == 1
        _same(got, want)
    finally:
        e.stop()
