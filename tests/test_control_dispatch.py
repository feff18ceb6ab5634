"""Control messages reach their stage's handler by type: a worker answers each kind it handles with that kind's
reply, answers a kind it does not handle with an error, and serves on (a real decode stage in a real worker loop,
in this process; what it sends is captured instead of pushed)."""

import pytest
import torch

from common.config.engine import EngineConfig, WorkerSpec
from common.protocol.codec import encode
from common.protocol.control import (
    CONTROL_REQUESTS,
    Checksum,
    InitWeightsGroup,
    LoadLora,
    ReleaseMemory,
    ReleaseReply,
    ResumeMemory,
    ResumeReply,
    UpdateWeights,
)
from common.protocol.messages import (LATENTS, OUTPUT, PROTOCOL_VERSION, DecodeRequest, ErrorReply, GenerationParams,
                                      Route)
from common.runtime.worker import WorkerRuntime
from decode_worker.stage import DecodeStage
from encoder_worker.stage import EncoderStage

PARAMS = GenerationParams(prompt="a fox", negative_prompt="", height=32, width=48, num_frames=5,
                          num_inference_steps=2, guidance_scale=1.0, seed=0)


def _config(tiny_dir, role: str, runtime_dir) -> EngineConfig:
    return EngineConfig(model=str(tiny_dir), workers=[WorkerSpec(role=role, index=0)], router_endpoint="",
                        runtime_dir=str(runtime_dir))


@pytest.fixture(scope="module")
def worker(tiny_dir, tmp_path_factory):
    """A decode worker's loop around its loaded stage; ``worker.sent``: what it sent, in order."""
    config = _config(tiny_dir, "decode", tmp_path_factory.mktemp("runtime"))
    stage = DecodeStage(config, config.workers[0])
    stage.load()
    runtime = WorkerRuntime(stage)
    runtime.sent = []
    runtime.send = runtime.sent.append
    yield runtime
    runtime.security.close()


def _turn(worker, msg, tensors=None) -> list:
    """``msg`` through the worker's receive path and one quiet turn of its loop; what it sent meanwhile."""
    worker.sent.clear()
    worker.handle(encode(msg, tensors))
    worker.apply_controls_when_quiet()
    worker.admit_held()
    while worker.stage.has_work():
        worker.advance()
    return [fwd.msg for fwd in worker.sent]


@pytest.mark.parametrize("msg, tensors", [
    (Checksum(v=PROTOCOL_VERSION, request_id="c1"), None),
    (UpdateWeights(v=PROTOCOL_VERSION, request_id="c2", path="/w"), None),
    (LoadLora(v=PROTOCOL_VERSION, request_id="c3", lora_name="a"), {"lora.blob": torch.randn(4)}),
    (InitWeightsGroup(v=PROTOCOL_VERSION, request_id="c4", master_address="127.0.0.1", master_port=1,
                      world_size=2, rank=1), None),
], ids=["checksum", "update_weights", "load_lora", "init_weights_group"])
def test_a_kind_the_stage_does_not_handle_is_answered_with_an_error_and_the_worker_serves_on(worker, msg, tensors):
    (reply,) = _turn(worker, msg, tensors)
    assert isinstance(reply, ErrorReply) and reply.request_id == msg.request_id
    assert (reply.status, reply.stage, reply.type) == (400, "decode", "RequestError")
    assert reply.message == f"the decode worker takes no {msg.__struct_config__.tag} messages"
    request = DecodeRequest(v=PROTOCOL_VERSION, request_id="d1", route=Route(encoder=0, denoise=0, decode=0),
                            params=PARAMS)
    (result,) = _turn(worker, request, {LATENTS.name: torch.randn(1, 16, 2, 4, 6)})
    assert result.request_id == "d1" and result.stage == "decode"
    assert worker.sent[0].tensors[OUTPUT.name].shape == (1, 5, 32, 48, 3)


def test_the_kinds_it_handles_get_their_own_replies(worker):
    (released,) = _turn(worker, ReleaseMemory(v=PROTOCOL_VERSION, request_id="m1", level=1))
    assert isinstance(released, ReleaseReply)
    assert (released.request_id, released.role, released.index) == ("m1", "decode", 0)
    assert released.level == 1 and released.released_bytes > 0 and "rss" in released.after
    (resumed,) = _turn(worker, ResumeMemory(v=PROTOCOL_VERSION, request_id="m2"))
    assert isinstance(resumed, ResumeReply) and resumed.level == 0 and resumed.request_id == "m2"
    assert not worker.stage.memory.asleep


def test_each_stage_names_the_kinds_it_handles(tiny_dir, tmp_path):
    """Encoder and decode workers handle releasing and resuming their weights only; a denoise worker every kind."""
    from denoise_worker.controls import DenoiseControls

    for stage_cls, role in ((EncoderStage, "encoder"), (DecodeStage, "decode")):
        config = _config(tiny_dir, role, tmp_path)
        assert set(stage_cls(config, config.workers[0]).control_handlers()) == {ReleaseMemory, ResumeMemory}
    assert set(DenoiseControls(None).table()) | {ReleaseMemory, ResumeMemory} == set(CONTROL_REQUESTS)
