"""Parse a ``--topology`` spec into worker specs with endpoints.

Two forms:

* compact: ``encoder=1,denoise=2,decode=1``; devices round-robin over the
  visible GPUs, CPU when there are none. A denoise worker over several devices:
  ``denoise=1:ulysses=2:cfg`` (options after colons: ``ulysses=N``, ``ring=N``,
  ``cfg``); each such worker takes ``ulysses * ring * (2 with cfg)`` devices of the round;
* a YAML or JSON file: ``{"workers": [{"role": "denoise", "device": "cuda:1",
  "threads": 4, "host": "10.0.0.2"}, ...]}`` (or a bare list of such entries).
  A multi-device denoise worker: ``{"role": "denoise", "devices": ["cuda:0",
  "cuda:1", "cuda:2", "cuda:3"], "ulysses": 2, "cfg_parallel": true}`` (on the
  CPU, ``devices`` may be left out: every rank is ``cpu``). With ``launch.py --ray``, an entry may
  name custom Ray resources that pin it to nodes: ``"resources": {"node_a": 1}``.

Endpoints depend on the transport: ``ipc://<runtime>/<role>-<index>.sock``
(the default; one host), or ``tcp://<host>:<free port>`` where ``host`` is the
worker's ``host`` key (default 127.0.0.1): the address its input socket binds
to and the others connect to.
"""

from __future__ import annotations

import ipaddress
import json
import re
import socket
from collections.abc import Callable
from pathlib import Path

import torch

from common.config.engine import WorkerSpec, validate_workers
from common.protocol.messages import ROLES

_COMPACT = re.compile(r"^\s*(\w+)\s*=\s*(\d+)\s*((?::[\w=]+)*)\s*$")
_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$")
TRANSPORTS = ("ipc", "tcp")
LOOPBACK = "127.0.0.1"


def is_device(name: str) -> bool:
    """Whether ``name`` spells a worker device: cpu, cuda or cuda:N."""
    return bool(_DEVICE.match(name))


def _visible_devices() -> list[str]:
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{i}" for i in range(n)] or ["cpu"]


def _compact_options(role: str, text: str) -> dict:
    """``:ulysses=2:cfg`` -> the entry keys of a multi-device denoise worker."""
    out: dict = {}
    for opt in filter(None, text.split(":")):
        if role != "denoise":
            raise ValueError(f"{role}: only denoise workers take options (got {opt!r})")
        if opt == "cfg":
            out["cfg_parallel"] = True
        elif re.fullmatch(r"(ulysses|ring)=\d+", opt):
            key, value = opt.split("=")
            out[key] = int(value)
        else:
            raise ValueError(f"denoise: unknown option {opt!r} (ulysses=N, ring=N or cfg)")
    return out


def _parse_compact(spec: str) -> list[dict]:
    counts: dict[str, int] = {}
    options: dict[str, dict] = {}
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
        options[role] = _compact_options(role, m.group(3))
    devices = _visible_devices()
    entries, k = [], 0
    for role in ROLES:
        opts = options.get(role, {})
        ranks = opts.get("ulysses", 1) * opts.get("ring", 1) * (2 if opts.get("cfg_parallel") else 1)
        for _ in range(counts.get(role, 0)):
            mine = [devices[(k + r) % len(devices)] for r in range(ranks)]
            entries.append({"role": role, "device": mine[0], **opts, **({"devices": mine} if ranks > 1 else {})})
            k += ranks
    return entries


def _ranks(i: int, e: dict, device: str) -> dict:
    """A multi-device denoise worker's keys, checked: ``devices`` (the leader's first), ``ulysses``, ``ring``,
    ``cfg_parallel``."""
    ulysses, ring, cfg = e.get("ulysses", 1), e.get("ring", 1), e.get("cfg_parallel", False)
    for key, value in (("ulysses", ulysses), ("ring", ring)):
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 64:
            raise ValueError(f"worker #{i}: {key} must be an integer within 1..64")
    if not isinstance(cfg, bool):
        raise ValueError(f"worker #{i}: cfg_parallel must be true or false")
    world = ulysses * ring * (2 if cfg else 1)
    if "devices" not in e and world == 1:
        return {}
    if e["role"] != "denoise":
        raise ValueError(f"worker #{i}: only a denoise worker may own several devices")
    devices = e.get("devices", [device] * world if device == "cpu" else None)
    if not isinstance(devices, list) or not all(isinstance(d, str) and _DEVICE.match(d) for d in devices):
        raise ValueError(f"worker #{i}: devices must be a list of cpu, cuda or cuda:N (name them for GPUs)")
    if len(devices) != world:
        raise ValueError(f"worker #{i}: {len(devices)} devices for ulysses {ulysses} x ring {ring} x cfg "
                         f"{2 if cfg else 1} = {world} ranks")
    if ring > 1 and devices[0] == "cpu":
        raise ValueError(f"worker #{i}: ring attention needs GPUs (cuDNN attention returns the log-sum-exp it "
                         "merges by); on CPUs use ulysses")
    if len({d.split(":")[0] for d in devices}) != 1 or any(d == "cuda" for d in devices) and world > 1:
        raise ValueError(f"worker #{i}: devices must be all cpu or all cuda:N")
    cuda = [d for d in devices if d != "cpu"]
    if len(set(cuda)) != len(cuda):
        raise ValueError(f"worker #{i}: a GPU appears twice in devices")
    if "device" in e and e["device"] != devices[0]:
        raise ValueError(f"worker #{i}: device {e['device']!r} is not devices[0] ({devices[0]!r})")
    return {"devices": devices, "ulysses": ulysses, "ring": ring, "cfg_parallel": cfg}


def _resources(i: int, resources: object) -> dict[str, float]:
    """Custom Ray resources that pin a worker to nodes (``{"node_a": 1}``); Ray's own CPU/GPU come from the
    worker's threads and devices."""
    if not isinstance(resources, dict):
        raise ValueError(f"worker #{i}: resources must be a mapping of resource name to amount")
    for name, amount in resources.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z_][\w.:-]{0,127}", name):
            raise ValueError(f"worker #{i}: bad resource name {name!r}")
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            raise ValueError(f"worker #{i}: resource {name!r} comes from threads and devices; name custom ones only")
        if not isinstance(amount, (int, float)) or isinstance(amount, bool) or not 0 < amount <= 1e6:
            raise ValueError(f"worker #{i}: resource {name!r} needs a positive amount")
    return {name: float(amount) for name, amount in resources.items()}


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


def free_tcp_port(host: str = LOOPBACK) -> int:
    """A TCP port on ``host`` that nothing listens on right now (the OS picks it)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    except OSError as e:
        raise ValueError(f"cannot bind a port on host {host!r} (is it an address of this machine?): {e}") from None


def port_picker() -> Callable[[str], int]:
    """``free_tcp_port`` that never hands out the same (host, port) twice: share one per engine."""
    given: set[tuple[str, int]] = set()

    def pick(host: str) -> int:
        for _ in range(100):
            port = free_tcp_port(host)
            if (host, port) not in given:
                given.add((host, port))
                return port
        raise ValueError(f"could not find a free port on {host!r}")

    return pick


def check_host(host: object) -> str:
    """An IPv4 address or host name that other processes can connect to (not a wildcard)."""
    if not isinstance(host, str) or not host:
        raise ValueError("host must be a non-empty string")
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        if not _HOSTNAME.match(host) or host.replace(".", "").isdigit():
            raise ValueError(f"bad host {host!r} (an IPv4 address or a host name)") from None
        return host
    if addr.version != 4:
        raise ValueError(f"bad host {host!r}: only IPv4 addresses are supported")
    if addr.is_unspecified:
        raise ValueError(f"bad host {host!r}: name the address others connect to, not a wildcard")
    return host


def _ipv4(host: str) -> str:
    """The IPv4 address of ``host`` (zmq binds to addresses, not names)."""
    try:
        return socket.gethostbyname(host)
    except OSError as e:
        raise ValueError(f"cannot resolve host {host!r}: {e}") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def router_endpoint(runtime_dir: str | Path, transport: str = "ipc", host: str = LOOPBACK,
                    pick_port: Callable[[str], int] | None = None) -> str:
    """Where the router's PULL socket binds."""
    if transport == "ipc":
        return f"ipc://{Path(runtime_dir) / 'router.sock'}"
    if transport == "tcp":
        addr = _ipv4(check_host(host))
        return f"tcp://{addr}:{(pick_port or free_tcp_port)(addr)}"
    raise ValueError(f"unknown transport {transport!r} (expected one of {TRANSPORTS})")


def parse_topology(spec: str, runtime_dir: str | Path, transport: str = "ipc",
                   pick_port: Callable[[str], int] | None = None) -> list[WorkerSpec]:
    """Worker specs with indices per role and their input endpoints.

    ``ipc``: ``ipc://`` sockets in ``runtime_dir`` (every worker on this host);
    ``tcp``: ``tcp://<host>:<port>``, the port from ``pick_port(host)`` (default: a fresh
    :func:`port_picker`; pass the one that picked the router's port so none repeats).
    """
    if transport not in TRANSPORTS:
        raise ValueError(f"unknown transport {transport!r} (expected one of {TRANSPORTS})")
    path = Path(spec)
    entries = _parse_file(path) if path.suffix in (".yaml", ".yml", ".json") else _parse_compact(spec)
    workers: list[WorkerSpec] = []
    next_index = {r: 0 for r in ROLES}
    pick_port = pick_port or port_picker()
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or e.get("role") not in ROLES:
            raise ValueError(f"worker #{i}: needs a role among {ROLES}")
        unknown = set(e) - {"role", "device", "threads", "host", "devices", "ulysses", "ring", "cfg_parallel",
                            "resources"}
        if unknown:
            raise ValueError(f"worker #{i}: unknown keys {sorted(unknown)}")
        try:
            host = check_host(e.get("host", LOOPBACK))
        except ValueError as err:
            raise ValueError(f"worker #{i}: {err}") from None
        if transport == "ipc" and not _is_loopback(host):
            raise ValueError(f"worker #{i}: host {host!r} needs --transport tcp (ipc sockets are local files)")
        devices = e.get("devices")
        device = str(e.get("device", devices[0] if isinstance(devices, list) and devices else "cpu"))
        if not _DEVICE.match(device):
            raise ValueError(f"worker #{i}: bad device {device!r} (cpu, cuda or cuda:N)")
        ranks = _ranks(i, e, device)
        threads = e.get("threads", 0)
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 0:
            raise ValueError(f"worker #{i}: threads must be a non-negative integer")
        resources = _resources(i, e.get("resources", {}))
        role = e["role"]
        idx = next_index[role]
        next_index[role] += 1
        if transport == "ipc":
            endpoint = f"ipc://{Path(runtime_dir) / f'{role}-{idx}.sock'}"
        else:
            addr = _ipv4(host)
            endpoint = f"tcp://{addr}:{pick_port(addr)}"
        workers.append(WorkerSpec(role=role, index=idx, device=device, endpoint=endpoint, threads=threads,
                                  host=host, resources=resources, **ranks))
    validate_workers(workers)
    endpoints = [w.endpoint for w in workers]
    if len(set(endpoints)) != len(endpoints):
        raise ValueError("two workers got the same endpoint")
    return workers
