"""What a denoise worker that splits each forward's sequence over ranks (Ulysses, ring) can take.

diffusers' context parallelism cuts the image tokens (and, where the transformer's plan says so, the text
tokens) into equal shares, one per rank: a length that does not divide fails the forward on every rank, and
with it the worker. So a request is checked when it arrives and refused alone (a 400 that says why) where its
image sequence does not divide; texts the transformer masks are padded to a multiple instead, as a longer batch
mate's padding would be (``TextPart.padded_to``, applied to every forward by the leader).
"""

from __future__ import annotations

from common.diffusion.parts.text import HIDDEN, text_kwargs
from common.protocol.errors import RequestError


def check_split(task, degree: int) -> None:
    """Refuse ``task`` (a DenoiseTask) where a worker splitting the sequence over ``degree`` ranks cannot run it."""
    if degree < 2:
        return
    info, p = task.info, task.params
    family = info.family
    size = family.latents.size(info, p.height, p.width, p.fields)
    tokens = family.latents.image_seq_len(info, *size, p.num_frames) + family.condition.extra_tokens(task.image)
    if tokens % degree:
        what = "with its reference images' tokens " if family.condition.extra_tokens(task.image) else ""
        raise RequestError(f"this denoise worker splits the sequence over {degree} ranks and the request's "
                           f"{tokens} image tokens {what}do not divide by {degree}: choose another height / width "
                           "(or image size)")
    if family.transformer.splits_text and not family.text.masks_padding:
        for text in (t for t in (task.cond, task.uncond) if t is not None):
            length = text_kwargs(text)[HIDDEN].shape[1]
            if length % degree:
                raise RequestError(f"max_sequence_length: this denoise worker splits the text over {degree} ranks "
                                   f"and a text of {length} tokens does not divide by {degree}")
