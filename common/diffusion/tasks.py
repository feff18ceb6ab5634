"""One model directory, two tasks: where diffusers loads the same directory with a text-only pipeline class and
with an image-conditioned one (the same components, optional ones absent) and both run on it, the engine serves
both from it, whichever class ``model_index.json`` names: a request with an image takes the image task's path,
one without the text-only task's.

A family declares such a pair with :func:`serving_both`: the two bindings as served share every part but the
condition (checked here), and each takes the condition :class:`TextOrImage` and both tasks' request fields. The
stages call the condition as any other: the router's checks say ``image`` is optional (``/v1/models``,
``/openapi.json``), the encoder worker loads the image task's image side, and on the denoise worker a request's
image (or its absence) picks the task's latents, timesteps and log-prob mask; requests of the two tasks never
share a forward (:meth:`TextOrImage.batch_key`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from common.diffusion.parts.condition import NoCondition

if TYPE_CHECKING:
    from common.diffusion.binding import Binding

# The parts and settings the two pipelines of one directory must share for one binding to serve both.
SHARED = ("text", "latents", "transformer", "decoder", "guidance", "experts", "fps", "request_fps", "size_multiple",
          "defaults", "default_size")


@dataclass(frozen=True, kw_only=True)
class TextOrImage(NoCondition):
    """The condition of a directory serving two tasks: ``image``'s (the image-conditioned pipeline's) for a
    request with an image, ``text``'s (the text-only pipeline's) for one without. ``own``: the task of the
    pipeline class the directory names ("text" or "image")."""

    text: NoCondition
    image: NoCondition
    own: str = "text"

    def __post_init__(self) -> None:
        # The image side's tensors: what the encoder worker sends for a request with an image.
        object.__setattr__(self, "fields", self.image.fields)
        object.__setattr__(self, "text_fields", self.image.text_fields)

    def _task(self, image) -> NoCondition:
        return self.text if image is None else self.image

    # --- the request's checks, the encoder worker's image side: the image task's, an image being optional ---
    def image_input(self, info):
        return "optional" if self.image.image_input(info) is not None else self.text.image_input(info)

    def last_image_input(self, info):
        return self.image.last_image_input(info)

    def images_allowed(self, info):
        return self.image.images_allowed(info)

    def text_sees_images(self):
        return self.image.text_sees_images()

    def load(self, info, dtype, device, *args, **kwargs):
        return self.image.load(info, dtype, device, *args, **kwargs)

    def wire_tensors(self, conditioner, images, last_image, params):
        return self.image.wire_tensors(conditioner, images, last_image, params)

    def cache_key(self, params):
        return self.image.cache_key(params)

    def default_size(self, info, sizes, fields):
        return (self.image if sizes else self.text).default_size(info, sizes, fields)

    def from_wire(self, wire):
        return self.image.from_wire(wire)

    def example(self, info, latent_shape, generator, device, dtype):
        own = self.image if self.own == "image" else self.text  # compile warm-ups: the directory's own task
        return own.example(info, latent_shape, generator, device, dtype)

    # --- the denoise side: the task the request's image (or its absence) picks ---
    def model_latents(self, info, latents, image):
        return self._task(image).model_latents(info, latents, image)

    def token_layout(self, grid, image):
        return self._task(image).token_layout(grid, image)

    def batch_key(self, image):
        # The tasks' rows apart: their timesteps differ in shape (a timestep per token with an image).
        return image is not None, self._task(image).batch_key(image)

    def extra_tokens(self, image):
        return self._task(image).extra_tokens(image)

    def row_timesteps(self, info, timestep, latents, image):
        return self._task(image).row_timesteps(info, timestep, latents, image)

    def final_latents(self, info, latents, image):
        return self._task(image).final_latents(info, latents, image)

    def log_prob_mask(self, info, latents, image):
        return self._task(image).log_prob_mask(info, latents, image)


def serving_both(text: "Binding", image: "Binding") -> tuple["Binding", "Binding"]:
    """``text`` (a text-only pipeline's binding) and ``image`` (the image-conditioned pipeline's that loads the
    same directories) as served: each serves both tasks (see the module docstring). Raises ``ValueError`` where
    they differ in a part besides the condition and the request fields."""
    differ = [name for name in SHARED if getattr(text, name) != getattr(image, name)]
    if differ or type(text) is not type(image):
        raise ValueError(f"{text.pipeline} and {image.pipeline} differ in {differ or 'their binding class'}: "
                         "one binding cannot serve both tasks")
    fields = text.request_fields + tuple(f for f in image.request_fields if f not in text.request_fields)
    return tuple(replace(b, condition=TextOrImage(text=text.condition, image=image.condition, own=own),
                         request_fields=fields)
                 for b, own in ((text, "text"), (image, "image")))
