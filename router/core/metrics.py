"""The router's Prometheus metrics, with ``prometheus_client`` (its own registry per engine); ``GET /metrics``
serves them (router/api/metrics.py).

Counted as requests are answered: requests by endpoint and status, latency of
the whole request and of each stage (queue, encode, denoise, decode), denoise
batch sizes, denoising steps (``rate()`` of the counter is steps per second),
generations cancelled (by reason).
Read at each scrape from the engine's state: outstanding samples per worker,
worker states and restarts, jobs by status, weight and adapter versions, and
the tensors moved through shared memory and as CUDA IPC handles.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300, 600, 1800)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)
STAGES = ("encode", "denoise", "decode")


class Metrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("disagg_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.request_seconds = Histogram("disagg_request_seconds", "HTTP request latency", ["endpoint"],
                                         buckets=LATENCY_BUCKETS, registry=r)
        self.stage_seconds = Histogram("disagg_stage_seconds", "time a generation spent per stage (queue: in "
                                       "transit and waiting between stages)", ["stage"],
                                       buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("disagg_denoise_batch_size", "the most samples a generation shared a denoise "
                                    "forward with", buckets=BATCH_BUCKETS, registry=r)
        self.denoise_steps = Counter("disagg_denoise_steps", "denoising steps taken, one per sample per step",
                                     registry=r)
        self.samples = Counter("disagg_samples", "samples generated", registry=r)
        self.row_steps = Counter("disagg_denoise_row_steps", "a sample's CFG branch at one step: computed by a "
                                 "transformer forward, or cached (its last output reused)", ["kind"], registry=r)
        self.reruns = Counter("disagg_request_reruns", "generations run again because a worker died holding "
                              "them (answered; attempts beyond the first)", registry=r)
        self.cancelled = Counter("disagg_cancelled", "generations cancelled before their answer: the client went "
                                 "away (client_disconnected), POST /abort_request (aborted), a video job deleted "
                                 "(job_deleted)", ["reason"], registry=r)

    def generated(self, timings: dict, info: dict, samples: int, steps: int, total_s: float) -> None:
        """One generation answered: its stage times, batch size and steps."""
        stage_s = {stage: float(timings.get(f"{stage}_s", 0.0)) for stage in STAGES}
        for stage, s in stage_s.items():
            self.stage_seconds.labels(stage).observe(s)
        self.stage_seconds.labels("queue").observe(max(0.0, total_s - sum(stage_s.values())))
        if info.get("batch") is not None:
            self.batch_size.observe(float(info["batch"]))
        self.denoise_steps.inc(steps * samples)
        for kind, key in (("computed", "transformer_passes"), ("cached", "cached_steps")):
            if isinstance(info.get(key), list):
                self.row_steps.labels(kind).inc(sum(info[key]))
        self.row_steps.labels("computed").inc(info.get("prefix_transformer_passes") or 0)  # a shared prefix's, once
        self.samples.inc(samples)
        self.reruns.inc(info.get("attempts", 1) - 1)

    def watch(self, state) -> None:
        """Report ``state`` (an :class:`EngineState`) at every scrape."""
        self.registry.register(state)

    def exposition(self) -> tuple[bytes, str]:
        """The text exposition format, and its media type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class EngineState:
    """A collector over live state: ``workers()`` (the health rows), ``jobs()`` (counts by status),
    ``weights()`` (version), ``adapters()`` (name -> version), ``restarts()`` ((role, index) -> count),
    ``shm()`` (the router's own segments sent and received)."""

    def __init__(self, workers, jobs, weights, adapters, restarts, shm):
        self.workers, self.jobs, self.weights, self.adapters = workers, jobs, weights, adapters
        self.restarts, self.shm = restarts, shm

    def describe(self):
        return []  # collected at scrape time only

    def collect(self):
        outstanding = GaugeMetricFamily("disagg_worker_outstanding", "samples routed to a worker and not yet "
                                        "answered", labels=["role", "index"])
        up = GaugeMetricFamily("disagg_worker_ready", "1 when a worker is ready", labels=["role", "index"])
        ipc = CounterMetricFamily("disagg_cuda_ipc_tensors", "tensors a worker sent or received as CUDA IPC "
                                  "handles", labels=["role", "index", "direction"])
        shm_w = CounterMetricFamily("disagg_worker_shm_tensors", "tensors a worker sent or received through "
                                    "shared memory", labels=["role", "index", "direction"])
        for w in self.workers():
            key = [w["role"], str(w["index"])]
            outstanding.add_metric(key, w["outstanding"])
            up.add_metric(key, 1.0 if w["state"] == "ready" else 0.0)
            for direction in ("sent", "received"):
                ipc.add_metric([*key, direction], w["cuda_ipc"][direction])
                shm_w.add_metric([*key, direction], w["shm"][direction])
        restarts = CounterMetricFamily("disagg_worker_restarts", "processes of a worker that died",
                                       labels=["role", "index"])
        for (role, index), count in self.restarts().items():
            restarts.add_metric([role, str(index)], count)
        jobs = GaugeMetricFamily("disagg_jobs", "video jobs held, by status", labels=["status"])
        for status, count in self.jobs().items():
            jobs.add_metric([status], count)
        weights = GaugeMetricFamily("disagg_weight_version", "the weight version every denoise worker holds")
        weights.add_metric([], self.weights())
        adapters = GaugeMetricFamily("disagg_lora_version", "each loaded adapter's version", labels=["lora_name"])
        for name, version in self.adapters().items():
            adapters.add_metric([name], version)
        shm = CounterMetricFamily("disagg_router_shm_tensors", "tensors the router sent or received through "
                                  "shared memory", labels=["direction"])
        for direction, count in self.shm().items():
            shm.add_metric([direction], count)
        yield from (outstanding, up, ipc, shm_w, restarts, jobs, weights, adapters, shm)
