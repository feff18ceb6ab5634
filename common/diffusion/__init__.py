"""What every stage shares about diffusion models: bindings' base, schedulers, policy, weights, LoRA."""

from common.diffusion.image_processors import bind_pil_processors

bind_pil_processors()  # before any diffusers pipeline module is imported (common/diffusion/image_processors.py)
