"""Reading LoRA adapters for the Wan transformer(s): diffusers files, peft folders, or a trainer's tensors.

What comes out is the same either way: per expert, per target module (its
path inside the transformer), ``lora_A`` [r, in], ``lora_B`` [out, r] and the
module's ``alpha``. The effective scaling of a module is ``alpha / r`` (or
``alpha / sqrt(r)`` with rsLoRA), as peft computes it. Where the adapter says
nothing about alpha, alpha = r (scale 1), as diffusers assumes.

- diffusers (``WanPipeline.save_lora_weights``): ``pytorch_lora_weights.safetensors``
  with keys ``transformer.blocks.N.attn1.to_q.lora_A.weight``; ``transformer_2.`` keys
  are the second expert's. Rank and alpha in the header's ``lora_adapter_metadata``
  (``transformer.r``, ``transformer.lora_alpha``, ``rank_pattern``, ``alpha_pattern``),
  or per-module ``<module>.alpha`` keys.
- peft: a folder with ``adapter_config.json`` and ``adapter_model.safetensors``, keys
  optionally prefixed ``base_model.model.``.
- community formats (kohya / sd-scripts, the model's own checkpoint names as its trainers write them, XLabs,
  ...): what diffusers' ``<Pipeline>.lora_state_dict`` converts for the model's pipeline class (``pipeline``),
  which folds each module's alpha into its tensors; a file whose keys it does not convert is refused.

Only safetensors are read, and only below the allowed roots (:mod:`common.diffusion.weights`).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.protocol.messages import EXPERT_NAMES
from common.diffusion.weights import WeightsError, check_allowed, load_safetensors_file

DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
PEFT_CONFIG = "adapter_config.json"
PEFT_FILE = "adapter_model.safetensors"
METADATA_KEY = "lora_adapter_metadata"  # where diffusers writes the LoraConfig into the safetensors header
_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A\.weight|lora_B\.weight|alpha)$")


class LoraError(WeightsError):
    """The adapter cannot be used; the message says why (answered with HTTP 400)."""


@dataclass(frozen=True)
class LoraConfig:
    """The rank and alpha rules of an adapter (peft's LoraConfig fields that matter here)."""

    r: int | None = None
    lora_alpha: float | None = None
    rank_pattern: dict = field(default_factory=dict)
    alpha_pattern: dict = field(default_factory=dict)
    use_rslora: bool = False

    @classmethod
    def from_dict(cls, d: dict) -> "LoraConfig":
        if d.get("use_dora"):
            raise LoraError("DoRA adapters are not supported")
        if d.get("lora_bias"):
            raise LoraError("adapters with a lora_B bias are not supported")
        return cls(d.get("r"), d.get("lora_alpha"), dict(d.get("rank_pattern") or {}),
                   dict(d.get("alpha_pattern") or {}), bool(d.get("use_rslora", False)))

    def scaling(self, module: str, rank: int, alpha_key: float | None) -> float:
        """peft's ``lora_alpha / r`` for ``module``, its patterns applied (rank checked against the tensors)."""
        r = _pattern_value(self.rank_pattern, module, self.r)
        if r is not None and int(r) != rank:
            raise LoraError(f"{module}: the adapter's config says rank {r}, its tensors have rank {rank}")
        alpha = _pattern_value(self.alpha_pattern, module, self.lora_alpha)
        if alpha is None:
            alpha = alpha_key if alpha_key is not None else rank
        if not math.isfinite(float(alpha)):
            raise LoraError(f"{module}: alpha {alpha} is not finite")
        return float(alpha) / (math.sqrt(rank) if self.use_rslora else rank)


def _pattern_value(patterns: dict, module: str, default):
    """peft's rule: a pattern applies to a module whose path ends with it (after a dot)."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


@dataclass
class ExpertLora:
    """One expert's part of an adapter: module path -> (lora_A, lora_B, scaling)."""

    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]


def parse_state(state: dict[str, torch.Tensor], config: LoraConfig, default_expert: str = "transformer",
                swap_experts: bool = False) -> dict[str, ExpertLora]:
    """Group a LoRA state dict by expert and module; every key must be a LoRA key."""
    parts: dict[str, dict[str, dict[str, torch.Tensor]]] = {}
    for key, tensor in state.items():
        expert, rest = _expert_of(key.removeprefix("base_model.model."), default_expert)
        if swap_experts and expert == "transformer":
            expert = "transformer_2"
        m = _KEY.match(rest)
        if m is None:
            raise LoraError(f"{key}: not a LoRA key (expected <module>.lora_A.weight, .lora_B.weight or .alpha)")
        parts.setdefault(expert, {}).setdefault(m["module"], {})[m["part"]] = tensor
    if not parts:
        raise LoraError("the adapter holds no tensors")
    return {expert: ExpertLora({mod: _module(mod, p, config) for mod, p in sorted(mods.items())})
            for expert, mods in parts.items()}


def _expert_of(key: str, default: str) -> tuple[str, str]:
    for expert in EXPERT_NAMES[::-1]:  # "transformer_2." before its prefix "transformer"
        if key.startswith(expert + "."):
            return expert, key[len(expert) + 1:]
    return default, key


def _module(module: str, p: dict[str, torch.Tensor], config: LoraConfig) -> tuple[torch.Tensor, torch.Tensor, float]:
    a, b = p.get("lora_A.weight"), p.get("lora_B.weight")
    if a is None or b is None:
        raise LoraError(f"{module}: needs both lora_A.weight and lora_B.weight")
    if a.dim() > 2 and b.dim() > 2:  # peft's pair for a convolution: [r, in, *kernel] / [out, r, 1, ...]
        raise LoraError(f"{module}: lora_A {list(a.shape)} / lora_B {list(b.shape)} adapt a convolution; adapters "
                        "apply to Linear layers only")
    if a.dim() != 2 or b.dim() != 2 or b.shape[1] != a.shape[0]:
        raise LoraError(f"{module}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not form a low-rank pair")
    alpha_key = p.get("alpha")
    alpha = float(alpha_key.reshape(-1)[0]) if alpha_key is not None and alpha_key.numel() == 1 else None
    return a, b, config.scaling(module, a.shape[0], alpha)


def lora_sha256(parsed: dict[str, ExpertLora]) -> str:
    """SHA-256 of an adapter: every expert's modules in order, their shapes, scalings and float32 values.
    Needs no model, so a trainer can compute it on the state dict it pushes and compare it with the engine's."""
    digest = hashlib.sha256()
    for expert in sorted(parsed):
        for path, (a, b, scaling) in sorted(parsed[expert].modules.items()):
            for t in (a, b):
                digest.update(f"{expert}.{path}:{list(t.shape)}:{scaling!r}".encode())
                digest.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()


def read_lora(path: str, roots: list[str] | None, swap_experts: bool = False,
              pipeline: str | None = None) -> dict[str, ExpertLora]:
    """An adapter from a diffusers LoRA file or folder, or a peft adapter folder, below ``roots``; with
    ``pipeline`` (the model's diffusers pipeline class), also a file in a community format it converts."""
    given = Path(path).expanduser()
    real_roots = None if roots is None else [Path(r).resolve() for r in roots]
    check_allowed(given, real_roots)
    if not given.exists():
        raise LoraError(f"{given} does not exist")
    if given.is_dir() and (given / PEFT_CONFIG).is_file():
        try:
            config = LoraConfig.from_dict(json.loads((given / PEFT_CONFIG).read_text()))
        except (ValueError, TypeError) as e:
            raise LoraError(f"{given / PEFT_CONFIG}: {e}") from None
        return parse_state(load_safetensors_file(given / PEFT_FILE, real_roots), config, swap_experts=swap_experts)
    file = given / DIFFUSERS_FILE if given.is_dir() else given
    state = load_safetensors_file(file, real_roots)
    if pipeline and any(_expert_of(k, "")[0] == "" for k in state):
        state = community_to_diffusers(state, pipeline)
    return _parse_diffusers(state, _header_metadata(file), swap_experts)


def community_to_diffusers(state: dict[str, torch.Tensor], pipeline: str) -> dict[str, torch.Tensor]:
    """A community-format adapter's tensors as diffusers' loader of ``pipeline`` converts them (diffusers'
    names, ``transformer.``-prefixed, alphas folded in); unchanged where it converts nothing."""
    import diffusers

    convert = getattr(getattr(diffusers, pipeline, None), "lora_state_dict", None)
    if convert is None:
        return state
    try:
        out = convert(dict(state))
    except Exception as e:  # each converter raises its own kind on keys it does not expect
        raise LoraError(f"not a LoRA format {pipeline}'s loader reads ({type(e).__name__}: {e})") from None
    out = out[0] if isinstance(out, tuple) else out
    return {k if _expert_of(k, "")[0] else f"transformer.{k}": v for k, v in out.items()}


def _header_metadata(file: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(file.resolve()), framework="pt") as f:
        raw = (f.metadata() or {}).get(METADATA_KEY)
    try:
        return json.loads(raw) if raw else {}
    except ValueError as e:
        raise LoraError(f"{file}: unreadable {METADATA_KEY}: {e}") from None


def _parse_diffusers(state: dict[str, torch.Tensor], metadata: dict, swap: bool) -> dict[str, ExpertLora]:
    """Each expert's keys with that expert's config (diffusers prefixes the metadata with the expert)."""
    orphans = sorted(k for k in state if _expert_of(k, "")[0] == "")
    if orphans:
        raise LoraError(f"keys outside transformer. and transformer_2.: {', '.join(orphans[:3])}")
    by_expert = {e: {k: v for k, v in state.items() if _expert_of(k, "")[0] == e} for e in EXPERT_NAMES}
    if swap and by_expert["transformer_2"]:
        raise LoraError("load_into_transformer_2: the file already holds transformer_2 keys")
    out: dict[str, ExpertLora] = {}
    for expert, mine in by_expert.items():
        if mine:
            config = LoraConfig.from_dict({k[len(expert) + 1:]: v for k, v in metadata.items()
                                           if k.startswith(expert + ".")})
            out.update(parse_state(mine, config, swap_experts=swap))
    if not out:
        raise LoraError("the adapter holds no tensors")
    return out
