"""The LoRA adapters one denoise worker holds, by name (loaded from a path or from the trainer's tensors)."""

from __future__ import annotations

import math

import torch

from common.config.engine import EngineConfig
from common.protocol.errors import Forbidden, RequestError
from common.protocol.control import FromMemory, LoadLora, UnloadLora
from common.protocol.messages import LORA_BLOB, GenerationParams
from common.diffusion.lora import LoraAdapter, build_adapter
from common.diffusion.lora_format import LoraConfig, LoraError, parse_state, read_lora
from common.diffusion.weights import WeightsError
from common.diffusion.policy import Policy


class AdapterTable:
    """Name -> the adapter's latest version. Versions are immutable: a request holds the one it
    started with, so replacing or unloading a name never changes a request in flight."""

    def __init__(self, config: EngineConfig, policy: Policy):
        self.config, self.policy = config, policy
        self.by_name: dict[str, LoraAdapter] = {}

    def choice(self, params: GenerationParams) -> tuple[LoraAdapter, float] | None:
        """The (adapter, scale) a request runs with; a name not loaded here is the request's error."""
        if params.lora_name is None:
            return None
        adapter = self.by_name.get(params.lora_name)
        if adapter is None:
            raise RequestError(f"lora_name: no adapter {params.lora_name!r} is loaded")
        return adapter, params.lora_scale

    def load(self, msg: LoadLora, tensors: dict[str, torch.Tensor]) -> dict:
        """An adapter from a path, or from the trainer's tensors in the message (one blob)."""
        return self._install(msg, lambda: self._read_path(msg) if msg.path else self._read_tensors(msg, tensors))

    def load_state(self, msg: FromMemory, state: dict[str, torch.Tensor]) -> dict:
        """An adapter from the trainer's memory (shared-memory buckets or a broadcast): peft-named tensors."""
        if msg.lora_rank is None:
            raise RequestError("lora.rank: required")
        return self._install(msg, lambda: parse_state(state, LoraConfig(r=msg.lora_rank, lora_alpha=msg.lora_alpha),
                                                      default_expert=msg.module))

    def _install(self, msg: LoadLora | FromMemory, read) -> dict:
        limits = self.config.limits
        if msg.lora_name not in self.by_name and len(self.by_name) >= limits.max_loras:
            raise RequestError(f"lora_name: {len(self.by_name)} adapters are loaded, the most --max-loras allows")
        try:
            parsed = read()
            version = msg.version if msg.version is not None else self._next_version(msg.lora_name)
            adapter = build_adapter(msg.lora_name, version, parsed, self.policy.experts, limits.max_lora_rank)
        except WeightsError as e:  # LoraError is one too: bad paths, files or tensors are the caller's
            raise RequestError(str(e)) from None
        self.policy.cover(adapter)
        self.by_name[adapter.name] = adapter  # one assignment: the next request sees the new version
        return adapter.describe()

    def unload(self, msg: UnloadLora) -> None:
        if self.by_name.pop(msg.lora_name, None) is None:
            raise RequestError(f"lora_name: no adapter {msg.lora_name!r} is loaded")

    def _next_version(self, name: str) -> int:
        old = self.by_name.get(name)
        return 1 if old is None else old.version + 1

    def _read_path(self, msg: LoadLora):
        if not self.config.weight_roots:  # the router refuses first; never read from anywhere
            raise Forbidden("adapter loads from a path are disabled: start the engine with --weight-root DIR")
        return read_lora(msg.path, self.config.weight_roots, swap_experts=msg.load_into_transformer_2,
                         pipeline=self.policy.family.pipeline)  # community formats: as its diffusers loader reads them

    @staticmethod
    def _read_tensors(msg: LoadLora, tensors: dict[str, torch.Tensor]):
        """The trainer's tensors: consecutive pieces of one flat blob, named and shaped by the message."""
        blob = tensors.get(LORA_BLOB.name)
        if blob is None or not msg.lora_tensors or msg.lora_rank is None:
            raise LoraError("an adapter from memory needs its tensors and its rank")
        sizes = [math.prod(t.shape) for t in msg.lora_tensors]
        if sum(sizes) != blob.numel():
            raise LoraError(f"the tensors' shapes need {sum(sizes)} values, the blob holds {blob.numel()}")
        pieces = torch.split(blob, sizes)
        state = {t.name: p.reshape(t.shape) for t, p in zip(msg.lora_tensors, pieces)}
        config = LoraConfig(r=msg.lora_rank, lora_alpha=msg.lora_alpha)
        return parse_state(state, config, default_expert=msg.module)
