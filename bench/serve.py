"""Serving benchmark: throughput and latency under load, next to the model's diffusers pipeline run in-process.

    python bench/serve.py                                   # preset tiny: concurrency 1..32, 64 requests each
    python bench/serve.py --preset small                    # single-request latency of the ~17M model
    python bench/serve.py --preset wan-1.3b                 # Wan2.1-1.3B-shaped model, bf16 on a GPU (bench/gpu.sh)
    python bench/serve.py --preset small-sd3                # SD3: the ~19.5M transformer, 256x256, c=1 and 16
    python bench/serve.py --preset small-flux               # FLUX (embedded guidance); small-qwen-image (true CFG)
    python bench/serve.py --preset small-flux2-klein        # FLUX.2 [klein], step-distilled: no CFG, no negative
    python bench/serve.py --preset small-wan-i2v            # Wan2.1 I2V-like: requests with an image, c=1 and 4
    python bench/serve.py --preset tiny-wan-i2v --images 8  # image to video, many small requests, 8 distinct images
    python bench/serve.py --preset small-qwen-image-edit    # image editing (also small-flux-kontext): a picture each
    python bench/serve.py --model tiny-qwen-image-edit-plus --pictures 2  # two pictures per request, as a list
    python bench/serve.py --preset small-ltx2               # LTX-2 (video with sound), CFG + STG + modality
    python bench/serve.py --preset small-z-image            # Z-Image-Turbo's setting: 8 steps, no guidance
    python bench/serve.py --preset small-hunyuan-video15    # HunyuanVideo 1.5, CFG through the model's guider
    python bench/serve.py --concurrency 1 4 --requests 32 --output-type latent
    python bench/serve.py --rate 5 --duration 20            # open loop: Poisson arrivals at 5 req/s
    python bench/serve.py --url http://127.0.0.1:8000       # a running engine instead of starting one
    python bench/serve.py --topology encoder=1,denoise=2,decode=1 --extra='--dtype float32'
    python bench/serve.py --json bench/results/serve-tiny.json --png bench/results/serve-tiny.png

What it does, in this order:

1. Starts an engine (``--model``, ``--topology``, ``--extra`` passed to launch.py, and ``--dtype``) on a free
   loopback port, or uses ``--url``. The model directory comes from the engine's ``/health``. The workers'
   devices come from the topology: the compact form puts them on the visible GPUs, else on the CPU.
2. Builds a fixed request mix, deterministic from ``--seed``: request ``i`` has a prompt from a small list
   and seed ``--seed * 1_000_000 + i`` (all distinct), the same size / steps / guidance for all (by default the
   model's default size, ``--steps`` from the preset, CFG on with guidance 5.0 (SD3 presets: 4.5),
   ``--output-type frames``; a preset's ``fields``, e.g. LTX-2's audio guidance, go to every request and to
   the pipeline alike). Image families (SD3) are sent no ``num_frames``: they answer one frame.
   Image-to-video and edit models (those that require an ``image``: ``WanImageToVideoPipeline``,
   ``QwenImageEditPipeline``; ``FluxKontextPipeline``, which takes one optionally, when the preset or
   ``--images`` asks) get a picture too: ``--images`` distinct seeded synthetic RGB pictures of 96x160
   (another size and aspect than the output's, so the resize and CLIP's crop run), request ``i`` taking
   picture ``i mod --images``, sent as base64 PNG; the warm-up requests have pictures of their own.
   ``--pictures K`` > 1 (Qwen-Image-Edit-Plus) sends K pictures per request as a list, the second on a
   160x96. The first request with a picture makes the encoder worker encode it; later ones are answered
   from its cache.
3. Sends ``--warmup`` requests (not counted), then, per load level, the first ``--requests`` requests of the mix:
   - ``--concurrency N ...``: closed loop, N requests in flight at all times;
   - ``--rate R ...``: open loop, Poisson arrivals at R req/s for ``--duration`` seconds (or ``--requests``
     arrivals); latency counts from the scheduled arrival, so a backlog shows up as latency.
   Per level: throughput (req/s, samples/s), latency p50/p90/p99, mean per-stage time from each response's
   ``timings`` (encode_s, denoise_s, decode_s; total_s is the router's wall time for the request), errors.
   With images, the encoder's ``image_encode_s`` (the image side: CLIP and VAE encoding of the picture for
   image to video, the VAE encoding of the references for edits; apart from the text's encode_s, which for
   Qwen-Image-Edit includes the VL encoder's look at the picture): median and p90 over the requests whose picture was new to the engine, and the most any repeat of
   a picture took (its cache lookup).
4. While the engine sits idle, runs the same requests (same prompts, seeds, sizes, steps, guidance) through
   the served family's diffusers pipeline (``WanPipeline``, ``StableDiffusion3Pipeline``,
   ``WanImageToVideoPipeline``, ``QwenImageEditPipeline``, ``FluxKontextPipeline`` given the same PIL
   picture(s) as ``image``: the binding's ``pipeline``) loaded in this process from the same directory in
   ``--dtype`` on ``--device`` (the Qwen edit pipelines get the engine's processor loader's ``processor``,
   common/families/qwen_image/processor.py, as transformers' own does not load without torchvision),
   one after another, with ``torch.set_num_threads(os.cpu_count())``: all cores for the one in-process
   pipeline, the fair sequential baseline on a CPU (the engine's workers share the same cores between them).
   One untimed warm-up call first; on a GPU each request's time ends with a device synchronisation.
   Reports its throughput and per-request latency, and per load level the ratios engine / diffusers
   (throughput, and p50 latency).
5. Correctness: for the first ``--check`` requests, the max abs difference between the engine's output at
   every load level and diffusers' output ([F, H, W, 3] frames, one frame for images, against the
   pipeline's ``np`` output; or latents) (expected <= ``--tolerance``: 1e-4 in float32, batched or not;
   the bfloat16 preset wan-1.3b and small-wan-i2v, whose batched frames go through the VAE, set looser ones,
   see PRESETS). A model with sound (LTX-2) whose answers carry ``audio`` has its waveform checked the same
   way against the pipeline's ``audio``.

Prints a table; ``--json`` writes every number, ``--png`` a chart (throughput and p50/p99 latency against
concurrency or offered rate, diffusers' sequential figures as horizontal lines).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import random
import shlex
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.runtime.engine_process import EngineProcess  # noqa: E402
from common.protocol.http_tensors import body_to_tensor  # noqa: E402
from common.diffusion.model_info import ModelInfo  # noqa: E402
from common.families import read_model  # noqa: E402
from router.client import image_field  # noqa: E402

MSGPACK = "application/msgpack"

PROMPTS = [
    "a red fox runs through the snow at dawn",
    "an astronaut floats above the ocean, cinematic lighting",
    "a lonely lighthouse in a storm, aerial view",
    "a golden retriever jumps into a lake in summer",
    "a paper boat drifts down a rainy street",
    "a dragon sleeps on a mountain under the stars",
    "a train crosses the desert at sunset, slow motion",
    "a child dances in a quiet garden, watercolor style",
]

# What each preset sets; any flag given on the command line wins.
PRESETS = {
    # Many small requests: how throughput and latency behave as concurrency grows.
    "tiny": dict(model="tiny", height=32, width=32, num_frames=5, steps=8, guidance=5.0,
                 concurrency=[1, 2, 4, 8, 16, 32], requests=64, warmup=4),
    # A compute-bound model: single-request latency against diffusers in-process.
    "small": dict(model="small", height=128, width=128, num_frames=9, steps=10, guidance=5.0,
                  concurrency=[1], requests=5, warmup=1),
    # Wan2.1-T2V-1.3B's shape (common/builtin/specs/wan.py "wan2.1-1.3b") in bfloat16 on one GPU, sized so that the
    # whole run (engine start, 2 levels x 8 requests, diffusers' 8) takes a few minutes on an H100-class
    # card: 480x832 as the real default but 17 frames (5 latent frames, 7800 tokens) and 10 steps instead
    # of 81 frames and 50 steps, about 3e13 FLOP per transformer call, ~6e14 per request with CFG.
    # Tolerance: in bfloat16 a batched forward rounds differently from diffusers' unbatched one (c=1 can
    # match exactly). This model on the CPU at 64x64, batches of 2-4, 2-10 steps: max abs frame
    # difference 0.055-0.078, mean <= 0.01; a wrong video (other seed or prompt) differs by ~1. 0.25 leaves
    # room for the ~300x more pixels of the GPU size; the max and mean are recorded either way.
    "wan-1.3b": dict(model="wan2.1-1.3b", height=480, width=832, num_frames=17, steps=10, guidance=5.0,
                     concurrency=[1, 4], requests=8, warmup=1, device="cuda", dtype="bfloat16",
                     tolerance=0.25),
    # SD3 (StableDiffusion3Pipeline, images: no num_frames), at each model's default size and steps with
    # SD3.5's guidance 4.5. tiny-sd3: many small requests, as "tiny".
    "tiny-sd3": dict(model="tiny-sd3", height=64, width=64, num_frames=None, steps=4, guidance=4.5,
                     concurrency=[1, 2, 4, 8, 16, 32], requests=64, warmup=4),
    # The ~19.5M-parameter SD3.5-style transformer, compute-bound: one request at a time against diffusers
    # in-process (target: engine p50 <= 1.05x diffusers'), and 16 in flight (16 requests, so that all are).
    "small-sd3": dict(model="small-sd3", height=256, width=256, num_frames=None, steps=10, guidance=4.5,
                      concurrency=[1, 16], requests=16, warmup=1, target_p50_ratio=1.05),
    # FLUX.1-dev-like: embedded guidance 3.5, no true CFG (one forward per step), as FLUX.1-dev is served.
    "small-flux": dict(model="small-flux", height=256, width=256, num_frames=None, steps=10, guidance=3.5,
                       concurrency=[1, 16], requests=16, warmup=1, target_p50_ratio=1.05),
    # FLUX.2 [klein] (Flux2KleinPipeline), step-distilled as FLUX.2-klein-4B: guidance 1.0 (no CFG, one forward
    # per step) and no negative prompt (the pipeline takes none, so none is sent). 20 steps rather than the
    # distilled 4: at 4 (~0.3 s on this CPU) the engine's fixed cost per request (~60 ms: HTTP and the hops, as
    # small-flux's 0.77 s against 0.71 s) alone is 1.2x; at 20 (~1.6 s) it is ~1.04x, where the transformer is
    # what is measured. One request at a time against diffusers in-process (target: engine p50 <= 1.05x), and
    # 16 in flight.
    "small-flux2-klein": dict(model="small-flux2-klein", height=256, width=256, num_frames=None, steps=20,
                              guidance=1.0, concurrency=[1, 16], requests=16, warmup=1, target_p50_ratio=1.05),
    # Qwen-Image: no embedded guidance; true CFG 4.0 with the empty negative prompt (two forwards per step).
    "small-qwen-image": dict(model="small-qwen-image", height=256, width=256, num_frames=None, steps=10,
                             guidance=None, true_cfg=4.0, concurrency=[1, 16], requests=16, warmup=1,
                             target_p50_ratio=1.05),
    # Wan2.1 I2V-like (WanImageToVideoPipeline, a CLIP image encoder): every request carries a picture.
    # tiny-wan-i2v: many small requests, as "tiny", 8 distinct pictures (8 encoded at the first level).
    "tiny-wan-i2v": dict(model="tiny-wan-i2v", height=32, width=32, num_frames=5, steps=8, guidance=5.0,
                         concurrency=[1, 4, 16], requests=32, warmup=4, images=8),
    # small-wan-i2v: "small"'s transformer with the image cross-attention (~19.6M) and a ~0.88M CLIP vision
    # encoder, compute-bound: one request at a time against diffusers in-process (target: engine p50 <= 1.05x
    # diffusers'), then 4 in flight. 3 distinct pictures over 5 requests: the first 3 are encoded, the last 2
    # come from the encoder's cache. Tolerance: alone (c=1) the frames are diffusers' bit for bit; batched
    # (c=4) the forward rounds differently, latents within 6.4e-6 of diffusers' and frames, through the VAE,
    # within 1.8e-4 on this CPU. 1e-3 leaves room for other BLAS kernels; a wrong video differs by far more.
    "small-wan-i2v": dict(model="small-wan-i2v", height=128, width=128, num_frames=9, steps=10, guidance=5.0,
                          concurrency=[1, 4], requests=5, warmup=1, images=3, target_p50_ratio=1.05,
                          tolerance=1e-3),
    # Image editing (QwenImageEditPipeline, FluxKontextPipeline): every request carries a picture of another
    # size and aspect than the 256x256 output. The pipelines take each reference at a 1024x1024 area whatever
    # the output size (Kontext: the preferred resolution nearest the picture's aspect), so a request holds
    # ~16x more reference tokens than noise tokens and VAE-encodes a ~1-megapixel picture: the step counts
    # and request counts keep a run to a few minutes on 2 CPU cores. One request at a time against
    # diffusers in-process (target: engine p50 <= 1.05x diffusers'); 3 distinct pictures over 4 requests:
    # the first 3 are encoded, the fourth comes from the encoder's cache. The encoder worker gets every core
    # (encoder_threads; its default is one thread): the reference's VAE encode is a large share of a request,
    # and one request at a time never runs it beside the denoiser; on as many threads as diffusers' in-process
    # encode it also rounds as that does (a 1-megapixel encode on another thread count differs by ~1e-3).
    # The decode worker too (decode_threads; its default is one thread): it never runs beside the denoiser
    # either, and a 256x256 decode takes ~0.4 s on 2 threads where one takes ~0.6 s (an idle machine).
    # Qwen-Image-Edit: the picture goes to the VL text encoder too; true CFG 4.0 with the empty negative prompt.
    "small-qwen-image-edit": dict(model="small-qwen-image-edit", height=256, width=256, num_frames=None, steps=6,
                                  guidance=None, true_cfg=4.0, concurrency=[1], requests=4, warmup=1, images=3,
                                  encoder_threads="all", decode_threads="all", target_p50_ratio=1.05),
    # Qwen-Image-Edit-Plus: two pictures per request, as a list (each its own reference tokens).
    "small-qwen-image-edit-plus": dict(model="small-qwen-image-edit-plus", height=256, width=256, num_frames=None,
                                       steps=6, guidance=None, true_cfg=4.0, concurrency=[1], requests=4, warmup=1,
                                       images=3, pictures=2, encoder_threads="all", decode_threads="all",
                                       target_p50_ratio=1.05),
    # FLUX.1 Kontext-like: embedded guidance 2.5 (FLUX.1-Kontext-dev's), no true CFG.
    "small-flux-kontext": dict(model="small-flux-kontext", height=256, width=256, num_frames=None, steps=6,
                               guidance=2.5, concurrency=[1], requests=4, warmup=1, images=3,
                               encoder_threads="all", decode_threads="all", target_p50_ratio=1.05),
    # LTX-2 (LTX2Pipeline: video and audio latents denoised jointly) at small-ltx2's default 256x384, 25 frames,
    # with the guidance the pipeline's defaults run: CFG 3.0 (audio 7.0), STG 1.0 on the model's stg_block,
    # modality 3.0, rescale 0.7 on both streams; four rows a step (cond, uncond, perturbed, isolated), which
    # the pipeline runs as three transformer calls. Every guidance field is sent, so that engine and pipeline
    # run the same values whatever either's defaults (the engine's are the model's serving ones). The
    # pipeline's own 30 steps: an answer of 25 float32 frames is 29.5 MB, which costs the engine's request a
    # fixed ~0.3 s on this CPU whatever its steps (~0.26 s of it the HTTP answer, the rest the hops), against
    # diffusers' frames handed over in process; at 3 steps (1.0 s) that alone is 1.3x, at 30 steps (~10 s)
    # 1.03x, where a real LTX-2 request (minutes) sits. 8 requests at c=1 and at c=8 (all in flight), about
    # 8 minutes on 2 cores. Decode is two VAEs and the vocoder: the decode worker gets every core, as
    # diffusers' in-process decode has (and the encoder, as the edits).
    "small-ltx2": dict(model="small-ltx2", height=256, width=384, num_frames=25, steps=30, guidance=3.0,
                       fields=dict(audio_guidance_scale=7.0, stg_scale=1.0, audio_stg_scale=1.0,
                                   modality_scale=3.0, audio_modality_scale=3.0, guidance_rescale=0.7,
                                   audio_guidance_rescale=0.7),
                       concurrency=[1, 8], requests=8, warmup=1, encoder_threads="all", decode_threads="all",
                       target_p50_ratio=1.05),
    # Z-Image (ZImagePipeline) as Z-Image-Turbo is served: 8 steps, guidance_scale 0 (the pipeline's guidance is
    # off at 0, so one forward per step on both sides), at small-z-image's 256x256 (~17M transformer,
    # compute-bound). One request at a time against diffusers in-process (target: engine p50 <= 1.05x
    # diffusers'), and 16 in flight. cfg_normalization and cfg_truncation go to the pipeline as the model's
    # serving defaults (run_diffusers' fixed), which are the pipeline's own. At 8 one-forward steps a request is
    # short, so its encode and decode weigh: the encoder and decode workers get every core, as the pipeline's
    # in-process encode and decode have (one request at a time they never run beside the denoiser).
    "small-z-image": dict(model="small-z-image", height=256, width=256, num_frames=None, steps=8, guidance=0.0,
                          concurrency=[1, 16], requests=16, warmup=1, encoder_threads="all", decode_threads="all",
                          target_p50_ratio=1.05),
    # HunyuanVideo 1.5 (HunyuanVideo15Pipeline) at small-hunyuan-video15's default 144x256, 9 frames, 10 steps:
    # a ~21M transformer with CFG through the directory's guider. The pipeline takes no guidance_scale (its guider
    # holds the scale), so none is sent: both sides run the guider's 6.0, the engine's default for this model.
    # One request at a time against diffusers in-process (target: engine p50 <= 1.05x diffusers'); ~28 s a
    # request in diffusers on 2 busy cores, so 4 requests. The encoder and decode workers get every core, as
    # diffusers' in-process encode and decode have (at c=1 neither runs beside the denoiser).
    "small-hunyuan-video15": dict(model="small-hunyuan-video15", height=144, width=256, num_frames=9, steps=10,
                                  guidance=None, concurrency=[1], requests=4, warmup=1, encoder_threads="all",
                                  decode_threads="all", target_p50_ratio=1.05),
}
# Serving defaults of a family's fields that the pipeline takes under another name and shape.
PIPELINE_ARGS = {"stg_block": lambda v: {"spatio_temporal_guidance_blocks": [int(v)]}}
DEFAULT_TOPOLOGY = "encoder=1,denoise=1,decode=1"
# Used where a preset does not say.
PRESET_FALLBACKS = {"device": "cpu", "dtype": "float32", "tolerance": 1e-4, "images": 4, "pictures": 1}
# The pictures of image-to-video requests: height x width, another size and aspect than any preset's video.
IMAGE_SIZE = (96, 160)
DTYPES = ("float32", "bfloat16", "float16")


# --------------------------------------------------------------------------
# Requests
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    height: int
    width: int
    num_frames: int
    steps: int
    guidance: float | None  # None: not sent (Qwen-Image's transformer takes no embedded guidance)
    output_type: str  # "frames" | "latent"
    n: int
    seed: int
    video: bool = True  # False: an image family, sent no num_frames (it answers one frame)
    true_cfg: float | None = None  # FLUX / Qwen-Image: true CFG with the empty negative prompt
    images: int = 0  # image to video: distinct pictures in the mix (request i takes picture i mod images)
    pictures: int = 1  # pictures per request (an edit model taking several: ``image`` as a list)
    fields: tuple = ()  # (name, value) of the family's own fields every request sends (and the pipeline gets)
    negative_prompt: bool = True  # False: the pipeline takes none (Flux2KleinPipeline), so none is sent

    def body(self, i: int) -> dict:
        """Request ``i`` of the mix (deterministic from the workload seed)."""
        rng = random.Random(self.seed * 1_000_003 + i)
        body = {"prompt": rng.choice(PROMPTS), "negative_prompt": "", "seed": self.seed * 1_000_000 + i,
                "n": self.n, "height": self.height, "width": self.width, "num_frames": self.num_frames,
                "num_inference_steps": self.steps, "guidance_scale": self.guidance,
                "output_type": self.output_type}
        if not self.video:
            del body["num_frames"]
        if not self.negative_prompt:
            del body["negative_prompt"]
        if self.guidance is None:
            del body["guidance_scale"]
        if self.true_cfg is not None:
            body["true_cfg_scale"] = self.true_cfg
        body.update(self.fields)
        if self.images:
            body["image"] = self._image_field(self._picture_key(i))
        return body

    def warmup_body(self, j: int) -> dict:
        """Warm-up request ``j``: outside the mix (its own prompt, seed and picture)."""
        body = {**self.body(j), "prompt": "warm-up", "seed": 2**40 + j}
        if self.images:
            body["image"] = self._image_field(self._picture_key(j, warmup=True))
        return body

    def image(self, i: int, warmup: bool = False):
        """The picture (PIL, RGB) whose PNG request ``i`` (warm-up request ``i``) carries (a list of them with
        several pictures per request); None without images."""
        if not self.images:
            return None
        key = self._picture_key(i, warmup)
        return _picture(key) if self.pictures == 1 else [_picture((*key, k)) for k in range(self.pictures)]

    def _image_field(self, key: tuple[int, ...]):
        # Picture k > 0 of a request: its own key, and the transposed size (a second size and aspect).
        return _picture_field(key) if self.pictures == 1 else [_picture_field((*key, k))
                                                                 for k in range(self.pictures)]

    def _picture_key(self, i: int, warmup: bool = False) -> tuple[int, int, int]:
        return (self.seed, int(warmup), i if warmup else i % self.images)


@functools.lru_cache(maxsize=None)
def _picture(key: tuple[int, ...]):
    """A seeded synthetic RGB picture of IMAGE_SIZE (transposed for a request's pictures k > 0, ``key[3]``):
    smooth colour fields (a coarse random grid upscaled bicubically) with fine noise on top."""
    import numpy as np
    from PIL import Image

    height, width = IMAGE_SIZE if len(key) < 4 or key[3] == 0 else IMAGE_SIZE[::-1]
    rng = np.random.default_rng(list(key))
    coarse = Image.fromarray(rng.integers(0, 256, (height // 16, width // 16, 3), dtype=np.uint8), "RGB")
    smooth = np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), dtype=np.int16)
    noisy = smooth + rng.integers(-12, 13, (height, width, 3), dtype=np.int16)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")


@functools.lru_cache(maxsize=None)
def _picture_field(key: tuple[int, ...]) -> str:
    """The picture as a request's ``image`` value (base64 PNG: lossless, the engine decodes the same pixels)."""
    return image_field(_picture(key))


@dataclass
class Result:
    index: int
    ok: bool
    latency_s: float
    status: int | None = None
    error: str | None = None
    timings: dict = field(default_factory=dict)
    new_image: bool | None = None  # its picture was new to the engine (None: no picture)


class CpuMeter:
    """CPU used during a phase by this benchmark and the engine, and by everything else on the machine.

    Reads /proc (Linux; elsewhere it reports nothing). ``pids``: the engine's processes (router and workers;
    with ``--url`` only the workers, so the router counts as "other"). Other work on the machine competes for
    the same cores and skews every number, so each phase reports how many cores it took on average.
    """

    def __init__(self, pids: list[int]):
        self.pids = [os.getpid(), *pids]
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

    def _snapshot(self) -> tuple[float, float, float] | None:
        try:
            fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
            # user nice system idle iowait irq softirq steal: busy = all but idle and iowait
            busy = sum(fields[:8]) - fields[3] - fields[4]
            ours = 0
            for pid in self.pids:
                try:
                    stat = Path(f"/proc/{pid}/stat").read_text()
                except OSError:
                    continue
                rest = stat.rsplit(")", 1)[1].split()
                ours += int(rest[11]) + int(rest[12])  # utime, stime (threads included)
            return busy / self.hz, ours / self.hz, time.monotonic()
        except (OSError, ValueError, IndexError):
            return None

    def start(self) -> None:
        self._t0 = self._snapshot()

    def stop(self) -> dict:
        t1 = self._snapshot()
        if self._t0 is None or t1 is None or t1[2] <= self._t0[2]:
            return {}
        wall = t1[2] - self._t0[2]
        busy, ours = (t1[0] - self._t0[0]) / wall, (t1[1] - self._t0[1]) / wall
        return {"cpu_cores_ours": round(ours, 3), "cpu_cores_other": round(max(0.0, busy - ours), 3)}


# --------------------------------------------------------------------------
# Engine load
# --------------------------------------------------------------------------


class Sender:
    """Posts requests of the mix and keeps the outputs of the first ``keep`` ones for the correctness check.

    ``seen``: the pictures (with the request's size, as the encoder worker's cache keys them) sent so far in
    this run, shared by every level's Sender: a request whose picture is not in it makes the encoder encode it.
    """

    def __init__(self, http: httpx.AsyncClient, work: Workload, keep: int, seen: set):
        self.http, self.work, self.keep, self.seen = http, work, keep, seen
        self.outputs: dict[int, list] = {}
        self.sounds: dict[int, list] = {}  # the kept requests' waveforms, where the answers carry them

    async def send(self, i: int, body: dict | None = None, t_start: float | None = None) -> Result:
        body = body or self.work.body(i)
        new_image = None
        if "image" in body:
            image = body["image"]
            key = (tuple(image) if isinstance(image, list) else image, body["height"], body["width"], body.get("num_frames"))
            new_image = key not in self.seen
            self.seen.add(key)
        t0 = time.perf_counter() if t_start is None else t_start
        try:
            r = await self.http.post("/generate", content=json.dumps(body).encode(),
                                     headers={"content-type": "application/json", "accept": MSGPACK})
        except httpx.HTTPError as e:
            return Result(i, False, time.perf_counter() - t0, error=f"{type(e).__name__}: {e}")
        latency = time.perf_counter() - t0
        try:
            data = (msgpack.unpackb(r.content, raw=False) if r.headers.get("content-type", "").startswith(MSGPACK)
                    else r.json())
        except Exception as e:  # noqa: BLE001 - a garbled body is an error like any other
            return Result(i, False, latency, r.status_code, f"undecodable body: {e}")
        if r.status_code != 200:
            err = data.get("error", {}) if isinstance(data, dict) else {}
            return Result(i, False, latency, r.status_code, f"{err.get('type')}: {err.get('message')}")
        if 0 <= i < self.keep:
            self.outputs[i] = [body_to_tensor(s["output"]) for s in data["samples"]]
            if all(s.get("audio") for s in data["samples"]):
                self.sounds[i] = [body_to_tensor(s["audio"]) for s in data["samples"]]
        return Result(i, True, latency, 200, timings=dict(data.get("timings", {})), new_image=new_image)


async def closed_loop(sender: Sender, concurrency: int, requests: int) -> tuple[list[Result], float]:
    """``concurrency`` requests in flight until ``requests`` are answered; returns results and wall time."""
    next_index = 0
    results: list[Result] = []

    async def user() -> None:
        nonlocal next_index
        while next_index < requests:
            i = next_index
            next_index += 1
            results.append(await sender.send(i))

    t0 = time.perf_counter()
    await asyncio.gather(*(user() for _ in range(min(concurrency, requests))))
    return results, time.perf_counter() - t0


def poisson_arrivals(rate: float, seed: int, duration: float | None, requests: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process at ``rate``: within ``duration`` if given, else ``requests`` of them."""
    rng = random.Random(seed ^ 0x5EED)
    t, out = 0.0, []
    while True:
        t += rng.expovariate(rate)
        if (duration is not None and t > duration) or (duration is None and len(out) >= requests):
            return out
        out.append(t)


async def open_loop(sender: Sender, arrivals: list[float]) -> tuple[list[Result], float]:
    """Send request ``i`` at ``arrivals[i]`` whatever is still in flight; latency counts from that moment."""
    t0 = time.perf_counter()
    tasks = []
    for i, at in enumerate(arrivals):
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(sender.send(i, t_start=t0 + at)))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - t0


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarise(kind: str, level: float, results: list[Result], wall: float, n: int) -> dict:
    ok = [r for r in results if r.ok]
    lat = [r.latency_s for r in ok]
    mean = lambda key: (sum(r.timings.get(key, 0.0) for r in ok) / len(ok)) if ok else None  # noqa: E731
    errors = [r for r in results if not r.ok]
    return {
        "mode": kind, "level": level, "requests": len(results), "ok": len(ok), "errors": len(errors),
        "error_examples": sorted({f"{r.status}: {r.error}" for r in errors})[:5],
        "wall_s": wall, "req_per_s": len(ok) / wall if wall > 0 else None,
        "samples_per_s": len(ok) * n / wall if wall > 0 else None,
        "latency_p50_s": percentile(lat, 0.50), "latency_p90_s": percentile(lat, 0.90),
        "latency_p99_s": percentile(lat, 0.99), "latency_mean_s": sum(lat) / len(lat) if lat else None,
        "latencies_s": [r.latency_s for r in sorted(ok, key=lambda r: r.index)],  # by request, for a noisy machine
        "mean_encode_s": mean("encode_s"), "mean_denoise_s": mean("denoise_s"),
        "mean_decode_s": mean("decode_s"), "mean_total_s": mean("total_s"),
        **_image_encode_stats(ok),
    }


def _image_encode_stats(ok: list[Result]) -> dict:
    """The encoder's image_encode_s: median and p90 over the requests that encoded their picture, and the
    most a repeat (a cache hit) took. Nothing for requests without pictures."""
    with_image = [r for r in ok if r.new_image is not None]
    if not with_image:
        return {}
    encoded = [r.timings.get("image_encode_s", 0.0) for r in with_image if r.new_image]
    cached = [r.timings.get("image_encode_s", 0.0) for r in with_image if not r.new_image]
    return {"images_encoded": len(encoded), "images_cached": len(cached),
            "image_encode_p50_s": percentile(encoded, 0.50), "image_encode_p90_s": percentile(encoded, 0.90),
            "image_encode_cached_max_s": max(cached) if cached else None}


async def run_engine_levels(url: str, work: Workload, args, meter: CpuMeter) \
        -> tuple[list[dict], dict[str, dict[int, list]], dict[str, dict[int, list]]]:
    """Levels, and per level the kept requests' outputs and waveforms (empty for a model without sound)."""
    levels, outputs, sounds = [], {}, {}
    limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout, limits=limits) as http:
        seen: set = set()
        warm = Sender(http, work, keep=0, seen=seen)
        for j in range(args.warmup):  # not counted; seeds (and pictures) outside the mix
            r = await warm.send(-1, work.warmup_body(j))
            if not r.ok:
                raise SystemExit(f"warm-up request failed: {r.status}: {r.error}")
        for c in args.concurrency:
            sender = Sender(http, work, keep=args.check, seen=seen)
            meter.start()
            results, wall = await closed_loop(sender, c, args.requests)
            levels.append({**summarise("concurrency", c, results, wall, work.n), **meter.stop()})
            outputs[f"c={c}"], sounds[f"c={c}"] = sender.outputs, sender.sounds
            _progress(levels[-1])
        for rate in args.rate or []:
            sender = Sender(http, work, keep=args.check, seen=seen)
            arrivals = poisson_arrivals(rate, args.seed, args.duration, args.requests)
            meter.start()
            results, wall = await open_loop(sender, arrivals)
            level = {**summarise("rate", rate, results, wall, work.n), **meter.stop()}
            level["offered_req_per_s"] = len(arrivals) / args.duration if args.duration else rate
            levels.append(level)
            outputs[f"rate={rate:g}"], sounds[f"rate={rate:g}"] = sender.outputs, sender.sounds
            _progress(level)
    return levels, outputs, sounds


async def _engine_once(url: str, work: Workload, args, i: int) -> float:
    """Request ``i`` of the mix through the engine alone: its latency."""
    async with httpx.AsyncClient(base_url=url, timeout=args.request_timeout) as http:
        r = await Sender(http, work, keep=0, seen=set()).send(i)
    if not r.ok:
        raise SystemExit(f"paired request {i} failed: {r.status}: {r.error}")
    return r.latency_s


def _progress(level: dict) -> None:
    print(f"  {_label(level):<10} {level['ok']:>4} ok {level['errors']:>3} errors  {level['wall_s']:6.1f}s  "
          f"{_f(level['req_per_s'], 2)} req/s  p50 {_f(level['latency_p50_s'], 3)}s", flush=True)


# --------------------------------------------------------------------------
# diffusers baseline
# --------------------------------------------------------------------------


def run_diffusers(model_dir: Path, work: Workload, count: int, meter: CpuMeter, device: str = "cpu",
                  dtype: str = "float32", pairs: int = 0, engine_once=None) -> tuple[dict, dict[int, list], dict[int, list]]:
    """The first ``count`` requests of the mix through the family's diffusers pipeline (WanPipeline,
    StableDiffusion3Pipeline, WanImageToVideoPipeline with the request's picture, LTX2Pipeline, ...), one after
    another, on all cores; with their waveforms where the pipeline makes sound. Then ``pairs`` of the same
    request through ``engine_once(i)`` (its latency) and through the pipeline, one after the other (see
    :func:`_paired`)."""
    import inspect

    import diffusers
    import diffusers.utils.logging as dlog
    import torch
    import transformers.utils.logging as tlog

    dlog.disable_progress_bar()
    tlog.disable_progress_bar()
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    dev = torch.device(device)

    def sync() -> None:  # CUDA calls return before the work is done
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    info = read_model(model_dir)
    family = info.family
    t_load = time.perf_counter()
    pipe = getattr(diffusers, family.pipeline).from_pretrained(model_dir, dtype=getattr(torch, dtype),
                                                               **_components(model_dir, family.pipeline)).to(dev)
    pipe.set_progress_bar_config(disable=True)
    sync()
    load_s = time.perf_counter() - t_load
    output_type = "latent" if work.output_type == "latent" else "np"
    # The engine's defaults of the family's own fields are the model's, which may not be the pipeline's (SD3's
    # text length: 256 in the pipeline, 32 in tiny-sd3's serving defaults; FLUX.1 Kontext's max_area: 1024x1024
    # in the pipeline, 256x256 in small-flux-kontext's); Wan's 512 is both.
    takes = inspect.signature(pipe.__call__).parameters
    fixed = {f.name: info.defaults[f.name] for f in family.request_fields
             if f.name in takes and f.name in info.defaults and f.name not in work.body(0)}
    for name, translate in PIPELINE_ARGS.items():  # LTX-2's stg_block: spatio_temporal_guidance_blocks
        if name in info.defaults and not set(translate(info.defaults[name])) - set(takes):
            fixed.update(translate(info.defaults[name]))
    own = [name for name, _ in work.fields if name in takes]
    sounds: dict[int, list] = {}

    def one(body: dict, image, i: int | None = None) -> list:
        outs = []
        for k in range(body["n"]):  # the engine's n samples use seeds seed, seed+1, ...
            # A CPU generator, as the engine draws its initial noise on the CPU whatever the device.
            kw = dict(prompt=body["prompt"], height=body["height"], width=body["width"],
                      num_inference_steps=body["num_inference_steps"],
                      generator=torch.Generator("cpu").manual_seed(body["seed"] + k), output_type=output_type,
                      **{**fixed, **{k2: body[k2] for k2 in ("negative_prompt", "guidance_scale", "true_cfg_scale",
                                                             *own)
                                     if k2 in body}})
            if image is not None:  # the PIL picture whose PNG the engine was sent
                kw["image"] = image
            if family.video:
                result = pipe(**kw, num_frames=body["num_frames"])
                out = result.frames[0]  # [F, H, W, 3] or latents [C, F', ...]
                if i is not None and output_type == "np" and getattr(result, "audio", None) is not None:
                    sounds.setdefault(i, []).append(result.audio[0].float().cpu())  # [channels, samples]
            else:  # images [1, H, W, 3], as the engine answers one frame; latents [C, H', W']
                out = pipe(**kw).images
                out = out[:1] if output_type == "np" else out[0]
            outs.append(torch.from_numpy(out) if output_type == "np" else out.cpu())
        sync()
        return outs

    with torch.inference_mode():
        one(work.warmup_body(0), work.image(0, warmup=True))
        latencies, outputs = [], {}
        meter.start()
        t0 = time.perf_counter()
        for i in range(count):
            t = time.perf_counter()
            outputs[i] = one(work.body(i), work.image(i), i)
            latencies.append(time.perf_counter() - t)
        wall = time.perf_counter() - t0
        cpu = meter.stop()
        paired = _paired(pairs, engine_once, lambda i: one(work.body(i), work.image(i))) if pairs else None
    res = {**cpu, "pipeline": family.pipeline, "requests": count, "threads": threads, "device": device,
           "dtype": dtype, "load_s": load_s,
           "wall_s": wall,
           "req_per_s": count / wall, "samples_per_s": count * work.n / wall,
           "latency_p50_s": percentile(latencies, 0.5), "latency_p90_s": percentile(latencies, 0.9),
           "latency_p99_s": percentile(latencies, 0.99), "latency_mean_s": sum(latencies) / count,
           "latencies_s": latencies, **({"paired": paired} if paired else {})}
    return res, outputs, sounds


def _paired(pairs: int, engine_once, diffusers_once) -> dict:
    """One request at a time, the engine's and the pipeline's turn about (ABBA: the first of a pair alternates),
    so that the machine's speed drifting over minutes (shared cores) weighs on both alike: the c=1 comparison
    the target is checked on. Neither runs while the other does."""
    engine, baseline = [], []
    for j in range(pairs):
        turns = [(engine, engine_once), (baseline, diffusers_once)]
        for latencies, once in (turns if j % 2 == 0 else turns[::-1]):
            t = time.perf_counter()
            took = once(j)
            latencies.append(took if isinstance(took, float) else time.perf_counter() - t)
    e50, d50 = percentile(engine, 0.5), percentile(baseline, 0.5)
    return {"pairs": pairs, "engine_latencies_s": engine, "diffusers_latencies_s": baseline,
            "engine_p50_s": e50, "diffusers_p50_s": d50, "p50_ratio": e50 / d50}


def _components(model_dir: Path, pipeline: str) -> dict:
    """Components to hand ``from_pretrained`` rather than let it load them: a Qwen-VL ``processor`` (the edit
    pipelines') as the engine loads it, since transformers' own class does not load without torchvision."""
    import inspect

    import diffusers

    takes = inspect.signature(getattr(diffusers, pipeline).__init__).parameters
    if "processor" in takes and (model_dir / "processor").is_dir():
        from common.families.qwen_image.processor import load_processor

        return {"processor": load_processor(model_dir)}
    return {}


def takes_negative_prompt(pipeline: str) -> bool:
    """Whether the diffusers pipeline ``pipeline`` takes a ``negative_prompt`` (Flux2KleinPipeline does not)."""
    import inspect

    import diffusers

    return "negative_prompt" in inspect.signature(getattr(diffusers, pipeline).__call__).parameters


def compare(engine_outputs: dict[str, dict[int, list]], reference: dict[int, list], tolerance: float) -> dict:
    per_level = {}
    for label, outs in engine_outputs.items():
        diffs, means = {}, {}
        for i, samples in outs.items():
            if i in reference:
                d = [(a.float() - b.float()).abs() for a, b in zip(samples, reference[i])]
                diffs[i] = max(x.max().item() for x in d)
                means[i] = max(x.mean().item() for x in d)
        per_level[label] = {"requests": sorted(diffs), "max_abs_diff": max(diffs.values()) if diffs else None,
                            "mean_abs_diff": max(means.values()) if means else None}
    worst = [v["max_abs_diff"] for v in per_level.values() if v["max_abs_diff"] is not None]
    return {"tolerance": tolerance, "per_level": per_level, "max_abs_diff": max(worst) if worst else None,
            "ok": bool(worst) and max(worst) <= tolerance}


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def _f(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def _label(level: dict) -> str:
    return f"c={level['level']}" if level["mode"] == "concurrency" else f"rate={level['level']:g}"


def _fields_note(cfg: dict) -> str:
    fields = cfg.get("fields") or {}
    return f" ({', '.join(f'{k} {v:g}' for k, v in fields.items())})" if fields else ""


def _gpu_note(cfg: dict) -> str:
    return f"; GPU: {cfg['gpu']}" if cfg.get("gpu") else ""


def print_report(res: dict) -> None:
    cfg, eng, diff = res["config"], res["engine"], res.get("diffusers")
    print(f"\nengine: model {Path(eng['model_dir']).name} ({cfg['model']}), topology {eng['topology']}, "
          f"devices {','.join(sorted({str(w['device']) for w in eng['workers']}))}"
          f"{' ' + ' '.join(eng['extra']) if eng['extra'] else ''}, {eng['url']}")
    frames = f"{cfg['num_frames']} frames" if cfg.get("video", True) else "image"
    images = cfg.get("images", 0)
    size = "x".join(map(str, cfg.get("image_size", ())))
    each = "an image each" if cfg.get("pictures", 1) == 1 else f"{cfg['pictures']} images each"
    pictures = (f", {each}: {min(images, cfg['requests_per_level'])} distinct {size} RGB pictures "
                f"(request i: picture i mod {images}; warm-up: its own)" if images else "")
    print(f"requests: {cfg['height']}x{cfg['width']}, {frames}, {cfg['steps']} steps, "
          f"guidance {cfg['guidance']}{_fields_note(cfg)}, output {cfg['output_type']}, n={cfg['n']}, "
          f"seed {cfg['seed']}, "
          f"warm-up {cfg['warmup']}{pictures}; CPU cores: {os.cpu_count()}{_gpu_note(cfg)}; load average (1/5/15 min) "
          f"at start {'/'.join(f'{x:.1f}' for x in cfg['loadavg_at_start'])}, at end "
          f"{'/'.join(f'{x:.1f}' for x in cfg['loadavg_at_end'])}")
    head = (f"{'load':<10} {'ok':>4} {'err':>4} {'req/s':>7} {'smp/s':>7} {'p50 s':>7} {'p90 s':>7} {'p99 s':>7} "
            f"{'encode':>7}" + (f" {'img p50':>8} {'img p90':>8}" if images else "")
            + f" {'denoise':>8} {'decode':>7} {'total':>7} {'thr/diff':>9} {'p50/diff':>9}")
    print(head)
    print("-" * len(head))
    for lv in res["levels"]:
        img = (f" {_f(lv.get('image_encode_p50_s'), 4):>8} {_f(lv.get('image_encode_p90_s'), 4):>8}"
               if images else "")
        print(f"{_label(lv):<10} {lv['ok']:>4} {lv['errors']:>4} {_f(lv['req_per_s'], 2):>7} "
              f"{_f(lv['samples_per_s'], 2):>7} {_f(lv['latency_p50_s'], 3):>7} {_f(lv['latency_p90_s'], 3):>7} "
              f"{_f(lv['latency_p99_s'], 3):>7} {_f(lv['mean_encode_s'], 3):>7}{img} {_f(lv['mean_denoise_s'], 3):>8} "
              f"{_f(lv['mean_decode_s'], 3):>7} {_f(lv['mean_total_s'], 3):>7} "
              f"{_f(lv.get('throughput_vs_diffusers'), 2):>9} {_f(lv.get('p50_latency_vs_diffusers'), 2):>9}")
    print("(encode/denoise/decode/total: mean seconds per request from the response timings; "
          "thr/diff: engine req/s / diffusers req/s; p50/diff: engine p50 latency / diffusers p50 latency)")
    if images:
        print("(img p50/p90: the encoder's image_encode_s, the image side's encoding of the picture (CLIP and "
              "VAE; an edit's reference VAE encodes) apart from the text's encode, median and p90 over the requests whose picture was new to the engine)")
        print("image encodes: " + "; ".join(
            f"{_label(lv)} {lv.get('images_encoded', 0)} encoded, {lv.get('images_cached', 0)} from the encoder's cache"
            + (f" (at most {lv['image_encode_cached_max_s']:.5f} s)" if lv.get("images_cached") else "")
            for lv in res["levels"]))
    phases = [(_label(lv), lv) for lv in res["levels"]] + ([("diffusers", diff)] if diff else [])
    busy = [(name, ph["cpu_cores_other"]) for name, ph in phases if ph.get("cpu_cores_other", 0.0) > 0.2]
    if phases and "cpu_cores_other" in phases[0][1]:
        print("cores used by this benchmark + engine / by other processes: "
              + ", ".join(f"{name} {ph.get('cpu_cores_ours', 0):.2f}/{ph.get('cpu_cores_other', 0):.2f}"
                          for name, ph in phases))
    if busy:
        print("WARNING: other processes used CPU during " + ", ".join(f"{n} ({c:.2f} cores)" for n, c in busy)
              + ": those numbers are skewed; rerun on an idle machine")
    for lv in res["levels"]:
        if lv["errors"]:
            print(f"{_label(lv)} errors: {lv['error_examples']}")
    if diff:
        print(f"\ndiffusers {diff['pipeline']} in-process, sequential, {diff['device']} {diff['dtype']}, "
              f"torch threads {diff['threads']}: "
              f"{diff['requests']} requests in {diff['wall_s']:.2f}s = {diff['req_per_s']:.2f} req/s; latency p50 "
              f"{diff['latency_p50_s']:.3f}s p90 {diff['latency_p90_s']:.3f}s (pipeline load {diff['load_s']:.1f}s)")
        first = res["levels"][0] if res["levels"] else None
        if first is not None and first.get("p50_latency_vs_diffusers") is not None:
            target = cfg.get("target_p50_ratio")
            verdict = "" if target is None else (
                f" (target <= {target:g}: {'MET' if first['p50_latency_vs_diffusers'] <= target else 'NOT MET'})")
            paired = diff.get("paired")
            if paired:  # the target is checked on the paired run, which the machine's drift weighs on alike
                verdict = ""
            print(f"latency engine/diffusers at {_label(first)}: p50 {first['latency_p50_s']:.3f}s / "
                  f"{diff['latency_p50_s']:.3f}s = {first['p50_latency_vs_diffusers']:.2f}{verdict}")
            if paired:
                verdict = "" if target is None else (
                    f" (target <= {target:g}: {'MET' if paired['p50_ratio'] <= target else 'NOT MET'})")
                print(f"latency engine/diffusers, {paired['pairs']} requests each, taking turns: p50 "
                      f"{paired['engine_p50_s']:.3f}s / {paired['diffusers_p50_s']:.3f}s = "
                      f"{paired['p50_ratio']:.2f}{verdict}")
    chk = res.get("correctness")
    if chk:
        parts = ", ".join(f"{k} {'-' if v['max_abs_diff'] is None else format(v['max_abs_diff'], '.2e')}"
                          + ("" if v.get("mean_abs_diff") is None else f" (mean {v['mean_abs_diff']:.1e})")
                          for k, v in chk["per_level"].items())
        verdict = "OK" if chk["ok"] else "MISMATCH"
        print(f"correctness, engine vs diffusers max abs diff on requests {list(range(res['config']['check']))}: "
              f"{parts}  -> {verdict} (tolerance {chk['tolerance']:g})")
        if not chk["ok"] and res["config"]["output_type"] == "frames":
            print("  (frames go through the VAE, which can amplify a tiny latent difference; "
                  "--output-type latent checks the denoiser's output alone)")
    sound = res.get("correctness_audio")
    if sound:
        print("waveform, engine vs diffusers: " + (sound["skipped"] if "skipped" in sound else ", ".join(
            f"{k} {'-' if v['max_abs_diff'] is None else format(v['max_abs_diff'], '.2e')}"
            for k, v in sound["per_level"].items()) + f"  -> {'OK' if sound['ok'] else 'MISMATCH'}"))


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, diff = res["config"], res.get("diffusers")
    modes = [m for m in ("concurrency", "rate") if any(lv["mode"] == m for lv in res["levels"])]
    fig, axes = plt.subplots(len(modes), 2, figsize=(11, 4.2 * len(modes)), squeeze=False)
    for row, mode in enumerate(modes):
        lvs = [lv for lv in res["levels"] if lv["mode"] == mode]
        xs = [lv["level"] for lv in lvs]
        xlabel = "concurrency (requests in flight)" if mode == "concurrency" else "offered load (req/s, Poisson)"
        ax_t, ax_l = axes[row]
        ax_t.plot(xs, [lv["req_per_s"] or 0.0 for lv in lvs], "o-", label="engine")
        if diff:
            ax_t.axhline(diff["req_per_s"], color="tab:red", ls="--",
                         label=f"diffusers sequential ({diff['req_per_s']:.2f} req/s)")
        ax_t.set_ylabel("throughput (req/s)")
        ax_t.set_title("throughput")
        top = max([lv["req_per_s"] or 0.0 for lv in lvs] + [diff["req_per_s"] if diff else 0.0])
        ax_t.set_ylim(0, top * 1.2 or 1.0)
        ax_l.plot(xs, [lv["latency_p50_s"] for lv in lvs], "o-", label="engine p50")
        ax_l.plot(xs, [lv["latency_p99_s"] for lv in lvs], "s-", label="engine p99")
        if diff:
            ax_l.axhline(diff["latency_p50_s"], color="tab:red", ls="--",
                         label=f"diffusers p50 ({diff['latency_p50_s']:.3f}s)")
        ax_l.set_ylabel("latency (s)")
        ax_l.set_title("latency")
        top = max([lv["latency_p99_s"] or 0.0 for lv in lvs] + [diff["latency_p50_s"] if diff else 0.0])
        ax_l.set_ylim(0, top * 1.2 or 1.0)
        for ax in (ax_t, ax_l):
            ax.set_xlabel(xlabel)
            if mode == "concurrency" and len(xs) > 1 and min(xs) > 0:
                ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([f"{x:g}" for x in xs])
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
    size = f"{cfg['height']}x{cfg['width']}" + (f"x{cfg['num_frames']}" if cfg.get("video", True) else "")
    fig.suptitle(f"{cfg['model']}: {size}, {cfg['steps']} steps, "
                 f"guidance {cfg['guidance']}, {cfg['output_type']}; topology {res['engine']['topology']}; "
                 f"{os.cpu_count()} CPU cores{_gpu_note(cfg)}; {cfg['dtype']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def _flag_value(tokens: list[str], flag: str) -> str | None:
    """The last value given to ``flag`` (``--flag V`` or ``--flag=V``) in a launch.py command line."""
    value = None
    for k, tok in enumerate(tokens):
        if tok == flag and k + 1 < len(tokens):
            value = tokens[k + 1]
        elif tok.startswith(flag + "="):
            value = tok.split("=", 1)[1]
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny",
                    help="defaults for model, size, steps, load levels, request count and, for image to video, "
                         "distinct pictures (default: tiny)")
    ap.add_argument("--url", help="a running engine; default: start one with --model/--topology/--extra")
    ap.add_argument("--model", help="model to start (launch.py --model); default: the preset's")
    ap.add_argument("--topology", help="launch.py --topology (default encoder=1,denoise=1,decode=1; the edit "
                                       "presets give the encoder worker every core, see PRESETS)")
    ap.add_argument("--extra", action="append", default=[],
                    help="more launch.py flags, shell-quoted, repeatable: --extra='--max-batch-size 4'")
    ap.add_argument("--device", help="device of the diffusers baseline, cpu or cuda[:N] (default: the preset's; "
                                     "tiny, small: cpu; wan-1.3b: cuda); the engine's come from --topology")
    ap.add_argument("--dtype", choices=DTYPES,
                    help="weights dtype of the engine (launch.py --dtype) and of the baseline "
                         "(default: the preset's; tiny, small: float32; wan-1.3b: bfloat16)")
    ap.add_argument("--height", type=int, help="default: the preset's (the model's default without a preset model)")
    ap.add_argument("--width", type=int)
    ap.add_argument("--num-frames", type=int, help="video families only (image families answer one frame)")
    ap.add_argument("--steps", type=int, help="num_inference_steps (preset tiny: 8, small: 10, wan-1.3b: 10, "
                                              "tiny-sd3: 4, small-sd3: 10, tiny-wan-i2v: 8, small-wan-i2v: 10)")
    ap.add_argument("--guidance", type=float, help="guidance_scale; > 1 means CFG (default 5.0; SD3 presets 4.5)")
    ap.add_argument("--output-type", choices=["frames", "latent"], default="frames")
    ap.add_argument("--n", type=int, default=1, help="samples per request")
    ap.add_argument("--concurrency", type=int, nargs="+",
                    help="closed-loop levels (preset tiny, tiny-sd3: 1 2 4 8 16 32; small: 1; wan-1.3b: 1 4; "
                         "small-sd3: 1 16; tiny-wan-i2v: 1 4 16; small-wan-i2v: 1 4); "
                         "default none when --rate is given")
    ap.add_argument("--rate", type=float, nargs="+", help="open-loop Poisson arrival rates, req/s")
    ap.add_argument("--duration", type=float, help="open loop: seconds of arrivals (default: --requests arrivals)")
    ap.add_argument("--requests", type=int, help="requests per level (preset tiny, tiny-sd3: 64, small: 5, small-sd3: 16, "
                                                 "wan-1.3b: 8, tiny-wan-i2v: 32, small-wan-i2v: 5)")
    ap.add_argument("--warmup", type=int, help="uncounted warm-up requests (preset tiny, tiny-wan-i2v: 4; small, "
                                               "wan-1.3b, small-wan-i2v: 1)")
    ap.add_argument("--images", type=int,
                    help="image-to-video and edit models: distinct pictures in the mix, request i taking picture "
                         "i mod this (preset tiny-wan-i2v: 8, small-wan-i2v and the edit presets: 3, "
                         "others: 4); a picture's first request makes the encoder encode "
                         "it, later ones hit its cache. A model that takes an image optionally (FLUX.1 Kontext) "
                         "gets pictures only when this or its preset asks")
    ap.add_argument("--pictures", type=int,
                    help="pictures per request, sent as a list beyond 1 (an edit model taking several, "
                         "Qwen-Image-Edit-Plus: up to 3; default 1); picture k > 0 is 160x96")
    ap.add_argument("--seed", type=int, default=0, help="request mix and arrival times")
    ap.add_argument("--no-diffusers", action="store_true", help="skip the diffusers baseline and the check")
    ap.add_argument("--diffusers-requests", type=int, help="requests for the baseline (default: --requests)")
    ap.add_argument("--pairs", type=int,
                    help="after the baseline, this many requests through the engine and the pipeline taking turns, "
                         "one at a time: the c=1 ratio the target is checked on (default: --diffusers-requests "
                         "where a target and c=1 are set, else 0)")
    ap.add_argument("--check", type=int, default=2, help="requests compared with diffusers at every level")
    ap.add_argument("--tolerance", type=float, help="max abs difference allowed by the check "
                                                     "(default: the preset's; 1e-4, small-wan-i2v: 1e-3, "
                                                     "wan-1.3b: 0.25)")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="client timeout per request, s")
    ap.add_argument("--json", type=Path, help="write every number here")
    ap.add_argument("--png", type=Path, help="write a chart here (matplotlib)")
    args = ap.parse_args(argv)

    preset = PRESETS[args.preset]
    own_model = args.model is None or args.model == preset["model"]
    args.model = args.model or preset["model"]
    for key, attr in (("height", "height"), ("width", "width"), ("num_frames", "num_frames"), ("steps", "steps")):
        if getattr(args, attr) is None and own_model:  # another model: its own defaults (read from its directory)
            setattr(args, attr, preset.get(key))
    if args.guidance is None:
        args.guidance = preset["guidance"]
    args.fields = dict(preset.get("fields", {}))  # the family's own fields: another model of it takes them too
    if args.concurrency is None:
        args.concurrency = [] if args.rate else list(preset["concurrency"])
    if args.requests is None:
        args.requests = preset["requests"]
    if args.warmup is None:
        args.warmup = preset["warmup"]
    # One dtype for engine and baseline: a --dtype inside --extra counts as this one.
    extra = [tok for chunk in args.extra for tok in shlex.split(chunk)]
    extra_dtype = _flag_value(extra, "--dtype")
    if extra_dtype is not None:
        if args.dtype is not None and args.dtype != extra_dtype:
            ap.error(f"--dtype {args.dtype} disagrees with --extra's --dtype {extra_dtype}")
        args.dtype = extra_dtype
    args.images_asked = args.images is not None or "images" in preset
    for key in ("device", "dtype", "tolerance", "images", "pictures"):
        if getattr(args, key) is None:
            setattr(args, key, preset.get(key, PRESET_FALLBACKS[key]))
    # (On a GPU the compact default places the workers; the threads are a CPU run's concern.)
    args.encoder_threads = (preset.get("encoder_threads")
                            if args.topology is None and args.device.startswith("cpu") else None)
    args.decode_threads = preset.get("decode_threads") if args.encoder_threads else None
    args.topology = args.topology or DEFAULT_TOPOLOGY
    args.launch_flags = extra if extra_dtype is not None else [*extra, "--dtype", args.dtype]
    # A speed comparison with diffusers on all cores: the workers' threads as the topology gives them, not one
    # (the engine's default keeps its CPU numbers independent of threads: docs/architecture.md).
    if args.device.startswith("cpu") and _flag_value(args.launch_flags, "--cpu-numerics") is None:
        args.launch_flags = [*args.launch_flags, "--cpu-numerics", "threaded"]
    if args.diffusers_requests is None:
        args.diffusers_requests = args.requests
    args.check = max(0, min(args.check, args.diffusers_requests))
    if args.pairs is None:
        args.pairs = (args.diffusers_requests if own_model and preset.get("target_p50_ratio") and 1 in args.concurrency
                      and not args.no_diffusers else 0)
    if any(c < 1 for c in args.concurrency) or any(r <= 0 for r in args.rate or []):
        ap.error("concurrency levels must be >= 1 and rates > 0")
    if args.requests < 1 or args.n < 1 or args.images < 1 or args.pictures < 1:
        ap.error("--requests, --n, --images and --pictures must be >= 1")
    return args


def _images(args, info) -> int:
    """Distinct pictures in the mix: image-to-video and edit models that require an image get them; a model that
    takes one optionally (FLUX.1 Kontext) when the preset or ``--images`` asks."""
    condition = info.family.condition
    takes = condition.image_input(info)
    if takes is None or (takes == "optional" and not args.images_asked):
        return 0
    if args.pictures > condition.images_allowed(info):
        raise SystemExit(f"--pictures {args.pictures}: {info.family.pipeline} takes at most "
                         f"{condition.images_allowed(info)} images per request")
    return args.images


def _threads(value) -> int:
    return (os.cpu_count() or 1) if value == "all" else int(value)


def _topology_file(args, folder: str) -> str:
    """The default topology with the encoder worker on ``args.encoder_threads`` CPU threads ("all": every core)
    instead of its default one (and the decode worker on ``args.decode_threads``, when given), as a topology
    file; ``args.topology`` becomes its description."""
    threads = _threads(args.encoder_threads)
    decode = {"role": "decode"}
    described = f"encoder threads {threads}"
    if args.decode_threads:
        decode["threads"] = _threads(args.decode_threads)
        described += f", decode threads {decode['threads']}"
    entries = [{"role": "encoder", "threads": threads}, {"role": "denoise"}, decode]
    path = Path(folder) / "topology.json"
    path.write_text(json.dumps(entries))
    args.topology = f"{DEFAULT_TOPOLOGY} ({described})"
    return str(path)


def _gpu_name(device: str) -> str | None:
    if not device.startswith("cuda"):
        return None
    import torch

    return torch.cuda.get_device_name(torch.device(device)) if torch.cuda.is_available() else None


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    extra = args.launch_flags
    # Other work on the machine skews every number here; the load averages are recorded to tell.
    load_start = os.getloadavg()
    engine = None
    tmp = tempfile.TemporaryDirectory(prefix="bench-serve-")
    if args.url:
        url = args.url.rstrip("/")
    else:
        topology = _topology_file(args, tmp.name) if args.encoder_threads else args.topology
        print(f"starting engine: --model {args.model} --topology {args.topology} {' '.join(extra)}", flush=True)
        engine = EngineProcess(args.model, topology, extra)
        url = engine.url
    try:
        health = httpx.get(f"{url}/health", timeout=30).json()
        model_dir = Path(health["model"])
        info = read_model(model_dir)
        defaults, video = info.defaults, info.family.video
        if not video and args.num_frames not in (None, 1):
            raise SystemExit(f"{info.family.pipeline} makes images: --num-frames must be 1 or left out")
        work = Workload(height=args.height or defaults["height"], width=args.width or defaults["width"],
                        num_frames=(args.num_frames or defaults["num_frames"]) if video else 1,
                        steps=args.steps or defaults["num_inference_steps"], guidance=args.guidance,
                        output_type=args.output_type, n=args.n, seed=args.seed, video=video,
                        true_cfg=PRESETS[args.preset].get("true_cfg"),
                        images=_images(args, info), pictures=args.pictures,
                        fields=tuple(args.fields.items()),
                        negative_prompt=takes_negative_prompt(info.family.pipeline))
        print(f"engine ready at {url}: {model_dir}; {len(health['workers'])} workers", flush=True)
        pids = [w["pid"] for w in health["workers"] if w.get("pid")] + ([engine.proc.pid] if engine else [])
        meter = CpuMeter(pids)
        levels, engine_outputs, engine_sounds = asyncio.run(run_engine_levels(url, work, args, meter))
        res = {
            "config": {"preset": args.preset, "model": args.model, "height": work.height, "width": work.width,
                       "num_frames": work.num_frames, "video": work.video, "family": info.family.family,
                       "steps": work.steps, "guidance": work.guidance, "fields": dict(work.fields),
                       **({"images": work.images, "image_size": list(IMAGE_SIZE), "pictures": work.pictures}
                          if work.images else {}),
                       "output_type": work.output_type, "n": work.n, "seed": work.seed,
                       "requests_per_level": args.requests, "warmup": args.warmup, "check": args.check,
                       "concurrency": args.concurrency, "rate": args.rate, "duration": args.duration,
                       "device": args.device, "dtype": args.dtype, "tolerance": args.tolerance,
                       "gpu": _gpu_name(args.device), "cpu_count": os.cpu_count(),
                       "target_p50_ratio": PRESETS[args.preset].get("target_p50_ratio")
                       if args.model == PRESETS[args.preset]["model"] else None,
                       "loadavg_at_start": load_start},
            "engine": {"url": url, "started_by_bench": engine is not None, "model_dir": str(model_dir),
                       "topology": args.topology if engine else "(external)", "extra": extra,
                       "workers": [{k: w.get(k) for k in ("role", "index", "device", "pid")}
                                   for w in health["workers"]]},
            "levels": levels,
        }
        if not args.no_diffusers:
            # The engine is idle now: nothing else competes for the cores.
            print(f"diffusers {info.family.pipeline} baseline: {args.diffusers_requests} requests, sequential",
                  flush=True)
            devices = {str(w.get("device", "")).split(":")[0] for w in health["workers"]}
            if devices != {args.device.split(":")[0]}:
                print(f"WARNING: the engine's workers run on {sorted(devices)}, the baseline on {args.device}: "
                      "the ratios compare different hardware", flush=True)
            diff, reference, reference_sounds = run_diffusers(
                model_dir, work, args.diffusers_requests, meter, args.device, args.dtype, args.pairs,
                lambda i: asyncio.run(_engine_once(url, work, args, i)))
            res["diffusers"] = diff
            for lv in levels:
                lv["throughput_vs_diffusers"] = (lv["req_per_s"] / diff["req_per_s"]) if lv["req_per_s"] else None
                lv["p50_latency_vs_diffusers"] = (lv["latency_p50_s"] / diff["latency_p50_s"]
                                                  if lv["latency_p50_s"] is not None else None)
            if args.check:
                res["correctness"] = compare(engine_outputs, reference, args.tolerance)
                if reference_sounds:  # a model with sound: its waveform, where the answers carry it
                    res["correctness_audio"] = (compare(engine_sounds, reference_sounds, args.tolerance)
                                                if any(engine_sounds.values())
                                                else {"skipped": "the engine's answers carry no audio"})
    finally:
        if engine is not None:
            engine.stop()
        tmp.cleanup()
    res["config"]["loadavg_at_end"] = os.getloadavg()
    print_report(res)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))
        print(f"wrote {args.json}")
    if args.png:
        plot(res, args.png)
        print(f"wrote {args.png}")
    return res


if __name__ == "__main__":
    main()
