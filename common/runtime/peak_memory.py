"""A worker's peak memory over a window of its work, for the answers' ``peak_memory``.

- On a CUDA device: the most bytes torch's allocator held in tensors there at once
  (``torch.cuda.max_memory_allocated``; the caching allocator's reserve and the CUDA context are not in it),
  its peak statistics reset when a window starts.
- On the CPU: the process's peak resident set size (``VmHWM`` in ``/proc/self/status``, weights, libraries and
  the interpreter included), which a window's start resets to the current resident size by writing 5 to
  ``/proc/self/clear_refs`` (Linux). Where that file cannot be written, the peak since the process started.
"""

from __future__ import annotations

import logging
import re

import torch

log = logging.getLogger("disagg.memory")

_HWM = re.compile(rb"^VmHWM:\s+(\d+) kB$", re.MULTILINE)


def _rss_high_water_mark() -> int:
    with open("/proc/self/status", "rb") as f:
        return int(_HWM.search(f.read()).group(1)) * 1024


class PeakMemory:
    """Peak memory on one device between :meth:`reset` and :meth:`read` (bytes)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.resettable = True  # False: a CPU peak is the process's since it started

    def reset(self) -> None:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self.resettable:
            try:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")  # the kernel's "reset the peak resident set size" command
            except OSError as e:
                self.resettable = False
                log.warning("cannot reset the peak resident set size (%s): peaks are since the process started", e)

    def read(self) -> int:
        if self.cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        return _rss_high_water_mark()
