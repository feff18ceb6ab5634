"""``GET /metrics``: Prometheus text that prometheus_client's own parser reads, moving by what requests did."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

REQ = dict(prompt="a fox in the snow", num_inference_steps=3, guidance_scale=4.0, output_type="latent")


@pytest.fixture(scope="module")
def engine(engine_factory):
    return engine_factory("tiny", extra=["--shm-threshold", "1024"])  # the tiny model's tensors use segments too


def _scrape(engine) -> dict[tuple[str, tuple], float]:
    r = engine.http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def _value(m: dict, name: str, **labels) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def test_counters_and_histograms_move_by_the_requests(engine):
    before = _scrape(engine)
    for body in (dict(REQ, seed=1), dict(REQ, seed=2), dict(REQ, seed=3, n=2)):
        assert engine.http.post("/generate", json=body).status_code == 200
    assert engine.http.post("/generate", json=dict(REQ, num_frames=6)).status_code == 400
    after = _scrape(engine)

    def moved(name, **labels):
        return _value(after, name, **labels) - _value(before, name, **labels)

    assert moved("disagg_requests_total", endpoint="/generate", status="200") == 3
    assert moved("disagg_requests_total", endpoint="/generate", status="400") == 1
    assert moved("disagg_request_seconds_count", endpoint="/generate") == 4
    assert moved("disagg_samples_total") == 4
    assert moved("disagg_denoise_steps_total") == 4 * 3  # samples x steps
    for stage in ("queue", "encode", "denoise", "decode"):
        assert moved("disagg_stage_seconds_count", stage=stage) == 3
    assert moved("disagg_stage_seconds_sum", stage="denoise") > 0
    assert moved("disagg_denoise_batch_size_count") == 3
    assert moved("disagg_denoise_batch_size_sum") >= 4  # the n=2 request's two samples shared their forwards


def test_engine_state_is_read_at_each_scrape(engine):
    m = _scrape(engine)
    for role in ("encoder", "denoise", "decode"):
        assert _value(m, "disagg_worker_ready", role=role, index="0") == 1
        assert ("disagg_worker_outstanding", (("index", "0"), ("role", role))) in m
        assert _value(m, "disagg_worker_restarts_total", role=role, index="0") == 0
    assert _value(m, "disagg_weight_version") == 0
    assert {k[1] for k in m if k[0] == "disagg_jobs"} == {(("status", s),) for s in
                                                           ("queued", "in_progress", "completed", "failed")}
    assert ("disagg_router_shm_tensors_total", (("direction", "received"),)) in m
    # The encoder's prompt embeddings (64 KB on tiny) cross to the denoise worker in shared memory; the
    # workers' counts come with their heartbeats (every 0.5 s).
    deadline = time.monotonic() + 10

    def moved_through_shm(m):
        return (_value(m, "disagg_worker_shm_tensors_total", role="encoder", index="0", direction="sent") >= 1
                and _value(m, "disagg_worker_shm_tensors_total", role="denoise", index="0", direction="received") >= 1)

    while not moved_through_shm(m):
        assert time.monotonic() < deadline, {k: v for k, v in m.items() if "shm" in k[0]}
        time.sleep(0.2)
        m = _scrape(engine)
