"""CPU numerics that do not follow the thread count.

torch's CPU kernels split their work by the intra-op thread count, and several round by the split (measured on
torch 2.13, MKL 2024.2, oneDNN 3.12; bench/thread_invariance.py):

- ``GroupNorm`` on a channels-last input sums each group per thread (every VAE fed pixels from PIL / numpy,
  which ``VaeImageProcessor`` hands over channels-last, and every conv after them): 1e-3 on a VAE encode's
  latents between 1 and 2 threads. On a contiguous (NCHW) input each group is one thread's sum, at any count;
- oneDNN convolutions (1x1 ones above all), MKL's sgemm (its row and column tails: M or N not a multiple of
  its blocks per thread), CPU flash attention with few queries, and element-wise ops whose vector body and
  scalar tail differ (``gelu``, ``silu``, ``exp``: which elements fall in a tail follows the split): 1e-7 to
  1e-5 an op, on contiguous inputs too.

Two measures follow. Every component's group norms see contiguous inputs
(:func:`contiguous_activations`, applied wherever a component is laid out: the workers' component memory,
a trainer's copy, the tests' reference pipelines), which removes the first cause whatever the count. The second
has no layout that avoids it, so the workers compute at one intra-op thread (``EngineConfig.cpu_numerics``
"invariant", the default; common/config/engine.py ``worker_threads``): the same bits whatever the topology's
threads, the machine's cores or a forward's batch. "threaded" gives a CPU worker its threads for speed, and its
outputs then round with them.
"""

from __future__ import annotations

import torch

_HOOKED = "_disagg_contiguous_input"  # set on a module whose input hook is installed (installing is idempotent)
# The modules whose kernel's reduction order follows the input's memory format and the thread count. Not the
# convolutions: oneDNN's round by their layout only when split over threads (which the workers' one thread
# avoids), and a contiguous copy before each one changed SANA's transformer from a load to its level-1 resume.
LAYOUT_SENSITIVE = (torch.nn.GroupNorm,)


def _contiguous_input(module: torch.nn.Module, args: tuple) -> tuple | None:
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


def contiguous_activations(module: torch.nn.Module) -> torch.nn.Module:
    """Every group norm in ``module`` given its input contiguous (a no-op on one that is); the module. Its outputs
    then no longer depend on the input's layout nor on the thread count."""
    for sub in module.modules():
        if isinstance(sub, LAYOUT_SENSITIVE) and not getattr(sub, _HOOKED, False):
            sub.register_forward_pre_hook(_contiguous_input)
            setattr(sub, _HOOKED, True)
    return module
