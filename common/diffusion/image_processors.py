"""transformers' image processors without torchvision, quietly.

Without torchvision, transformers answers an import of ``<Model>ImageProcessor`` with its PIL twin
(``<Model>ImageProcessorPil``) and warns once per class; diffusers' pipeline modules import CLIP's and SigLIP's
at import time, so every start of an image family (and Wan image to video) printed warnings a user can only act
on by installing a package the engine does not need. Binding the twins first loads the very classes the
fallback would, without the warning.
"""

from __future__ import annotations

import importlib.util
import sys

# The processors diffusers' pipelines import (IP-adapter feature extractors, Wan I2V's CLIP image processor).
PROCESSORS = ("CLIPImageProcessor", "SiglipImageProcessor")


def bind_pil_processors() -> None:
    if importlib.util.find_spec("torchvision") is not None:
        return  # the default backend is there: nothing falls back, nothing to warn about
    import transformers

    twins = {name: getattr(transformers, f"{name}Pil") for name in PROCESSORS}
    # Loading a twin may put a new lazy module in sys.modules["transformers"]: bind on the one imports will see.
    module = sys.modules["transformers"]
    for name, twin in twins.items():
        if name not in vars(module):
            setattr(module, name, twin)
