"""The supervisor's judgement of a worker's exit, with stand-in processes (no worker starts): a crash is an
error and restarted; an exit once the engine's stop began is no crash, never restarted; a clean exit alone
(code 0 while the engine runs) is restarted after the settle time, without an error."""

from __future__ import annotations

import itertools
import logging
import time

import pytest

from common.config.engine import EngineConfig
from common.config.topology import parse_topology
from common.runtime import supervisor as supervision
from common.runtime.supervisor import Supervisor

PIDS = itertools.count(1000)


class StandIn:
    """The part of Popen the supervisor uses; ``exit(code)`` ends it."""

    def __init__(self):
        self.pid, self.returncode = next(PIDS), None

    def poll(self):
        return self.returncode

    def exit(self, code: int) -> None:
        self.returncode = code

    def send_signal(self, sig) -> None:
        self.returncode = -sig

    def wait(self, timeout=None):
        return self.returncode

    def kill(self) -> None:
        self.returncode = -9


@pytest.fixture
def supervised(tmp_path, monkeypatch, caplog):
    """A started supervisor over stand-ins for one encoder, denoise and decode worker; and the exits it told."""
    monkeypatch.setattr(supervision, "CLEAN_EXIT_SETTLE_S", 0.3)
    caplog.set_level(logging.INFO, logger="disagg.supervisor")
    config = EngineConfig(model="unused", workers=parse_topology("encoder=1,denoise=1,decode=1", tmp_path),
                          router_endpoint=f"ipc://{tmp_path}/router.sock", runtime_dir=str(tmp_path))
    exits = []
    sup = Supervisor(config, tmp_path / "engine.json", on_exit=lambda *exit: exits.append(exit),
                     spawn=lambda w: StandIn())
    sup.start()
    yield sup, exits
    sup.stop()


def _until(check, timeout_s: float = 5.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "not reached"
        time.sleep(0.02)


def _lines(caplog) -> list[str]:
    return [f"{r.levelname} {r.getMessage()}" for r in caplog.records]


def test_a_crash_is_an_error_and_restarted(supervised, caplog):
    sup, exits = supervised
    first = sup.procs[("denoise", 0)]
    first.exit(-9)  # SIGKILL
    _until(lambda: sup.restarts.get(("denoise", 0)) == 1)
    assert exits == [("denoise", 0, -9)] and sup.procs[("denoise", 0)] is not first
    assert f"ERROR denoise worker 0 (pid {first.pid}) exited with code -9" in _lines(caplog)


def test_workers_that_exit_once_the_stop_began_are_no_crash(supervised, caplog):
    sup, exits = supervised
    sup.begin_stop()
    procs = dict(sup.procs)
    for code, proc in zip((0, 0, -15), procs.values()):  # a worker still loading dies of the signal itself
        proc.exit(code)
    _until(lambda: len(exits) == 3)
    time.sleep(supervision.CLEAN_EXIT_SETTLE_S + 3 * supervision.POLL_S)  # time a restart would have had
    assert sup.procs == procs and not sup.restarts
    assert not [line for line in _lines(caplog) if not line.startswith("INFO")]
    assert f"INFO encoder worker 0 (pid {procs['encoder', 0].pid}) stopped with the engine (code 0)" in _lines(caplog)


def test_a_clean_exit_alone_is_restarted_after_the_settle_time(supervised, caplog):
    sup, exits = supervised
    first = sup.procs[("decode", 0)]
    t0 = time.monotonic()
    first.exit(0)  # told to stop (SIGTERM to this worker alone) while the engine runs
    _until(lambda: exits)  # told at once: the router fails what it held
    assert sup.procs[("decode", 0)] is first
    _until(lambda: sup.restarts.get(("decode", 0)) == 1)
    assert time.monotonic() - t0 >= supervision.CLEAN_EXIT_SETTLE_S
    assert [line.split(" ")[0] for line in _lines(caplog)] == ["WARNING", "WARNING"]  # stopped; restarted
    assert f"WARNING decode worker 0 (pid {first.pid}) stopped (code 0) while the engine runs" in _lines(caplog)
