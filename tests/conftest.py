"""Fixtures that start real engines on loopback: in this process (the local engine with its HTTP front door) unless
the test asks for a launched one (launch.py in a child process), or the engine needs what only processes have."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.config.engine import DATA_DIR_ENV  # noqa: E402
from common.runtime.engine_process import EngineProcess  # noqa: E402
from common.builtin import ensure_builtin  # noqa: E402
from engine_pool import DEFAULT_TOPOLOGY, EnginePool  # noqa: E402
from router.api.auth import ADMIN_KEY_ENV, API_KEY_ENV  # noqa: E402

# Engines started by this test process (every EngineProcess, shared or not), reported at the end of the run:
# counted by wrapping the class here, so that the product's EngineProcess carries nothing for the suite.
ENGINE_STARTS = {"all": 0}
IN_PROCESS_STARTS = {"all": 0}
_POOLS: list[EnginePool] = []
_start_engine_process = EngineProcess.__init__


def _counted_start(self, *args, **kwargs):
    ENGINE_STARTS["all"] += 1
    _start_engine_process(self, *args, **kwargs)


EngineProcess.__init__ = _counted_start


def pytest_collection_modifyitems(config, items):
    """Heavy tests (several multi-rank engines, minutes each) run in CI (CI=true) or with DISAGG_HEAVY=1."""
    if os.environ.get("CI") == "true" or os.environ.get("DISAGG_HEAVY") == "1":
        return
    skip = pytest.mark.skip(reason="heavy: runs in CI, or here with DISAGG_HEAVY=1")
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def own_data_dir(tmp_path_factory):
    """launch.py started directly (not through EngineProcess, which gives each engine its own) keeps its jobs
    in this session's dir, never in the user's default one."""
    os.environ[DATA_DIR_ENV] = str(tmp_path_factory.mktemp("data-dir"))


_os_kill = os.kill


def _kill_another(pid: int, sig: int) -> None:
    """An in-process engine's workers report this process's pid: a test that would signal one is a test of
    processes, which must ask for ``launched=True``; it fails here instead of ending the run."""
    if sig != 0 and (pid in (0, os.getpid()) or pid == -os.getpgid(0)):
        raise RuntimeError(f"a test signalled the test process itself ({sig}): its engine is in process; a test "
                           "of the workers' processes asks for launched=True")
    _os_kill(pid, sig)


os.kill = _kill_another


_MODULE_METHODS = {name: getattr(torch.nn.Module, name) for name in ("register_parameter", "register_buffer")}


@pytest.fixture(autouse=True)
def module_registration_restored():
    """accelerate's ``init_empty_weights`` patches ``torch.nn.Module`` for the whole process while a model loads;
    two loads on two threads of one process (an in-process engine's and a test's) can leave it patched, and every
    later model would be built on the meta device. The test that left it so fails here, and the rest run clean."""
    yield
    left = [name for name, method in _MODULE_METHODS.items() if getattr(torch.nn.Module, name) is not method]
    for name in left:
        setattr(torch.nn.Module, name, _MODULE_METHODS[name])
    assert not left, f"torch.nn.Module.{left} left patched (a model loaded on two threads at once)"


def pid_alive(pid: int) -> bool:
    """Whether a process runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def sample_tensor(dtype: torch.dtype, shape) -> torch.Tensor:
    """Seeded values of any wire dtype (bool, signed/unsigned ints, floats, bfloat16)."""
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)
    return torch.randint(-100 if dtype != torch.uint8 else 0, 100, shape, generator=g).to(dtype)


class Engine(EngineProcess):
    """One running topology for a test module (or the session's pool), in a pytest temp directory."""

    def __init__(self, tmp: Path, model: str, topology: str, extra: list[str] | None = None,
                 env: dict[str, str] | None = None):
        super().__init__(model, topology, extra, workdir=tmp, env=env)

    def alive(self) -> bool:
        return self.proc.poll() is None


# Flags whose subject is the processes, the sockets between them or the launcher: an engine with one is launched.
PROCESS_FLAGS = {"--ray", "--transport", "--no-curve", "--shm-threshold", "--shm-spare-bytes", "--no-cuda-ipc",
                 "--no-restart", "--grace-period", "--runtime-dir", "--host", "--port", "--max-message-bytes"}
# The environment an in-process engine takes, as the flags that say the same.
KEY_FLAGS = {API_KEY_ENV: "--api-key", ADMIN_KEY_ENV: "--admin-key"}
# Everything launched, as before the local engine: ``DISAGG_TEST_ENGINES=launched``.
ALL_LAUNCHED = os.environ.get("DISAGG_TEST_ENGINES") == "launched"


class InProcessEngine:
    """A test engine in this process: the local engine (local_engine/) with the launched router's HTTP front door,
    so ``url``, ``http``, ``stop()`` and ``alive()`` work as a launched ``Engine``'s; the same answers bit for bit
    (tests/test_local_engine.py), started in a fraction of a second instead of ~10 s. It has no log, worker pids
    or processes to kill: a test about those asks for ``launched=True``."""

    def __init__(self, tmp: Path, model: str, topology: str, extra: list[str], env: dict[str, str]):
        from local_engine import LocalEngine

        flags = [f for name, value in env.items() for f in (KEY_FLAGS[name], value)]
        if not any(a == "--data-dir" or a.startswith("--data-dir=") for a in extra):
            flags += ["--data-dir", str(tmp / "jobs")]
        IN_PROCESS_STARTS["all"] += 1
        self.local = LocalEngine(model, "--topology", topology, *extra, *flags)
        self.url = self.local.serve_http()
        self.port, self.workdir = self.local.front_door.port, tmp
        self.http = httpx.Client(base_url=self.url, timeout=600)

    def alive(self) -> bool:
        return self.local.link.loop_thread.error is None

    def stop(self) -> None:
        self.http.close()
        self.local.close()


def in_process_possible(topology: str, extra, env: dict[str, str]) -> bool:
    flags = {a.split("=", 1)[0] for a in extra if a.startswith("--")}
    return ":" not in topology and not flags & PROCESS_FLAGS and set(env) <= KEY_FLAGS.keys()


def start_engine(tmp: Path, model: str, topology: str, extra=(), env: dict | None = None, launched: bool = False):
    """An in-process engine unless ``launched`` (the test's subject is the processes: their logs, pids, deaths,
    restarts, signals), ``DISAGG_TEST_ENGINES=launched``, or the engine needs processes (ranks, Ray, tcp, shared
    memory, launcher flags: ``PROCESS_FLAGS``)."""
    extra, env = list(extra or []), dict(env or {})
    if launched or ALL_LAUNCHED or not in_process_possible(topology, extra, env):
        return Engine(tmp, model, topology, extra, env)
    return InProcessEngine(tmp, model, topology, extra, env)


@pytest.fixture(scope="session")
def tiny_dir() -> Path:
    return ensure_builtin("tiny")


@pytest.fixture(scope="session")
def alt_dir() -> Path:
    return ensure_builtin("tiny-alt")


@pytest.fixture(scope="module")
def engine_factory(tmp_path_factory):
    """Engines of this module alone, stopped at its end: for tests that change what an engine answers
    (weights, adapters, memory, killed workers, limits) and for flags no other module uses."""
    started: list = []

    def start(model: str = "tiny", topology: str = DEFAULT_TOPOLOGY, extra=None, launched: bool = False):
        e = start_engine(tmp_path_factory.mktemp("engine"), model, topology, extra, launched=launched)
        started.append(e)
        return e

    yield start
    for e in started:
        e.stop()


@pytest.fixture(scope="session")
def engine_pool(tmp_path_factory):
    """The session's shared engines (tests/engine_pool.py); ``DISAGG_TEST_SHARED_ENGINES`` of them at once
    (default 3)."""
    pool = EnginePool(lambda model, topology, extra, env, launched: start_engine(
        tmp_path_factory.mktemp("shared-engine"), model, topology, extra, env, launched),
        capacity=int(os.environ.get("DISAGG_TEST_SHARED_ENGINES", "3")))
    _POOLS.append(pool)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def shared_engine(engine_pool):
    """``shared_engine(model="tiny", topology=..., extra=(), env=None, launched=False)``: the session's engine of that
    key, started on first use. Only for tests that leave it answering as before (see tests/engine_pool.py); a
    module uses at most the pool's capacity of keys (3), or it would stop one it still holds."""
    return engine_pool.get


# The API key of the shared engine that asks for one (``keyed_engine``).
SHARED_API_KEY = "test-api-key-0123456789abcdef"


@pytest.fixture(scope="module")
def keyed_engine(shared_engine):
    """The shared ``tiny`` engine that requires ``Authorization: Bearer SHARED_API_KEY`` (from the environment,
    as ``$DISAGG_API_KEY``)."""
    return shared_engine("tiny", env={API_KEY_ENV: SHARED_API_KEY})


def pytest_terminal_summary(terminalreporter):
    sweep = sys.modules.get("test_config_sweep")
    if sweep is not None:  # the seed that rebuilds every drawn configuration of the run
        terminalreporter.write_line(f"config sweep: seed {sweep.SEED}, {sweep.PER_FAMILY} per family "
                                    "(DISAGG_SWEEP_SEED, DISAGG_SWEEP_N)")
    if ENGINE_STARTS["all"] or IN_PROCESS_STARTS["all"]:
        shared = sum(p.starts for p in _POOLS)
        keys = len(set().union(*(p.keys for p in _POOLS))) if _POOLS else 0
        terminalreporter.write_line(f"engines started: {ENGINE_STARTS['all']} launched, {IN_PROCESS_STARTS['all']} "
                                    f"in process (shared: {shared} starts of {keys} keys)")
    if MEMORY_PEAK["total"]:
        terminalreporter.write_line(f"memory: this process at most {MEMORY_PEAK['own'] / 2**30:.1f} GiB; with the "
                                    f"processes it started {MEMORY_PEAK['total'] / 2**30:.1f} GiB, after "
                                    f"{MEMORY_PEAK['at']}")


_PIPES: dict[str, object] = {}


def reference_pipeline(pipe):
    """A diffusers pipeline as the tests compare the engine with: no progress bar, and its weights laid out as
    the engine lays out its own (common/diffusion/weight_storage.py: kernels round by alignment, so the same
    weights at other addresses would not give the same bits)."""
    from common.runtime.component_memory import settle_held

    settle_held(pipe=pipe)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def diffusers_pipe(model_dir: Path, cache: dict | None = None):
    """diffusers' own WanPipeline on the same directory, cached per directory (in ``cache``, else one shared)."""
    from diffusers import WanPipeline

    cache = _PIPES if cache is None else cache
    key = str(model_dir)
    if key not in cache:
        cache[key] = reference_pipeline(WanPipeline.from_pretrained(model_dir, dtype=torch.float32))
    return cache[key]


def solo_then_concurrent(client, reqs: list[tuple[str, dict]]) -> tuple[list[dict], list[dict]]:
    """Each ``(path, body)`` request alone, then all of them at once: their first samples, in order."""
    from concurrent.futures import ThreadPoolExecutor

    def run(r):
        return client._post(r[0], r[1])["samples"][0]

    solo = [run(r) for r in reqs]
    with ThreadPoolExecutor(len(reqs)) as pool:
        return solo, list(pool.map(run, reqs))


def diffusers_generate(model_dir: Path, *, prompt, seed, height, width, num_frames, num_inference_steps,
                       guidance_scale, negative_prompt="", output_type="np", sigmas=None, guidance_scale_2=None):
    """Reference output; custom sigmas go to the pipeline's own scheduler as diffusers would take them."""
    import numpy as np

    pipe = diffusers_pipe(model_dir)
    original = pipe.scheduler.set_timesteps
    if sigmas is not None:
        pipe.scheduler.set_timesteps = lambda n, device=None: original(
            sigmas=np.asarray(sigmas, dtype=np.float64), device=device)
    try:
        kw = {} if guidance_scale_2 is None else {"guidance_scale_2": guidance_scale_2}
        out = pipe(prompt=prompt, negative_prompt=negative_prompt, height=height, width=width,
                   num_frames=num_frames, num_inference_steps=num_inference_steps, guidance_scale=guidance_scale,
                   generator=torch.Generator("cpu").manual_seed(seed), output_type=output_type, **kw).frames
    finally:
        pipe.scheduler.set_timesteps = original
    if output_type == "np":
        return torch.from_numpy(out[0])
    return out[0]


@pytest.fixture(scope="session")
def moe_dir() -> Path:
    return ensure_builtin("tiny-moe")


@pytest.fixture(scope="session")
def lora_root(tmp_path_factory) -> Path:
    """A weight root for LoRA adapters (``--weight-root``): adapters that engines may load are written below it."""
    return tmp_path_factory.mktemp("lora-root")


@pytest.fixture(scope="session")
def tiny_lora(tiny_dir, lora_root):
    """A diffusers-format adapter on the tiny model (rank 4, alpha 8, the attention projections), with the
    peft state dict it was saved from (``tests/lora_fixtures.py``)."""
    from lora_fixtures import ATTN, make_diffusers_lora

    return make_diffusers_lora(tiny_dir, lora_root / "tiny-lora", rank=4, alpha=8, target_modules=ATTN, seed=1)


# Memory of the suite: this process and every process it started (engines, their workers), after each test.
# The peak is reported at the end; ``DISAGG_TEST_MEMORY_LOG=FILE`` also writes one line a test, to find where
# it grows.
MEMORY_PEAK = {"total": 0, "own": 0, "at": ""}


def _rss_now() -> tuple[int, int]:
    import psutil

    me = psutil.Process()
    total = own = me.memory_info().rss
    for child in me.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.Error:  # gone between the listing and the read
            pass
    return own, total


def pytest_runtest_logfinish(nodeid, location):
    own, total = _rss_now()
    if total > MEMORY_PEAK["total"]:
        MEMORY_PEAK.update(total=total, at=nodeid)
    MEMORY_PEAK["own"] = max(MEMORY_PEAK["own"], own)
    log = os.environ.get("DISAGG_TEST_MEMORY_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"{time.time():.1f} {own / 2**20:.0f} {total / 2**20:.0f} {nodeid}\n")
