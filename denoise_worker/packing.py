"""How the requests of one batched step fill forwards of at most ``max_batch`` samples."""

from __future__ import annotations

from common.diffusion.policy import ModelInput


def forward_parts(inputs: list[ModelInput], max_batch: int) -> list[list[tuple[int, ModelInput]]]:
    """The forwards to run, each a list of (input index, samples of that input), in input order.

    Whole inputs share a forward while they fit; an input larger than ``max_batch`` is cut into
    parts of ``max_batch`` samples (the samples of a request never depend on each other in a
    forward), so ``max_batch`` bounds the memory of every forward.
    """
    parts: list[list[tuple[int, ModelInput]]] = [[]]
    size = 0
    for i, x in enumerate(inputs):
        for start in range(0, x.n, max_batch):
            piece = x if x.n <= max_batch else x.rows(start, min(start + max_batch, x.n))
            if parts[-1] and size + piece.n > max_batch:
                parts.append([])
                size = 0
            parts[-1].append((i, piece))
            size += piece.n
    return parts
