"""The whole engine in this process: encoder, denoise and decode stages and the router's core, no ZeroMQ, no HTTP.

``LocalEngine("tiny", "--max-batch-size", "8")`` takes ``launch.py``'s flags and offers
:class:`router.client.EngineClient`'s Python API (generate, rollout, stream, weights from disk and from memory,
LoRA adapters, sleep and wake, the pinned KL reference). Under it runs what a launched engine runs: the router's
core (:class:`router.core.engine.Engine`: checks, admission, joins, retries, weights and adapter bookkeeping)
over the dispatcher's in-process link (local_engine/link.py), and each stage's own message loop on one thread
(local_engine/workers.py). For notebooks, for a trainer that hosts its rollout engine in its own process or Ray
actor, and for tests; its answers equal the launched engine's bit for bit.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
from pydantic import ValidationError

import launch
from common.families.layouts import layout_problem
from common.protocol.http_tensors import decode_tensors
from common.runtime.stage import Stage
from decode_worker.stage import DecodeStage
from denoise_worker.stage import DenoiseStage
from encoder_worker.stage import EncoderStage
from local_engine.front_door import FrontDoor
from local_engine.link import LocalLink
from local_engine.routes import Routes
from router.client import EngineClient, EngineHTTPError
from router.core.engine import Engine
from router.core.errors import EngineError

STAGES: dict[str, type[Stage]] = {"encoder": EncoderStage, "denoise": DenoiseStage, "decode": DecodeStage}


class LocalEngine(EngineClient):
    def __init__(self, model: str = "tiny", *flags: str, ready_timeout_s: float | None = None):
        """``model`` and ``flags`` as ``launch.py`` takes them (``--max-batch-size``, ``--weight-root``,
        ``--weight-sync-from-memory``, ``--dtype``, ``--cache``, ...); returns once every stage has loaded."""
        args = launch.parse_args(["--model", model, *flags])
        if args.ray is not None or args.transport != "ipc":
            raise ValueError("a local engine runs in this process: no --ray, no --transport tcp")
        args.shm_threshold = 0  # every tensor travels inline through the codec
        # The keys guard the HTTP front door, which a local engine opens only when asked (serve_http).
        api_key, admin_key, roots = launch.keys_and_roots(args)
        path = launch.load_model(args.model)
        self._runtime = Path(tempfile.mkdtemp(prefix="disagg-local-"))
        args.data_dir = args.data_dir or str(self._runtime / "data")
        config = launch.engine_config(args, path, self._runtime, roots)
        info = launch.model_info(path, args.transformer_file)
        problem = layout_problem(info, config.workers, config.cache)
        ranks = [w for w in config.workers if w.ranks > 1]
        if problem or ranks:
            shutil.rmtree(self._runtime, ignore_errors=True)
            raise ValueError(problem or "a local engine runs each worker on one device: no ranks > 1")
        self.binary, self._buckets, self.base_url = True, {}, f"local:{path.name}"
        self._keys, self.front_door = (api_key, admin_key), None
        self.config = config
        self.link = LocalLink(config, [STAGES[w.role](config, w) for w in config.workers])
        self.engine = Engine(config, self.link, info)
        self.routes = Routes(self.engine)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="local-router", daemon=True)
        self._thread.start()
        self._call(self.engine.start(self.routes.rerun_job))
        self._wait_ready(ready_timeout_s or args.ready_timeout)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.engine.health()["ok"]:
            if self.link.loop_thread.error is not None:
                self.close()
                raise RuntimeError(f"a stage failed to load: {self.link.loop_thread.error}")
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError(f"the stages did not load within {timeout_s:.0f}s")
            time.sleep(0.05)

    def serve_http(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Open the launched engine's HTTP front door (every route, the page, the keys given by flag or
        environment) on ``host:port`` (0: a free port) in this process; returns its URL."""
        if self.front_door is None:
            self.front_door = FrontDoor(self.engine, self._loop, host, port, *self._keys)
        return self.front_door.url

    def close(self) -> None:
        """Stop the front door, the stages and the router's loop; remove the weight buckets kept for updates."""
        if self.front_door is not None:
            self.front_door.close()
            self.front_door = None
        if self._thread.is_alive():
            self._call(self.engine.stop())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()
        for written in self._buckets.values():
            written.close()
        self._buckets.clear()
        shutil.rmtree(self._runtime, ignore_errors=True)

    # --- EngineClient's transport, answered by the core -------------------------------------------------
    def _call(self, coro) -> Any:
        """Run ``coro`` on the router's loop; the router's errors as the client's (status, error body)."""
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        except EngineError as e:
            raise EngineHTTPError(e.status, error_body(e.type, e.message, e.stage, e.request_id or None, e.field))
        except ValidationError as e:
            field, message = Routes.first_error(e)
            raise EngineHTTPError(400, error_body("invalid_request", message, "router", None, field))

    def _post(self, path: str, body: dict[str, Any], request_id: str | None = None) -> dict[str, Any]:
        body = json.loads(json.dumps(body))  # what the route reads: JSON's types (lists, not tuples)
        return decode_tensors(self._call(self.routes.post(path, body, request_id or uuid.uuid4().hex)))

    def _post_msgpack(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        body = msgpack.unpackb(msgpack.packb(body, use_bin_type=True), raw=False)  # raw bytes as the route reads them
        return decode_tensors(self._call(self.routes.post(path, body, uuid.uuid4().hex)))

    def _get(self, path: str, params: dict[str, str] | None = None) -> dict[str, Any]:
        return self._call(self.routes.get(path, params or {}))

    def _stream(self, path: str, body: dict[str, Any], request_id: str | None) -> Iterator[dict[str, Any]]:
        items = self.routes.stream(path, json.loads(json.dumps(body)), request_id or uuid.uuid4().hex)
        while True:
            try:
                item = self._call(anext(items))
            except StopAsyncIteration:
                return
            yield decode_tensors(item)

    def health(self) -> dict[str, Any]:
        return self.engine.health()


def error_body(type_: str, message: str, stage: str, request_id: str | None, field: str | None) -> dict:
    """The error's JSON body, as the HTTP API answers it (router/api/http_errors.py)."""
    err = {"type": type_, "message": message, "request_id": request_id, "stage": stage}
    return err if field is None else {**err, "field": field}
