"""One transformer forward run by a multi-device denoise worker's ranks together: the leader's calls, the
followers' loop.

The ranks form a mesh of ``cfg`` x ``ring`` x ``ulysses`` (:class:`ParallelLayout`). The
leader (global rank 0) is the policy's ``ranks`` (:attr:`Policy.ranks`):
each forward's :class:`~common.diffusion.rows.Rows` go to every follower
(:mod:`common.transport.forward_link`). With CFG parallel (``cfg=2``) the rows
before ``cond_rows`` (the conditional passes) run on CFG group 0 and the rest
(the unconditional ones) on group 1, whose first rank sends its output to the
leader; within a group, diffusers' context parallelism (``ring x ulysses`` ranks,
:func:`common.diffusion.context_parallel.enable_context_parallel` on the group's sub-mesh)
splits the sequence and gathers the output. Every rank runs its rows with
:func:`common.diffusion.rows.forward_rows`, as a single device does.

What the followers must hold besides the base weights travels on the same link:
a LoRA adapter before the first forward that uses it (and the keys of those the
leader dropped, with the next forward), and an expert's weights after each
weight update.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from common.transport.forward_link import receive_call, send_call
from common.diffusion.context_parallel import enable_context_parallel, settled
from common.diffusion.lora import LoraAdapter, LoraModule
from common.diffusion.policy import Policy
from common.diffusion.rows import Rows
from common.runtime.component_memory import ModuleMemory, return_freed_memory

FORWARD, ADAPTER, WEIGHTS, MEMORY, STOP = "forward", "adapter", "weights", "memory", "stop"
TEXT_PREFIX = "text."  # a forward's text tensors on the link: text.<the transformer's keyword>


@dataclass
class ParallelLayout:
    """Where this rank sits: its CFG group and the mesh its Ulysses ranks share."""

    cfg: int
    ulysses: int
    mesh: object  # DeviceMesh ("cfg", "ring", "ulysses")
    ring: int = 1

    @classmethod
    def create(cls, cfg: int, ulysses: int, device_type: str = "cpu", ring: int = 1) -> "ParallelLayout":
        from torch.distributed.device_mesh import init_device_mesh

        world = cfg * ring * ulysses
        if cfg not in (1, 2) or ulysses < 1 or ring < 1 or dist.get_world_size() != world:
            raise ValueError(f"a layout of cfg {cfg} x ring {ring} x ulysses {ulysses} needs {world} ranks, "
                             f"the group has {dist.get_world_size()}")
        mesh = init_device_mesh(device_type, (cfg, ring, ulysses), mesh_dim_names=("cfg", "ring", "ulysses"))
        return cls(cfg, ulysses, mesh, ring)

    @classmethod
    def of(cls, spec, device_type: str) -> "ParallelLayout":
        """The layout a multi-device worker's spec describes (common.config.engine.WorkerSpec)."""
        return cls.create(2 if spec.cfg_parallel else 1, spec.ulysses, device_type, spec.ring)

    @property
    def cfg_rank(self) -> int:
        return self.mesh.get_local_rank("cfg")

    @property
    def sends_for_group(self) -> bool:
        """The rank that hands its CFG group's output to the leader (group 1's first rank)."""
        return self.cfg_rank == 1 and self.mesh.get_local_rank("ring") == 0 and self.mesh.get_local_rank("ulysses") == 0

    def prepare(self, policy: Policy) -> None:
        """Sequence parallelism over this rank's CFG group, when it has several ranks."""
        if self.ulysses * self.ring > 1:
            for model in policy.experts.values():
                enable_context_parallel(model, self.ulysses, self.ring, mesh=self.mesh["ring", "ulysses"])


class ParallelForward:
    """The leader's side: each call runs on every rank of the layout."""

    def __init__(self, policy: Policy, layout: ParallelLayout):
        self.policy, self.layout = policy, layout
        self.cfg = layout.cfg
        self.device = next(iter(policy.experts.values())).device  # every call's header goes there (NCCL: a GPU)
        self._keys: weakref.WeakKeyDictionary[LoraAdapter, int] = weakref.WeakKeyDictionary()
        self._next_key = 0
        self._dropped: list[int] = []  # adapters gone here, to be dropped by the followers with the next call

    def __call__(self, expert: str, rows: Rows) -> torch.Tensor:
        """The model's output for every row of ``rows``."""
        split_over = self.layout.ulysses * self.layout.ring
        if split_over > 1:  # masked texts padded to a share per rank (denoise_worker/sequence_split.py)
            rows = replace(rows, texts=self.policy.family.text.padded_to(rows.texts, split_over))
        loras = [None if lo is None else [self._key(lo[0]), lo[1]] for lo in rows.loras]
        split = rows.n if self.cfg == 1 else rows.cond_rows
        inputs = {"hidden_states": rows.hidden_states, "timestep": rows.timestep,
                  **{TEXT_PREFIX + k: v for k, v in rows.texts.items()},
                  **({} if rows.guidance is None else {"guidance": rows.guidance})}
        dropped = self._dropped[:]
        self._dropped.clear()  # (not a new list: the finalizers append to this one)
        send_call(FORWARD, inputs, device=self.device, expert=expert, text_of=rows.text_of, loras=loras, split=split,
                  dropped=dropped, grid=self.policy.family.latents.layout_to_wire(rows.grid))
        mine = settled(self.policy.local(expert, rows, 0, split))
        if split == rows.n:
            return mine
        theirs = torch.empty((rows.n - split, *mine.shape[1:]), dtype=mine.dtype, device=mine.device)
        dist.recv(theirs, src=self.layout.mesh.mesh[1, 0, 0].item())
        return torch.cat([mine, theirs])

    def _key(self, adapter: LoraAdapter) -> int:
        """The followers' key for ``adapter``, sending it to them the first time."""
        key = self._keys.get(adapter)
        if key is None:
            key, self._next_key = self._next_key, self._next_key + 1
            names, tensors = [], {}
            for expert, modules in adapter.experts.items():
                for path, m in modules.items():
                    i = len(names)
                    names.append([expert, path, m.scaling, m.dense is not None])
                    tensors.update({f"{i}.a": m.a, f"{i}.b": m.b, **({f"{i}.dense": m.dense} if m.dense is not None
                                                                    else {})})
            send_call(ADAPTER, tensors, device=self.device, key=key, name=adapter.name, version=adapter.version,
                      sha256=adapter.sha256, modules=names)
            self._keys[adapter] = key
            weakref.finalize(adapter, self._dropped.append, key)
        return key

    def share_weights(self, expert: str) -> None:
        """After a weight update on the leader: the same weights on every follower."""
        send_call(WEIGHTS, device=self.device, expert=expert)
        _broadcast_weights(self.policy.experts[expert])

    def memory(self, action: str, level: int = 0) -> None:
        """Every follower's experts released at ``level`` (``"release"``), or their host copies back
        (``"resume"``; dropped experts come back with the leader's :meth:`share_weights`)."""
        send_call(MEMORY, device=self.device, action=action, level=level)

    def stop(self) -> None:
        send_call(STOP, device=self.device)


def _broadcast_weights(module: torch.nn.Module) -> None:
    """Every tensor of ``module``'s state dict from the leader into every rank's, in place (the same order on
    every rank: the same model class and config)."""
    for t in module.state_dict().values():
        dist.broadcast(t, src=0)


class Follower:
    """A follower's side: runs its share of each call until the leader says stop."""

    def __init__(self, policy: Policy, layout: ParallelLayout, device: torch.device):
        self.policy, self.layout, self.device = policy, layout, device
        self.adapters: dict[int, LoraAdapter] = {}
        self.forwards = 0
        self.memory = {name: ModuleMemory(m) for name, m in policy.experts.items()}

    @torch.no_grad()
    def run(self) -> int:
        """The loop; returns how many forwards this rank took part in."""
        while True:
            call, tensors = receive_call(self.device)
            if call.op == STOP:
                return self.forwards
            if call.op == FORWARD:
                self._forward(call.fields, tensors)
            elif call.op == ADAPTER:
                self._adapter(call.fields, tensors)
            elif call.op == WEIGHTS:
                self.memory[call.fields["expert"]].materialize()  # a push into a sleeping expert
                _broadcast_weights(self.policy.experts[call.fields["expert"]])
            elif call.op == MEMORY:
                for m in self.memory.values():
                    if call.fields["action"] == "release":
                        m.release(call.fields["level"])
                    elif m.level == 1:
                        m.restore()
                return_freed_memory({self.device})
            else:
                raise RuntimeError(f"unknown call {call.op!r} from the leader")

    def _forward(self, f: dict, tensors: dict[str, torch.Tensor]) -> None:
        for key in f["dropped"]:
            self.adapters.pop(key, None)
        loras = [None if lo is None else (self.adapters[lo[0]], lo[1]) for lo in f["loras"]]
        texts = {k.removeprefix(TEXT_PREFIX): v for k, v in tensors.items() if k.startswith(TEXT_PREFIX)}
        rows = Rows(tensors["hidden_states"], tensors["timestep"], texts, f["text_of"], loras,
                    f["split"], self.policy.family.latents.layout_from_wire(f["grid"]), tensors.get("guidance"))
        start, stop = (0, f["split"]) if self.layout.cfg_rank == 0 else (f["split"], rows.n)
        if start == stop:
            return  # nothing for this CFG group (no unconditional rows)
        out = settled(self.policy.local(f["expert"], rows, start, stop))
        if self.layout.sends_for_group:
            dist.send(out.contiguous(), dst=0)
        self.forwards += 1

    def _adapter(self, f: dict, tensors: dict[str, torch.Tensor]) -> None:
        experts: dict[str, dict[str, LoraModule]] = {}
        for i, (expert, path, scaling, dense) in enumerate(f["modules"]):
            experts.setdefault(expert, {})[path] = LoraModule(tensors[f"{i}.a"], tensors[f"{i}.b"], scaling,
                                                              tensors[f"{i}.dense"] if dense else None)
        adapter = LoraAdapter(f["name"], f["version"], experts, f["sha256"])
        self.policy.cover(adapter)
        self.adapters[f["key"]] = adapter
