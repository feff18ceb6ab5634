"""What the edit-model feature tests share: the three edit built-ins, each with its request images, its engine
path in process (tests/family_harness.py) and a LoRA in two formats (a diffusers file of the family's own
pipeline, a peft folder) loaded into the engine and, through peft, into the trainer's policy."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import lora_fixtures as lf
from common.builtin import ensure_builtin
from common.protocol.messages import GenerationParams, RolloutParams
from family_harness import InProcess, ModuleModels

MODELS = ["tiny-qwen-image-edit", "tiny-qwen-image-edit-plus", "tiny-flux-kontext"]
# MODELS for the slow cases (over 5 s each): both Qwen-Image edit models run with the heavy tests (Edit-Plus's
# cases take ~20 s each: its pipeline resizes every reference to a 1024 x 1024 area for the VAE); FLUX.1 Kontext
# covers the mechanism by default, and Edit-Plus keeps its parity and rollout cases there
# (tests/test_qwen_image_edit.py, tests/test_edit_rollouts.py, tests/test_edit_requests.py).
SLOW_MODELS = [pytest.param(m, marks=pytest.mark.heavy) if m.startswith("tiny-qwen-image-edit") else m for m in MODELS]
SCALE = 0.8  # the requests' lora_scale, set on the trainer's peft adapters too


def picture(height: int, width: int, seed: int) -> Image.Image:
    """A smooth random picture (a coarse grid upsampled), so that resizing it keeps its content."""
    coarse = np.random.RandomState(seed).randint(0, 256, (6, 6, 3), dtype=np.uint8)
    return Image.fromarray(coarse).resize((width, height), Image.BILINEAR)


def images_for(model: str, seed: int = 0, aspect: tuple[int, int] = (40, 56), many: bool = False) -> list[Image.Image]:
    """A request's images: one (``aspect``: its height and width, which its reference grid follows), and a
    second for Edit-Plus when ``many`` (each reference is some 4,000 tokens at the pipelines' 1024x1024 area:
    most tests take one)."""
    first = picture(*aspect, seed)
    return [first, picture(48, 32, seed + 1)] if many and model.endswith("-plus") else [first]


@dataclass
class Made:
    eng: InProcess
    model_dir: Path
    adapters: dict = field(default_factory=dict)  # kind ("file", "peft") -> (lf.Adapter, the engine's adapter)

    def lora(self, kind: str):
        return self.adapters[kind][1], SCALE


class EditModels(ModuleModels):
    """ModuleModels plus each edit model's two adapters (built on first use)."""

    def __init__(self):
        super().__init__()
        self.made: dict[str, Made] = {}

    def get(self, model: str, tmp_path_factory) -> Made:
        from common.diffusion.lora import build_adapter
        from common.diffusion.lora_format import read_lora

        if model not in self.made:
            model_dir = ensure_builtin(model)
            eng = self.engine(model_dir)
            targets = eng.family.transformer.lora_targets
            m = Made(eng, model_dir)
            files = {"file": lf.make_diffusers_lora(model_dir, tmp_path_factory.mktemp(f"{model}-file"), rank=4,
                                                    alpha=8, target_modules=targets, seed=1),
                     "peft": lf.make_peft_lora(model_dir, tmp_path_factory.mktemp(f"{model}-peft"), rank=2, alpha=4,
                                               target_modules=targets, seed=2)}
            for i, (kind, files_) in enumerate(files.items()):
                adapter = build_adapter(kind, i + 1, read_lora(str(files_.path), None), eng.policy.experts, 64)
                eng.policy.cover(adapter)
                m.adapters[kind] = (files_, adapter)
            self.made[model] = m
        return self.made[model]

    def trainer_with(self, m: Made, kind: str):
        """The trainer's policy with adapter ``kind`` put in by peft and active at SCALE (the other off)."""
        import peft

        trainer = self.trainer(m.model_dir)
        model = trainer.transformer
        for name, (files, _) in m.adapters.items():
            if name not in getattr(model, "peft_config", {}):
                model.add_adapter(lf.lora_config(files.rank, files.alpha, files.target_modules), adapter_name=name)
                result = peft.set_peft_model_state_dict(model, files.state_dict, adapter_name=name)
                assert not [k for k in result.unexpected_keys if "lora" in k]
        model.set_adapters([kind], [SCALE])
        model.requires_grad_(False)  # a frozen copy
        return trainer

    def clear(self) -> None:
        super().clear()
        self.made.clear()


def rollout_params(eng: InProcess, sde_type: str = "sde", *, steps: int = 3, n: int = 2, seed: int = 3,
                   cfg: bool = False, **rollout) -> GenerationParams:
    """A rollout of ``steps`` with its trajectory, guided by a negative prompt when ``cfg``."""
    over = dict(num_inference_steps=steps, n=n, seed=seed, prompt="make the fox blue")
    if eng.family.cfg_field == "true_cfg_scale":
        over["true_cfg_scale"] = 2.0 if cfg else 1.0
    else:
        over["guidance_scale"] = 2.0 if cfg else 1.0
    if cfg:
        over["negative_prompt"] = "blurry"
    noise_level = 0.8 if sde_type == "cps" else 0.7
    return eng.params(rollout=RolloutParams(sde_type=sde_type, noise_level=noise_level, return_trajectory=True,
                                            **rollout), **over)


def no_grad(fn, *args, **kwargs):
    with torch.no_grad():
        return fn(*args, **kwargs)
