"""Topology specs (compact and file forms) and the engine config file, without starting any process."""

import json
from pathlib import Path

import msgspec
import pytest
import torch

from common.config import topology
from common.config.engine import EngineConfig, Limits
from common.config.topology import parse_topology


@pytest.fixture
def no_gpu(monkeypatch):
    """Parse as on a machine without GPUs, whatever this one has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _layout(workers):
    return [(w.role, w.index, w.device, w.threads) for w in workers]


def _endpoint(rt: Path, role: str, index: int) -> str:
    return f"ipc://{rt / f'{role}-{index}.sock'}"


def test_compact_spec_gives_indices_per_role_on_cpu(tmp_path, no_gpu):
    workers = parse_topology("encoder=1,denoise=2,decode=1", tmp_path)
    assert _layout(workers) == [
        ("encoder", 0, "cpu", 0),
        ("denoise", 0, "cpu", 0),
        ("denoise", 1, "cpu", 0),
        ("decode", 0, "cpu", 0),
    ]
    endpoints = [w.endpoint for w in workers]
    assert endpoints == [_endpoint(tmp_path, w.role, w.index) for w in workers]
    assert len(set(endpoints)) == len(endpoints)
    for e in endpoints:
        assert e.startswith("ipc://")
        assert Path(e[len("ipc://"):]).parent == tmp_path


def test_compact_spec_order_and_spaces_do_not_matter(tmp_path, no_gpu):
    a = parse_topology("encoder=2,denoise=3,decode=2", tmp_path)
    b = parse_topology(" decode = 2 ,denoise=3,  encoder=2 ", tmp_path)
    assert a == b
    assert [(w.role, w.index) for w in a] == [
        ("encoder", 0), ("encoder", 1), ("denoise", 0), ("denoise", 1), ("denoise", 2), ("decode", 0), ("decode", 1),
    ]
    assert len({w.endpoint for w in a}) == 7


def test_compact_spec_round_robins_over_visible_gpus(tmp_path, monkeypatch):
    monkeypatch.setattr(topology, "_visible_devices", lambda: ["cuda:0", "cuda:1"])
    workers = parse_topology("encoder=1,denoise=2,decode=1", tmp_path)
    assert [w.device for w in workers] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]


def test_endpoints_live_in_the_given_runtime_dir(tmp_path, no_gpu):
    a = parse_topology("encoder=1,denoise=1,decode=1", tmp_path / "a")
    b = parse_topology("encoder=1,denoise=1,decode=1", tmp_path / "b")
    assert all(w.endpoint.startswith(f"ipc://{tmp_path / 'a'}/") for w in a)
    assert not {w.endpoint for w in a} & {w.endpoint for w in b}


YAML_TOPOLOGY = """\
workers:
  - role: encoder
  - role: denoise
    device: cuda:1
    threads: 3
  - role: denoise
    device: cpu
    threads: 2
  - role: decode
    device: cuda
"""


@pytest.mark.parametrize("suffix", [".yaml", ".yml"])
def test_yaml_file(tmp_path, suffix):
    path = tmp_path / f"topo{suffix}"
    path.write_text(YAML_TOPOLOGY)
    workers = parse_topology(str(path), tmp_path / "rt")
    assert _layout(workers) == [
        ("encoder", 0, "cpu", 0),
        ("denoise", 0, "cuda:1", 3),
        ("denoise", 1, "cpu", 2),
        ("decode", 0, "cuda", 0),
    ]
    assert [w.endpoint for w in workers] == [_endpoint(tmp_path / "rt", w.role, w.index) for w in workers]


@pytest.mark.parametrize("wrapped", [True, False], ids=["workers-key", "bare-list"])
def test_json_file(tmp_path, wrapped):
    entries = [
        {"role": "decode", "device": "cuda:0", "threads": 1},
        {"role": "encoder", "threads": 3},
        {"role": "denoise", "device": "cuda:1", "threads": 3},
        {"role": "decode", "device": "cuda:2"},
    ]
    path = tmp_path / "topo.json"
    path.write_text(json.dumps({"workers": entries} if wrapped else entries))
    workers = parse_topology(str(path), tmp_path)
    # File order is kept; indices count per role in that order.
    assert _layout(workers) == [
        ("decode", 0, "cuda:0", 1),
        ("encoder", 0, "cpu", 3),
        ("denoise", 0, "cuda:1", 3),
        ("decode", 1, "cuda:2", 0),
    ]
    assert len({w.endpoint for w in workers}) == 4


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("encoder=1,denoise=1", "at least one decode worker"),
        ("denoise=2,decode=1", "at least one encoder worker"),
        ("encoder=1,denoise=1,decode=1,vae=1", "unknown role 'vae'"),
        ("encoder=1,denoise=0,decode=1", "count must be within 1..64"),
        ("encoder=1,denoise=65,decode=1", "count must be within 1..64"),
        ("encoder=1;denoise=1;decode=1", "bad topology item"),
        ("encoder:1,denoise:1,decode:1", "bad topology item"),
        ("encoder=one,denoise=1,decode=1", "bad topology item"),
        ("encoder=-1,denoise=1,decode=1", "bad topology item"),
        ("encoder=1,,decode=1", "bad topology item ''"),
        ("=1", "bad topology item"),
        ("encoder=1,denoise=1,decode=1,denoise=3", "appears twice"),
        ("", "bad topology item"),
    ],
)
def test_bad_compact_specs(tmp_path, spec, needle):
    with pytest.raises(ValueError, match=needle):
        parse_topology(spec, tmp_path)


GOOD = [{"role": "encoder"}, {"role": "denoise"}, {"role": "decode"}]


@pytest.mark.parametrize(
    "data, needle",
    [
        ([{"role": "encoder"}, {"role": "denoise"}], "at least one decode worker"),
        ([], "at least one encoder worker"),
        ([*GOOD, {"device": "cpu"}], r"worker #3: needs a role"),
        ([*GOOD, {"role": "vae"}], r"worker #3: needs a role"),
        ([*GOOD, "denoise"], r"worker #3: needs a role"),
        ([*GOOD, {"role": "denoise", "device": "gpu:0"}], "bad device 'gpu:0'"),
        ([*GOOD, {"role": "denoise", "device": "cuda:x"}], "bad device 'cuda:x'"),
        ([*GOOD, {"role": "denoise", "device": "cuda:-1"}], "bad device"),
        ([*GOOD, {"role": "denoise", "device": "CPU"}], "bad device"),
        ([*GOOD, {"role": "denoise", "gpus": 2}], r"unknown keys \['gpus'\]"),
        ([*GOOD, {"role": "denoise", "endpoint": "tcp://10.0.0.1:5555"}], r"unknown keys \['endpoint'\]"),
        ([*GOOD, {"role": "denoise", "threads": -1}], "threads must be a non-negative integer"),
        ([*GOOD, {"role": "denoise", "threads": 2.5}], "threads must be a non-negative integer"),
        ([*GOOD, {"role": "denoise", "threads": "4"}], "threads must be a non-negative integer"),
        ([*GOOD, {"role": "denoise", "threads": True}], "threads must be a non-negative integer"),
        ({"workers": None}, "expected a list of workers"),
        ({"denoise": 1}, "expected a list of workers"),
        ("encoder=1,denoise=1,decode=1", "expected a list of workers"),
    ],
)
@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_bad_topology_files(tmp_path, data, needle, suffix):
    path = tmp_path / f"topo{suffix}"
    path.write_text(json.dumps(data))  # JSON is also valid YAML
    with pytest.raises(ValueError, match=needle):
        parse_topology(str(path), tmp_path)


@pytest.mark.parametrize(
    "name, text",
    [
        ("topo.json", '{"workers": [{"role": "encoder",'),
        ("topo.json", "workers: [encoder]"),
        ("topo.yaml", "workers: [role: encoder\n  - {"),
        ("topo.yml", "workers:\n  - role: encoder\n   device: cpu\n"),
    ],
)
def test_unparsable_topology_files(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as exc:
        parse_topology(str(path), tmp_path)
    if path.suffix != ".json":  # YAML parse errors are re-raised as ValueErrors naming the file
        assert str(path) in str(exc.value) and "not valid YAML" in str(exc.value)


def test_engine_config_save_load_round_trip(tmp_path):
    path = tmp_path / "topo.yaml"
    path.write_text(YAML_TOPOLOGY)
    config = EngineConfig(
        model=str(tmp_path / "model"),
        workers=parse_topology(str(path), tmp_path),
        router_endpoint=f"ipc://{tmp_path / 'router.sock'}",
        runtime_dir=str(tmp_path),
        dtype="bfloat16",
        heartbeat_interval_s=0.25,
        heartbeat_timeout_s=3.0,
        limits=Limits(max_height=512, max_width=768, max_num_frames=33, max_steps=40, max_n=2,
                      max_prompt_chars=100, request_timeout_s=12.5),
    )
    saved = tmp_path / "engine.json"
    config.save(saved)
    json.loads(saved.read_text())  # plain JSON on disk
    loaded = EngineConfig.load(saved)
    assert loaded == config
    assert loaded.worker("denoise", 0).device == "cuda:1" and loaded.worker("denoise", 0).threads == 3
    assert [w.index for w in loaded.of_role("denoise")] == [0, 1]
    with pytest.raises(KeyError):
        loaded.worker("denoise", 2)


def test_engine_config_defaults_survive_round_trip(tmp_path):
    config = EngineConfig(model="m", workers=parse_topology("encoder=1,denoise=1,decode=1", tmp_path),
                          router_endpoint="ipc:///x/router.sock", runtime_dir=str(tmp_path))
    config.save(tmp_path / "engine.json")
    loaded = EngineConfig.load(tmp_path / "engine.json")
    assert loaded == config and loaded.dtype is None and loaded.limits == Limits()


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.update(surprise=1),
        lambda d: d["workers"][0].update(gpus=2),
        lambda d: d["limits"].update(max_height="512"),
        lambda d: d["workers"][0].update(threads=True),
        lambda d: d.pop("model"),
    ],
    ids=["unknown-field", "unknown-worker-field", "wrong-type", "bool-threads", "missing-field"],
)
def test_engine_config_load_is_strict(tmp_path, mutate):
    config = EngineConfig(model="m", workers=parse_topology("encoder=1,denoise=1,decode=1", tmp_path),
                          router_endpoint="ipc:///x/router.sock", runtime_dir=str(tmp_path))
    path = tmp_path / "engine.json"
    config.save(path)
    data = json.loads(path.read_text())
    mutate(data)
    path.write_text(json.dumps(data))
    with pytest.raises(msgspec.ValidationError):
        EngineConfig.load(path)


# --- transports and hosts --------------------------------------------------------------------


def _fake_ports(start: int = 40000):
    """A deterministic port picker: 40000, 40001, ... per call, whatever the host."""
    ports = iter(range(start, start + 1000))
    seen = []

    def pick(host):
        seen.append(host)
        return next(ports)

    pick.seen = seen
    return pick


def test_tcp_endpoints_default_to_loopback(tmp_path, no_gpu):
    pick = _fake_ports()
    workers = parse_topology("encoder=1,denoise=2,decode=1", tmp_path, "tcp", pick)
    assert [w.endpoint for w in workers] == [f"tcp://127.0.0.1:{40000 + i}" for i in range(4)]
    assert [w.host for w in workers] == ["127.0.0.1"] * 4 and pick.seen == ["127.0.0.1"] * 4
    assert _layout(workers) == _layout(parse_topology("encoder=1,denoise=2,decode=1", tmp_path))


def test_tcp_ports_are_real_free_and_distinct(tmp_path, no_gpu):
    import socket

    pick = topology.port_picker()
    router = topology.router_endpoint(tmp_path, "tcp", pick_port=pick)
    workers = parse_topology("encoder=2,denoise=3,decode=2", tmp_path, "tcp", pick)
    endpoints = [router, *(w.endpoint for w in workers)]
    assert len(set(endpoints)) == 8
    for e in endpoints:
        host, port = e.removeprefix("tcp://").rsplit(":", 1)
        assert host == "127.0.0.1"
        with socket.socket() as s:  # nothing holds the port
            s.bind((host, int(port)))


def test_router_endpoint(tmp_path):
    assert topology.router_endpoint(tmp_path) == f"ipc://{tmp_path / 'router.sock'}"
    assert topology.router_endpoint(tmp_path, "tcp", pick_port=_fake_ports(5555)) == "tcp://127.0.0.1:5555"
    with pytest.raises(ValueError, match="unknown transport 'udp'"):
        topology.router_endpoint(tmp_path, "udp")


def test_file_hosts_describe_multi_host_layouts(tmp_path):
    path = tmp_path / "topo.yaml"
    path.write_text(
        "workers:\n"
        "  - {role: encoder, host: 10.0.0.1}\n"
        "  - {role: denoise, host: 10.0.0.2, device: cuda:0}\n"
        "  - {role: denoise, host: 10.0.0.2, device: cuda:1}\n"
        "  - {role: decode}\n"
    )
    pick = _fake_ports()
    workers = parse_topology(str(path), tmp_path, "tcp", pick)
    assert [(w.host, w.endpoint) for w in workers] == [
        ("10.0.0.1", "tcp://10.0.0.1:40000"),
        ("10.0.0.2", "tcp://10.0.0.2:40001"),
        ("10.0.0.2", "tcp://10.0.0.2:40002"),
        ("127.0.0.1", "tcp://127.0.0.1:40003"),
    ]
    assert pick.seen == ["10.0.0.1", "10.0.0.2", "10.0.0.2", "127.0.0.1"]  # each port picked on its own host
    # ipc sockets are files on one host: other hosts need tcp.
    with pytest.raises(ValueError, match=r"worker #0: host '10.0.0.1' needs --transport tcp"):
        parse_topology(str(path), tmp_path)


def test_loopback_hosts_work_with_ipc(tmp_path):
    path = tmp_path / "topo.json"
    path.write_text(json.dumps([{"role": "encoder", "host": "127.0.0.1"}, {"role": "denoise", "host": "localhost"},
                                {"role": "decode"}]))
    workers = parse_topology(str(path), tmp_path)
    assert [w.endpoint for w in workers] == [_endpoint(tmp_path, w.role, w.index) for w in workers]
    assert [w.host for w in workers] == ["127.0.0.1", "localhost", "127.0.0.1"]


@pytest.mark.parametrize(
    "host, needle",
    [
        ("0.0.0.0", "not a wildcard"),
        ("*", "bad host"),
        ("", "non-empty"),
        (5, "non-empty string"),
        ("::1", "only IPv4"),
        ("10.0.0.1:5555", "bad host"),
        ("tcp://10.0.0.1", "bad host"),
        ("a b", "bad host"),
        ("999.1.1.1", "bad host"),
    ],
)
def test_bad_hosts(tmp_path, host, needle):
    path = tmp_path / "topo.json"
    path.write_text(json.dumps([*GOOD, {"role": "denoise", "host": host}]))
    with pytest.raises(ValueError, match=rf"worker #3: .*{needle}"):
        parse_topology(str(path), tmp_path, "tcp", _fake_ports())


def test_unknown_transport(tmp_path):
    with pytest.raises(ValueError, match="unknown transport"):
        parse_topology("encoder=1,denoise=1,decode=1", tmp_path, "udp")


def test_tcp_config_round_trip_keeps_public_keys_only(tmp_path):
    pick = _fake_ports()
    config = EngineConfig(model="m", workers=parse_topology("encoder=1,denoise=1,decode=1", tmp_path, "tcp", pick),
                          router_endpoint=topology.router_endpoint(tmp_path, "tcp", pick_port=pick),
                          runtime_dir=str(tmp_path), transport="tcp", weight_roots=[str(tmp_path)],
                          curve_public={"router": "a" * 40}, curve_secret_files={"router": str(tmp_path / "r")})
    config.save(tmp_path / "engine.json")
    loaded = EngineConfig.load(tmp_path / "engine.json")
    assert loaded == config and loaded.router_endpoint == "tcp://127.0.0.1:40003"
    assert EngineConfig(model="m", workers=[], router_endpoint="", runtime_dir="").transport == "ipc"


def test_compact_multi_device_denoise_workers_take_their_share_of_gpus(tmp_path, monkeypatch):
    monkeypatch.setattr(topology, "_visible_devices", lambda: [f"cuda:{i}" for i in range(8)])
    workers = parse_topology("encoder=1,denoise=2:ulysses=2:cfg,decode=1", tmp_path)
    denoise = [w for w in workers if w.role == "denoise"]
    assert [w.devices for w in denoise] == [["cuda:1", "cuda:2", "cuda:3", "cuda:4"],
                                            ["cuda:5", "cuda:6", "cuda:7", "cuda:0"]]
    assert all(w.device == w.devices[0] and w.ulysses == 2 and w.cfg_parallel and w.ranks == 4 for w in denoise)
    assert [w.devices for w in workers if w.role != "denoise"] == [[], []]


def test_compact_multi_device_on_cpu(tmp_path, no_gpu):
    (w,) = [w for w in parse_topology("encoder=1,denoise=1:cfg,decode=1", tmp_path) if w.role == "denoise"]
    assert (w.devices, w.ulysses, w.cfg_parallel, w.ranks) == (["cpu", "cpu"], 1, True, 2)


def test_file_multi_device_worker_round_trips(tmp_path):
    path = tmp_path / "t.json"
    devices = ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]
    path.write_text(json.dumps({"workers": [{"role": "encoder"}, {"role": "decode"}, {
        "role": "denoise", "devices": devices, "ulysses": 2, "cfg_parallel": True}]}))
    (w,) = [w for w in parse_topology(str(path), tmp_path) if w.role == "denoise"]
    assert (w.device, w.devices, w.ulysses, w.cfg_parallel) == ("cuda:0", devices, 2, True)
    config = EngineConfig(model="m", workers=[w], router_endpoint="ipc:///x", runtime_dir=str(tmp_path))
    config.save(tmp_path / "c.json")
    assert EngineConfig.load(tmp_path / "c.json").workers[0] == w


@pytest.mark.parametrize("entry, needle", [
    ({"role": "denoise", "devices": ["cpu", "cpu", "cpu"], "ulysses": 2}, "3 devices for ulysses 2 x ring 1 x cfg 1"),
    ({"role": "denoise", "ring": 2}, "ring attention needs GPUs"),
    ({"role": "denoise", "ring": 0, "devices": ["cuda:0"]}, "ring must be an integer"),
    ({"role": "denoise", "ulysses": 2, "device": "cuda:0"}, "name them for GPUs"),
    ({"role": "denoise", "devices": ["cuda:0", "cuda:0"], "cfg_parallel": True}, "appears twice"),
    ({"role": "denoise", "devices": ["cpu", "cuda:1"], "cfg_parallel": True}, "all cpu or all cuda"),
    ({"role": "denoise", "devices": ["cuda:1", "cuda:2"], "device": "cuda:2", "cfg_parallel": True}, "devices[0]"),
    ({"role": "denoise", "ulysses": 0}, "ulysses must be an integer"),
    ({"role": "denoise", "ulysses": True}, "ulysses must be an integer"),
    ({"role": "denoise", "cfg_parallel": "yes"}, "cfg_parallel must be true or false"),
    ({"role": "encoder", "ulysses": 2}, "only a denoise worker may own several devices"),
])
def test_bad_multi_device_workers(tmp_path, entry, needle):
    path = tmp_path / "t.json"
    others = [{"role": r} for r in ("encoder", "denoise", "decode") if r != entry["role"]]
    path.write_text(json.dumps({"workers": [entry, *others]}))
    with pytest.raises(ValueError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        parse_topology(str(path), tmp_path)


@pytest.mark.parametrize("spec, needle", [
    ("encoder=1:cfg,denoise=1,decode=1", "only denoise workers take options"),
    ("encoder=1,denoise=1:ulysses=x,decode=1", "unknown option 'ulysses=x'"),
    ("encoder=1,denoise=1:rings=2,decode=1", "unknown option 'rings=2'"),
    ("encoder=1,denoise=1:ring=2,decode=1", "ring attention needs GPUs"),
])
def test_bad_compact_options(tmp_path, spec, needle, no_gpu):
    with pytest.raises(ValueError, match=needle):
        parse_topology(spec, tmp_path)
