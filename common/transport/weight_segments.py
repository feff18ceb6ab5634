"""Weight-update buckets in ``/dev/shm``: written once by a trainer, read by every denoise worker.

A trainer on the engine's host writes each bucket of an update into its own
segment, named ``<engine prefix>weights-<token>`` (the prefix comes from the
router's ``GET /weight_sync``), and posts only their names and sizes. Each
denoise worker maps the segments and copies from them into its parameters;
nobody but the trainer writes them. The trainer rewrites them for its next
update of the same layout and removes them when it is done (the launcher
sweeps leftovers of its engine).

A worker opens only names of that form with its own engine's prefix, never
through a symlink, only regular files of its own user, and only when the
size matches the announced one: the same rules as the data plane
(:mod:`common.transport.shm`), except that a bucket is read by several
workers, so the reader does not unlink it.
"""

from __future__ import annotations

import mmap
import os
import warnings

import torch

from common.protocol.codec import WireError
from common.protocol.control import WeightBucket
from common.transport.shm_segments import (
    create_segment, is_token, new_token, open_segment, own_regular_file, release, segment_path, unlink_segment,
)

STEM = "weights-"
POPULATE = getattr(mmap, "MAP_POPULATE", 0)


def weight_prefix(engine_prefix: str) -> str:
    return engine_prefix + STEM


def _view(mm: mmap.mmap | None) -> torch.Tensor:
    if mm is None:
        return torch.empty(0, dtype=torch.uint8)
    with warnings.catch_warnings():  # a read-only mapping is fine: nothing writes through the view
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mm, dtype=torch.uint8)


class WrittenBuckets:
    """The trainer's side: fresh segments of the given sizes, as writable uint8 tensors. Keep them for the
    next update of the same layout (:attr:`sizes`): rewriting mapped pages costs a copy, fresh ones a page
    fault each as well."""

    def __init__(self, prefix: str, sizes: list[int]):
        self.sizes = list(sizes)
        self.names: list[str] = []
        self._maps: list[mmap.mmap | None] = []
        try:
            for size in sizes:
                name = prefix + new_token()
                fd = create_segment(name, os.O_RDWR)
                self.names.append(name)
                try:
                    if size:
                        os.posix_fallocate(fd, 0, size)  # ENOSPC now, rather than SIGBUS on a store
                    self._maps.append(mmap.mmap(fd, size) if size else None)
                finally:
                    os.close(fd)
        except BaseException:
            self.close()
            raise
        self.buffers = [_view(mm) for mm in self._maps]

    def buckets(self) -> list[WeightBucket]:
        return [WeightBucket(nbytes=b.numel(), segment=n) for b, n in zip(self.buffers, self.names)]

    def close(self) -> None:
        """Unmap and remove every segment (after the update was answered, or on failure)."""
        self.buffers = []
        for mm in self._maps:
            if mm is not None:
                release(mm)
        for name in self.names:
            unlink_segment(name)
        self._maps, self.names = [], []


def _identity(st: os.stat_result) -> tuple[int, int, int]:
    """Which file a name leads to, for telling a rewritten segment from a replaced one."""
    return st.st_dev, st.st_ino, st.st_size


class MappedBuckets:
    """A worker's side: the announced segments as read-only uint8 tensors, checked first.

    The mappings are kept after an update: a trainer rewrites the same segments for its next update of
    the same layout, and mapping 2.8 GB anew costs almost as much as copying it. A kept mapping is
    reused only while its name still leads to the same file (device, inode, size); one whose file was
    removed or replaced is unmapped by the next :meth:`open` or :meth:`prune` (the worker prunes when
    idle), so a trainer that went away does not leave its pages alive in here for long.
    """

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._maps: dict[str, tuple[tuple[int, int, int], mmap.mmap | None]] = {}

    def open(self, buckets: list[WeightBucket]) -> list[torch.Tensor]:
        kept: dict[str, tuple[tuple[int, int, int], mmap.mmap | None]] = {}
        try:
            for i, b in enumerate(buckets):
                name = b.segment
                if name is None or not name.startswith(self.prefix) or not is_token(name[len(self.prefix):]):
                    raise WireError(f"weight bucket {i}: {name!r} is not a weight segment of this engine")
                if name in kept:
                    raise WireError(f"weight bucket {i}: {name} is named twice")
                kept[name] = self._mapping(i, name, b.nbytes)
        except FileNotFoundError as e:
            self._release_unless(kept, self._maps)
            raise WireError(f"weight bucket missing: {e.filename}") from None
        except BaseException:
            self._release_unless(kept, self._maps)
            raise
        self._release_unless(self._maps, kept)
        self._maps = kept
        return [_view(kept[b.segment][1]) for b in buckets]

    def _mapping(self, i: int, name: str, nbytes: int) -> tuple[tuple[int, int, int], mmap.mmap | None]:
        fd = open_segment(name)
        try:
            st = os.fstat(fd)
            if not own_regular_file(st):
                raise WireError(f"weight bucket {i}: {name} is not a regular file of this user")
            if st.st_size != nbytes:
                raise WireError(f"weight bucket {i}: {name} holds {st.st_size} bytes, announced {nbytes}")
            identity = _identity(st)
            old = self._maps.get(name)
            if old is not None and old[0] == identity:
                return old
            # Populated at once: one pass in the kernel instead of a fault per page on the copy.
            mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | POPULATE, prot=mmap.PROT_READ) if nbytes else None
            return identity, mm
        finally:
            os.close(fd)

    @staticmethod
    def _release_unless(entries: dict, keep: dict) -> None:
        """Unmap each mapping of ``entries`` that ``keep`` does not hold."""
        held = {id(mm) for _, mm in keep.values()}
        for _, mm in entries.values():
            if mm is not None and id(mm) not in held:
                release(mm)

    def prune(self) -> int:
        """Unmap every kept segment whose name no longer leads to the file it mapped; how many went."""
        gone = {}
        for name, (identity, mm) in self._maps.items():
            try:
                st = os.stat(segment_path(name), follow_symlinks=False)
                same = _identity(st) == identity
            except OSError:
                same = False
            if not same:
                gone[name] = (identity, mm)
        for name, (_, mm) in gone.items():
            del self._maps[name]
            if mm is not None:
                release(mm)
        return len(gone)

    def close(self) -> None:
        for _, mm in self._maps.values():
            if mm is not None:
                release(mm)
        self._maps = {}
