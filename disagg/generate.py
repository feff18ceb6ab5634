"""``disagg generate "a fox at dawn" -o fox.mp4``: one video (or image) from a running engine or one of its own.

The engine writes the file: ``/generate`` with ``output_type`` ``mp4`` (its model's frame rate; with its
sound where the model makes sound), ``png`` (``round(255 x)`` of the one frame) or ``wav`` (the sound alone), so these bytes are what ``/generate`` answers for the same fields. A
``.png`` asks for one frame (``num_frames`` 1), which every family takes: a video model's PNG is the
one-frame video it makes, not the first frame of a longer one. Flags left out are not sent, so the model's
serving defaults apply.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import httpx

from disagg.progress import StepBar

KINDS = {".png": "png", ".mp4": "mp4", ".wav": "wav"}  # .wav: the sound of a model that makes it
API_KEY_ENV = "DISAGG_API_KEY"  # the variable the engine reads its key from (router/api/auth.py)
# Each flag and the /generate field it sets; a flag left out (None) is not sent.
FIELDS = {"negative_prompt": "negative_prompt", "seed": "seed", "steps": "num_inference_steps",
          "frames": "num_frames", "guidance": "guidance_scale", "lora": "lora_name", "lora_scale": "lora_scale"}


class Failed(Exception):
    """A failure to report in one line (the engine's message, or why it could not be reached)."""


def size(value: str) -> tuple[int, int]:
    width, sep, height = value.lower().partition("x")
    if not (sep and width.isdigit() and height.isdigit()):
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT such as 832x480, got {value!r}")
    return int(width), int(height)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="make one video (.mp4) or image (.png)",
                       description="Make one video or image: with a running engine (--url), or an engine started "
                                   "for the request and stopped after it.", epilog="Flags left out take the model's defaults.")
    p.add_argument("prompt")
    p.add_argument("-o", "--output", required=True, type=Path, help="the file to write: .mp4 or .png (.wav: "
                   "the sound alone, models with sound; their .mp4 has it too)")
    p.add_argument("--model", help="the model of the engine started for the request (default: tiny); "
                                   "not with --url, whose engine serves its own")
    p.add_argument("--url", help="a running engine (e.g. http://127.0.0.1:8000); its API key from $" + API_KEY_ENV)
    p.add_argument("--seed", type=int)
    p.add_argument("--steps", type=int, help="denoising steps")
    p.add_argument("--size", type=size, metavar="WxH")
    p.add_argument("--frames", type=int, help="video models: the frame count (.mp4, .wav)")
    p.add_argument("--negative-prompt")
    p.add_argument("--guidance", type=float, help="guidance scale")
    p.add_argument("--image", type=Path, action="append", help="image-to-video models: the first frame (a PNG, "
                   "JPEG or WEBP); edit models: the image to edit (again for each of several, in order)")
    p.add_argument("--lora", help="a loaded LoRA adapter's name")
    p.add_argument("--lora-scale", type=float)
    p.add_argument("-v", "--verbose", action="store_true", help="say which engine and processes serve it")
    p.set_defaults(run=run, parser=p)


def request_fields(args: argparse.Namespace, kind: str) -> dict:
    """The /generate body; a mistake the engine need not see (a missing image file) is a usage error."""
    fields: dict = {"prompt": args.prompt, "output_type": kind}
    fields.update({field: getattr(args, flag) for flag, field in FIELDS.items() if getattr(args, flag) is not None})
    if args.size is not None:
        fields["width"], fields["height"] = args.size
    if kind == "png":
        if fields.get("num_frames", 1) != 1:
            args.parser.error("a .png holds one frame: leave out --frames, or write a .mp4")
        fields["num_frames"] = 1
    images = []
    for path in args.image or ():
        try:
            images.append(base64.b64encode(path.read_bytes()).decode("ascii"))
        except OSError as e:
            args.parser.error(f"--image: {e.strerror}: {path}")
    if images:  # one --image is the one image; several are a list (models that take several)
        fields["image"] = images[0] if len(images) == 1 else images
    return fields


def checked_kind(args: argparse.Namespace) -> str:
    """png, mp4 or wav, from -o; anything else ends the command before an engine is started."""
    kind = KINDS.get(args.output.suffix.lower())
    if kind is None:
        args.parser.error(f"-o must end in .mp4, .png or .wav, got {args.output.name!r}")
    if not args.output.parent.is_dir():
        args.parser.error(f"-o: no directory {args.output.parent}")
    if args.url is not None and args.model is not None:
        args.parser.error("--model chooses the engine started without --url; the engine at --url serves its own")
    return kind


def engine_message(r: httpx.Response) -> str:
    """The error's message from the engine's one error shape ({"error": {"message": ...}})."""
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {r.status_code}: {r.text[:200]}"


def request(url: str, fields: dict, headers: dict[str, str]) -> tuple[bytes, str]:
    """POST /generate under an id of ours while a bar follows its steps; (the file, the seed it used)."""
    request_id = uuid.uuid4().hex
    headers = {**headers, "X-Request-Id": request_id}
    with httpx.Client(base_url=url, headers=headers, timeout=httpx.Timeout(10.0, read=None)) as http:
        try:
            steps = fields.get("num_inference_steps") or default_steps(http)
        except httpx.ConnectError as e:
            raise Failed(f"cannot reach {url}: {e}") from None
        with StepBar(url, headers, request_id, steps) as bar:
            r = post(http, url, fields)
            bar.finish()
    return r.content, r.headers["x-seed"]


def default_steps(http: httpx.Client) -> int | None:
    """The served model's default step count (GET /v1/models), so that the bar has its total from the first
    step; None where the engine does not say (the bar learns it from the progress it reports)."""
    r = http.get("/v1/models")
    try:
        return int(r.json()["data"][0]["defaults"]["num_inference_steps"]) if r.status_code == 200 else None
    except (ValueError, KeyError, IndexError, TypeError):
        return None


def post(http: httpx.Client, url: str, fields: dict) -> httpx.Response:
    """POST /generate; an answer other than 200, or none, is a failure in one line."""
    try:
        r = http.post("/generate", json=fields)
    except httpx.ConnectError as e:
        raise Failed(f"cannot reach {url}: {e}") from None
    except httpx.TransportError as e:  # the engine went away mid-request
        raise Failed(f"lost {url}: {type(e).__name__}: {e}") from None
    if r.status_code != 200:
        raise Failed(engine_message(r))
    return r


def run(args: argparse.Namespace) -> int:
    kind = checked_kind(args)
    fields = request_fields(args, kind)
    key = os.environ.get(API_KEY_ENV)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with ExitStack() as stack:
            url = args.url.rstrip("/") if args.url else start_engine(stack, model_argument(args.model or "tiny"),
                                                                       args.verbose)
            t0 = time.perf_counter()
            data, seed = request(url, fields, headers)
            elapsed = time.perf_counter() - t0
        args.output.write_bytes(data)
    except (Failed, OSError) as e:  # OSError: the file could not be written
        print(f"disagg generate: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # the engine (if ours) is stopped by now: the ExitStack closed it
        print("disagg generate: interrupted", file=sys.stderr)
        return 130
    print(f"saved {args.output} (seed {seed}) in {elapsed:.1f} s")
    return 0


def model_argument(model: str) -> str:
    """``--model`` as the engine must read it: a path (anything but a built-in name) made absolute against
    where the command runs, since the engine runs in the repository's directory."""
    path = Path(model).expanduser()
    return str(path.resolve()) if "/" in model or model.startswith((".", "~")) or path.exists() else model


def start_engine(stack: ExitStack, model: str, verbose: bool) -> str:
    """Start an engine for this request (stopped when ``stack`` closes); its URL."""
    from disagg.embedded import embedded_engine

    print(f"starting an engine for {model} ...", file=sys.stderr)
    t0 = time.perf_counter()
    try:
        engine = stack.enter_context(embedded_engine(model))
    except (RuntimeError, TimeoutError) as e:
        raise Failed(f"the engine did not start: {e}") from None
    print(f"engine ready in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    if verbose:
        print(f"engine at {engine.url}, launcher pid {engine.proc.pid}, worker pids "
              f"{' '.join(map(str, engine.worker_pids()))}", file=sys.stderr)
    return engine.url
