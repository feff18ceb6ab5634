"""Segment files under ``/dev/shm`` for the same-host data plane (:mod:`common.transport.shm`).

Here: where segments live, how their names and tokens look, creating and
opening them safely (exclusive create, mode 0600, never through a symlink),
removing one's own leftovers, and :class:`SparePool`, the segments a sender
prepares ahead of time. Who may send or open which name is
:mod:`common.transport.shm`'s business.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass

log = logging.getLogger("disagg.shm")

SHM_DIR = "/dev/shm"
SEEN_SIZES = 16  # a size gets a prepared segment once it repeats among the last SEEN_SIZES sizes sent
TOKEN_HEX = 32
NAME_CHARS = re.compile(r"[A-Za-z0-9_-]+")  # a segment name a message may carry
LOCAL_CHARS = re.compile(r"[A-Za-z0-9_.-]+")  # also a sender's prepared segments (see SparePool)
_TOKEN = re.compile(rf"[0-9a-f]{{{TOKEN_HEX}}}")
_SAFE_OPEN = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def segment_path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


def is_token(text: str) -> bool:
    return _TOKEN.fullmatch(text) is not None


def new_token() -> str:
    return secrets.token_hex(TOKEN_HEX // 2)


def own_regular_file(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def create_segment(name: str, access: int) -> int:
    """A descriptor of the new segment ``name`` (mode 0600); fails if the name exists, even as a symlink."""
    return os.open(segment_path(name), os.O_CREAT | os.O_EXCL | access | _SAFE_OPEN, 0o600)


def open_segment(name: str) -> int:
    """A read-write descriptor of the existing segment ``name``, never through a symlink."""
    return os.open(segment_path(name), os.O_RDWR | os.O_NONBLOCK | _SAFE_OPEN)


def unlink_segment(name: str) -> None:
    try:
        os.unlink(segment_path(name))
    except FileNotFoundError:
        pass


def remove_own(matches) -> int:
    """Remove this user's regular files in /dev/shm whose names ``matches`` accepts."""
    removed = 0
    for entry in os.scandir(SHM_DIR):
        if matches(entry.name):
            try:
                if own_regular_file(entry.stat(follow_symlinks=False)):
                    os.unlink(entry.path)
                    removed += 1
            except FileNotFoundError:
                pass
    return removed


def sweep_stem(stem: str) -> int:
    """Remove this user's regular files named ``<stem><token>``."""
    return remove_own(lambda name: name.startswith(stem) and is_token(name[len(stem):]))


@dataclass
class Spare:
    name: str
    nbytes: int
    mm: mmap.mmap


def release(mm: mmap.mmap) -> None:
    """Unmap ``mm`` now, or when the last tensor viewing it goes."""
    try:
        mm.close()
    except BufferError:  # a tensor still views it (a traceback holding a frame): unmapped when that goes
        pass


def _discard(spare: Spare) -> None:
    unlink_segment(spare.name)
    release(spare.mm)


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
        self._ready: OrderedDict[int, Spare] = OrderedDict()  # size -> spare, least recently used first
        self._wanted: OrderedDict[int, None] = OrderedDict()
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._retired: list[mmap.mmap] = []
        self._thread: threading.Thread | None = None
        self._busy = False
        self.failed = False

    def take(self, nbytes: int) -> Spare | None:
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
        return sweep_stem(self.stem)

    def close(self, timeout: float = 30.0) -> None:
        """Prepare nothing more and remove every spare (after one being prepared now is done)."""
        with self._cv:
            self.failed = True
            self._wanted.clear()
            self._cv.wait_for(lambda: not self._busy, timeout)
            ready, self._ready = list(self._ready.values()), OrderedDict()
        for spare in ready:
            _discard(spare)

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
                retired, nbytes, evicted = self._take_work()
                self._busy = True  # close() waits for what is taken out of the pool here
            try:
                self._do_work(retired, nbytes, evicted)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _take_work(self) -> tuple[list[mmap.mmap], int | None, list[Spare]]:
        """Under the lock: the mappings to unmap, the size to prepare (or None) and the spares evicted
        to make room for it."""
        retired, self._retired = self._retired, []
        nbytes = self._wanted.popitem(last=False)[0] if self._wanted else None
        if nbytes is not None and (nbytes in self._ready or self.failed):
            nbytes = None
        evicted = []
        while nbytes is not None and self._ready and sum(
                s.nbytes for s in self._ready.values()) + nbytes > self.max_bytes:
            evicted.append(self._ready.popitem(last=False)[1])
        return retired, nbytes, evicted

    def _do_work(self, retired: list[mmap.mmap], nbytes: int | None, evicted: list[Spare]) -> None:
        """Outside the lock: the slow part (unmapping, allocating, mapping)."""
        for mm in retired:
            release(mm)
        for old in evicted:
            _discard(old)
        if nbytes is None:
            return
        spare = None
        try:
            spare = self._prepare(nbytes)
        except (OSError, ValueError) as e:
            log.warning("cannot prepare shared-memory segments (%s); each large tensor gets a new one", e)
            with self._cv:
                self.failed = True
        with self._cv:
            if spare is not None and not self.failed:
                self._ready[nbytes] = spare
                spare = None
        if spare is not None:  # closed meanwhile
            _discard(spare)

    def _prepare(self, nbytes: int) -> Spare:
        name = self.stem + new_token()
        fd = create_segment(name, os.O_RDWR)
        try:
            # Pages exist from here on: a full /dev/shm is an error now, never a SIGBUS in a later store.
            os.posix_fallocate(fd, 0, nbytes)
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
        except BaseException:
            unlink_segment(name)
            raise
        finally:
            os.close(fd)
        return Spare(name, nbytes, mm)
