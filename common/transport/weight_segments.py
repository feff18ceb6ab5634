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
from common.protocol.messages import WeightBucket
from common.transport.shm_segments import (
    create_segment, is_token, new_token, open_segment, own_regular_file, release, unlink_segment,
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


def open_buckets(prefix: str, buckets: list[WeightBucket]) -> tuple[list[torch.Tensor], list[mmap.mmap]]:
    """A worker's side: each announced segment as a uint8 tensor over its mapping, checked first.
    Release the mappings (:func:`close_maps`) once the tensors are no longer used."""
    maps: list[mmap.mmap] = []
    views: list[torch.Tensor] = []
    try:
        for i, b in enumerate(buckets):
            name = b.segment
            if name is None or not name.startswith(prefix) or not is_token(name[len(prefix):]):
                raise WireError(f"weight bucket {i}: {name!r} is not a weight segment of this engine")
            fd = open_segment(name)
            try:
                st = os.fstat(fd)
                if not own_regular_file(st):
                    raise WireError(f"weight bucket {i}: {name} is not a regular file of this user")
                if st.st_size != b.nbytes:
                    raise WireError(f"weight bucket {i}: {name} holds {st.st_size} bytes, announced {b.nbytes}")
                # Populated at once: one pass in the kernel instead of a fault per page on the copy.
                mm = mmap.mmap(fd, b.nbytes, flags=mmap.MAP_SHARED | POPULATE, prot=mmap.PROT_READ) \
                    if b.nbytes else None
            finally:
                os.close(fd)
            if mm is not None:
                maps.append(mm)
            views.append(_view(mm))
    except FileNotFoundError as e:
        close_maps(maps)
        raise WireError(f"weight bucket missing: {e.filename}") from None
    except BaseException:
        close_maps(maps)
        raise
    return views, maps


def close_maps(maps: list[mmap.mmap]) -> None:
    for mm in maps:
        release(mm)
