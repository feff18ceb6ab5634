"""The session's shared engines (tests/engine_pool.py): one start per key, at most ``capacity`` alive, the least
recently used stopped first, a dead one replaced; and the real pool hands every module the same running engine."""

from __future__ import annotations

import pytest

from engine_pool import EnginePool


class StandIn:
    """Records what the pool does to it, in place of a launched engine."""

    def __init__(self, key):
        self.key, self.stopped, self.dead = key, False, False

    def alive(self) -> bool:
        return not self.dead

    def stop(self) -> None:
        self.stopped = True


def _pool(capacity: int) -> tuple[EnginePool, list[StandIn]]:
    made: list[StandIn] = []

    def start(model, topology, extra, env, launched):
        made.append(StandIn((model, topology, tuple(extra), tuple(sorted(env.items())))))
        return made[-1]

    return EnginePool(start, capacity), made


def test_one_start_per_key_and_flags_environment_and_topology_tell_keys_apart():
    pool, made = _pool(capacity=8)
    tiny = pool.get("tiny")
    assert pool.get("tiny") is tiny and pool.get("tiny", extra=[]) is tiny and pool.starts == 1
    others = [pool.get("tiny", extra=["--max-n", "3"]), pool.get("tiny", "encoder=1,denoise=2,decode=1"),
              pool.get("tiny", env={"DISAGG_API_KEY": "k"}), pool.get("tiny-alt")]
    assert len({id(e) for e in [tiny, *others]}) == 5 and pool.starts == 5 == len(made)
    assert pool.get("tiny", env={"DISAGG_API_KEY": "k"}) is others[2] and pool.starts == 5
    assert len(pool.keys) == 5 and not any(e.stopped for e in made)


def test_the_least_recently_used_engine_is_stopped_for_a_new_key():
    pool, made = _pool(capacity=2)
    a, b = pool.get("a"), pool.get("b")
    assert pool.get("a") is a  # now b is the least recently used
    c = pool.get("c")
    assert b.stopped and not a.stopped and not c.stopped
    assert [k[0] for k in pool.alive_keys()] == ["a", "c"]
    again = pool.get("b")  # asked for again: a new start, and a goes
    assert again is not b and a.stopped and pool.starts == 4 and len(pool.keys) == 3
    pool.close()
    assert all(e.stopped for e in made) and pool.alive_keys() == []


def test_a_dead_engine_is_replaced_not_handed_out():
    pool, made = _pool(capacity=2)
    first = pool.get("tiny")
    first.dead = True
    second = pool.get("tiny")
    assert second is not first and first.stopped and second.alive() and pool.starts == 2


def test_a_pool_holds_at_least_one_engine():
    with pytest.raises(ValueError):
        EnginePool(lambda *a: None, capacity=0)


def test_the_sessions_pool_shares_one_running_engine(engine_pool, shared_engine):
    eng = shared_engine("tiny")
    starts = engine_pool.starts
    assert shared_engine("tiny") is eng and engine_pool.starts == starts
    assert eng.alive() and eng.http.get("/health").status_code == 200
    assert ("tiny", "encoder=1,denoise=1,decode=1", (), (), False) in engine_pool.alive_keys()
