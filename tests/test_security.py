"""Security: API/admin keys on the router, the weight-path allow-list, CURVE on tcp topologies.

Three real engines on loopback, started side by side: ``keyed`` (ipc, API key from the environment,
admin key by flag, one weight root), ``plain_tcp`` (``--transport tcp --no-curve``, no weight root) and
``curve`` (``--transport tcp``, CURVE on by default). Strangers push well-formed messages straight into
the CURVE engine's sockets; only a socket holding one of the engine's own keys gets through.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import torch
import zmq
import zmq.auth

from common.config.engine import EngineConfig, WorkerSpec
from common.runtime.engine_process import EngineProcess
from common.protocol.messages import PROTOCOL_VERSION, EncodeRequest, ErrorReply, GenerationParams, Route
from common.transport.security import SecurityError, Security, bind_pull, connect_push, provision_curve
from common.protocol.codec import encode
from router.api.auth import ADMIN_KEY_ENV, API_KEY_ENV, bearer_token, keys_from_environment
from router.client import EngineClient

API_KEY = "api-" + uuid.uuid4().hex
ADMIN_KEY = "admin-" + uuid.uuid4().hex
REQUEST = {"prompt": "a fox at dawn", "seed": 3, "negative_prompt": "blurry"}
DISABLED = "weight updates are disabled: start the engine with --weight-root DIR"


@pytest.fixture(scope="module")
def weight_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("weights")


@pytest.fixture(scope="module")
def engines(tmp_path_factory, weight_root):
    """The three engines, started concurrently (startup is mostly imports)."""
    specs = {
        "keyed": dict(extra=["--admin-key", ADMIN_KEY, "--weight-root", str(weight_root)],
                      env={API_KEY_ENV: API_KEY}),
        "plain_tcp": dict(extra=["--transport", "tcp", "--no-curve"]),
        "curve": dict(extra=["--transport", "tcp"]),
    }

    def start(name):
        return name, EngineProcess("tiny", workdir=tmp_path_factory.mktemp(name), **specs[name])

    started = {}
    with ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(start, n) for n in specs]
        errors = []
        for f in futures:
            try:
                name, eng = f.result()
                started[name] = eng
            except Exception as e:  # stop the others before failing
                errors.append(e)
    if errors:
        for eng in started.values():
            eng.stop()
        raise errors[0]
    yield started
    for eng in started.values():
        eng.stop()
    assert not (started["curve"].runtime / "curve").exists(), "secret key files left behind after shutdown"


def _auth(key: str | None) -> dict:
    return {} if key is None else {"authorization": f"Bearer {key}"}


def _config(eng: EngineProcess) -> tuple[EngineConfig, str]:
    text = (eng.runtime / "engine.json").read_text()
    return EngineConfig.load(eng.runtime / "engine.json"), text


def _output(eng: EngineProcess, key: str | None = None) -> torch.Tensor:
    with EngineClient(eng.url, api_key=key) as c:
        return c.generate(**REQUEST)["samples"][0]["output"]


# --- API and admin keys -------------------------------------------------------------------


@pytest.mark.heavy  # launched engines (keys from the environment, tcp, CURVE): CI
def test_api_key_is_required_except_for_health(engines):
    http = engines["keyed"].http
    assert http.get("/health").status_code == 200
    for headers in ({}, _auth("wrong-" + API_KEY), {"authorization": API_KEY}, {"authorization": f"Basic {API_KEY}"},
                    _auth(API_KEY[:-1])):
        r = http.post("/generate", json=REQUEST, headers=headers)
        assert r.status_code == 401, (headers, r.text)
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json() == {"error": {"type": "unauthorized", "message": r.json()["error"]["message"],
                                      "request_id": None, "stage": "router"}}
        assert API_KEY not in r.text
    for method, path in (("GET", "/weights_checksum"), ("POST", "/rollout/generate"), ("GET", "/openapi.json"),
                         ("POST", "/docs"), ("POST", "/"), ("POST", "/static/app.js"), ("POST", "/health"),
                         ("GET", "/no-such-path"), ("GET", "/v1/videos"), ("GET", "/progress/x")):
        assert http.request(method, path).status_code == 401, (method, path)
    # The web page and the API docs hold no data (router/api/web.py): they load without the key, then ask for it.
    for path in ("/", "/docs", "/static/app.js", "/static/swagger/swagger-ui-bundle.js"):
        assert http.get(path).status_code == 200, path
    assert http.get("/static/%2e%2e/auth.py").status_code == 404  # only the static files, nothing beside them
    r = http.post("/generate", json=REQUEST, headers=_auth(API_KEY))
    assert r.status_code == 200, r.text
    assert http.get("/weights_checksum", headers=_auth(API_KEY)).status_code == 200
    # The admin key opens the ordinary endpoints too.
    assert http.get("/weights_checksum", headers=_auth(ADMIN_KEY)).status_code == 200


@pytest.mark.heavy  # launched engines (keys from the environment, tcp, CURVE): CI
def test_admin_key_guards_weight_updates(engines, weight_root, tiny_dir, tmp_path):
    eng = engines["keyed"]
    body = {"path": str(weight_root / "missing.safetensors")}
    r = eng.http.post("/update_weights_from_disk", json=body, headers=_auth(API_KEY))
    assert r.status_code == 403 and r.json()["error"]["type"] == "forbidden", r.text
    assert "admin key" in r.json()["error"]["message"]
    for path in ("/sglang/update_weights_from_disk", "/sglang/release_memory_occupation", "/init_weights_update_group",
                 "/update_weights_from_tensor", "/vllm-omni/pause", "/start_weight_update"):  # the peers' controls too
        assert eng.http.post(path, json={}, headers=_auth(API_KEY)).status_code == 403, path
    for headers in ({}, _auth("nope-" + ADMIN_KEY)):
        r = eng.http.post("/update_weights_from_disk", json=body, headers=headers)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", r.text
    v0 = eng.http.get("/weights_checksum", headers=_auth(API_KEY)).json()

    # Past authentication, the worker's allow-list decides: outside the root (directly or via a symlink) is 400.
    src = tiny_dir / "transformer" / "diffusion_pytorch_model.safetensors"
    outside = tmp_path / "outside.safetensors"
    shutil.copy(src, outside)
    (weight_root / "link.safetensors").symlink_to(outside)
    for path in (outside, weight_root / "link.safetensors"):
        r = eng.http.post("/update_weights_from_disk", json={"path": str(path)}, headers=_auth(ADMIN_KEY))
        assert r.status_code == 400, r.text
        assert "outside the allowed weight directories" in r.json()["error"]["message"]
    # Inside the root, with the admin key: the update goes through.
    shutil.copy(src, weight_root / "same.safetensors")
    r = eng.http.post("/update_weights_from_disk", json={"path": str(weight_root / "same.safetensors")},
                      headers=_auth(ADMIN_KEY))
    assert r.status_code == 200, r.text
    assert r.json()["weight_version"] == v0["weight_version"] + 1 and r.json()["sha256"] == v0["sha256"]


@pytest.mark.heavy  # launched engines (keys from the environment, tcp, CURVE): CI
def test_keys_stay_out_of_config_and_workers(engines):
    eng = engines["keyed"]
    _, text = _config(eng)
    assert API_KEY not in text and ADMIN_KEY not in text
    for pid in eng.worker_pids():
        environ = Path(f"/proc/{pid}/environ").read_bytes()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        for secret in (API_KEY, ADMIN_KEY):
            assert secret.encode() not in environ and secret.encode() not in cmdline
        assert API_KEY_ENV.encode() not in environ
    assert API_KEY not in eng.log_text() and ADMIN_KEY not in eng.log_text()


def test_keys_from_environment():
    env = {API_KEY_ENV: "a" * 20, ADMIN_KEY_ENV: "b" * 20, "OTHER": "x"}
    assert keys_from_environment(None, None, env) == ("a" * 20, "b" * 20)
    assert env == {"OTHER": "x"}  # children do not inherit the keys
    env = {API_KEY_ENV: "a" * 20}
    assert keys_from_environment("c" * 20, None, env) == ("c" * 20, None) and env == {}
    assert keys_from_environment(None, None, {API_KEY_ENV: ""}) == (None, None)
    with pytest.raises(ValueError, match="differ"):
        keys_from_environment("same-key-0123456789", "same-key-0123456789", {})
    with pytest.raises(ValueError, match="printable"):
        keys_from_environment("has space in it 0123", None, {})
    assert bearer_token([(b"authorization", b"Bearer abc")]) == b"abc"
    assert bearer_token([(b"Authorization", b"bearer  abc ")]) == b"abc"
    for headers in ([], [(b"authorization", b"Basic abc")], [(b"authorization", b"Bearer ")],
                    [(b"authorization", b"Bearer a"), (b"authorization", b"Bearer a")]):
        assert bearer_token(headers) is None


# --- weight roots -------------------------------------------------------------------------


@pytest.mark.heavy  # launched engines (keys from the environment, tcp, CURVE): CI
def test_weight_updates_refused_without_a_root(engines, tiny_dir):
    eng = engines["plain_tcp"]
    before = eng.http.get("/weights_checksum").json()
    path = tiny_dir / "transformer" / "diffusion_pytorch_model.safetensors"
    r = eng.http.post("/update_weights_from_disk", json={"path": str(path)})
    assert r.status_code == 403, r.text
    assert r.json() == {"error": {"type": "forbidden", "message": DISABLED, "request_id": None, "stage": "router"}}
    after = eng.http.get("/weights_checksum").json()
    assert after["weight_version"] == before["weight_version"] == 0
    assert "update_weights" not in eng.log_text()  # no worker saw a control message for it


# --- tcp ----------------------------------------------------------------------------------


@pytest.mark.heavy  # launched engines (keys from the environment, tcp, CURVE): CI
def test_tcp_without_curve_serves_the_same_output(engines):
    eng = engines["plain_tcp"]
    config, _ = _config(eng)
    assert config.transport == "tcp" and not config.curve_public and not config.curve_secret_files
    assert config.router_endpoint.startswith("tcp://127.0.0.1:")
    assert all(w.endpoint.startswith("tcp://127.0.0.1:") for w in config.workers)
    assert not (eng.runtime / "curve").exists()
    assert torch.equal(_output(eng), _output(engines["keyed"], API_KEY))


@pytest.mark.heavy  # launched engines (keys from the environment, tcp, CURVE): CI
def test_curve_engine_serves_the_same_output_as_ipc(engines):
    eng = engines["curve"]
    config, _ = _config(eng)
    assert config.transport == "tcp"
    assert all(w.endpoint.startswith("tcp://127.0.0.1:") for w in config.workers)
    assert {w["endpoint"] for w in eng.http.get("/health").json()["workers"]} == {w.endpoint for w in config.workers}
    assert torch.equal(_output(eng), _output(engines["keyed"], API_KEY))


@pytest.mark.heavy  # launched engines (keys from the environment, tcp, CURVE): CI
def test_curve_secret_keys_live_in_private_files(engines):
    eng = engines["curve"]
    config, text = _config(eng)
    names = {"router", "encoder-0", "denoise-0", "decode-0"}
    assert set(config.curve_public) == names == set(config.curve_secret_files)
    assert stat.S_IMODE(os.stat(eng.runtime).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(eng.runtime / "curve").st_mode) == 0o700
    for name, path in config.curve_secret_files.items():
        path = Path(path)
        assert path.parent == eng.runtime / "curve"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        public, secret = zmq.auth.load_certificate(path)
        assert public.decode() == config.curve_public[name]
        assert secret and secret.decode() not in text
    assert "secret-key" not in text and len(set(config.curve_public.values())) == len(names)


PARAMS = GenerationParams(prompt="a fox at dawn", negative_prompt="", height=32, width=32, num_frames=5,
                          num_inference_steps=2, guidance_scale=5.0, seed=1)


def _message(target: str, rid: str) -> list:
    if target == "router":
        return encode(ErrorReply(v=PROTOCOL_VERSION, request_id=rid, stage="decode", type="X", message="x", status=500))
    return encode(EncodeRequest(v=PROTOCOL_VERSION, request_id=rid, route=Route(encoder=0, denoise=0, decode=0),
                                params=PARAMS))


def _push(ctx: zmq.Context, endpoint: str, frames: list, keys: tuple[bytes, bytes] | None, server_key: bytes | None):
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    if keys is not None:
        sock.curve_publickey, sock.curve_secretkey = keys
        sock.curve_serverkey = server_key
    sock.connect(endpoint)
    sock.send_multipart(frames)
    return sock


def _wait_for(eng: EngineProcess, needle: str, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if needle in eng.log_text():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.heavy  # launched engines (keys from the environment, tcp, CURVE): CI
@pytest.mark.parametrize("target, sender", [("encoder-0", "router"), ("router", "encoder-0")])
def test_strangers_cannot_push_into_curve_sockets(engines, target, sender):
    eng = engines["curve"]
    config, _ = _config(eng)
    endpoint = config.router_endpoint if target == "router" else config.worker("encoder", 0).endpoint
    server_key = config.curve_public[target].encode()
    before = _output(eng)
    tag = uuid.uuid4().hex[:12]
    plain_rid, keyed_rid, legit_rid = f"stranger-plain-{tag}", f"stranger-curve-{tag}", f"legit-{tag}"
    stranger_keys = zmq.curve_keypair()
    ctx = zmq.Context()
    socks = []
    try:
        # (a) no CURVE at all, (b) CURVE with a key of its own and the real server key.
        socks.append(_push(ctx, endpoint, _message(target, plain_rid), None, None))
        socks.append(_push(ctx, endpoint, _message(target, keyed_rid), stranger_keys, server_key))
        # Control: the same message from a socket holding one of the engine's own keys does get processed.
        own = zmq.auth.load_certificate(config.curve_secret_files[sender])
        socks.append(_push(ctx, endpoint, _message(target, legit_rid), own, server_key))
        assert _wait_for(eng, legit_rid), f"the allowed sender's message was not processed:\n{eng.log()}"
        time.sleep(1.0)  # strangers had every chance by now
        log = eng.log_text()
        assert plain_rid not in log and keyed_rid not in log, "a stranger's message was processed"
        # The ZAP handler saw the keyed stranger and refused it (the plain one fails the handshake earlier).
        assert _wait_for(eng, f"unknown client key {stranger_keys[0].decode()}", 10), eng.log()
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
    # Still serving, with the same output.
    health = eng.http.get("/health").json()
    assert health["ok"], health
    assert torch.equal(_output(eng), before)


# --- in-process checks of the socket helpers ----------------------------------------------


def _tcp_config(tmp_path, ports) -> EngineConfig:
    return EngineConfig(model="m", runtime_dir=str(tmp_path), transport="tcp",
                        workers=[WorkerSpec(role="encoder", index=0, endpoint=f"tcp://127.0.0.1:{ports[0]}")],
                        router_endpoint=f"tcp://127.0.0.1:{ports[1]}")


def test_security_refuses_loose_or_mismatched_key_files(tmp_path):
    from common.config.topology import port_picker

    pick = port_picker()
    config = provision_curve(_tcp_config(tmp_path, [pick("127.0.0.1"), pick("127.0.0.1")]))
    Security.load(config, "router").close()
    path = Path(config.curve_secret_files["router"])
    os.chmod(path, 0o644)
    with pytest.raises(SecurityError, match="other users"):
        Security.load(config, "router")
    os.chmod(path, 0o600)
    swapped = msgspec.structs.replace(config, curve_secret_files={**config.curve_secret_files,
                                                                  "router": config.curve_secret_files["encoder-0"]})
    with pytest.raises(SecurityError, match="does not hold"):
        Security.load(swapped, "router")
    with pytest.raises(SecurityError, match="not an endpoint"):
        Security.load(config, "router").server_key("tcp://127.0.0.1:1")
    text = json.dumps(msgspec.to_builtins(config))
    for path in config.curve_secret_files.values():
        assert zmq.auth.load_certificate(path)[1].decode() not in text


def test_socket_helpers_admit_only_engine_keys(tmp_path):
    from common.config.topology import port_picker

    pick = port_picker()
    config = provision_curve(_tcp_config(tmp_path, [pick("127.0.0.1"), pick("127.0.0.1")]))
    server, client = Security.load(config, "router"), Security.load(config, "encoder-0")
    ctx = zmq.Context()
    pull = bind_pull(ctx, config.router_endpoint, server)
    good = connect_push(ctx, config.router_endpoint, client)
    stranger = _push(ctx, config.router_endpoint, [b"stranger"], zmq.curve_keypair(),
                     config.curve_public["router"].encode())
    plain = _push(ctx, config.router_endpoint, [b"plain"], None, None)
    try:
        good.send(b"good")
        got = []
        poller = zmq.Poller()
        poller.register(pull, zmq.POLLIN)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if poller.poll(100):
                got.append(pull.recv())
        assert got == [b"good"]
    finally:
        for s in (pull, good, stranger, plain):
            s.close(linger=0)
        server.close()
        ctx.term()


def test_asyncio_pull_survives_new_curve_peers(tmp_path):
    """New authenticated connections never make an awaiting zmq.asyncio recv fail (the router's loop)."""
    import asyncio

    import zmq.asyncio

    from common.config.topology import port_picker

    pick = port_picker()
    config = provision_curve(_tcp_config(tmp_path, [pick("127.0.0.1"), pick("127.0.0.1")]))
    server, client = Security.load(config, "router"), Security.load(config, "encoder-0")

    async def main():
        actx, ctx = zmq.asyncio.Context(), zmq.Context()
        pull = bind_pull(actx, config.router_endpoint, server)
        pushes = []
        try:
            got = []
            for i in range(5):  # each message on a new connection, while the receiver already waits
                waiting = asyncio.ensure_future(pull.recv_multipart())
                await asyncio.sleep(0.05)
                pushes.append(connect_push(ctx, config.router_endpoint, client))
                # A large multipart message arrives in many reads, the first one before the rest.
                pushes[-1].send_multipart([b"m%d" % i, bytes(4 << 20)])
                got.append((await asyncio.wait_for(waiting, 5))[0])
            return got
        finally:
            for s in (pull, *pushes):
                s.close(linger=0)
            server.close()
            actx.term()
            ctx.term()

    assert asyncio.run(main()) == [b"m0", b"m1", b"m2", b"m3", b"m4"]


def test_a_moved_peer_is_admitted_by_its_new_key_only(tmp_path):
    """``Security.move`` (a worker replaced on another node, ``launch.py --ray``): the server admits the new
    key and no longer the old one; the client side connects to the new endpoint with the new server key."""
    from common.config.topology import port_picker
    from common.transport.security import fresh_key_dir, new_key_pair

    pick = port_picker()
    config = provision_curve(_tcp_config(tmp_path, [pick("127.0.0.1"), pick("127.0.0.1")]))
    server, old = Security.load(config, "router"), Security.load(config, "encoder-0")
    moved_endpoint = f"tcp://127.0.0.1:{pick('127.0.0.1')}"
    new_public, new_file = new_key_pair(fresh_key_dir(tmp_path / "elsewhere"), "encoder-0")
    moved = msgspec.structs.replace(config, curve_public={**config.curve_public, "encoder-0": new_public},
                                    curve_secret_files={**config.curve_secret_files, "encoder-0": new_file})
    old_endpoint = config.workers[0].endpoint
    moved = msgspec.structs.replace(moved, workers=[msgspec.structs.replace(config.workers[0], endpoint=moved_endpoint)])
    new = Security.load(moved, "encoder-0")
    ctx = zmq.Context()
    pull = bind_pull(ctx, config.router_endpoint, server)
    socks = []

    def received(sender: Security, payload: bytes) -> bool:
        socks.append(connect_push(ctx, config.router_endpoint, sender))
        socks[-1].send(payload)
        return bool(pull.poll(1500)) and pull.recv() == payload

    try:
        assert received(old, b"before") and not received(new, b"new key, not yet admitted")
        server.move("encoder-0", moved_endpoint, new_public)
        assert received(new, b"after") and not received(old, b"old key, no longer admitted")
        assert server.server_key(moved_endpoint) == new_public.encode()
        with pytest.raises(SecurityError, match="not an endpoint"):
            server.server_key(old_endpoint)
    finally:
        for s in (pull, *socks):
            s.close(linger=0)
        server.close()
        ctx.term()
