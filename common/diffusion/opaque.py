"""Python calls that a compiled graph holds as one opaque op, run as they are at every forward.

What a forward reads from Python per request (each row's LoRA adapter, the shared-text plan: lists,
indices, objects) must not be traced: it would become guards, a recompile per mix of adapters or texts.
A graph break instead (``torch.compiler.disable``) inside the blocks' loop makes dynamo run the forward
eagerly around compiled fragments, and later plain forwards of the same shape take those fragments too.
A custom op is neither: one node in the graph, which calls the registered Python function at run time.
Outside torch.compile the wrappers are plain calls, so eager results do not change.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable

import torch

# Held weakly: an entry goes with the wrapper (and so with the hook that holds it).
_CALLS: "weakref.WeakValueDictionary[int, Callable]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


@torch.library.custom_op("disagg_diffusion::opaque_update", mutates_args=("out",))
def _opaque_update(key: int, x: torch.Tensor, out: torch.Tensor) -> None:
    result = _CALLS[key](x, out)
    if result is not out:
        out.copy_(result)


@_opaque_update.register_fake
def _(key, x, out):
    return None


@torch.library.custom_op("disagg_diffusion::opaque_like", mutates_args=())
def _opaque_like(key: int, tensors: list[torch.Tensor]) -> torch.Tensor:
    return _CALLS[key](*tensors).contiguous()  # the layout the fake below promises


@_opaque_like.register_fake
def _(key, tensors):  # noqa: F811
    return tensors[0].new_empty(tensors[0].shape)


def _registered(call: Callable) -> int:
    key = next(_KEYS)
    _CALLS[key] = call
    return key


def opaque_update(fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
    """``fn(x, out)`` returning ``out`` updated (in place or not); under torch.compile one opaque op."""
    def call(x, out):
        if not torch.compiler.is_compiling():
            return fn(x, out)
        torch.ops.disagg_diffusion.opaque_update(key, x, out)
        return out

    key = _registered(call)
    return call


def opaque_like(fn: Callable[..., torch.Tensor]):
    """``fn(first, *rest)`` returning a new tensor of ``first``'s shape; under torch.compile one opaque op."""
    def call(*tensors):
        if not torch.compiler.is_compiling():
            return fn(*tensors)
        return torch.ops.disagg_diffusion.opaque_like(key, list(tensors))

    key = _registered(call)
    return call
