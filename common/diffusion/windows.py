"""A rollout's random SDE window: which consecutive steps take the SDE step, picked from the request's seed.

Flow-GRPO-Fast's rule: ``start = randint(lo, hi - size)`` (both ends inclusive), the window is the steps
``[start, start + size)``. Here the draw is ``random.Random(seed)``'s, so a request's window is a pure function
of its seed and settings: the same request gives the same window on any router and in the trainer's
``TrainerPolicy.params``, and a group (``n`` samples) shares its request's window.
"""

from __future__ import annotations

import random


def window_problem(size: int, window_range: list[int] | tuple[int, int] | None, steps: int) -> tuple[str, str] | None:
    """(field, why) when ``size`` and ``window_range`` cannot make a window on a ``steps``-step schedule."""
    if size < 1:
        return "sde_window_size", f"must be at least 1, got {size}"
    lo, hi = (0, steps) if window_range is None else window_range
    if window_range is not None and len(window_range) != 2:
        return "sde_window_range", f"must be [lo, hi], got {list(window_range)}"
    if not 0 <= lo <= hi <= steps:
        return "sde_window_range", f"must satisfy 0 <= lo <= hi <= {steps} (the steps), got [{lo}, {hi}]"
    if size > hi - lo:
        field = "sde_window_size" if window_range is None else "sde_window_range"
        return field, f"a window of {size} steps does not fit in [{lo}, {hi}]"
    return None


def pick_window(seed: int, size: int, window_range: list[int] | tuple[int, int] | None, steps: int) -> tuple[int, int]:
    """The window [start, stop) of a request with ``seed`` (call :func:`window_problem` first)."""
    lo, hi = (0, steps) if window_range is None else window_range
    start = random.Random(seed).randint(lo, hi - size)
    return start, start + size
