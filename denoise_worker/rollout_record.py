"""What a rollout request returns, recorded step by step: its trajectory, per-step log-probs (and each SDE
stream's), the KL against its reference, and the reference's forwards."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RolloutRecord:
    trajectory: list[torch.Tensor] = field(default_factory=list)  # [n, ...] per step (the first: the start)
    log_probs: list[torch.Tensor] = field(default_factory=list)  # [n] per SDE step
    log_prob_steps: list[int] = field(default_factory=list)  # the step index of each
    stream_log_probs: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # per SDE stream, [n] a step
    # return_kl (denoise_worker/reference.py): [n] per SDE step, beside ``log_probs``
    kls: list[torch.Tensor] = field(default_factory=list)
    ref_log_probs: list[torch.Tensor] = field(default_factory=list)
    reference_passes: int = 0  # the reference's forwards per sample (summed over its CFG branches)

    def step(self, step: int, log_prob: torch.Tensor, by_stream: dict[str, torch.Tensor] | None) -> None:
        """A stochastic step's [n] log-probs (and each SDE stream's, for a model with several)."""
        self.log_probs.append(log_prob)
        self.log_prob_steps.append(step)
        for name, value in (by_stream or {}).items():
            self.stream_log_probs.setdefault(name, []).append(value)

    def kl(self, kl: torch.Tensor, ref_log_prob: torch.Tensor) -> None:
        self.kls.append(kl)
        self.ref_log_probs.append(ref_log_prob)

    def log_prob_tensor(self, values: list[torch.Tensor], n: int) -> torch.Tensor:
        """[n, K] of per-step [n] values (K = 0 before the first SDE step)."""
        return torch.stack(values, dim=1).float() if values else torch.zeros(n, 0)
