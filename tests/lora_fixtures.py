"""LoRA adapters for the tiny models, written by peft's and diffusers' own savers, and diffusers' reference output.

Every adapter is deterministic (a seed sets all its values) and changes the model's output: peft's default
initialisation leaves ``lora_B`` at zero, so the factors are overwritten with seeded random values.

- :func:`make_diffusers_lora`: ``pytorch_lora_weights.safetensors`` as ``WanPipeline.save_lora_weights`` writes it
  (keys ``transformer.blocks.N....lora_A.weight``), with or without diffusers' ``lora_adapter_metadata`` header.
- :func:`make_peft_lora`: a peft folder (``adapter_config.json`` + ``adapter_model.safetensors``) as
  ``PeftModel.save_pretrained`` writes it (keys ``base_model.model.blocks....``), optionally without the prefix.
- :func:`make_two_expert_lora`: one diffusers file with ``transformer.`` and ``transformer_2.`` keys, plus the
  second expert's part on its own (as ``transformer.`` keys) for diffusers' ``load_into_transformer_2``.
- :func:`diffusers_lora_output`: ``WanPipeline`` + ``load_lora_weights`` + ``set_adapters``, the same settings and
  seed as the engine (and as ``conftest.diffusers_generate``).

Every maker follows the model directory's family (``model_index.json``'s pipeline, ``transformer/config.json``'s
class): on a ``tiny-sd3`` directory :func:`make_diffusers_lora` (or :func:`make_sd3_diffusers_lora`) writes with
``StableDiffusion3Pipeline.save_lora_weights`` (keys ``transformer.transformer_blocks.N.attn.to_q.lora_A.weight``),
:func:`make_peft_lora` (:func:`make_sd3_peft_lora`) wraps an ``SD3Transformer2DModel``, and :func:`diffusers_twin`
saves with the adapter's own pipeline. SD3's reference is :func:`sd3_lora_output` (``StableDiffusion3Pipeline`` +
``load_lora_weights`` + ``set_adapters``); :data:`SD3_ATTN` is Flow-GRPO's SD3 target set (``SD3.transformer.lora_targets``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

ATTN = ["to_q", "to_k", "to_v", "to_out.0"]  # both attentions of every block
FFN = ["ffn.net.0.proj", "ffn.net.2"]
DIFFUSERS_FILE = "pytorch_lora_weights.safetensors"
# SD3: both streams' joint-attention projections of every block (Flow-GRPO's set).
SD3_ATTN = ["attn.add_k_proj", "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "attn.to_k", "attn.to_out.0",
            "attn.to_q", "attn.to_v"]


@dataclass
class Adapter:
    """What a helper wrote: the path to hand to the engine and to diffusers, and what is in it."""

    path: Path
    rank: int
    alpha: float
    target_modules: list[str]
    # Per expert ("transformer", "transformer_2"): peft's state dict, keys like ``blocks.0.attn1.to_q.lora_A.weight``.
    state_dicts: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    # For a two-expert file: the second expert's part alone, keys ``transformer.``, for load_into_transformer_2.
    expert_2_path: Path | None = None
    # The diffusers pipeline class of the model it was made for (its saver writes diffusers_twin).
    pipeline: str = "WanPipeline"

    @property
    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state_dicts["transformer"]


def lora_config(rank: int, alpha: float, target_modules, rank_pattern=None, alpha_pattern=None):
    import peft

    return peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(target_modules), init_lora_weights=True,
                           rank_pattern=dict(rank_pattern or {}), alpha_pattern=dict(alpha_pattern or {}))


def pipeline_name(model_dir: Path) -> str:
    """The model directory's diffusers pipeline class name (``WanPipeline``, ``StableDiffusion3Pipeline``)."""
    return json.loads((Path(model_dir) / "model_index.json").read_text())["_class_name"]


def _pipeline_class(name: str):
    """The class whose ``save_lora_weights`` writes ``name``'s file: the pipeline's own, else (a pipeline diffusers
    gives no LoRA loader: HunyuanVideo 1.5's) HunyuanVideoPipeline's, the transformer-only ``transformer.`` layout
    every such saver writes."""
    import diffusers

    cls = getattr(diffusers, name)
    return cls if hasattr(cls, "save_lora_weights") else diffusers.HunyuanVideoPipeline


def _load_transformer(model_dir: Path, expert: str):
    """The directory's transformer ``expert`` (its class from its config: Wan's or SD3's), in float32."""
    import diffusers

    cls_name = json.loads((Path(model_dir) / expert / "config.json").read_text())["_class_name"]
    # A str, not a Path: peft's model card records it (a Path is written as a YAML object it cannot read back).
    return getattr(diffusers, cls_name).from_pretrained(str(model_dir), subfolder=expert, dtype=torch.float32)


def _randomise_lora(model: torch.nn.Module, seed: int, strength: float) -> None:
    """Seeded values for every LoRA factor, in name order: A ~ N(0, 1/in), B ~ N(0, strength^2 / r).

    With alpha = r the delta B A has entries of about ``strength / sqrt(in)``, a visible but moderate change.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if ".lora_A." in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            elif ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * strength / p.shape[1] ** 0.5)


def randomise_lora(model: torch.nn.Module, seed: int, strength: float = 0.3) -> None:
    """Seeded values for every LoRA factor of ``model`` (a trainer's peft layers too): see :func:`_randomise_lora`."""
    _randomise_lora(model, seed, strength)


def lora_state_dict(model_dir: Path, rank: int, alpha: float, target_modules, seed: int,
                    expert: str = "transformer", strength: float = 0.3, rank_pattern=None, alpha_pattern=None):
    """peft's state dict of a seeded adapter on ``expert`` (``get_peft_model_state_dict``) and its LoraConfig."""
    import peft

    transformer = _load_transformer(model_dir, expert)
    config = lora_config(rank, alpha, target_modules, rank_pattern, alpha_pattern)
    transformer.add_adapter(config)
    _randomise_lora(transformer, seed, strength)
    sd = peft.get_peft_model_state_dict(transformer)
    sd = {k: v.detach().clone().contiguous() for k, v in sd.items()}
    assert sd and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in sd), list(sd)[:4]
    return sd, config


def _metadata(config) -> dict:
    """What a trainer hands diffusers as ``transformer_lora_adapter_metadata``: the LoraConfig as a dict."""
    return config.to_dict()


def make_diffusers_lora(model_dir: Path, out_dir: Path, rank: int, alpha: float, target_modules, seed: int,
                        expert: str = "transformer", with_metadata: bool = True, strength: float = 0.3,
                        rank_pattern=None, alpha_pattern=None) -> Adapter:
    """``out_dir/pytorch_lora_weights.safetensors`` via the family's ``save_lora_weights`` (``WanPipeline``,
    ``StableDiffusion3Pipeline``; keys ``transformer.``).

    ``expert`` says which transformer of the model the adapter is made for (its shapes); the file's keys are
    ``transformer.`` either way, as diffusers writes them (load it with ``load_into_transformer_2`` for the second).
    Without metadata diffusers (and so the engine) takes alpha = rank.
    """
    pipeline = pipeline_name(model_dir)
    sd, config = lora_state_dict(model_dir, rank, alpha, target_modules, seed, expert, strength, rank_pattern,
                                 alpha_pattern)
    out_dir = Path(out_dir)
    _pipeline_class(pipeline).save_lora_weights(
        out_dir, transformer_lora_layers=sd, transformer_lora_adapter_metadata=_metadata(config) if with_metadata
        else None)
    return Adapter(out_dir, rank, alpha if with_metadata else rank, list(target_modules), {"transformer": sd},
                   pipeline=pipeline)


def make_two_expert_lora(model_dir: Path, out_dir: Path, parts: dict[str, tuple[int, float, list[str]]],
                         seed: int, strength: float = 0.3) -> Adapter:
    """One diffusers file with a part per expert: ``parts`` maps ``transformer``/``transformer_2`` to
    (rank, alpha, target_modules). Written by diffusers' own packer (``_save_lora_weights``, which
    ``save_lora_weights`` calls with the transformer alone), with each part's metadata under its prefix.

    ``expert_2_path`` holds the ``transformer_2`` part alone as ``transformer.`` keys: diffusers loads only the
    ``transformer.`` keys of a file, so its reference loads that file with ``load_into_transformer_2=True``.
    """
    from diffusers import WanPipeline

    out_dir = Path(out_dir)
    layers, metadata, sds = {}, {}, {}
    for i, (expert, (rank, alpha, targets)) in enumerate(sorted(parts.items())):
        sd, config = lora_state_dict(model_dir, rank, alpha, targets, seed + 1000 * i, expert, strength)
        layers[expert], metadata[expert], sds[expert] = sd, _metadata(config), sd
    WanPipeline._save_lora_weights(save_directory=out_dir, lora_layers=layers, lora_metadata=metadata)
    expert_2 = None
    if "transformer_2" in parts:
        expert_2 = out_dir.parent / f"{out_dir.name}-expert2"
        WanPipeline.save_lora_weights(expert_2, transformer_lora_layers=sds["transformer_2"],
                                      transformer_lora_adapter_metadata=metadata["transformer_2"])
    first = parts.get("transformer") or parts["transformer_2"]
    return Adapter(out_dir, first[0], first[1], list(first[2]), sds, expert_2)


def make_peft_lora(model_dir: Path, out_dir: Path, rank: int, alpha: float, target_modules, seed: int,
                   strength: float = 0.3, prefixed: bool = True, rank_pattern=None, alpha_pattern=None) -> Adapter:
    """A peft folder from ``PeftModel.save_pretrained``: ``adapter_config.json`` + ``adapter_model.safetensors``
    (keys ``base_model.model.blocks....``, SD3's ``base_model.model.transformer_blocks....``); ``prefixed=False``
    rewrites the file with the bare keys."""
    import peft
    from safetensors.torch import load_file, save_file

    transformer = _load_transformer(model_dir, "transformer")
    config = lora_config(rank, alpha, target_modules, rank_pattern, alpha_pattern)
    model = peft.get_peft_model(transformer, config)
    _randomise_lora(model, seed, strength)
    out_dir = Path(out_dir)
    model.save_pretrained(out_dir)
    weights = out_dir / "adapter_model.safetensors"
    assert (out_dir / "adapter_config.json").is_file() and weights.is_file()
    saved = load_file(weights)
    if not prefixed:
        save_file({k.removeprefix("base_model.model."): v for k, v in saved.items()}, weights,
                  metadata={"format": "pt"})
    sd = {k.removeprefix("base_model.model."): v.clone() for k, v in saved.items()}
    return Adapter(out_dir, rank, alpha, list(target_modules), {"transformer": sd}, pipeline=pipeline_name(model_dir))


def peft_config_json(adapter: Adapter) -> dict:
    return json.loads((adapter.path / "adapter_config.json").read_text())


def diffusers_twin(adapter: Adapter, out_dir: Path) -> Path:
    """A peft folder's tensors and LoraConfig saved by diffusers (which reads no peft folder): its reference,
    written by the adapter's own pipeline (``WanPipeline``, ``StableDiffusion3Pipeline``)."""
    out_dir = Path(out_dir)
    if not (out_dir / DIFFUSERS_FILE).is_file():
        cfg = peft_config_json(adapter)
        config = lora_config(cfg["r"], cfg["lora_alpha"], cfg["target_modules"], cfg.get("rank_pattern"),
                             cfg.get("alpha_pattern"))
        _pipeline_class(adapter.pipeline).save_lora_weights(out_dir, transformer_lora_layers=adapter.state_dict,
                                                            transformer_lora_adapter_metadata=config.to_dict())
    return out_dir


def write_raw_lora(path: Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> Path:
    """A diffusers-style file with exactly these tensors (for hostile inputs: wrong shapes, NaN, bad modules)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    header = {"format": "pt"}
    if metadata is not None:
        header["lora_adapter_metadata"] = json.dumps(metadata)
    save_file({k: v.contiguous() for k, v in tensors.items()}, path / DIFFUSERS_FILE, metadata=header)
    return path


# --- diffusers' reference -----------------------------------------------------------------------------------

_PIPES: dict[str, object] = {}


def _lora_pipe(model_dir: Path):
    """A WanPipeline of its own per directory (conftest's cached one stays adapter-free)."""
    from conftest import diffusers_pipe

    return diffusers_pipe(model_dir, cache=_PIPES)


def _activate(pipe, names: list[str], scales: list[float]) -> None:
    """``pipe.set_adapters(names, scales)``; per expert when an adapter sits on one expert only (the pipeline's
    own set_adapters asks every transformer for every name)."""
    experts = [m for m in (pipe.transformer, getattr(pipe, "transformer_2", None)) if m is not None]
    held = [set(getattr(m, "peft_config", {})) for m in experts]
    if all(set(names) <= h for h in held):
        pipe.set_adapters(names, scales)
        return
    for m, h in zip(experts, held):
        mine = [(n, s) for n, s in zip(names, scales) if n in h]
        if mine:
            m.set_adapters([n for n, _ in mine], [s for _, s in mine])


def diffusers_lora_output(model_dir: Path, adapters, *, prompt, seed, height, width, num_frames,
                          num_inference_steps, guidance_scale, negative_prompt="", output_type="np",
                          guidance_scale_2=None) -> torch.Tensor:
    """diffusers' output with LoRA adapters.

    ``adapters``: (path, name, scale, load_into_transformer_2) tuples; a name may come twice (a part per expert,
    as diffusers loads a two-expert adapter); each name is activated once with its scale. Frames [F, H, W, 3] for
    ``output_type="np"``, latents [16, F', H', W'] for ``"latent"``. The pipeline's adapters are unloaded after.
    """
    pipe = _lora_pipe(Path(model_dir))
    names, scales = [], []
    try:
        for path, name, scale, into_2 in adapters:  # a load that fails half-way is unloaded too (finally)
            kw = {"load_into_transformer_2": True} if into_2 else {}
            pipe.load_lora_weights(str(path), adapter_name=name, **kw)
            if name not in names:
                names.append(name)
                scales.append(float(scale))
        if names:
            _activate(pipe, names, scales)
        kw = {} if guidance_scale_2 is None else {"guidance_scale_2": guidance_scale_2}
        with torch.no_grad():
            out = pipe(prompt=prompt, negative_prompt=negative_prompt, height=height, width=width,
                       num_frames=num_frames, num_inference_steps=num_inference_steps,
                       guidance_scale=guidance_scale, generator=torch.Generator("cpu").manual_seed(seed),
                       output_type=output_type, **kw).frames
    finally:
        if adapters:
            pipe.unload_lora_weights()
    return torch.from_numpy(out[0]) if output_type == "np" else out[0]


# --- SD3 adapters ----------------------------------------------------------------------------------------------

SD3_PIPELINE = "StableDiffusion3Pipeline"


def _check_sd3(model_dir: Path) -> None:
    if pipeline_name(model_dir) != SD3_PIPELINE:
        raise ValueError(f"{model_dir} is a {pipeline_name(model_dir)} directory, not {SD3_PIPELINE}")


def make_sd3_diffusers_lora(model_dir: Path, out_dir: Path, rank: int, alpha: float, target_modules=tuple(SD3_ATTN),
                            seed: int = 0, with_metadata: bool = True, strength: float = 0.3, rank_pattern=None,
                            alpha_pattern=None) -> Adapter:
    """An SD3 adapter written by ``StableDiffusion3Pipeline.save_lora_weights`` (keys
    ``transformer.transformer_blocks.N.attn.to_q.lora_A.weight``; metadata ``transformer.r`` ... under
    ``lora_adapter_metadata`` unless ``with_metadata=False``): :func:`make_diffusers_lora` on an SD3 directory."""
    _check_sd3(model_dir)
    return make_diffusers_lora(model_dir, out_dir, rank, alpha, target_modules, seed, with_metadata=with_metadata,
                               strength=strength, rank_pattern=rank_pattern, alpha_pattern=alpha_pattern)


def make_sd3_peft_lora(model_dir: Path, out_dir: Path, rank: int, alpha: float, target_modules=tuple(SD3_ATTN),
                       seed: int = 0, strength: float = 0.3, prefixed: bool = True) -> Adapter:
    """A peft folder of an adapter on ``SD3Transformer2DModel`` (``PeftModel.save_pretrained``):
    :func:`make_peft_lora` on an SD3 directory."""
    _check_sd3(model_dir)
    return make_peft_lora(model_dir, out_dir, rank, alpha, target_modules, seed, strength=strength, prefixed=prefixed)


# --- SD3: diffusers' reference ---------------------------------------------------------------------------------

_SD3_PIPES: dict[str, object] = {}


def sd3_pipe(model_dir: Path):
    """``StableDiffusion3Pipeline.from_pretrained(model_dir)`` in float32, one per directory."""
    from diffusers import StableDiffusion3Pipeline

    from conftest import reference_pipeline

    key = str(model_dir)
    if key not in _SD3_PIPES:
        _SD3_PIPES[key] = reference_pipeline(StableDiffusion3Pipeline.from_pretrained(Path(model_dir),
                                                                                      dtype=torch.float32))
    return _SD3_PIPES[key]


def sd3_lora_output(model_dir: Path, adapters, *, prompt, seed, height, width, num_inference_steps, guidance_scale,
                    negative_prompt="", max_sequence_length=256, output_type="np", num_frames=1) -> torch.Tensor:
    """diffusers' SD3 output with LoRA adapters: ``load_lora_weights(path, adapter_name=name)`` per
    ``(path, name, scale)``, ``set_adapters(names, scales)``, then the pipeline at the engine's seed and settings.

    Frames [1, H, W, 3] (one image, as the engine's [F, H, W, 3]) for ``output_type="np"``, latents [16, H', W']
    for ``"latent"``. No adapters: the base model. The pipeline's adapters are unloaded after.
    """
    if num_frames != 1:
        raise ValueError("SD3 makes one image")
    pipe = sd3_pipe(Path(model_dir))
    names, scales = [], []
    try:
        for path, name, scale in adapters:
            pipe.load_lora_weights(str(path), adapter_name=name)
            names.append(name)
            scales.append(float(scale))
        if names:
            pipe.set_adapters(names, scales)
        with torch.no_grad():
            out = pipe(prompt=prompt, negative_prompt=negative_prompt, height=height, width=width,
                       num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                       max_sequence_length=max_sequence_length, generator=torch.Generator("cpu").manual_seed(seed),
                       output_type=output_type).images
    finally:
        if adapters:
            pipe.unload_lora_weights()
    return torch.from_numpy(out) if output_type == "np" else out[0]
