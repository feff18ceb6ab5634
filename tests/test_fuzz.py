"""A schema-driven fuzz run (schemathesis) against a launched `tiny` engine on loopback: every operation of
its own /openapi.json, with bodies, parameters and headers drawn from the schema (valid ones, then invalid
ones), a bounded number of examples each, derandomized (the same run every time).

Each answer must be documented: its status among the operation's responses, its content type among that
status's, its JSON body valid against that status's schema; invalid data must be refused with a 4xx; no 5xx
other than the documented 503 (sleeping, starting) and 504 (deadline). The control endpoints (sleep, weight
updates, adapters) run in a pass of their own after the serving pass, so that a release does not starve the
rest. At the end every worker is the process it was before (pids unchanged) and a reference request answers
exactly as before the run.

The engine runs with small limits (48 x 48, 9 frames, 4 steps, n <= 2): the schema carries them, so the
generated requests are small and the tiny model answers fast.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path

import hypothesis
import msgpack
import pytest
import schemathesis
import torch
from hypothesis import HealthCheck, Phase, settings
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, negative_data_rejection, response_schema_conformance,
                                 status_code_conformance)

from router.client import EngineClient

# CI runs these (heavy): launched engines' processes are their subject:
# no worker process may die: it compares their pids.
pytestmark = pytest.mark.heavy

LIMITS = ["--max-height", "48", "--max-width", "48", "--max-num-frames", "9", "--max-steps", "4", "--max-n", "2",
          "--max-jobs", "16"]
REFERENCE = {"prompt": "a fox at dawn", "seed": 5, "num_inference_steps": 3, "output_type": "latent"}
CONTROL = frozenset({"/release_memory_occupation", "/resume_memory_occupation", "/sleep", "/wake_up",
                     "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/update_weights_from_disk",
                     "/update_weights_from_tensors", "/update_weights_from_distributed", "/destroy_weights_group",
                     "/pin_reference"})
# The peers' APIs (router/peers/): under their prefixes, every route but these reads is a control; at the root,
# the controls the native API leaves them.
PEER_PREFIXES = ("/sglang", "/vllm-omni")
PEER_READS = frozenset({"/rollout/generate", "/health", "/health_generate", "/get_weights_checksum", "/is_paused",
                        "/abort_requests", "/get_world_size", "/server_info", "/reset_prefix_cache",
                        "/reset_mm_cache", "/reset_encoder_cache", "/is_sleeping"})
PEER_ROOT_CONTROL = frozenset({"/update_weights_from_tensor", "/destroy_weights_update_group", "/pause", "/resume",
                               "/init_weight_transfer_engine", "/start_weight_update", "/start_draft_weight_update",
                               "/update_weights", "/finish_weight_update", "/v1/omni/sleep", "/v1/omni/wakeup"})
# The workers would dial whatever address the fuzzer writes into it: a test calls only its own loopback.
NOT_FUZZED = frozenset({"/init_weights_group", "/init_weights_update_group", "/sglang/init_weights_update_group"})
DOCUMENTED_5XX = (503, 504)
SERVING_EXAMPLES, CONTROL_EXAMPLES = 10, 8
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]


@schemathesis.serializer("application/msgpack")
def _msgpack(ctx, value):
    try:
        return msgpack.packb(value, use_bin_type=True)
    except OverflowError:  # an integer msgpack cannot carry: a body that is not msgpack then (a 400 too)
        return json.dumps(value).encode()


@pytest.fixture(scope="module")
def engine(engine_factory, lora_root):
    return engine_factory("tiny", extra=[*LIMITS, "--weight-root", str(lora_root), "--weight-sync-from-memory"],
                          launched=True)  # no worker may die: their pids


@pytest.fixture(scope="module", autouse=True)
def no_segments_left():
    """vLLM-Omni's rollout answers leave shared-memory segments for their client to unlink: the fuzzer never
    opens them, so those it caused are unlinked here."""
    before = set(Path("/dev/shm").glob("psm_*"))
    yield
    for path in set(Path("/dev/shm").glob("psm_*")) - before:
        path.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def before(engine):
    return EngineClient(engine.url).generate(**REFERENCE)["samples"][0]["output"], engine.worker_pids()


@pytest.fixture(scope="module")
def schema(engine):
    return schemathesis.openapi.from_url(f"{engine.url}/openapi.json")


def fuzz(schema, url: str, paths, examples: int) -> dict:
    """Every operation on ``paths`` with ``examples`` valid and as many invalid examples: the counts, and
    each failure with the request that caused it."""
    report = {"operations": 0, "examples": 0, "failures": [], "seconds": 0.0, "statuses": Counter()}
    t0 = time.perf_counter()
    for result in schema.get_all_operations():
        op = result.ok()
        if op.path not in paths:
            continue
        report["operations"] += 1
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            checks = CHECKS + ([negative_data_rejection] if mode == GenerationMode.NEGATIVE else [])

            @hypothesis.given(op.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, database=None, derandomize=True, phases=[Phase.generate],
                      suppress_health_check=list(HealthCheck), verbosity=hypothesis.Verbosity.quiet)
            def run(case):
                report["examples"] += 1
                response = case.call(base_url=url, timeout=120)
                report["statuses"][response.status_code] += 1
                problem = None
                if response.status_code >= 500 and response.status_code not in DOCUMENTED_5XX:
                    problem = "undocumented server error"
                else:
                    try:
                        case.validate_response(response, checks=checks)
                    except (Exception, BaseExceptionGroup) as e:  # the checks' failures (one or a group)
                        problem = str(e)
                if problem is not None:
                    report["failures"].append(f"{mode.value} {case.method} {case.path} -> {response.status_code}: "
                                              f"{problem[:600]}\n  {response.text[:300]}\n  {case.as_curl_command()}")

            try:
                run()
            except hypothesis.errors.Unsatisfiable:
                assert mode == GenerationMode.NEGATIVE  # nothing in the operation can be made invalid (GET /health)
    report["seconds"] = round(time.perf_counter() - t0, 1)
    return report


def test_the_schema_carries_this_engines_limits(engine):
    doc = engine.http.get("/openapi.json").json()
    body = doc["paths"]["/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]["properties"]
    height = body["height"]["anyOf"][0]
    assert (height["minimum"], height["maximum"], height["multipleOf"]) == (16, 48, 16)
    assert body["num_frames"]["anyOf"][0]["enum"] == [1, 5, 9]
    assert body["num_inference_steps"]["anyOf"][0]["maximum"] == 4 and body["n"]["maximum"] == 2
    sizes = doc["paths"]["/v1/images/generations"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert sizes["properties"]["size"]["anyOf"][0]["enum"] == [f"{w}x{h}" for h in (16, 32, 48) for w in (16, 32, 48)]


def _control(schema) -> set[str]:
    paths = {op.ok().path for op in schema.get_all_operations()}
    peer = {p for p in paths for prefix in PEER_PREFIXES
            if p.startswith(prefix + "/") and p.removeprefix(prefix) not in PEER_READS}
    return (CONTROL | PEER_ROOT_CONTROL | peer) - NOT_FUZZED


def _serving(schema) -> set[str]:
    return {op.ok().path for op in schema.get_all_operations()} - _control(schema) - NOT_FUZZED


def test_fuzz_the_serving_endpoints(engine, before, schema):
    report = fuzz(schema, engine.url, _serving(schema), SERVING_EXAMPLES)
    print(f"\nserving pass: {report['operations']} operations, {report['examples']} examples, "
          f"{len(report['failures'])} failures, {report['seconds']} s; statuses {dict(report['statuses'])}")
    assert report["statuses"][200] >= 2 * report["operations"]  # valid examples are answered, not refused
    assert report["operations"] >= 15 and report["examples"] >= 10 * report["operations"]
    assert not report["failures"], "\n".join(report["failures"][:10])


def test_fuzz_the_control_endpoints(engine, before, schema):
    report = fuzz(schema, engine.url, _control(schema), CONTROL_EXAMPLES)
    print(f"\ncontrol pass: {report['operations']} operations, {report['examples']} examples, "
          f"{len(report['failures'])} failures, {report['seconds']} s; statuses {dict(report['statuses'])}")
    assert report["operations"] == len(_control(schema))
    assert not report["failures"], "\n".join(report["failures"][:10])


def test_the_engine_serves_as_before_after_the_fuzz(engine, before):
    # What the control pass may have left paused (vLLM-Omni's /pause) or released comes back: from the model
    # directory where dropped.
    assert engine.http.post("/resume").status_code == 200
    if engine.http.get("/is_sleeping").json()["is_sleeping"]:
        r = engine.http.post("/resume_memory_occupation", json={"reload": "disk"})
        assert r.status_code == 200, r.text
    output, pids = before
    assert engine.worker_pids() == pids  # no worker died or was restarted
    assert engine.http.get("/health").status_code == 200
    again = EngineClient(engine.url).generate(**REFERENCE)["samples"][0]["output"]
    assert torch.equal(again, output)
