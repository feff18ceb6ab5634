"""launch.py's front door: a port it cannot bind fails at once in one clear line; a stop is logged, and is
no crash."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from common.builtin import BUILTINS
from common.runtime.engine_process import EngineProcess
from conftest import ROOT, pid_alive


def _launch(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    return r, time.monotonic() - t0


def _fails_before_loading_anything(r: subprocess.CompletedProcess, elapsed: float, runtime, message: str) -> None:
    assert r.returncode != 0
    assert r.stderr.splitlines() == [message]  # no traceback, no "loading model" or "starting N workers" line
    assert r.stdout == ""
    assert not runtime.exists()  # no config written: no worker could have started
    # Exiting costs no more than starting Python and importing torch (about 2 s on an idle machine; a
    # busy one is slower); an engine that loaded first took ~18 s before the port error.
    _, startup = _launch("--help")
    assert elapsed < max(5.0, startup + 2.0), (elapsed, startup)


@pytest.mark.heavy  # a launcher beside a listening socket: CI
def test_a_taken_port_fails_at_once_naming_the_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r, elapsed = _launch("--port", str(port), "--runtime-dir", str(tmp_path / "rt"))
    _fails_before_loading_anything(
        r, elapsed, tmp_path / "rt",
        f"launch.py: error: port {port} on 127.0.0.1 is already in use; pick another with --port N")


@pytest.mark.heavy  # a bind failure: the taken port test is the default
def test_an_address_of_another_host_fails_at_once(tmp_path):
    # 192.0.2.1 (TEST-NET-1) is no address of this machine: binding it fails with EADDRNOTAVAIL.
    r, elapsed = _launch("--host", "192.0.2.1", "--port", "8000", "--runtime-dir", str(tmp_path / "rt"))
    _fails_before_loading_anything(
        r, elapsed, tmp_path / "rt",
        "launch.py: error: cannot listen on 192.0.2.1:8000 (Cannot assign requested address); "
        "choose another --host or --port")


@pytest.mark.parametrize("model, why", [
    ("tiny-wan", "{path} does not exist; did you mean "),  # a typo of a built-in name
    # a launcher start each (~8 s): the typo is the default case
    pytest.param("/nonexistent/dir", "{path} does not exist (built-in models: ", marks=pytest.mark.heavy),
    pytest.param(".", "{path} has no model_index.json (not a diffusers model directory) (built-in models: ",
                 marks=pytest.mark.heavy),
])
def test_an_unknown_model_lists_the_built_in_names_and_whether_the_path_exists(tmp_path, model, why):
    r, elapsed = _launch("--model", model, "--port", "0", "--runtime-dir", str(tmp_path / "rt"))
    [line] = r.stderr.splitlines()
    path = (ROOT / model).resolve()
    assert line.startswith(f"launch.py: error: --model {model}: not a built-in model, and "
                           + why.format(path=path)), line
    assert line.endswith(f"(built-in models: {', '.join(BUILTINS)})")
    if "did you mean" in why:  # the closest names, the one meant among them
        assert "tiny-wan-i2v" in line.split("did you mean ")[1].split("?")[0].split(" or "), line
    assert r.returncode != 0 and not (tmp_path / "rt").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.heavy)],
                         ids=["sigterm", "sigint"])  # a container's stop; a terminal's Ctrl-C (the same handlers)
def test_start_is_announced_and_a_stop_of_the_process_group_is_no_crash(tmp_path, sig):
    """The signal reaches the launcher and every worker at once: the workers exit 0 while the launcher drains.
    Neither is a crash (no ERROR, no restart): the request in flight is answered 503 shutting_down at once,
    the launcher exits 0 within seconds, every worker is gone."""
    eng = EngineProcess("tiny", workdir=tmp_path)
    answers = []
    try:
        pids = eng.worker_pids()
        body = {"prompt": "a long one", "height": 128, "width": 128, "num_frames": 9, "num_inference_steps": 400,
                "output_type": "latent"}
        post = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{eng.url}/generate", json=body, headers={"X-Request-Id": "long"}, timeout=120)))
        post.start()
        deadline = time.monotonic() + 60
        while (r := eng.http.get("/progress/long")).status_code != 200 or r.json()["step"] < 1:
            assert time.monotonic() < deadline, "the request never reached the denoise worker"
            time.sleep(0.05)
        t0 = time.monotonic()
        os.killpg(eng.proc.pid, sig)  # the launcher and every worker
        assert eng.proc.wait(timeout=60) == 0
        stopped_s = time.monotonic() - t0
        post.join(timeout=60)
    finally:
        eng.stop()
    lines = eng.log_text().splitlines()

    def first(text: str) -> int:
        return next(i for i, line in enumerate(lines) if text in line)

    assert "launch INFO loading model tiny (built in; the first run generates it into" in lines[first("loading model")]
    starting = first("launch INFO starting 3 workers (encoder=1, denoise=1, decode=1); "
                     f"http://127.0.0.1:{eng.port} answers once each has loaded the model")
    assert first("loading model") < starting < first("ready on")  # said before the (possibly long) loading
    assert lines[-1].endswith("launch INFO stopped: all workers exited")
    assert not [line for line in lines if " ERROR " in line or "restart" in line], eng.log()
    assert stopped_s < 10, stopped_s  # measured ~0.3 s; a restarted worker would load first
    [answer] = answers
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "shutting_down", answer.text
    assert not [p for p in pids if pid_alive(p)]


def test_no_torchvision_warnings_from_the_families_pipelines_nor_bars_from_a_first_build(tmp_path):
    """Without torchvision, transformers warned at every image family's start (diffusers' pipeline modules
    import CLIP's and SigLIP's image processors); the engine binds the PIL processors the fallback would use.
    A built-in model's first build printed transformers' "Writing model shards" bars."""
    code = ("import common.families, importlib.util, transformers, sys\n"
            "from common.builtin import ensure_builtin\n"
            f"ensure_builtin('tiny-sd3', {str(tmp_path)!r})\n"
            "from diffusers import StableDiffusion3Pipeline, FluxPipeline, QwenImagePipeline, WanImageToVideoPipeline\n"
            "from transformers import CLIPImageProcessor, SiglipImageProcessor\n"
            "print(importlib.util.find_spec('torchvision') is None, CLIPImageProcessor.__name__, "
            "SiglipImageProcessor.__name__)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    if r.stdout.split()[0] == "True":  # the case the engine handles: the PIL twins, as transformers' fallback
        assert r.stdout.split()[1:] == ["CLIPImageProcessorPil", "SiglipImageProcessorPil"]
    assert "torchvision" not in r.stderr and "Writing model shards" not in r.stderr, r.stderr
    assert any(tmp_path.iterdir())  # it did build
