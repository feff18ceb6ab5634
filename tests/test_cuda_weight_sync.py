"""Weight sync from a trainer's GPU tensors (GPU machines only): CUDA IPC buckets on one host, and an NCCL
weights group (two GPUs or more). Each equals the same update sent from host memory: checksum and output."""

from __future__ import annotations

import pytest
import torch
from diffusers import WanTransformer3DModel

from common.runtime.engine_process import free_port
from common.transport.weight_handles import DeviceBuckets
from common.diffusion.weights import state_dict_checksum
from rl import TrainerPolicy, WeightsGroup
from rl.lora import add_lora, lora_sha256, lora_state_dict, push_lora
from router.client import EngineClient

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA IPC needs a GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="an NCCL group needs the trainer on a GPU of its own")
REQ = dict(prompt="a lighthouse at dusk", seed=4, num_inference_steps=4, guidance_scale=4.0, output_type="latent")


def _trainer_copy(tiny_dir, seed: int, device: str) -> WanTransformer3DModel:
    model = WanTransformer3DModel.from_pretrained(tiny_dir / "transformer").eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model.to(device)


@pytest.fixture(scope="module")
def client(engine_factory):
    eng = engine_factory("tiny", extra=["--weight-sync-from-memory", "--dtype", "float32"])
    with EngineClient(eng.url) as c:
        assert all(w["device"].startswith("cuda") for w in c.health()["workers"] if w["role"] == "denoise")
        yield c


@gpu
def test_gpu_tensors_travel_as_cuda_ipc_handles_and_equal_the_host_update(client, tiny_dir):
    assert client.weight_sync_info()["cuda_ipc"] is True
    new = _trainer_copy(tiny_dir, seed=1, device="cuda")
    reply = client.update_weights_from_tensors(new, bucket_bytes=64 << 10)
    assert any(isinstance(b, DeviceBuckets) for b in client._buckets.values())  # not through /dev/shm
    assert reply["sha256"] == state_dict_checksum(new.cpu())
    on_gpu = client.generate(**REQ)["samples"][0]["output"]
    client.update_weights_from_tensors(_trainer_copy(tiny_dir, seed=2, device="cpu"))
    assert client.update_weights_from_tensors(new.cpu())["sha256"] == reply["sha256"]  # the same, from host memory
    assert torch.equal(client.generate(**REQ)["samples"][0]["output"], on_gpu)
    torch.cuda.synchronize()
    free_before = torch.cuda.mem_get_info()[0]
    for seed in (3, 4, 5):  # the same buckets again: handles given back, nothing grows
        client.update_weights_from_tensors(_trainer_copy(tiny_dir, seed=seed, device="cuda"), bucket_bytes=64 << 10)
    torch.cuda.synchronize()
    assert torch.cuda.mem_get_info()[0] >= free_before - (64 << 20)


@gpu
def test_an_adapter_from_gpu_tensors(client, tiny_dir):
    policy = TrainerPolicy(tiny_dir)
    add_lora(policy, 4, 8.0, seed=0)
    with torch.no_grad():
        for name, p in policy.transformer.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    via_http = push_lora(client, policy, "gpu-http")
    on_gpu = {k: v.to("cuda") for k, v in lora_state_dict(policy).items()}  # the client hands over CUDA handles
    via_ipc = client.update_weights_from_tensors(on_gpu, lora={"lora_name": "gpu-ipc", "rank": 4, "alpha": 8.0})
    assert via_ipc["sha256"] == via_http["sha256"] == lora_sha256(policy)
    a = client.generate(**REQ, lora_name="gpu-http")["samples"][0]["output"]
    assert torch.equal(client.generate(**REQ, lora_name="gpu-ipc")["samples"][0]["output"], a)


@gpu
@two_gpus
def test_nccl_group_broadcast_equals_the_trainer(client, tiny_dir):
    trainer_gpu = f"cuda:{torch.cuda.device_count() - 1}"
    new = _trainer_copy(tiny_dir, seed=6, device=trainer_gpu)
    with WeightsGroup(client, "127.0.0.1", free_port(), backend="nccl", timeout_s=120, device=trainer_gpu) as g:
        reply = g.push(new)
    assert reply["sha256"] == state_dict_checksum(new.cpu()) == client.weights_checksum()["sha256"]
