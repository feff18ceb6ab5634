"""Parse a ``--topology`` spec into worker specs with endpoints.

Two forms:

* compact: ``encoder=1,denoise=2,decode=1``; devices round-robin over the
  visible GPUs, CPU when there are none;
* a YAML or JSON file: ``{"workers": [{"role": "denoise", "device": "cuda:1",
  "threads": 4}, ...]}`` (or a bare list of such entries).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from common.config import WorkerSpec, validate_workers
from common.messages import ROLES

_COMPACT = re.compile(r"^\s*(\w+)\s*=\s*(\d+)\s*$")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def _visible_devices() -> list[str]:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i}" for i in range(n)] or ["cpu"]


def _parse_compact(spec: str) -> list[dict]:
    counts: dict[str, int] = {}
    for part in spec.split(","):
        m = _COMPACT.match(part)
        if not m:
            raise ValueError(f"bad topology item {part!r}; expected ROLE=COUNT, e.g. denoise=2")
        role, count = m.group(1), int(m.group(2))
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r} in topology (expected one of {ROLES})")
        if role in counts:
            raise ValueError(f"role {role!r} appears twice in the topology")
        if count < 1 or count > 64:
            raise ValueError(f"{role}={count}: count must be within 1..64")
        counts[role] = count
    devices = _visible_devices()
    entries, k = [], 0
    for role in ROLES:
        for _ in range(counts.get(role, 0)):
            entries.append({"role": role, "device": devices[k % len(devices)]})
            k += 1
    return entries


def _parse_file(path: Path) -> list[dict]:
    text = path.read_text()
    if path.suffix in (".yaml", ".yml"):
        import yaml  # only needed for YAML topology files

        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:  # not a ValueError: report it as every other bad topology
            raise ValueError(f"{path}: not valid YAML: {e}") from None
    else:
        data = json.loads(text)  # json.JSONDecodeError is a ValueError
    if isinstance(data, dict):
        data = data.get("workers")
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a list of workers or {{'workers': [...]}}")
    return data


def parse_topology(spec: str, runtime_dir: str | Path) -> list[WorkerSpec]:
    """Worker specs with indices per role and ``ipc://`` endpoints in ``runtime_dir``."""
    path = Path(spec)
    entries = _parse_file(path) if path.suffix in (".yaml", ".yml", ".json") else _parse_compact(spec)
    workers: list[WorkerSpec] = []
    next_index = {r: 0 for r in ROLES}
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or e.get("role") not in ROLES:
            raise ValueError(f"worker #{i}: needs a role among {ROLES}")
        unknown = set(e) - {"role", "device", "threads"}
        if unknown:
            raise ValueError(f"worker #{i}: unknown keys {sorted(unknown)}")
        device = str(e.get("device", "cpu"))
        if not _DEVICE.match(device):
            raise ValueError(f"worker #{i}: bad device {device!r} (cpu, cuda or cuda:N)")
        threads = e.get("threads", 0)
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
            raise ValueError(f"worker #{i}: threads must be a non-negative integer")
        role = e["role"]
        idx = next_index[role]
        next_index[role] += 1
        endpoint = f"ipc://{Path(runtime_dir) / f'{role}-{idx}.sock'}"
        workers.append(WorkerSpec(role=role, index=idx, device=device, endpoint=endpoint, threads=threads))
    validate_workers(workers)
    return workers
