"""Decode stage: the family's VAE decode, latents to frames [n, F, H, W, 3] (F = 1: an image), tiled as
``--vae-tiling`` says, and for a model with sound the waveform (``AUDIO``, its rate in
``info["audio_sample_rate"]``).

A streaming request of several samples (``stream``) is decoded one sample per round of the worker's loop, each
sent to the router as a ``SampleDone`` as soon as it is decoded (other requests go on between two), then
answered whole like any other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from common.diffusion.parts.decoder import Decoded
from common.diffusion.vae_tiling import VaeTiling
from common.families import read_model
from common.protocol.errors import Cancelled
from common.protocol.messages import (
    AUDIO, LATENTS, OUTPUT, PER_SAMPLE, PROTOCOL_VERSION, DecodeRequest, Result, SampleDone,
)
from common.runtime.stage import Forward, QueuedBatchStage


@dataclass
class _Streaming:
    """A streaming request being decoded sample by sample."""

    msg: DecodeRequest
    tensors: dict
    parts: list[Decoded] = field(default_factory=list)
    elapsed: float = 0.0

    @property
    def samples(self) -> int:
        return self.tensors[LATENTS.name].shape[0]


class DecodeStage(QueuedBatchStage):
    role = "decode"

    streams: list[_Streaming]
    _notices: list[Forward]

    def load(self) -> None:
        self.streams, self._notices = [], []
        info = self.info = read_model(self.config.model)
        tiling = VaeTiling.of(self.config.vae_tiling, self.config.vae_tiling_pixels)
        self.decoder = info.family.decoder.load(info, self.dtype, self.device, tiling)
        self.memory = self.component_memory("vae", {"decoder": self.decoder})

    def decode(self, latents: torch.Tensor, height: int, width: int, made: tuple[int, int]) -> torch.Tensor:
        # Packed latents (what the pipeline stepped on, at the size ``made`` they were made at) as the VAE
        # takes them; frames at the requested size.
        return self.decoder.decode(self.info.family.latents.unpack(latents, self.info, *made), height, width)

    def decode_group(self, items: list, idx: list[int], size: tuple) -> Decoded:
        """The samples of requests ``idx`` (one group)."""
        latents = torch.cat([items[i][1][LATENTS.name] for i in idx])
        rows = [(items[i][0].params, k) for i in idx for k in range(items[i][1][LATENTS.name].shape[0])]
        return self.decode_rows(latents, rows, size)

    def decode_rows(self, latents: torch.Tensor, rows: list, size: tuple) -> Decoded:
        """``latents``' rows, each (its request's params, its index there), ``max_batch`` rows per call; a decoder
        that reads its requests (``decode_rows``: LTX-2's seeds its noise by them) gets them."""
        if not hasattr(self.decoder, "decode_rows"):
            return Decoded(torch.cat([self.decode(part, *size) for part in latents.split(self.max_batch)]))
        parts, start = [], 0
        for part in latents.split(self.max_batch):
            parts.append(self.decoder.decode_rows(part, rows[start : start + len(part)], *size[2]))
            start += len(part)
        return Decoded.cat(parts)

    # --- streaming requests: one sample per round ---------------------------------------------------------
    def accept(self, msg: DecodeRequest, tensors: dict) -> None:
        if msg.params.stream and tensors[LATENTS.name].shape[0] > 1:
            self.streams.append(_Streaming(msg, tensors))
        else:
            super().accept(msg, tensors)

    def has_work(self) -> bool:
        return super().has_work() or bool(self.streams)

    def work(self) -> list:
        done = super().work() if self.queue else []
        if self.streams:
            done += self._stream_one()
        return done

    def notices(self) -> list[Forward]:
        out, self._notices = self._notices, []
        return out

    def _stream_one(self) -> list:
        """The next sample of the oldest streaming request: its SampleDone now, the request's Result after its
        last sample."""
        s = self.streams[0]
        k, p = len(s.parts), s.msg.params
        size = (p.height, p.width, self.info.family.latents.size(self.info, p.height, p.width, p.fields))
        t0 = time.perf_counter()
        try:
            decoded = self.decode_rows(s.tensors[LATENTS.name][k:k + 1], [(p, k)], size)
        except Exception as e:
            self.streams.pop(0)
            return [(s.msg, e)]
        s.elapsed += time.perf_counter() - t0
        s.parts.append(decoded)
        self._notices.append(self._sample_done(s, k, decoded))
        if len(s.parts) < s.samples:
            return []
        self.streams.pop(0)
        return [(s.msg, self._result(s.msg, s.tensors, Decoded.cat(s.parts), s.elapsed))]

    def _sample_done(self, s: _Streaming, k: int, decoded: Decoded) -> Forward:
        rows = {f.name for f in PER_SAMPLE}
        tensors = {name: t[k:k + 1] if name in rows else t for name, t in s.tensors.items()}
        info, out = _answer(s.msg.info, tensors, decoded)
        done = SampleDone(v=PROTOCOL_VERSION, request_id=s.msg.request_id, stage=self.role, index=k,
                          timings={**s.msg.timings, "decode_s": s.elapsed}, info=info)
        return Forward("router", done, out)

    def drop_work(self) -> int:
        dropped = len(self.streams)
        self.streams.clear()
        return dropped + super().drop_work()

    def cancel(self, request_id: str, partial: bool):
        for s in self.streams:
            if s.msg.request_id == request_id:
                self.streams.remove(s)
                return s.msg, Cancelled(f"request cancelled while decoding in the {self.role} worker")
        return super().cancel(request_id, partial)

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
        info, out = _answer(msg.info, tensors, decoded)
        result = Result(v=PROTOCOL_VERSION, request_id=msg.request_id, stage=self.role,
                        timings={**msg.timings, "decode_s": elapsed}, info=info)
        return Forward("router", result, out)


def _answer(info: dict, tensors: dict, decoded: Decoded) -> tuple[dict, dict]:
    """What a request's (or a streamed sample's) answer carries: the frames, a model's sound and its rate, and
    the rollout tensors (log-probs, trajectory), which pass through unchanged."""
    out = {OUTPUT.name: decoded.frames, **{k: v for k, v in tensors.items() if k != LATENTS.name}}
    if decoded.audio is not None:
        info, out[AUDIO.name] = {**info, "audio_sample_rate": decoded.sample_rate}, decoded.audio
    return info, out
