"""Model families: one binding per diffusers pipeline (see :mod:`common.diffusion.binding`).

A model directory's family is its ``model_index.json`` ``_class_name``. Adding a family is one folder
here composing a :class:`~common.diffusion.binding.Binding` of parts, and one line in :data:`BINDINGS`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from common.diffusion.binding import Binding
from common.diffusion.model_info import ModelInfo, read_index
from common.families.flux.binding import FLUX
from common.families.flux.kontext import FLUX_KONTEXT
from common.families.flux2.binding import FLUX2_KLEIN
from common.families.hunyuan_video15.binding import HUNYUAN_VIDEO15, HUNYUAN_VIDEO15_I2V
from common.families.ltx2.binding import LTX2, LTX2_I2V
from common.families.qwen_image.binding import QWEN_IMAGE
from common.families.qwen_image.edit import QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS
from common.families.sana.binding import SANA
from common.families.sd3.binding import SD3
from common.families.wan.binding import WAN
from common.families.wan.i2v import WAN_I2V
from common.families.z_image.binding import Z_IMAGE

BINDINGS: dict[str, Binding] = {b.pipeline: b for b in (WAN, WAN_I2V, SD3, FLUX, QWEN_IMAGE, SANA,
                                                        QWEN_IMAGE_EDIT, QWEN_IMAGE_EDIT_PLUS, FLUX_KONTEXT, LTX2, LTX2_I2V,
                                                        Z_IMAGE, FLUX2_KLEIN,
                                                        HUNYUAN_VIDEO15, HUNYUAN_VIDEO15_I2V)}


class UnknownFamily(ValueError):
    """The directory's pipeline class has no binding."""


def binding_for(pipeline: str | None) -> Binding:
    binding = BINDINGS.get(pipeline or "")
    if binding is None:
        raise UnknownFamily(f"model_index.json names pipeline class {pipeline!r}, which this engine does not serve; "
                            f"supported: {', '.join(sorted(BINDINGS))}")
    return binding


def family_of(path: str | Path) -> Binding:
    """The binding of a model directory's pipeline class (``model_index.json``'s ``_class_name``)."""
    return binding_for(read_index(path).get("_class_name"))


def read_model(path: str | Path, transformer_file: str | Path | None = None) -> ModelInfo:
    """The facts of a model directory, read with its family's binding; ``transformer_file``: one checkpoint file
    the transformer's weights come from instead (``--transformer-file``)."""
    info = ModelInfo.read_with(family_of(path), path)
    return info if transformer_file is None else replace(info, transformer_file=Path(transformer_file))
