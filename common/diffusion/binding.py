"""What a model family binds: a diffusers pipeline class composed of parts (:mod:`common.diffusion.parts`).

A family is one diffusers pipeline class (``model_index.json``'s ``_class_name``). Its binding
(``common/families/<family>/``) names it and composes its parts; the stages call the parts and never branch
on a family:

- ``text`` (:mod:`~common.diffusion.parts.text`): the encoder the encoder worker loads, a prompt's wire
  tensors, its conditioning as the transformer takes it, how distinct texts stack in one forward;
- ``latents`` (:mod:`~common.diffusion.parts.latents`): the directory's geometry, the noise, packing;
- ``transformer`` (:mod:`~common.diffusion.parts.transformer`): loading and calling an expert, TeaCache's
  signal, compile's dynamic dimensions, context parallel, LoRA targets, its blocks and cross-attentions;
- ``guidance`` (:mod:`~common.diffusion.parts.guidance`): the field that scales CFG, the order of operations,
  one or two forwards, embedded guidance, default sigmas;
- ``condition`` (:mod:`~common.diffusion.parts.condition`): a request's image(s), or none;
- ``decoder`` (:mod:`~common.diffusion.parts.decoder`): VAE latents to frames;
- ``experts`` (:mod:`~common.diffusion.parts.experts`): which transformer runs a timestep, at which guidance scale.

Everything else (rows, the SDE step, LoRA hooks, shared text, weight buckets, compile, context parallel)
is shared and knows nothing of any family. The tensors a family sends beyond every family's are its parts'
declaration (:attr:`Binding.wire_tensors`): its message contracts (:attr:`Binding.contract`) are built from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable

from common.diffusion.parts.condition import NoCondition
from common.diffusion.parts.decoder import DecoderPart
from common.diffusion.parts.experts import OneExpert
from common.diffusion.parts.guidance import Guidance
from common.diffusion.parts.latents import Geometry, LatentsPart
from common.diffusion.parts.text import TextPart
from common.diffusion.parts.transformer import TransformerPart
from common.diffusion.request_fields import RequestField
from common.protocol.contracts import WireContract
from common.protocol.tensor_field import TensorField


@dataclass(frozen=True, eq=False)
class Binding:
    family: str  # short name: /health, /v1/models, the launcher's table
    pipeline: str  # model_index.json's _class_name
    text: TextPart
    latents: LatentsPart
    transformer: TransformerPart
    decoder: DecoderPart
    guidance: Guidance = Guidance()
    condition: NoCondition = NoCondition()
    experts: OneExpert = OneExpert()
    fps: int = 16  # video: the MP4's frame rate unless serving_defaults.json says otherwise
    # A family whose requests choose their video's frame rate: that rate, read off a request's params (the MP4's).
    request_fps: Callable[[object], float] | None = None
    # A fixed rule the pipeline puts on height and width beyond its VAE's (WanPipeline.check_inputs' 16, SANA's
    # 32): sizes are multiples of this and of the directory's VAE scale times its patches (params.size_multiple).
    size_multiple: int = 1
    # The pipeline's own defaults for the request fields a model directory's serving defaults may override.
    defaults: dict = field(default_factory=dict)
    # (transformer config, geometry) -> the pipeline's default height and width, where its config decides.
    default_size: Callable[[dict, Geometry], int] | None = None
    # The request fields this family takes beyond those every family has (common/diffusion/request_fields.py).
    request_fields: tuple[RequestField, ...] = ()
    # The words that name this family in code beside its family and pipeline names (e.g. its model's name): no
    # shared file spells one (tests/test_layout.py), as no shared file branches on a family.
    words: tuple[str, ...] = ()

    @property
    def video(self) -> bool:
        """Frames [F, H, W, 3] with F from num_frames; else one frame (an image)."""
        return self.latents.video

    @property
    def cfg_field(self) -> str:
        return self.guidance.field

    @property
    def wire_tensors(self) -> tuple[TensorField, ...]:
        """What the family's messages carry, as its parts declare it: a prompt's tensors (``text.fields``), each
        one's negative twin, and the image side's (``condition.fields``); each says which stage makes and reads it."""
        missing = [f.name for f in self.text.fields if f.negative is None]
        if missing:
            raise ValueError(f"{self.pipeline}: text tensors {missing} declare no negative twin (TensorField.negative)")
        declared = (*self.text.fields, *(f.negative for f in self.text.fields), *self.condition.fields)
        return tuple(dict.fromkeys(declared))  # one declaration shared by two parts counts once

    @cached_property
    def contract(self) -> WireContract:
        """The message kinds' tensor contracts for this family (common/protocol/contracts.py)."""
        return WireContract(self.wire_tensors)

    def pipeline_defaults(self, transformer_config: dict, geometry: Geometry) -> dict:
        """The pipeline's defaults for this directory (some depend on its config, e.g. a sample size)."""
        if self.default_size is None:
            return dict(self.defaults)
        size = self.default_size(transformer_config, geometry)
        return {**self.defaults, "height": size, "width": size}
