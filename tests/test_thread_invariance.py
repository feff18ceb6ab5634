"""CPU outputs that do not follow the thread count (common/diffusion/thread_invariance.py).

1. A worker's torch threads: one whatever the topology's threads, the role or the machine's cores with
   ``cpu_numerics`` "invariant" (the default); the topology's with "threaded".
2. (heavy) Every family's (registry-driven) group norms and convolutions see contiguous inputs in the components as
   loaded, fed pixels as PIL / numpy hand them over (channels-last).
3. FLUX.1 Kontext with auto-resize, 80x120 and 130x70 references: the engine at the workers' thread count, for
   topologies of 1 and 3 threads, the same bits (latents and frames), and its latents equal ``FluxKontextPipeline`` run the same way (laid out as the engine,
   one thread) within 1e-5 (130x70 heavy; the gap was 1e-4 against diffusers at two threads, channels-last).
4. (heavy) Every family's encode, image side, forwards (alone and batched) and decode as the workers run them
   for topologies of 1, 2 and 3 threads: bit-identical.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from common.builtin import ensure_builtin
from common.config.engine import EngineConfig, WorkerSpec, worker_threads
from common.diffusion import text_roles
from common.diffusion.thread_invariance import LAYOUT_SENSITIVE
from common.runtime.component_memory import modules_of
from denoise_worker.forward import step_velocities
from denoise_worker.threads import size_threads
from family_builtins import tiny_per_pipeline
from family_harness import ModuleModels, gradient_picture, max_diff

PIPELINES = tiny_per_pipeline()
SIZES = ((80, 120), (130, 70))  # odd sizes, as a user's pictures come
_MODELS = ModuleModels()


@pytest.fixture(scope="module", autouse=True)
def _module_state():
    yield from _MODELS.module_scope()


def _config(numerics: str, threads: int, role: str = "denoise") -> tuple[EngineConfig, WorkerSpec]:
    spec = WorkerSpec(role=role, index=0, threads=threads)
    workers = [spec] + [WorkerSpec(role=r, index=0) for r in ("encoder", "denoise", "decode") if r != role]
    return EngineConfig(model="m", workers=workers, router_endpoint="", runtime_dir="",
                        cpu_numerics=numerics), spec


def _as_worker(eng, threads: int) -> None:
    """torch's threads as a worker of a topology giving it ``threads`` sets them (and its forwards' cap)."""
    config, spec = _config("invariant", threads)  # the default
    eng.max_threads = worker_threads(config, spec)
    torch.set_num_threads(eng.max_threads)


def test_workers_compute_at_one_thread_whatever_the_topology(monkeypatch):
    for cores in (1, 2, 3, 16):
        monkeypatch.setattr("os.cpu_count", lambda cores=cores: cores)
        for role in ("encoder", "denoise", "decode"):
            for threads in (0, 1, 2, 3):
                assert worker_threads(*_config("invariant", threads, role)) == 1
                threaded = worker_threads(*_config("threaded", threads, role))
                assert threaded == threads if threads else threaded >= 1
    assert worker_threads(*_config("threaded", 0)) == 16  # the default: the cores shared by the denoise workers


def _image(eng):
    """A PIL picture of an odd size for a model that takes one, as its requests give it (a list on edit models)."""
    if eng.family.condition.image_input(eng.info) is None:
        return None
    pic = gradient_picture(*SIZES[0], seed=1)
    return [pic] if eng.family.condition.images_allowed(eng.info) > 1 else pic


@pytest.mark.heavy
@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_group_norms_see_contiguous_inputs(pipeline):
    eng = _MODELS.engine(ensure_builtin(PIPELINES[pipeline]))
    p, image = eng.params(), _image(eng)
    seen: list[tuple[str, bool]] = []
    hooks = [m.register_forward_pre_hook(lambda m, args: seen.append((type(m).__name__, args[0].is_contiguous())))
             for holder in (eng.images, eng.decoder) if holder is not None
             for top in modules_of({"c": holder}).values() for m in top.modules() if isinstance(m, LAYOUT_SENSITIVE)]
    try:
        if image is not None:
            eng.image_wire(p, image)
        eng.decoded(eng.family.latents.draw(eng.info, p, torch.Generator().manual_seed(0)), p)
    finally:
        for h in hooks:
            h.remove()
    if not seen:
        pytest.skip(f"{pipeline}'s image side and decoder have no group norm")
    assert all(ok for _, ok in seen), sorted({name for name, ok in seen if not ok})


@pytest.mark.parametrize("size", [SIZES[0], pytest.param(SIZES[1], marks=pytest.mark.heavy)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_kontext_auto_resize_equals_the_pipeline_run_the_same_way(size):
    path = ensure_builtin(PIPELINES["FluxKontextPipeline"])
    eng = _MODELS.engine(path)
    p = eng.params()  # auto_resize on: the reference at a preferred Kontext resolution
    image = gradient_picture(*size, seed=3)
    runs = []
    for threads in (1, 3):
        _as_worker(eng, threads)
        task = eng.run(p, image=image)
        runs.append((task.latents, eng.frames(task.latents, p)))
    assert all(torch.equal(runs[0][0], lat) and torch.equal(runs[0][1], fr) for lat, fr in runs[1:])
    torch.set_num_threads(1)  # diffusers the same way: one thread, laid out as the engine (reference_pipeline)
    pipe = _MODELS.pipe(path)
    ref = pipe(image=image, prompt=p.prompt, guidance_scale=p.guidance_scale, height=p.height, width=p.width,
               max_area=p.fields["max_area"], num_inference_steps=p.num_inference_steps,
               max_sequence_length=p.max_sequence_length, output_type="latent",
               generator=torch.Generator("cpu").manual_seed(p.seed)).images
    d_lat = max_diff(runs[0][0], ref)  # (the frames: the same decoder on equal latents, test_flux_kontext.py)
    print(f"\n[{size}] latents {d_lat:.3g}")
    assert d_lat <= 1e-5


def _stage_outputs(eng, threads: int) -> list[torch.Tensor]:
    """A request's text encode, image side, forwards (alone, and batched with a second request) and decode, as
    workers given ``threads`` run them."""
    _as_worker(eng, threads)
    p, image = eng.params(), _image(eng)
    seen = [[image] if not isinstance(image, list) else image] * 2 \
        if image is not None and eng.family.condition.text_sees_images() else None
    texts = [(p.prompt, False), ("blurry", True)]
    out = [t for wire in text_roles.encode(eng.encoder, texts, p.max_sequence_length, seen) for t in wire.values()]
    out += list(eng.image_wire(p, image).values())
    a, b = eng.task(p, image=image), eng.task(msgspec.structs.replace(p, seed=7), image=image)

    def before(inputs):  # the worker's sizing, capped by its threads
        size_threads(eng.policy.experts[eng.policy.expert_for(inputs[0].timestep)], inputs, eng.max_threads,
                     eng.family.latents.image_seq_len(eng.info, p.height, p.width, p.num_frames)
                     + eng.family.condition.extra_tokens(inputs[0].image))
    out += [g.velocity for tasks in ([a], [a, b]) for g in step_velocities(eng.policy, tasks, 8, before)]
    decoded = eng.decoded(a.latents, p)
    out += [decoded.frames] + ([] if decoded.audio is None else [decoded.audio])
    return out


@pytest.mark.heavy
@pytest.mark.parametrize("pipeline", sorted(PIPELINES))
def test_every_stage_is_bit_identical_whatever_the_threads(pipeline):
    eng = _MODELS.engine(ensure_builtin(PIPELINES[pipeline]))
    first = _stage_outputs(eng, 1)
    for threads in (2, 3):
        again = _stage_outputs(eng, threads)
        assert len(again) == len(first)
        assert all(torch.equal(x, y) for x, y in zip(first, again)), threads
