"""The trainer's side of a rollout: its own copy of the policy, in-process.

:class:`TrainerPolicy` loads the text encoder(s) and the transformer(s) from the
same model directory the engine serves, whatever its family, and recomputes the
log-probs of a returned trajectory with the engine's own code: the family's
binding (text encoding, the transformer's call), :class:`common.diffusion.policy.Policy`
(expert choice, guidance) and :func:`common.diffusion.policy.step_at` (the SDE step on
the schedule), so that rollout and recompute agree to float32 rounding.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from common.config.engine import Limits
from common.diffusion import streams, text_roles
from common.diffusion.kl import kl_at
from common.diffusion.params import to_params
from common.diffusion.parts.text import Conditioning, cond_to
from common.diffusion.policy import ModelInput, Policy, step_at
from common.diffusion.step_variants import step_variant
from common.diffusion.vae_tiling import VaeTiling
from common.families import read_model
from common.protocol.messages import GenerationParams, RolloutParams
from common.runtime.component_memory import settle_held


@dataclass
class Trajectory:
    """What ``/rollout/generate`` returns per sample with ``return_trajectory``."""

    latents: torch.Tensor  # [T+1, *latent]: x_0 (initial noise) ... x_T
    timesteps: torch.Tensor  # [T]
    sigmas: torch.Tensor  # [T+1]

    @classmethod
    def from_sample(cls, sample: dict) -> "Trajectory":
        tr = sample["trajectory"]
        return cls(tr["latents"], tr["timesteps"], tr["sigmas"])


@dataclass
class ImageInputs:
    """An image-to-video request's image as the encoder worker turns it into tensors (:meth:`TrainerPolicy.image`):
    ``wire`` what travels to the denoise worker, ``condition`` the latent side on the trainer's device."""

    wire: dict[str, torch.Tensor]
    condition: torch.Tensor | None
    images: list = field(default_factory=list)  # the PIL images (an edit model's text encoder sees them too)


class TrainerPolicy:
    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 vae_tiling: VaeTiling = VaeTiling(), limits: Limits | None = None,
                 transformer_file: str | Path | None = None):
        """``vae_tiling``: the engine's ``--vae-tiling`` settings, which an image's VAE encode follows (a tiled
        encode's condition differs from a whole one's); ``limits``: the engine's request bounds, which
        :meth:`params` checks (None: the engine's defaults); ``transformer_file``: the engine's
        ``--transformer-file`` (the transformer's weights from that one file)."""
        self.info = read_model(model_dir, transformer_file)
        self.limits = Limits() if limits is None else limits
        self.vae_tiling = vae_tiling
        self.device = torch.device(device)
        self.dtype = dtype
        self.family = self.info.family
        self.text_encoder = self.family.text.load_encoder(self.info, dtype, self.device)
        settle_held(text_encoder=self.text_encoder)  # as the encoder worker's lies: the same embeddings
        self.policy = Policy.load(self.info, dtype, self.device, trainable=True)
        self._images = None  # the image side, loaded by the first image()

    def params(self, prompt: str, negative_prompt: str | None = None, **fields) -> GenerationParams:
        """A request's params exactly as the engine's router makes them from a body with these fields (the one
        conversion, :func:`common.diffusion.params.to_params`: the model's defaults filled in, the family's own
        fields among ``fields``); a field this model takes no value of, or a bad value, raises
        :class:`common.diffusion.params.FieldError` naming it. A rollout's fields (``sde_type``,
        ``noise_level``, ...) make it a rollout's params."""
        request = {"prompt": prompt, "negative_prompt": negative_prompt, **fields}
        images = _pil_list(request.get("image"))
        return to_params(request, self.info, self.limits, image_sizes=[x.size for x in images])

    def image(self, params: GenerationParams, image, last_image=None) -> ImageInputs:
        """A request's image tensors, as the encoder worker makes them for ``params`` (its size and frames):
        ``image`` (one, or a list for an edit model that takes several) and ``last_image`` are PIL images or
        uint8 [H, W, 3] RGB pixels (what the router decodes from the request's base64)."""
        if self._images is None:
            self._images = self.family.condition.load(self.info, self.dtype, self.device, self.vae_tiling)
            settle_held(images=self._images)
        images, last = _pil_list(image), _pil_list(last_image)
        with torch.no_grad():
            wire = self.family.condition.wire_tensors(self._images, images, last[0] if last else None, params)
        condition = self.family.condition.from_wire(wire)
        return ImageInputs(wire, None if condition is None else condition.to(self.device), images)

    @property
    def experts(self) -> dict[str, torch.nn.Module]:
        return self.policy.experts

    @property
    def transformer(self) -> torch.nn.Module:
        return self.policy.experts["transformer"]

    def embeddings(self, params: GenerationParams,
                   image: ImageInputs | None = None) -> tuple[Conditioning, Conditioning | None]:
        """(cond, uncond) conditioning of ``params``' prompts, exactly as the encoder + denoise workers build it
        (uncond None: no classifier-free guidance); ``image``: an image-to-video request's, from :meth:`image`
        (its image embeds join each prompt's conditioning)."""
        length = params.max_sequence_length
        texts = [(params.prompt, False), (params.negative_prompt, True)] \
            if self.family.guidance.uses_cfg(params) else [(params.prompt, False)]
        beside = {} if image is None else {k: t for k, t in image.wire.items()
                                           if k in self.family.condition.text_fields}
        seen = [image.images] * len(texts) if image is not None and self.family.condition.text_sees_images() else None
        conds = [cond_to(self.family.text.conditioning({**w, **beside}, length), self.device, self.policy.dtype)
                 for w in text_roles.encode(self.text_encoder, texts, length, seen)]
        return conds[0], conds[1] if len(conds) > 1 else None

    def velocity(self, latents, t, cond, uncond, params: GenerationParams,
                 image: ImageInputs | None = None, sigma: torch.Tensor | None = None) -> torch.Tensor:
        """The guided velocity as the denoise worker computes it for a request with ``params`` (``image``: an
        image-to-video request's, from :meth:`image`; ``sigma``: the step's, for a family guiding on x0)."""
        x = ModelInput.of(self.info, params, latents.to(self.device), t.to(self.device), cond, uncond,
                          image=None if image is None else image.condition,
                          sigma=None if sigma is None else sigma.to(self.device))
        return self.policy.velocity(x)

    def log_probs(self, trajectory: Trajectory, steps: list[int] | torch.Tensor, params: GenerationParams,
                  embeddings: tuple[Conditioning, Conditioning | None] | None = None,
                  image: ImageInputs | None = None) -> torch.Tensor:
        """Recompute log p(x_{i+1} | x_i) for each step i in ``steps``: [K] float32, for the request with
        ``params`` (:meth:`params`; its step variant from ``params.rollout``, the default one without);
        ``embeddings``: :meth:`embeddings`' of ``params``, when computed once for many calls; ``image``: an
        image-to-video request's, from :meth:`image`, which also says which latent elements count (TI2V's
        frame 0 does not).
        The steps read ``sigma_max`` and ``sigma_min`` off ``trajectory.sigmas`` (its second and last), whatever
        schedule it ran on (``params.rollout.schedule``: its timesteps are the ones the model was conditioned on).

        Differentiable w.r.t. the transformer's parameters unless called under
        ``torch.no_grad()``.
        """
        out = self._log_probs(trajectory, steps, params, embeddings, image, None)
        return torch.stack(out) if out else torch.zeros(0)

    def log_probs_by_stream(self, trajectory: Trajectory, steps: list[int] | torch.Tensor, params: GenerationParams,
                            embeddings: tuple[Conditioning, Conditioning | None] | None = None,
                            image: ImageInputs | None = None) -> dict[str, torch.Tensor]:
        """A model with several latent streams (LTX-2's video and audio): the answer's ``log_probs`` (the joint
        Gaussian's over the SDE streams) and each SDE stream's ``log_probs_<stream>``, [K] each, as
        :meth:`log_probs` (common/diffusion/streams.py)."""
        by_stream: dict[str, list[torch.Tensor]] = {}
        joint = self._log_probs(trajectory, steps, params, embeddings, image, by_stream)
        out = {"log_probs": torch.stack(joint) if joint else torch.zeros(0)}
        out.update({f"log_probs_{k}": torch.stack(v) for k, v in by_stream.items()})
        return out

    def _log_probs(self, trajectory, steps, params, embeddings, image, by_stream: dict | None) -> list[torch.Tensor]:
        rollout = params.rollout or RolloutParams()
        variant = step_variant(rollout.sde_type, rollout.noise_level)
        cond, uncond = embeddings or self.embeddings(params, image)
        condition = None if image is None else image.condition
        out = []
        for i in [int(i) for i in steps]:
            x = trajectory.latents[i : i + 1].to(self.device)
            v = self.velocity(x, trajectory.timesteps[i], cond, uncond, params, image, trajectory.sigmas[i])
            own = self.family.condition.log_prob_mask(self.info, x, condition)
            step = step_at(trajectory.sigmas, i, v, x, variant,
                           prev_sample=trajectory.latents[i + 1 : i + 2].to(self.device),
                           log_prob_mask=streams.log_prob_mask(self.info, params, own))
            out.append(step.log_prob[0])
            if by_stream is not None:
                chosen = streams.sde_streams(self.info, params, own)
                for name, value in streams.stream_log_probs(variant, step, chosen, own).items():
                    by_stream.setdefault(name, []).append(value[0])
        return out

    def kl(self, trajectory: Trajectory, steps: list[int] | torch.Tensor, params: GenerationParams,
           embeddings: tuple[Conditioning, Conditioning | None] | None = None,
           image: ImageInputs | None = None, reference: "TrainerPolicy | None" = None
           ) -> tuple[torch.Tensor, torch.Tensor]:
        """Recompute ``return_kl``'s answer for each step i in ``steps``: ([K] KL of the policy's step against the
        reference's, [K] log p_ref(x_{i+1} | x_i)), float32, with :mod:`common.diffusion.kl` (the engine's code).
        The reference is this copy with its LoRA adapters (rl/lora.py) disabled, the engine's ``kl_reference:
        "base"``; or ``reference``, another copy holding the weights the engine pinned (``kl_reference:
        "pinned"``), with its adapters off. Arguments as :meth:`log_probs`. Differentiable through the policy's side unless called under
        ``torch.no_grad()``; the reference's side never is."""
        rollout = params.rollout or RolloutParams()
        variant = step_variant(rollout.sde_type, rollout.noise_level)
        cond, uncond = embeddings or self.embeddings(params, image)
        condition = None if image is None else image.condition
        kls, refs = [], []
        for i in [int(i) for i in steps]:
            x = trajectory.latents[i : i + 1].to(self.device)
            v = self.velocity(x, trajectory.timesteps[i], cond, uncond, params, image, trajectory.sigmas[i])
            ref = reference or self
            with torch.no_grad(), adapters_off(ref.experts.values()):
                v_ref = ref.velocity(x, trajectory.timesteps[i], cond, uncond, params, image, trajectory.sigmas[i])
            mask = streams.log_prob_mask(self.info, params, self.family.condition.log_prob_mask(self.info, x, condition))
            step = step_at(trajectory.sigmas, i, v, x, variant,
                           prev_sample=trajectory.latents[i + 1 : i + 2].to(self.device), log_prob_mask=mask)
            out = kl_at(trajectory.sigmas, i, step, v_ref, x, variant, mask)
            kls.append(out.kl[0])
            refs.append(out.ref_log_prob[0])
        return (torch.stack(kls), torch.stack(refs)) if kls else (torch.zeros(0), torch.zeros(0))


@contextmanager
def adapters_off(models):
    """Every enabled peft LoRA layer of ``models`` off inside the block (diffusers' ``disable_adapters``, layer by
    layer), back on after it; layers already off stay off."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for model in models for m in model.modules()
              if isinstance(m, BaseTunerLayer) and not m.disable_adapters]
    # peft's enable_adapters also sets the adapters' requires_grad: the trainer's own choice is put back.
    grads = [(p, p.requires_grad) for m in layers for p in m.parameters()]
    for m in layers:
        m.enable_adapters(False)
    try:
        yield
    finally:
        for m in layers:
            m.enable_adapters(True)
        for p, wanted in grads:
            p.requires_grad_(wanted)


def _pil_list(value) -> list:
    """``value`` (None, one image, or a list of them; PIL images or uint8 [H, W, 3] pixels) as a list of PIL images."""
    from common.protocol.images import image_from_array

    if value is None:
        return []
    return [x if hasattr(x, "convert") else image_from_array(x) for x in (value if isinstance(value, list) else [value])]
