"""The engine ``disagg generate`` starts when it is given no ``--url``: one request's engine, nothing left behind.

It runs on a free loopback port in a temporary directory, and stopping it waits until every process it
started has exited (also after Ctrl-C), so the command never returns while a worker still holds memory.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from common.runtime.engine_process import EngineProcess

GROUP_EXIT_S = 10.0  # how long processes left in the engine's group (a worker's own children) get to exit


def group_members(pgid: int) -> list[int]:
    """The live processes of process group ``pgid`` (a zombie counts as exited: it holds nothing)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def wait_group_gone(pgid: int, timeout_s: float = GROUP_EXIT_S) -> None:
    """Wait for the group's processes to exit; kill those still there after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while group_members(pgid):
        if time.monotonic() > deadline:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                return
            deadline = float("inf")  # SIGKILL cannot be refused: they go
        time.sleep(0.05)


class EmbeddedEngine(EngineProcess):
    """An EngineProcess whose stop also outlasts every process in its group (it runs in its own session)."""

    def stop(self, timeout_s: float = 30) -> None:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the clean-up short
        try:
            super().stop(timeout_s)
            wait_group_gone(self.proc.pid)
        finally:
            signal.signal(signal.SIGINT, previous)


@contextmanager
def embedded_engine(model: str) -> Iterator[EmbeddedEngine]:
    """A ready engine serving ``model``; stopped, every process gone and its directory removed on exit."""
    with tempfile.TemporaryDirectory(prefix="disagg-generate-") as tmp:
        # The launcher's own --ready-timeout ends a start that hangs: this one only waits for it.
        engine = EmbeddedEngine(model, workdir=tmp, ready_timeout_s=float("inf"))
        try:
            yield engine
        finally:
            engine.stop()
