"""LoRA adapters applied per sample, batched, without merging them into the base weights.

A forward of the transformer may hold samples with different adapters (and
samples with none). Each targeted ``nn.Linear`` runs once for the whole batch;
a forward hook then adds, for the rows of each adapter, that adapter's delta
``scale * scaling * (x A^T) B^T`` (grouped per adapter, as S-LoRA and Punica
do). The base weights are never touched, so switching adapters costs nothing,
and the state dict (weight sync, checksums) is the base model's.

An adapter is immutable once built: loading a name again makes a new
:class:`LoraAdapter` with the next version, and a request keeps the object it
started with, so a request in flight finishes on its version.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from common.diffusion.opaque import opaque_update
from common.diffusion.lora_format import ExpertLora, LoraError, lora_sha256


@dataclass(frozen=True)
class LoraModule:
    """One targeted Linear's low-rank pair, in the model's dtype and on its device."""

    a: torch.Tensor  # [r, in]
    b: torch.Tensor  # [out, r]
    scaling: float  # alpha / r
    # B A [out, in], kept only where it costs no more than the two factors (r (in + out) >= in out, small
    # Linears): one matmul instead of two.
    dense: torch.Tensor | None = None


@dataclass(frozen=True, eq=False)  # identity: two loads of one name are two adapters
class LoraAdapter:
    name: str
    version: int
    experts: dict[str, dict[str, LoraModule]]
    sha256: str

    @property
    def rank(self) -> int:
        return max(m.a.shape[0] for mods in self.experts.values() for m in mods.values())

    def describe(self) -> dict:
        scalings = {m.scaling for mods in self.experts.values() for m in mods.values()}
        return {
            "lora_name": self.name, "lora_version": self.version, "rank": self.rank,
            "scale": scalings.pop() if len(scalings) == 1 else None,  # alpha / r, when every module agrees
            "target_modules": sorted({p for mods in self.experts.values() for p in mods}),
            "experts": sorted(self.experts), "sha256": self.sha256,
        }


def build_adapter(name: str, version: int, parsed: dict[str, ExpertLora], models: dict[str, torch.nn.Module],
                  max_rank: int) -> LoraAdapter:
    """Check every module of ``parsed`` against the model it targets, then cast it to that model's dtype."""
    experts: dict[str, dict[str, LoraModule]] = {}
    for expert, part in sorted(parsed.items()):
        model = models.get(expert)
        if model is None:
            raise LoraError(f"the adapter has weights for {expert}, which this model does not have")
        experts[expert] = {path: _checked(model, expert, path, a, b, scaling, max_rank)
                           for path, (a, b, scaling) in part.modules.items()}
    return LoraAdapter(name, version, experts, lora_sha256(parsed))


def _checked(model, expert, path, a, b, scaling, max_rank) -> LoraModule:
    where = f"{expert}.{path}"
    try:
        linear = model.get_submodule(path)
    except AttributeError:
        raise LoraError(f"unknown target module {where}: the transformer has no such module") from None
    if not isinstance(linear, torch.nn.Linear):
        raise LoraError(f"target module {where} is a {type(linear).__name__}, not a Linear")
    rank = a.shape[0]
    if rank > max_rank:
        raise LoraError(f"{where}: rank {rank} exceeds --max-lora-rank {max_rank}")
    if a.shape[1] != linear.in_features or b.shape[0] != linear.out_features:
        raise LoraError(f"{where}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit a Linear "
                        f"{linear.in_features} -> {linear.out_features}")
    if not (a.is_floating_point() and b.is_floating_point()):
        raise LoraError(f"{where}: lora_A and lora_B must be floating point")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise LoraError(f"{where}: non-finite values (NaN or inf)")
    w = linear.weight
    a, b = a.detach().to(w.device, w.dtype), b.detach().to(w.device, w.dtype)
    dense = b @ a if rank * (linear.in_features + linear.out_features) >= linear.in_features * linear.out_features else None
    return LoraModule(a, b, scaling, dense)


class LoraRows:
    """The adapter of every row of one forward's batch: (adapter, scale) or None per row.

    Per targeted Linear, each adapter present adds its delta to its own rows only: its rows of the
    input (a slice when they are consecutive, else a gather), ``u = (x A^T) * scale * alpha / r``
    (small: rank columns), and ``u B^T`` added into those rows of the Linear's output in place. The
    work is each adapter's own rank on its own rows, whatever the number of adapters in the batch.
    """

    def __init__(self, rows: list[tuple[LoraAdapter, float] | None], device: torch.device):
        self.n = len(rows)
        groups: dict[LoraAdapter, tuple[list[int], list[float]]] = {}
        for i, choice in enumerate(rows):
            if choice is not None:
                idx, scales = groups.setdefault(choice[0], ([], []))
                idx.append(i)
                scales.append(choice[1])
        self.groups = []
        for adapter, (idx, scales) in groups.items():
            span = (idx[0], idx[-1] + 1) if idx == list(range(idx[0], idx[-1] + 1)) else None
            self.groups.append((adapter, torch.tensor(idx, device=device), span,
                                torch.tensor(scales, dtype=torch.float64),
                                scales[0] if len(set(scales)) == 1 else None))
        self._factors: dict[tuple[int, float, torch.dtype], torch.Tensor] = {}
        self.device = device

    def _factor(self, g: int, scaling: float, dtype: torch.dtype) -> torch.Tensor:
        """Per row of group ``g``: scale * alpha / r, shaped to broadcast over [rows, tokens, rank]."""
        key = (g, scaling, dtype)
        if key not in self._factors:
            self._factors[key] = (self.groups[g][3] * scaling).to(self.device, dtype).view(-1, 1, 1)
        return self._factors[key]

    def add_deltas(self, expert: str, path: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if x.shape[0] != self.n:  # every Linear of Wan's transformer sees the batch first
            raise RuntimeError(f"{expert}.{path}: input batch {x.shape[0]} is not the {self.n} rows of this forward")
        in_place = not torch.is_grad_enabled() and out.is_contiguous()
        for g, (adapter, idx, span, _, scale) in enumerate(self.groups):
            m = adapter.experts.get(expert, {}).get(path)
            if m is None:
                continue
            xs = x[span[0]:span[1]] if span is not None else x.index_select(0, idx)
            if span is not None and in_place and scale is not None:
                # The common case (the batch orders rows by adapter): matmuls straight into that slice of the output.
                flat, target = xs.reshape(-1, xs.shape[-1]), out[span[0]:span[1]].view(-1, out.shape[-1])
                if m.dense is not None:
                    target.addmm_(flat, m.dense.T, alpha=scale * m.scaling)
                else:
                    target.addmm_(flat @ m.a.T, m.b.T, alpha=scale * m.scaling)
                continue
            u = xs.reshape(xs.shape[0], -1, xs.shape[-1]) @ m.a.T  # [rows, tokens, rank]
            u = (u * self._factor(g, m.scaling, u.dtype)).reshape(-1, u.shape[-1])
            if span is not None and in_place:
                out[span[0]:span[1]].view(-1, out.shape[-1]).addmm_(u, m.b.T)
                continue
            delta = (u @ m.b.T).view(xs.shape[:-1] + (out.shape[-1],))
            out = out.index_add_(0, idx, delta) if in_place else out.index_add(0, idx, delta)
        return out


class LoraHooks:
    """Forward hooks on one expert's targeted Linears; they act only inside :meth:`rows`."""

    def __init__(self, expert: str, model: torch.nn.Module):
        self.expert, self.model = expert, model
        self.hooked: set[str] = set()
        self.active: dict[int, LoraRows] = {}  # by batch size: the forward's rows, and its distinct text rows
        # What the hooks test: a compiled graph guards on what it reads, and a dict's keys would be batch sizes.
        self.applying = False
        self._last: dict[tuple, LoraRows] = {}  # consecutive forwards often have the same rows

    def cover(self, adapter: LoraAdapter) -> None:
        """Hook the modules ``adapter`` targets in this expert (hooks stay: an idle one costs a check)."""
        for path in adapter.experts.get(self.expert, {}):
            if path not in self.hooked:
                self.model.get_submodule(path).register_forward_hook(self._hook(path))
                self.hooked.add(path)

    def _hook(self, path: str):
        # Under torch.compile the deltas are one opaque op (common/diffusion/opaque.py): traced, each mix of
        # adapters would be a recompile. The idle check stays in the graph.
        add = opaque_update(functools.partial(self._add_deltas, path))

        def hook(module, args, out):
            if not self.applying:
                return None
            return add(args[0], out)
        return hook

    def _add_deltas(self, path: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        rows = self.active.get(x.shape[0]) or next(iter(self.active.values()))  # a mismatch raises there
        return rows.add_deltas(self.expert, path, x, out)

    def _rows(self, rows: list) -> LoraRows:
        key = tuple(rows)  # adapters hash by identity: a new version is a new key
        if key not in self._last:
            self._last = {k: v for k, v in self._last.items() if len(k) != len(key)}  # the latest of each size
            self._last[key] = LoraRows(rows, next(self.model.parameters()).device)
        return self._last[key]

    @contextmanager
    def rows(self, rows: list[tuple[LoraAdapter, float] | None],
             text_rows: list[tuple[LoraAdapter, float] | None] | None = None) -> Iterator[None]:
        """Apply the rows' adapters during the forward inside this block (nothing when no row has one).
        ``text_rows``: the adapters of the distinct text rows when the forward shares its text
        (:mod:`common.diffusion.shared_text`); the text-side Linears see those rows only."""
        if all(r is None for r in rows):
            yield
            return
        self.active = {len(rows): self._rows(rows)}
        if text_rows is not None:
            self.active[len(text_rows)] = self._rows(text_rows)
        self.applying = True
        try:
            yield
        finally:
            self.active, self.applying = {}, False
