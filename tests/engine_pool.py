"""Launched engines shared by every test of a session that only reads them (``shared_engine`` in conftest.py).

An engine is started once per key (model, topology, flags, environment) and handed to every module that asks
for the same key; at most ``capacity`` run at once (each is 4-5 processes of a few hundred MB), the least
recently used one stopped to make room. A shared engine must answer every module as a fresh one would: tests
that push or reload weights, load adapters under names others use, release memory, kill workers or change
limits start their own (``engine_factory``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, Protocol

DEFAULT_TOPOLOGY = "encoder=1,denoise=1,decode=1"


class Stoppable(Protocol):
    def stop(self) -> None: ...

    def alive(self) -> bool: ...


Key = tuple[str, str, tuple[str, ...], tuple[tuple[str, str], ...], bool]


class EnginePool:
    def __init__(self, start: Callable[[str, str, list[str], dict[str, str], bool], Stoppable], capacity: int = 3):
        """``start(model, topology, extra, env, launched)`` starts an engine; ``capacity``: most engines alive at
        once."""
        if capacity < 1:
            raise ValueError("an engine pool holds at least one engine")
        self._start = start
        self.capacity = capacity
        self._alive: OrderedDict[Key, Stoppable] = OrderedDict()  # least recently used first
        self.starts = 0  # engines this pool started (a key evicted and asked for again counts twice)
        self.keys: set[Key] = set()  # every key asked for

    def get(self, model: str = "tiny", topology: str = DEFAULT_TOPOLOGY, extra=(), env: dict | None = None,
            launched: bool = False):
        key: Key = (model, topology, tuple(extra), tuple(sorted((env or {}).items())), launched)
        self.keys.add(key)
        engine = self._alive.pop(key, None)
        if engine is not None and not engine.alive():  # its launcher is gone: a fresh one, not a dead one
            engine.stop()
            engine = None
        if engine is None:
            while len(self._alive) >= self.capacity:
                self._alive.popitem(last=False)[1].stop()
            engine = self._start(model, topology, list(extra), dict(env or {}), launched)
            self.starts += 1
        self._alive[key] = engine
        return engine

    def alive_keys(self) -> list[Key]:
        """The running engines' keys, least recently used first."""
        return list(self._alive)

    def close(self) -> None:
        while self._alive:
            self._alive.popitem(last=False)[1].stop()
