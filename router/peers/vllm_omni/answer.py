"""vLLM-Omni's ``/rollout/generate`` answer from the native outcome: the trajectory's latents, its timesteps and
the log-probs over every step (0 on the steps without an SDE), each written into a POSIX shared-memory segment
the client opens by name, copies and unlinks (``ownership: "client"``, ``release: "unlink"``), as
vllm_omni/diffusion/ipc.py's client-owned handles.

The router writes the segments (``multiprocessing.shared_memory``'s own ``psm_xxxxxxxx`` names) and never frees
them: its resource tracker forgets each, so that none is unlinked when the router exits. A segment whose client
never opens it stays in /dev/shm until someone removes it (as the peer's): :class:`Segments` counts those still
there, and refuses a rollout whose handles would not fit in /dev/shm's free space (writing past it would kill
the router with SIGBUS).
"""

from __future__ import annotations

import asyncio
import os
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import numpy as np
import torch

from common.protocol.messages import KL, LOG_PROB_STEPS, LOG_PROBS, REF_LOG_PROBS, TRAJECTORY_LATENTS, \
    TRAJECTORY_TIMESTEPS
from router.core.errors import EngineError
from router.link.join import Outcome
from router.peers.vllm_omni.translate import STAGE_ID, Plan

SHM_DIR = "/dev/shm"
RESERVE_BYTES = 64 << 20  # what a rollout's handles leave free in /dev/shm
AS_FLOAT32 = (torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)  # dtypes numpy lacks
INFO_KEYS = ("weight_version", "lora_name", "lora_version", "scheduler", "schedule", "sde_window", "batch",
             "step_weight_versions", "step_lora_versions", "attempts")


def over_all_steps(native: torch.Tensor | None, steps: torch.Tensor | None, n: int, total: int) -> torch.Tensor:
    """[n, total] from the native [n, K] of SDE steps ``steps``: 0 on the other steps."""
    out = torch.zeros(n, total, dtype=native.dtype if native is not None else torch.float32)
    if native is not None and steps is not None and steps.numel():
        out[:, steps.long()] = native
    return out


def arrays(outcome: Outcome, plan: Plan) -> dict[str, torch.Tensor]:
    """The handles' tensors: latents [T+1, *latent], timesteps [T], log_probs [T] (a leading n for n > 1)."""
    t = outcome.tensors
    timesteps = t[TRAJECTORY_TIMESTEPS.name]
    latents = t[TRAJECTORY_LATENTS.name]
    n, total = latents.shape[0], timesteps.shape[0]
    steps = t.get(LOG_PROB_STEPS.name)
    out = {"latents": latents, "timesteps": timesteps,
           "log_probs": over_all_steps(t.get(LOG_PROBS.name), steps, n, total)}
    if plan.kl:
        out.update(kl=over_all_steps(t.get(KL.name), steps, n, total),
                   ref_log_probs=over_all_steps(t.get(REF_LOG_PROBS.name), steps, n, total))
    if n == 1:
        out = {k: v if k == "timesteps" else v[0] for k, v in out.items()}
    return out


def metrics(outcome: Outcome, plan: Plan, total_s: float) -> dict:
    """The engine's facts about the rollout (vLLM-Omni's ``metrics`` is engine-defined)."""
    t, info = outcome.tensors, outcome.info
    steps = t.get(LOG_PROB_STEPS.name)
    out = {"seed": plan.seed, "seeds": [plan.seed + i for i in range(plan.n)], "n": plan.n,
           "num_inference_steps": int(t[TRAJECTORY_TIMESTEPS.name].shape[0]),
           "sde_steps": [] if steps is None else [int(i) for i in steps]}
    out.update({k: info[k] for k in INFO_KEYS if k in info})
    out["timings"] = {"encode_s": 0.0, "denoise_s": 0.0, "decode_s": 0.0, **outcome.timings, "total_s": total_s}
    out["peak_memory"] = dict(outcome.peak_memory)
    out["stage_id"] = STAGE_ID
    return out


def _create(size: int) -> SharedMemory:
    """A new segment the router's resource tracker does not know (so never unlinks)."""
    try:
        return SharedMemory(create=True, size=size, track=False)  # Python 3.13+
    except TypeError:
        shm = SharedMemory(create=True, size=size)
        resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 (the tracker's own key)
        return shm


def write_handle(tensor: torch.Tensor) -> dict:
    """One tensor in a new segment, as a client-owned handle. A dtype numpy lacks (bfloat16) is stored as
    float32, ``torch_dtype`` naming the original, as the peer does."""
    torch_dtype = str(tensor.dtype)
    t = tensor.detach().cpu().contiguous()
    if t.dtype in AS_FLOAT32:
        t = t.float()
    a = t.numpy()
    shm = _create(max(1, a.nbytes))
    try:
        view = np.ndarray(a.shape, dtype=a.dtype, buffer=shm.buf[:a.nbytes])
        view[...] = a
        del view
        handle = {"name": shm.name, "shape": list(a.shape), "numpy_dtype": str(a.dtype), "nbytes": int(a.nbytes),
                  "torch_dtype": torch_dtype, "kind": "shm", "ownership": "client", "release": "unlink"}
    except BaseException:
        shm.close()
        shm.unlink()
        raise
    shm.close()
    return handle


def unlink(name: str) -> None:
    try:
        shm = SharedMemory(name=name)
    except FileNotFoundError:
        return
    shm.close()
    shm.unlink()  # and forgets it in the tracker that opening it told


class Segments:
    """The segments this router wrote for its clients, until each client unlinks its own."""

    def __init__(self, shm_dir: str = SHM_DIR):
        self.shm_dir = shm_dir
        self._written: dict[str, int] = {}  # name -> bytes

    def outstanding(self) -> dict[str, int]:
        """Those still in /dev/shm (not unlinked yet): how many, their bytes."""
        if os.path.isdir(self.shm_dir):
            self._written = {n: b for n, b in self._written.items() if os.path.exists(os.path.join(self.shm_dir, n))}
        return {"segments": len(self._written), "bytes": sum(self._written.values())}

    def _check_room(self, need: int) -> None:
        if not os.path.isdir(self.shm_dir):
            return
        st = os.statvfs(self.shm_dir)
        free = st.f_bavail * st.f_frsize
        if need + RESERVE_BYTES > free:
            left = self.outstanding()
            raise EngineError(503, "shm_full", f"{self.shm_dir} has {free} bytes free; this rollout's handles need "
                              f"{need} (and {RESERVE_BYTES} are kept free). {left['segments']} segment(s) of "
                              f"{left['bytes']} bytes this engine wrote are not unlinked yet: a client must unlink "
                              "every handle it gets", "router", "")

    async def write(self, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
        """Every tensor as a handle (written off the event loop), or none (a failure unlinks those written)."""
        self._check_room(sum(t.numel() * (4 if t.dtype in AS_FLOAT32 else t.element_size())
                             for t in tensors.values()))
        handles = await asyncio.to_thread(write_all, tensors)
        self._written.update({h["name"]: h["nbytes"] for h in handles.values()})
        return handles


def write_all(tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    handles: dict[str, dict] = {}
    try:
        for key, tensor in tensors.items():
            handles[key] = write_handle(tensor)
    except BaseException:
        for h in handles.values():
            unlink(h["name"])
        raise
    return handles
