"""Decode stage: the family's VAE decode, latents to frames [n, F, H, W, 3] (F = 1: an image), tiled as
``--vae-tiling`` says, and for a model with sound the waveform (``AUDIO``, its rate in
``info["audio_sample_rate"]``)."""

from __future__ import annotations

import time

import torch

from common.diffusion.parts.decoder import Decoded
from common.diffusion.vae_tiling import VaeTiling
from common.families import read_model
from common.protocol.messages import AUDIO, LATENTS, OUTPUT, PROTOCOL_VERSION, DecodeRequest, Result
from common.runtime.stage import Forward, QueuedBatchStage


class DecodeStage(QueuedBatchStage):
    role = "decode"

    def load(self) -> None:
        info = self.info = read_model(self.config.model)
        tiling = VaeTiling.of(self.config.vae_tiling, self.config.vae_tiling_pixels)
        self.decoder = info.family.decoder.load(info, self.dtype, self.device, tiling)
        self.memory = self.component_memory("vae", {"decoder": self.decoder})

    def decode(self, latents: torch.Tensor, height: int, width: int, made: tuple[int, int]) -> torch.Tensor:
        # Packed latents (what the pipeline stepped on, at the size ``made`` they were made at) as the VAE
        # takes them; frames at the requested size.
        return self.decoder.decode(self.info.family.latents.unpack(latents, self.info, *made), height, width)

    def decode_group(self, items: list, idx: list[int], size: tuple) -> Decoded:
        """The samples of requests ``idx`` (one group), ``max_batch`` rows per call."""
        latents = torch.cat([items[i][1][LATENTS.name] for i in idx])
        if not hasattr(self.decoder, "decode_rows"):
            return Decoded(torch.cat([self.decode(part, *size) for part in latents.split(self.max_batch)]))
        # A decoder that reads its requests: each row with its request and its index there (its seed).
        rows = [(items[i][0].params, k) for i in idx for k in range(items[i][1][LATENTS.name].shape[0])]
        parts, start = [], 0
        for part in latents.split(self.max_batch):
            parts.append(self.decoder.decode_rows(part, rows[start : start + len(part)], *size[2]))
            start += len(part)
        return Decoded.cat(parts)

    def process_batch(self, items: list[tuple[DecodeRequest, dict]]) -> list[Forward | BaseException]:
        """The samples of every queued request whose latents have the same shape and size are decoded together
        (packed latents of two sizes can share a shape), ``max_batch`` samples per VAE call (which bounds its
        memory); others in their own calls."""
        groups: dict[tuple, list[int]] = {}
        out: list[Forward | BaseException] = [None] * len(items)
        for i, (msg, tensors) in enumerate(items):  # the codec guarantees latents (DecodeRequest.carries)
            p = msg.params
            size = (p.height, p.width, self.info.family.latents.size(self.info, p.height, p.width, p.fields))
            key = self.decoder.batch_key(p) if hasattr(self.decoder, "batch_key") else ()
            groups.setdefault((tuple(tensors[LATENTS.name].shape[1:]), key, size), []).append(i)
        for (_, _, size), idx in groups.items():
            t0 = time.perf_counter()
            try:
                decoded = self.decode_group(items, idx, size)
            except Exception as e:
                for i in idx:
                    out[i] = e
                continue
            elapsed = time.perf_counter() - t0
            start = 0
            for i in idx:
                n = items[i][1][LATENTS.name].shape[0]
                out[i] = self._result(*items[i], decoded.rows(start, start + n), elapsed)
                start += n
        return out

    def _result(self, msg: DecodeRequest, tensors: dict, decoded: Decoded, elapsed: float) -> Forward:
        timings = {**msg.timings, "decode_s": elapsed}
        info, sound = msg.info, {}
        if decoded.audio is not None:
            info, sound = {**info, "audio_sample_rate": decoded.sample_rate}, {AUDIO.name: decoded.audio}
        out = Result(v=PROTOCOL_VERSION, request_id=msg.request_id, stage=self.role, timings=timings, info=info)
        # Rollout tensors (log-probs, trajectory) pass through unchanged.
        extras = {k: v for k, v in tensors.items() if k != LATENTS.name}
        return Forward("router", out, {OUTPUT.name: decoded.frames, **sound, **extras})
