"""A validated request body to the engine's :class:`GenerationParams`, through the one conversion
(common/diffusion/params.py) that a trainer's params take too; here only what is HTTP's: the body as the
conversion's dict, the media outputs (an mp4 or png file holds frames), and its errors as the router's."""

from __future__ import annotations

import torch

from common.diffusion import params as conversion
from common.diffusion import resume
from common.diffusion.model_info import ModelInfo
from common.protocol.messages import EDIT_IMAGES, INITIAL_LATENTS, CacheParams, GenerationParams
from router.request.schemas import MEDIA_OUTPUTS, GenerateBody
from router.core.errors import FieldError

size_multiple = conversion.size_multiple


def request_of(body: GenerateBody) -> dict:
    """The body's fields as the conversion takes them: the family's own (extra fields) among them, ``cache``
    only when given (left out: the engine's --cache; null: off), a media output as the frames it holds."""
    for name in body.model_extra or {}:  # e.g. a rollout's field on /generate
        if name in conversion.COMMON:
            raise FieldError(name, f"is not a field of this endpoint's body ({type(body).__name__})")
    request = body.model_dump(exclude=None if "cache" in body.model_fields_set else {"cache"})
    if request["output_type"] in MEDIA_OUTPUTS:
        request["output_type"] = "frames"
    return request


def makes_sound(info: ModelInfo) -> bool:
    """Whether the model's results carry a waveform: its directory has a vocoder (the decode worker's mel
    spectrogram to sound)."""
    return info.has_component("vocoder")


def max_images(info: ModelInfo) -> int:
    """How many images ``image`` may hold on this model (0: none; more than 1: a list of up to that)."""
    return info.family.condition.images_allowed(info)


def sized_by_image(info: ModelInfo) -> bool:
    """Whether the output's size follows the input image alone (HunyuanVideo 1.5 image to video: its aspect
    bucket), so that a request's size is refused."""
    return info.family.guidance.refusal(info, {"height": 1, "width": 1}) is not None


def image_items(image) -> list[tuple[str, str]]:
    """``image`` (one, or a list) as (wire tensor name, the name a refusal gives it) per image, in order:
    ``image``, ``image.2``, ``image.3`` on the wire; ``image`` or ``image[i]`` in errors."""
    if image is None:
        return []
    if isinstance(image, str):
        return [(EDIT_IMAGES[0].name, "image")]
    return [(field.name, f"image[{i}]") for i, field in enumerate(EDIT_IMAGES[:len(image)])]


def to_params(body: GenerateBody, info: ModelInfo, limits, cache: CacheParams | None = None,
              images: dict[str, torch.Tensor] | None = None) -> GenerationParams:
    """Every check of a request body on this model (``info``) and engine (``limits``, ``cache``: its default
    step caching), images included; a bad field raises :class:`FieldError`. ``images``: the request's decoded
    pixels by wire name, where the output size may follow them (image editing)."""
    request = request_of(body)
    sizes = [(int(images[f.name].shape[1]), int(images[f.name].shape[0])) for f in EDIT_IMAGES
             if images and f.name in images]
    try:
        conversion.check_images(request, info)
        params = conversion.to_params(request, info, limits, cache, sizes)
    except conversion.FieldError as e:
        raise FieldError(e.field, e.message) from None
    if body.stream and body.output_type in MEDIA_OUTPUTS:
        raise FieldError("stream", f"streams tensors (output_type frames or latent), not {body.output_type} files")
    if body.output_dtype == "uint8" and params.output_type == "latent":
        raise FieldError("output_dtype", "uint8 holds frames: latents are float (output_type latent)")
    if body.output_type == "wav" and not makes_sound(info):
        raise FieldError("output_type", f"wav holds a model's sound: {info.family.pipeline} makes none")
    if body.output_type == "png" and params.num_frames != 1:
        raise FieldError("output_type", f"png holds one frame: set num_frames to 1 (got {params.num_frames}), "
                                        "or ask for mp4")
    return params


def initial_latents(body: GenerateBody, info: ModelInfo, params: GenerationParams) -> dict[str, torch.Tensor]:
    """A resumed rollout's starting latents (``initial_latents``), checked against ``params``' latent layout, as
    the wire tensor the encoder worker passes on; {} when the body has none."""
    given = getattr(body, INITIAL_LATENTS.name, None)
    if given is None:
        return {}
    try:
        return {INITIAL_LATENTS.name: resume.checked(resume.from_body(given), info, params)}
    except conversion.FieldError as e:
        raise FieldError(e.field, e.message) from None
