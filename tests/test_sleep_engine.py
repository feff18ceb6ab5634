"""Releasing and resuming the weights on a launched engine (``small``: a 66 MB transformer, so that the denoise
worker's RSS shows the release).

Level 1 of ``weights`` puts every worker to ``sleeping`` and brings the weights back bit for bit; level 2 of the
transformer returns its bytes to the OS, and a push or a reload from disk brings them back; each resume gives
outputs equal to before the release (max abs diff 0.0). Requests meanwhile wait and get 503 ``sleeping``,
never a wrong output; bad input is a 400 naming the field.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from common.diffusion.weights import state_dict_checksum
from router.client import EngineClient, EngineHTTPError

REQ = dict(prompt="a lighthouse at dusk", seed=4, height=32, width=32, num_frames=1, num_inference_steps=3,
           guidance_scale=4.0)
ROLLOUT = dict(REQ, return_trajectory=True, sde_step_indices=[1])


@pytest.fixture(scope="module")
def engine(engine_factory):
    # Launched: the workers' memory is read per process, and a heavy test kills one.
    return engine_factory("small", extra=["--weight-sync-from-memory", "--worker-wait", "30"], launched=True)


@pytest.fixture(scope="module")
def client(engine):
    with EngineClient(engine.url) as c:
        yield c


@pytest.fixture(scope="module")
def reference(client):
    """Outputs before any release: frames, latents, a rollout's log-probs and trajectory, the checksum."""
    frames = client.generate(**REQ)["samples"][0]["output"]
    r = client.rollout(**ROLLOUT)["samples"][0]
    return {"frames": frames, "log_probs": r["log_probs"], "trajectory": r["trajectory"]["latents"],
            "sha256": client.weights_checksum()["sha256"]}


def _same_as(client, reference) -> None:
    frames = client.generate(**REQ)["samples"][0]["output"]
    r = client.rollout(**ROLLOUT)["samples"][0]
    assert (frames - reference["frames"]).abs().max().item() == 0.0
    assert (r["log_probs"] - reference["log_probs"]).abs().max().item() == 0.0
    assert (r["trajectory"]["latents"] - reference["trajectory"]).abs().max().item() == 0.0
    assert client.weights_checksum()["sha256"] == reference["sha256"]


def _states(client) -> dict[str, str]:
    return {w["role"]: w["state"] for w in client.health()["workers"]}


def _rss(pid: int) -> dict[str, int]:
    """A process's resident bytes: its own (``RssAnon``: the weights) and shared memory mapped (``RssShmem``:
    the trainer's buckets)."""
    kinds = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssShmem"):
            kinds[key] = int(value.split()[0]) * 1024
    return kinds


def _denoise_pid(client) -> int:
    return next(w["pid"] for w in client.health()["workers"] if w["role"] == "denoise")


def test_level1_of_weights_sleeps_every_worker_and_restores_them_exactly(client, reference):
    out = client.release_memory_occupation(["weights"], level=1)
    assert out["is_sleeping"] and out["tags"] == ["transformer", "text_encoder", "vae"]
    assert _states(client) == {"encoder": "sleeping", "denoise": "sleeping", "decode": "sleeping"}
    assert all(c["sleeping"] and c["level"] == 1 for c in client.is_sleeping()["components"].values())
    t0 = time.monotonic()
    with pytest.raises(EngineHTTPError) as e:
        client.generate(**REQ, timeout_s=1.0)  # waits (up to its deadline here), never runs on released weights
    assert (e.value.status, e.value.error["type"]) == (503, "sleeping") and time.monotonic() - t0 >= 0.9
    with pytest.raises(EngineHTTPError) as e:
        client.weights_checksum()
    assert e.value.error["type"] == "sleeping"
    out = client.resume_memory_occupation()
    assert not out["is_sleeping"] and out["weight_version"] == 0
    assert set(_states(client).values()) == {"ready"}
    _same_as(client, reference)


def test_level2_of_the_transformer_returns_its_bytes_and_a_push_brings_them_back(engine, client, reference):
    from diffusers import WanTransformer3DModel

    trainer = WanTransformer3DModel.from_pretrained(Path(client.health()["model"]) / "transformer").eval()
    nbytes = sum(t.numel() * t.element_size() for t in trainer.state_dict().values())
    client.update_weights_from_tensors(trainer.state_dict())  # the worker now keeps the buckets mapped
    pid = _denoise_pid(client)
    before = _rss(pid)
    out = client.release_memory_occupation(["transformer"], level=2)
    assert out["workers"][0]["released_bytes"] == nbytes
    after = _rss(pid)
    for kind, what in (("RssAnon", "weights"), ("RssShmem", "buckets")):  # returned to the OS, both
        dropped = before[kind] - after[kind]
        assert dropped >= 0.9 * nbytes, f"{kind} fell by {dropped / 1e6:.1f} MB, the {what} are {nbytes / 1e6:.1f} MB"
    assert _states(client)["denoise"] == "sleeping" and _states(client)["encoder"] == "ready"
    with pytest.raises(EngineHTTPError) as e:
        client.resume_memory_occupation(["transformer"])  # neither a push nor a reload
    assert (e.value.status, e.value.error["type"]) == (409, "weights_missing")
    assert client.is_sleeping()["components"]["transformer"]["weights"] == "dropped"
    pushed = client.update_weights_from_tensors(trainer.state_dict())  # accepted while asleep
    assert pushed["sha256"] == state_dict_checksum(trainer) == reference["sha256"]
    assert _states(client)["denoise"] == "sleeping"  # until the resume
    client.resume_memory_occupation(["transformer"])
    _same_as(client, reference)


def test_level2_resume_reloads_from_the_model_directory(client, reference):
    version = client.weights_checksum()["weight_version"]
    client.release_memory_occupation(["transformer", "vae"], level=2)
    out = client.resume_memory_occupation(["transformer", "vae"], reload="disk")
    assert out["weight_version"] == version + 1 and not out["is_sleeping"]
    _same_as(client, reference)


def test_a_rollout_admitted_before_a_level2_release_and_run_after_it_is_refused(client, reference):
    from diffusers import WanTransformer3DModel

    trainer = WanTransformer3DModel.from_pretrained(Path(client.health()["model"]) / "transformer").eval()
    client.release_memory_occupation(["text_encoder"], level=1)  # the rollout waits at the door
    result: dict = {}
    waiting = threading.Thread(target=lambda: result.update(r=_status(client.rollout, ROLLOUT)))
    waiting.start()
    time.sleep(0.5)
    client.release_memory_occupation(["transformer"], level=2)
    client.update_weights_from_tensors(trainer.state_dict())
    client.resume_memory_occupation(["weights"])
    waiting.join(60)
    assert result["r"] == (409, "weights_changed")
    _same_as(client, reference)


def _status(call, body) -> tuple[int, str]:
    """A request's status and error type (200, "" when it succeeds)."""
    try:
        call(**body)
        return 200, ""
    except EngineHTTPError as e:
        return e.status, e.error["type"]


def test_a_release_waits_for_the_work_in_flight_and_abort_answers_it_at_once(client, reference):
    long = dict(REQ, num_inference_steps=40, output_type="latent")
    with EngineClient(client.base_url) as other:
        for mode, expected in (("wait", (200, "")), ("abort", (503, "sleeping"))):
            result: dict = {}
            t = threading.Thread(target=lambda: result.update(r=_status(other.generate, long)))
            t.start()
            deadline = time.monotonic() + 30
            while not any(w["outstanding"] for w in client.health()["workers"]) and time.monotonic() < deadline:
                time.sleep(0.01)
            client.release_memory_occupation(["transformer"], level=1, mode=mode)
            t.join(60)
            assert result["r"] == expected, mode
            client.resume_memory_occupation(["transformer"])
    _same_as(client, reference)


@pytest.mark.parametrize("method,path,body,field", [
    ("post", "/release_memory_occupation", {"tags": ["unet"]}, "tags"),
    ("post", "/release_memory_occupation", {"tags": "transformer"}, "tags"),
    ("post", "/release_memory_occupation", {"level": 3}, "level"),
    ("post", "/release_memory_occupation", {"level": "1"}, "level"),
    ("post", "/release_memory_occupation", {"mode": "keep"}, "mode"),
    ("post", "/release_memory_occupation", {"levle": 1}, "levle"),
    ("post", "/resume_memory_occupation", {"reload": "hub"}, "reload"),
    ("post", "/resume_memory_occupation", [1], "body"),
    ("post", "/sleep?level=0", None, "level"),
    ("post", "/sleep?level=1&mode=drop", None, "mode"),
    ("post", "/sleep?tags=vae", None, "tags"),
    ("post", "/sleep", {"level": 1}, "body"),
    ("post", "/wake_up?tags=unet", None, "tags"),
    ("post", "/wake_up", {"tags": ["vae"]}, "body"),
    ("get", "/is_sleeping?verbose=1", None, "verbose"),
])
def test_bad_input_is_a_400_naming_the_field(engine, client, reference, method, path, body, field):
    r = getattr(engine.http, method)(path, **({} if body is None else {"json": body}))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["field"] == field
    assert not client.is_sleeping()["is_sleeping"] and set(_states(client).values()) == {"ready"}


def test_vllm_spellings(engine, client, reference):
    r = engine.http.post("/sleep?level=1")
    assert r.status_code == 200 and engine.http.get("/is_sleeping").json()["is_sleeping"] is True
    r = engine.http.post("/wake_up?tags=transformer&tags=vae")
    assert r.status_code == 200 and r.json()["components"]["text_encoder"]["sleeping"] is True
    assert engine.http.post("/wake_up").json()["is_sleeping"] is False
    _same_as(client, reference)


@pytest.mark.heavy
def test_a_worker_that_restarts_while_asleep_stays_asleep(client, reference):
    client.release_memory_occupation(["transformer"], level=1)
    old = _denoise_pid(client)
    os.kill(old, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        w = next(w for w in client.health()["workers"] if w["role"] == "denoise")
        if w["pid"] != old and w["state"] == "sleeping":
            break
        time.sleep(0.2)
    assert w["state"] == "sleeping"
    time.sleep(1.0)  # heartbeats of the new process keep it asleep
    assert _states(client)["denoise"] == "sleeping"
    # Earlier tests pushed weights from memory, which the new process lacks: as after any restart, the trainer
    # pushes them again (accepted while asleep), then wakes the worker.
    from diffusers import WanTransformer3DModel

    trainer = WanTransformer3DModel.from_pretrained(Path(client.health()["model"]) / "transformer").eval()
    client.update_weights_from_tensors(trainer.state_dict())
    client.resume_memory_occupation(["transformer"])
    _same_as(client, reference)


@pytest.mark.heavy  # a second engine; test_sleep.py covers each family
def test_two_experts_and_the_image_side_of_an_image_to_video_model(engine_factory):
    """Wan2.2 I2V-A14B-like: ``transformer`` is both experts (each must be pushed before a resume), the
    encoder's image side (the VAE's encoder half) sleeps with the text encoder."""
    from common.diffusion.policy import Policy
    from common.families import read_model
    from test_wan_i2v import picture

    eng = engine_factory("tiny-wan-i2v-a14b", extra=["--weight-sync-from-memory"])
    req = dict(prompt="a fox at dawn", seed=3, num_inference_steps=4, image=picture(40, 24, 1))
    try:
        with EngineClient(eng.url) as c:
            before = c.generate(**req)["samples"][0]["output"]
            trainer = Policy.load(read_model(Path(c.health()["model"])), torch.float32, "cpu").experts
            out = c.release_memory_occupation(["transformer"], level=2)
            assert out["workers"][0]["released_bytes"] == sum(
                t.numel() * t.element_size() for m in trainer.values() for t in m.state_dict().values())
            out = c.release_memory_occupation(["text_encoder", "vae"], level=1)
            assert {w["role"] for w in out["workers"]} == {"encoder", "decode"} and out["workers"][0]["released_bytes"]
            c.update_weights_from_tensors(trainer["transformer"].state_dict(), module="transformer")
            with pytest.raises(EngineHTTPError) as e:
                c.resume_memory_occupation(["weights"])
            assert e.value.status == 409 and "transformer_2" in e.value.error["message"]
            assert c.is_sleeping()["components"]["transformer"]["weights"] == "partly pushed"
            c.update_weights_from_tensors(trainer["transformer_2"].state_dict(), module="transformer_2")
            c.resume_memory_occupation(["weights"])
            assert (c.generate(**req)["samples"][0]["output"] - before).abs().max().item() == 0.0
    finally:
        eng.stop()


@pytest.mark.heavy
def test_every_rank_of_a_multi_device_worker_releases_and_resumes(engine_factory):
    """CFG parallel x Ulysses 2 (four ranks): level 1, level 2 with a push, level 2 reloaded from disk; the
    followers' experts follow the leader's each time (outputs equal before and after)."""
    from diffusers import WanTransformer3DModel

    eng = engine_factory("tiny-moe", "encoder=1,denoise=1:ulysses=2:cfg,decode=1", ["--weight-sync-from-memory"])
    req = dict(prompt="a fox at dawn", seed=3, num_inference_steps=4, guidance_scale=4.0, output_type="latent")
    try:
        with EngineClient(eng.url) as c:
            before = c.generate(**req)["samples"][0]["output"]
            model = Path(c.health()["model"])
            trainer = {name: WanTransformer3DModel.from_pretrained(model / name).state_dict()
                       for name in ("transformer", "transformer_2")}
            for level, how in ((1, None), (2, "push"), (2, "disk")):
                c.release_memory_occupation(["transformer"], level=level)
                if how == "push":
                    for name, state in trainer.items():
                        c.update_weights_from_tensors(state, module=name)
                c.resume_memory_occupation(["transformer"], reload="disk" if how == "disk" else None)
                after = c.generate(**req)["samples"][0]["output"]
                assert (after - before).abs().max().item() == 0.0, (level, how)
    finally:
        eng.stop()
