"""A denoise worker over several ranks (gloo on this CPU) answers what a one-device worker answers.

Layouts: diffusers' Ulysses over 2 ranks, CFG parallel over 2 ranks, and both (4 ranks). Each engine is
compared with a one-device engine on the same model, request by request: latents and frames (UniPC serving),
rollout log-probs and trajectories (SDE), a GRPO group (shared text), no CFG, requests batched at different
steps, LoRA adapters (also mixed with the base model in one forward), and a weight update (the followers'
copies follow the leader's, or the outputs would part). Then two experts (tiny-moe), two configurations
other than tiny's (tiny-alt: 3 heads, CFG parallel; small: 6 heads, Ulysses 2 with CFG), and a follower
that dies: its requests get an answer, the worker comes back whole, no process is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

import lora_fixtures as lf
from conftest import Engine, pid_alive
from local_engine import LocalEngine
from common.diffusion.weights import save_weights
from router.client import EngineClient, EngineHTTPError

TOL = 1e-5  # float32, relative to the tensor's scale: max |a - b| <= TOL * max(1, max |b|)
BASE = dict(prompt="a heron in the reeds", negative_prompt="blurry", seed=40, num_inference_steps=4,
            guidance_scale=4.0, output_type="latent")
LAYOUTS = {"ulysses2": "denoise=1:ulysses=2", "cfg2": "denoise=1:cfg", "cfg2-ulysses2": "denoise=1:ulysses=2:cfg"}
CASES = {
    "serving-latent": ("/generate", {}),
    "serving-frames": ("/generate", {"output_type": "frames"}),
    "rollout-sde": ("/rollout/generate", {"return_trajectory": True, "noise_level": 0.7}),
    "rollout-group": ("/rollout/generate", {"n": 3, "return_trajectory": True}),
    "no-cfg": ("/rollout/generate", {"guidance_scale": 1.0}),
}


def _topology(layout: str) -> str:
    return f"encoder=1,{LAYOUTS[layout]},decode=1"


def _start(tmp_path_factory, model: str, topology: str, lora_root: Path, extra: tuple = ()) -> Engine:
    return Engine(tmp_path_factory.mktemp("engine"), model, topology,
                  ["--max-batch-size", "8", "--weight-root", str(lora_root), "--weight-sync-from-memory", *extra])


@pytest.fixture(scope="module")
def refs(tmp_path_factory, lora_root):
    """One-device references by model, started when first asked for: local engines (local_engine/, the launched
    engine's answers bit for bit, tests/test_local_engine.py), since the boundary tested here is the ranks'.
    Besides ``tiny`` (every layout's reference) one at a time: each other model is one test's."""
    started: dict[str, LocalEngine] = {}

    def get(model: str) -> LocalEngine:
        if model not in started:
            for other in [m for m in started if m != "tiny"]:
                started.pop(other).close()
            flags = ["--max-batch-size", "8", "--weight-root", str(lora_root), "--weight-sync-from-memory"]
            if model == "small":
                # Its forwards are big enough for all of a worker's threads (denoise_worker/threads.py): one
                # thread, as each rank of a 4-rank worker on 2 cores has, so that the sums round alike.
                topology = tmp_path_factory.mktemp("topology") / "one-thread.json"
                topology.write_text(json.dumps([{"role": "encoder"}, {"role": "denoise", "threads": 1},
                                                {"role": "decode"}]))
                flags += ["--topology", str(topology)]
            started[model] = LocalEngine(model, *flags)
        return started[model]

    yield get
    for e in started.values():
        e.close()


# One layout in the default suite (both mechanisms at once); the two single ones are heavy.
@pytest.fixture(scope="module", params=[pytest.param(k, marks=[pytest.mark.heavy] if k != "cfg2-ulysses2" else [])
                                        for k in LAYOUTS])
def multi(request, tmp_path_factory, lora_root):
    engine = _start(tmp_path_factory, "tiny", _topology(request.param), lora_root)
    with EngineClient(engine.url) as c:
        yield c
    engine.stop()


def _samples(client: EngineClient, path: str, body: dict) -> list[dict]:
    return client._post(path, body)["samples"]


def _scaled(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference in units of ``b``'s scale (its largest magnitude, at least 1)."""
    return (a - b).abs().max().item() / max(1.0, b.abs().max().item())


def _diff(a: dict, b: dict) -> float:
    diffs = [_scaled(a["output"], b["output"])]
    if "log_probs" in a:
        assert a["log_prob_steps"].tolist() == b["log_prob_steps"].tolist()
        diffs.append(_scaled(a["log_probs"], b["log_probs"]))
    if "trajectory" in a:
        diffs.append(_scaled(a["trajectory"]["latents"], b["trajectory"]["latents"]))
    return max(diffs)


def _assert_same(got: list[dict], want: list[dict], tol: float = TOL) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g["seed"] == w["seed"] and g["scheduler"] == w["scheduler"]
        assert _diff(g, w) <= tol


@pytest.mark.parametrize("case", list(CASES))
def test_outputs_equal_one_device(multi, refs, case):
    path, over = CASES[case]
    body = {**BASE, **over}
    _assert_same(_samples(multi, path, body), _samples(refs("tiny"), path, body))


def test_requests_batched_at_different_steps_equal_one_device(multi, refs):
    """Four requests at once (different step counts, one a group): they share forwards at different steps."""
    bodies = [("/generate", {**BASE, "seed": 1, "num_inference_steps": 6}),
              ("/rollout/generate", {**BASE, "seed": 2, "num_inference_steps": 4, "n": 2}),
              ("/rollout/generate", {**BASE, "seed": 3, "num_inference_steps": 5, "prompt": "a red kite"}),
              ("/generate", {**BASE, "seed": 4, "num_inference_steps": 3, "guidance_scale": 1.0})]
    with ThreadPoolExecutor(len(bodies)) as pool:
        got = list(pool.map(lambda pb: _samples(multi, *pb), bodies))
    assert max(s["batch"] for samples in got for s in samples) > 2  # they did share forwards
    for (path, body), samples in zip(bodies, got):
        _assert_same(samples, _samples(refs("tiny"), path, body))


@pytest.fixture(scope="module")
def adapter(tiny_dir, lora_root):
    return lf.make_diffusers_lora(tiny_dir, lora_root / "multi-device-lora", rank=4, alpha=8,
                                  target_modules=lf.ATTN, seed=3)


def test_lora_adapters_equal_one_device(multi, refs, adapter):
    """The followers get the adapter from the leader; a forward mixes rows with and without it."""
    for c in (multi, refs("tiny")):
        c.load_lora_adapter("md", str(adapter.path))
    with_lora = ("/rollout/generate", {**BASE, "lora_name": "md", "lora_scale": 0.8, "n": 2})
    base = ("/rollout/generate", {**BASE, "seed": 9})
    with ThreadPoolExecutor(2) as pool:
        got = list(pool.map(lambda pb: _samples(multi, *pb), [with_lora, base]))
    assert got[0][0]["lora_name"] == "md" and got[1][0].get("lora_name") is None
    _assert_same(got[0], _samples(refs("tiny"), *with_lora))
    _assert_same(got[1], _samples(refs("tiny"), *base))
    lora_only = _samples(refs("tiny"), *with_lora)[0]["output"]
    assert (lora_only - _samples(refs("tiny"), "/rollout/generate", {**BASE, "n": 2})[0]["output"]).abs().max() > 1e-3
    for c in (multi, refs("tiny")):
        c.unload_lora_adapter("md")


def test_a_weight_update_reaches_every_rank(multi, refs, tiny_dir, lora_root):
    """Both engines take the same perturbed weights and still agree; then both go back to the originals."""
    original, perturbed = lora_root / "original.safetensors", lora_root / "perturbed.safetensors"
    if not perturbed.exists():
        model = lf._load_transformer(tiny_dir, "transformer")
        save_weights(model, original)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * 0.05)
        save_weights(model, perturbed)
    before = _samples(refs("tiny"), "/generate", BASE)
    try:
        sums = [c.update_weights_from_disk(str(perturbed))["sha256"] for c in (multi, refs("tiny"))]
        assert sums[0] == sums[1]
        assert (_samples(refs("tiny"), "/generate", BASE)[0]["output"] - before[0]["output"]).abs().max() > 1e-3
        for path, over in CASES.values():
            _assert_same(_samples(multi, path, {**BASE, **over}), _samples(refs("tiny"), path, {**BASE, **over}))
    finally:
        for c in (multi, refs("tiny")):
            c.update_weights_from_disk(str(original))
    _assert_same(_samples(multi, "/generate", BASE), before)


OTHER_MODELS = {  # model: (layout, request overrides)
    "tiny-moe": ("cfg2-ulysses2", {"guidance_scale_2": 2.5}),  # two experts, each with its own guidance
    "tiny-alt": ("cfg2", {}),  # 3 heads: CFG parallel only (Ulysses 2 is refused, see test_context_parallel)
    "small": ("cfg2-ulysses2", {"height": 64, "width": 64, "num_frames": 5, "num_inference_steps": 3}),
    "tiny-sana": ("cfg2", {"height": 96, "width": 160}),  # no context-parallel plan in diffusers: CFG parallel
    # LTX-2: every guidance pass (uncond, STG-perturbed, modality-isolated) on the unconditional ranks; Ulysses is
    # refused for it (tests/test_ltx2_parallel.py)
    "tiny-ltx2": ("cfg2", {"stg_scale": 1.0, "modality_scale": 3.0, "num_frames": 9}),
}


def _edit_image() -> str:
    """An edit request's image as a data: URL (its reference tokens follow the noise tokens: Ulysses splits both)."""
    import base64
    import io

    from edit_models import picture

    buf = io.BytesIO()
    picture(40, 56, 0).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# The edit models: diffusers has a context-parallel plan for both transformers; true CFG with a negative prompt.
OTHER_MODELS.update({m: ("cfg2-ulysses2", {"image": _edit_image(), "true_cfg_scale": 2.0, "height": 32, "width": 32,
                                            "num_inference_steps": 3, **over})
                     for m, over in (("tiny-qwen-image-edit", {"guidance_scale": None}), ("tiny-flux-kontext", {}))})
# Z-Image and HunyuanVideo 1.5: no context-parallel plan in diffusers (tests/test_families_parallel.py), CFG
# parallel; FLUX.2 [klein]: diffusers' plan splits its image and text tokens (its negative is the empty prompt).
OTHER_MODELS.update({
    "tiny-z-image": ("cfg2", {"cfg_normalization": 1.0, "height": 48, "width": 80}),
    "tiny-flux2-klein": ("cfg2-ulysses2", {"negative_prompt": None, "height": 48, "width": 64}),
    "tiny-hunyuan-video15": ("cfg2", {"num_frames": 5}),
})
# One device runs SANA's [uncond, cond] in one forward, CFG parallel a row per rank: the latents round apart
# (2.6e-6 of 6.3) and its random DC-AE (latents / 0.414, six levels) and resize turn that into 1.7e-5 of the
# frames (measured in process on this request: two one-row forwards against one of both rows).
FRAMES_TOL = {"tiny-sana": 5e-5}


@pytest.mark.heavy
@pytest.mark.parametrize("model", list(OTHER_MODELS))
def test_other_models_equal_one_device(model, refs, tmp_path_factory, lora_root):
    layout, over = OTHER_MODELS[model]
    engine = _start(tmp_path_factory, model, _topology(layout), lora_root)
    try:
        with EngineClient(engine.url) as c:
            for path, case in (CASES["serving-frames"], CASES["rollout-group"]):
                body = {**BASE, **case, **over}
                tol = FRAMES_TOL.get(model, TOL) if body["output_type"] == "frames" else TOL
                _assert_same(_samples(c, path, body), _samples(refs(model), path, body), tol)
    finally:
        engine.stop()


def _followers(leader: int) -> list[int]:
    """The follower processes of a leader (its children running denoise_worker.follower)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            cmd = (d / "cmdline").read_bytes()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        if ppid == leader and b"denoise_worker.follower" in cmd:
            out.append(int(d.name))
    return out


def _processes_of(engine: Engine) -> list[int]:
    """Processes whose command line names the engine's directory (its workers and their followers)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            mine = d.name.isdigit() and str(engine.workdir).encode() in (d / "cmdline").read_bytes()
            if mine and pid_alive(int(d.name)):
                out.append(int(d.name))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def _denoise_pid(engine: Engine) -> int:
    return next(w["pid"] for w in engine.http.get("/health").json()["workers"] if w["role"] == "denoise")


@pytest.mark.heavy  # a multi-rank engine killed and restarted: half a minute
def test_a_follower_that_dies_takes_its_worker_down_and_up_whole(refs, tmp_path_factory, lora_root):
    # One attempt: the held request fails with its worker (tests/test_redispatch.py runs such requests again).
    engine = _start(tmp_path_factory, "tiny", _topology("cfg2-ulysses2"), lora_root, ("--max-attempts", "1"))
    try:
        leader = _denoise_pid(engine)
        followers = _followers(leader)
        assert len(followers) == 3
        slow = {**BASE, "height": 128, "width": 128, "num_frames": 9, "num_inference_steps": 400}
        with EngineClient(engine.url) as c, ThreadPoolExecutor(1) as pool:
            held = pool.submit(lambda: c.generate(**slow))
            time.sleep(1.5)
            assert not held.done()
            killed_at = time.monotonic()
            os.kill(followers[1], signal.SIGKILL)
            with pytest.raises(EngineHTTPError) as err:
                held.result(timeout=30)
            assert time.monotonic() - killed_at < 5  # at once, not after a timeout
            assert err.value.status == 503 and err.value.error["stage"] == "denoise"
            deadline = time.monotonic() + 90
            while engine.http.get("/health").status_code != 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            new_leader = _denoise_pid(engine)
            assert new_leader != leader and not pid_alive(leader)
            assert not any(pid_alive(p) for p in followers)  # the others went with their leader
            new_followers = _followers(new_leader)
            assert len(new_followers) == 3
            _assert_same(_samples(c, "/rollout/generate", {**BASE, "n": 2}),
                         _samples(refs("tiny"), "/rollout/generate", {**BASE, "n": 2}))
            os.kill(new_leader, signal.SIGKILL)  # and the other way round: the followers go with their leader
            deadline = time.monotonic() + 5
            while any(pid_alive(p) for p in new_followers) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not any(pid_alive(p) for p in new_followers)
        assert "restarted denoise worker 0" in engine.log_text()
    finally:
        engine.stop()
    assert not any(pid_alive(p) for p in [new_leader, *new_followers])  # nothing left behind
    assert not _processes_of(engine)


def test_health_shows_every_rank(multi):
    (w,) = [w for w in multi.health()["workers"] if w["role"] == "denoise"]
    ranks = w["ulysses"] * (2 if w["cfg_parallel"] else 1)
    assert ranks > 1 and w["devices"] == ["cpu"] * ranks and w["state"] == "ready"


COMPILE_TOL = 1e-4  # torch.compile's fused kernels round apart from eager (float32): latents and log-probs
FRAMES_COMPILE_TOL = 1e-3  # frames: the (eager) VAE decodes those latents, and magnifies their differences ~10x


def _recompiles_after_ready(engine: Engine) -> list[str]:
    text = engine.log_text()
    ready = text.index("denoise-0 INFO ready on")
    return [line for line in text[ready:].splitlines() if "Recompiling function" in line]


@pytest.mark.heavy  # a compiled engine per layout: tests/test_compile.py covers compiling in the default suite
@pytest.mark.parametrize("layout", ["one", "cfg2"])
def test_compiled_workers_equal_eager_and_compile_once_per_shape(layout, refs, adapter, tmp_path_factory, lora_root):
    """``--compile``: warmed up at the default shape before ready; then groups of other sizes, requests at
    different steps and an adapter's rows run without compiling again (a LoRA's first use aside)."""
    topology = "encoder=1,denoise=1,decode=1" if layout == "one" else _topology(layout)
    engine = Engine(tmp_path_factory.mktemp("engine"), "tiny", topology,
                    ["--max-batch-size", "8", "--weight-root", str(lora_root), "--compile"])
    try:
        assert "compiled transformer in" in engine.log_text()
        with EngineClient(engine.url) as c:
            for n, path, over in [(1, *CASES["serving-latent"]), (3, *CASES["rollout-group"]),
                                  (2, *CASES["serving-frames"]), (1, *CASES["no-cfg"])]:
                body = {**BASE, **over, "n": n}
                got, want = _samples(c, path, body), _samples(refs("tiny"), path, body)
                tol = FRAMES_COMPILE_TOL if body["output_type"] == "frames" else COMPILE_TOL
                assert max(_diff(g, w) for g, w in zip(got, want)) <= tol
            assert not _recompiles_after_ready(engine)
            c.load_lora_adapter("cmp", str(adapter.path))
            body = {**BASE, "lora_name": "cmp", "n": 2}
            refs("tiny").load_lora_adapter("cmp", str(adapter.path))
            try:
                seen = []
                for seed in (1, 2):  # the second time compiles nothing
                    got = _samples(c, "/generate", {**body, "seed": seed})
                    want = _samples(refs("tiny"), "/generate", {**body, "seed": seed})
                    assert max(_diff(g, w) for g, w in zip(got, want)) <= COMPILE_TOL
                    seen.append(len(_recompiles_after_ready(engine)))
            finally:
                refs("tiny").unload_lora_adapter("cmp")
            assert seen[1] == seen[0]
    finally:
        engine.stop()


def test_weights_and_adapters_from_memory_reach_every_rank(multi, refs, tiny_dir):
    """Weight sync from the trainer's memory (shared-memory buckets) and an adapter pushed the same way."""
    model = lf._load_transformer(tiny_dir, "transformer")
    original = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    state, config = lf.lora_state_dict(tiny_dir, rank=4, alpha=8, target_modules=lf.ATTN, seed=8)
    body = {**BASE, "n": 2, "lora_name": "mem"}
    try:
        for c in (multi, refs("tiny")):
            c.update_weights_from_tensors(model.state_dict())
            c.update_weights_from_tensors(state, lora={"lora_name": "mem", "rank": 4, "alpha": 8})
        _assert_same(_samples(multi, "/rollout/generate", body), _samples(refs("tiny"), "/rollout/generate", body))
        _assert_same(_samples(multi, "/generate", BASE), _samples(refs("tiny"), "/generate", BASE))
    finally:
        for c in (multi, refs("tiny")):
            c.update_weights_from_tensors(original)
            c.unload_lora_adapter("mem")


@pytest.mark.heavy
def test_a_sequence_the_ranks_cannot_share_is_refused_alone(refs, tmp_path_factory, lora_root):
    """Qwen-Image over two Ulysses ranks: texts of every length run (padded with the mask the transformer
    honours) and equal one device; an image sequence of an odd token count is a 400 that says why, and the
    worker serves the next request."""
    from router.client import EngineHTTPError

    engine = _start(tmp_path_factory, "tiny-qwen-image", _topology("ulysses2"), lora_root)
    try:
        with EngineClient(engine.url) as c:
            for prompt in ("a heron in", "a grey heron", "a heron at dusk, wings open wide"):  # 11, 13, 25 tokens
                body = {**BASE, "prompt": prompt, "guidance_scale": None, "true_cfg_scale": 2.0, "height": 64,
                        "width": 48}
                _assert_same(_samples(c, "/generate", body), _samples(refs("tiny-qwen-image"), "/generate", body))
            with pytest.raises(EngineHTTPError) as e:  # 48 x 48: 3 x 3 tokens over 2 ranks
                c.generate(**{**body, "height": 48, "width": 48})
            assert e.value.status == 400 and "do not divide by 2" in str(e.value)
            assert c.generate(**body)["samples"]  # the worker is still there
    finally:
        engine.stop()
