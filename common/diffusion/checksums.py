"""Digests of a module's weights in each protocol's own formula, so that a trainer's check passes unchanged: the
engine's (:func:`~common.diffusion.weights.state_dict_checksum`), SGLang diffusion's and vLLM-Omni's."""

from __future__ import annotations

import hashlib

import torch

from common.diffusion.weights import _raw_bytes, state_dict_checksum


def parameters_checksum(module: torch.nn.Module) -> str:
    """SHA-256 hex digest as SGLang diffusion's ``/get_weights_checksum`` computes it, so that a trainer's own
    check against its tensors passes: the module's parameters (not its buffers) in name order, each its name's
    UTF-8 bytes then its raw bytes (no dtype, shape or length in between)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.named_parameters(), key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(_raw_bytes(tensor))
    return digest.hexdigest()


def omni_parameters_checksum(module: torch.nn.Module) -> str:
    """SHA-256 hex digest as vLLM-Omni's ``/get_weights_checksum`` computes it: the module's parameters (not its
    buffers) in name order, each its name, ``str(dtype)`` (``torch.bfloat16``), ``str(tuple(shape))`` and raw bytes."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.named_parameters(), key=lambda item: item[0]):
        digest.update(name.encode())
        digest.update(str(tensor.dtype).encode())
        digest.update(str(tuple(tensor.shape)).encode())
        digest.update(_raw_bytes(tensor))
    return digest.hexdigest()


CHECKSUMS = {"engine": state_dict_checksum, "sglang": parameters_checksum,  # a checksum request's scheme
             "vllm_omni": omni_parameters_checksum}
