"""Wire codec: round trips over real ZeroMQ sockets and rejection of malformed frames."""

import msgpack
import msgspec
import pytest
import torch
import zmq

from conftest import sample_tensor
from common.protocol.messages import (
    PROTOCOL_VERSION,
    DecodeRequest,
    DenoiseRequest,
    EncodeRequest,
    ErrorReply,
    GenerationParams,
    Heartbeat,
    Progress,
    Result,
    Route,
)
from common.protocol.codec import DTYPES, WireError, decode, decode_frames, encode

PARAMS = GenerationParams(
    prompt="a fox at dawn",
    negative_prompt="",
    height=32,
    width=48,
    num_frames=5,
    num_inference_steps=4,
    guidance_scale=5.0,
    seed=7,
    sigmas=[1.0, 0.75, 0.5, 0.25],
    mu=0.5,
)
ROUTE = Route(encoder=0, denoise=1, decode=0)


def _msg(**kw):
    return DecodeRequest(v=PROTOCOL_VERSION, request_id="r1", route=ROUTE, params=PARAMS, **kw)


@pytest.fixture(scope="module")
def pair():
    ctx = zmq.Context.instance()
    pull = ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    yield push, pull
    push.close(0)
    pull.close(0)


def _roundtrip(pair, frames):
    push, pull = pair
    push.send_multipart(frames, copy=False)
    assert pull.poll(5000)
    return decode_frames(pull.recv_multipart(copy=False))


@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
def test_roundtrip_every_dtype_over_zmq(pair, dtype):
    t = sample_tensor(dtype, (2, 3, 5))
    msg, tensors = _roundtrip(pair, encode(_msg(), {"latents": t}))
    assert msg.params == PARAMS and msg.route == ROUTE and msg.request_id == "r1"
    got = tensors["latents"]
    assert got.dtype == dtype and got.shape == t.shape
    assert torch.equal(got.view(torch.uint8), t.contiguous().view(torch.uint8))


def test_bfloat16_bytes_are_preserved_exactly(pair):
    t = torch.tensor([1.0, -2.5, 3.140625, 1e-3, float("inf")], dtype=torch.bfloat16)
    _, tensors = _roundtrip(pair, encode(_msg(), {"x": t}))
    assert torch.equal(tensors["x"].view(torch.int16), t.view(torch.int16))


def test_empty_and_non_contiguous_tensors(pair):
    empty = torch.empty(0, 16, dtype=torch.float32)
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    strided = base.t()  # non-contiguous view
    sliced = base[:, ::2]
    _, tensors = _roundtrip(pair, encode(_msg(), {"e": empty, "t": strided, "s": sliced}))
    assert tensors["e"].shape == (0, 16)
    assert torch.equal(tensors["t"], strided) and torch.equal(tensors["s"], sliced)


def test_received_tensor_is_a_view_of_the_frame(pair):
    t = torch.randn(1024)
    frames = encode(_msg(), {"x": t})
    push, pull = pair
    push.send_multipart(frames, copy=False)
    raw = pull.recv_multipart(copy=False)
    _, tensors = decode_frames(raw)
    frame_addr = memoryview(raw[1].buffer)
    assert tensors["x"].data_ptr() == torch.frombuffer(frame_addr, dtype=torch.uint8).data_ptr()


def _header(frames):
    return msgpack.unpackb(bytes(frames[0]))


def _with_header(frames, header):
    return [msgpack.packb(header), *frames[1:]]


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda h, f: ([b"\x00garbage"] + f[1:], None), "invalid header"),
        (lambda h, f: (_with_header(f, {**h, "v": 99}), None), "protocol version"),
        (lambda h, f: (_with_header(f, {**h, "kind": "bogus"}), None), "invalid header"),
        (lambda h, f: (_with_header(f, {**h, "extra_field": 1}), None), "invalid header"),
        (lambda h, f: (_with_header(f, {**h, "route": {"encoder": "x"}}), None), "invalid header"),
        (lambda h, f: (f[:1], None), "frames follow"),
        (lambda h, f: (f + [b"x"], None), "frames follow"),
        (lambda h, f: ([f[0], bytes(f[1])[:-4]], None), "needs"),
        (
            lambda h, f: (_with_header(f, {**h, "tensors": [{**h["tensors"][0], "dtype": "complex64"}]}), None),
            "unknown dtype",
        ),
        (
            lambda h, f: (_with_header(f, {**h, "tensors": [{**h["tensors"][0], "shape": [-1, 4]}]}), None),
            "invalid shape",
        ),
    ],
    ids=["garbage", "version", "kind", "unknown-field", "field-type", "missing-frame", "extra-frame",
         "truncated", "dtype", "shape"],
)
def test_malformed_messages_are_rejected(mutate, needle):
    frames = [bytes(memoryview(f)) for f in encode(_msg(), {"latents": torch.zeros(2, 2)})]
    bad, _ = mutate(_header(frames), frames)
    with pytest.raises(WireError, match=needle) as exc:
        decode_frames(bad)
    # Whenever the header still names the request, the error does too, so it can be answered.
    assert exc.value.request_id == (None if bad[0].startswith(b"\x00garbage") else "r1")


def test_request_id_is_recovered_from_a_bad_header():
    frames = [bytes(memoryview(f)) for f in encode(_msg(), {})]
    h = _header(frames)
    with pytest.raises(WireError) as exc:
        decode_frames([msgpack.packb({**h, "params": {"prompt": 1}})])
    assert exc.value.request_id == "r1"


def _walk(obj):
    yield obj
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _walk(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk(v)


@pytest.mark.parametrize("kind", [EncodeRequest, DenoiseRequest, DecodeRequest])
def test_no_scheduler_travels(kind):
    """Request messages carry schedule numbers only; nothing of a scheduler object or its state."""
    from diffusers import FlowMatchEulerDiscreteScheduler, UniPCMultistepScheduler

    msg = kind(v=PROTOCOL_VERSION, request_id="r", route=ROUTE, params=PARAMS)
    frames = encode(msg, {"prompt_embeds": torch.zeros(3, 4)})
    header = msgpack.unpackb(bytes(memoryview(frames[0])))
    keys = {x for x in _walk(header) if isinstance(x, str)}
    sched_words = {"scheduler", "_class_name", "model_outputs", "timestep_list", "lower_order_nums",
                   "_step_index", "_begin_index", "solver_order", "flow_shift", "shift", "last_sample"}
    assert not keys & sched_words
    for sched in (UniPCMultistepScheduler(), FlowMatchEulerDiscreteScheduler()):
        assert type(sched).__name__ not in keys
    # The schedule-shaping fields themselves are present and are plain numbers.
    p = header["params"]
    assert p["num_inference_steps"] == 4 and p["sigmas"] == [1.0, 0.75, 0.5, 0.25] and p["mu"] == 0.5
    assert all(isinstance(x, (int, float, str, bool, type(None), bytes, list, dict)) for x in _walk(header))


def test_encoding_a_scheduler_is_impossible():
    from diffusers import UniPCMultistepScheduler

    with pytest.raises((TypeError, msgspec.EncodeError, msgspec.ValidationError)):
        msgspec.msgpack.encode(msgspec.structs.replace(PARAMS, sigmas=UniPCMultistepScheduler()))


# ---------------------------------------------------------------- tensor contracts (decode)


def _denoise(rid="c1"):
    return DenoiseRequest(v=PROTOCOL_VERSION, request_id=rid, route=ROUTE, params=PARAMS)


def test_a_message_with_its_declared_tensors_decodes():
    tensors = {"prompt_embeds": torch.randn(3, 8), "negative_prompt_embeds": torch.randn(1, 8, dtype=torch.bfloat16)}
    msg, got = decode(encode(_denoise(), tensors))
    assert isinstance(msg, DenoiseRequest) and set(got) == set(tensors)
    result = Result(v=PROTOCOL_VERSION, request_id="c2", stage="decode")
    _, got = decode(encode(result, {"output": torch.rand(1, 5, 8, 8, 3), "log_probs": torch.randn(1, 2),
                                    "log_prob_steps": torch.tensor([1, 2])}))
    assert got["log_prob_steps"].dtype == torch.int64


@pytest.mark.parametrize("msg, tensors, needle", [
    (_denoise(), {"prompt_embeds": torch.randn(3, 8), "latents": torch.randn(1, 16, 2, 4, 4)}, "carries no tensor 'latents'"),
    (_denoise(), {"prompt_embeds": torch.ones(3, 8, dtype=torch.int64)}, "dtype int64"),
    (_denoise(), {"prompt_embeds": torch.randn(1, 3, 8)}, "rank 3 is not 2"),
    (_denoise(), {"negative_prompt_embeds": torch.randn(3, 8)}, "without prompt_embeds"),
    (DecodeRequest(v=PROTOCOL_VERSION, request_id="c1", route=ROUTE, params=PARAMS), {"log_probs": torch.randn(1, 2)},
     "without latents"),
    (Result(v=PROTOCOL_VERSION, request_id="c1", stage="decode"),
     {"output": torch.rand(1, 5, 8, 8, 3), "log_prob_steps": torch.randn(2)}, "dtype float32"),
    (ErrorReply(v=PROTOCOL_VERSION, request_id="c1", stage="decode", type="X", message="m"),
     {"output": torch.rand(1, 5, 8, 8, 3)}, "carries no tensor"),
])
def test_tensors_outside_the_contract_are_rejected_naming_the_request(msg, tensors, needle):
    frames = encode(msg, tensors)
    with pytest.raises(WireError, match=needle) as e:
        decode(frames)
    assert e.value.request_id == "c1"
    decode_frames(frames)  # positive control: the data plane alone accepts the same frames


def test_every_kind_declares_distinct_tensor_names():
    for kind in (EncodeRequest, DenoiseRequest, DecodeRequest, Result, ErrorReply, Heartbeat, Progress):
        names = [f.name for f in kind.carries]
        assert len(names) == len(set(names)) == len(kind.contract())
    assert DecodeRequest.contract()["latents"].required and not Result.contract()["log_probs"].required



def _zeros(field):
    """A tensor of ``field``'s first rank and dtype class."""
    rank = field.rank if isinstance(field.rank, int) else field.rank[0]
    return torch.zeros((2,) * rank, dtype=torch.float32 if "float32" in field.dtypes else torch.int64)


def test_a_familys_own_tensors_ride_its_contract_alone():
    """A tensor a family's binding declares (its prompt tensors, their negative twins, its image side's) decodes
    on a denoise message against that family's contract, and is refused by the shared contract, by the contract
    of every family that does not declare it, on a kind outside its way, and at another rank."""
    from common.families import BINDINGS

    declared = {b.pipeline: {f.name: f for f in b.wire_tensors} for b in BINDINGS.values()}
    own = {n: f for fields in declared.values() for n, f in fields.items() if n not in DenoiseRequest.contract()}
    assert len(own) >= 4 and all(f.made_by == "encoder" and f.read_by == "denoise" for f in own.values())
    for name, field in own.items():
        frames = encode(_denoise(), {"prompt_embeds": torch.randn(3, 8), name: _zeros(field)})
        with pytest.raises(WireError, match=f"carries no tensor '{name}'"):
            decode(frames)
        for b in BINDINGS.values():
            if name in declared[b.pipeline]:
                assert set(decode(frames, contract=b.contract)[1]) == {"prompt_embeds", name}
                decode_request = DecodeRequest(v=PROTOCOL_VERSION, request_id="c1", route=ROUTE, params=PARAMS)
                with pytest.raises(WireError, match=f"carries no tensor '{name}'"):
                    decode(encode(decode_request, {"latents": torch.randn(1, 4, 4, 4), name: _zeros(field)}),
                           contract=b.contract)
                wrong = {"prompt_embeds": torch.randn(3, 8), name: _zeros(field)[None]}
                with pytest.raises(WireError, match="rank"):
                    decode(encode(_denoise(), wrong), contract=b.contract)
            else:
                with pytest.raises(WireError, match=f"carries no tensor '{name}'"):
                    decode(frames, contract=b.contract)


def test_every_prompt_tensor_declares_its_negative_twin():
    """Classifier-free guidance sends the negative prompt's tensors under their twins' names, each declared."""
    from common.families import BINDINGS

    for b in BINDINGS.values():
        contract = b.contract.of(DenoiseRequest)
        assert all(contract[f.negative.name] == f.negative for f in b.text.fields), b.pipeline
        assert b.text.negatives() == {f.name: f"negative_{f.name}" for f in b.text.fields}


def test_a_contract_refuses_a_tensor_with_no_way():
    from common.protocol.contracts import WireContract
    from common.protocol.tensor_field import FLOAT_DTYPES, TensorField

    with pytest.raises(ValueError, match="'x': made by 'decode' and read by 'encoder'"):
        WireContract((TensorField("x", FLOAT_DTYPES, 2, made_by="decode", read_by="encoder"),))
    twice = TensorField("y", FLOAT_DTYPES, 2, made_by="encoder", read_by="denoise")
    with pytest.raises(ValueError, match="declared twice"):
        WireContract((twice, TensorField("y", FLOAT_DTYPES, 3, made_by="encoder", read_by="denoise")))


# ---------------------------------------------------------------- control kinds


def _controls() -> list:
    """One message of every control kind (requests and replies), each with its own fields set."""
    from common.protocol import control as c

    head = dict(v=PROTOCOL_VERSION, request_id="k1")
    answer = dict(head, role="denoise", index=1)
    tensors = [c.WeightTensor(name="w", dtype="float32", shape=[2], bucket=0, offset=0)]
    buckets = [c.WeightBucket(nbytes=8, segment="seg-1")]
    return [
        c.UpdateWeights(**head, module="transformer_2", path="/w/1", version=3, checksum=False),
        c.Checksum(**head, module="transformer"),
        c.UpdateWeightsFromTensors(**head, version=2, weight_tensors=tensors, weight_buckets=buckets),
        c.UpdateWeightsFromGroup(**head, weight_tensors=tensors, weight_buckets=[c.WeightBucket(nbytes=8)],
                                 lora_name="style-a", lora_rank=4, lora_alpha=8.0),
        c.InitWeightsGroup(**head, master_address="10.0.0.5", master_port=29600, world_size=3, rank=2,
                           backend="nccl", group_timeout_s=60.0),
        c.DestroyWeightsGroup(**head),
        c.LoadLora(**head, lora_name="style-a", version=1, lora_tensors=[c.LoraTensor(name="a.lora_A", shape=[4, 8])],
                   lora_rank=4, lora_alpha=4.0),
        c.UnloadLora(**head, lora_name="style-a"),
        c.ReleaseMemory(**head, level=2, abort=True),
        c.ResumeMemory(**head, reload="disk", version=4),
        c.WeightsReply(**answer, weight_version=3, load_s=0.5, sha256=None),
        c.ChecksumReply(**answer, weight_version=3, sha256="ab"),
        c.LoraReply(**answer, lora_name="style-a", lora_version=1, rank=4, scale=1.0, target_modules=["to_q"],
                    experts=["transformer"], sha256="cd"),
        c.UnloadLoraReply(**answer, lora_name="style-a"),
        c.GroupReply(**answer, rank=2, world_size=3, backend="gloo"),
        c.GroupDestroyedReply(**answer, group="none"),
        c.ReleaseReply(**answer, level=2, released_bytes=10, before={"rss": 20}, after={"rss": 10}),
        c.ResumeReply(**answer, level=0, after={"rss": 20}, weight_version=4, reloaded=["transformer"]),
        c.PinReference(**head),
        c.PinReply(**answer, weight_version=5, experts=["transformer", "transformer_2"], nbytes=64, pin_s=0.1),
    ]


def test_every_control_kind_round_trips_with_its_own_tag():
    from common.protocol.control import CONTROL_REPLIES, CONTROL_REQUESTS, kind_of

    messages = _controls()
    assert {type(m) for m in messages} == set(CONTROL_REQUESTS) | set(CONTROL_REPLIES)
    assert len({kind_of(m) for m in messages}) == len(messages)  # one wire kind each
    for msg in messages:
        blob = {"lora.blob": torch.randn(32)} if kind_of(msg) == "load_lora" else {}
        frames = encode(msg, blob)
        assert _header(frames)["kind"] == kind_of(msg)
        back, got = decode(frames)
        assert back == msgspec.structs.replace(msg, tensors=back.tensors) and set(got) == set(blob)


def test_every_control_request_names_the_replies_it_gets():
    from common.protocol.control import CONTROL_REPLIES, CONTROL_REQUESTS

    for kind in CONTROL_REQUESTS:
        assert kind.replies and set(kind.replies) <= set(CONTROL_REPLIES), kind.__name__


def _control_header(i: int) -> dict:
    return _header(encode(_controls()[i]))


@pytest.mark.parametrize("header, needle", [
    ({**_control_header(1), "path": "/w"}, "unknown field `path`"),  # a field of another kind
    ({**_control_header(7), "kind": "unload"}, "Invalid value 'unload'"),  # no such kind
    ({**_control_header(0), "kind": "checksum"}, "unknown field `path`"),  # another kind's tag
    ({k: v for k, v in _control_header(0).items() if k != "path"}, "missing required field `path`"),
    ({**_control_header(0), "path": ""}, "length >= 1"),
    ({**_control_header(0), "module": "vae"}, "Invalid enum value 'vae'"),
    ({**_control_header(4), "master_port": 70000}, "<= 65535"),
    ({**_control_header(4), "rank": 0}, ">= 1"),
    ({**_control_header(4), "world_size": 1}, ">= 2"),
    ({**_control_header(4), "group_timeout_s": 0}, "> 0"),
    ({**_control_header(6), "lora_name": "../up"}, "matching regex"),
    ({**_control_header(6), "lora_rank": 0}, ">= 1"),
    ({**_control_header(8), "level": 3}, "Invalid enum value 3"),
    ({**_control_header(9), "reload": "network"}, "Invalid enum value 'network'"),
    ({**_control_header(11), "sha256": 1}, "Expected `str`, got `int`"),
    ({**_control_header(16), "data": {}}, "unknown field `data`"),
], ids=["other-kinds-field", "unknown-kind", "wrong-tag", "missing-path", "empty-path", "module", "port", "rank",
        "world-size", "timeout", "lora-name", "lora-rank", "level", "reload", "reply-field-type", "old-reply-data"])
def test_control_headers_outside_their_kind_are_refused_naming_the_request(header, needle):
    with pytest.raises(WireError, match="invalid header") as e:
        decode([msgpack.packb(header)])
    assert needle in str(e.value) and e.value.request_id == "k1"


def test_only_an_adapter_load_carries_a_tensor():
    from common.protocol.control import Checksum, LoadLora

    blob = {"lora.blob": torch.randn(8)}
    load = LoadLora(v=PROTOCOL_VERSION, request_id="k1", lora_name="a")
    with pytest.raises(WireError, match="carries no tensor 'lora.blob'"):
        decode(encode(Checksum(v=PROTOCOL_VERSION, request_id="k1"), blob))
    with pytest.raises(WireError, match="dtype int64"):
        decode(encode(load, {"lora.blob": torch.ones(8).long()}))
    assert set(decode(encode(load, blob))[1]) == set(blob)
