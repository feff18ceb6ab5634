"""Hostile messages sent straight to the workers' (and the router's) ipc sockets never kill a process.

Each case goes to every worker through a raw ZeroMQ PUSH socket. The worker must log that it dropped
(or failed) the message, answer the router with an error whenever the header names a request, and keep
serving: afterwards every process is alive, /health is green and /generate gives byte-identical output
to what it gave before any hostile message.
"""

import re
import time

import msgpack
import msgspec
import pytest
import torch
import zmq

from common.protocol.messages import (
    PROTOCOL_VERSION,
    DecodeRequest,
    DenoiseRequest,
    EncodeRequest,
    GenerationParams,
    PeerMoved,
    Result,
    Route,
)
from common.protocol.codec import WireError, decode, encode
from conftest import pid_alive

PARAMS = GenerationParams(
    prompt="a fox at dawn", negative_prompt="", height=32, width=32, num_frames=5,
    num_inference_steps=2, guidance_scale=5.0, seed=1,
)
ROUTE = Route(encoder=0, denoise=0, decode=0)
KIND = {"encoder": EncodeRequest, "denoise": DenoiseRequest, "decode": DecodeRequest}
WRONG_KIND = {"encoder": DecodeRequest, "denoise": EncodeRequest, "decode": DenoiseRequest}
TIMEOUT_S = 20


@pytest.fixture(scope="module")
def engine(shared_engine):
    # Shared: the hostile messages leave it as it was (the tests below check the same pids and bytes).
    return shared_engine("tiny", launched=True)  # the workers' processes and sockets


REFERENCE_REQUEST = {"prompt": "a fox at dawn", "seed": 5, "negative_prompt": "blurry"}


@pytest.fixture(scope="module")
def baseline(engine):
    """The reference request's output before any hostile message reached the engine."""
    r = engine.http.post("/generate", json=REFERENCE_REQUEST)
    assert r.status_code == 200, r.text
    return r.json()["samples"][0]["output"]


@pytest.fixture(scope="module")
def workers(engine, baseline):
    rows = engine.http.get("/health").json()["workers"]
    assert [w["role"] for w in rows] == ["encoder", "denoise", "decode"]
    return rows


@pytest.fixture(scope="module")
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def _send(ctx, endpoint: str, frames) -> None:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)  # close() waits until the frames are handed over
    sock.connect(endpoint)
    sock.send_multipart([bytes(memoryview(f)) for f in frames])
    sock.close()


def _frames(msg, tensors=None) -> list[bytes]:
    return [bytes(memoryview(f)) for f in encode(msg, tensors)]


def _header(frames) -> dict:
    return msgpack.unpackb(frames[0])


def _request(role: str, rid: str, kind=None):
    return (kind or KIND[role])(v=PROTOCOL_VERSION, request_id=rid, route=ROUTE, params=PARAMS)


def _declared(kind) -> dict[str, torch.Tensor]:
    """Tensors that satisfy a message kind's contract (its required fields, of their rank)."""
    return {f.name: torch.zeros((2,) * (f.rank if isinstance(f.rank, int) else f.rank[0])) for f in kind.carries
            if f.required}


def _valid(role: str, rid: str) -> list[bytes]:
    # An EncodeRequest carries no tensor at all, so any tensor on one is refused by its contract.
    return _frames(_request(role, rid), _declared(KIND[role]) or {"x": torch.zeros(2, 3)})


# Each case: frames for a role and request id, and whether the header still names the request.
def _garbage(role, rid):
    return [b"\x00\xffnot msgpack at all"]


def _truncated(role, rid):
    head = _valid(role, rid)[0]
    return [head[: len(head) // 2]]


def _unknown_kind(role, rid):
    f = _valid(role, rid)
    return [msgpack.packb({**_header(f), "kind": "reboot"}), *f[1:]]


def _wrong_version(role, rid):
    f = _valid(role, rid)
    return [msgpack.packb({**_header(f), "v": PROTOCOL_VERSION + 98}), *f[1:]]


def _tensor_without_frame(role, rid):
    return _valid(role, rid)[:1]


def _size_mismatch(role, rid):
    f = _valid(role, rid)
    return [f[0], f[1][:-4]]


def _huge_empty_tensor(role, rid):
    # Zero elements, so an empty frame matches its byte size; torch cannot build the shape though.
    f = _valid(role, rid)
    h = _header(f)
    shape = [0, 2**63, *h["tensors"][0]["shape"][2:]]  # the declared rank, so the contract check passes
    return [msgpack.packb({**h, "tensors": [{**h["tensors"][0], "shape": shape}]}), b""]


def _wrong_message_kind(role, rid):
    return _frames(_request(role, rid, WRONG_KIND[role]), _declared(WRONG_KIND[role]))


def _result_to_worker(role, rid):
    return _frames(Result(v=PROTOCOL_VERSION, request_id=rid, stage="decode"), _declared(Result))


def _peer_moved(role, rid, **fields):
    moved = PeerMoved(v=PROTOCOL_VERSION, request_id=rid, role="decode", index=0,
                      endpoint="tcp://127.0.0.1:9", public_key="")
    return _frames(msgspec.structs.replace(moved, **fields))


def _peer_moved_bad_endpoint(role, rid):
    return [msgpack.packb({**_header(_peer_moved(role, rid)), "endpoint": "ipc:///tmp/elsewhere.sock"})]


CASES = {
    # name: (builder, header readable, log line the worker writes)
    "garbage": (_garbage, False, "dropped bad message"),
    "truncated-header": (_truncated, False, "dropped bad message"),
    "unknown-kind": (_unknown_kind, True, "dropped bad message"),
    "wrong-version": (_wrong_version, True, "dropped bad message"),
    "tensor-without-frame": (_tensor_without_frame, True, "dropped bad message"),
    "size-mismatch": (_size_mismatch, True, "dropped bad message"),
    "huge-empty-tensor": (_huge_empty_tensor, True, "dropped bad message"),
    "wrong-message-kind": (_wrong_message_kind, True, "dropped {kind} message"),
    "result-to-worker": (_result_to_worker, True, "dropped Result message"),
    # Workers move only on tcp engines (launch.py --ray); this one is ipc, and an endpoint must be tcp.
    "peer-moved-on-ipc": (_peer_moved, False, "dropped PeerMoved message"),
    "peer-moved-bad-endpoint": (_peer_moved_bad_endpoint, True, "dropped bad message"),
}
WELL_FORMED = ("wrong-message-kind", "result-to-worker", "peer-moved-on-ipc")  # the worker refuses them


def _log(engine) -> str:
    return engine.log_path.read_text(errors="replace")


def _count(text: str, pattern: str) -> int:
    return len(re.findall(pattern, text))


def _wait_for(engine, pattern: str, at_least: int) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while _count(_log(engine), pattern) < at_least:
        assert time.monotonic() < deadline, f"no {pattern!r} in the engine log:\n{engine.log()}"
        time.sleep(0.05)


def _assert_all_alive(engine, workers):
    for w in workers:
        assert pid_alive(w["pid"]), f"{w['role']} worker died:\n{engine.log()}"
    r = engine.http.get("/health")
    assert r.status_code == 200, r.text
    assert [w["pid"] for w in r.json()["workers"]] == [w["pid"] for w in workers]  # none was restarted


def test_cases_are_rejected_by_the_codec():
    """The same frames fail decoding with a WireError (naming the request when the header is readable)."""
    for name, (build, readable, _) in CASES.items():
        if name in WELL_FORMED:
            decode(build("denoise", "r"))  # well-formed: the worker, not the codec, refuses these
            continue
        with pytest.raises(WireError) as exc:
            decode(build("denoise", "r"))
        assert exc.value.request_id == ("r" if readable else None), name


@pytest.mark.heavy  # hostile bytes at launched workers' sockets: CI
@pytest.mark.parametrize("case", list(CASES))
def test_hostile_message_is_dropped_and_worker_lives(engine, workers, ctx, case):
    build, readable, line = CASES[case]
    before = _log(engine)
    for w in workers:
        role = w["role"]
        rid = f"hostile-{case}-{role}"
        _send(ctx, w["endpoint"], build(role, rid))
        pattern = rf"{role}-0 WARNING " + re.escape(line.format(kind=WRONG_KIND[role].__name__))
        _wait_for(engine, pattern, _count(before, pattern) + 1)
        if readable:
            # The worker answered the request the header names; the router knows no such request and drops it.
            _wait_for(engine, rf"answer for unknown or finished request {re.escape(rid)} dropped", 1)
    _assert_all_alive(engine, workers)


@pytest.mark.heavy  # hostile bytes at launched workers' sockets: CI
@pytest.mark.parametrize("role", ["encoder", "denoise", "decode"])
def test_well_formed_but_unprocessable_request_is_answered(engine, workers, ctx, role):
    """The right kind for the worker, but unusable: a route to a worker that does not exist, or a
    missing tensor (refused by the message kind's contract, naming the tensor)."""
    rid = f"hostile-unprocessable-{role}"
    if role == "encoder":
        msg = EncodeRequest(v=PROTOCOL_VERSION, request_id=rid, route=Route(encoder=0, denoise=7, decode=0),
                            params=PARAMS)
        line = rf"{role}-0 ERROR request {re.escape(rid)} failed in {role}"
    else:
        msg = _request(role, rid)  # without prompt_embeds / latents
        missing = next(f.name for f in KIND[role].carries if f.required)
        line = rf"{role}-0 WARNING dropped bad message: a {KIND[role].__name__} without {missing}"
    _send(ctx, next(w for w in workers if w["role"] == role)["endpoint"], _frames(msg))
    _wait_for(engine, line, 1)
    _wait_for(engine, rf"answer for unknown or finished request {re.escape(rid)} dropped", 1)
    _assert_all_alive(engine, workers)


@pytest.mark.heavy  # hostile bytes at launched workers' sockets: CI
@pytest.mark.parametrize("case", ["garbage", "wrong-version", "huge-empty-tensor", "wrong-message-kind"])
def test_router_socket_survives_hostile_messages(engine, workers, ctx, case):
    build, _, _ = CASES[case]
    router_endpoint = f"ipc://{engine.runtime / 'router.sock'}"
    before = _log(engine)
    _send(ctx, router_endpoint, build("denoise", f"hostile-router-{case}"))
    pattern = r"launch WARNING (dropped bad message at router|router does not take)"
    _wait_for(engine, pattern, _count(before, pattern) + 1)
    # The router's receive loop still runs: a request completes (it would hang otherwise).
    r = engine.http.post("/generate", json={"prompt": "a fox", "output_type": "latent", "num_inference_steps": 1},
                         timeout=60)
    assert r.status_code == 200, r.text
    _assert_all_alive(engine, workers)


@pytest.mark.heavy  # hostile bytes at launched workers' sockets: CI
def test_engine_still_serves_correct_results(engine, workers, baseline, ctx):
    # One more burst of every case at every worker, straight before real traffic.
    for w in workers:
        for name, (build, _, _) in CASES.items():
            _send(ctx, w["endpoint"], build(w["role"], f"hostile-final-{name}-{w['role']}"))
    a = engine.http.post("/generate", json=REFERENCE_REQUEST)
    b = engine.http.post("/generate", json=REFERENCE_REQUEST)
    assert a.status_code == 200 and b.status_code == 200, (a.text, b.text)
    out_a, out_b = a.json()["samples"][0]["output"], b.json()["samples"][0]["output"]
    assert out_a["shape"] == [5, 32, 32, 3]
    assert out_a == out_b == baseline  # byte-identical to each other and to the output before any attack
    other = engine.http.post("/generate", json={**REFERENCE_REQUEST, "seed": 6}).json()["samples"][0]["output"]
    assert other["data"] != baseline["data"]  # the comparison can tell outputs apart
    _assert_all_alive(engine, workers)
    log = _log(engine)
    for role in ("encoder", "denoise", "decode"):
        assert f"{role}-0 WARNING dropped bad message" in log
    # The encoder answers the final burst's wrong-version message with an error the router cannot place.
    _wait_for(engine, "answer for unknown or finished request hostile-final-wrong-version-encoder dropped", 1)


@pytest.mark.heavy  # hostile bytes at launched workers' sockets: CI
def test_oversized_message_is_cut_off_by_zeromq(engine_factory, ctx):
    """A message part above --max-message-bytes never reaches the worker's code; the worker goes on."""
    eng = engine_factory("tiny", extra=["--max-message-bytes", "65536"])
    rows = eng.http.get("/health").json()["workers"]
    for w in rows:
        role = w["role"]
        big = _frames(_request(role, f"big-frame-{role}"), {"x": torch.zeros(64, 1024)})  # a 256 KiB frame
        _send(ctx, w["endpoint"], big)
        probe = _wrong_version(role, f"probe-{role}")
        _send(ctx, w["endpoint"], probe)
        _wait_for(eng, rf"{role}-0 WARNING dropped bad message: protocol version", 1)
        assert f"big-frame-{role}" not in _log(eng)
    r = eng.http.post("/generate", json={"prompt": "a fox", "num_inference_steps": 2})
    assert r.status_code == 200, r.text
    assert [w["pid"] for w in eng.http.get("/health").json()["workers"]] == [w["pid"] for w in rows]
