"""A request's prompt and negative prompt through a text encoder: one call for both, unless the encoder encodes
a negative prompt otherwise than a prompt (its ``negative_apart``: e.g. an instruction put before prompts only),
then one call per role. The encoder worker, the tests' in-process path and a trainer encode through here."""

from __future__ import annotations

import torch


def negative_apart(encoder) -> bool:
    """Whether ``encoder`` encodes a text as a negative prompt otherwise than as a prompt (then a text's
    embeddings depend on its role, and a cache keys them by it)."""
    return bool(getattr(encoder, "negative_apart", False))


def encode(encoder, texts: list[tuple[str, bool]], max_sequence_length: int,
           images: list[list] | None = None) -> list[dict[str, torch.Tensor]]:
    """Each ``(text, negative)``'s wire tensors, in order. ``images``: the PIL images each text is encoded with,
    for an encoder that sees images (an edit model's vision-language encoder); None for the others."""
    if images is not None:
        if negative_apart(encoder):
            raise ValueError("an encoder that sees images encodes every role alike")
        return encoder.wire_tensors([t for t, _ in texts], max_sequence_length, images)
    if not negative_apart(encoder):
        return encoder.wire_tensors([t for t, _ in texts], max_sequence_length)
    out: list = [None] * len(texts)
    for negative in (False, True):
        idx = [i for i, (_, neg) in enumerate(texts) if neg == negative]
        if idx:
            wires = encoder.wire_tensors([texts[i][0] for i in idx], max_sequence_length, negative=negative)
            for i, wire in zip(idx, wires):
                out[i] = wire
    return out
