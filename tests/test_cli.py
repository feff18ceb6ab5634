"""The ``disagg`` command, run as a real subprocess, and ``GET /progress/{id}`` that draws its progress bar.

One engine with an API key serves the ``--url`` runs: a PNG is ``/generate``'s ``round(255 x)`` exactly, an
MP4 decodes to the requested frames within H.264's loss; failures exit non-zero with the engine's message and
no traceback. The run without ``--url`` starts its own engine and leaves no process behind.
"""

from __future__ import annotations

import io
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from common.protocol.http_tensors import body_to_tensor
from common.runtime.engine_process import free_port
from router.api.auth import API_KEY_ENV
from router.core.errors import EngineError
from router.link.join import Pending, PendingTable
from router.api.media import decode_mp4, to_uint8
from router.core.progress import InFlight

from conftest import ROOT, SHARED_API_KEY as API_KEY, pid_alive

AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "a fox at dawn"
# The same request as flags and as /generate fields.
FLAGS = ["--seed", "3", "--steps", "2", "--size", "48x32", "--negative-prompt", "blurry", "--guidance", "4"]
FIELDS = dict(prompt=PROMPT, seed=3, num_inference_steps=2, width=48, height=32, negative_prompt="blurry",
              guidance_scale=4.0)
LUMA = torch.tensor([0.299, 0.587, 0.114])


def disagg(*args: str, key: str | None = API_KEY, timeout: float = 180, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``python -m disagg ARGS`` (the installed command's module) in ``cwd``, with ``key`` as $DISAGG_API_KEY."""
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    if key is not None:
        env[API_KEY_ENV] = key
    return subprocess.run([sys.executable, "-m", "disagg", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)


def saved_seed(run: subprocess.CompletedProcess) -> int:
    assert run.returncode == 0, run.stderr
    return int(re.search(r"\(seed (\d+)\) in [\d.]+ s$", run.stdout.strip()).group(1))


def failed_with(run: subprocess.CompletedProcess, message: str) -> None:
    assert run.returncode != 0 and message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr + run.stdout


@pytest.fixture(scope="module")
def engine(keyed_engine):
    return keyed_engine


def _frames(engine, **fields) -> torch.Tensor:
    """``/generate``'s float frames [F, H, W, 3] for the same fields."""
    r = engine.http.post("/generate", json={**FIELDS, **fields}, headers=AUTH)
    assert r.status_code == 200, r.text
    return body_to_tensor(r.json()["samples"][0]["output"])


def test_help_lists_the_subcommands():
    script = Path(sys.executable).parent / "disagg"  # the console script, once the package is installed
    for command in ([sys.executable, "-m", "disagg"], *([[str(script)]] if script.exists() else [])):
        out = subprocess.run([*command, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "serve" in out.stdout and "generate" in out.stdout, out.stderr
    serve = disagg("serve", "--help")  # launch.py's own flags, under the name that was typed
    assert serve.returncode == 0 and "usage: disagg serve" in serve.stdout and "--topology" in serve.stdout


def test_png_is_the_pixels_of_generate(engine, tmp_path):
    out = tmp_path / "fox.png"
    run = disagg("generate", PROMPT, "-o", str(out), "--url", engine.url, *FLAGS)
    assert saved_seed(run) == 3 and str(out) in run.stdout
    png = np.array(Image.open(io.BytesIO(out.read_bytes())))
    assert np.array_equal(png, to_uint8(_frames(engine, num_frames=1))[0])  # round(255 x), byte for byte


def test_mp4_decodes_to_the_requested_frames(engine, tmp_path):
    out = tmp_path / "fox.mp4"
    run = disagg("generate", PROMPT, "-o", str(out), "--url", engine.url, *FLAGS, "--frames", "9")
    assert saved_seed(run) == 3
    frames = torch.from_numpy(decode_mp4(out.read_bytes())).float() / 255
    ref = _frames(engine, num_frames=9)
    assert frames.shape == ref.shape == (9, 32, 48, 3)
    mse = ((frames @ LUMA - ref @ LUMA) ** 2).mean().item()  # luma: yuv420p halves chroma (docs/api.md)
    assert 10 * math.log10(1 / mse) >= 30


def test_a_seed_left_out_is_the_engines_and_reported(engine, tmp_path):
    out = tmp_path / "default.png"
    seed = saved_seed(disagg("generate", PROMPT, "-o", str(out), "--url", engine.url, "--steps", "2"))
    r = engine.http.post("/generate", json={"prompt": PROMPT, "num_inference_steps": 2, "num_frames": 1,
                                            "seed": seed, "output_type": "png"}, headers=AUTH)
    assert r.content == out.read_bytes()


def test_the_bar_has_its_total_from_the_first_step(engine, tmp_path):
    """No --steps: the bar's total is the model's default step count (from GET /v1/models) before the
    engine reports any progress, and it ends full."""
    steps = engine.http.get("/v1/models", headers=AUTH).json()["data"][0]["defaults"]["num_inference_steps"]
    run = disagg("generate", PROMPT, "-o", str(tmp_path / "bar.png"), "--url", engine.url)
    assert run.returncode == 0, run.stderr
    bars = [b for b in re.split(r"[\r\n]", run.stderr) if "step" in b]
    assert f" 0/{steps} " in bars[0] and f" {steps}/{steps} " in bars[-1], bars


def test_failures_exit_with_the_message_and_no_traceback(engine, tmp_path):
    out = tmp_path / "x.png"
    failed_with(disagg("generate", PROMPT, "-o", str(out), "--url", engine.url, "--size", "48x7"),
                "height: must be a positive multiple of 16")
    failed_with(disagg("generate", PROMPT, "-o", str(out), "--url", engine.url, key=None),
                "missing or invalid API key")  # the 401's message
    failed_with(disagg("generate", PROMPT, "-o", str(out), "--url", f"http://127.0.0.1:{free_port()}"),
                "cannot reach")
    failed_with(disagg("generate", PROMPT, "-o", str(tmp_path / "x.wav"), "--url", engine.url),
                "output_type: wav holds a model's sound")  # a model without sound
    # Refused before any engine starts (argparse's usage errors, exit code 2).
    failed_with(disagg("generate", PROMPT, "-o", str(tmp_path / "x.gif")), "-o must end in .mp4, .png or .wav")
    failed_with(disagg("generate", PROMPT, "-o", str(out), "--frames", "5"), "a .png holds one frame")
    failed_with(disagg("generate", PROMPT, "-o", str(out), "--size", "big"), "expected WIDTHxHEIGHT")
    assert not out.exists()


def test_progress_follows_the_denoising_steps(engine):
    rid, seen, answer = f"progress-{uuid.uuid4().hex[:8]}", [], {}
    # The denoise worker reports a request's step every 0.5 s: a few seconds of steps show it moving (1000
    # steps of 64x64x5: several seconds even on a fast machine).
    body = {"prompt": PROMPT, "num_inference_steps": 1000, "width": 64, "height": 64, "num_frames": 5,
            "output_type": "latent"}
    post = threading.Thread(target=lambda: answer.update(r=engine.http.post(
        "/generate", json=body, headers={**AUTH, "X-Request-Id": rid})))
    post.start()
    while post.is_alive():
        r = engine.http.get(f"/progress/{rid}", headers=AUTH)
        if r.status_code == 200:
            state = r.json()
            assert state["id"] == rid and state["object"] == "request.progress"
            seen.append(state)
        time.sleep(0.02)
    post.join()
    assert answer["r"].status_code == 200 and answer["r"].json()["request_id"] == rid
    steps = [s["step"] for s in seen if s["stage"] == "denoise"]
    assert len(set(steps) - {0}) >= 2 and steps == sorted(steps), steps  # it moves, forwards only
    assert {s["steps"] for s in seen if s["stage"] == "denoise" and s["step"]} == {1000}
    percents = [s["progress"] for s in seen]
    assert percents == sorted(percents) and percents[-1] < 100
    gone = engine.http.get(f"/progress/{rid}", headers=AUTH)  # answered: no longer in flight
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "not_found"
    assert engine.http.get(f"/progress/{rid}").status_code == 401  # the API key, like everything else


def test_an_id_in_flight_is_refused_with_its_retries():
    """Run ``k`` of request ``a`` has wire id ``a.k`` (router/link/attempts.py): ``a`` and ``a.2`` may not overlap."""
    table = PendingTable()
    in_flight = InFlight(table, max_attempts=3)
    with in_flight.claim("a"):
        assert in_flight.state("a") == {"stage": "encode", "step": 0, "steps": None, "progress": 0}
        for taken in ("a", "a.2", "a.3"):
            with pytest.raises(EngineError) as e, in_flight.claim(taken):
                pass
            assert (e.value.status, e.value.type) == (409, "request_id_in_use")
        with in_flight.claim("a.4"), in_flight.claim("b"):  # a's third run is a.3: a.4 is free
            pass
        table.add("a.2", Pending(None, None, done_stage=0, step=3, steps=10, client_id="a"))  # its second run
        assert in_flight.state("a") == {"stage": "denoise", "step": 3, "steps": 10, "progress": 5 + 85 * 3 // 10}
    assert in_flight.state("b") is None
    with pytest.raises(EngineError):  # a run in flight under another client's id (a video job's) is taken too
        with in_flight.claim("a"):
            pass


@pytest.mark.parametrize("value", ["", "a" * 65, "a b", "ab/c", "é"])
def test_a_bad_request_id_is_a_400_naming_the_header(engine, value):
    r = engine.http.post("/generate", json=FIELDS, headers={**AUTH, "X-Request-Id": value.encode("utf-8")})
    assert r.status_code == 400 and r.json()["error"]["field"] == "X-Request-Id"


def _pids(run_stderr: str) -> list[int]:
    m = re.search(r"launcher pid (\d+), worker pids ([\d ]+)", run_stderr)
    assert m, run_stderr
    return [int(m.group(1)), *map(int, m.group(2).split())]


@pytest.mark.heavy  # the command's own launched engine and its processes: CI
def test_without_url_an_engine_of_its_own_leaves_no_process(tmp_path, tiny_dir):
    """Run from another directory: ``--model ./mymodel`` and ``-o`` are paths relative to it."""
    (tmp_path / "mymodel").symlink_to(tiny_dir)
    run = disagg("generate", PROMPT, "-o", "own.png", "--model", "./mymodel", "--steps", "2", "--seed", "5", "-v",
                 key=None, cwd=tmp_path)
    assert saved_seed(run) == 5
    assert Image.open(tmp_path / "own.png").size == (32, 32)  # tiny's default size, one frame
    pids = _pids(run.stderr)
    assert len(pids) == 4 and not [p for p in pids if pid_alive(p)], "processes outlived the command"


@pytest.mark.heavy
def test_ctrl_c_stops_its_engine(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    proc = subprocess.Popen([sys.executable, "-m", "disagg", "generate", PROMPT, "-o", str(tmp_path / "x.mp4"),
                             "--steps", "1000", "--size", "64x64", "--frames", "9", "-v"],
                            cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
                            # A test run started in the background ignores SIGINT, and so would the command.
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stderr:  # wait until the engine is up, then interrupt the request in flight
        lines.append(line)
        if "worker pids" in line:
            break
    pids = _pids("".join(lines))
    time.sleep(1.0)
    proc.send_signal(signal.SIGINT)
    rest = proc.communicate(timeout=120)[1]
    assert proc.returncode == 130 and "Traceback" not in rest, rest
    assert not [p for p in pids if pid_alive(p)] and not (tmp_path / "x.mp4").exists()
