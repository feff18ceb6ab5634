"""Each family's experts through ``torch.compile``: compiled in place, warmed up at a latent shape.

:func:`compile_experts` compiles each expert with ``nn.Module.compile``, so every call site
(``model(hidden_states=..., ...)``) and every hook keeps working. Only the batch dimension is dynamic: a
latent shape compiles twice (batch 1, which torch always specialises, and any larger batch), whatever the
batch sizes continuous batching makes, and another latent shape gets graphs of its own (graphs generic in
every dimension took several times longer to compile on the tiny model). A family whose inputs vary in
another dimension between requests of one shape says so (its transformer part's ``compile_dynamic``: Qwen-Image's texts,
each its prompt's own length), and that dimension is dynamic too.

What a forward reads from Python per request (each row's LoRA adapter, the shared-text plan) is an
opaque op in the graph (:mod:`common.diffusion.opaque`), so a new mix of adapters or texts compiles nothing;
whether a plan or an adapter is active is traced, a guard and a graph each. LoRA hooks added after the
compile are guarded on too: an adapter that hooks new modules makes the graphs it meets compile once more.
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from common.diffusion.policy import Policy

# Graphs of one forward (dynamo counts per code object, every shape together): up to 8 per latent shape, as
# (batch 1 or larger) x (a shared-text plan or not) x (adapters applying or not); past it dynamo runs that
# code eagerly (and says so).
RECOMPILE_LIMIT = 64


class CompileError(RuntimeError):
    """torch.compile cannot be used here, or failed on the experts; they are left eager."""


def compile_experts(target: "Policy | dict[str, torch.nn.Module]", mode: str | None = None,
                    options: dict | None = None, backend: str | Callable = "inductor",
                    log_recompiles: bool = True) -> None:
    """Compile every expert of a policy (or bare experts) in place (``mode``, ``options``, ``backend``:
    ``torch.compile``'s). Compilation happens at the first forward of each shape: call :func:`warm_up` so
    that no request pays it. ``log_recompiles``: torch logs each recompile and its reason
    (``Recompiling function ...``). With a policy, the dimensions its family says vary between requests
    (its transformer part's ``compile_dynamic``: Qwen-Image's text length) are dynamic too, a graph for them all."""
    from common.diffusion.policy import Policy

    experts = target.experts if isinstance(target, Policy) else target
    dynamic = target.family.transformer.compile_dynamic if isinstance(target, Policy) else {}
    blocks = target.family.transformer.compile_blocks if isinstance(target, Policy) else ()
    if not hasattr(torch, "compile") or not torch._dynamo.is_dynamo_supported():
        raise CompileError(f"torch.compile is not supported by this torch ({torch.__version__}) or Python")
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    # By default dynamo does not guard on module hooks: a LoRA hook added after a compile would be skipped.
    config.skip_nnmodule_hook_guards = False
    if log_recompiles:
        torch._logging.set_logs(recompiles=True)
    try:
        for model in experts.values():
            for region in _regions(model, blocks):
                names = tuple(inspect.signature(region.forward).parameters)
                region.register_forward_pre_hook(functools.partial(_prepare_inputs, dynamic=dynamic, names=names),
                                                 with_kwargs=True)
                region.compile(mode=mode, options=options, backend=backend, dynamic=False)
    except Exception as e:
        uncompile(experts)
        raise CompileError(f"torch.compile refused the experts: {type(e).__name__}: {e}") from e


def _regions(model: torch.nn.Module, blocks: tuple[str, ...]) -> list[torch.nn.Module]:
    """What is compiled: the model, or with ``blocks`` (class names) each of its modules of those classes (its
    own forward, with Python per row or branches on tensor values, then runs eagerly between them)."""
    if not blocks:
        return [model]
    found = [m for m in model.modules() if type(m).__name__ in blocks]
    if not found:
        raise ValueError(f"{type(model).__name__} has no module of the classes {list(blocks)}")
    return found


@torch.compiler.disable  # runs before the compiled forward, on the tensors it is given
def _prepare_inputs(module, args, kwargs, dynamic: dict[str, tuple[int, ...]], names: tuple[str, ...] = ()):
    """The batch dimension dynamic, and the ``dynamic`` ones of a keyword (every other one static), and
    dense strides: dynamo guards on strides, so an expanded text or timestep (a view, stride 0) would be a
    graph of its own; ``contiguous()`` is not enough, it keeps a size-1 dimension's stride. Positional
    tensors too (a call ``model(hidden_states, ...)``: ``names``, the forward's parameters, name them for
    ``dynamic``): else each batch size is a graph of its own."""
    def dense(k, v):
        if not isinstance(v, torch.Tensor) or not v.dim():
            return v
        if v.stride() != _dense_strides(v.shape):
            v = v.clone(memory_format=torch.contiguous_format)
        for dim in (0, *dynamic.get(k, ())):
            torch._dynamo.maybe_mark_dynamic(v, dim)
        return v
    return (tuple(dense(names[i] if i < len(names) else None, v) for i, v in enumerate(args)),
            {k: dense(k, v) for k, v in kwargs.items()})


def _dense_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def uncompile(experts: dict[str, torch.nn.Module]) -> None:
    """Back to eager forwards (undoes ``nn.Module.compile``, which sets ``_compiled_call_impl``)."""
    for model in experts.values():
        for module in model.modules():  # the model, or its compiled blocks
            module._compiled_call_impl = None


def warm_up(policy: "Policy", latent_shape: tuple[int, ...] | None = None, batch: int = 2) -> dict[str, float]:
    """Compile each of the policy's experts for ``latent_shape`` ([C, F', H', W']; by default its default
    request's) by running it: seconds per expert.

    Its own forwards, on example inputs its binding's parts make: ``velocity`` (one sample, guidance) and,
    when ``batch`` > 1, ``batched_velocity`` of ``batch`` samples of one prompt (a shared-text plan) and of one
    row of each of two texts (a step-caching request's branches), and for a transformer whose texts vary in
    size (its part's ``compile_dynamic``) one of two texts of different sizes (a graph of its own).
    On failure the experts are made eager again and :class:`CompileError` says why.
    """
    from common.diffusion.policy import ModelInput

    info, d, parts = policy.info, policy.info.defaults, policy.family
    if latent_shape is None:
        latent_shape = info.latent_shape(d["height"], d["width"], d["num_frames"])[1:]
    seconds = {}
    for name, model in policy.experts.items():
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        t = torch.tensor(999.0 if name == "transformer" else 0.0, device=device)
        if policy.expert_for(t) != name:
            raise ValueError(f"no timestep of this policy takes {name}")
        g = torch.Generator(device).manual_seed(0)
        texts = [parts.text.example(info, model, d["max_sequence_length"], g, device, dtype) for _ in range(2)]

        def latents(n):
            return torch.randn(n, *latent_shape, generator=g, device=device, dtype=dtype)

        start = time.perf_counter()
        try:
            with torch.no_grad():
                policy.share_text()  # its processors now, or their later install would recompile
                image = parts.condition.example(info, tuple(latent_shape), g, device, dtype)
                # The grid as a request's: the latents part's layout of the model's default request (LTX-2's
                # carries its geometry and frame rate, not a token grid).
                params = _default_request(info)
                extra = dict(grid=parts.condition.token_layout(parts.latents.layout(info, params), image),
                             image=image, embedded_guidance=parts.guidance.embedded(info, d["guidance_scale"]),
                             sigma=t / info.num_train_timesteps)
                # The request's further guidance passes (LTX-2's perturbed and isolated rows) and its settings.
                guided = dict(passes=parts.guidance.passes(params, texts[0]), settings=parts.guidance.settings(params))
                policy.velocity(ModelInput(latents(1), t, texts[0], texts[1], 5.0, **extra, **guided))
                if batch > 1:
                    policy.batched_velocity([ModelInput(latents(batch), t, texts[0], texts[1], 5.0, **extra, **guided)])
                if batch > 1:  # a step-caching request's two branches as pieces: one row per text
                    policy.batched_velocity([ModelInput(latents(1), t, texts[0], None, 1.0, **extra),
                                             ModelInput(latents(1), t, texts[1], None, 1.0, **extra,
                                                        unconditional=True)])
                dynamic = parts.transformer.compile_dynamic
                if batch > 1 and dynamic:  # texts of two sizes in one forward
                    policy.batched_velocity([ModelInput(latents(batch), t, texts[0], _shorter(texts[1], dynamic),
                                                        5.0, **extra, **guided)])
        except Exception as e:
            uncompile(policy.experts)
            raise CompileError(f"torch.compile failed on {name} at latents {list(latent_shape)}: "
                               f"{type(e).__name__}: {e}") from e
        seconds[name] = time.perf_counter() - start
    return seconds


def _default_request(info):
    """The model's default request (its serving defaults, its family's fields at theirs), as the router fills it
    (not through ``to_params``: an edit model's default request has no image, which that refuses)."""
    from common.diffusion.params import family_values
    from common.protocol.messages import GenerationParams

    d = info.defaults
    fields = dict(prompt="", negative_prompt="", seed=0, height=d["height"], width=d["width"],
                  num_frames=d.get("num_frames", 1), num_inference_steps=d["num_inference_steps"],
                  guidance_scale=float(d["guidance_scale"]), max_sequence_length=d["max_sequence_length"])
    return GenerationParams(**fields, fields=family_values(fields, info))


def _shorter(text, dynamic: dict[str, tuple[int, ...]]):
    """``text`` one shorter in each of its dynamic dimensions (another size of the same kind of text)."""
    from common.diffusion.parts.text import TextCond

    tensors = dict(text.tensors)
    for k, dims in dynamic.items():
        for d in dims:
            if k in tensors:
                tensors[k] = tensors[k].narrow(d, 0, tensors[k].shape[d] - 1)
    return TextCond(tensors)
