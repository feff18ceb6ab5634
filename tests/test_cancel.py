"""Cancellation: a request never outlives its client (a disconnect, POST /abort_request, DELETE /v1/videos/{id}).

The session's shared ``tiny`` engine; the router's pieces in process where no worker is needed.
"""

from __future__ import annotations

import asyncio
import gc
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from fastapi import FastAPI, Request

from common.protocol.errors import Cancelled
from common.protocol.http_tensors import body_to_tensor
from common.protocol.messages import PROTOCOL_VERSION, ErrorReply, GenerationParams, Route
from common.runtime.stage import QueuedBatchStage
from router.api.auth import ApiKeyMiddleware
from router.api.cancel_api import abort_request
from router.link.cancel import Cancellations
from router.client import EngineClient
from router.core.errors import EngineError
from router.api.http_errors import install_error_handlers
from router.link.join import Pending, PendingTable

# CI runs these (heavy): launched engines' processes are their subject:
# it reads the workers' log lines.
pytestmark = pytest.mark.heavy

# 1000 steps of 256x256, 17 frames: about half a minute on 2 cores, cancelled after a few seconds.
LONG = {"prompt": "a long walk", "num_inference_steps": 1000, "height": 256, "width": 256, "num_frames": 17}
SHORT = {"prompt": "a quick look", "num_inference_steps": 4}


@pytest.fixture(scope="module")
def engine(shared_engine):
    return shared_engine("tiny", launched=True)  # it reads the log; every test leaves it answering as before: cancelled work is gone


def _cancelled(engine, reason: str) -> float:
    """``disagg_cancelled_total{reason=...}`` from /metrics (0 before the first)."""
    m = re.search(rf'^disagg_cancelled_total\{{reason="{reason}"\}} (\S+)$', engine.http.get("/metrics").text, re.M)
    return float(m.group(1)) if m else 0.0


def _progress(engine, rid: str) -> dict | None:
    r = engine.http.get(f"/progress/{rid}")
    return r.json() if r.status_code == 200 else None


def _until(check, timeout_s: float = 60.0, what: str = "the condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"{what} not reached in {timeout_s}s")


def _denoising(engine, rid: str, step: int = 1) -> dict:
    """Wait until request ``rid`` has taken ``step`` denoising steps (as its progress says)."""
    return _until(lambda: (p := _progress(engine, rid)) and p["stage"] == "denoise" and p["step"] >= step and p,
                  what=f"{rid} denoising")


def _post(engine, path: str, body: dict, rid: str, timeout_s: float = 600) -> httpx.Response:
    return httpx.post(engine.url + path, json=body, headers={"X-Request-Id": rid}, timeout=timeout_s)


def test_a_client_that_goes_away_cancels_its_request(engine):
    """``curl -m 3``: the request leaves the denoise worker, its id is free at once, a short request behind it
    answers long before the long one would have ended, and /metrics counts it."""
    before, log_at = _cancelled(engine, "client_disconnected"), len(engine.log_text())
    client = {}

    def give_up_after_3s():
        try:
            client["answer"] = _post(engine, "/generate", LONG, "gone", timeout_s=3)
        except httpx.ReadTimeout:
            client["answer"] = None
    gone = threading.Thread(target=give_up_after_3s)
    gone.start()
    seen = []  # (time, step) of the long request while its client waits: its step time
    while gone.is_alive():
        p = _progress(engine, "gone")
        if p is not None and p["step"]:
            seen.append((time.monotonic(), p["step"]))
        time.sleep(0.05)
    gone.join()
    assert client["answer"] is None, client  # it timed out
    (t0, s0), (t1, s1) = seen[0], seen[-1]
    assert s1 > s0, seen
    would_still_run_s = (1000 - s1) * (t1 - t0) / (s1 - s0)  # what the long request had left when its client left
    _until(lambda: _progress(engine, "gone") is None, would_still_run_s / 5, "the request gone from /progress")
    start = time.monotonic()
    r = _post(engine, "/generate", SHORT, "gone")  # the same id, accepted at once
    took = time.monotonic() - start
    assert r.status_code == 200 and r.json()["request_id"] == "gone", r.text
    assert took < would_still_run_s / 5, (took, would_still_run_s)  # not queued behind the long request's rows
    assert _cancelled(engine, "client_disconnected") == before + 1
    _until(lambda: "request gone cancelled in denoise" in engine.log_text()[log_at:], 10, "the denoise worker's drop")


def test_abort_request_cancels_by_rid_or_all(engine):
    """``POST /abort_request``: by the request's X-Request-Id, or every one; each answered 499 ``cancelled`` (a
    rollout without return_partial too); an unknown rid is a 404 naming ``rid``."""
    before = _cancelled(engine, "aborted")
    with ThreadPoolExecutor(3) as pool:
        one = pool.submit(_post, engine, "/generate", LONG, "ab-1")
        _denoising(engine, "ab-1")
        r = engine.http.post("/abort_request", json={"rid": "ab-1"})
        assert r.status_code == 200 and r.json() == {"aborted": ["ab-1"]}
        answer = one.result(timeout=30)
        assert answer.status_code == 499, answer.text
        assert answer.json()["error"] | {"message": ""} == {"type": "cancelled", "message": "", "request_id": "ab-1",
                                                             "stage": "router"}
        rest = {rid: pool.submit(_post, engine, path, LONG, rid)
                for rid, path in (("ab-2", "/generate"), ("ab-3", "/rollout/generate"))}
        for rid in rest:
            _denoising(engine, rid)
        r = engine.http.post("/abort_request", json={"abort_all": True})
        assert r.status_code == 200 and sorted(r.json()["aborted"]) == ["ab-2", "ab-3"]
        for rid, future in rest.items():
            answer = future.result(timeout=30)
            assert answer.status_code == 499 and answer.json()["error"]["type"] == "cancelled", (rid, answer.text)
    assert _cancelled(engine, "aborted") == before + 3
    r = engine.http.post("/abort_request", json={"rid": "ab-1"})  # answered already
    assert r.status_code == 404 and r.json()["error"]["field"] == "rid"
    r = engine.http.post("/abort_request", json={})
    assert r.status_code == 400 and r.json()["error"]["field"] == "rid"


def test_an_aborted_rollout_with_return_partial_answers_its_steps_done(engine):
    """Its log-probs and trajectory are those of the steps it took: the first ``steps_done`` of the same rollout
    run to its end."""
    body = {"prompt": "a fox at dawn", "num_inference_steps": 300, "seed": 3, "n": 2, "return_trajectory": True,
            "return_partial": True}
    with ThreadPoolExecutor(1) as pool:
        partial = pool.submit(_post, engine, "/rollout/generate", body, "part")
        _denoising(engine, "part")
        with EngineClient(engine.url) as client:  # the Python client's spelling
            assert client.abort_request("part") == ["part"]
        r = partial.result(timeout=60)
    assert r.status_code == 200, r.text
    got = r.json()
    k = got["steps_done"]
    assert got["partial"] is True and 0 < k < 300
    full = _post(engine, "/rollout/generate", {**body, "return_partial": False}, "whole").json()
    assert "partial" not in full
    for mine, whole in zip(got["samples"], full["samples"], strict=True):
        log_probs = body_to_tensor(mine["log_probs"])
        assert log_probs.shape == (k,)
        assert torch.equal(log_probs, body_to_tensor(whole["log_probs"])[:k])
        assert torch.equal(body_to_tensor(mine["log_prob_steps"]), torch.arange(k))
        trajectory, complete = mine["trajectory"], whole["trajectory"]
        assert torch.equal(body_to_tensor(trajectory["latents"]), body_to_tensor(complete["latents"])[:k + 1])
        assert torch.equal(body_to_tensor(trajectory["timesteps"]), body_to_tensor(complete["timesteps"])[:k])
        assert torch.equal(body_to_tensor(trajectory["sigmas"]), body_to_tensor(complete["sigmas"])[:k + 1])
        assert torch.equal(body_to_tensor(mine["output"]), body_to_tensor(complete["latents"])[k])  # x_k


def test_deleting_a_running_video_job_cancels_it(engine):
    before, log_at = _cancelled(engine, "job_deleted"), len(engine.log_text())
    job = engine.http.post("/v1/videos", json={"prompt": "a long shot", "size": "256x256", "num_frames": 17,
                                               "num_inference_steps": 1000}).json()
    _until(lambda: engine.http.get(f"/v1/videos/{job['id']}").json()["progress"] > 5, what="the job denoising")
    r = engine.http.delete(f"/v1/videos/{job['id']}")
    assert r.status_code == 200 and r.json() == {"id": job["id"], "object": "video.deleted", "deleted": True}
    assert engine.http.get(f"/v1/videos/{job['id']}").status_code == 404
    assert job["id"] not in [v["id"] for v in engine.http.get("/v1/videos").json()["data"]]
    assert _cancelled(engine, "job_deleted") == before + 1
    _until(lambda: re.search(r"request \w+ cancelled in denoise", engine.log_text()[log_at:]), 10,
           "the denoise worker's drop")


def test_a_client_that_leaves_mid_body_is_one_log_line(engine):
    log_at = len(engine.log_text())
    with socket.create_connection(("127.0.0.1", engine.port)) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000"
                  b"\r\n\r\n{\"prompt\": \"half a bo")
        time.sleep(0.3)
    line = "the client went away before its body was read"
    _until(lambda: line in engine.log_text()[log_at:], 10, "the log line")
    assert engine.http.post("/generate", json=SHORT).status_code == 200  # the engine serves on
    new = engine.log_text()[log_at:]
    assert new.count(line) == 1 and "Traceback" not in new and "ClientDisconnect" not in new, new


# --- in process -----------------------------------------------------------------------------------------------
def test_a_fenced_run_is_never_answered_by_its_late_messages(caplog):
    """A run that ended unanswered (cancelled, 504) is fenced: its late answers are dropped without a warning;
    the latest run of a client's id is found whatever its wire id."""
    async def main():
        table = PendingTable()
        loop = asyncio.get_running_loop()
        route = Route(encoder=0, denoise=0, decode=0)
        table.fence("a")
        late = ErrorReply(v=PROTOCOL_VERSION, request_id="a", stage="denoise", type="cancelled", message="x", status=499)
        assert table.resolve(late, {}) is False
        retry = table.add("a~1", Pending(loop.create_future(), route, client_id="a"))
        assert table.latest("a") == ("a~1", retry) and table.latest("b") is None
        assert not retry.future.done()
    caplog.set_level("WARNING", logger="disagg.router")
    asyncio.run(main())
    assert "dropped" not in caplog.text


def test_the_stop_fails_what_nobody_awaits_without_a_never_retrieved_log():
    """At the router's stop every unsettled future is failed; one whose waiter was cancelled earlier (a control
    fan-out's later replies) must not be logged as "Future exception was never retrieved"."""
    seen = []

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _, context: seen.append(context["message"]))
        table = PendingTable()
        table.add("ctl-1", Pending(loop.create_future(), None, target=("denoise", 0)))  # its waiter is gone
        table.fail_all(EngineError(503, "shutting_down", "engine is shutting down", "router", ""))
        table.discard("ctl-1")
        gc.collect()
        await asyncio.sleep(0)
    asyncio.run(main())
    assert seen == []


class _Queue(QueuedBatchStage):
    role = "decode"

    def __init__(self):  # no model: only the queue
        import collections
        self.queue, self.max_batch = collections.deque(), 4


def test_a_queued_stage_lets_go_of_a_cancelled_request_only():
    stage = _Queue()
    params = GenerationParams(prompt="p", negative_prompt="", height=32, width=32, num_frames=5,
                              num_inference_steps=4, guidance_scale=1.0, seed=0)
    msgs = [type("M", (), {"request_id": rid, "params": params})() for rid in ("x", "y")]
    for m in msgs:
        stage.accept(m, {})
    assert stage.cancel("z", partial=False) is None
    msg, outcome = stage.cancel("x", partial=True)  # queued, not started: nothing partial to give
    assert msg is msgs[0] and isinstance(outcome, Cancelled) and outcome.status == 499
    assert [m.request_id for m, _ in stage.queue] == ["y"]


def _abort_app(cancels: Cancellations) -> FastAPI:
    app = FastAPI()

    async def abort(request: Request):
        return await abort_request(cancels, request, 1 << 16)

    async def work(request: Request):
        async def forever():
            await asyncio.sleep(3600)
        return await cancels.run(request.headers["x-request-id"], forever())

    app.add_api_route("/abort_request", abort, methods=["POST"])
    app.add_api_route("/work", work, methods=["POST"])
    app.add_middleware(ApiKeyMiddleware, api_key="k" * 16, admin_key="a" * 16)
    install_error_handlers(app)
    return app


def test_abort_all_needs_the_admin_key_and_a_rid_the_api_key():
    counted = []
    cancels = Cancellations(lambda rid: False, counted.append)
    user, admin = ({"Authorization": f"Bearer {c * 16}"} for c in "ka")

    async def main():
        transport = httpx.ASGITransport(app=_abort_app(cancels))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as http:
            work = [asyncio.create_task(http.post("/work", headers={**user, "X-Request-Id": rid})) for rid in "pq"]
            await asyncio.sleep(0.1)
            assert (await http.post("/abort_request", json={"abort_all": True})).status_code == 401
            assert (await http.post("/abort_request", json={"abort_all": True}, headers=user)).status_code == 403
            r = await http.post("/abort_request", json={"rid": "p"}, headers=user)
            assert r.json() == {"aborted": ["p"]}
            r = await http.post("/abort_request", json={"abort_all": True}, headers=admin)
            assert r.json() == {"aborted": ["q"]}
            for task in work:
                answer = await task
                assert answer.status_code == 499 and answer.json()["error"]["type"] == "cancelled"
    asyncio.run(main())
    assert counted == ["aborted", "aborted"]
