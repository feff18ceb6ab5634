"""SGLang diffusion's weight, checksum, group and memory routes on an engine of this module's own (they change
its weights): as sglang 0.5.23's ``test_update_weights_from_disk.py`` drives them, with its checksum formula
(``compute_weights_checksum``) computed here from the files and tensors a trainer holds.

One engine, started with ``--peer-api sglang``: its bare release / resume keep the weights, as SGLang's.
"""

from __future__ import annotations

import hashlib
import shutil
import threading

import httpx
import msgpack
import pytest
import torch
from safetensors.torch import load_file, save_file

from common.transport import weights_group
from router.peers.sglang.sender import SGLangWeightSender
from test_peer_sglang import read
from test_weight_sync_memory import free_port


def sglang_checksum(named) -> str:
    """SGLang's ``compute_weights_checksum``, restated: name order, each name's bytes then the raw bytes."""
    h = hashlib.sha256()
    for name, t in sorted(named, key=lambda item: item[0]):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().data)
    return h.hexdigest()


def disk_checksum(folder) -> str:
    return sglang_checksum(load_file(next(folder.glob("*.safetensors"))).items())


@pytest.fixture(scope="module")
def setup(engine_factory, tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("weights")
    engine = engine_factory("tiny", extra=["--weight-root", str(root), "--weight-sync-from-memory",
                                           "--peer-api", "sglang"])
    return engine, root


def _post(url, path, body=None):
    return httpx.post(url + path, json=body if body is not None else {}, timeout=120)


def _sample(url) -> torch.Tensor:
    r = _post(url, "/rollout/generate", {"prompt": "a fox", "seed": 2, "num_inference_steps": 2,
                                         "generator_device": "cpu"})
    assert r.status_code == 200, r.text
    return read(msgpack.unpackb(r.content))[0]["generated_output"]


def _perturbed(tiny_dir, root, name: str, delta: float):
    """A model directory below the weight root whose transformer differs from the served one."""
    model = root / name
    shutil.copytree(tiny_dir / "transformer", model / "transformer")
    file = next((model / "transformer").glob("*.safetensors"))
    weights = {k: v + delta for k, v in load_file(file).items()}
    save_file(weights, file)
    return model


def test_checksums_updates_from_disk_and_refusals(setup, tiny_dir):
    engine, root = setup
    url = engine.url
    before = _post(url, "/get_weights_checksum").json()
    assert before == {"transformer": disk_checksum(tiny_dir / "transformer")}
    assert _post(url, "/get_weights_checksum", {"module_names": ["transformer", "vae", "nope"]}).json() == {
        "transformer": before["transformer"], "vae": "not_found", "nope": "not_found"}
    out = _sample(url)

    model = _perturbed(tiny_dir, root, "step-1", 0.01)
    r = _post(url, "/update_weights_from_disk", {"model_path": str(model), "flush_cache": True})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert _post(url, "/get_weights_checksum").json()["transformer"] == disk_checksum(model / "transformer")
    assert not torch.equal(_sample(url), out)

    for body, status, needle in (
            ({}, 400, "model_path is required"),
            ({"model_path": str(model), "target_modules": ["nonexistent_module"]}, 400, "not found in pipeline"),
            ({"model_path": str(model), "target_modules": ["vae"]}, 400, "transformer experts only"),
            ({"model_path": str(root / "absent")}, 400, "missing weight files"),
            ({"model_path": str(tiny_dir)}, 400, "outside the allowed weight directories")):
        r = _post(url, "/update_weights_from_disk", body)
        assert r.status_code == status and r.json()["success"] is False and needle in r.json()["message"], r.text
    assert _post(url, "/get_weights_checksum").json()["transformer"] == disk_checksum(model / "transformer")

    back = _post(url, "/sglang/update_weights_from_disk", {"model_path": str(model.parent / "step-0")})
    assert back.status_code == 400
    shutil.copytree(tiny_dir / "transformer", root / "step-0" / "transformer")
    r = _post(url, "/sglang/update_weights_from_disk", {"model_path": str(root / "step-0"),
                                                        "target_modules": ["transformer"]})
    assert r.status_code == 200 and r.json()["success"], r.text
    assert torch.equal(_sample(url), out)  # the served weights again: the same samples bit for bit


def test_a_bare_release_and_resume_keep_the_weights(setup):
    """SGLang's sequence: ``{}`` then ``{}`` (level 1 here), the engine answering as before bit for bit."""
    url = setup[0].url
    out = _sample(url)
    released = _post(url, "/release_memory_occupation", {})
    assert released.status_code == 200 and released.json() == {
        "success": True, "sleeping": True, "message": "released GPU memory (moved active modules to CPU)"}
    assert _post(url, "/release_memory_occupation").json()["message"] == "already sleeping"
    resumed = _post(url, "/resume_memory_occupation", {})
    assert resumed.status_code == 200 and resumed.json()["success"] is True and resumed.json()["sleeping"] is False
    assert _post(url, "/resume_memory_occupation").json()["message"] == "already awake"
    assert torch.equal(_sample(url), out)


def test_a_weights_group_with_one_broadcast_per_tensor(setup, tiny_dir):
    """SGLang's trainer: a gloo group (rank 0 hosts the store), then one broadcast per tensor in its own dtype
    after ``/update_weights_from_distributed`` names them; the served weights are then the trainer's."""
    url = setup[0].url
    port = free_port()
    assert _post(url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                     "rank_offset": 1, "world_size": 3,
                                                     "backend": "gloo"}).json()["error"]["field"] == "world_size"
    group = {}

    def trainer_joins():
        store = weights_group.store("127.0.0.1", port, 2, True, 60)
        group["pg"] = weights_group.new_group(store, 0, 2, "gloo", 60)
        group["store"] = store

    t = threading.Thread(target=trainer_joins)
    t.start()
    r = _post(url, "/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": port,
                                                  "rank_offset": 1, "world_size": 2, "backend": "gloo"})
    t.join(60)
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    new = {k: (v * 1.5).to(torch.bfloat16).float() if k.endswith("bias") else v * 1.5
           for k, v in load_file(next((tiny_dir / "transformer").glob("*.safetensors"))).items()}
    names = sorted(new)
    body = {"names": names, "dtypes": [str(new[n].dtype) for n in names], "shapes": [list(new[n].shape) for n in names]}
    answer = {}
    t = threading.Thread(target=lambda: answer.update(r=_post(url, "/update_weights_from_distributed", body)))
    t.start()
    for n in names:  # as SGLang's trainers broadcast: each tensor as it is, in order
        group["pg"].broadcast([new[n].contiguous()], weights_group.broadcast_options(0)).wait()
    t.join(120)
    assert answer["r"].status_code == 200 and answer["r"].json()["success"] is True, answer["r"].text
    assert _post(url, "/get_weights_checksum").json()["transformer"] == sglang_checksum(new.items())
    assert _post(url, "/destroy_weights_update_group", {"group_name": "other"}).json()["error"]["field"] == "group_name"
    assert _post(url, "/destroy_weights_update_group").json()["success"] is True


def test_the_weight_sender_in_place_of_pickled_tensors(setup, tiny_dir):
    """``router.peers.sglang.sender.SGLangWeightSender``: the same named tensors through shared memory, SGLang's answer."""
    url = setup[0].url
    new = {k: v * 0.5 for k, v in load_file(next((tiny_dir / "transformer").glob("*.safetensors"))).items()}
    with SGLangWeightSender(url + "/sglang") as sender:
        done = sender.update_weights_from_tensor(list(new.items()), target_modules=["transformer"])
        assert done["success"] is True, done
        assert sender.update_weights_from_tensor([("nope", torch.zeros(1))])["success"] is False
    assert _post(url, "/get_weights_checksum").json()["transformer"] == sglang_checksum(new.items())
