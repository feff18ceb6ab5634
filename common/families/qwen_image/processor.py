"""Qwen-Image-Edit's ``processor`` component (``Qwen2VLProcessor``: the Qwen2.5-VL image processor beside the
tokenizer) loaded with or without torchvision.

transformers' ``Qwen2VLProcessor`` holds a video processor, and the video processors need torchvision; where
torchvision does not import, the same processor is built from the PIL image processor
(``Qwen2VLImageProcessorPil``, the same settings from ``preprocessor_config.json``) and the tokenizer, without a
video processor: the edit pipelines never pass videos. The token expansion is the same (one ``<|image_pad|>``
per merged patch of ``smart_resize``'s grid); the pixel values can differ slightly, PIL's bicubic resize
against torchvision's (docs/operations.md).
"""

from __future__ import annotations

import functools
from pathlib import Path

PROCESSOR = "processor"
TOKENIZER = "tokenizer"


def torchvision_imports() -> bool:
    try:
        import torchvision  # noqa: F401
    except Exception:  # not installed, or built against another torch (its C++ operators fail to register)
        return False
    return True


def load_processor(path: str | Path):
    """The processor of the model directory ``path`` (its ``processor/`` folder, and ``tokenizer/`` when the
    processor folder holds no tokenizer files)."""
    from transformers import AutoTokenizer, Qwen2VLProcessor

    folder = Path(path) / PROCESSOR
    if torchvision_imports():
        return Qwen2VLProcessor.from_pretrained(folder)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    has_tokenizer = (folder / "tokenizer_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(folder if has_tokenizer else Path(path) / TOKENIZER)
    chat_template = getattr(tokenizer, "chat_template", None)
    return image_text_processor()(Qwen2VLImageProcessorPil.from_pretrained(folder), tokenizer,
                                  chat_template=chat_template)


@functools.cache
def image_text_processor() -> type:
    """The processor class without a video processor (made on first use: it subclasses transformers')."""
    from transformers import Qwen2VLProcessor
    from transformers.processing_utils import ProcessorMixin

    class ImageTextProcessor(Qwen2VLProcessor):
        """``Qwen2VLProcessor`` without its video processor (ProcessorMixin reads the attributes off this
        ``__init__``'s parameters, so leaving ``video_processor`` out of them removes it)."""

        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
            self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
            self.image_token_id = (getattr(tokenizer, "image_token_id", None)
                                   or tokenizer.convert_tokens_to_ids(self.image_token))
            self.video_token_id = (getattr(tokenizer, "video_token_id", None)
                                   or tokenizer.convert_tokens_to_ids(self.video_token))
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

        def save_pretrained(self, save_directory, **kwargs):
            """The real checkpoint's ``processor/`` layout: ``preprocessor_config.json`` (the image processor,
            which either backend loads) beside the tokenizer's files; no processor_config.json naming this
            class, so ``Qwen2VLProcessor.from_pretrained`` reads the folder where torchvision imports."""
            kwargs.pop("push_to_hub", None)
            self.image_processor.save_pretrained(save_directory)
            self.tokenizer.save_pretrained(save_directory)
            return [str(save_directory)]

    return ImageTextProcessor

