"""What the step-caching methods measure (common/diffusion/step_cache.py), for every family.

- :func:`modulated_input`: one request branch's timestep-modulated input (the family's
  transformer part's ``modulated_input``): a few Linear layers, no pass of the transformer.
- :func:`first_block_residuals`: the probe of ``first_block``: the rows' forward up to the first
  transformer block, stopped there; its residual (output - input) per row (the transformer part's
  ``block_residual``: the stream diffusers' block registry names, or every stream of a joint model). The probe runs eagerly, its hook in place only while it runs (a
  compiled expert keeps its graphs, which guard on hooks: no recompile per decision) and on this process only (a worker that splits the sequence over ranks cannot
  serve it: the router refuses ``first_block`` there).
- :func:`teacache_settings`: the model's TeaCache polynomial and warm-up: its directory's ``step_cache.json``
  (``{"teacache_coefficients": [...], "teacache_warmup": N, "source": "..."}``, as bench/fit_teacache.py
  writes it, and the built-in models of families without a published polynomial carry it), else the family's
  published one; :func:`teacache_source` says which, and a model with neither cannot serve teacache
  (:func:`cache_problem`): a polynomial fitted on another model would decide its steps on a guess.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from common.diffusion.parts.text import text_kwargs
from common.diffusion.model_info import STEP_CACHE_FILE, ModelInfo
from common.diffusion.policy import ModelInput, Policy
from common.diffusion.rows import forward_rows

SETTINGS_FILE = STEP_CACHE_FILE


def _directory_settings(info: ModelInfo) -> dict:
    path = info.path / SETTINGS_FILE
    data = json.loads(path.read_text()) if path.is_file() else {}
    return data if data.get("teacache_coefficients") else {}


def teacache_settings(info: ModelInfo) -> tuple[tuple[float, ...], int]:
    """(polynomial coefficients, warm-up steps) of TeaCache for this model directory; no coefficients (())
    where it has none (:func:`teacache_source` is None: requests are refused before they get here)."""
    data = _directory_settings(info)
    coefficients = data.get("teacache_coefficients", info.family.transformer.teacache_coefficients) or ()
    return tuple(float(c) for c in coefficients), int(data.get("teacache_warmup", info.family.transformer.teacache_warmup))


def teacache_source(info: ModelInfo) -> str | None:
    """Where this model's TeaCache polynomial comes from; None: it has none."""
    data = _directory_settings(info)
    if data:
        return data.get("source") or f"{info.path / SETTINGS_FILE}"
    return info.family.transformer.teacache_source if info.family.transformer.teacache_coefficients else None


def cache_problem(method: str, family, workers, info: ModelInfo | None = None) -> str | None:
    """Why the engine cannot serve step caching ``method`` for this family on these workers (``workers``: the
    engine's WorkerSpecs) and, given ``info``, this model directory; or None."""
    if method == "teacache" and not family.transformer.has_modulated_input:
        return f"{family.pipeline}'s binding has no timestep-modulated input, so it cannot serve teacache"
    if method == "teacache" and info is not None and teacache_source(info) is None:
        return (f"{family.pipeline} has no published TeaCache polynomial and this model directory has no "
                f"{SETTINGS_FILE}: fit one with bench/fit_teacache.py MODEL_DIR --write, or use first_block")
    if method == "first_block" and any(w.role == "denoise" and (w.ulysses > 1 or w.ring > 1) for w in workers):
        return ("first_block probes the first block on one device; a denoise worker that splits the sequence "
                "(ulysses, ring) cannot serve it (teacache can)")
    return None


@torch.no_grad()
def modulated_input(policy: Policy, name: str, x: ModelInput) -> torch.Tensor:
    """The modulated input [1, ...] of one branch piece ``x`` (every sample of a request shares it)."""
    f = policy.family
    t = f.condition.row_timesteps(policy.info, x.timestep, x.latents[:1], x.image)
    if t.dim() > 1:  # a timestep per token (Wan2.2 TI2V): the noisy tokens' one
        t = t.amax(dim=1)
    text = {k: v[:1] for k, v in text_kwargs(x.cond).items()}
    return f.transformer.modulated_input(policy.experts[name], t, text, x.guidance_rows(1)).float()


class _Probed(Exception):
    """Raised by the tap once the first block has run: the rest of the forward is not wanted."""


class _FirstBlockTap:
    """A forward hook on an expert's first block, in place for one probe only, that keeps the block's residual
    and stops the forward. (A compiled expert guards on its blocks' hooks: one left in place would make every
    graph compile again.)"""

    def __init__(self, part, block: torch.nn.Module):
        self.part, self.block = part, block
        self.residual: torch.Tensor | None = None

    @contextmanager
    def armed(self) -> Iterator[None]:
        self.residual = None
        handle = self.block.register_forward_hook(self._hook, with_kwargs=True)
        try:
            yield
        finally:
            handle.remove()

    def _hook(self, module, args, kwargs, output):
        self.residual = self.part.block_residual(self.block, args, kwargs, output)
        raise _Probed


_TAPS: "weakref.WeakKeyDictionary[torch.nn.Module, _FirstBlockTap]" = weakref.WeakKeyDictionary()


@torch.no_grad()
def first_block_residuals(policy: Policy, name: str, inputs: list[ModelInput]) -> list[torch.Tensor]:
    """The first block's residual [n, ...] (float32) of every row of each input (single-branch pieces)."""
    model = policy.experts[name]
    tap = _TAPS.get(model)
    if tap is None:
        part = policy.family.transformer
        tap = _TAPS[model] = _FirstBlockTap(part, part.blocks(model)[0])
    rows, blocks = policy.rows_of(name, inputs)
    try:
        with tap.armed(), torch.compiler.set_stance("force_eager"):
            forward_rows(policy.family, model, policy.lora_hooks[name], policy._shared_text(name), rows)
    except _Probed:
        pass
    residual, tap.residual = tap.residual, None
    if residual is None:
        raise RuntimeError(f"{type(model).__name__}: the forward never reached its first block")
    out, start = [None] * len(inputs), 0
    for i, _ in blocks:
        out[i] = residual[start : start + inputs[i].n]
        start += inputs[i].n
    return out
