"""Step caching per request: which rows of a request run the transformer at a step, and what the others reuse.

A request asks for it with ``cache`` (:class:`~common.protocol.messages.CacheParams`); its
:class:`RequestCache` lives in its denoise task and holds everything the method remembers, per CFG
branch and per sample, so requests at different steps that share a batched forward never see each
other's state, and a request's skips depend on its own schedule and rows only.

- ``teacache``: the relative L1 change of the timestep-modulated input (:meth:`Binding.transformer.modulated_input`)
  since the previous step, rescaled by the model's polynomial (:func:`teacache_coefficients`) and
  accumulated: while the sum stays under the threshold the step reuses the last output; else the step
  computes and the sum restarts. One decision per branch (every sample of a request has the same
  timestep and text).
- ``first_block``: a probe runs the first transformer block on every row; a row whose first-block
  residual moved less than the threshold (relative L1 against the residual of the row's last computed
  step) reuses its last output, each row on its own.

A skipped row does not enter the batched forward at all: its output is its own last transformer output
(its branch's, before guidance, which is applied again with this step's scale). The published methods add
the cached residual of the blocks to the step's new block input and run the output head, which needs the
row in the forward; reusing the whole output keeps skipped rows out of it.

Always computed: the first ``warmup`` steps, the last step, the first step after an expert switch (the
state is reset there), and every step the caller forces (a rollout's SDE steps).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from common.protocol.messages import CacheParams


@dataclass(frozen=True)
class Method:
    default_threshold: float
    max_threshold: float  # thresholds lie in (0, max_threshold]
    warmup: int  # steps always computed at the start (a family may ask for more: Binding.transformer.teacache_warmup)
    what: str


METHODS: dict[str, Method] = {
    "teacache": Method(0.08, 2.0, 1, "accumulated rescaled change of the timestep-modulated input"),
    "first_block": Method(0.08, 1.0, 1, "relative change of the first block's residual, per row"),
}


def threshold_problem(method: str, threshold: float) -> str | None:
    """Why ``threshold`` is not one ``method`` takes, or None."""
    top = METHODS[method].max_threshold
    if not 0.0 < threshold <= top:
        return f"{method} takes a threshold in (0, {top}], got {threshold}"
    return None


def parse_flag(text: str) -> CacheParams:
    """``METHOD[:THRESHOLD]`` (launch.py's ``--cache``) as cache settings; ValueError when it is none."""
    method, _, value = text.partition(":")
    if method not in METHODS:
        raise ValueError(f"unknown cache method {method!r}; known: {', '.join(METHODS)}")
    threshold = METHODS[method].default_threshold if not value else float(value)
    problem = threshold_problem(method, threshold)
    if problem:
        raise ValueError(problem)
    return CacheParams(method=method, threshold=threshold)


def cli_flag(text: str) -> CacheParams:
    """:func:`parse_flag` as an argparse ``type`` (its message as the flag's error)."""
    try:
        return parse_flag(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def rel_l1(now: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """Per row: mean |now - before| / mean |before| (float32)."""
    now, before = now.float().flatten(1), before.float().flatten(1)
    return (now - before).abs().mean(1) / before.abs().mean(1).clamp_min(1e-12)


def rescale(coefficients: tuple[float, ...], x: torch.Tensor) -> torch.Tensor:
    """The polynomial ``coefficients`` (highest power first, as numpy.poly1d) at ``x``."""
    out = torch.zeros_like(x)
    for c in coefficients:
        out = out * x + c
    return out


class RequestCache:
    """One request's caching state: ``branches`` CFG branches (1 or 2) of ``n`` samples over ``steps`` steps.

    Per step the caller asks :meth:`decide` which rows compute (given the method's signal), runs those,
    then calls :meth:`output` per branch to store their outputs and get every row's.
    """

    def __init__(self, params: CacheParams, n: int, branches: int, steps: int, warmup: int = 1,
                 coefficients: tuple[float, ...] = (1.0, 0.0)):
        self.method, self.threshold = params.method, params.threshold
        self.n, self.branches, self.steps = n, branches, steps
        self.warmup = max(warmup, METHODS[self.method].warmup)
        self.coefficients = coefficients
        self.transformer_passes = [0] * n  # full forwards per sample, summed over its branches
        self.cached_steps = [0] * n  # row-steps that reused an output
        self._reset(None)

    def _reset(self, expert: str | None) -> None:
        self.expert = expert
        self.outputs: list[torch.Tensor | None] = [None] * self.branches  # [n, ...] per branch
        self.signals: list[torch.Tensor | None] = [None] * self.branches  # the previous step's, per branch
        self.accumulated = [0.0] * self.branches  # teacache

    def forced(self, step: int) -> bool:
        """Whether ``step`` computes whatever the signal says (warm-up, last step)."""
        return step < self.warmup or step >= self.steps - 1

    def wants_signal(self, step: int) -> bool:
        """Whether :meth:`decide` needs this step's signal (a probe's residual is needed until the last step)."""
        return step < self.steps - 1

    def decide(self, step: int, expert: str, forced: bool, signals: list[torch.Tensor] | None) -> list[torch.Tensor]:
        """Which rows compute at ``step``: a bool [n] per branch. ``signals``: per branch, the modulated input
        [1, ...] (teacache) or the first block's residual [n, ...] (first_block); None when not wanted."""
        if expert != self.expert:
            self._reset(expert)
            forced = True
        forced = forced or self.forced(step)
        masks = []
        for b in range(self.branches):
            signal = None if signals is None else signals[b]
            masks.append(self._decide_branch(b, signal, forced or self.outputs[b] is None))
        for b, mask in enumerate(masks):
            for i, computes in enumerate(mask.tolist()):
                if computes:
                    self.transformer_passes[i] += 1
                else:
                    self.cached_steps[i] += 1
        return masks

    def _decide_branch(self, b: int, signal: torch.Tensor | None, forced: bool) -> torch.Tensor:
        previous = self.signals[b]
        if self.method == "teacache":
            if signal is not None:
                self.signals[b] = signal
            if forced or previous is None or signal is None:
                self.accumulated[b] = 0.0
                return torch.ones(self.n, dtype=torch.bool)
            change = rel_l1(signal, previous)[0]
            rescaled = float(rescale(self.coefficients, change))
            # A polynomial that goes negative has left the range it was fitted on: the raw change counts then.
            self.accumulated[b] += rescaled if rescaled > 0 else float(change)
            if self.accumulated[b] < self.threshold:
                return torch.zeros(self.n, dtype=torch.bool)
            self.accumulated[b] = 0.0
            return torch.ones(self.n, dtype=torch.bool)
        # first_block: a row compares with the residual of its last computed step, which it then keeps
        if forced or previous is None or signal is None:
            computes = torch.ones(self.n, dtype=torch.bool)
        else:
            computes = (rel_l1(signal, previous) >= self.threshold).cpu()
        if signal is not None:
            kept = signal if previous is None else torch.where(_rows_like(computes, signal), signal, previous)
            self.signals[b] = kept
        return computes

    def output(self, b: int, computes: torch.Tensor, computed: torch.Tensor | None) -> torch.Tensor:
        """Branch ``b``'s output for every row [n, ...]: the computed rows' (``computed``: [rows, ...] in row
        order) stored for later steps, the others' reused."""
        if bool(computes.all()):
            full = computed
        else:
            full = self.outputs[b].clone()
            if computed is not None:
                full[computes.to(full.device)] = computed
        self.outputs[b] = full
        return full


def _rows_like(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A bool per row as a mask broadcastable to ``like`` [n, ...]."""
    return mask.to(like.device).view(-1, *([1] * (like.dim() - 1)))
