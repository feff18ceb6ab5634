"""The router's core without HTTP: an :class:`~router.core.engine.Engine` over real worker processes of the
tiny model, driven by plain method calls in one event loop (no FastAPI app, no server, no client)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from common.config.engine import CONFIG_NAME
from common.builtin import ensure_builtin
from common.protocol.messages import OUTPUT
from common.runtime.supervisor import Supervisor
from launch import engine_config, parse_args
from router.request.schemas import GenerateBody, RolloutBody
from router.core.engine import Engine
from router.core.errors import EngineError, FieldError
from router.link.dispatcher import Dispatcher


async def _ready(engine: Engine, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not engine.health()["ok"]:
        assert time.monotonic() < deadline, engine.health()
        await asyncio.sleep(0.2)


async def _never_rerun(row, request):
    raise AssertionError("no stored job to run again")


def test_an_engine_generates_and_controls_its_workers_without_http(tmp_path):
    model = ensure_builtin("tiny")
    runtime = tmp_path / "rt"
    runtime.mkdir()
    args = parse_args(["--model", str(model), "--topology", "encoder=1,denoise=1,decode=1",
                       "--data-dir", str(tmp_path / "jobs")])
    config = engine_config(args, model, runtime, weight_roots=[])
    config.save(runtime / CONFIG_NAME)
    dispatcher = Dispatcher(config)
    supervisor = Supervisor(config, runtime / CONFIG_NAME, restart=False, on_exit=dispatcher.notify_exit)
    engine = Engine(config, dispatcher)

    async def main():
        await engine.start(_never_rerun)
        try:
            await _ready(engine)
            body = GenerateBody(prompt="a red fox", num_inference_steps=2, n=2, seed=5)
            done = await engine.generate(body, "core-1")
            frames = done.outcome.tensors[OUTPUT.name]
            assert done.params.n == 2 and frames.shape[0] == 2 and torch.isfinite(frames).all()
            assert not torch.equal(frames[0], frames[1])  # seeds 5 and 6
            rollout = await engine.generate(RolloutBody(prompt="a red fox", num_inference_steps=2, seed=5), "core-2")
            assert rollout.params.rollout is not None and rollout.outcome.info["weight_version"] == 0

            with pytest.raises(FieldError) as bad:  # every check before any work: 400 naming the field
                await engine.generate(GenerateBody(prompt="x", lora_name="absent"), "core-3")
            assert (bad.value.status, bad.value.field) == (400, "lora_name")
            for call in (lambda: engine.progress("core-1"), lambda: engine.cancel("core-1")):
                with pytest.raises(EngineError) as gone:  # answered already
                    call()
                assert gone.value.status == 404
            with pytest.raises(EngineError) as refused:  # no --weight-root: refused before any worker is asked
                await engine.update_weights_from_disk("transformer", str(model))
            assert (refused.value.status, refused.value.type) == (403, "forbidden")

            sums = await engine.weights_checksum("transformer")  # a control op fanned out to every denoise worker
            assert sums["consistent"] and sums["weight_version"] == 0 and len(sums["workers"]) == 1
            slept = await engine.release_memory(["transformer"], level=1)
            assert slept["is_sleeping"] and engine.sleep_state()["components"]["transformer"]["weights"] == "host"
            woke = await engine.resume_memory(["transformer"])
            assert woke["resumed"] == ["transformer"] and not woke["is_sleeping"]
            again = await engine.generate(body, "core-4")  # the same weights back: the same samples
            assert torch.equal(again.outcome.tensors[OUTPUT.name], frames)
            assert engine.metrics.samples._value.get() == 2 + 1 + 2
        finally:
            await engine.stop()

    supervisor.start()
    try:
        asyncio.run(main())
    finally:
        supervisor.stop()
