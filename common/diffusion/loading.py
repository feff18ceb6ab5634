"""How every component's weights are read from a model directory, in the layouts checkpoints ship in.

diffusers' and transformers' own ``from_pretrained`` stay the loaders; this module chooses what they read:

- a plain component folder (``diffusion_pytorch_model.safetensors`` / ``model.safetensors``), or sharded with its
  index (``*.safetensors.index.json``): ``from_pretrained`` reads both;
- ``variant`` files (``diffusion_pytorch_model.fp16.safetensors``, ``model.safetensors.index.fp16.json``, as
  ``save_pretrained(..., variant="fp16")`` writes them): the variant the folder holds is passed as ``variant=``.
  Plain files win where both are present (``from_pretrained``'s own default); a folder with several variants
  and no plain files is refused at launch (common/diffusion/checkpoint_check.py);
- one file for the transformer (``--transformer-file``): a ``.safetensors`` in the original or the diffusers
  naming through diffusers' ``from_single_file`` (the classes its single-file mapping covers), or a GGUF-quantized
  ``.gguf`` through the same call with ``GGUFQuantizationConfig`` (the ``gguf`` extra); the transformer's config
  and every other component come from the model directory.

The weights are cast to the dtype the worker computes in (``--dtype``): bf16 or fp16 files load as float32 (upcast)
or in their own dtype alike.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

# Weight file names as the libraries save them: a base name, an optional ".<variant>", an optional shard number;
# an index's variant sits before its ".json".
_WEIGHTS = re.compile(r"^(?:diffusion_pytorch_model|model|pytorch_model)(?:\.(?P<variant>[A-Za-z0-9_]+))?"
                      r"(?:-\d+-of-\d+)?\.(?:safetensors|bin)$")
_INDEX = re.compile(r"^(?:diffusion_pytorch_model|model|pytorch_model)\.(?:safetensors|bin)\.index"
                    r"(?:\.(?P<variant>[A-Za-z0-9_]+))?\.json$")
SINGLE_FILE_SUFFIXES = (".safetensors", ".gguf")


def variants_in(folder: Path) -> set[str | None]:
    """The variants of the weight files in ``folder`` (None: the plain files)."""
    found: set[str | None] = set()
    if folder.is_dir():
        for f in folder.iterdir():
            m = _WEIGHTS.match(f.name) or _INDEX.match(f.name)
            if m:
                found.add(m.group("variant"))
    return found


def weight_variant(folder: Path) -> str | None:
    """The ``variant=`` that loads ``folder``'s weights: None where plain files exist (or none at all), else the
    one variant present. Several variants and no plain files: a ValueError naming them."""
    found = variants_in(folder)
    if None in found or not found:
        return None
    if len(found) > 1:
        raise ValueError(f"{folder}: weight files of several variants ({', '.join(sorted(found))}) and no plain "
                         "ones; keep the files of one")
    return found.pop()


def load_component(cls, folder: Path, dtype: torch.dtype, **kwargs):
    """``cls.from_pretrained(folder)`` in ``dtype``, reading the folder's variant files where it holds only those."""
    return cls.from_pretrained(folder, dtype=dtype, variant=weight_variant(folder), **kwargs)


def single_file_support(cls) -> bool:
    """Whether diffusers' ``from_single_file`` maps checkpoints of model class ``cls``."""
    from diffusers.loaders.single_file_model import _get_single_file_loadable_mapping_class

    return hasattr(cls, "from_single_file") and _get_single_file_loadable_mapping_class(cls) is not None


def is_gguf(file: Path) -> bool:
    return Path(file).suffix == ".gguf"


def load_single_file(cls, file: Path, config_folder: Path, dtype: torch.dtype):
    """Model class ``cls`` from one checkpoint file, its config from ``config_folder`` (the model directory's
    ``transformer/``); a ``.gguf`` file stays quantized, dequantized to ``dtype`` in each forward."""
    kwargs = {}
    if is_gguf(file):
        from diffusers import GGUFQuantizationConfig

        kwargs["quantization_config"] = GGUFQuantizationConfig(compute_dtype=dtype)
    return cls.from_single_file(str(file), config=str(config_folder.parent), subfolder=config_folder.name,
                                dtype=dtype, local_files_only=True, **kwargs)
