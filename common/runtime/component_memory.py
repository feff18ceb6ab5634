"""A worker's model weights released and resumed in place, for a trainer that shares the worker's device.

Level 1 moves every tensor of a module's state dict to host memory (pinned when it comes from a GPU) and
brings the same bytes back; level 2 drops them, and they come back from a push (the weight-sync paths
fill a :meth:`ModuleMemory.materialize`-d module), or from a fresh load of the model directory. Either
way each tensor keeps its identity (``tensor.data`` is swapped), so whatever holds the parameters (LoRA
hooks, compiled graphs, context-parallel hooks) still holds them afterwards, and each lies as it did before
the release (:mod:`common.diffusion.weight_storage`: its own aligned storage), so outputs are bit-identical.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from collections.abc import Callable, Mapping

import torch

from common.diffusion.thread_invariance import contiguous_activations
from common.diffusion.weight_storage import settle, weight_tensors
from common.protocol.errors import WeightsMissing


def modules_of(holders: Mapping[str, object], depth: int = 3) -> dict[str, torch.nn.Module]:
    """The top-level modules a stage's loaded objects hold (a text encoder's model, a text-only pipeline's
    encoders, a decoder's VAE), by attribute path; a module inside another is its parent's."""
    found: dict[str, torch.nn.Module] = {}
    seen: set[int] = set()

    def walk(path: str, obj: object, left: int) -> None:
        if obj is None or id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, torch.Tensor)):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            found[path] = obj
            return
        if left and hasattr(obj, "__dict__"):
            for key, value in sorted(vars(obj).items()):
                walk(f"{path}.{key}", value, left - 1)

    for name, obj in holders.items():
        walk(name, obj, depth)
    inner = {id(sub) for m in found.values() for sub in m.modules() if sub is not m}
    return {path: m for path, m in found.items() if id(m) not in inner}


def settle_held(**holders: object) -> None:
    """Every module ``holders`` hold laid out as a worker's component is (a trainer's own copy of a stage's
    encoders: its outputs then equal the worker's bit for bit): weights and activations' layout."""
    for module in modules_of(holders).values():
        contiguous_activations(settle(module))


def return_freed_memory(devices: set[torch.device] = frozenset()) -> None:
    """Hand what was freed back: the CUDA caching allocator's blocks on ``devices``, and the heap's free pages
    to the OS (glibc keeps freed chunks below its mmap threshold, which grows up to 32 MiB as large blocks
    are freed, for reuse: RSS would not show a release)."""
    for device in devices:
        if device.type == "cuda":
            with torch.cuda.device(device):
                torch.cuda.empty_cache()
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        ctypes.CDLL(name).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


def memory_usage(devices: set[torch.device] = frozenset()) -> dict[str, int]:
    """This process's resident memory and, per CUDA device, torch's allocated and reserved bytes."""
    out = {"rss": 0}
    with open("/proc/self/statm") as f:
        out["rss"] = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    for device in sorted(devices, key=str):
        if device.type == "cuda":
            out[f"{device}.allocated"] = torch.cuda.memory_allocated(device)
            out[f"{device}.reserved"] = torch.cuda.memory_reserved(device)
    return out


class ModuleMemory:
    """One module's weights: on their device, in host memory (level 1), or dropped (level 2)."""

    def __init__(self, module: torch.nn.Module):
        # Laid out as every resume and push will lay it out; its activations as thread_invariance says.
        self.module = contiguous_activations(settle(module))
        self.level = 0  # 0: the weights are on their device
        self._host: dict[str, torch.Tensor] = {}
        self._meta: dict[str, tuple[torch.Size, torch.dtype, torch.device]] = {}

    @property
    def present(self) -> bool:
        return self.level == 0

    @property
    def devices(self) -> set[torch.device]:
        if self.present:
            return {t.device for t in weight_tensors(self.module).values()}
        return {d for _, _, d in self._meta.values()}

    @property
    def nbytes(self) -> int:
        if self.present:
            return sum(t.numel() * t.element_size() for t in weight_tensors(self.module).values())
        return sum(s.numel() * torch.empty(0, dtype=d).element_size() for s, d, _ in self._meta.values())

    def release(self, level: int) -> None:
        """Level 1: to host memory; level 2: dropped (a level-1 module's host copies too)."""
        if self.level >= level:
            return
        if self.level == 1:  # 1 -> 2
            self._host = {}
            self.level = 2
            return
        tensors = weight_tensors(self.module)
        self._meta = {name: (t.shape, t.dtype, t.device) for name, t in tensors.items()}
        if level == 1:
            self._host = {name: _to_host(t.data) for name, t in tensors.items()}
            if any(t.device.type == "cuda" for t in tensors.values()):
                torch.cuda.synchronize()
        for t in tensors.values():
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)
        self.level = level

    def restore(self) -> None:
        """Level 1's host copies back onto their devices, bit for bit."""
        if self.level != 1:
            raise RuntimeError(f"no host copy to restore (level {self.level})")
        for name, t in weight_tensors(self.module).items():
            host = self._host[name]
            t.data = host if host.device == self._meta[name][2] else host.to(self._meta[name][2], copy=True)
        self._host = {}
        self.level = 0

    def materialize(self) -> None:
        """Storage of the right shapes on the device again, its values undefined: a push fills it next.
        A level-1 module gets its host copies back instead (a push may name only part of it)."""
        if self.level == 1:
            self.restore()
        elif self.level == 2:
            for name, t in weight_tensors(self.module).items():
                shape, dtype, device = self._meta[name]
                t.data = torch.empty(shape, dtype=dtype, device=device)
            self.level = 0

    def take(self, fresh: torch.nn.Module) -> None:
        """The weights of ``fresh``, a newly loaded module of the same class and config (its storage is
        taken over, not copied)."""
        mine, theirs = weight_tensors(self.module), fresh.state_dict(keep_vars=True)
        missing = sorted(set(mine) - set(theirs))
        if missing:
            raise RuntimeError(f"the reloaded module lacks {', '.join(missing[:5])}")
        for name, t in mine.items():
            _, dtype, device = self._meta.get(name, (None, t.dtype, t.device))
            t.data = theirs[name].data.to(device=device, dtype=dtype)
        settle(self.module)  # a module loaded some other way than the stages load theirs
        self._host = {}
        self.level = 0


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu":
        return t  # the same bytes stay where they are: on the CPU level 1 frees nothing
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


class ComponentMemory:
    """A worker's component (``transformer``, ``text_encoder``, ``vae``): its modules by name, asleep or
    awake together. ``reload`` loads them afresh from the model directory (a level-2 resume from disk)."""

    def __init__(self, tag: str, modules: Mapping[str, torch.nn.Module],
                 reload: Callable[[], Mapping[str, torch.nn.Module]]):
        self.tag = tag
        self.modules = {name: ModuleMemory(m) for name, m in modules.items()}
        self._reload = reload
        self.level = 0  # the level it sleeps at; 0: awake

    @property
    def asleep(self) -> bool:
        return self.level > 0

    @property
    def devices(self) -> set[torch.device]:
        """Where the component's weights live when it is awake."""
        return {d for m in self.modules.values() for d in m.devices}

    def missing(self) -> list[str]:
        """The modules whose weights were dropped and not pushed since."""
        return [name for name, m in self.modules.items() if m.level == 2]

    def release(self, level: int) -> int:
        """Every module at ``level`` (never back from 2 to 1); the bytes that left the device."""
        before = sum(m.nbytes for m in self.modules.values() if m.present)
        for m in self.modules.values():
            m.release(level)
        self.level = max(self.level, level)
        return before

    def resume(self, reload: str | None = None) -> None:
        """Awake: host copies back, pushed modules kept; dropped ones from ``reload="disk"``. Without it, a
        dropped module is a :class:`WeightsMissing` and the component stays asleep, unchanged."""
        missing = self.missing()
        if missing and reload != "disk":
            raise WeightsMissing(f"{self.tag}: {', '.join(missing)} dropped (level 2) and not pushed since; "
                                 "push the weights first, or resume with reload: disk")
        if missing:
            fresh = self._reload()
            for name in missing:
                self.modules[name].take(fresh[name])
        for m in self.modules.values():
            if m.level == 1:
                m.restore()
        self.level = 0
