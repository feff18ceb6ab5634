"""What the OpenAI-style API and MP4 / PNG encoding cost on top of ``/generate`` with tensor output, side by side.

    python bench/openai_overhead.py [--models tiny small] [--repeats 7] [--json PATH]

Per model, one engine; the same request (the model's default size and frames, its serving steps, one seed)
by each path, interleaved, repeats times, after one untimed warm-up each:

- ``tensor``: ``POST /generate``, msgpack output (the float frames as raw bytes);
- ``mp4``: ``POST /generate`` with ``output_type: "mp4"`` (the router encodes H.264);
- ``video job``: the official ``openai`` client's ``videos.create_and_poll`` (50 ms polls) then
  ``download_content``: the same MP4 through a job;
- ``image tensor`` / ``png`` / ``images API``: the one-frame request as tensor, as ``output_type: "png"`` and
  through ``images.generate``.

Prints the median seconds per path and its ratio to the tensor path of the same shape.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import httpx
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.runtime.engine_process import EngineProcess  # noqa: E402
from common.diffusion.model_info import ModelInfo  # noqa: E402
from common.families import read_model  # noqa: E402
from common.builtin import ensure_builtin  # noqa: E402

warnings.simplefilter("ignore", DeprecationWarning)  # the client marks OpenAI's video API deprecated
MSGPACK = {"Accept": "application/msgpack"}


def paths(http: httpx.Client, oa: openai.OpenAI, d: dict) -> dict:
    """Each path as a function of the seed; each returns the bytes it got (checked non-empty)."""
    size = f"{d['width']}x{d['height']}"
    video = dict(prompt="a red fox running through snow", height=d["height"], width=d["width"],
                 num_frames=d["num_frames"])
    image = {**video, "num_frames": 1}
    seconds = f"{(d['num_frames'] - 1) / 16:g}"

    def post(body, headers=None):
        r = http.post("/generate", json=body, headers=headers)
        r.raise_for_status()
        return r.content

    def job(seed):
        v = oa.videos.create_and_poll(prompt=video["prompt"], size=size, seconds=seconds, poll_interval_ms=50,
                                      extra_body={"seed": seed})
        assert v.status == "completed", v.error
        return oa.videos.download_content(v.id).read()

    def images(seed):
        r = oa.images.generate(prompt=image["prompt"], size=size, response_format="b64_json",
                               extra_body={"seed": seed})
        return r.data[0].b64_json.encode()

    return {
        "tensor": lambda s: post({**video, "seed": s}, MSGPACK),
        "mp4": lambda s: post({**video, "seed": s, "output_type": "mp4"}),
        "video job": job,
        "image tensor": lambda s: post({**image, "seed": s}, MSGPACK),
        "png": lambda s: post({**image, "seed": s, "output_type": "png"}),
        "images API": images,
    }


BASELINE = {"tensor": "tensor", "mp4": "tensor", "video job": "tensor", "image tensor": "image tensor",
            "png": "image tensor", "images API": "image tensor"}


def bench_model(name: str, repeats: int) -> dict:
    model_dir = ensure_builtin(name)
    d = read_model(model_dir).defaults
    with EngineProcess(name, "encoder=1,denoise=1,decode=1", ready_timeout_s=600) as eng, \
            openai.OpenAI(base_url=eng.url + "/v1", api_key="unused", max_retries=0) as oa:
        runs = paths(eng.http, oa, d)
        for fn in runs.values():
            assert fn(0)  # warm-up
        seconds: dict[str, list[float]] = {p: [] for p in runs}
        for r in range(repeats):
            for p, fn in runs.items():
                t0 = time.perf_counter()
                assert fn(1 + r)
                seconds[p].append(time.perf_counter() - t0)
    med = {p: statistics.median(v) for p, v in seconds.items()}
    return {"model": name, "size": f"{d['width']}x{d['height']}", "frames": d["num_frames"],
            "steps": d["num_inference_steps"], "repeats": repeats, "median_s": med,
            "ratio": {p: med[p] / med[BASELINE[p]] for p in med}, "raw": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "small"])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    results = [bench_model(m, args.repeats) for m in args.models]
    print(f"\n{'model':<8} {'request':<22} " + " ".join(f"{p:>13}" for p in results[0]["median_s"]))
    for r in results:
        req = f"{r['size']}, {r['frames']} fr, {r['steps']} st"
        print(f"{r['model']:<8} {req:<22} " + " ".join(f"{s:>12.3f}s" for s in r["median_s"].values()))
        print(f"{'':<8} {'vs tensor':<22} " + " ".join(f"{x:>12.2f}x" for x in r["ratio"].values()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
