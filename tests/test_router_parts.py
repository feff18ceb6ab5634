"""The router's socket-free pieces, one by one: registry, admission, the join of answers, control
fan-out, request checks, and the HTTP error shape. No engine, no ZeroMQ."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import msgspec
import pytest
import torch
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel

from common.config.engine import Limits, WorkerSpec
from common.protocol.codec import WireError, decode, encode
from common.protocol.control import (ChecksumReply, LoadLora, LoraReply, UnloadLoraReply, UpdateWeights,
                                     UpdateWeightsFromTensors, WeightsReply, kind_of)
from common.protocol.messages import PROTOCOL_VERSION, ErrorReply, Heartbeat, Progress, Result, Route
from router.link.admission import Admission
from router.control.fanout import control_failure, fan_out
from router.control.lora import LoraControl
from router.control.weights import WeightControl
from router.core.errors import EngineError, FieldError
from router.api.http_errors import install_error_handlers
from router.link.join import Pending, PendingTable
from router.api.openapi import inline_refs
from router.link.registry import WorkerRegistry
from router.core.request_params import to_params
from common.families import read_model
from router.request.schemas import GenerateBody, LoadLoraBody, RolloutBody

from conftest import ROOT

TIMEOUT = 10.0
SPECS = [WorkerSpec("encoder", 0), WorkerSpec("denoise", 0), WorkerSpec("denoise", 1), WorkerSpec("decode", 0)]


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def heartbeat(role: str, index: int, pid: int, state: str = "ready") -> Heartbeat:
    return Heartbeat(v=PROTOCOL_VERSION, request_id="", role=role, index=index, pid=pid, device="cpu",
                     endpoint=f"ipc:///x/{role}-{index}.sock", socket_type="PULL", state=state)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def registry(clock):
    reg = WorkerRegistry(SPECS, TIMEOUT, clock=clock)
    for pid, spec in enumerate(SPECS, start=10):
        reg.heartbeat(heartbeat(spec.role, spec.index, pid))
    return reg


# --- registry -----------------------------------------------------------------

def test_pick_prefers_the_least_outstanding_instance(registry):
    registry.workers[("denoise", 0)].outstanding = 2
    registry.workers[("denoise", 1)].outstanding = 1
    assert {registry.pick("denoise").spec.index for _ in range(4)} == {1}


def test_pick_breaks_ties_round_robin(registry):
    assert [registry.pick("denoise").spec.index for _ in range(4)] in ([0, 1, 0, 1], [1, 0, 1, 0])


@pytest.mark.parametrize("roles", [("encoder", "denoise", "decode"), ("encoder", "denoise")],
                         ids=["frames", "latent"])
def test_idle_instances_take_turns_whatever_roles_a_request_reserves(registry, roles):
    routes = []
    for _ in range(4):  # one request after another, each answered before the next
        chosen = registry.reserve(roles)
        routes.append(chosen["denoise"].spec.index)
        registry.release(chosen)
    assert routes in ([0, 1, 0, 1], [1, 0, 1, 0])


def test_reserve_counts_outstanding_until_released(registry):
    chosen = registry.reserve()
    assert {role: w.spec.index for role, w in chosen.items()}.keys() == {"encoder", "denoise", "decode"}
    assert all(w.outstanding == 1 for w in chosen.values())
    second = registry.reserve()
    assert second["denoise"] is not chosen["denoise"]  # the next request goes to the idle instance
    registry.release(chosen)
    assert (chosen["denoise"].outstanding, second["denoise"].outstanding, second["encoder"].outstanding) == (0, 1, 1)
    registry.release(second)
    assert all(w.outstanding == 0 for w in registry.workers.values())


def test_pick_skips_unready_workers_and_fails_without_any(registry, clock):
    registry.heartbeat(heartbeat("denoise", 0, 11, state="loading"))
    assert {registry.pick("denoise").spec.index for _ in range(3)} == {1}
    registry.lost("denoise", 1)
    with pytest.raises(EngineError) as e:
        registry.pick("denoise")
    assert (e.value.status, e.value.type, e.value.stage) == (503, "unavailable", "denoise")
    clock.now += TIMEOUT  # a quiet worker is not picked either
    with pytest.raises(EngineError):
        registry.pick("encoder")


def test_lost_worker_ignores_its_dead_pid_and_comes_back_with_a_new_one(registry):
    assert registry.lost("denoise", 0) is True
    assert registry.lost("denoise", 7) is False  # not in the topology
    w = registry.workers[("denoise", 0)]
    assert w.state == "dead" and 11 in w.dead_pids
    assert registry.heartbeat(heartbeat("denoise", 0, 11)) is None  # sent before it died
    assert w.state == "dead"
    assert registry.heartbeat(heartbeat("denoise", 0, 99)) is None  # the restarted process
    assert (w.state, w.pid) == ("ready", 99)


def test_a_restarted_process_is_synced_before_it_is_routed_to(registry, clock):
    w = registry.workers[("denoise", 0)]
    assert registry.take_new_ready(w) is False  # the first process: nothing to give it
    registry.lost("denoise", 0)
    registry.heartbeat(heartbeat("denoise", 0, 99, state="loading"))
    assert registry.take_new_ready(w) is False  # not ready yet
    registry.heartbeat(heartbeat("denoise", 0, 99))
    assert registry.take_new_ready(w) is True and registry.take_new_ready(w) is False  # once
    assert {registry.pick("denoise").spec.index for _ in range(4)} == {1}  # not routed to while syncing
    assert dict((r["index"], r["state"]) for r in registry.health()[1] if r["role"] == "denoise")[0] == "syncing"
    w.syncing = False
    assert 0 in {registry.pick("denoise").spec.index for _ in range(4)}


def test_a_new_pid_on_a_live_worker_reports_the_old_one_lost(registry):
    assert registry.heartbeat(heartbeat("denoise", 1, 12)) is None  # same process: nothing lost
    assert registry.heartbeat(heartbeat("denoise", 1, 50)) == "replaced by pid 50"
    w = registry.workers[("denoise", 1)]
    assert (w.state, w.pid) == ("ready", 50) and 12 in w.dead_pids


def test_heartbeat_from_an_unknown_worker_is_ignored(registry):
    assert registry.heartbeat(heartbeat("denoise", 5, 77)) is None
    assert ("denoise", 5) not in registry.workers


def test_expired_lists_workers_that_went_quiet(clock):
    reg = WorkerRegistry(SPECS, TIMEOUT, clock=clock)  # every worker still starting: none can expire
    assert reg.expired(clock.now + 1000) == []
    reg.heartbeat(heartbeat("encoder", 0, 10))
    reg.heartbeat(heartbeat("denoise", 0, 11))
    assert reg.expired(clock.now + TIMEOUT - 0.1) == []
    assert reg.expired(clock.now + TIMEOUT) == [("encoder", 0), ("denoise", 0)]
    reg.lost("encoder", 0)  # already handled: not reported again
    assert reg.expired(clock.now + TIMEOUT) == [("denoise", 0)]


def test_health_rows_in_pipeline_order_with_derived_states(clock):
    reg = WorkerRegistry(list(reversed(SPECS)), TIMEOUT, clock=clock)
    reg.heartbeat(heartbeat("encoder", 0, 10))
    reg.heartbeat(heartbeat("denoise", 0, 11))
    reg.heartbeat(heartbeat("decode", 0, 13))
    reg.lost("decode", 0)
    clock.now += 4
    reg.heartbeat(heartbeat("denoise", 0, 11))
    clock.now += TIMEOUT - 1
    ok, rows = reg.health()
    assert not ok
    assert [(r["role"], r["index"], r["state"]) for r in rows] == [
        ("encoder", 0, "lost"), ("denoise", 0, "ready"), ("denoise", 1, "starting"), ("decode", 0, "dead")]
    assert rows[0]["seconds_since_heartbeat"] == TIMEOUT + 3 and rows[2]["seconds_since_heartbeat"] is None
    assert rows[1]["pid"] == 11 and rows[1]["socket_type"] == "PULL"


def test_health_is_ok_when_every_worker_is_ready(registry):
    ok, rows = registry.health()
    assert ok and len(rows) == len(SPECS)


# --- admission -----------------------------------------------------------------

def test_admission_bounds_requests_in_flight():
    a = Admission(max_pending=3)
    a.check(in_flight=1, count=2)
    with pytest.raises(EngineError) as e:
        a.check(in_flight=2, count=2)
    assert (e.value.status, e.value.type, e.value.headers) == (429, "overloaded", {"Retry-After": "1"})
    assert "2 requests in flight (limit 3)" in e.value.message


def test_draining_refuses_everything_with_503():
    a = Admission(max_pending=3)
    a.start_draining()
    with pytest.raises(EngineError) as e:
        a.check(in_flight=0, count=1)
    assert (e.value.status, e.value.type, e.value.stage) == (503, "shutting_down", "router")


# --- join ----------------------------------------------------------------------

ROUTE0 = Route(encoder=0, denoise=0, decode=0)


def _result(rid: str) -> Result:
    return Result(v=PROTOCOL_VERSION, request_id=rid, stage="decode", timings={"decode_s": 0.5},
                  info={"weight_version": 3})


def _error_of(fut: asyncio.Future) -> EngineError:
    assert fut.done()
    e = fut.exception()
    assert isinstance(e, EngineError)
    return e


def _table(**pendings: Pending) -> PendingTable:
    table = PendingTable()
    for rid, p in pendings.items():
        table.add(rid, p)
    return table


def test_resolve_joins_a_result_and_drops_a_second_answer():
    async def body():
        loop = asyncio.get_running_loop()
        table = _table(a=Pending(loop.create_future(), ROUTE0))
        out = torch.zeros(1, 2)  # one sample
        assert table.resolve(_result("a"), {"output": out}) is True
        err = ErrorReply(v=PROTOCOL_VERSION, request_id="a", stage="decode", type="X", message="late")
        assert table.resolve(err, {}) is False  # already settled: dropped
        assert table.resolve(_result("nobody"), {"output": out}) is False
        outcome = table.get("a").future.result()
        assert outcome.tensors["output"] is out and outcome.route == ROUTE0
        assert outcome.timings == {"decode_s": 0.5} and outcome.info == {"weight_version": 3}

    asyncio.run(body())


def test_resolve_turns_errors_and_empty_results_into_engine_errors():
    """An ErrorReply becomes its EngineError; a Result without output is refused by the codec (Result's
    contract), and the router's receive loop rejects the request it names with 502 at once."""
    async def body():
        loop = asyncio.get_running_loop()
        table = _table(a=Pending(loop.create_future(), ROUTE0), b=Pending(loop.create_future(), ROUTE0),
                       c=Pending(loop.create_future(), None, target=("denoise", 0)))
        table.resolve(ErrorReply(v=PROTOCOL_VERSION, request_id="a", stage="denoise", type="RuntimeError",
                                 message="boom", status=500), {})
        with pytest.raises(WireError) as refused:
            decode(encode(_result("b"), {}))
        assert refused.value.request_id == "b" and table.reject("b", str(refused.value)) is True
        assert table.reject("b", "again") is False and table.reject("nobody", "x") is False
        reply = ChecksumReply(v=PROTOCOL_VERSION, request_id="c", role="denoise", index=0, weight_version=0,
                              sha256="x")
        table.resolve(reply, {})
        e = _error_of(table.get("a").future)
        assert (e.status, e.type, e.message, e.stage, e.request_id) == (500, "RuntimeError", "boom", "denoise", "a")
        assert (_error_of(table.get("b").future).status, _error_of(table.get("b").future).type) == (502, "bad_result")
        assert table.get("c").future.result() is reply

    asyncio.run(body())


def test_a_lost_worker_fails_only_the_requests_still_in_it():
    async def body():
        loop = asyncio.get_running_loop()
        table = _table(
            queued=Pending(loop.create_future(), ROUTE0),  # not yet past the encoder
            in_denoise=Pending(loop.create_future(), ROUTE0),
            past_denoise=Pending(loop.create_future(), ROUTE0),
            other_route=Pending(loop.create_future(), Route(encoder=0, denoise=1, decode=0)),
            latent=Pending(loop.create_future(), ROUTE0, uses_decode=False),
            control=Pending(loop.create_future(), None, target=("denoise", 0)),
        )

        def progress(rid, stage):
            table.progress(Progress(v=PROTOCOL_VERSION, request_id=rid, stage=stage))

        progress("in_denoise", "encoder")
        progress("past_denoise", "encoder")
        progress("past_denoise", "denoise")
        progress("latent", "encoder")
        progress("nobody", "denoise")  # unknown request: ignored
        progress("past_denoise", "bogus")  # unknown stage: ignored
        assert table.fail_waiting_on("denoise", 0, "exited with code -9") == 4
        for rid in ("queued", "in_denoise", "latent", "control"):
            e = _error_of(table.get(rid).future)
            assert (e.status, e.type, e.stage, e.request_id) == (503, "worker_lost", "denoise", rid)
            assert e.message == "denoise worker 0 exited with code -9"
        assert not table.get("past_denoise").future.done() and not table.get("other_route").future.done()
        # decode 0 is where past_denoise is now and other_route will go; the latent request never goes there.
        assert table.fail_waiting_on("decode", 0, "gone") == 2
        assert _error_of(table.get("past_denoise").future).stage == "decode"
        assert _error_of(table.get("other_route").future).stage == "decode"
        assert table.fail_waiting_on("denoise", 0, "again") == 0  # settled requests are not failed twice

    asyncio.run(body())


def test_pending_where_names_the_stage_a_request_is_in():
    p = Pending(None, ROUTE0)
    assert p.where() == "encoder"
    p.done_stage = 1
    assert p.where() == "decode"
    p.done_stage = 2
    assert p.where() == "decode"
    assert Pending(None, None, target=("denoise", 1)).where() == "denoise"


def test_fail_all_settles_every_open_request():
    async def body():
        loop = asyncio.get_running_loop()
        table = _table(a=Pending(loop.create_future(), ROUTE0), b=Pending(loop.create_future(), ROUTE0))
        table.resolve(_result("a"), {"output": torch.zeros(1)})
        stop = EngineError(503, "shutting_down", "engine is shutting down", "router", "")
        table.fail_all(stop)
        assert table.get("a").future.result().info == {"weight_version": 3}
        assert table.get("b").future.exception() is stop
        table.discard("a")
        table.discard("a")
        assert len(table) == 1

    asyncio.run(body())


# --- control -------------------------------------------------------------------

def _reply(index: int, sha256: str = "aa", request_id: str | None = None) -> WeightsReply:
    return WeightsReply(v=PROTOCOL_VERSION, request_id=request_id or f"r{index}", role="denoise", index=index,
                        weight_version=1, load_s=0.0, sha256=sha256)


def _checksum(index: int, sha256: str, weight_version: int) -> ChecksumReply:
    return ChecksumReply(v=PROTOCOL_VERSION, request_id=f"r{index}", role="denoise", index=index,
                         weight_version=weight_version, sha256=sha256)


def test_control_failure_is_none_when_every_worker_answered():
    assert control_failure([_reply(0), _reply(1)], "denoise") is None


def test_control_failure_passes_on_a_refusal_every_worker_shares():
    refusal = [EngineError(400, "invalid_path", "outside the roots", "denoise", f"ctl-{i}") for i in range(2)]
    e = control_failure(refusal, "denoise")
    assert (e.status, e.type, e.message, e.stage, e.request_id) == (400, "invalid_path", "outside the roots",
                                                                    "denoise", "")


@pytest.mark.parametrize("replies", [
    [_reply(0), EngineError(500, "RuntimeError", "boom", "denoise", "ctl-1")],
    [EngineError(400, "invalid_path", "no", "denoise", "x"), EngineError(504, "timeout", "no answer", "denoise", "y")],
    [_reply(0), EngineError(400, "invalid_path", "no", "denoise", "x")],  # some loaded, some refused
], ids=["one-crashed", "refused-and-timed-out", "partly-refused"])
def test_control_failure_reports_workers_that_may_now_disagree(replies):
    e = control_failure(replies, "denoise")
    n_failed = sum(isinstance(r, EngineError) for r in replies)
    assert (e.status, e.type, e.stage, e.request_id) == (500, "inconsistent_workers", "denoise", "")
    assert e.message.startswith(f"{n_failed}/{len(replies)} workers failed: denoise: ")


def test_fan_out_asks_every_worker_and_keeps_their_order():
    async def body():
        table, sent = PendingTable(), []

        async def send(w, msg, tensors):  # 0 answers, 1 fails, 2 never answers, 3 answers another kind's reply
            sent.append((w.index, kind_of(msg), msg.module, msg.path))
            if w.index == 0:
                table.resolve(_reply(0, request_id=msg.request_id), {})
            elif w.index == 1:
                table.resolve(ErrorReply(v=PROTOCOL_VERSION, request_id=msg.request_id, stage="denoise",
                                         type="FileNotFoundError", message="gone", status=400), {})
            elif w.index == 3:
                table.resolve(msgspec.structs.replace(_checksum(3, "aa", 1), request_id=msg.request_id), {})

        workers = [WorkerSpec("denoise", i) for i in range(4)]
        replies = await fan_out(workers, UpdateWeights, {"module": "transformer", "path": "/w"}, table, send,
                                timeout_s=0.2)
        assert sent == [(i, "update_weights", "transformer", "/w") for i in range(4)]
        assert isinstance(replies[0], WeightsReply) and replies[0].sha256 == "aa"
        assert (replies[1].status, replies[1].type) == (400, "FileNotFoundError")
        assert (replies[2].status, replies[2].type, replies[2].stage) == (504, "timeout", "denoise")
        assert (replies[3].status, replies[3].type) == (502, "bad_result") and "checksum_reply" in replies[3].message
        assert len(table) == 0  # nothing left behind

    asyncio.run(body())


def test_weight_control_counts_versions_only_when_every_worker_loaded():
    async def body():
        calls, answers = [], []

        async def control(role, op, **fields):
            calls.append((role, op, fields))
            return answers.pop(0)

        weights = WeightControl(control)
        answers.append([_reply(0, sha256="aa"), _reply(1, sha256="aa")])
        done = await weights.update("transformer", "/w/1")
        assert (done["weight_version"], done["sha256"], weights.version) == (1, "aa", 1)
        assert calls[0] == ("denoise", UpdateWeights,
                            {"module": "transformer", "path": "/w/1", "version": 1, "checksum": True})
        answers.append([_reply(0, sha256="bb"), EngineError(500, "RuntimeError", "boom", "denoise", "x")])
        with pytest.raises(EngineError) as e:
            await weights.update("transformer", "/w/2")
        assert e.value.type == "inconsistent_workers" and weights.version == 1
        answers.append([_checksum(0, sha256="aa", weight_version=1), _checksum(1, sha256="bb", weight_version=1)])
        summary = await weights.checksum("transformer")
        assert summary["consistent"] is False and summary["sha256"] is None and summary["weight_version"] is None
        answers.append([_checksum(0, sha256="aa", weight_version=1), _checksum(1, sha256="aa", weight_version=1)])
        summary = await weights.checksum("transformer")
        assert (summary["consistent"], summary["sha256"], summary["weight_version"]) == (True, "aa", 1)
        assert [w["index"] for w in summary["workers"]] == [0, 1]

    asyncio.run(body())


def _lora(index: int, name: str, version: int) -> LoraReply:
    return LoraReply(v=PROTOCOL_VERSION, request_id=f"r{index}", role="denoise", index=index, lora_name=name,
                     lora_version=version, rank=4, scale=1.0, target_modules=["to_q"], experts=["transformer"],
                     sha256="cc")


def test_weights_and_adapters_share_one_all_or_nothing_pattern():
    """Weights and adapters (router/control/versioned.py): a change that a worker failed moves no version and
    names the failure; a restarted worker gets every update and adapter again at its version, and lacks what
    came from the trainer's memory; each change and removal is reported supplied."""
    async def body():
        calls, answers, supplied = [], [], []

        async def control(role, kind, **fields):
            calls.append((kind, fields))
            return answers.pop(0)

        weights, loras = WeightControl(control), LoraControl(control)
        weights.versioned.on_supplied = loras.versioned.on_supplied = supplied.append
        answers += [[_reply(0), _reply(1)], [_reply(0), _reply(1)]]
        await weights.update("transformer", "/w/1")
        await weights.update_from_memory(UpdateWeightsFromTensors, "transformer_2")
        answers += [[_lora(0, "a", 1), _lora(1, "a", 1)], [_lora(0, "a", 2), _lora(1, "a", 2)]]
        await loras.load_path(LoadLoraBody(lora_name="a", lora_path="/w/a"))
        await loras.load_path(LoadLoraBody(lora_name="a", lora_path="/w/a2"))
        answers.append([_lora(0, "b", 1), EngineError(500, "RuntimeError", "boom", "denoise", "x")])
        with pytest.raises(EngineError) as failed:
            await loras.load_path(LoadLoraBody(lora_name="b", lora_path="/w/b"))
        assert failed.value.type == "inconsistent_workers" and "boom" in failed.value.message
        assert sorted(loras.table) == ["a"] and loras.table["a"]["lora_version"] == 2 and weights.version == 2
        assert supplied == ["transformer", "transformer_2", "lora:a", "lora:a"]

        calls.clear()
        worker = WorkerSpec(role="denoise", index=1, endpoint="ipc:///x")
        answers.append([_reply(1)])
        assert await weights.replay(worker) == {"transformer_2"}  # pushed from memory: it cannot be replayed
        answers.append([_lora(1, "a", 2)])
        assert await loras.replay(worker) == set()
        assert calls == [(UpdateWeights, {"only": worker, "version": 2, "module": "transformer", "path": "/w/1"}),
                         (LoadLora, {"only": worker, "version": 2, "lora_name": "a", "path": "/w/a2",
                                     "load_into_transformer_2": False})]
        answers.append([UnloadLoraReply(v=PROTOCOL_VERSION, request_id="r0", role="denoise", index=0,
                                        lora_name="a")])
        await loras.unload("a")
        assert loras.table == {} and supplied[-1] == "lora:a"
        assert await loras.replay(worker) == set() and len(calls) == 3  # the unload; nothing left to replay

    asyncio.run(body())


# --- request checks --------------------------------------------------------------

DEFAULTS = {"height": 32, "width": 48, "num_frames": 5, "num_inference_steps": 4, "guidance_scale": 5.0}


@pytest.fixture(scope="module")
def info(tiny_dir):
    """The tiny model's facts with these defaults."""
    import dataclasses

    return dataclasses.replace(read_model(tiny_dir), defaults=DEFAULTS)


def test_to_params_fills_the_model_defaults(info):
    p = to_params(GenerateBody(prompt="a fox", height=64), info, Limits())
    assert (p.height, p.width, p.num_frames, p.num_inference_steps, p.guidance_scale) == (64, 48, 5, 4, 5.0)
    assert p.rollout is None


def test_noise_level_follows_the_sde_steps_own_rule(info):
    assert to_params(RolloutBody(prompt="a fox", sde_type="sde", noise_level=1.5), info, Limits()).rollout
    assert to_params(RolloutBody(prompt="a fox", sde_type="cps", noise_level=1.0), info, Limits()).rollout
    with pytest.raises(FieldError, match=r"cps noise_level must be in \[0, 1\]") as e:
        to_params(RolloutBody(prompt="a fox", sde_type="cps", noise_level=1.5), info, Limits())
    assert e.value.field == "noise_level"


def test_a_custom_schedule_sets_the_step_count_the_rollout_indices_are_checked_against(info):
    body = RolloutBody(prompt="a fox", sigmas=[1.0, 0.5], sde_step_indices=[1, 0])
    p = to_params(body, info, Limits())
    assert p.num_inference_steps == 2 and p.rollout.sde_step_indices == [0, 1]
    with pytest.raises(FieldError) as e:
        to_params(RolloutBody(prompt="a fox", sigmas=[1.0, 0.5], sde_step_indices=[2]), info, Limits())
    assert e.value.field == "sde_step_indices"
    with pytest.raises(FieldError) as e:
        to_params(GenerateBody(prompt="a fox", timesteps=[900.0, 500.0]), __import__('dataclasses').replace(info, num_train_timesteps=800), Limits())
    assert e.value.field == "timesteps"


def test_checks_report_the_first_bad_field_in_a_fixed_order(info):
    body = GenerateBody(prompt="x" * 10, height=40, num_frames=6, n=99)
    with pytest.raises(FieldError) as e:
        to_params(body, info, Limits(max_prompt_chars=5))
    assert e.value.field == "prompt"
    with pytest.raises(FieldError) as e:
        to_params(body, info, Limits())
    assert e.value.field == "height"
    with pytest.raises(FieldError) as e:
        to_params(GenerateBody(prompt="a", num_frames=6, n=99), info, Limits())
    assert e.value.field == "num_frames"
    with pytest.raises(FieldError) as e:
        to_params(GenerateBody(prompt="a", n=99), info, Limits())
    assert e.value.field == "n"


# --- HTTP errors and OpenAPI helpers ---------------------------------------------------

@pytest.fixture(scope="module")
def tiny_app():
    app = FastAPI()
    install_error_handlers(app)

    @app.get("/items")
    async def items(limit: int):
        return {"limit": limit}

    return TestClient(app)


def _assert_error(r, status: int, type_: str, field=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(r.json()) == {"error"}
    assert (err["type"], err["stage"], err["request_id"]) == (type_, "router", None)
    assert isinstance(err["message"], str) and err["message"]
    assert err.get("field") == field
    return err


def test_unknown_path_and_wrong_method_use_the_error_shape(tiny_app):
    err = _assert_error(tiny_app.get("/nothing/here"), 404, "not_found")
    assert "/nothing/here" in err["message"]
    r = tiny_app.delete("/items")
    err = _assert_error(r, 405, "method_not_allowed")
    assert r.headers["allow"] == "GET" and "DELETE" in err["message"]


def test_parameter_validation_is_a_400_naming_the_field(tiny_app):
    err = _assert_error(tiny_app.get("/items", params={"limit": "many"}), 400, "invalid_request", field="limit")
    assert err["message"].startswith("limit: ")
    _assert_error(tiny_app.get("/items"), 400, "invalid_request", field="limit")


def _failing_app() -> FastAPI:
    """An app whose route, and a middleware outside the error handlers, raise what nothing answers."""
    app = FastAPI()

    @app.middleware("http")
    async def outer(request, call_next):
        if request.url.path == "/outer":
            raise RuntimeError("a middleware broke")
        return await call_next(request)

    install_error_handlers(app)

    @app.get("/boom")
    async def boom():
        raise KeyError("\ud800 a bug")  # its text is not even encodable: the answer must not depend on it

    @app.get("/ok")
    async def fine():
        return {"ok": True}

    return app


def test_an_unexpected_exception_is_a_500_in_the_error_shape_with_the_request_id_logged_once(caplog):
    client = TestClient(_failing_app(), raise_server_exceptions=False)
    with caplog.at_level("ERROR", logger="disagg.router"):
        r = client.get("/boom", headers={"X-Request-Id": "req-7"})
    assert r.status_code == 500 and r.headers["content-type"] == "application/json"
    assert r.json()["error"]["type"] == "internal_error" and r.json()["error"]["request_id"] == "req-7"
    logged = [rec for rec in caplog.records if rec.exc_info]
    assert len(logged) == 1 and "req-7" in logged[0].getMessage() and logged[0].exc_info[0] is KeyError
    # Without an X-Request-Id the router gives the request one: the answer and the log name the same.
    caplog.clear()
    with caplog.at_level("ERROR", logger="disagg.router"):
        rid = client.get("/boom").json()["error"]["request_id"]
    assert rid and rid in caplog.records[0].getMessage()
    outer = client.get("/outer")  # raised outside the guard: the server's own handler answers in the shape
    assert outer.status_code == 500 and outer.json()["error"]["type"] == "internal_error"
    assert client.get("/ok").json() == {"ok": True}


def test_a_query_or_path_that_is_not_utf8_is_a_400_naming_it(tiny_app):
    _assert_error(tiny_app.get("/items?limit=1&after=%ED%A0%80"), 400, "invalid_request", "after")
    _assert_error(tiny_app.get("/items%FF"), 400, "invalid_request", "path")
    assert tiny_app.get("/items?limit=3&note=caf%C3%A9").json() == {"limit": 3}  # UTF-8 escapes are fine


def test_inline_refs_resolves_nested_models():
    class Inner(BaseModel):
        x: int

    class Outer(BaseModel):
        inner: Inner
        many: list[Inner] = []

    schema = inline_refs(Outer.model_json_schema())
    assert "$defs" not in schema and "$ref" not in str(schema)
    assert schema["properties"]["inner"]["properties"]["x"]["type"] == "integer"
    assert schema["properties"]["many"]["items"]["properties"]["x"]["type"] == "integer"


def test_the_pieces_need_no_zeromq():
    code = ("import sys; import router.link.registry, router.link.admission, router.link.join, router.control.fanout, router.core.errors; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'zmq'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- re-runs (router/link/attempts.py) ----------------------------------------------------------------------------


def _runs(outcomes: list):
    """A run function that fails or answers as ``outcomes`` says, one per attempt; and the wire ids it saw."""
    from router.link.attempts import attempt_id

    seen = []

    async def run(attempt: int):
        seen.append(attempt_id("req", attempt))
        out = outcomes[attempt - 1]
        if isinstance(out, EngineError):
            raise out
        return out

    return run, seen


def _lost(rid: str = "req") -> EngineError:
    return EngineError(503, "worker_lost", "denoise worker 0 exited with code -9", "denoise", rid)


def test_a_lost_request_runs_again_until_it_is_answered_or_its_attempts_are_used():
    from router.link.attempts import with_attempts

    run, seen = _runs([_lost(), _lost("req.2"), "answer"])
    assert asyncio.run(with_attempts(run, "req", 3)) == ("answer", 3)
    assert seen == ["req", "req.2", "req.3"]  # each run its own wire id
    run, _ = _runs([_lost(), _lost("req.2"), _lost("req.3")])
    with pytest.raises(EngineError) as e:
        asyncio.run(with_attempts(run, "req", 3))
    assert (e.value.type, e.value.request_id, e.value.headers["X-Attempts"]) == ("worker_lost", "req", "3")
    assert e.value.message.endswith("(attempt 3 of 3)")
    run, seen = _runs([_lost(), "answer"])
    with pytest.raises(EngineError):
        asyncio.run(with_attempts(run, "req", 1))  # one attempt: the worker's loss is the answer
    other = EngineError(500, "RuntimeError", "boom", "denoise", "req")
    run, seen = _runs([other, "answer"])
    with pytest.raises(EngineError) as e:
        asyncio.run(with_attempts(run, "req", 3))
    assert e.value is other and seen == ["req"]  # a failure other than a lost worker is not run again


def test_a_rollout_is_not_run_again_on_other_weights_but_serving_is():
    from router.link.attempts import with_attempts

    versions = iter([(0, None), (1, None)])
    run, _ = _runs([_lost(), "answer"])
    with pytest.raises(EngineError) as e:
        asyncio.run(with_attempts(run, "req", 3, versions=lambda: next(versions), rollout=True))
    assert (e.value.status, e.value.type) == (409, "weights_changed") and "(0, None) -> (1, None)" in e.value.message
    versions = iter([(0, None), (1, None)])
    run, _ = _runs([_lost(), "answer"])
    assert asyncio.run(with_attempts(run, "req", 3, versions=lambda: next(versions), rollout=False)) == ("answer", 2)
