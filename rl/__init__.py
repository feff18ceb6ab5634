"""Trainer-side helpers: import these to recompute rollout log-probs, sync weights and train LoRA adapters.

    from rl import TrainerPolicy, Trajectory, sde_step, state_dict_checksum, save_weights, WeightsGroup
    from rl import add_lora, lora_parameters, push_lora, save_lora, set_lora_scale   # needs peft

The LoRA helpers (:mod:`rl.lora`) are imported on first use, so ``import rl`` works without peft.
"""

from common.diffusion.sde import log_prob_of, sde_step
from common.diffusion.step_variants import STEP_VARIANTS, step_variant
from common.diffusion.weights import save_weights, state_dict_checksum
from rl.policy import ImageInputs, TrainerPolicy, Trajectory
from rl.weight_sync import WeightsGroup

_LORA = ("add_lora", "freeze_base", "lora_config", "lora_metadata", "lora_parameters", "lora_state_dict",
         "lora_sha256", "push_lora", "save_lora", "set_lora_scale", "DEFAULT_TARGETS")

__all__ = ["TrainerPolicy", "Trajectory", "ImageInputs", "WeightsGroup", "sde_step", "log_prob_of", "step_variant", "STEP_VARIANTS",
           "state_dict_checksum", "save_weights", *_LORA]


def __getattr__(name: str):
    if name in _LORA:
        from rl import lora

        return getattr(lora, name)
    raise AttributeError(f"module 'rl' has no attribute {name!r}")
