"""Step caching end to end: launched engines (real processes, ZeroMQ, HTTP on loopback) on the built-in
``-smooth`` models, each started with an engine default ``--cache first_block:0.1``.

Per family (Wan text to video in the default suite; SD3, FLUX, Qwen-Image and Wan image to video heavy): a
request with ``cache`` answers ``transformer_passes`` and ``cached_steps`` per sample (adding up to steps x
CFG branches, some steps cached), equals the workers' path in process (tests/family_harness.py: latents within
1e-5, the same counts) and itself run concurrently with three other requests; ``/metrics``' row-step counters
move by the answers' counts. On Wan: bad ``cache`` values are 400s naming ``cache``, ``cache.method``,
``cache.threshold`` (or the extra key); a request without ``cache`` takes the engine default and ``null`` turns
it off; rollouts take ``cache`` too. ``--cache first_block`` with a Ulysses denoise worker is refused at launch;
heavy: on such an engine a request's ``first_block`` is a 400 naming ``cache.method`` (teacache serves), and a
CFG-parallel engine answers caching requests as one device does (within 1e-5, the same counts).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from common.builtin import ensure_builtin
from common.protocol.messages import CacheParams
from conftest import ROOT, Engine, solo_then_concurrent
from family_harness import InProcess, max_diff
from router.client import EngineClient, image_field
from test_wan_i2v import picture

TOL = 1e-5
STEPS = 12
DEFAULT = ["--cache", "first_block:0.1"]
# Thresholds that skip steps of these requests on every family (tests/test_step_cache.py measures them).
CACHES = {"teacache": 0.3, "first_block": 0.3}
FAMILIES = [pytest.param(m, marks=[] if m == "tiny-smooth" else [pytest.mark.heavy])
            for m in ("tiny-smooth", "tiny-sd3-smooth", "tiny-flux-smooth", "tiny-qwen-image-smooth",
                      "tiny-wan-i2v-smooth")]
IMAGE, OTHER = picture(40, 24, 1), picture(70, 50, 2)


def _start(tmp_path_factory, model: str, topology: str = "encoder=1,denoise=1,decode=1") -> Engine:
    return Engine(tmp_path_factory.mktemp(model), model, topology, ["--max-batch-size", "8", *DEFAULT])


@pytest.fixture(scope="module")
def wan(tmp_path_factory):
    e = _start(tmp_path_factory, "tiny-smooth")
    yield e
    e.stop()


@pytest.fixture(scope="module")
def harnesses():
    made: dict[str, InProcess] = {}

    def get(model: str) -> InProcess:
        if model not in made:
            made[model] = InProcess(ensure_builtin(model))
        return made[model]

    threads = torch.get_num_threads()
    yield get
    torch.set_num_threads(threads)


def _scrape(engine: Engine) -> dict[tuple[str, tuple], float]:
    r = engine.http.get("/metrics")
    assert r.status_code == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def _row_steps(m: dict, kind: str) -> float:
    return m.get(("disagg_denoise_row_steps_total", (("kind", kind),)), 0.0)


def _body(eng: InProcess, **over) -> dict:
    """A request at ``STEPS`` steps with classifier-free guidance on (FLUX's true CFG too); image-to-video
    models get the test picture."""
    body = dict(prompt="a red fox in the snow", negative_prompt="blurry", seed=3, num_inference_steps=STEPS,
                output_type="latent")
    if eng.family.cfg_field == "true_cfg_scale":
        body["true_cfg_scale"] = 2.5
    if eng.family.condition.image_input(eng.info) == "required":
        body["image"] = IMAGE
    body.update(over)
    return {k: image_field(v) if k == "image" else v for k, v in body.items()}


def _in_process(eng: InProcess, body: dict, image):
    """The same request through the workers' path in one process (the router's defaults filled)."""
    fields = {k: v for k, v in body.items() if k not in ("output_type", "image", "cache")}
    cache = body.get("cache")
    p = eng.params(**fields, num_frames=eng.info.defaults.get("num_frames", 1),
                   cache=None if cache is None else CacheParams(**cache))
    return eng.run(p, image=image)


def _branches(eng: InProcess, body: dict) -> int:
    return 2 if body.get(eng.family.cfg_field, eng.info.defaults.get(eng.family.cfg_field, 1.0)) > 1.0 else 1


def _post(engine: Engine, body: dict, path: str = "/generate") -> list[dict]:
    with EngineClient(engine.url) as c:
        return c._post(path, body)["samples"]


@pytest.mark.parametrize("model", FAMILIES)
def test_a_caching_request_answers_its_counts_and_equals_the_workers_path(model, wan, harnesses,
                                                                          tmp_path_factory, record_property):
    engine = wan if model == "tiny-smooth" else _start(tmp_path_factory, model)
    try:
        eng = harnesses(model)
        image = IMAGE if eng.family.condition.image_input(eng.info) == "required" else None
        no_cfg = {eng.family.cfg_field: 1.0}
        main = _body(eng, n=2, cache={"method": "first_block", "threshold": CACHES["first_block"]})
        reqs = [main,
                _body(eng, prompt="a kite over the sea", seed=5, cache={"method": "teacache",
                                                                       "threshold": CACHES["teacache"]}),
                _body(eng, prompt="a quiet harbour", seed=6, num_inference_steps=STEPS - 2, cache=None, **no_cfg),
                _body(eng, prompt="snow on a pine", seed=7, **no_cfg,
                      **({"image": OTHER} if image is not None else {}))]  # the engine's default cache
        before = _scrape(engine)
        with EngineClient(engine.url) as c:
            solo, mixed = solo_then_concurrent(c, [("/generate", r) for r in reqs])
            group = c._post("/generate", main)["samples"]
        after = _scrape(engine)
        answers = [*solo, *mixed, *group]
        for kind, key in (("computed", "transformer_passes"), ("cached", "cached_steps")):
            # every sample: ``solo`` and ``mixed`` hold the first of each request's; the group ran three times
            counted = sum(s[key] for s in answers) + 2 * group[1][key]
            assert _row_steps(after, kind) - _row_steps(before, kind) == counted, kind
        for r, s in zip(reqs, solo):
            assert s["transformer_passes"] + s["cached_steps"] == r["num_inference_steps"] * _branches(eng, r)
        assert solo[0]["cached_steps"] > 0 and solo[1]["cached_steps"] > 0  # (the default's 0.1 may skip none)
        assert solo[2]["cached_steps"] == 0  # cache: null, the engine default off
        diffs = {"concurrent": max(max_diff(a["output"], b["output"]) for a, b in zip(solo, mixed))}
        for a, b in zip(solo, mixed):
            assert (a["transformer_passes"], a["cached_steps"]) == (b["transformer_passes"], b["cached_steps"])
        assert max(s["batch"] for s in mixed) > 1  # some of them shared forwards
        task = _in_process(eng, main, image)
        counts = task.pass_counts()
        for i, s in enumerate(group):
            assert [s["transformer_passes"], s["cached_steps"]] == [counts["transformer_passes"][i],
                                                                   counts["cached_steps"][i]]
        diffs["in-process"] = max(max_diff(s["output"], task.latents[i]) for i, s in enumerate(group))
        other = _in_process(eng, reqs[1], image)
        diffs["in-process teacache"] = max_diff(solo[1]["output"], other.latents[0])
        assert [solo[1]["transformer_passes"], solo[1]["cached_steps"]] == [
            other.pass_counts()["transformer_passes"][0], other.pass_counts()["cached_steps"][0]]
        record_property("max_diff", diffs)
        print(f"\n[{model}] {diffs} counts {[(s['transformer_passes'], s['cached_steps']) for s in solo]}")
        assert max(diffs.values()) <= TOL
    finally:
        if engine is not wan:
            engine.stop()


BAD = [({"method": "nope"}, "cache.method"), ({"method": 3}, "cache.method"), ({"method": None}, "cache.method"),
       ({}, "cache.method"), ({"threshold": 0.1}, "cache.method"),
       ({"method": "teacache", "threshold": 0}, "cache.threshold"),
       ({"method": "teacache", "threshold": -1}, "cache.threshold"),
       ({"method": "teacache", "threshold": 5}, "cache.threshold"),
       ({"method": "first_block", "threshold": 1.5}, "cache.threshold"),
       ({"method": "teacache", "threshold": "0.1"}, "cache.threshold"),
       ({"method": "teacache", "threshold": True}, "cache.threshold"),
       ({"method": "teacache", "extra": 1}, "cache.extra"),
       ("teacache", "cache"), (["teacache", 0.1], "cache"), (1, "cache")]


def test_bad_cache_values_are_400s_naming_the_field(wan):
    for path in ("/generate", "/rollout/generate"):
        for value, field in BAD:
            r = wan.http.post(path, json={"prompt": "a fox", "num_inference_steps": 2, "cache": value})
            assert r.status_code == 400, (path, value, r.text)
            assert r.json()["error"]["field"] == field, (path, value, r.json())
    r = wan.http.post("/generate", content=b'{"prompt": "a", "cache": {"method": "teacache", "threshold": NaN}}',
                      headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["field"] == "cache.threshold"


def test_the_engine_default_applies_unless_the_request_says_otherwise(wan, harnesses):
    eng = harnesses("tiny-smooth")
    base = _body(eng, num_inference_steps=16)
    absent = _post(wan, base)[0]
    explicit = _post(wan, {**base, "cache": {"method": "first_block", "threshold": 0.1}})[0]
    default_threshold = _post(wan, {**base, "cache": {"method": "first_block"}})[0]  # the method's default, 0.08
    off = _post(wan, {**base, "cache": None})[0]
    assert absent["cached_steps"] > 0 and torch.equal(absent["output"], explicit["output"])
    assert (absent["transformer_passes"], absent["cached_steps"]) == (explicit["transformer_passes"],
                                                                      explicit["cached_steps"])
    assert default_threshold["cached_steps"] <= absent["cached_steps"]
    assert off["cached_steps"] == 0 and off["transformer_passes"] == 16 * 2
    assert max_diff(off["output"], _in_process(eng, {**base, "cache": None}, None).latents[0]) <= TOL
    assert max_diff(off["output"], absent["output"]) > 1e-3
    # A rollout: its SDE window computed, ODE steps outside it cached; a window of every step caches nothing.
    rollout = {**base, "cache": {"method": "teacache", "threshold": 0.3}}
    windowed = _post(wan, {**rollout, "sde_step_indices": [0, 1, 2, 3]}, "/rollout/generate")[0]
    everywhere = _post(wan, rollout, "/rollout/generate")[0]
    assert windowed["cached_steps"] > 0 and windowed["log_probs"].shape == (4,)
    assert everywhere["cached_steps"] == 0 and everywhere["transformer_passes"] == 16 * 2


def test_first_block_as_the_default_is_refused_at_launch_with_ulysses(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--model", "tiny-smooth", "--topology",
                        "encoder=1,denoise=1:ulysses=2,decode=1", "--cache", "first_block:0.1", "--runtime-dir",
                        str(tmp_path / "rt")], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "--cache: first_block probes the first block on one device" in r.stdout + r.stderr


@pytest.mark.heavy
def test_first_block_is_a_400_on_a_ulysses_denoise_worker(tmp_path_factory):
    engine = Engine(tmp_path_factory.mktemp("ulysses"), "tiny-smooth", "encoder=1,denoise=1:ulysses=2,decode=1",
                    ["--max-batch-size", "8"])
    try:
        body = dict(prompt="a fox", negative_prompt="blurry", seed=3, num_inference_steps=STEPS, output_type="latent")
        for path in ("/generate", "/rollout/generate"):
            r = engine.http.post(path, json={**body, "cache": {"method": "first_block", "threshold": 0.1}})
            assert r.status_code == 400 and r.json()["error"]["field"] == "cache.method", r.text
            assert "ulysses" in r.json()["error"]["message"]
        s = _post(engine, {**body, "cache": {"method": "teacache", "threshold": CACHES["teacache"]}})[0]
        assert s["cached_steps"] > 0 and s["transformer_passes"] + s["cached_steps"] == STEPS * 2
    finally:
        engine.stop()


@pytest.mark.heavy
def test_cfg_parallel_answers_caching_requests_as_one_device(wan, tmp_path_factory, harnesses):
    """The branches of a caching request are pieces of their own: a step where only one computes puts rows on
    one CFG rank only."""
    eng = harnesses("tiny-smooth")
    engine = _start(tmp_path_factory, "tiny-smooth", "encoder=1,denoise=1:cfg,decode=1")
    try:
        reqs = [("/generate", _body(eng, n=2, cache={"method": "first_block", "threshold": CACHES["first_block"]})),
                ("/generate", _body(eng, seed=4, cache={"method": "teacache", "threshold": CACHES["teacache"]})),
                ("/generate", _body(eng, seed=5)),  # the engines' default
                ("/rollout/generate", _body(eng, seed=6, sde_step_indices=[0, 1, 2, 3], return_trajectory=True,
                                            cache={"method": "first_block", "threshold": CACHES["first_block"]}))]
        diffs = []
        for path, body in reqs:
            with EngineClient(engine.url) as c, EngineClient(wan.url) as one:
                got, want = c._post(path, body)["samples"], one._post(path, body)["samples"]
            assert sum(s["cached_steps"] for s in want) > 0
            for a, b in zip(got, want):
                assert (a["transformer_passes"], a["cached_steps"]) == (b["transformer_passes"], b["cached_steps"])
                diffs.append(max_diff(a["output"], b["output"]))
                if "log_probs" in b:
                    diffs.append(max_diff(a["log_probs"], b["log_probs"]))
                    diffs.append(max_diff(a["trajectory"]["latents"], b["trajectory"]["latents"]))
        print(f"\n[cfg parallel] {diffs}")
        assert max(diffs) <= TOL
    finally:
        engine.stop()
