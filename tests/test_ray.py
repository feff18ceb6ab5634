"""``launch.py --ray``: the same topology over the nodes of a Ray cluster (three simulated nodes here).

A local ``ray.cluster_utils.Cluster`` (a head and two nodes, each with its own custom resource) takes
``encoder=1,denoise=2,decode=1`` pinned to nodes by a topology file. Checked against the local launcher on
the same seeds (max abs diff 0.0): serving frames, rollout log-probs and trajectories. Also: ``/health``
puts each worker on the node its resources asked for, each worker's secret key is only on its node, a
SIGKILLed worker comes back in place, a node that dies moves its workers to a node with the resources (and
their peers follow), and a stop leaves no process or directory behind.

The engine tests are heavy (a Ray cluster and two engines: about two minutes on 2 cores): CI runs them.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import msgspec
import pytest
import torch

from common.config.engine import WorkerSpec
from common.config.topology import parse_topology
from common.placement.ray_workers import bundle, on_its_gpus
from common.runtime.engine_process import ROOT, EngineProcess
from common.transport.shm import engine_prefix
from conftest import pid_alive
from router.client import EngineClient

LOOPBACK_RAY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}  # Ray's nodes on 127.0.0.1: loopback only
# denoise-0 and the only decode worker share node_b, so that losing node_b moves a worker every request uses.
PLACES = [("encoder", "node_a"), ("denoise", "node_b"), ("denoise", "node_c"), ("decode", "node_b")]
# Requests run at once (so both denoise workers take some) but each alone: a forward shared with another
# request may round differently, and which requests share one depends on timing.
ONE_AT_A_TIME = ["--max-batch-size", "1"]
REQUESTS = [
    ("/generate", dict(prompt="a heron in the reeds", seed=11, num_inference_steps=4, output_type="frames")),
    ("/generate", dict(prompt="a fox at dusk", seed=12, num_inference_steps=3, guidance_scale=1.0,
                       output_type="latent")),
    ("/rollout/generate", dict(prompt="a boat", seed=13, n=2, num_inference_steps=4, return_trajectory=True,
                               noise_level=0.7)),
]


# --- no cluster needed ---------------------------------------------------------------------------------------


def test_a_bundle_reserves_the_workers_threads_gpus_and_custom_resources():
    cpu = WorkerSpec(role="encoder", index=0, threads=3, resources={"node_a": 0.5})
    assert bundle(cpu) == {"CPU": 3.0, "node_a": 0.5}
    gpus = WorkerSpec(role="denoise", index=0, device="cuda:2", devices=["cuda:2", "cuda:5"], ulysses=2)
    assert bundle(gpus) == {"CPU": 1.0, "GPU": 2.0}
    # Ray hands the host exactly its bundle's GPUs, visible there as 0..n-1.
    assert (on_its_gpus(gpus).device, on_its_gpus(gpus).devices) == ("cuda:0", ["cuda:0", "cuda:1"])
    one = WorkerSpec(role="decode", index=0, device="cuda:7")
    assert (bundle(one)["GPU"], on_its_gpus(one).device, on_its_gpus(one).devices) == (1.0, "cuda:0", [])


@pytest.mark.parametrize("resources, message", [
    ([1], "must be a mapping"), ({"CPU": 1}, "comes from threads and devices"), ({"node a": 1}, "bad resource"),
    ({"node_a": 0}, "positive amount"), ({"node_a": True}, "positive amount"),
])
def test_bad_resources_in_a_topology_are_refused(tmp_path, resources, message):
    f = tmp_path / "t.json"
    f.write_text(json.dumps([{"role": "encoder", "resources": resources}, {"role": "denoise"}, {"role": "decode"}]))
    with pytest.raises(ValueError, match=message):
        parse_topology(str(f), tmp_path)


def _launch(args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), "--port", "0", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})


def _topology_file(tmp_path: Path, places=PLACES, **extra) -> str:
    f = tmp_path / "topology.json"
    f.write_text(json.dumps({"workers": [{"role": r, "resources": {n: 0.1}, **extra} for r, n in places]}))
    return str(f)


@pytest.mark.heavy  # launchers with and without Ray: CI
def test_resources_need_ray_and_ray_places_by_resources_not_hosts(tmp_path):
    r = _launch(["--topology", _topology_file(tmp_path)])
    assert r.returncode != 0 and "'resources' are Ray's; they need --ray" in r.stderr
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([{"role": "encoder", "host": "10.0.0.2"}, {"role": "denoise"}, {"role": "decode"}]))
    r = _launch(["--ray", "--topology", str(hosts)])
    assert r.returncode != 0 and "pin one to nodes with 'resources', not 'host'" in r.stderr


def test_ray_flag_without_ray_installed_says_what_to_install(tmp_path):
    fake = tmp_path / "ray"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('No module named ray')\n")
    r = _launch(["--ray"], env={"PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])})
    assert r.returncode != 0
    assert r.stderr.strip().splitlines()[-1] == "launch.py: error: --ray needs Ray: pip install -e '.[ray]'"


# --- a local Ray cluster --------------------------------------------------------------------------------------


def _add_node(c, resource: str):
    return c.add_node(num_cpus=2, resources={resource: 1}, node_ip_address="127.0.0.1")


@pytest.fixture(scope="module")
def cluster():
    saved = {k: os.environ.get(k) for k in LOOPBACK_RAY}
    os.environ.update(LOOPBACK_RAY)  # before Ray is imported: it reads this once
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, connect=False,
                head_node_args={"num_cpus": 2, "resources": {"node_a": 1}, "node_ip_address": "127.0.0.1"})
    c.nodes_by_resource = {"node_a": c.head_node}
    for name in ("node_b", "node_c"):
        c.nodes_by_resource[name] = _add_node(c, name)
    yield c
    c.shutdown()
    for k, v in saved.items():
        os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


@pytest.fixture(scope="module")
def local_engine(tmp_path_factory):
    engine = EngineProcess("tiny", "encoder=1,denoise=2,decode=1", extra=ONE_AT_A_TIME,
                           workdir=tmp_path_factory.mktemp("local"))
    yield EngineClient(engine.url)
    engine.stop()


@pytest.fixture(scope="module")
def ray_engine(cluster, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ray")
    engine = EngineProcess("tiny", _topology_file(tmp), extra=["--ray", cluster.address, *ONE_AT_A_TIME], workdir=tmp,
                           env=LOOPBACK_RAY)
    yield engine
    engine.stop()


def _answers(client: EngineClient) -> list[dict]:
    """Every request at once, so that both denoise workers take some."""
    with ThreadPoolExecutor(len(REQUESTS)) as pool:
        return list(pool.map(lambda req: client._post(*req), REQUESTS))


def _assert_equal(got: list[dict], want: list[dict]) -> None:
    for g, w in zip(got, want):
        assert len(g["samples"]) == len(w["samples"])
        for gs, ws in zip(g["samples"], w["samples"]):
            for key in ("output", "log_probs", "trajectory"):
                if key == "trajectory" and key in ws:
                    for name, tensor in ws[key].items():
                        assert torch.equal(gs[key][name], tensor), (key, name)
                elif key in ws:
                    assert (gs[key] - ws[key]).abs().max().item() == 0.0, key


def _rows(engine: EngineProcess) -> dict[tuple[str, int], dict]:
    return {(w["role"], w["index"]): w for w in engine.http.get("/health").json()["workers"]}


def _wait_ready(engine: EngineProcess, changed, timeout_s: float = 120) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        body = engine.http.get("/health")
        rows = _rows(engine)
        if body.status_code == 200 and changed(rows):
            return rows
        time.sleep(0.3)
    raise AssertionError(f"not back within {timeout_s}s: {_rows(engine)}\n{engine.log()}")


@pytest.mark.heavy
def test_outputs_over_ray_equal_the_local_launchers(ray_engine, local_engine):
    want = _answers(local_engine)
    _assert_equal(_answers(EngineClient(ray_engine.url)), want)


@pytest.mark.heavy
def test_health_places_each_worker_on_the_node_its_resources_name(ray_engine, cluster):
    rows = _rows(ray_engine)
    for (role, index), node in zip([("encoder", 0), ("denoise", 0), ("denoise", 1), ("decode", 0)], PLACES):
        row = rows[(role, index)]
        assert row["node"] == cluster.nodes_by_resource[node[1]].node_id, (role, index)
        assert row["endpoint"].startswith("tcp://127.0.0.1:") and row["state"] == "ready"


@pytest.mark.heavy
def test_each_secret_key_is_only_on_its_workers_node(ray_engine):
    # The launcher's runtime dir holds the router's key alone; each worker's is in its host's private dir.
    assert [p.name for p in (ray_engine.runtime / "curve").iterdir()] == ["router.key_secret"]
    keys = sorted(Path("/tmp").glob("disagg-ray-*/*/curve/*.key_secret"))
    assert sorted(k.name for k in keys) == sorted(f"{r}-{i}.key_secret" for r, i in _rows(ray_engine))
    for k in keys:
        assert stat.S_IMODE(k.stat().st_mode) == 0o600 and stat.S_IMODE(k.parent.parent.stat().st_mode) == 0o700
    config = json.loads(next(Path("/tmp").glob("disagg-ray-*/denoise-0-*/engine.json")).read_text())
    assert "secret-key" not in json.dumps(config) and len(config["curve_public"]) == 5


@pytest.mark.heavy
def test_a_killed_worker_process_comes_back_in_place(ray_engine, local_engine):
    before = _rows(ray_engine)[("denoise", 1)]
    os.kill(before["pid"], signal.SIGKILL)
    rows = _wait_ready(ray_engine, lambda r: r[("denoise", 1)]["pid"] != before["pid"])
    after = rows[("denoise", 1)]
    assert (after["node"], after["endpoint"]) == (before["node"], before["endpoint"])  # same node, port and key
    _assert_equal(_answers(EngineClient(ray_engine.url)), _answers(local_engine))


@pytest.mark.heavy
def test_a_lost_node_moves_its_workers_and_their_peers_follow(ray_engine, local_engine, cluster):
    before = _rows(ray_engine)
    cluster.remove_node(cluster.nodes_by_resource["node_b"])
    cluster.nodes_by_resource["node_b"] = new = _add_node(cluster, "node_b")
    moved = [("denoise", 0), ("decode", 0)]
    rows = _wait_ready(ray_engine, lambda r: all(r[k]["node"] == new.node_id for k in moved), timeout_s=180)
    for k in moved:
        assert rows[k]["endpoint"] != before[k]["endpoint"]
    assert rows[("denoise", 1)]["pid"] == before[("denoise", 1)]["pid"]  # the others stayed as they were
    # Every request goes through the moved decode worker, sent there by denoise workers that were told.
    _assert_equal(_answers(EngineClient(ray_engine.url)), _answers(local_engine))


def _engine_processes() -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and b"/disagg-ray-" in (d / "cmdline").read_bytes() and pid_alive(int(d.name)):
                out.append(int(d.name))
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


@pytest.mark.heavy
def test_a_stop_leaves_no_worker_process_or_directory(ray_engine):
    assert len(_engine_processes()) == 4
    ray_engine.stop()
    assert ray_engine.proc.returncode == 0
    deadline = time.monotonic() + 10
    while _engine_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _engine_processes() == []
    assert list(Path("/tmp").glob("disagg-ray-*")) == []
    assert not (ray_engine.runtime / "curve").exists()  # the router's key went with the launcher
    assert not any(p.name.startswith(engine_prefix(str(ray_engine.runtime))) for p in Path("/dev/shm").iterdir())
