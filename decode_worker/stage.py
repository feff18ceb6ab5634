"""Decode stage: de-normalise latents, VAE-decode, post-process to frames."""

from __future__ import annotations

import time

import torch
from diffusers import AutoencoderKLWan

from common.protocol.messages import LATENTS, OUTPUT, PROTOCOL_VERSION, DecodeRequest, Result
from common.diffusion.model_info import ModelInfo
from common.runtime.stage import Forward, QueuedBatchStage


def to_frames(video: torch.Tensor) -> torch.Tensor:
    """VAE output [n, 3, F, H, W] in [-1, 1] -> float32 frames [n, F, H, W, 3] in [0, 1]."""
    # Denormalise in the VAE's dtype first, then widen: diffusers' VideoProcessor order.
    return (video / 2 + 0.5).clamp(0, 1).float().permute(0, 2, 3, 4, 1).contiguous()


class DecodeStage(QueuedBatchStage):
    role = "decode"

    def load(self) -> None:
        info = ModelInfo.read(self.config.model)
        self.vae = AutoencoderKLWan.from_pretrained(info.path / "vae", dtype=self.dtype)
        self.vae = self.vae.to(self.device).eval().requires_grad_(False)
        z = self.vae.config.z_dim
        self.latents_mean = torch.tensor(self.vae.config.latents_mean).view(1, z, 1, 1, 1)
        self.latents_std = torch.tensor(self.vae.config.latents_std).view(1, z, 1, 1, 1)

    @torch.no_grad()
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        dtype = self.vae.dtype
        latents = latents.to(self.device, dtype)
        # Same order of operations as diffusers: x / (1 / std) + mean, in the VAE's dtype.
        inv_std = 1.0 / self.latents_std.to(self.device, dtype)
        latents = latents / inv_std + self.latents_mean.to(self.device, dtype)
        return self.vae.decode(latents, return_dict=False)[0]

    def process_batch(self, items: list[tuple[DecodeRequest, dict]]) -> list[Forward | BaseException]:
        """The samples of every queued request whose latents have the same shape are decoded together,
        ``max_batch`` samples per VAE call (which bounds its memory); other shapes in their own calls."""
        groups: dict[tuple, list[int]] = {}
        out: list[Forward | BaseException] = [None] * len(items)
        for i, (_, tensors) in enumerate(items):  # the codec guarantees latents (DecodeRequest.carries)
            groups.setdefault(tuple(tensors[LATENTS.name].shape[1:]), []).append(i)
        for idx in groups.values():
            t0 = time.perf_counter()
            try:
                latents = torch.cat([items[i][1][LATENTS.name] for i in idx])
                video = torch.cat([self.decode(part) for part in latents.split(self.max_batch)])
            except Exception as e:
                for i in idx:
                    out[i] = e
                continue
            elapsed = time.perf_counter() - t0
            start = 0
            for i in idx:
                n = items[i][1][LATENTS.name].shape[0]
                out[i] = self._result(*items[i], video[start : start + n], elapsed)
                start += n
        return out

    def _result(self, msg: DecodeRequest, tensors: dict, video: torch.Tensor, elapsed: float) -> Forward:
        frames = to_frames(video)
        timings = {**msg.timings, "decode_s": elapsed}
        out = Result(v=PROTOCOL_VERSION, request_id=msg.request_id, stage=self.role, timings=timings, info=msg.info)
        # Rollout tensors (log-probs, trajectory) pass through unchanged.
        extras = {k: v for k, v in tensors.items() if k != LATENTS.name}
        return Forward("router", out, {OUTPUT.name: frames, **extras})
