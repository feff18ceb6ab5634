"""Weight sync from the trainer's memory: shared-memory buckets (one host) and a gloo weights group.

After each path the engine's checksum equals the trainer's and its outputs equal a fresh engine started
from those weights; refused and broken-off updates change nothing and the engine keeps serving.
Z-Image, FLUX.2 [klein] and HunyuanVideo 1.5 (heavy): an update from disk and one from memory each change
the answer, and the original weights give the first answer back bit for bit.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from diffusers import WanTransformer3DModel

from common.protocol.control import WeightTensor
from common.runtime.engine_process import ROOT, free_port
from common.transport import weight_segments
from common.diffusion import weight_buckets
from common.diffusion.weights import state_dict_checksum
from rl import TrainerPolicy, WeightsGroup
from rl.lora import add_lora, lora_parameters, lora_sha256, lora_state_dict, push_lora
from router.client import EngineClient, EngineHTTPError

REQ = dict(prompt="a lighthouse at dusk", seed=4, num_inference_steps=4, guidance_scale=4.0, output_type="latent")


def _trainer_copy(tiny_dir, seed: int, scale: float = 0.05) -> WanTransformer3DModel:
    model = WanTransformer3DModel.from_pretrained(tiny_dir / "transformer").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


@pytest.fixture(scope="module")
def engine(engine_factory):
    return engine_factory("tiny", extra=["--weight-sync-from-memory"])


@pytest.fixture(scope="module")
def client(engine):
    with EngineClient(engine.url) as c:
        yield c


def _output(client) -> torch.Tensor:
    return client.generate(**REQ)["samples"][0]["output"]


def _fresh_engine_output(engine_factory, tiny_dir, tmp_path, model) -> torch.Tensor:
    """The same request on an engine started from a model directory holding ``model``'s weights."""
    d = tmp_path / "model"
    shutil.copytree(tiny_dir, d)
    shutil.rmtree(d / "transformer")
    model.save_pretrained(d / "transformer")
    fresh = engine_factory(str(d))
    try:
        with EngineClient(fresh.url) as c:
            return _output(c)
    finally:
        fresh.stop()


def test_bucket_layout_round_trip():
    g = torch.Generator().manual_seed(0)
    named = [("a", torch.randn(3, 5, generator=g)), ("b", torch.randn(7, generator=g).to(torch.bfloat16)),
             ("c", torch.arange(11, dtype=torch.int64)), ("empty", torch.zeros(0, 4)), ("scalar", torch.tensor(2.5)),
             ("big", torch.randn(300, generator=g)), ("d", torch.ones(2, 2, dtype=torch.float16))]
    entries, sizes = weight_buckets.plan(named, bucket_bytes=256)
    assert len(sizes) > 2 and all(n <= 256 for n in sizes if n != 1200)
    assert max(sizes) == 1200  # a tensor larger than a bucket gets one of its own
    assert all(e.offset % weight_buckets.ALIGN == 0 for e in entries)
    buffers = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    weight_buckets.pack_into(buffers, entries, dict(named))
    back = weight_buckets.unpack(buffers, entries)
    assert list(back) == [n for n, _ in named]
    for name, t in named:
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name


@pytest.mark.parametrize("entry, needle", [
    (WeightTensor(name="x", dtype="float32", shape=[100], bucket=0, offset=0), "do not fit"),
    (WeightTensor(name="x", dtype="float32", shape=[1], bucket=3, offset=0), "bucket 3 of 1"),
    (WeightTensor(name="x", dtype="float32", shape=[1], bucket=0, offset=4), "aligned"),
    (WeightTensor(name="x", dtype="complex64", shape=[1], bucket=0, offset=0), "unknown dtype"),
])
def test_bucket_layout_refuses_what_does_not_fit(entry, needle):
    with pytest.raises(weight_buckets.LayoutError, match=needle):
        weight_buckets.unpack([torch.zeros(64, dtype=torch.uint8)], [entry])
    twice = WeightTensor(name="x", dtype="uint8", shape=[1], bucket=0, offset=0)
    with pytest.raises(weight_buckets.LayoutError, match="named twice"):
        weight_buckets.unpack([torch.zeros(64, dtype=torch.uint8)], [twice, twice])


def test_worker_keeps_its_mappings_while_the_segments_stay_the_same():
    prefix = weight_segments.weight_prefix(f"disagg-{os.getpid():08x}-")
    written = weight_segments.WrittenBuckets(prefix, [4096, 64])
    mapped = weight_segments.MappedBuckets(prefix)
    try:
        written.buffers[0].fill_(1)
        first = mapped.open(written.buckets())
        assert int(first[0].sum()) == 4096 and [v.numel() for v in first] == [4096, 64]
        written.buffers[0].fill_(2)  # the trainer's next update, in the same segments
        again = mapped.open(written.buckets())
        assert again[0].data_ptr() == first[0].data_ptr() and int(again[0].sum()) == 2 * 4096
        # The same name for another file (removed and made again): mapped anew, never the old pages.
        name = written.names[0]
        os.unlink("/dev/shm/" + name)
        fd = os.open("/dev/shm/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, bytes([3]) * 4096)
        os.close(fd)
        replaced = mapped.open(written.buckets())
        assert int(replaced[0].sum()) == 3 * 4096
        del first, again, replaced
        other = weight_segments.WrittenBuckets(prefix, [128])
        try:
            assert mapped.open(other.buckets())[0].numel() == 128
            assert sorted(mapped._maps) == other.names  # the first update's mappings are gone
        finally:
            other.close()
        assert mapped.prune() == 1 and not mapped._maps  # its file was removed: unmapped when idle
    finally:
        mapped.close()
        written.close()


def test_off_without_the_flag(shared_engine):
    off = shared_engine("tiny")  # its refusals change nothing
    with EngineClient(off.url) as c:
        assert c.weight_sync_info()["enabled"] is False
        for path, body in (("/update_weights_from_tensors", {"tensors": [], "buckets": []}),
                           ("/init_weights_group", {"master_address": "127.0.0.1", "master_port": 1}),
                           ("/destroy_weights_group", {})):
            r = off.http.post(path, json=body)
            assert r.status_code == 403 and "--weight-sync-from-memory" in r.json()["error"]["message"], path
        t0 = time.monotonic()
        with pytest.raises(EngineHTTPError) as e:  # refused at once, not after the group's timeout
            WeightsGroup(c, "127.0.0.1", free_port(), timeout_s=5).open()
        assert e.value.status == 403 and time.monotonic() - t0 < 4


@pytest.mark.heavy  # a second engine; the gloo push covers sync from memory
def test_shared_memory_update_equals_a_fresh_engine_on_those_weights(client, engine_factory, tiny_dir, tmp_path):
    before = client.weights_checksum()
    new = _trainer_copy(tiny_dir, seed=1)
    prefix = client.weight_sync_info()["shm_prefix"]
    with EngineClient(client.base_url) as trainer:
        trainer.update_weights_from_tensors(_trainer_copy(tiny_dir, seed=8), bucket_bytes=64 << 10)
        reply = trainer.update_weights_from_tensors(new, bucket_bytes=64 << 10)  # many buckets, the same ones again
        assert [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]  # kept for the next update
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]  # removed with the client
    assert reply["sha256"] == state_dict_checksum(new)
    assert reply["weight_version"] == before["weight_version"] + 2
    ck = client.weights_checksum()
    assert ck["sha256"] == state_dict_checksum(new) and ck["weight_version"] == reply["weight_version"]
    sample = client.generate(**REQ)["samples"][0]
    assert sample["weight_version"] == reply["weight_version"]
    assert (sample["output"] - _fresh_engine_output(engine_factory, tiny_dir, tmp_path, new)).abs().max() == 0.0


@pytest.mark.parametrize("spoil", ["name", "shape", "dtype", "nan", "missing"])
def test_a_wrong_update_changes_nothing(client, tiny_dir, spoil):
    before, out = client.weights_checksum(), _output(client)
    state = {k: v.clone() for k, v in _trainer_copy(tiny_dir, seed=2).state_dict().items()}
    key = sorted(state)[0]
    if spoil == "name":
        state["not.a.parameter"] = state.pop(key)
    elif spoil == "shape":
        state[key] = torch.zeros(3, 3)
    elif spoil == "dtype":
        state[key] = state[key].to(torch.int32)
    elif spoil == "nan":
        state[key][...] = float("nan")
    else:
        del state[key]
    with pytest.raises(EngineHTTPError) as e:
        client.update_weights_from_tensors(state)
    assert e.value.status == 400
    after = client.weights_checksum()
    assert after["sha256"] == before["sha256"] and after["weight_version"] == before["weight_version"]
    assert torch.equal(_output(client), out)


def test_segments_outside_this_engine_are_refused(client, engine):
    d = client.weight_sync_info()
    token = "0" * 32
    for name in ("disagg-00000000-weights-" + token, d["shm_prefix"] + "x" * 32, "etc-passwd"):
        r = engine.http.post("/update_weights_from_tensors", json={
            "tensors": [{"name": "a", "dtype": "float32", "shape": [1], "bucket": 0, "offset": 0}],
            "buckets": [{"nbytes": 4, "segment": name}]})
        assert r.status_code == 400 and "weight" in r.json()["error"]["message"], (name, r.text)


@pytest.mark.parametrize("cuda, needle", [
    ({"device": 0, "handle": "AQI=", "storage_bytes": 4, "offset_bytes": 0, "ref_counter": "/torch_1_2",
      "ref_counter_offset": 0, "event": None, "event_sync": False}, "GPUs"),  # a CPU engine opens no handle
    ({"device": 0, "handle": "AQI=", "storage_bytes": 4, "offset_bytes": 0, "ref_counter": "/etc/passwd",
      "ref_counter_offset": 0}, "ref_counter"),
    ({"device": 0, "handle": "not base64 !", "storage_bytes": 4, "offset_bytes": 0, "ref_counter": "/torch_1_2",
      "ref_counter_offset": 0}, "buckets"),
])
def test_hostile_cuda_handles_are_refused(client, engine, cuda, needle):
    before = client.weights_checksum()
    r = engine.http.post("/update_weights_from_tensors", json={
        "tensors": [{"name": "a", "dtype": "float32", "shape": [1], "bucket": 0, "offset": 0}],
        "buckets": [{"nbytes": 4, "cuda": cuda}]})
    assert r.status_code == 400 and needle in r.text, r.text
    assert client.weights_checksum() == before


def test_gloo_group_broadcast_equals_the_trainer(client, engine_factory, tiny_dir, tmp_path):
    with WeightsGroup(client, "127.0.0.1", free_port(), timeout_s=60, bucket_bytes=32 << 10) as group:
        assert client.weight_sync_info()["group"] is True
        for seed in (3, 4):  # twice over one group
            new = _trainer_copy(tiny_dir, seed=seed)
            reply = group.push(new)
            assert reply["sha256"] == state_dict_checksum(new)
            assert client.weights_checksum()["sha256"] == state_dict_checksum(new)
        with pytest.raises(EngineHTTPError) as e:  # a wrong update over the group: all received, none applied
            group.push({"not.a.parameter": torch.zeros(4)})
        assert e.value.status == 400
        assert client.weights_checksum()["sha256"] == state_dict_checksum(new)
        assert group.push(new)["sha256"] == state_dict_checksum(new)  # the group still works
    assert client.weight_sync_info()["group"] is False
    assert (_output(client) - _fresh_engine_output(engine_factory, tiny_dir, tmp_path, new)).abs().max() == 0.0


TRAINER_DIES = textwrap.dedent("""
    import os, sys, threading, torch
    sys.path.insert(0, {root!r})
    from diffusers import WanTransformer3DModel
    from common.transport import weights_group
    from rl import WeightsGroup
    from router.client import EngineClient

    client = EngineClient({url!r})
    group = WeightsGroup(client, "127.0.0.1", {port}, timeout_s=20, bucket_bytes=16 << 10)
    group.open()
    sent = []
    real = group.pg.broadcast
    def broadcast(tensors, opts):  # the trainer dies after its third bucket
        if len(sent) == 3:
            os._exit(0)
        sent.append(1)
        return real(tensors, opts)
    group.pg = type("P", (), {{"broadcast": staticmethod(broadcast)}})()
    model = WanTransformer3DModel.from_pretrained({model!r})
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    group.push(model)
""")


def test_a_trainer_killed_mid_broadcast_leaves_the_old_weights(client, engine, tiny_dir):
    before, out = client.weights_checksum(), _output(client)
    script = TRAINER_DIES.format(root=str(ROOT), url=engine.url, port=free_port(),
                                 model=str(tiny_dir / "transformer"))
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-c", script], timeout=120, check=True)
    deadline = time.monotonic() + 60
    while client.weight_sync_info()["group"] and time.monotonic() < deadline:
        time.sleep(0.2)  # the workers notice the broken broadcast, the router drops the group
    after = client.weights_checksum()
    assert after["sha256"] == before["sha256"] and after["weight_version"] == before["weight_version"]
    assert torch.equal(_output(client), out)  # still serving, on the old weights
    assert time.monotonic() - t0 < 90
    # A new group works afterwards.
    new = _trainer_copy(tiny_dir, seed=9)
    with WeightsGroup(client, "127.0.0.1", free_port(), timeout_s=60) as group:
        assert group.push(new)["sha256"] == state_dict_checksum(new)


def _lora_policy(tiny_dir, seed: int):
    policy = TrainerPolicy(tiny_dir)
    add_lora(policy, 4, 8.0, seed=0)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:  # peft starts lora_B at zero: the adapter would be the base model
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return policy


def test_adapters_through_shared_memory_and_a_group_equal_the_http_push(client, tiny_dir):
    before, base = client.weights_checksum(), _output(client)
    policy = _lora_policy(tiny_dir, seed=1)
    answers = {"via-http": push_lora(client, policy, "via-http"),
               "via-shm": push_lora(client, policy, "via-shm", via="shm")}
    with WeightsGroup(client, "127.0.0.1", free_port(), timeout_s=60, bucket_bytes=8 << 10) as group:
        answers["via-group"] = push_lora(client, policy, "via-group", via=group)
    assert {a["sha256"] for a in answers.values()} == {lora_sha256(policy)}
    outputs = {name: client.generate(**REQ, lora_name=name)["samples"][0]["output"] for name in answers}
    assert (outputs["via-http"] - base).abs().max() > 1e-3  # the adapter changes the output
    assert torch.equal(outputs["via-shm"], outputs["via-http"]) and torch.equal(outputs["via-group"], outputs["via-http"])
    assert client.weights_checksum() == before  # adapters leave the weights and their version alone
    # The worker holds its own copy: the trainer rewriting its buckets changes nothing until the next push.
    for written in client._buckets.values():
        for b in written.buffers:
            b.fill_(0)
    assert torch.equal(client.generate(**REQ, lora_name="via-shm")["samples"][0]["output"], outputs["via-shm"])
    # The next training step, pushed again the same way: a new version that equals the same step over HTTP.
    with torch.no_grad():
        for p in lora_parameters(policy):
            p.mul_(1.5)
    again = push_lora(client, policy, "via-shm", via="shm")
    assert again["lora_version"] == answers["via-shm"]["lora_version"] + 1 and again["sha256"] == lora_sha256(policy)
    push_lora(client, policy, "via-http")
    s = client.generate(**REQ, lora_name="via-shm")["samples"][0]
    assert s["lora_version"] == again["lora_version"]
    assert torch.equal(s["output"], client.generate(**REQ, lora_name="via-http")["samples"][0]["output"])
    for name in answers:
        client.unload_lora_adapter(name)


def test_a_wrong_adapter_from_memory_is_refused(client, tiny_dir):
    policy = _lora_policy(tiny_dir, seed=2)
    state = lora_state_dict(policy)
    bad = {**state, "blocks.0.attn1.to_q.lora_A.weight": torch.zeros(3, 999)}
    with pytest.raises(EngineHTTPError) as e:
        client.update_weights_from_tensors(bad, lora={"lora_name": "bad", "rank": 4, "alpha": 8.0})
    assert e.value.status == 400
    assert "bad" not in [a["lora_name"] for a in client.lora_adapters()]


@pytest.mark.heavy  # it kills a launched engine's denoise worker: CI
def test_a_restarted_worker_is_stale_until_the_trainer_pushes_again(engine_factory, tiny_dir):
    engine = engine_factory("tiny", extra=["--weight-sync-from-memory"], launched=True)
    client = EngineClient(engine.url)
    new = _trainer_copy(tiny_dir, seed=5)
    version = client.update_weights_from_tensors(new)["weight_version"]
    policy = _lora_policy(tiny_dir, seed=3)
    push_lora(client, policy, "pushed", via="shm")
    pid = next(w["pid"] for w in client.health()["workers"] if w["role"] == "denoise")
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        d = next(w for w in engine.http.get("/health").json()["workers"] if w["role"] == "denoise")
        if d["pid"] not in (None, pid) and d["state"] == "stale":
            break
        assert time.monotonic() < deadline, f"no stale restarted worker: {d}"
        time.sleep(0.1)
    assert d["weights"] == "stale" and d["missing"] == ["lora:pushed", "transformer"]
    assert engine.http.get("/health").status_code == 503
    r = engine.http.post("/generate", json=REQ)
    assert r.status_code == 503  # no request runs on weights the trainer did not send
    reply = client.update_weights_from_tensors(new)
    assert reply["weight_version"] == version + 1 and reply["sha256"] == state_dict_checksum(new)
    d = next(w for w in engine.http.get("/health").json()["workers"] if w["role"] == "denoise")
    assert d["state"] == "stale" and d["missing"] == ["lora:pushed"]  # the adapter is still only the trainer's
    assert push_lora(client, policy, "pushed", via="shm")["sha256"] == lora_sha256(policy)
    d = next(w for w in client.health()["workers"] if w["role"] == "denoise")
    assert d["state"] == "ready" and d["weights"] == "current" and d["missing"] == []
    assert client.generate(**REQ)["samples"][0]["weight_version"] == version + 1


# Each family's request (the families' own fields; FLUX.2 [klein]'s negative is the empty prompt).
FAMILY_REQ = {
    "tiny-z-image": dict(REQ, negative_prompt="blurry", num_inference_steps=3),
    "tiny-flux2-klein": dict(REQ, num_inference_steps=3, height=48, width=64),
    "tiny-hunyuan-video15": dict(REQ, negative_prompt="blurry", num_inference_steps=3, num_frames=5),
}


@pytest.mark.heavy  # an engine per family
@pytest.mark.parametrize("model", list(FAMILY_REQ))
def test_each_family_updates_from_disk_and_memory_and_the_originals_give_the_first_answer(
        model, engine_factory, tmp_path, record_property):
    """An update from a checkpoint on disk, then one from the trainer's memory, each change the answer; the
    original weights pushed back give the first answer bit for bit."""
    from common.builtin import ensure_builtin
    from common.diffusion.weights import save_weights

    original = TrainerPolicy(ensure_builtin(model)).transformer.state_dict()

    def changed(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in original.items()}

    engine = engine_factory(model, extra=["--weight-root", str(tmp_path), "--weight-sync-from-memory"])
    req = FAMILY_REQ[model]
    with EngineClient(engine.url) as client:
        def output() -> torch.Tensor:
            return client.generate(**req)["samples"][0]["output"]

        base = output()
        new = changed(1)
        save_weights(new, tmp_path / "step-1")
        assert client.update_weights_from_disk(str(tmp_path / "step-1"))["sha256"] == state_dict_checksum(new)
        from_disk = output()
        other = changed(2)
        assert client.update_weights_from_tensors(other)["sha256"] == state_dict_checksum(other)
        from_memory = output()
        assert client.update_weights_from_tensors(original)["sha256"] == state_dict_checksum(original)
        restored = output()
    diffs = {name: (run - base).abs().max().item() for name, run in (("disk", from_disk), ("memory", from_memory))}
    diffs["memory-vs-disk"] = (from_memory - from_disk).abs().max().item()
    record_property("diffs", diffs)
    assert min(diffs.values()) > 1e-3, diffs
    assert torch.equal(restored, base)  # bit for bit
