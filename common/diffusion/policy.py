"""The policy: a model's transformer expert(s) and how one denoising step evaluates and takes them.

One copy for every family (its binding, :mod:`common.diffusion.binding`, says how to call its
transformer), used by the denoise worker and by trainers that recompute rollout
log-probs (``rl.TrainerPolicy``): both sides must choose the same expert,
apply guidance in the same order and take the same step for their
log-probs to agree to float32 rounding.

- Experts: ``transformer``, and those its family's experts part (``Binding.experts``) adds; the part says which
  runs a timestep and which expert a request guides at a scale of its own.
- Guidance: classifier-free when the family's scale is above 1. A single request runs its two halves as its
  family's pipeline does: two forwards, or one of [uncond, cond].
- LoRA: each sample may bring its own adapter and scale (:mod:`common.diffusion.lora`),
  applied to its conditional and unconditional passes alike, as peft does.
- Step: on the rollout (flow-match Euler) schedule, :func:`step_at` takes step ``i``
  with :func:`common.diffusion.sde.sde_step`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from common.diffusion.parts.text import Conditioning, text_kwargs
from common.diffusion.lora import LoraAdapter, LoraHooks
from common.diffusion.model_info import ModelInfo
from common.diffusion.rows import Rows, forward_rows
from common.diffusion.sde import Generators, SdeStep, sde_step
from common.diffusion.step_variants import StepVariant
from common.diffusion import shared_text
from common.diffusion.shared_text import SharedText
from common.diffusion.weight_storage import settle


@dataclass(frozen=True)
class ModelInput:
    """What a request's samples bring to a transformer forward: latents at one timestep, their text,
    their guidance. The samples of one request share everything but their latents."""

    latents: torch.Tensor  # [n, *latent]
    timestep: torch.Tensor  # 0-d, or one per sample of ``latents``
    cond: Conditioning  # Wan: [1, L, D]; else a TextCond of [1, ...] tensors
    uncond: Conditioning | None  # None: no guidance
    guidance_scale: float  # classifier-free guidance's (the family's cfg field: Binding.guidance.scale)
    expert_scales: tuple[tuple[str, float], ...] = ()  # (expert, its own guidance scale): Binding.experts.scales
    lora: tuple[LoraAdapter, float] | None = None  # (adapter, scale); None: the base model
    # Packed families: the token grid (rows, columns), which [seq, C] hides; with reference images their
    # TokenLayout (Binding.condition.token_layout).
    grid: tuple[int, int] = (0, 0)
    embedded_guidance: float | None = None  # guidance-distilled transformers' guidance input (FLUX.1-dev)
    image: torch.Tensor | None = None  # the request's latent-side image condition (Binding.condition.from_wire)
    # One branch of a request's guidance run on its own (step caching): ``cond`` is its negative prompt, and
    # with CFG parallel its rows go with the unconditional ones.
    unconditional: bool = False
    # Guidance passes beyond the two of CFG (Binding.guidance.passes: e.g. LTX-2's perturbed and
    # modality-isolated passes), each a conditioning of its own; their rows go with the unconditional ones.
    passes: tuple[Conditioning, ...] = ()
    sigma: torch.Tensor | None = None  # the step's sigma, for guidance combined on x0 predictions
    settings: object = None  # the request's guidance settings where its family has more than one scale

    @property
    def branches(self) -> list[Conditioning]:
        """Each pass's conditioning in the order its guidance combines their outputs: cond, uncond, then
        the further passes."""
        return [self.cond, *(() if self.uncond is None else (self.uncond,)), *self.passes]

    @classmethod
    def of(cls, info: ModelInfo, params, latents: torch.Tensor, timestep: torch.Tensor, cond: Conditioning,
           uncond: Conditioning | None, lora: tuple[LoraAdapter, float] | None = None,
           image: torch.Tensor | None = None, sigma: torch.Tensor | None = None) -> "ModelInput":
        """A request's input as its params (``GenerationParams``) ask, read through the family's parts: the
        denoise worker's and a trainer's alike (``sigma``: the step's, where the family guides on x0)."""
        family = info.family
        grid = family.latents.layout(info, params)
        return cls(latents, timestep, cond, uncond, family.guidance.scale(params),
                   family.experts.scales(params), lora, family.condition.token_layout(grid, image),
                   family.guidance.embedded(info, params.guidance_scale), image,
                   passes=family.guidance.passes(params, cond), sigma=sigma,
                   settings=family.guidance.settings(params))

    @property
    def n(self) -> int:
        return self.latents.shape[0]

    @property
    def row_count(self) -> int:
        """Its rows in a forward: each sample once per guidance pass."""
        return self.n * len(self.branches)

    def rows(self, start: int, stop: int) -> "ModelInput":
        """Samples ``start:stop`` alone (a forward that takes only part of a large request)."""
        t = self.timestep if self.timestep.dim() == 0 else self.timestep[start:stop]
        return replace(self, latents=self.latents[start:stop], timestep=t)

    def guidance_rows(self, rows: int) -> torch.Tensor | None:
        """The embedded guidance of ``rows`` of this input's passes, float32 as the pipelines make it."""
        if self.embedded_guidance is None:
            return None
        return torch.full((rows,), self.embedded_guidance, dtype=torch.float32, device=self.latents.device)


class Policy:
    def __init__(self, info: ModelInfo, experts: dict[str, torch.nn.Module]):
        self.info = info
        self.family = info.family
        self.experts = experts
        self.lora_hooks = {name: LoraHooks(name, model) for name, model in experts.items()}
        # Read once: a diffusers model's ``dtype`` walks its parameters on every call.
        self.dtypes = {name: model.dtype for name, model in experts.items()}
        self.shared_text: dict[str, SharedText] = {}  # installed by the first batched forward of an expert
        # A multi-device worker's ranks (denoise_worker/parallel_forward.py): called as ranks(expert, rows),
        # with ``cfg`` (2: CFG parallel). None: every forward runs on this process.
        self.ranks = None

    def share_text(self) -> None:
        """Install the shared-text processors of every expert now (before torch.compile traces them)."""
        for name in self.experts:
            self._shared_text(name)

    def _shared_text(self, name: str) -> SharedText | None:
        if not self.family.transformer.shares_text(self.info):
            return None
        if name not in self.shared_text:
            self.shared_text[name] = shared_text.install(self.family.transformer.cross_attentions(self.experts[name]))
        return self.shared_text[name]

    @classmethod
    def load(cls, info: ModelInfo, dtype: torch.dtype, device: torch.device | str,
             trainable: bool = False) -> "Policy":
        """The model's expert(s) from its directory; ``trainable`` keeps gradients on (a trainer's copy)."""
        experts = {}
        for name in info.family.experts.names(info):
            file = info.transformer_file if name == "transformer" else None  # --transformer-file: the first's
            model = info.family.transformer.load(info.path / name, dtype, file)
            # Laid out as a push or a resume lays it out: the same bytes give the same outputs (weight_storage).
            model = model.to(device).eval().requires_grad_(False)
            for p in model.parameters():  # a GGUF file's quantized weights (integers) take no gradients
                p.requires_grad_(trainable and p.is_floating_point())
            experts[name] = settle(model)
        return cls(info, experts)

    def cover(self, adapter: LoraAdapter) -> None:
        """Make every module ``adapter`` targets able to take its delta (before a forward uses it)."""
        for hooks in self.lora_hooks.values():
            hooks.cover(adapter)

    @property
    def dtype(self) -> torch.dtype:
        return self.dtypes["transformer"]

    def expert_for(self, timestep: float | torch.Tensor) -> str:
        """The expert that runs ``timestep``, as the family's experts part says."""
        return self.family.experts.expert_for(self.info, self.experts, timestep)

    @staticmethod
    def guidance_scale(expert: str, x: ModelInput) -> float:
        """``x``'s guidance scale on ``expert``: its own where the request gives one, else the request's."""
        return dict(x.expert_scales).get(expert, x.guidance_scale)

    def velocity(self, x: ModelInput) -> torch.Tensor:
        """Guided model output for ``x``'s samples, in the model's dtype.

        Two passes (or, for a family that batches them, one forward of [uncond, cond]), then
        ``uncond + g * (cond - uncond)``: the order of operations of the family's diffusers
        pipeline (and so of a trainer's recompute).
        """
        name = self.expert_for(x.timestep)
        model = self.experts[name]
        h = self.family.condition.model_latents(self.info, x.latents, x.image).to(self.dtypes[name])
        # float32, as in batched_velocity: the same values (timesteps are at most 1000, and the model's time
        # embedding takes floats), and one dtype for compiled forwards to guard on.
        t = self.family.condition.row_timesteps(self.info, x.timestep, x.latents, x.image)
        forward = self.family.transformer.forward
        g = x.guidance_rows(x.n)
        if self.ranks is not None:
            v, v_u = self._passes_on_ranks(name, x, h, t)
            more = [self.ranks(name, Rows.of(self.family, h, t, [p] * x.n, [x.lora] * x.n, grid=x.grid, guidance=g))
                    for p in x.passes]
        else:
            hooks = self.lora_hooks[name]
            if x.uncond is not None and self.family.guidance.in_one_forward:
                with hooks.rows([x.lora] * (2 * x.n)):
                    both = forward(model, torch.cat([h, h]), torch.cat([t, t]), _joined_rows(x.uncond, x.cond, x.n),
                                   x.grid, x.guidance_rows(2 * x.n))
                v_u, v = both.chunk(2)
            else:
                with hooks.rows([x.lora] * h.shape[0]):
                    v = forward(model, h, t, _text_rows(x.cond, x.n), x.grid, g)
                    v_u = None if x.uncond is None else forward(model, h, t, _text_rows(x.uncond, x.n), x.grid, g)
            with hooks.rows([x.lora] * h.shape[0]):  # further passes (LTX-2's): a forward each, as the pipeline
                more = [forward(model, h, t, _text_rows(p, x.n), x.grid, g) for p in x.passes]
        return self.combine(name, x, [v, *(() if v_u is None else (v_u,)), *more])

    def combine(self, name: str, x: ModelInput, outs: list[torch.Tensor]) -> torch.Tensor:
        """``x``'s guided output from its branches' outputs (:attr:`ModelInput.branches`' order)."""
        return self.family.guidance.combine(x, outs, self.guidance_scale(name, x))

    def _passes_on_ranks(self, name: str, x: ModelInput, h: torch.Tensor, t: torch.Tensor):
        """:meth:`velocity`'s two passes on a multi-device worker's ranks: at once with CFG parallel (each on
        its group), else one after the other."""
        f, g = self.family, x.guidance_rows(x.n)
        cond = Rows.of(f, h, t, [x.cond] * x.n, [x.lora] * x.n, grid=x.grid, guidance=g)
        if x.uncond is None:
            return self.ranks(name, cond), None
        if self.ranks.cfg == 2:
            both = self.ranks(name, Rows.of(f, torch.cat([h, h]), torch.cat([t, t]), [x.cond] * x.n + [x.uncond] * x.n,
                                            [x.lora] * (2 * x.n), cond_rows=x.n, grid=x.grid,
                                            guidance=x.guidance_rows(2 * x.n)))
            return both[: x.n], both[x.n :]
        return self.ranks(name, cond), self.ranks(name, Rows.of(f, h, t, [x.uncond] * x.n, [x.lora] * x.n,
                                                                grid=x.grid, guidance=g))

    def run(self, name: str, rows: Rows) -> torch.Tensor:
        """The expert's output for every row: on this process, or on the worker's ranks."""
        return self.local(name, rows) if self.ranks is None else self.ranks(name, rows)

    def local(self, name: str, rows: Rows, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """The expert's output for rows ``start:stop`` on this process (a rank runs its share with it)."""
        return forward_rows(self.family, self.experts[name], self.lora_hooks[name], self._shared_text(name), rows,
                            start, stop)

    def batched_velocity(self, inputs: list[ModelInput]) -> list[torch.Tensor]:
        """Guided model outputs (one [n, ...] per input) for inputs at (possibly) different timesteps,
        in one forward.

        All inputs must map to the same expert and size. An input's conditional rows are followed by its
        unconditional rows when it uses guidance, and inputs with the same LoRA adapter are
        consecutive, so that each adapter's delta goes into one slice of every Linear's output.
        Guidance is applied per input, on all its samples at once, as in :meth:`velocity`. A single
        sample alone takes :meth:`velocity`'s two passes, exactly as diffusers does.
        """
        if len(inputs) == 1 and inputs[0].n == 1:
            return [self.velocity(inputs[0])]
        name = self.expert_for(inputs[0].timestep)
        # CFG parallel splits the forward at cond_rows: every conditional row first.
        rows, blocks = self.rows_of(name, inputs, guidance_last=self.ranks is not None and self.ranks.cfg == 2)
        out = self.run(name, rows)
        at, start = {}, 0
        for block in blocks:
            at[block] = out[start : start + inputs[block[0]].n]
            start += inputs[block[0]].n
        return [self.combine(name, x, [at[(i, b)] for b in range(len(x.branches))]) for i, x in enumerate(inputs)]


    def rows_of(self, name: str, inputs: list[ModelInput], guidance_last: bool = False):
        """The rows of one forward of ``inputs`` on expert ``name``, and their blocks (:func:`_blocks_by_adapter`)."""
        blocks = _blocks_by_adapter(inputs, guidance_last)
        branches = [x.branches for x in inputs]
        f, info = self.family, self.info
        h = torch.cat([f.condition.model_latents(info, inputs[i].latents, inputs[i].image) for i, _ in blocks])
        h = h.to(self.dtypes[name])
        ts = torch.cat([f.condition.row_timesteps(info, inputs[i].timestep, inputs[i].latents, inputs[i].image)
                        for i, _ in blocks])
        texts = [branches[i][b] for i, b in blocks for _ in range(inputs[i].n)]
        loras = [inputs[i].lora for i, _ in blocks for _ in range(inputs[i].n)]
        cond_rows = sum(inputs[i].n for i, b in blocks if not (b or inputs[i].unconditional))
        guidance = None
        if inputs[0].embedded_guidance is not None:
            guidance = torch.cat([inputs[i].guidance_rows(inputs[i].n) for i, _ in blocks])
        return Rows.of(f, h, ts, texts, loras, cond_rows, inputs[0].grid, guidance), blocks


def _text_rows(cond: Conditioning, n: int) -> dict[str, torch.Tensor]:
    """One request's [1, ...] text tensors for its n samples (views, no copy)."""
    return {k: v if v.shape[0] == n else v.expand(n, *v.shape[1:]) for k, v in text_kwargs(cond).items()}


def _joined_rows(uncond: Conditioning, cond: Conditioning, n: int) -> dict[str, torch.Tensor]:
    """[uncond x n, cond x n] per text tensor: one forward of both halves, as diffusers batches them."""
    u, c = _text_rows(uncond, n), _text_rows(cond, n)
    return {k: torch.cat([u[k], c[k]]) for k in c}


def _blocks_by_adapter(inputs: list[ModelInput], guidance_last: bool = False) -> list[tuple[int, int]]:
    """(input, branch) per block of rows of a batched forward (branch: the index in
    :attr:`ModelInput.branches`; 0 the conditional pass): each input's rows together, the inputs of one
    adapter together, in order of first appearance. ``guidance_last``: every conditional block before every
    other one (the split of CFG parallel)."""
    def adapter(x: ModelInput) -> int:
        return id(x.lora[0]) if x.lora is not None else 0

    first: dict[int, int] = {}
    for i, x in enumerate(inputs):
        first.setdefault(adapter(x), i)
    order = sorted(range(len(inputs)), key=lambda i: first[adapter(inputs[i])])
    if guidance_last:  # (an unconditional branch on its own counts as unconditional)
        return ([(i, 0) for i in order if not inputs[i].unconditional]
                + [(i, 0) for i in order if inputs[i].unconditional]
                + [(i, b) for i in order for b in range(1, len(inputs[i].branches))])
    return [(i, b) for i in order for b in range(len(inputs[i].branches))]


def sigma_max(sigmas: torch.Tensor) -> torch.Tensor:
    """The SDE's ``s_max``: the schedule's second sigma (the largest one below 1)."""
    return sigmas[1] if sigmas.numel() > 1 else sigmas[0]


def step_at(sigmas: torch.Tensor, i: int, velocity: torch.Tensor, latents: torch.Tensor, variant: StepVariant, *,
            generator: Generators = None, prev_sample: torch.Tensor | None = None,
            log_prob_mask: torch.Tensor | None = None) -> SdeStep:
    """Rollout step ``i`` of a flow-match schedule (``sigmas``: the whole schedule, its last sigma included)
    with ``variant``: the engine draws ``x_{i+1}`` (``generator``: one, or one per sample), a trainer passes
    the recorded one (``prev_sample``) to get its log-prob."""
    return sde_step(velocity, latents, sigmas[i], sigmas[i + 1], sigma_max(sigmas), sigma_min=sigmas[-1],
                    sde_type=variant, generator=generator, prev_sample=prev_sample, log_prob_mask=log_prob_mask)
