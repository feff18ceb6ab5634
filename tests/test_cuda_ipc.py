"""CUDA IPC data plane (common/transport/cuda_ipc.py).

On any machine: which links use it, the descriptor's validation, that a process
without CUDA refuses a handle, and the codec's bookkeeping (every handle of a
rejected message is released exactly once, never one that was opened). The
bookkeeping tests drive the codec with recording sender/receiver objects,
because real CUDA IPC needs a GPU.

On a GPU machine (skipped elsewhere): a tensor between two real processes over
a real ZeroMQ socket, the sender's memory coming back once the receiver is done
or rejects the message, and a whole engine on the GPU giving the same output
with CUDA IPC as with host staging while its workers report IPC transfers.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch
import zmq

from common.config.engine import EngineConfig, WorkerSpec
from common.transport.cuda_ipc import CudaIpcContext, CudaIpcSender, link_uses_cuda_ipc
from common.protocol.messages import PROTOCOL_VERSION, CudaIpcHandle, Result, TensorSpec
from common.protocol.codec import WireError, decode_frames, encode

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")

HANDLE = CudaIpcHandle(device=0, handle=b"\x01" * 66, storage_bytes=24, offset_bytes=0,
                       ref_counter="/torch_123_456_0", ref_counter_offset=3, event=b"\x02" * 64, event_sync=True)


def _config(transport="ipc", cuda_ipc=True, devices=("cuda:0", "cuda:0", "cuda:1")) -> EngineConfig:
    workers = [WorkerSpec(role=r, index=0, device=d, endpoint=f"ipc:///tmp/{r}")
               for r, d in zip(("encoder", "denoise", "decode"), devices)]
    return EngineConfig(model="m", workers=workers, router_endpoint="ipc:///tmp/router", runtime_dir="/tmp/rt",
                        transport=transport, cuda_ipc=cuda_ipc)


# --- which links -------------------------------------------------------------


def test_only_gpu_to_gpu_links_on_one_host_use_cuda_ipc():
    c = _config()
    enc, den, dec = c.workers
    assert link_uses_cuda_ipc(c, enc, den)
    assert link_uses_cuda_ipc(c, den, dec)  # different GPUs of one host: still IPC
    assert not link_uses_cuda_ipc(c, dec, None)  # the router takes host tensors
    assert not link_uses_cuda_ipc(_config(transport="tcp"), enc, den)
    assert not link_uses_cuda_ipc(_config(cuda_ipc=False), enc, den)
    cpu_decode = _config(devices=("cuda:0", "cuda:0", "cpu"))
    assert not link_uses_cuda_ipc(cpu_decode, cpu_decode.workers[1], cpu_decode.workers[2])
    assert not link_uses_cuda_ipc(cpu_decode, cpu_decode.workers[2], cpu_decode.workers[1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without CUDA")
def test_a_gpu_worker_spec_without_cuda_neither_sends_nor_receives_handles():
    c = _config()
    ctx = CudaIpcContext(c, c.workers[0])
    assert ctx.receiver is None and ctx.sender("denoise", 0) is None
    assert ctx.sent == ctx.received == 0


def test_a_host_tensor_is_never_exported():
    assert CudaIpcSender("denoise-0").put(torch.ones(4)) is None


def test_launcher_flag_and_transport_decide_the_config(tmp_path):
    import launch

    def config_of(*argv):
        return launch.engine_config(launch.parse_args(["--model", "tiny", *argv]), tmp_path / "m", tmp_path, [])

    assert config_of().cuda_ipc is True
    assert config_of("--no-cuda-ipc").cuda_ipc is False
    tcp = config_of("--transport", "tcp")
    assert tcp.cuda_ipc is False and tcp.shm_threshold_bytes == 0


# --- the descriptor --------------------------------------------------------------


def _header_with(spec: dict) -> bytes:
    header = msgspec.to_builtins(Result(v=PROTOCOL_VERSION, request_id="r9", stage="s"))
    header["tensors"] = [spec]
    return msgspec.msgpack.encode(header)


def _spec_dict() -> dict:
    return msgspec.to_builtins(TensorSpec(name="x", dtype="float32", shape=[2, 3], cuda=HANDLE),
                               builtin_types=(bytes,))


def test_descriptor_round_trips_in_a_header():
    rx = _RecordingReceiver()
    msg, tensors = decode_frames([_header_with(_spec_dict())], cuda=rx)
    assert msg.tensors[0].cuda == HANDLE and rx.opened == [HANDLE.ref_counter_offset]


@pytest.mark.parametrize("field,value", [
    ("ref_counter", "/etc/passwd"),
    ("ref_counter", "/torch_1/../x"),
    ("ref_counter", "torch_1_2"),
    ("ref_counter_offset", 10000),
    ("ref_counter_offset", -1),
    ("device", -1),
    ("device", 256),
    ("handle", b""),
    ("handle", b"x" * 1025),
    ("storage_bytes", 0),
    ("offset_bytes", -8),
    ("event", b"e" * 1025),
])
def test_hostile_descriptor_fields_are_rejected_by_the_codec(field, value):
    spec = _spec_dict()
    spec["cuda"][field] = value
    rx = _RecordingReceiver()
    with pytest.raises(WireError, match=field) as e:
        decode_frames([_header_with(spec)], cuda=rx)
    assert e.value.request_id == "r9" and rx.opened == []


# --- codec bookkeeping --------------------------------------------------------


class _RecordingSender:
    """Stands in for CudaIpcSender: hands out numbered descriptors, records discards."""

    def __init__(self):
        self.put_count, self.discarded = 0, []

    def put(self, t):
        self.put_count += 1
        return msgspec.structs.replace(HANDLE, ref_counter_offset=self.put_count,
                                       storage_bytes=t.numel() * t.element_size())

    def discard(self, h):
        self.discarded.append(h.ref_counter_offset)


class _RecordingReceiver:
    """Stands in for CudaIpcReceiver: builds the tensor from nothing, can fail on chosen handles."""

    def __init__(self, fail_on=()):
        self.fail_on, self.opened, self.discarded = set(fail_on), [], []

    def open(self, h, dtype, shape, nbytes, request_id=None):
        self.opened.append(h.ref_counter_offset)
        if h.ref_counter_offset in self.fail_on:
            raise WireError("cannot open", request_id)
        return torch.zeros(shape, dtype=dtype)

    def discard(self, h):
        self.discarded.append(h.ref_counter_offset)


def _message(tensors, cuda):
    return encode(Result(v=PROTOCOL_VERSION, request_id="r1", stage="s"), tensors, cuda=cuda)


def test_handles_replace_frames_and_decode_opens_each_once():
    tx, rx = _RecordingSender(), _RecordingReceiver()
    frames = _message({"a": torch.ones(2, 3), "b": torch.ones(4)}, tx)
    assert len(frames) == 1  # no tensor frames: both went as handles
    msg, tensors = decode_frames(frames, cuda=rx)
    assert [s.cuda.ref_counter_offset for s in msg.tensors] == [1, 2]
    assert rx.opened == [1, 2] and rx.discarded == []
    assert tensors["a"].shape == (2, 3)


def test_a_process_without_a_cuda_receiver_rejects_handles():
    frames = _message({"a": torch.ones(2, 3)}, _RecordingSender())
    with pytest.raises(WireError, match="CUDA IPC"):
        decode_frames(frames)


def test_a_rejected_message_releases_every_handle_exactly_once():
    frames = _message({"a": torch.ones(2, 3), "b": torch.ones(4)}, _RecordingSender())
    rx = _RecordingReceiver()
    with pytest.raises(WireError, match="frames"):
        decode_frames([*frames, b"stray frame"], cuda=rx)
    assert rx.opened == [] and sorted(rx.discarded) == [1, 2]


def test_a_failed_open_releases_only_the_handles_never_opened():
    frames = _message({"a": torch.ones(2), "b": torch.ones(3), "c": torch.ones(4)}, _RecordingSender())
    rx = _RecordingReceiver(fail_on={2})
    with pytest.raises(WireError, match="cannot open"):
        decode_frames(frames, cuda=rx)
    # "a" was opened (its copy is the receiver's), "b" failed (open releases it), "c" never opened.
    assert rx.opened == [1, 2] and rx.discarded == [3]


def test_a_size_mismatch_is_caught_by_the_descriptor_check():
    frames = _message({"a": torch.ones(2, 3)}, _RecordingSender())
    header = msgspec.msgpack.decode(frames[0])
    header["tensors"][0]["shape"] = [2, 2 ** 62]
    rx = _RecordingReceiver()
    with pytest.raises(WireError, match="shape"):
        decode_frames([msgspec.msgpack.encode(header)], cuda=rx)
    assert rx.opened == [] and rx.discarded == [1]


def test_a_tensor_with_both_a_segment_and_a_handle_is_rejected():
    frames = _message({"a": torch.ones(2, 3)}, _RecordingSender())
    header = msgspec.msgpack.decode(frames[0])
    header["tensors"][0]["shm"] = "disagg-00000000-x-" + "0" * 32
    rx = _RecordingReceiver()
    with pytest.raises(WireError, match="both"):
        decode_frames([msgspec.msgpack.encode(header)], cuda=rx)
    assert rx.opened == []


def test_a_failed_encode_releases_the_handles_it_made():
    tx = _RecordingSender()
    with pytest.raises(TypeError):
        _message({"a": torch.ones(2), "b": torch.ones(2, dtype=torch.complex64)}, tx)
    assert tx.discarded == [1]


# --- on a GPU -------------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import sys, torch, zmq
    sys.path.insert(0, {root!r})
    from common.transport.cuda_ipc import CudaIpcReceiver
    from common.protocol.messages import PROTOCOL_VERSION, Result
    from common.protocol.codec import WireError, decode_frames, encode
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind({data!r}); push.connect({report!r})
    rx = CudaIpcReceiver(torch.device("cuda:0"))
    push.send_multipart(encode(Result(v=PROTOCOL_VERSION, request_id="ready", stage="t")))
    while True:
        frames = pull.recv_multipart(copy=False)
        try:
            msg, tensors = decode_frames(frames, cuda=rx)
        except WireError as e:
            push.send_multipart(encode(Result(v=PROTOCOL_VERSION, request_id="rejected", stage="t")))
            continue
        if msg.request_id == "stop":
            break
        x = tensors["x"]
        torch.cuda.synchronize()
        info = {{"device": str(x.device)}}
        push.send_multipart(encode(Result(v=PROTOCOL_VERSION, request_id=msg.request_id, stage="t", info=info),
                                   {{"x": x.cpu()}}))
""")


@pytest.fixture
def gpu_peer(tmp_path):
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    data, report = f"ipc://{tmp_path}/data", f"ipc://{tmp_path}/report"
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(report)
    proc = subprocess.Popen([sys.executable, "-c", _CHILD.format(root=root, data=data, report=report)])
    assert pull.poll(120_000), "receiver did not start"
    pull.recv_multipart()
    push.connect(data)
    yield push, pull
    push.send_multipart(encode(Result(v=PROTOCOL_VERSION, request_id="stop", stage="t")))
    proc.wait(timeout=30)
    push.close(0)
    pull.close(0)
    ctx.term()


def _blocks_free_after(fn, timeout_s=10.0) -> bool:
    """Whether this process's CUDA memory returns to where it was once ``fn()`` ran and IPC was collected."""
    import time

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    fn()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        torch.cuda.ipc_collect()
        if torch.cuda.memory_allocated() <= base:
            return True
        time.sleep(0.05)
    return False


@gpu
def test_gpu_tensor_crosses_processes_by_handle_and_its_memory_comes_back(gpu_peer):
    push, pull = gpu_peer
    tx = CudaIpcSender("peer")
    x = torch.randn(3, 1024, 1024, device="cuda")  # 12 MiB
    replies = []

    def send():
        frames = encode(Result(v=PROTOCOL_VERSION, request_id="a", stage="t"), {"x": x[:, 1:]}, cuda=tx)
        assert len(frames) == 1 and tx.sent == 1  # the tensor went as a handle, not a frame
        push.send_multipart(frames)
        assert pull.poll(60_000)
        replies.append(decode_frames(pull.recv_multipart()))

    assert _blocks_free_after(send), "the sender's exported copy was never freed"
    msg, tensors = replies[0]
    assert msg.info["device"].startswith("cuda")
    assert torch.equal(tensors["x"], x[:, 1:].cpu())


@gpu
def test_gpu_handles_of_a_rejected_message_are_released(gpu_peer):
    push, pull = gpu_peer
    tx = CudaIpcSender("peer")
    x = torch.randn(1 << 20, device="cuda")

    def send_bad():
        frames = encode(Result(v=PROTOCOL_VERSION, request_id="b", stage="t"), {"x": x}, cuda=tx)
        push.send_multipart([*frames, b"stray frame"])
        assert pull.poll(60_000)
        assert decode_frames(pull.recv_multipart())[0].request_id == "rejected"

    assert _blocks_free_after(send_bad), "a rejected message's handle was never released"


@gpu
def test_gpu_engine_output_is_the_same_with_and_without_cuda_ipc(engine_factory):
    body = dict(prompt="a red fox runs through the snow", seed=11, num_inference_steps=4, output_type="latent")
    outputs, counts = {}, {}
    for mode, extra in (("ipc", []), ("staged", ["--no-cuda-ipc"])):
        e = engine_factory("tiny", "encoder=1,denoise=1,decode=1", ["--dtype", "float32", *extra])
        r = e.http.post("/generate", json=body)
        assert r.status_code == 200, r.text
        outputs[mode] = r.json()["samples"][0]["output"]
        import time

        time.sleep(1.5)  # a heartbeat carries the counters
        counts[mode] = {w["role"]: w["cuda_ipc"] for w in e.http.get("/health").json()["workers"]}
        assert all(w["device"].startswith("cuda") for w in e.http.get("/health").json()["workers"])
        e.stop()
    assert outputs["ipc"] == outputs["staged"]
    assert counts["ipc"]["encoder"]["sent"] >= 1 and counts["ipc"]["denoise"]["received"] >= 1
    assert counts["ipc"]["denoise"]["sent"] >= 1 and counts["ipc"]["decode"]["received"] >= 1
    assert all(c == {"sent": 0, "received": 0} for c in counts["staged"].values())
