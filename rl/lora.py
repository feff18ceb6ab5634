"""Train a LoRA on the trainer's copy of the policy and hand it to the engine.

    from rl import TrainerPolicy
    from rl.lora import add_lora, lora_parameters, push_lora, save_lora, set_lora_scale

    policy = TrainerPolicy(client.health()["model"])
    add_lora(policy, rank=8)                       # base frozen, LoRA on the family's default targets
    optim = torch.optim.Adam(lora_parameters(policy), lr=1e-3)
    ...
    push_lora(client, policy, "mine")              # from memory, over the engine's wire
    client.rollout(prompt, lora_name="mine", return_trajectory=True)

The adapter is peft's LoRA, added with diffusers' own ``add_adapter``
(``PeftAdapterMixin``) to the transformer inside :class:`rl.TrainerPolicy`, so
``policy.log_probs`` runs it: for a Linear it adds ``scale * (alpha / r) * B (A x)``
to the output, the delta the engine adds per sample for a request with
``lora_name`` and ``lora_scale``. A request's ``lora_scale`` must be mirrored on the
trainer with :func:`set_lora_scale` before recomputing its log-probs.

peft initialises ``lora_B`` to zero: a fresh adapter equals the base model.

Family-generic: the default target modules are the served family's (the transformer part's ``lora_targets``: Wan's
attention projections, SD3's joint-attention projections of both streams as Flow-GRPO trains them), and
:func:`save_lora` writes the file with that family's diffusers pipeline's ``save_lora_weights``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from common.diffusion.parts.transformer import ATTENTION_PROJECTIONS
from common.diffusion.lora_format import LoraConfig as EngineLoraConfig
from common.diffusion.lora_format import lora_sha256 as adapter_sha256
from common.diffusion.lora_format import parse_state
from rl.policy import TrainerPolicy

# The attention projections of every block (Wan: self- and cross-attention, as diffusers' Wan LoRA scripts
# target): every family's default unless its binding names its own (the transformer part's ``lora_targets``).
DEFAULT_TARGETS: tuple[str, ...] = ATTENTION_PROJECTIONS
DEFAULT_ADAPTER = "default"
# peft names every adapter parameter with this prefix (lora_A, lora_B, ...).
_LORA_PREFIX = "lora_"


def _expert(policy: TrainerPolicy, expert: str):
    if expert not in policy.experts:
        raise ValueError(f"no expert {expert!r} in this model (has {sorted(policy.experts)})")
    return policy.experts[expert]


def freeze_base(policy: TrainerPolicy) -> None:
    """Turn gradients off for every parameter of every expert that is not a LoRA parameter."""
    for model in policy.experts.values():
        for name, p in model.named_parameters():
            if _LORA_PREFIX not in name:
                p.requires_grad_(False)


def add_lora(
    policy: TrainerPolicy,
    rank: int,
    alpha: float | None = None,
    target_modules: Iterable[str] | None = None,
    expert: str = "transformer",
    seed: int | None = None,
    adapter_name: str = DEFAULT_ADAPTER,
) -> LoraConfig:
    """Freeze the base weights of every expert and add a trainable LoRA to ``expert``.

    ``alpha`` defaults to ``rank`` (scaling 1). ``target_modules`` defaults to the family's
    (``policy.info.family.transformer.lora_targets``; :data:`DEFAULT_TARGETS` for Wan). ``seed`` makes ``lora_A``'s random
    initialisation reproducible without touching the global RNG. No dropout, so the
    trainer's forward stays the deterministic function the engine evaluates.
    Returns the adapter's config (also ``policy.experts[expert].peft_config[adapter_name]``).
    """
    if rank < 1:
        raise ValueError(f"rank must be >= 1, got {rank}")
    model = _expert(policy, expert)
    if target_modules is None:
        target_modules = policy.info.family.transformer.lora_targets
    config = LoraConfig(r=rank, lora_alpha=rank if alpha is None else alpha, lora_dropout=0.0,
                        init_lora_weights=True, target_modules=list(target_modules))
    freeze_base(policy)
    if seed is None:
        model.add_adapter(config, adapter_name=adapter_name)
    else:
        with torch.random.fork_rng(devices=[]):  # peft builds the layers on the CPU, then moves them
            torch.manual_seed(seed)
            model.add_adapter(config, adapter_name=adapter_name)
    freeze_base(policy)
    return model.peft_config[adapter_name]


def lora_config(policy: TrainerPolicy, expert: str = "transformer", adapter_name: str = DEFAULT_ADAPTER) -> LoraConfig:
    model = _expert(policy, expert)
    configs = getattr(model, "peft_config", {}) if getattr(model, "_hf_peft_config_loaded", False) else {}
    if adapter_name not in configs:
        raise ValueError(f"{expert} has no LoRA adapter {adapter_name!r}; call add_lora first")
    return configs[adapter_name]


def lora_parameters(policy: TrainerPolicy, expert: str | None = None) -> list[torch.nn.Parameter]:
    """The trainable (LoRA) parameters of ``expert``, or of every expert: what the optimiser gets."""
    models = [_expert(policy, expert)] if expert else list(policy.experts.values())
    return [p for m in models for n, p in m.named_parameters() if _LORA_PREFIX in n and p.requires_grad]


def lora_state_dict(policy: TrainerPolicy, expert: str = "transformer",
                    adapter_name: str = DEFAULT_ADAPTER) -> dict[str, torch.Tensor]:
    """peft's ``get_peft_model_state_dict``: names like ``blocks.0.attn1.to_q.lora_A.weight`` (Wan) or
    ``transformer_blocks.0.attn.to_q.lora_A.weight`` (SD3); detached CPU copies."""
    lora_config(policy, expert, adapter_name)
    sd = get_peft_model_state_dict(_expert(policy, expert), adapter_name=adapter_name)
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}


def _rank_alpha(config: LoraConfig) -> tuple[int, float]:
    if config.rank_pattern or config.alpha_pattern or config.use_rslora or config.use_dora:
        raise ValueError("only a plain LoRA (one rank and alpha, no rslora/DoRA) can be pushed to the engine")
    return int(config.r), float(config.lora_alpha)


def push_lora(client, policy: TrainerPolicy, lora_name: str, expert: str = "transformer",
              adapter_name: str = DEFAULT_ADAPTER, via="http") -> dict:
    """Send the adapter from memory to the engine as ``lora_name`` (for ``module=expert``); returns its answer.

    ``via``: ``"http"`` (in the request body; the router keeps it for workers that restart), ``"shm"``
    (shared-memory buckets, same host, needs ``--weight-sync-from-memory``) or an open
    :class:`rl.WeightsGroup` (a broadcast). A worker that restarts lacks an adapter sent the last two
    ways and is stale until the next push.
    """
    rank, alpha = _rank_alpha(lora_config(policy, expert, adapter_name))
    state = lora_state_dict(policy, expert, adapter_name)
    if via == "http":
        return client.load_lora_adapter_from_tensors(lora_name, state, rank=rank, alpha=alpha, module=expert)
    lora = {"lora_name": lora_name, "rank": rank, "alpha": alpha}
    if via == "shm":
        return client.update_weights_from_tensors(state, module=expert, lora=lora)
    if hasattr(via, "push"):
        return via.push(state, module=expert, lora=lora)
    raise ValueError(f"via: 'http', 'shm' or a WeightsGroup, not {via!r}")


def lora_sha256(policy: TrainerPolicy, expert: str = "transformer", adapter_name: str = DEFAULT_ADAPTER) -> str:
    """The sha256 the engine reports for this adapter once pushed (``/v1/lora_adapters``), computed here."""
    rank, alpha = _rank_alpha(lora_config(policy, expert, adapter_name))
    parsed = parse_state(lora_state_dict(policy, expert, adapter_name), EngineLoraConfig(r=rank, lora_alpha=alpha),
                         default_expert=expert)
    return adapter_sha256(parsed)


def lora_metadata(policy: TrainerPolicy, expert: str = "transformer", adapter_name: str = DEFAULT_ADAPTER) -> dict:
    """The adapter's ``LoraConfig`` as a dict: diffusers' ``transformer_lora_adapter_metadata``."""
    return lora_config(policy, expert, adapter_name).to_dict()


def save_lora(policy: TrainerPolicy, directory: str | Path, expert: str = "transformer",
              adapter_name: str = DEFAULT_ADAPTER, weight_name: str | None = None) -> Path:
    """Write the adapter as the family's diffusers pipeline saves LoRA weights (``WanPipeline``,
    ``StableDiffusion3Pipeline``: ``save_lora_weights``), with its config as metadata.

    The file holds ``transformer.``-prefixed keys whichever expert it came from (diffusers'
    Wan format has no ``transformer_2`` prefix): an adapter of ``transformer_2`` is loaded
    back with ``load_into_transformer_2=True``. The metadata header is diffusers' own
    (``lora_adapter_metadata``: the LoraConfig under ``transformer.``), so the pipeline's
    ``load_lora_weights`` and the engine read the same rank and alpha. Returns the safetensors file's path.
    """
    import diffusers
    from diffusers.loaders.lora_base import LORA_WEIGHT_NAME_SAFE

    pipeline = getattr(diffusers, policy.info.family.pipeline)
    directory = Path(directory)
    pipeline.save_lora_weights(directory, transformer_lora_layers=lora_state_dict(policy, expert, adapter_name),
                               transformer_lora_adapter_metadata=lora_metadata(policy, expert, adapter_name),
                               weight_name=weight_name, safe_serialization=True)
    return directory / (weight_name or LORA_WEIGHT_NAME_SAFE)


def set_lora_scale(policy: TrainerPolicy, scale: float, expert: str | None = None,
                   adapter_name: str = DEFAULT_ADAPTER) -> None:
    """Run the adapter at ``scale`` (a request's ``lora_scale``) on ``expert``, or on every expert that has it.

    diffusers' ``set_adapters([adapter], [scale])``: each peft LoRA layer's scaling becomes
    ``scale * alpha / r``. The parameters stay trainable.
    """
    names = [expert] if expert else [n for n, m in policy.experts.items()
                                     if adapter_name in getattr(m, "peft_config", {})]
    if not names:
        raise ValueError(f"no expert has a LoRA adapter {adapter_name!r}")
    for name in names:
        lora_config(policy, name, adapter_name)
        policy.experts[name].set_adapters([adapter_name], [float(scale)])
