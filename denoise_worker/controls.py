"""The denoise worker's control handlers: weight updates (from a checkpoint, from the trainer's memory or its
weights group), checksums, the trainer's weights group, LoRA adapters. One handler per control kind;
:meth:`DenoiseControls.table` is what the stage answers (besides releasing and resuming its weights)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from common.diffusion.checksums import CHECKSUMS
from common.diffusion.weights import WeightsError, load_into, read_weights, state_dict_checksum
from common.protocol.control import (
    Checksum,
    ChecksumReply,
    ControlReply,
    DestroyWeightsGroup,
    FromMemory,
    GroupDestroyedReply,
    GroupReply,
    InitWeightsGroup,
    LoadLora,
    LoraReply,
    PinReference,
    PinReply,
    UnloadLora,
    UnloadLoraReply,
    UpdateWeights,
    UpdateWeightsFromGroup,
    UpdateWeightsFromTensors,
    WeightsReply,
)
from common.protocol.errors import Forbidden, RequestError, Sleeping
from common.config.engine import EngineConfig
from common.diffusion.policy import Policy
from common.runtime.component_memory import ComponentMemory
from denoise_worker.adapters import AdapterTable
from denoise_worker.pinned import Pinned, pinned_copy
from denoise_worker.weight_sync import WeightSync


class ControlledStage(Protocol):
    """What the handlers read and change of the denoise stage (denoise_worker/stage.py implements it)."""

    config: EngineConfig
    policy: Policy
    memory: ComponentMemory
    adapters: AdapterTable
    sync: WeightSync
    pinned: Pinned | None
    weight_version: int

    def fresh_modules(self) -> dict[str, torch.nn.Module]: ...

    def answer(self, msg: Any, reply: type, **fields: Any) -> Any: ...


class DenoiseControls:
    def __init__(self, stage: ControlledStage):
        self.stage = stage

    def table(self) -> dict[type, Callable[..., ControlReply]]:
        return {UpdateWeights: self.update_weights, UpdateWeightsFromTensors: self.update_from_memory,
                UpdateWeightsFromGroup: self.update_from_memory, Checksum: self.checksum,
                InitWeightsGroup: self.init_group, DestroyWeightsGroup: self.destroy_group,
                LoadLora: self.load_lora, UnloadLora: self.unload_lora, PinReference: self.pin}

    # --- weights ------------------------------------------------------------------------
    def update_weights(self, msg: UpdateWeights) -> WeightsReply:
        return self._update(msg, lambda module: self._read_into(module, msg.path))

    def update_from_memory(self, msg: FromMemory) -> WeightsReply | LoraReply:
        """A module's weights, or an adapter (``lora_name``), from the trainer's buckets or its broadcast."""
        self._check_from_memory()
        if msg.lora_name is not None:
            described = self.stage.adapters.load_state(msg, self.stage.sync.tensors(msg))
            return self.stage.answer(msg, LoraReply, **described)
        return self._update(msg, lambda module: self.stage.sync.load(module, msg))

    def checksum(self, msg: Checksum) -> ChecksumReply:
        module = self._module(msg.module)
        if not self.stage.memory.modules[msg.module].present:
            raise Sleeping(f"{msg.module}: its weights are released (level {self.stage.memory.level})")
        return self.stage.answer(msg, ChecksumReply, weight_version=self.stage.weight_version,
                                 sha256=CHECKSUMS[msg.scheme](module))

    def _update(self, msg: UpdateWeights | FromMemory, load: Callable[[torch.nn.Module], None]) -> WeightsReply:
        stage = self.stage
        module = self._module(msg.module)
        t0 = time.perf_counter()
        self._load_asleep(msg.module, lambda: load(module))
        if stage.policy.ranks is not None:  # the followers' copies follow the leader's
            stage.policy.ranks.share_weights(msg.module)
        stage.weight_version = msg.version if msg.version is not None else stage.weight_version + 1
        return stage.answer(msg, WeightsReply, weight_version=stage.weight_version, load_s=time.perf_counter() - t0,
                            sha256=state_dict_checksum(module) if msg.checksum else None)

    def _module(self, name: str) -> torch.nn.Module:
        module = self.stage.policy.experts.get(name)
        if module is None:
            raise RequestError(f"module: this model has no {name}")
        return module

    def _load_asleep(self, name: str, load: Callable[[], None]) -> None:
        """A push into a sleeping expert: storage for it first (its values come with the push); a refused push
        leaves it as asleep as it was."""
        expert = self.stage.memory.modules[name]
        level = expert.level
        expert.materialize()
        try:
            load()
        except BaseException:
            expert.release(level)
            raise

    def _read_into(self, module: torch.nn.Module, path: str) -> None:
        roots = self.stage.config.weight_roots
        if not roots:  # the router refuses first; never read from anywhere
            raise Forbidden("weight updates are disabled: start the engine with --weight-root DIR")
        try:
            load_into(module, read_weights(path, allowed_roots=roots))
        except WeightsError as e:
            raise RequestError(str(e)) from None

    # --- the pinned KL reference ------------------------------------------------------------
    def pin(self, msg: PinReference) -> PinReply:
        """Copy every expert's weights as ``kl_reference: "pinned"`` (replacing an earlier copy)."""
        stage = self.stage
        if stage.policy.ranks is not None:  # the copy would have to be laid out over the ranks like the policy
            raise RequestError("pin_reference: a multi-device denoise worker (ranks > 1) cannot pin a reference")
        asleep = [name for name, m in stage.memory.modules.items() if not m.present]
        if asleep:
            raise Sleeping(f"{', '.join(asleep)}: its weights are released (level {stage.memory.level})")
        t0 = time.perf_counter()
        stage.pinned = None  # the old copy goes before the new one is made
        stage.pinned = Pinned(pinned_copy(stage.policy, stage.fresh_modules), stage.weight_version)
        return stage.answer(msg, PinReply, weight_version=stage.weight_version, experts=list(stage.policy.experts),
                            nbytes=stage.pinned.nbytes, pin_s=time.perf_counter() - t0)

    # --- the trainer's weights group ------------------------------------------------------
    def init_group(self, msg: InitWeightsGroup) -> GroupReply:
        self._check_from_memory()
        self.stage.sync.init_group(msg)
        return self.stage.answer(msg, GroupReply, rank=msg.rank, world_size=msg.world_size, backend=msg.backend)

    def destroy_group(self, msg: DestroyWeightsGroup) -> GroupDestroyedReply:
        self._check_from_memory()
        had = self.stage.sync.destroy_group()
        return self.stage.answer(msg, GroupDestroyedReply, group="destroyed" if had else "none")

    def _check_from_memory(self) -> None:
        if not self.stage.config.weight_sync_from_memory:  # the router refuses first
            raise Forbidden("weight sync from memory is off: start the engine with --weight-sync-from-memory")

    # --- adapters ---------------------------------------------------------------------------
    def load_lora(self, msg: LoadLora, tensors: dict[str, torch.Tensor]) -> LoraReply:
        return self.stage.answer(msg, LoraReply, **self.stage.adapters.load(msg, tensors))

    def unload_lora(self, msg: UnloadLora) -> UnloadLoraReply:
        self.stage.adapters.unload(msg)
        return self.stage.answer(msg, UnloadLoraReply, lora_name=msg.lora_name)


def applies_between_steps(msg: object) -> bool:
    """Adapter changes need no quiet moment: requests in flight keep the version they hold."""
    return isinstance(msg, (LoadLora, UnloadLora)) or isinstance(msg, FromMemory) and msg.lora_name is not None
