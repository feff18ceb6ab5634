"""Releasing and resuming weights in process (common/runtime/component_memory.py), for every family's components.

Level 1 restores the same bytes (checksums equal) and keeps every parameter object; level 2 drops them and
a push (``materialize`` then ``load_into``) or a fresh load brings them back; a resume with neither is
``WeightsMissing`` and changes nothing. Each family's encoder, denoise and decode workers' weights are found
(the image encoder with the text encoder, every expert with the transformer) and come back exactly: the same
bytes, laid out as at the load (each in its own aligned storage), so every output is bit-identical.
"""

from __future__ import annotations

import pytest
import torch

from common.config.engine import EngineConfig, WorkerSpec
from common.diffusion.policy import Policy
from common.diffusion.weights import load_into, state_dict_checksum
from common.families import read_model
from common.builtin import ensure_builtin
from common.protocol.errors import WeightsMissing
from common.diffusion.weight_storage import ALIGN, unsettled, weight_tensors
from common.runtime.component_memory import ComponentMemory, ModuleMemory, modules_of
from family_harness import InProcess


def _module(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    m[1].running_mean.add_(torch.randn(16))  # a persistent buffer with values of its own
    m.register_buffer("scratch", torch.ones(3), persistent=False)
    return m


def _sums(modules: dict[str, torch.nn.Module]) -> dict[str, str]:
    return {name: state_dict_checksum(m) for name, m in modules.items()}


def test_level1_restores_the_same_bytes_into_the_same_parameters():
    m = _module()
    params = list(m.parameters())
    before = state_dict_checksum(m)
    mem = ModuleMemory(m)
    nbytes = mem.nbytes
    mem.release(1)
    assert not mem.present and all(p.numel() == 0 for p in m.parameters()) and mem.nbytes == nbytes
    assert m.scratch.numel() == 3  # not part of the weights: left alone
    mem.restore()
    assert state_dict_checksum(m) == before and all(a is b for a, b in zip(params, m.parameters()))


def test_a_module_taken_in_lies_as_a_push_will_lay_it():
    """Weights at odd offsets of one buffer (as a safetensors load leaves them in the mapped file) each get
    storage of their own, aligned, when a worker's memory takes the module: same values, same parameters."""
    m = _module()
    tensors = weight_tensors(m)
    buffer = torch.empty(sum(t.nbytes + ALIGN for t in tensors.values()), dtype=torch.uint8)
    at = 8  # never on a 16-byte boundary: 8 past one, then each tensor's bytes plus 4
    for t in tensors.values():
        t.data = buffer[at:at + t.nbytes].view(t.dtype).view(t.shape).copy_(t.data)
        at += t.nbytes + 4
    assert sorted(unsettled(m)) == sorted(tensors)
    params, before = list(m.parameters()), state_dict_checksum(m)
    ModuleMemory(m)
    assert unsettled(m) == [] and all(t.data_ptr() % ALIGN == 0 for t in weight_tensors(m).values())
    assert state_dict_checksum(m) == before and all(a is b for a, b in zip(params, m.parameters()))
    assert m.scratch.numel() == 3  # not a weight: left alone


def test_level2_drops_and_a_push_into_materialized_storage_restores():
    m, trainer = _module(), _module()
    mem = ModuleMemory(m)
    mem.release(2)
    with pytest.raises(RuntimeError):
        mem.restore()  # nothing kept
    mem.materialize()
    load_into(m, trainer.state_dict())
    assert mem.present and state_dict_checksum(m) == state_dict_checksum(trainer)


def test_level1_then_level2_drops_the_host_copies():
    mem = ModuleMemory(_module())
    mem.release(1)
    mem.release(2)
    mem.release(1)  # never back from 2 to 1
    assert mem.level == 2 and not mem._host


def test_a_resume_without_the_dropped_weights_changes_nothing():
    m = _module()
    c = ComponentMemory("vae", {"m": m}, lambda: {"m": _module()})
    c.release(2)
    with pytest.raises(WeightsMissing) as e:
        c.resume()
    assert (e.value.status, e.value.error_type) == (409, "weights_missing") and c.asleep and c.missing() == ["m"]
    c.resume(reload="disk")
    assert not c.asleep and state_dict_checksum(m) == state_dict_checksum(_module())


def test_a_pushed_module_is_kept_and_only_the_dropped_rest_reloads():
    a, b = _module(0), _module(1)
    reloads = []
    c = ComponentMemory("transformer", {"transformer": a, "transformer_2": b},
                        lambda: reloads.append(1) or {"transformer": _module(5), "transformer_2": _module(1)})
    c.release(2)
    c.modules["transformer"].materialize()
    load_into(a, _module(7).state_dict())  # the trainer's push of the first expert
    assert c.missing() == ["transformer_2"]
    c.resume(reload="disk")
    assert reloads == [1]
    assert state_dict_checksum(a) == state_dict_checksum(_module(7))  # the push, not the directory's
    assert state_dict_checksum(b) == state_dict_checksum(_module(1))


def test_modules_of_finds_the_top_modules_each_once():
    class Holder:
        def __init__(self):
            self.model = _module()
            self.inner = self.model[0]  # part of model
            self.name, self.nothing = "x", None

    class Pipe:
        def __init__(self, holder):
            self.text_encoder, self.tokenizer, self.holder = _module(), object(), holder

    h = Holder()
    found = modules_of({"text_encoder": Pipe(h), "images": None})
    assert set(found) == {"text_encoder.holder.model", "text_encoder.text_encoder"}


def _load_component(info, tag: str) -> dict[str, torch.nn.Module]:
    """What the worker of component ``tag`` makes it from, loaded the way its stage loads it."""
    family, dtype, cpu = info.family, torch.float32, torch.device("cpu")
    if tag == "transformer":
        return Policy.load(info, dtype, cpu).experts
    if tag == "text_encoder":
        images = family.condition.load(info, dtype, cpu) if family.condition.image_input(info) is not None else None
        return modules_of({"text_encoder": family.text.load_encoder(info, dtype, cpu), "images": images})
    return modules_of({"decoder": family.decoder.load(info, dtype, cpu)})


@pytest.fixture(scope="module", autouse=True)
def _threads():
    threads = torch.get_num_threads()  # _outputs and the forwards change it
    yield
    torch.set_num_threads(threads)


def _outputs(engine: InProcess, image) -> dict[str, torch.Tensor]:
    """What each component computes for one request: its text (and image) wire tensors, its latents after
    every step (each expert's forwards, with guidance), the frames decoded from them."""
    p = engine.params(num_inference_steps=3, height=32, width=32)
    # One thread count for every call (the forwards set one: an edit model's VAE encode rounds by it).
    torch.set_num_threads(1)
    seen = () if image is None or not engine.family.condition.text_sees_images() else ([[image]] * 2,)
    texts = engine.encoder.wire_tensors([p.prompt, p.negative_prompt], p.max_sequence_length, *seen)
    out = {f"text{i}.{k}": t for i, wire in enumerate(texts) for k, t in wire.items()}
    out.update({f"image.{k}": t for k, t in engine.image_wire(p, image).items()})
    out["latents"] = engine.run(p, image=image).latents
    out["frames"] = engine.frames(out["latents"], p)
    return out


def _unsettled(components) -> dict[str, list[str]]:
    return {f"{tag}.{name}": bad for tag, modules in components.items() for name, m in modules.items()
            if (bad := unsettled(m))}

def assert_sleep_cycles(info, components: dict[str, dict], outputs) -> None:
    """Level 1; level 2 and a push of the trainer's load of the same checkpoint (the transformer, the encoder's
    and decoder's reloaded); level 2 reloaded from disk: each time every weight (parameter or persistent buffer)
    released, then the same checksums, every weight laid out as a fresh load's, and ``outputs()`` (name ->
    tensor) equal to those before, bit for bit."""
    before, sums = outputs(), {tag: _sums(modules) for tag, modules in components.items()}
    memory = {tag: ComponentMemory(tag, modules, lambda tag=tag: _load_component(info, tag))
              for tag, modules in components.items()}
    trainer = Policy.load(info, torch.float32, "cpu").experts
    for level, how in ((1, "restore"), (2, "push"), (2, "disk")):
        for c in memory.values():
            assert c.release(level) == sum(m.nbytes for m in c.modules.values())
        assert all(t.numel() == 0 for modules in components.values() for m in modules.values()
                   for t in weight_tensors(m).values()), how
        if how == "push":
            for name, m in memory["transformer"].modules.items():
                m.materialize()
                load_into(m.module, trainer[name].state_dict())
        for c in memory.values():
            c.resume(reload="disk" if level == 2 else None)
        assert {tag: _sums(modules) for tag, modules in components.items()} == sums, how
        assert _unsettled(components) == {}, how
        after = outputs()
        assert [k for k in before if not torch.equal(after[k], before[k])] == [], how



@pytest.mark.parametrize("model", ["tiny", "tiny-sd3", "tiny-flux", "tiny-qwen-image", "tiny-sana", "tiny-wan-i2v",
                                   "tiny-wan-i2v-a14b",
                                   # ~20 s; its classes are tiny-qwen-image's (the processor aside)
                                   pytest.param("tiny-qwen-image-edit", marks=pytest.mark.heavy)])
def test_every_family_is_bit_identical_after_a_release_and_a_resume_or_a_push(model):
    """Level 1; level 2 and a push of the trainer's load of the same checkpoint (the transformer, the encoder's
    and decoder's reloaded); level 2 reloaded from disk: each time the same checksums, every weight laid out
    as a fresh load's (its own 64-byte aligned storage: kernels round by alignment), and outputs equal to
    those before, bit for bit."""
    from test_wan_i2v import picture

    engine = InProcess(ensure_builtin(model))
    info = engine.info
    components = {"transformer": engine.policy.experts,
                  "text_encoder": modules_of({"text_encoder": engine.encoder, "images": engine.images}),
                  "vae": modules_of({"decoder": engine.decoder})}
    if model == "tiny-wan-i2v":  # the image encoder and the VAE's encoder half go with the text encoder
        kinds = {type(m).__name__ for m in components["text_encoder"].values()}
        assert {"CLIPVisionModel", "AutoencoderKLWan"} <= kinds
    if model == "tiny-wan-i2v-a14b":
        assert set(components["transformer"]) == {"transformer", "transformer_2"}
    # A fresh load lies as a push will (the experts: Policy.load; the encoders and the VAE as the workers'
    # memory lays them out: tests/family_harness.py)
    assert _unsettled(components) == {}
    image = picture(40, 24, 1) if info.family.condition.image_input(info) is not None else None
    assert_sleep_cycles(info, components, lambda: _outputs(engine, image))


def test_a_fresh_stage_reload_takes_the_same_weights(tiny_dir, tmp_path):
    """The encoder and decode stages reload from disk by loading a fresh copy of themselves."""
    from decode_worker.stage import DecodeStage

    config = EngineConfig(model=str(tiny_dir), runtime_dir=str(tmp_path), router_endpoint="ipc://unused",
                          workers=[WorkerSpec("decode", 0)])
    stage = DecodeStage(config, config.workers[0])
    stage.load()
    before = _sums({n: m.module for n, m in stage.memory.modules.items()})
    stage.memory.release(2)
    stage.memory.resume(reload="disk")
    assert _sums({n: m.module for n, m in stage.memory.modules.items()}) == before


def test_the_sleep_endpoints_need_the_admin_key_and_is_sleeping_does_not():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from router.api.auth import ApiKeyMiddleware

    app = FastAPI()
    for path in ("/release_memory_occupation", "/resume_memory_occupation", "/sleep", "/wake_up"):
        app.add_api_route(path, lambda: {"ok": True}, methods=["POST"])
    app.add_api_route("/is_sleeping", lambda: {"ok": True}, methods=["GET"])
    app.add_middleware(ApiKeyMiddleware, api_key="api-" + "k" * 16, admin_key="admin-" + "k" * 16)
    http = TestClient(app)
    api, admin = ({"authorization": f"Bearer {k}-{'k' * 16}"} for k in ("api", "admin"))
    for path in ("/release_memory_occupation", "/resume_memory_occupation", "/sleep", "/wake_up"):
        assert http.post(path, headers=api).status_code == 403
        assert http.post(path, headers=admin).status_code == 200
    assert http.get("/is_sleeping", headers=api).status_code == 200
    assert http.get("/is_sleeping").status_code == 401



class _Dispatcher:
    """What SleepControl uses of the dispatcher, with workers that answer as ``fail`` says."""

    def __init__(self, fail: set[str] = frozenset()):
        from router.link.join import PendingTable
        from router.link.registry import WorkerRegistry

        self.config = EngineConfig(model="m", runtime_dir="/tmp", router_endpoint="ipc://x",
                                   workers=[WorkerSpec(r, 0) for r in ("encoder", "denoise", "decode")])
        self.registry = WorkerRegistry(self.config.workers, 10.0)
        self.pending = PendingTable()
        self.fail, self.sent = fail, []

    async def control(self, role, op, only=None, **fields):
        from common.protocol.control import ReleaseMemory, ReleaseReply, ResumeReply
        from common.protocol.messages import PROTOCOL_VERSION
        from router.core.errors import EngineError

        self.sent.append((role, op, fields))
        if role in self.fail:
            return [EngineError(500, "RuntimeError", "boom", role, "x")]
        header = dict(v=PROTOCOL_VERSION, request_id="x", role=role, index=0)
        if op is ReleaseMemory:
            return [ReleaseReply(**header, level=fields["level"], released_bytes=1, before={}, after={})]
        return [ResumeReply(**header, level=0, after={})]


def test_sleep_control_keeps_what_each_release_did_and_refuses_a_resume_without_weights():
    import asyncio

    from common.protocol.control import ResumeMemory
    from router.control.weights import WeightControl
    from router.core.errors import EngineError
    from router.control.sleep import SleepControl, components_of

    every = components_of(["weights"])

    async def body():
        d = _Dispatcher(fail={"decode"})
        weights = WeightControl(lambda role, op, **f: d.control(role, op, **f))
        sleep = SleepControl(d, weights, ("transformer", "transformer_2"))
        with pytest.raises(EngineError):
            await sleep.release(["text_encoder", "vae"], level=1)
        assert sleep.levels == {"text_encoder": 1}  # the encoder did sleep; the decode worker serves on
        assert d.registry.asleep("encoder") and not d.registry.asleep("decode")
        d.fail = set()
        await sleep.release(["transformer"], level=2)
        sent = len(d.sent)
        with pytest.raises(EngineError) as e:
            await sleep.resume(every)
        assert (e.value.status, e.value.type) == (409, "weights_missing") and "transformer_2" in e.value.message
        assert len(d.sent) == sent and sleep.levels == {"text_encoder": 1, "transformer": 2}  # nothing sent
        sleep.supplied("transformer")
        sleep.supplied("transformer_2")  # both experts pushed
        out = await sleep.resume(every)
        assert out["resumed"] == ["transformer", "text_encoder"] and not out["is_sleeping"]
        assert weights.version == 0 and not d.registry.asleep("denoise")
        await sleep.release(["transformer"], level=2)
        out = await sleep.resume(["transformer"], reload="disk")  # the model directory's weights: a new version
        assert out["weight_version"] == weights.version == 1
        assert d.sent[-1] == ("denoise", ResumeMemory, {"reload": "disk", "version": 1})

    asyncio.run(body())
