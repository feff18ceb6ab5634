"""The same-host shared-memory data plane (common/transport/shm.py, shm_segments.py): round trips between
processes, zero-copy receive, no names left behind, hostile segment names, leftover removal, and whole engines
with and without it."""

import errno
import gc
import logging
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from conftest import sample_tensor
from common.config.engine import EngineConfig, WorkerSpec
from common.runtime.engine_process import EngineProcess
from common.protocol.messages import PROTOCOL_VERSION, DecodeRequest, GenerationParams, Route
from common.transport.shm import (
    SHM_DIR,
    ShmContext,
    ShmReceiver,
    ShmSender,
    engine_prefix,
    remove_engine_segments,
)
from common.transport.shm_segments import SparePool
# decode_frames: the data plane alone, without the message kinds' tensor contracts (tensors named freely)
from common.protocol.codec import DTYPES, WireError, decode_frames, encode
from router.client import EngineClient

ROOT = Path(__file__).resolve().parent.parent
PARAMS = GenerationParams(prompt="a fox", negative_prompt="", height=32, width=32, num_frames=5,
                          num_inference_steps=2, guidance_scale=5.0, seed=1)
ROUTE = Route(encoder=0, denoise=0, decode=0)


def _segments(prefix: str) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))


def _token() -> str:
    return secrets.token_hex(16)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _mapping_of(ptr: int) -> str:
    """The path /proc/self/maps gives for the mapping that holds address ``ptr`` ("" if anonymous)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start <= ptr < end:
            return parts[5] if len(parts) > 5 else ""
    return "?"


def _shm_names(frames) -> dict[str, str]:
    head = msgpack.unpackb(bytes(memoryview(frames[0])))
    return {t["name"]: t["shm"] for t in head["tensors"] if "shm" in t}


@pytest.fixture
def prefix(tmp_path):
    p = engine_prefix(str(tmp_path / "rt"))
    yield p
    remove_engine_segments(p)


def _msg(rid="r1", **kw):
    return DecodeRequest(v=PROTOCOL_VERSION, request_id=rid, route=ROUTE, params=PARAMS, **kw)


# --------------------------------------------------------------------------
# Between two processes
# --------------------------------------------------------------------------

ECHO = r"""
import sys
from pathlib import Path
import zmq
from common.protocol.messages import PROTOCOL_VERSION, ErrorReply, Result
from common.transport.shm import ShmReceiver, ShmSender
from common.protocol.codec import WireError, decode_frames, encode

work, prefix = sys.argv[1], sys.argv[2]
rx, tx = ShmReceiver(prefix, "echo"), ShmSender(prefix, "parent", 1)
ctx = zmq.Context()
pull = ctx.socket(zmq.PULL)
pull.bind(f"ipc://{work}/echo.sock")
push = ctx.socket(zmq.PUSH)
push.connect(f"ipc://{work}/parent.sock")
push.send_multipart(encode(Result(v=PROTOCOL_VERSION, request_id="ready", stage="echo")))


def mapping(ptr):
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start <= ptr < end:
            return parts[5] if len(parts) > 5 else ""
    return "?"


while True:
    frames = pull.recv_multipart(copy=False)
    try:
        msg, tensors = decode_frames(frames, shm=rx)
    except WireError as e:
        push.send_multipart(encode(ErrorReply(v=PROTOCOL_VERSION, request_id=e.request_id or "", stage="echo",
                                              type="WireError", message=str(e))))
        continue
    if msg.request_id == "stop":
        break
    info = {name: mapping(t.data_ptr()) for name, t in tensors.items() if t.numel()}
    push.send_multipart(encode(Result(v=PROTOCOL_VERSION, request_id=msg.request_id, stage="echo", info=info),
                               tensors, shm=tx))
pull.close(0)
push.close(0)
ctx.term()
"""


@pytest.fixture
def echo(tmp_path, prefix):
    """A second process that decodes what it gets through its shared-memory receiver and sends it back
    through shared memory, reporting which file each received tensor's memory belongs to."""
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.bind(f"ipc://{tmp_path}/parent.sock")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"ipc://{tmp_path}/echo.sock")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", ECHO, str(tmp_path), prefix], cwd=ROOT, env=env)
    assert pull.poll(60_000), "echo process did not start"
    pull.recv_multipart()
    sender, receiver = ShmSender(prefix, "echo", 1), ShmReceiver(prefix, "parent")

    class Echo:
        @staticmethod
        def send(frames):
            push.send_multipart(frames, copy=False)

        @staticmethod
        def recv():
            assert pull.poll(30_000), "no answer from the echo process"
            return decode_frames(pull.recv_multipart(copy=False), shm=receiver)

        def __call__(self, msg, tensors):
            frames = encode(msg, tensors, shm=sender)
            names = _shm_names(frames)
            self.send(frames)
            return (names, *self.recv())

    yield Echo()
    push.send_multipart(encode(_msg("stop")))
    try:
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
        push.close(0)
        pull.close(0)
        ctx.term()


def test_every_dtype_round_trips_between_processes(echo, prefix):
    tensors = {name: sample_tensor(dtype, (3, 5, 7)) for name, dtype in DTYPES.items()}
    tensors["large"] = torch.randn(1024, 1024)  # 4 MiB
    tensors["strided"] = torch.arange(600, dtype=torch.float32).reshape(20, 30).t()
    tensors["empty"] = torch.empty(0, 4)  # no bytes: travels as a (empty) frame
    names, reply, back = echo(_msg(), tensors)
    assert set(names) == set(tensors) - {"empty"}
    assert reply.request_id == "r1"
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert _same_bytes(back[name], t), name
    # Each tensor the other process received lived in its segment, already unlinked: zero-copy, no name left.
    for name, seg in names.items():
        assert reply.info[name] == f"{SHM_DIR}/{seg} (deleted)", name
    assert _segments(prefix) == []


def test_large_tensor_between_processes(echo, prefix):
    t = torch.randn(16, 1024, 1024)  # 64 MiB
    names, _, back = echo(_msg(), {"x": t})
    assert torch.equal(back["x"], t)
    assert _segments(prefix) == []


def test_rejection_in_the_other_process(echo, prefix):
    """A segment for another destination is refused there and left alone; the process goes on."""
    other = f"{prefix}denoise-0-{_token()}"
    Path(SHM_DIR, other).write_bytes(b"\0" * 16)
    try:
        echo.send(_naming(other, rid="hostile"))
        reply, _ = echo.recv()
        assert reply.request_id == "hostile" and "not addressed to this process" in reply.message
        assert Path(SHM_DIR, other).read_bytes() == b"\0" * 16
        _, reply, back = echo(_msg("after"), {"y": torch.ones(8)})
        assert reply.request_id == "after" and torch.equal(back["y"], torch.ones(8))
    finally:
        Path(SHM_DIR, other).unlink(missing_ok=True)


# --------------------------------------------------------------------------
# One process: zero-copy, lifetime, fallback
# --------------------------------------------------------------------------


def test_receive_is_zero_copy_and_memory_is_released(prefix):
    sender, receiver = ShmSender(prefix, "router", 1024), ShmReceiver(prefix, "router")
    t = torch.randn(256, 1024)
    frames = encode(_msg(), {"x": t, "small": torch.ones(4)}, shm=sender)
    names = _shm_names(frames)
    assert list(names) == ["x"] and len(frames) == 2  # the small tensor still travels as a frame
    assert _segments(prefix) == [names["x"]]
    _, tensors = decode_frames(frames, shm=receiver)
    assert _segments(prefix) == []  # unlinked as soon as it was opened
    x = tensors["x"]
    assert torch.equal(x, t) and torch.equal(tensors["small"], torch.ones(4))
    assert _mapping_of(x.data_ptr()) == f"{SHM_DIR}/{names['x']} (deleted)"
    x[0, 0] = 42.0  # a private, writable tensor like any other
    assert x[0, 0] == 42.0
    view = x[1:3]
    del tensors, x
    gc.collect()
    assert _mapping_of(view.data_ptr()).startswith(f"{SHM_DIR}/{names['x']}")  # a view keeps it mapped
    assert torch.equal(view, t[1:3])
    del view
    gc.collect()
    assert names["x"] not in Path("/proc/self/maps").read_text()  # unmapped once the last tensor is gone


def test_threshold_decides(prefix):
    sender = ShmSender(prefix, "router", 4096)
    below, at = torch.zeros(1023), torch.zeros(1024)  # 4092 and 4096 bytes
    frames = encode(_msg(), {"below": below, "at": at}, shm=sender)
    assert list(_shm_names(frames)) == ["at"]
    decode_frames(frames, shm=ShmReceiver(prefix, "router"))
    assert _segments(prefix) == []


def test_full_dev_shm_falls_back_to_frames(prefix, monkeypatch, caplog):
    import common.transport.shm as shm

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm.os, "write", full)
    t = torch.randn(1024)
    frames = encode(_msg(), {"x": t}, shm=ShmSender(prefix, "router", 1))
    assert _shm_names(frames) == {} and len(frames) == 2
    assert _segments(prefix) == []
    assert "shared memory unavailable" in caplog.text
    _, tensors = decode_frames(frames)
    assert torch.equal(tensors["x"], t)


def test_failed_encode_leaves_no_segment(prefix):
    with pytest.raises(TypeError):
        encode(_msg(), {"a": torch.randn(64), "b": torch.zeros(4, dtype=torch.complex64)},
               shm=ShmSender(prefix, "router", 1))
    assert _segments(prefix) == []


def _config(tmp_path, transport="ipc", threshold=1024, spare_bytes=0) -> EngineConfig:
    return EngineConfig(model="m", workers=[WorkerSpec("encoder", 0)], router_endpoint="ipc://x",
                        runtime_dir=str(tmp_path / "rt"), transport=transport, shm_threshold_bytes=threshold,
                        shm_spare_bytes=spare_bytes)


def test_context_is_off_for_tcp_and_threshold_zero(tmp_path):
    for cfg in (_config(tmp_path, "tcp"), _config(tmp_path, threshold=0)):
        ctx = ShmContext(cfg, "router")
        assert ctx.receiver is None and ctx.sender("encoder-0") is None
    on = ShmContext(_config(tmp_path), "router")
    assert on.receiver is not None and on.sender("encoder-0").threshold == 1024 and on.spares is None
    assert ShmContext(_config(tmp_path, spare_bytes=1 << 20), "router").sender("encoder-0").spares is not None


# --------------------------------------------------------------------------
# Segments prepared ahead of time
# --------------------------------------------------------------------------


def _spares(prefix: str) -> list[str]:
    return [n for n in _segments(prefix) if n.startswith(f"{prefix}spare.")]


@pytest.fixture
def pool(prefix):
    p = SparePool(prefix, "denoise-0", max_bytes=64 << 20)
    yield p
    p.close()


def test_repeated_sizes_use_prepared_segments(prefix, pool, caplog):
    caplog.set_level(logging.DEBUG, logger="disagg.shm")
    sender, receiver = ShmSender(prefix, "router", 1, spares=pool), ShmReceiver(prefix, "router")
    cases = {name: sample_tensor(dtype, (3, 5, 7)) for name, dtype in DTYPES.items()}
    cases["strided"] = torch.arange(600, dtype=torch.float32).reshape(20, 30).t()
    cases["scalar"] = torch.tensor(2.5, dtype=torch.float64)
    cases["large"] = torch.randn(4, 1 << 20)  # 16 MiB: torch's threaded copy instead of one memmove
    for name, t in cases.items():
        nbytes = t.numel() * t.element_size()
        for _ in range(2):  # the first sends teach the pool the size
            decode_frames(encode(_msg(), {"x": t}, shm=sender), shm=receiver)
        assert pool.wait_ready(nbytes, 30), name
        (spare,) = [n for n in _spares(prefix) if os.stat(Path(SHM_DIR, n)).st_size == nbytes]
        caplog.clear()
        frames = encode(_msg(), {"x": t}, shm=sender)
        assert "(prepared segment)" in caplog.text, name
        seg = _shm_names(frames)["x"]
        assert spare not in _segments(prefix)  # the spare became the message's segment
        assert os.stat(Path(SHM_DIR, seg)).st_size == nbytes
        _, got = decode_frames(frames, shm=receiver)
        assert _same_bytes(got["x"], t), name
        assert _mapping_of(got["x"].data_ptr()) == f"{SHM_DIR}/{seg} (deleted)"
    assert not [n for n in _segments(prefix) if not n.startswith(f"{prefix}spare.")]  # every message consumed
    pool.close()
    assert _segments(prefix) == []


def test_prepared_segments_are_never_accepted_as_messages(prefix, pool):
    sender = ShmSender(prefix, "router", 1, spares=pool)
    for _ in range(2):
        decode_frames(encode(_msg(), {"x": torch.ones(64)}, shm=sender), shm=ShmReceiver(prefix, "router"))
    assert pool.wait_ready(256, 30)
    (spare,) = _spares(prefix)
    for me in ("router", "denoise-0", "spare", "spare-denoise-0"):
        with pytest.raises(WireError):
            decode_frames(_naming(spare, shape=(64,)), shm=ShmReceiver(prefix, me))
    assert _spares(prefix) == [spare]


def test_pool_keeps_to_its_byte_budget(prefix):
    pool = SparePool(prefix, "denoise-0", max_bytes=1000)
    try:
        sender, receiver = ShmSender(prefix, "router", 1, spares=pool), ShmReceiver(prefix, "router")
        for n in (100, 200):  # 400 bytes, then 800 bytes: both do not fit
            for _ in range(2):
                decode_frames(encode(_msg(), {"x": torch.zeros(n)}, shm=sender), shm=receiver)
            assert pool.wait_ready(4 * n, 30)
        (only,) = _spares(prefix)
        assert os.stat(Path(SHM_DIR, only)).st_size == 800
        for _ in range(3):
            decode_frames(encode(_msg(), {"x": torch.zeros(1000)}, shm=sender), shm=receiver)  # above the budget
        assert not pool.wait_ready(4000, 0.5)
    finally:
        pool.close()
    assert _segments(prefix) == []


def test_pool_without_room_falls_back(prefix, pool, monkeypatch, caplog):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)  # what SparePool._prepare allocates pages with
    sender, receiver = ShmSender(prefix, "router", 1, spares=pool), ShmReceiver(prefix, "router")
    t = torch.randn(64)
    for _ in range(2):
        decode_frames(encode(_msg(), {"x": t}, shm=sender), shm=receiver)
    assert not pool.wait_ready(256, 30) and pool.failed
    assert "cannot prepare shared-memory segments" in caplog.text
    _, got = decode_frames(encode(_msg(), {"x": t}, shm=sender), shm=receiver)  # still through shared memory
    assert torch.equal(got["x"], t)
    assert _segments(prefix) == []


def test_context_removes_its_own_old_spares(tmp_path):
    cfg = _config(tmp_path, spare_bytes=1 << 20)
    prefix = engine_prefix(cfg.runtime_dir)
    mine, other = f"{prefix}spare.denoise-0.{_token()}", f"{prefix}spare.denoise-1.{_token()}"
    try:
        for n in (mine, other):
            Path(SHM_DIR, n).write_bytes(b"x")
        ShmContext(cfg, "denoise-0")
        assert not Path(SHM_DIR, mine).exists() and Path(SHM_DIR, other).exists()
    finally:
        remove_engine_segments(prefix)


# --------------------------------------------------------------------------
# Hostile names
# --------------------------------------------------------------------------


def _naming(segment: str, shape=(4,), dtype="float32", rid="r1", frames_after=()) -> list[bytes]:
    frames = encode(_msg(rid), {})
    head = msgpack.unpackb(bytes(memoryview(frames[0])))
    head["tensors"] = [{"name": "x", "dtype": dtype, "shape": list(shape), "shm": segment}]
    return [msgpack.packb(head), *frames_after]


@pytest.fixture
def opened(monkeypatch):
    """Every path the shared-memory modules open or unlink (both call them through the os module)."""
    seen = {"open": [], "unlink": []}
    real_open, real_unlink = os.open, os.unlink

    def spy_open(path, *a, **kw):
        seen["open"].append(str(path))
        return real_open(path, *a, **kw)

    def spy_unlink(path, *a, **kw):
        seen["unlink"].append(str(path))
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "open", spy_open)
    monkeypatch.setattr(os, "unlink", spy_unlink)
    return seen


def test_hostile_names_are_rejected_without_touching_anything(prefix, tmp_path, opened):
    receiver = ShmReceiver(prefix, "denoise-0")
    token = _token()
    other_engine = engine_prefix(str(tmp_path / "another")) + f"denoise-0-{token}"
    other_dest = f"{prefix}encoder-0-{token}"
    longer_index = f"{prefix}denoise-01-{token}"
    for name in (other_engine, other_dest, longer_index):
        Path(SHM_DIR, name).write_bytes(b"\0" * 16)
    victim = tmp_path / "victim"
    victim.write_bytes(b"\0" * 16)
    try:
        hostile = [
            "../etc/passwd", "/etc/passwd", "..", "", f"{prefix}denoise-0-../../etc/passwd",
            f"{prefix}denoise-0/{token}", other_engine, other_dest, longer_index,
            f"{prefix}denoise-0-{token[:-1]}", f"{prefix}denoise-0-{token.upper()}", f"{prefix}denoise-0-{token}x",
            f"{prefix}router-{token}", "x" * 300,
        ]
        for name in hostile:
            with pytest.raises(WireError):
                decode_frames(_naming(name), shm=receiver)
        assert opened == {"open": [], "unlink": []}  # nothing was opened or removed
        for name in (other_engine, other_dest, longer_index):
            assert Path(SHM_DIR, name).read_bytes() == b"\0" * 16
        # A symlink with a valid name is not followed, and its target is left alone.
        link = f"{prefix}denoise-0-{_token()}"
        os.symlink(victim, Path(SHM_DIR, link))
        with pytest.raises(WireError, match="cannot be opened"):
            decode_frames(_naming(link), shm=receiver)
        assert victim.read_bytes() == b"\0" * 16
        os.unlink(Path(SHM_DIR, link))
    finally:
        for name in (other_engine, other_dest, longer_index):
            Path(SHM_DIR, name).unlink(missing_ok=True)


def test_size_mismatch_is_rejected_and_removed(prefix):
    receiver = ShmReceiver(prefix, "denoise-0")
    for size in (15, 17, 0):
        name = f"{prefix}denoise-0-{_token()}"
        Path(SHM_DIR, name).write_bytes(b"\1" * size)
        with pytest.raises(WireError, match="needs 16") as exc:
            decode_frames(_naming(name, shape=(4,)), shm=receiver)
        assert exc.value.request_id == "r1"
        assert not Path(SHM_DIR, name).exists()


def test_empty_tensor_or_missing_segment_or_no_shm_link(prefix):
    receiver = ShmReceiver(prefix, "denoise-0")
    name = f"{prefix}denoise-0-{_token()}"
    with pytest.raises(WireError, match="cannot be opened"):
        decode_frames(_naming(name), shm=receiver)  # no such segment
    Path(SHM_DIR, name).write_bytes(b"")
    with pytest.raises(WireError, match="empty tensor"):
        decode_frames(_naming(name, shape=(0, 4)), shm=receiver)
    assert not Path(SHM_DIR, name).exists()
    Path(SHM_DIR, name).write_bytes(b"\0" * 16)
    with pytest.raises(WireError, match="takes none") as exc:
        decode_frames(_naming(name))  # a link without shared memory (tcp, or off)
    assert exc.value.request_id == "r1"
    assert Path(SHM_DIR, name).exists()  # without a receiver nothing is touched


def test_rejected_message_removes_its_segments(prefix):
    """A message refused for another reason (here: a frame too many) leaves no segment behind."""
    sender, receiver = ShmSender(prefix, "denoise-0", 1), ShmReceiver(prefix, "denoise-0")
    frames = encode(_msg(), {"x": torch.randn(64), "bad": torch.zeros(2, 2, dtype=torch.int8)}, shm=sender)
    assert len(_shm_names(frames)) == 2
    with pytest.raises(WireError, match="frames follow"):
        decode_frames([*frames, b"extra"], shm=receiver)
    assert _segments(prefix) == []
    frames = encode(_msg(), {"x": torch.randn(64)}, shm=sender)
    head = msgpack.unpackb(bytes(memoryview(frames[0])))
    head["tensors"][0]["dtype"] = "complex64"
    with pytest.raises(WireError, match="unknown dtype"):
        decode_frames([msgpack.packb(head)], shm=receiver)
    assert _segments(prefix) == []


def test_oversized_segment_is_refused(prefix):
    sender = ShmSender(prefix, "denoise-0", 1)
    frames = encode(_msg(), {"x": torch.randn(1024)}, shm=sender)
    with pytest.raises(WireError, match="exceeds 1000"):
        decode_frames(frames, shm=ShmReceiver(prefix, "denoise-0", max_bytes=1000))
    assert _segments(prefix) == []


def test_sweep_removes_only_own_leftovers(tmp_path):
    cfg = _config(tmp_path)
    prefix = engine_prefix(cfg.runtime_dir)
    mine = [f"{prefix}denoise-0-{_token()}" for _ in range(3)]
    others = [f"{prefix}denoise-01-{_token()}", f"{prefix}router-{_token()}",
              engine_prefix(str(tmp_path / "b")) + f"denoise-0-{_token()}"]
    try:
        for n in mine + others:
            Path(SHM_DIR, n).write_bytes(b"x")
        ShmContext(cfg, "denoise-0")
        assert not any(Path(SHM_DIR, n).exists() for n in mine)
        assert all(Path(SHM_DIR, n).exists() for n in others)
        assert remove_engine_segments(prefix) == 2  # the launcher's sweep: the whole engine, nothing else
        assert Path(SHM_DIR, others[2]).exists()
    finally:
        for n in others:
            Path(SHM_DIR, n).unlink(missing_ok=True)


# --------------------------------------------------------------------------
# Whole engines
# --------------------------------------------------------------------------

ROLLOUT = dict(prompt="a red kite over the sea", negative_prompt="blurry", seed=3, num_inference_steps=4,
               guidance_scale=4.0, return_trajectory=True)
SHM_LINE = re.compile(r"(\w+-\d+) DEBUG (\d+) bytes to (\S+) through shared memory \((new|prepared) segment\)")


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """The same topology with the data plane at a 1 KiB threshold and with it off."""
    started = {}
    try:
        for key, threshold in (("shm", "1024"), ("frames", "0")):
            started[key] = EngineProcess("tiny", "encoder=1,denoise=1,decode=1", ["--shm-threshold", threshold],
                                         workdir=tmp_path_factory.mktemp(f"engine-{key}"),
                                         env={"DISAGG_LOG_LEVEL": "DEBUG"})
        yield started
    finally:
        for e in started.values():
            e.stop()


def _prefix_of(engine) -> str:
    return engine_prefix(str(engine.runtime))


def _rollout(engine, **over):
    with EngineClient(engine.url) as c:
        return c.rollout(**{**ROLLOUT, **over})


@pytest.mark.heavy  # launched engines with and without shared memory: CI
@pytest.mark.parametrize("output_type", ["frames", "latent"])
def test_engine_results_identical_with_and_without_shm(engines, output_type):
    a = _rollout(engines["shm"], output_type=output_type)["samples"][0]
    b = _rollout(engines["frames"], output_type=output_type)["samples"][0]
    for key in ("output", "log_probs", "log_prob_steps"):
        assert _same_bytes(a[key], b[key]), key
    for key in ("latents", "timesteps", "sigmas"):
        assert _same_bytes(a["trajectory"][key], b["trajectory"][key]), key
    assert a["trajectory"]["latents"].numel() * 4 > 1024  # large enough to take the shared-memory path
    log = engines["shm"].log_text()
    hops = {(m.group(1), m.group(3)) for m in SHM_LINE.finditer(log)}
    # Results reach the router through shared memory: from the decode worker, or (latent) from denoise.
    assert ("decode-0" if output_type == "frames" else "denoise-0", "router") in hops
    if output_type == "frames":
        assert ("denoise-0", "decode-0") in hops
    assert not SHM_LINE.search(engines["frames"].log_text())
    # Every message's segment was opened (and so unlinked); what is left is prepared for the next send.
    assert _segments(_prefix_of(engines["shm"])) == _spares(_prefix_of(engines["shm"]))


@pytest.mark.heavy  # launched engines with and without shared memory: CI
def test_repeated_requests_use_prepared_segments(engines):
    reference = _rollout(engines["frames"])["samples"][0]
    for _ in range(10):
        got = _rollout(engines["shm"])["samples"][0]
        assert _same_bytes(got["output"], reference["output"])
        assert _same_bytes(got["trajectory"]["latents"], reference["trajectory"]["latents"])
        if any(m.group(4) == "prepared" for m in SHM_LINE.finditer(engines["shm"].log_text())):
            break
    else:
        raise AssertionError("no prepared segment was used:\n" + engines["shm"].log())


@pytest.mark.heavy  # launched engines with and without shared memory: CI
def test_hostile_segment_name_at_a_worker(engines):
    eng = engines["shm"]
    prefix = _prefix_of(eng)
    elsewhere = f"{prefix}encoder-0-{_token()}"
    Path(SHM_DIR, elsewhere).write_bytes(b"\0" * 16)
    try:
        rows = eng.http.get("/health").json()["workers"]
        denoise = next(w for w in rows if w["role"] == "denoise")
        ctx = zmq.Context.instance()
        for i, name in enumerate(["../../etc/passwd", elsewhere, f"{prefix}denoise-0-{_token()}"]):
            sock = ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 5000)
            sock.connect(denoise["endpoint"])
            sock.send_multipart(_naming(name, rid=f"hostile-shm-{i}"))
            sock.close()
        deadline = time.monotonic() + 20
        while eng.log_text().count("answer for unknown or finished request hostile-shm-") < 3:
            assert time.monotonic() < deadline, eng.log()
            time.sleep(0.05)
        assert Path(SHM_DIR, elsewhere).read_bytes() == b"\0" * 16
        assert [w["pid"] for w in eng.http.get("/health").json()["workers"]] == [w["pid"] for w in rows]
    finally:
        Path(SHM_DIR, elsewhere).unlink(missing_ok=True)


@pytest.mark.heavy  # launched engines with and without shared memory: CI
def test_restarted_worker_removes_its_leftovers(engines):
    eng = engines["shm"]
    prefix = _prefix_of(eng)
    for_denoise = [f"{prefix}denoise-0-{_token()}" for _ in range(2)]
    for_encoder = f"{prefix}encoder-0-{_token()}"
    for n in [*for_denoise, for_encoder]:
        Path(SHM_DIR, n).write_bytes(b"\0" * 64)
    pid = next(w["pid"] for w in eng.http.get("/health").json()["workers"] if w["role"] == "denoise")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        rows = eng.http.get("/health").json()["workers"]
        new = next(w for w in rows if w["role"] == "denoise")
        if new["pid"] not in (None, pid) and new["state"] == "ready":
            break
        assert time.monotonic() < deadline, eng.log()
        time.sleep(0.2)
    assert not any(Path(SHM_DIR, n).exists() for n in for_denoise)  # the new worker removed what was addressed to it
    assert Path(SHM_DIR, for_encoder).exists()  # and nothing addressed to another process
    # Still serving through shared memory after the restart, with the same results.
    a = _rollout(eng)["samples"][0]
    b = _rollout(engines["frames"])["samples"][0]
    assert _same_bytes(a["output"], b["output"])


@pytest.mark.heavy  # launched engines with and without shared memory: CI
def test_no_segment_survives_the_engine(engines):
    """Runs last: stopping the engine removes every segment of it, delivered or not."""
    eng = engines["shm"]
    prefix = _prefix_of(eng)
    Path(SHM_DIR, f"{prefix}router-{_token()}").write_bytes(b"x")  # as if a message never arrived
    Path(SHM_DIR, f"{prefix}encoder-0-{_token()}").write_bytes(b"x")
    assert _segments(prefix)
    eng.stop()
    assert _segments(prefix) == []
