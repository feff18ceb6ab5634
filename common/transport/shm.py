"""Same-host data plane: large tensors travel in POSIX shared memory instead of ZeroMQ frames.

With the ``ipc`` transport every process of an engine runs on one host, so a
tensor of at least ``EngineConfig.shm_threshold_bytes`` bytes (``launch.py
--shm-threshold``, default 1 MiB, 0 turns this off) is written once into a
fresh file under ``/dev/shm`` and only its name crosses the socket, in the
tensor's descriptor (``TensorSpec.shm``); the tensor has no frame.

Segment names are ``<prefix><destination>-<token>``:

* ``prefix`` is ``disagg-<8 hex>-``, derived from the engine's runtime
  directory, so engines never touch each other's segments;
* ``destination`` is the process the message goes to (``router``,
  ``encoder-0``, ``denoise-1``, ...);
* ``token`` is 32 random hex digits.

The sender creates the file with ``O_CREAT | O_EXCL`` and mode 0600 and writes
the bytes with ``write(2)`` (a full ``/dev/shm`` is an error it falls back
from, to a frame, where a store into a mapping would raise SIGBUS). For sizes it
sends repeatedly it keeps segments prepared ahead of time (:class:`SparePool`,
in :mod:`common.transport.shm_segments` with the other file-level helpers:
pages allocated and mapped by a background thread), so that a send is one
memcpy; a prepared segment gets the message's name by a hard link. The sender
never unlinks a segment it has sent: it cannot know when the receiver opened it.

The receiver accepts only a name with its own engine's prefix, its own process
name as destination and a well-formed token (nothing else is ever opened or
removed), opens it without following symlinks, checks that it is a regular
file of the engine's user, unlinks it at once, checks that its size equals the
descriptor's byte count, and maps it. The tensor is a zero-copy view over the
mapping; the mapping (and with it the memory) lives exactly as long as the
tensor, and no name is left behind even if the receiver crashes later.

Leaks: a segment whose message never reaches its receiver (the receiver died
first, ZeroMQ dropped the message) keeps its name, and so do a process's
prepared segments when it dies. Each process removes the leftovers addressed
to itself and its own prepared segments when it starts (:class:`ShmContext`),
and the launcher removes every segment of its engine at start and at exit
(:func:`remove_engine_segments`).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import mmap
import os

import torch

from common.config.engine import EngineConfig
from common.protocol.codec import WireError, tensor_bytes
from common.transport.shm_segments import (
    LOCAL_CHARS,
    NAME_CHARS,
    SHM_DIR,
    Spare,
    SparePool,
    create_segment,
    is_token,
    new_token,
    open_segment,
    own_regular_file,
    remove_own,
    segment_path,
    sweep_stem,
    unlink_segment,
)

__all__ = [
    "DEFAULT_SPARE_BYTES", "DEFAULT_THRESHOLD", "NAME_CHARS", "SHM_DIR", "ShmContext", "ShmReceiver", "ShmSender",
    "SparePool", "available", "engine_prefix", "remove_engine_segments",
]

log = logging.getLogger("disagg.shm")

DEFAULT_THRESHOLD = 1 << 20
DEFAULT_SPARE_BYTES = 1 << 30
# Below this, a copy into a prepared segment is one memmove: waking torch's worker threads for one isolated
# copy can cost more than the copy (measured: milliseconds on a busy 2-core host); above, torch's copy.
THREADED_COPY_BYTES = 16 << 20


def engine_prefix(runtime_dir: str) -> str:
    """``disagg-<8 hex>-``: the same in every process of one engine, different between engines."""
    return f"disagg-{hashlib.sha256(runtime_dir.encode()).hexdigest()[:8]}-"


def available(config: EngineConfig) -> bool:
    """Whether this engine moves large tensors through shared memory (ipc only, threshold > 0)."""
    return config.transport == "ipc" and config.shm_threshold_bytes > 0 and os.path.isdir(SHM_DIR)


class ShmSender:
    """Puts tensors of at least ``threshold`` bytes into segments addressed to one process."""

    def __init__(self, prefix: str, dest: str, threshold: int, spares: SparePool | None = None):
        if not NAME_CHARS.fullmatch(prefix + dest):
            raise ValueError(f"bad shared-memory prefix or destination: {prefix!r}, {dest!r}")
        self.prefix, self.dest, self.threshold, self.spares = prefix, dest, threshold, spares
        self._warned = False
        self.sent = 0  # tensors that went through a segment (metrics)

    def put(self, t: torch.Tensor) -> str | None:
        """The name of a new segment holding ``t``'s bytes, or None: send ``t`` as a frame."""
        nbytes = t.numel() * t.element_size()
        if self.threshold <= 0 or nbytes < self.threshold or nbytes == 0:
            return None
        name = f"{self.prefix}{self.dest}-{new_token()}"
        spare = self.spares.take(nbytes) if self.spares is not None else None
        if spare is not None and self._from_spare(spare, t, name):
            log.debug("%d bytes to %s through shared memory (prepared segment)", nbytes, self.dest)
            self.sent += 1
            return name
        data = tensor_bytes(t)
        try:
            fd = create_segment(name, os.O_WRONLY)
        except OSError as e:
            self._fall_back(e)
            return None
        try:
            written = 0
            while written < data.nbytes:
                written += os.write(fd, data[written:])
        except OSError as e:  # e.g. ENOSPC: /dev/shm is full
            unlink_segment(name)
            self._fall_back(e)
            return None
        finally:
            os.close(fd)
        log.debug("%d bytes to %s through shared memory (new segment)", data.nbytes, self.dest)
        self.sent += 1
        return name

    def _from_spare(self, spare: Spare, t: torch.Tensor, name: str) -> bool:
        """Copy ``t`` into a prepared segment (one copy, also from a strided or GPU tensor) and give it ``name``."""
        try:
            src = t.detach()
            dst = torch.frombuffer(spare.mm, dtype=torch.uint8)
            if src.device.type == "cpu" and src.is_contiguous() and spare.nbytes < THREADED_COPY_BYTES:
                ctypes.memmove(dst.data_ptr(), src.data_ptr(), spare.nbytes)  # one thread, GIL released
            else:  # large, strided or on a GPU: torch's copy (its threads; one pass)
                dst.view(src.dtype).reshape(src.shape).copy_(src)
            del dst
            os.link(segment_path(spare.name), segment_path(name))
            return True
        except (OSError, RuntimeError) as e:
            log.warning("prepared shared-memory segment unusable (%s); writing a new one", e)
            return False
        finally:
            unlink_segment(spare.name)
            self.spares.retire(spare.mm)

    def discard(self, name: str) -> None:
        """Remove a segment this sender made whose message was never sent."""
        if name.startswith(f"{self.prefix}{self.dest}-") and NAME_CHARS.fullmatch(name):
            unlink_segment(name)

    def _fall_back(self, e: OSError) -> None:
        if not self._warned:
            log.warning("shared memory unavailable (%s); large tensors to %s travel as frames", e, self.dest)
            self._warned = True


class ShmReceiver:
    """Opens the segments addressed to one process (``me``) of one engine (``prefix``), and nothing else."""

    def __init__(self, prefix: str, me: str, max_bytes: int | None = None):
        if not NAME_CHARS.fullmatch(prefix + me):
            raise ValueError(f"bad shared-memory prefix or process name: {prefix!r}, {me!r}")
        self.own = f"{prefix}{me}-"
        self.max_bytes = max_bytes
        self.received = 0  # segments opened (metrics)

    def valid(self, name: object) -> bool:
        """A name of this engine addressed to this process; only such a name is ever opened or removed."""
        return (
            isinstance(name, str)
            and name.startswith(self.own)
            and is_token(name[len(self.own):])
        )

    def open(self, name: str, nbytes: int, request_id: str | None = None) -> memoryview:
        """The segment's bytes, mapped; the name is gone from ``/dev/shm`` when this returns.

        Raises :class:`WireError` for a name this process must not open, a missing
        segment, or a size other than ``nbytes``.
        """
        if not self.valid(name):
            raise WireError(f"shared-memory segment {name!r} is not addressed to this process", request_id)
        if nbytes <= 0:
            unlink_segment(name)
            raise WireError("an empty tensor never travels in shared memory", request_id)
        try:
            fd = open_segment(name)
        except OSError as e:
            raise WireError(f"shared-memory segment {name!r} cannot be opened: {e.strerror}", request_id) from None
        try:
            st = os.fstat(fd)
            if not own_regular_file(st):
                raise WireError(f"shared-memory segment {name!r} is not a file of this engine", request_id)
            os.unlink(segment_path(name))
            self.received += 1
            if st.st_size != nbytes:
                raise WireError(
                    f"shared-memory segment {name!r} has {st.st_size} bytes, the descriptor needs {nbytes}",
                    request_id,
                )
            if self.max_bytes is not None and nbytes > self.max_bytes:
                raise WireError(f"shared-memory tensor of {nbytes} bytes exceeds {self.max_bytes}", request_id)
            return memoryview(mmap.mmap(fd, nbytes))
        finally:
            os.close(fd)

    def discard(self, name: object) -> None:
        """Remove a segment of a message that was rejected before the segment was opened."""
        if self.valid(name):
            try:
                st = os.lstat(segment_path(name))
            except FileNotFoundError:
                return
            if own_regular_file(st):
                unlink_segment(name)

    def sweep(self) -> int:
        """Remove leftovers addressed to this process (from a previous process in its place)."""
        removed = sweep_stem(self.own)
        if removed:
            log.warning("removed %d leftover shared-memory segment(s) addressed to %s", removed, self.own[:-1])
        return removed


class ShmContext:
    """One process's side of the data plane: a receiver for itself and a sender per destination.

    Both are None when the engine does not use shared memory (tcp, or threshold 0);
    a message that names a segment is then rejected by the codec. Creating the
    context removes the leftovers addressed to this process.
    """

    def __init__(self, config: EngineConfig, me: str):
        self.enabled = available(config)
        self.prefix = engine_prefix(config.runtime_dir)
        self.threshold = config.shm_threshold_bytes
        self.receiver = ShmReceiver(self.prefix, me, config.limits.max_message_bytes) if self.enabled else None
        self.spares = SparePool(self.prefix, me, config.shm_spare_bytes) if (
            self.enabled and config.shm_spare_bytes > 0) else None
        self._senders: dict[str, ShmSender] = {}
        if self.receiver is not None:
            self.receiver.sweep()
        if self.spares is not None:
            self.spares.sweep()

    def counts(self) -> dict[str, int]:
        """Tensors this process sent and received through shared memory."""
        senders = list(self._senders.values())  # one C-level copy: safe while another thread adds a sender
        return {"sent": sum(s.sent for s in senders),
                "received": self.receiver.received if self.receiver is not None else 0}

    def sender(self, dest: str) -> ShmSender | None:
        if not self.enabled:
            return None
        s = self._senders.get(dest)
        if s is None:
            s = self._senders[dest] = ShmSender(self.prefix, dest, self.threshold, self.spares)
        return s


def remove_engine_segments(prefix: str) -> int:
    """Launcher: remove every segment of the engine with ``prefix`` (at start and at exit)."""
    if not (prefix.startswith("disagg-") and NAME_CHARS.fullmatch(prefix)) or not os.path.isdir(SHM_DIR):
        return 0
    return remove_own(lambda name: name.startswith(prefix) and LOCAL_CHARS.fullmatch(name) is not None)
