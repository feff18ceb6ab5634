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
sends repeatedly it keeps segments prepared ahead of time (:class:`SparePool`:
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
import re
import secrets
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from common.config.engine import EngineConfig
from common.protocol.codec import WireError, tensor_bytes

log = logging.getLogger("disagg.shm")

SHM_DIR = "/dev/shm"
DEFAULT_THRESHOLD = 1 << 20
DEFAULT_SPARE_BYTES = 1 << 30
SEEN_SIZES = 16  # a size gets a prepared segment once it repeats among the last SEEN_SIZES sizes sent
# Below this, a copy into a prepared segment is one memmove: waking torch's worker threads for one isolated
# copy can cost more than the copy (measured: milliseconds on a busy 2-core host); above, torch's copy.
THREADED_COPY_BYTES = 16 << 20
TOKEN_HEX = 32
NAME_CHARS = re.compile(r"[A-Za-z0-9_-]+")  # a segment name a message may carry
_LOCAL_CHARS = re.compile(r"[A-Za-z0-9_.-]+")  # also a sender's prepared segments (see SparePool)
_TOKEN = re.compile(rf"[0-9a-f]{{{TOKEN_HEX}}}")
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def engine_prefix(runtime_dir: str) -> str:
    """``disagg-<8 hex>-``: the same in every process of one engine, different between engines."""
    return f"disagg-{hashlib.sha256(runtime_dir.encode()).hexdigest()[:8]}-"


def available(config: EngineConfig) -> bool:
    """Whether this engine moves large tensors through shared memory (ipc only, threshold > 0)."""
    return config.transport == "ipc" and config.shm_threshold_bytes > 0 and os.path.isdir(SHM_DIR)


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def _own_regular_file(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def _unlink(name: str) -> None:
    try:
        os.unlink(_path(name))
    except FileNotFoundError:
        pass


def _token() -> str:
    return secrets.token_hex(TOKEN_HEX // 2)


def _remove_own(matches) -> int:
    """Remove this user's regular files in /dev/shm whose names ``matches`` accepts."""
    removed = 0
    for entry in os.scandir(SHM_DIR):
        if matches(entry.name):
            try:
                if _own_regular_file(entry.stat(follow_symlinks=False)):
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                pass
    return removed


def _sweep(stem: str) -> int:
    """Remove this user's regular files named ``<stem><token>``."""
    return _remove_own(lambda name: name.startswith(stem) and _TOKEN.fullmatch(name[len(stem):]) is not None)


@dataclass
class _Spare:
    name: str
    nbytes: int
    mm: mmap.mmap


def _release(mm: mmap.mmap) -> None:
    try:
        mm.close()
    except BufferError:  # a tensor still views it (a traceback holding a frame): unmapped when that goes
        pass


class SparePool:
    """Segments allocated and mapped ahead of time, so that sending a tensor of a size seen before is
    one memcpy into memory that is already there.

    Making a segment's pages and mapping them is most of the cost of a fresh segment (page faults,
    zeroing); a background thread does that work between sends. A size gets a spare once it repeats
    among the last few sizes sent; at most ``max_bytes`` of spares wait at a time (least recently
    used go first). Spares are named ``<prefix>spare.<me>.<token>``: the dots make it a name no
    message can carry (the wire's name pattern and every receiver refuse it). A spare becomes a
    message's segment by a hard link to the message's name (the spare name is then removed), so a
    receiver sees exactly what a fresh segment would be. The sender's own mapping is unmapped by the
    background thread after the send. ``/dev/shm`` full: spares stop, with a warning.
    """

    def __init__(self, prefix: str, me: str, max_bytes: int):
        if not NAME_CHARS.fullmatch(prefix + me):
            raise ValueError(f"bad shared-memory prefix or process name: {prefix!r}, {me!r}")
        self.stem = f"{prefix}spare.{me}."
        self.max_bytes = max_bytes
        self._cv = threading.Condition()
        self._ready: OrderedDict[int, _Spare] = OrderedDict()  # size -> spare, least recently used first
        self._wanted: OrderedDict[int, None] = OrderedDict()
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._retired: list[mmap.mmap] = []
        self._thread: threading.Thread | None = None
        self._busy = False
        self.failed = False

    def take(self, nbytes: int) -> _Spare | None:
        """A ready spare of exactly ``nbytes`` (never waits); asks for the next one of that size."""
        with self._cv:
            spare = self._ready.pop(nbytes, None)
            repeated = spare is not None or nbytes in self._seen
            self._seen[nbytes] = None
            self._seen.move_to_end(nbytes)
            while len(self._seen) > SEEN_SIZES:
                self._seen.popitem(last=False)
            if repeated and nbytes <= self.max_bytes and not self.failed:
                self._wanted[nbytes] = None
                self._start()
                if spare is None:  # else retire() wakes the thread, once the send's copy is done
                    self._cv.notify_all()
        return spare

    def retire(self, mm: mmap.mmap) -> None:
        """The sender is done with a spare's mapping: unmapped in the background."""
        with self._cv:
            self._retired.append(mm)
            self._start()
            self._cv.notify_all()

    def wait_ready(self, nbytes: int, timeout: float) -> bool:
        """Wait until a spare of ``nbytes`` is ready (benchmarks and tests)."""
        with self._cv:
            return self._cv.wait_for(lambda: nbytes in self._ready or self.failed, timeout) and nbytes in self._ready

    def sweep(self) -> int:
        """Remove spares left by a previous process of the same name."""
        return _sweep(self.stem)

    def close(self, timeout: float = 30.0) -> None:
        """Prepare nothing more and remove every spare (after one being prepared now is done)."""
        with self._cv:
            self.failed = True
            self._wanted.clear()
            self._cv.wait_for(lambda: not self._busy, timeout)
            ready, self._ready = list(self._ready.values()), OrderedDict()
        for spare in ready:
            _unlink(spare.name)
            _release(spare.mm)

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shm-spares", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        try:  # Linux: the nice value of this thread only; the process's own work comes first
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._retired or self._wanted)
                retired, self._retired = self._retired, []
                nbytes = self._wanted.popitem(last=False)[0] if self._wanted else None
                if nbytes is not None and (nbytes in self._ready or self.failed):
                    nbytes = None
                evicted = []
                while nbytes is not None and self._ready and sum(
                        s.nbytes for s in self._ready.values()) + nbytes > self.max_bytes:
                    evicted.append(self._ready.popitem(last=False)[1])
                self._busy = True  # close() waits for what is taken out of the pool here
            spare = None
            try:
                for mm in retired:
                    _release(mm)
                for old in evicted:
                    _unlink(old.name)
                    _release(old.mm)
                if nbytes is not None:
                    try:
                        spare = self._prepare(nbytes)
                    except (OSError, ValueError) as e:
                        log.warning("cannot prepare shared-memory segments (%s); each large tensor gets a new one",
                                    e)
                        with self._cv:
                            self.failed = True
                with self._cv:
                    if spare is not None and not self.failed:
                        self._ready[nbytes] = spare
                        spare = None
                if spare is not None:  # closed meanwhile
                    _unlink(spare.name)
                    _release(spare.mm)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _prepare(self, nbytes: int) -> _Spare:
        name = self.stem + _token()
        fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_RDWR | _O_NOFOLLOW | _O_CLOEXEC, 0o600)
        try:
            # Pages exist from here on: a full /dev/shm is an error now, never a SIGBUS in a later store.
            os.posix_fallocate(fd, 0, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            _unlink(name)
            raise
        finally:
            os.close(fd)
        return _Spare(name, nbytes, mm)


class ShmSender:
    """Puts tensors of at least ``threshold`` bytes into segments addressed to one process."""

    def __init__(self, prefix: str, dest: str, threshold: int, spares: SparePool | None = None):
        if not NAME_CHARS.fullmatch(prefix + dest):
            raise ValueError(f"bad shared-memory prefix or destination: {prefix!r}, {dest!r}")
        self.prefix, self.dest, self.threshold, self.spares = prefix, dest, threshold, spares
        self._warned = False

    def put(self, t: torch.Tensor) -> str | None:
        """The name of a new segment holding ``t``'s bytes, or None: send ``t`` as a frame."""
        nbytes = t.numel() * t.element_size()
        if self.threshold <= 0 or nbytes < self.threshold or nbytes == 0:
            return None
        name = f"{self.prefix}{self.dest}-{_token()}"
        spare = self.spares.take(nbytes) if self.spares is not None else None
        if spare is not None and self._from_spare(spare, t, name):
            log.debug("%d bytes to %s through shared memory (prepared segment)", nbytes, self.dest)
            return name
        data = tensor_bytes(t)
        try:
            fd = os.open(_path(name), os.O_CREAT | os.O_EXCL | os.O_WRONLY | _O_NOFOLLOW | _O_CLOEXEC, 0o600)
        except OSError as e:
            self._fall_back(e)
            return None
        try:
            written = 0
            while written < data.nbytes:
                written += os.write(fd, data[written:])
        except OSError as e:  # e.g. ENOSPC: /dev/shm is full
            _unlink(name)
            self._fall_back(e)
            return None
        finally:
            os.close(fd)
        log.debug("%d bytes to %s through shared memory (new segment)", data.nbytes, self.dest)
        return name

    def _from_spare(self, spare: _Spare, t: torch.Tensor, name: str) -> bool:
        """Copy ``t`` into a prepared segment (one copy, also from a strided or GPU tensor) and give it ``name``."""
        try:
            src = t.detach()
            dst = torch.frombuffer(spare.mm, dtype=torch.uint8)
            if src.device.type == "cpu" and src.is_contiguous() and spare.nbytes < THREADED_COPY_BYTES:
                ctypes.memmove(dst.data_ptr(), src.data_ptr(), spare.nbytes)  # one thread, GIL released
            else:  # large, strided or on a GPU: torch's copy (its threads; one pass)
                dst.view(src.dtype).reshape(src.shape).copy_(src)
            del dst
            os.link(_path(spare.name), _path(name))
            return True
        except (OSError, RuntimeError) as e:
            log.warning("prepared shared-memory segment unusable (%s); writing a new one", e)
            return False
        finally:
            _unlink(spare.name)
            self.spares.retire(spare.mm)

    def discard(self, name: str) -> None:
        """Remove a segment this sender made whose message was never sent."""
        if name.startswith(f"{self.prefix}{self.dest}-") and NAME_CHARS.fullmatch(name):
            _unlink(name)

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

    def valid(self, name: object) -> bool:
        """A name of this engine addressed to this process; only such a name is ever opened or removed."""
        return (
            isinstance(name, str)
            and name.startswith(self.own)
            and _TOKEN.fullmatch(name[len(self.own):]) is not None
        )

    def open(self, name: str, nbytes: int, request_id: str | None = None) -> memoryview:
        """The segment's bytes, mapped; the name is gone from ``/dev/shm`` when this returns.

        Raises :class:`WireError` for a name this process must not open, a missing
        segment, or a size other than ``nbytes``.
        """
        if not self.valid(name):
            raise WireError(f"shared-memory segment {name!r} is not addressed to this process", request_id)
        if nbytes <= 0:
            _unlink(name)
            raise WireError("an empty tensor never travels in shared memory", request_id)
        try:
            fd = os.open(_path(name), os.O_RDWR | os.O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC)
        except OSError as e:
            raise WireError(f"shared-memory segment {name!r} cannot be opened: {e.strerror}", request_id) from None
        try:
            st = os.fstat(fd)
            if not _own_regular_file(st):
                raise WireError(f"shared-memory segment {name!r} is not a file of this engine", request_id)
            os.unlink(_path(name))
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
                st = os.lstat(_path(name))
            except FileNotFoundError:
                return
            if _own_regular_file(st):
                _unlink(name)

    def sweep(self) -> int:
        """Remove leftovers addressed to this process (from a previous process in its place)."""
        removed = _sweep(self.own)
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
    return _remove_own(lambda name: name.startswith(prefix) and _LOCAL_CHARS.fullmatch(name) is not None)
