"""GRPO-style group rollouts: one prompt's group of N samples through the engine, next to in-process baselines.

    python bench/rollout_group.py                              # presets tiny and small, one after the other
    python bench/rollout_group.py --preset tiny --repeats 1    # quick: one timed run of each row
    python bench/rollout_group.py --preset small --n 4
    python bench/rollout_group.py --preset tiny-sd3 small-sd3  # SD3: num_images_per_prompt=N
    python bench/rollout_group.py --preset tiny-flux tiny-qwen-image   # FLUX.1, Qwen-Image (packed latents)
    python bench/rollout_group.py --preset small-flux small-qwen-image
    python bench/rollout_group.py --preset tiny --url http://127.0.0.1:8000   # a running engine (one preset)
    python bench/rollout_group.py --max-batch-size 16 --json bench/results/rollout-group.json

An RL trainer (Flow-GRPO and the like) asks for a *group*: N samples of one prompt with seeds seed, seed+1, ...,
with the SDE step's log-probs. This measures what one group (and, on the tiny presets, four groups) costs
through the engine against doing the same work in this process, side by side in one run; the machine is
noisy, so read the ratios rather than the seconds.

Per preset (latent output throughout; ``tiny``: the tiny model, 32x32, 5 frames, 8 steps, n=16; ``small``:
the ~17M model, 128x128, 9 frames, 10 steps, n=8; both CFG with guidance 4.0 and the empty negative prompt;
images, no ``num_frames``, from here on: SD3, CFG with guidance 4.5: ``tiny-sd3``, 64x64, 4 steps, n=16, and
``small-sd3``, the ~19.5M transformer, 256x256, 10 steps, n=16; FLUX.1 as Flow-GRPO's FLUX.1-dev settings
scaled down, embedded guidance 3.5 (``guidance_scale``), no true CFG, no negative prompt: ``tiny-flux``,
64x64, 4 steps, n=16, and ``small-flux``, 256x256, 10 steps, n=16; Qwen-Image as verl-omni's recipe, true CFG
4.0 (``true_cfg_scale``) with the negative prompt " ", no ``guidance_scale`` (its transformer has no guidance
embedding): ``tiny-qwen-image``, 64x64, 4 steps, n=16, and ``small-qwen-image``, 256x256, 10 steps, n=16;
each the built-in model of the preset's name):

1. Starts an engine (``launch.py --model M --max-batch-size B --dtype float32``, the engine's own thread
   settings) on a free loopback port, or uses ``--url``; loads the family's diffusers pipeline
   (``WanPipeline``, ``StableDiffusion3Pipeline``, ``FluxPipeline``, ``QwenImagePipeline``) from the
   directory the engine serves into this process, float32 on the CPU, ``torch.set_num_threads(os.cpu_count())``.
2. Rows, each once untimed (warm-up), then ``--repeats`` timed rounds (median reported); a round runs every
   row once, one after another, so that machine noise hits them alike, and nothing else runs meanwhile:
   - ``engine rollout n=N (sde)``: ``POST /rollout/generate`` with ``sde_type "sde"``, ``noise_level 0.7``
     and the preset's guidance fields (``negative_prompt``, ``guidance_scale``, ``true_cfg_scale``: those it
     sets): wall time of the HTTP call (msgpack response);
   - ``engine rollout n=N (rollout=false, UniPC)``: the same with ``"rollout": false`` (the serving scheduler:
     UniPC for Wan, flow-match Euler for the image families, named in the row);
   - ``diffusers batch``: ``pipe(..., num_videos_per_prompt=N`` (images: ``num_images_per_prompt=N``)
     ``, generator=[one per seed], output_type="latent")`` with the same guidance fields;
   - ``flow-grpo loop``: an in-process rollout loop as Flow-GRPO writes it: ``encode_prompt`` (N videos /
     images per prompt; the negative prompt's too with guidance), ``prepare_latents`` with one generator per
     seed (FLUX, Qwen-Image: packed, with FLUX's ``latent_image_ids`` / Qwen-Image's ``img_shapes``), the
     flow-match Euler schedule with the model's shift (``common.diffusion.schedulers``; FLUX, Qwen-Image: the
     pipeline's ``mu`` of the packed sequence length from the scheduler config and sigmas
     ``linspace(1, 1/N, N)``), and per step one batched transformer forward of N for the conditional and one for
     the unconditional pass (SD3: one forward of 2N, [uncond, cond], as Flow-GRPO's SD3 pipeline and diffusers'
     batch them; FLUX without true CFG: the conditional one alone, with the embedded guidance; FLUX and
     Qwen-Image take ``timestep / 1000``), ``v_u + g (v_c - v_u)`` (Qwen-Image: then rescaled to the
     conditional output's norm per token, as ``QwenImagePipeline``), then the project's
     ``common.diffusion.sde.sde_step`` collecting the log-probs. Each sample's step noise is drawn from its own
     generator (passed as ``noise=``) in one sample's latent shape (packed for FLUX and Qwen-Image), as the
     engine draws it, so the loop's trajectory is the engine's;
   - the tiny presets only (tiny, tiny-sd3, tiny-flux, tiny-qwen-image): ``4 groups concurrent``: 4 prompts'
     SDE groups POSTed at once, wall time until all 4 are answered; ``4 groups sequential (engine)`` one after
     another; and in-process the flow-grpo loop and the diffusers batch for the same 4 prompts, one after another.
   Every timed call has a prompt of its own (the encoder's prompt cache never answers one); the engine row 2
   and the diffusers batch of a round share theirs, as do engine row 1 and the flow-grpo loop, for the checks.
   Each run also records the CPU other processes took meanwhile (/proc, ``bench/serve.py``'s ``CpuMeter``);
   a warning names the rows where that exceeded 0.2 cores.
3. Checks (from the timed runs): max |engine rollout=false latents - diffusers latents| over the group
   (expected <= 1e-4 in float32), and max |engine sde - flow-grpo loop| over the latents and the log-probs.

Prints a table per preset (seconds; ratio to the diffusers batch; for the 4-group rows, ratios to the 4
sequential flow-grpo loops and to the 4 sequential diffusers batches), the targets (one group <= 1.0x the
diffusers batch and the flow-grpo loop; on the tiny presets, 4 concurrent groups <= 0.7x 4 sequential
in-process) and
whether they are met. ``--json`` writes every number, every timed run included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import msgpack
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.serve import CpuMeter  # noqa: E402
from common.protocol.http_tensors import body_to_tensor  # noqa: E402
from common.protocol.messages import GenerationParams  # noqa: E402
from common.runtime.engine_process import EngineProcess  # noqa: E402
from common.diffusion import schedulers  # noqa: E402
from common.diffusion.model_info import ModelInfo  # noqa: E402
from common.families import read_model  # noqa: E402
from common.diffusion.policy import sigma_max  # noqa: E402
from common.diffusion.sde import sde_step  # noqa: E402

MSGPACK = "application/msgpack"
SDE_TYPE, NOISE_LEVEL = "sde", 0.7
TOLERANCE = 1e-4  # float32: batched or not, engine and diffusers agree to rounding
GROUPS = 4  # prompts in the multi-group rows (tiny)

# guidance: the request's guidance_scale (None: not sent): Wan's and SD3's classifier-free scale, the embedded
# guidance of the families whose classifier-free scale is true_cfg (FLUX, Qwen-Image: their presets name it;
# None: no true CFG, not sent); negative_prompt: sent with them (None: not sent).
PRESETS = {
    "tiny": dict(model="tiny", height=32, width=32, num_frames=5, steps=8, guidance=4.0, negative_prompt="",
                 n=16, repeats=3, multi_group=True),
    "small": dict(model="small", height=128, width=128, num_frames=9, steps=10, guidance=4.0, negative_prompt="",
                  n=8, repeats=1, multi_group=False),
    # SD3 (images: no num_frames; diffusers' num_images_per_prompt), Flow-GRPO's SD3.5 guidance 4.5.
    "tiny-sd3": dict(model="tiny-sd3", height=64, width=64, num_frames=None, steps=4, guidance=4.5,
                     negative_prompt="", n=16, repeats=3, multi_group=True),
    "small-sd3": dict(model="small-sd3", height=256, width=256, num_frames=None, steps=10, guidance=4.5,
                      negative_prompt="", n=16, repeats=1, multi_group=False),
    # FLUX.1-dev as Flow-GRPO rolls it out, scaled down: embedded guidance 3.5, no true CFG (one forward of N
    # per step), packed latents; the models' default sizes.
    "tiny-flux": dict(model="tiny-flux", height=64, width=64, num_frames=None, steps=4, guidance=3.5,
                      negative_prompt=None, true_cfg=None, n=16, repeats=3, multi_group=True),
    "small-flux": dict(model="small-flux", height=256, width=256, num_frames=None, steps=10, guidance=3.5,
                       negative_prompt=None, true_cfg=None, n=16, repeats=1, multi_group=False),
    # Qwen-Image as verl-omni's recipe rolls it out: true CFG 4.0 with the negative prompt " " (two forwards of
    # N per step, the pipeline's norm rescale); its transformer takes no embedded guidance.
    "tiny-qwen-image": dict(model="tiny-qwen-image", height=64, width=64, num_frames=None, steps=4, guidance=None,
                            negative_prompt=" ", true_cfg=4.0, n=16, repeats=3, multi_group=True),
    "small-qwen-image": dict(model="small-qwen-image", height=256, width=256, num_frames=None, steps=10,
                             guidance=None, negative_prompt=" ", true_cfg=4.0, n=16, repeats=1, multi_group=False),
}

PROMPTS = [
    "a red fox runs through the snow at dawn",
    "an astronaut floats above the ocean, cinematic lighting",
    "a lonely lighthouse in a storm, aerial view",
    "a golden retriever jumps into a lake in summer",
    "a paper boat drifts down a rainy street",
    "a dragon sleeps on a mountain under the stars",
]

# Row names, in table order.
ROW_SDE = "engine rollout n={n} (sde)"
ROW_UNIPC = "engine rollout n={n} (rollout=false, {scheduler})"
# The serving schedulers' short names in that row.
SCHEDULER_NAMES = {"UniPCMultistepScheduler": "UniPC", "FlowMatchEulerDiscreteScheduler": "Euler"}
ROW_DIFF = "diffusers batch"
ROW_LOOP = "flow-grpo loop"
ROW_CONC = f"{GROUPS} groups concurrent (engine, sde)"
ROW_SEQ_ENGINE = f"{GROUPS} groups sequential (engine, sde)"
ROW_SEQ_LOOP = f"{GROUPS} groups sequential in-process (flow-grpo loop)"
ROW_SEQ_DIFF = f"{GROUPS} groups sequential in-process (diffusers batch)"


class Prompts:
    """A fresh prompt for every timed call, so that no cache (the encoder's) answers one."""

    def __init__(self) -> None:
        self.count = 0

    def next(self, tag: str) -> str:
        self.count += 1
        return f"{PROMPTS[self.count % len(PROMPTS)]}, {tag} {self.count}"


# --------------------------------------------------------------------------
# Engine side
# --------------------------------------------------------------------------


def rollout_body(cfg: dict, prompt: str, seed: int, rollout: bool) -> dict:
    body = {"prompt": prompt, "seed": seed, "n": cfg["n"], "height": cfg["height"], "width": cfg["width"],
            "num_frames": cfg["num_frames"], "num_inference_steps": cfg["steps"], **guidance_fields(cfg),
            "output_type": "latent", "rollout": rollout, "sde_type": SDE_TYPE, "noise_level": NOISE_LEVEL}
    if cfg["num_frames"] is None:  # an image family: one frame, and no num_frames field
        del body["num_frames"]
    return body


def _decode(r: httpx.Response) -> dict:
    """The samples of a rollout answer as tensors, by seed; raises on an error answer."""
    if r.status_code != 200:
        raise RuntimeError(f"/rollout/generate answered {r.status_code}: {r.text[:500]}")
    data = msgpack.unpackb(r.content, raw=False)
    out = {}
    for s in data["samples"]:
        out[int(s["seed"])] = {"output": body_to_tensor(s["output"]),
                               "log_probs": body_to_tensor(s["log_probs"]) if "log_probs" in s else None,
                               "batch": s.get("batch")}
    return out


def post_group(http: httpx.Client, body: dict) -> tuple[float, dict]:
    """Wall time of one ``/rollout/generate`` call, and its samples."""
    t0 = time.perf_counter()
    r = http.post("/rollout/generate", content=json.dumps(body).encode(),
                  headers={"content-type": "application/json", "accept": MSGPACK})
    wall = time.perf_counter() - t0
    return wall, _decode(r)


async def _post_all(url: str, bodies: list[dict], timeout: float) -> tuple[float, list[dict]]:
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as http:
        async def one(body: dict) -> httpx.Response:
            return await http.post("/rollout/generate", content=json.dumps(body).encode(),
                                   headers={"content-type": "application/json", "accept": MSGPACK})

        t0 = time.perf_counter()
        answers = await asyncio.gather(*(one(b) for b in bodies))
        wall = time.perf_counter() - t0
    return wall, [_decode(r) for r in answers]


def post_concurrent(url: str, bodies: list[dict], timeout: float) -> tuple[float, list[dict]]:
    """All ``bodies`` posted at once; wall time until the last is answered."""
    return asyncio.run(_post_all(url, bodies, timeout))


def post_sequential(http: httpx.Client, bodies: list[dict]) -> tuple[float, list[dict]]:
    t0 = time.perf_counter()
    outs = [post_group(http, b)[1] for b in bodies]
    return time.perf_counter() - t0, outs


# --------------------------------------------------------------------------
# In-process side
# --------------------------------------------------------------------------


def guidance_fields(cfg: dict) -> dict:
    """The preset's guidance fields, under the names both the request body and the family's pipeline call take
    them: ``negative_prompt`` and ``guidance_scale`` (Wan, SD3: classifier-free guidance; FLUX.1-dev: the
    embedded guidance), ``true_cfg_scale`` (FLUX, Qwen-Image: true CFG with the negative prompt). A field the
    preset leaves None is not sent (Qwen-Image's transformer takes no guidance_scale; FLUX without true CFG
    takes no negative prompt)."""
    fields = {"negative_prompt": cfg["negative_prompt"], "guidance_scale": cfg["guidance"],
              "true_cfg_scale": cfg.get("true_cfg")}
    return {k: v for k, v in fields.items() if v is not None}


class LoopFamily:
    """What the flow-grpo loop does the family's own way: the text of the two passes, the initial latents, the
    schedule's request fields and one guided velocity. ``pipe``: the family's diffusers pipeline."""

    def __init__(self, pipe, cfg: dict, max_sequence_length: int):
        self.pipe, self.cfg, self.n = pipe, cfg, cfg["n"]
        self.max_sequence_length = max_sequence_length

    def text(self, prompt: str, device) -> tuple[dict, dict | None]:
        """(cond, uncond) transformer keywords for the N samples, in the form the family's :meth:`velocity` takes
        them (uncond None without guidance)."""
        raise NotImplementedError

    def latents(self, generators: list[torch.Generator], device) -> tuple[torch.Tensor, dict]:
        """The initial latents [N, ...], one generator per sample, and the keywords every forward takes besides."""
        raise NotImplementedError

    def schedule(self, latents: torch.Tensor) -> dict:
        """The request fields that set the rollout schedule beyond the step count (none: the template's own)."""
        return {}

    def velocity(self, model, latents: torch.Tensor, t: torch.Tensor, cond: dict, uncond: dict | None,
                 extra: dict) -> torch.Tensor:
        """The guided model output at timestep ``t`` for the N samples."""
        raise NotImplementedError


class WanLoop(LoopFamily):
    """WanPipeline: CFG with ``guidance_scale``, one batched forward of N for each pass."""

    def text(self, prompt, device):
        cond, uncond = self.pipe.encode_prompt(
            prompt=prompt, negative_prompt=self.cfg["negative_prompt"],
            do_classifier_free_guidance=self.cfg["guidance"] > 1.0, num_videos_per_prompt=self.n,
            max_sequence_length=self.max_sequence_length, device=device)
        return {"encoder_hidden_states": cond}, (None if uncond is None else {"encoder_hidden_states": uncond})

    def latents(self, generators, device):
        c = self.cfg
        return self.pipe.prepare_latents(self.n, self.pipe.transformer.config.in_channels, c["height"], c["width"],
                                         c["num_frames"], torch.float32, device, generators), {}

    def velocity(self, model, latents, t, cond, uncond, extra):
        h, ts, g = latents.to(model.dtype), t.expand(self.n), self.cfg["guidance"]
        v = model(hidden_states=h, timestep=ts, **cond, return_dict=False)[0]
        if uncond is not None:
            v_u = model(hidden_states=h, timestep=ts, **uncond, return_dict=False)[0]
            v = v_u + g * (v - v_u)
        return v


class SD3Loop(LoopFamily):
    """StableDiffusion3Pipeline: CFG with ``guidance_scale``, one forward of 2N rows, [uncond, cond], as
    Flow-GRPO's SD3 pipeline (and diffusers') batch them: the text's uncond is both halves, joined once."""

    def text(self, prompt, device):
        cfg_on = self.cfg["guidance"] > 1.0
        embeds, neg, pooled, neg_pooled = self.pipe.encode_prompt(
            prompt=prompt, prompt_2=None, prompt_3=None, negative_prompt=self.cfg["negative_prompt"],
            do_classifier_free_guidance=cfg_on, num_images_per_prompt=self.n,
            max_sequence_length=self.max_sequence_length, device=device)
        cond = {"encoder_hidden_states": embeds, "pooled_projections": pooled}
        if not cfg_on:
            return cond, None
        uncond = {"encoder_hidden_states": neg, "pooled_projections": neg_pooled}
        return cond, {k: torch.cat([uncond[k], cond[k]]) for k in cond}

    def latents(self, generators, device):
        c = self.cfg
        return self.pipe.prepare_latents(self.n, self.pipe.transformer.config.in_channels, c["height"], c["width"],
                                         torch.float32, device, generators), {}

    def velocity(self, model, latents, t, cond, uncond, extra):
        h, g = latents.to(model.dtype), self.cfg["guidance"]
        if uncond is None:
            return model(hidden_states=h, timestep=t.expand(self.n), **cond, return_dict=False)[0]
        v_u, v = model(hidden_states=torch.cat([h, h]), timestep=t.expand(2 * self.n), **uncond,
                       return_dict=False)[0].chunk(2)
        return v_u + g * (v - v_u)


class PackedLoop(LoopFamily):
    """FLUX and Qwen-Image: packed latents from the pipeline's ``prepare_latents``; flow-match Euler with the
    pipeline's dynamic shift (``mu`` of the image sequence length from the scheduler config) and sigmas
    ``linspace(1, 1/N, N)``; the transformer on ``timestep / 1000``, with the embedded guidance when the
    transformer has ``guidance_embeds``; true CFG (``true_cfg_scale`` with a negative prompt) as two forwards
    of N, cond then uncond, as the pipelines run them."""

    @property
    def true_cfg(self) -> bool:
        """True CFG runs with a scale above 1 and a negative prompt, as in the pipelines."""
        return (self.cfg.get("true_cfg") or 1.0) > 1.0 and self.cfg["negative_prompt"] is not None

    def encode(self, prompt: str, device) -> dict:
        raise NotImplementedError

    def text(self, prompt, device):
        return self.encode(prompt, device), (self.encode(self.cfg["negative_prompt"], device) if self.true_cfg
                                             else None)

    def schedule(self, latents):
        steps = self.cfg["steps"]
        config = self.pipe.scheduler.config
        seq_len = latents.shape[1]  # the packed tokens, as the pipelines take it
        return {"mu": schedulers.calculate_shift(seq_len, config) if schedulers.dynamic(config) else None,
                "sigmas": np.linspace(1.0, 1 / steps, steps).tolist()}

    def guide(self, v: torch.Tensor, v_u: torch.Tensor) -> torch.Tensor:
        return v_u + self.cfg["true_cfg"] * (v - v_u)

    def velocity(self, model, latents, t, cond, uncond, extra):
        h = latents.to(model.dtype)
        ts = t.expand(self.n).to(h.dtype) / 1000
        guidance = None
        if model.config.guidance_embeds:
            guidance = torch.full([1], self.cfg["guidance"], device=h.device, dtype=torch.float32).expand(self.n)
        v = model(hidden_states=h, timestep=ts, guidance=guidance, **cond, **extra, return_dict=False)[0]
        if uncond is None:
            return v
        v_u = model(hidden_states=h, timestep=ts, guidance=guidance, **uncond, **extra, return_dict=False)[0]
        return self.guide(v, v_u)


class FluxLoop(PackedLoop):
    """FluxPipeline: CLIP's pooled output and T5's sequence with their ``txt_ids``, the latents' ``img_ids``."""

    def encode(self, prompt, device):
        embeds, pooled, text_ids = self.pipe.encode_prompt(
            prompt=prompt, prompt_2=None, device=device, num_images_per_prompt=self.n,
            max_sequence_length=self.max_sequence_length)
        return {"encoder_hidden_states": embeds, "pooled_projections": pooled, "txt_ids": text_ids}

    def latents(self, generators, device):
        c = self.cfg
        latents, image_ids = self.pipe.prepare_latents(self.n, self.pipe.transformer.config.in_channels // 4,
                                                       c["height"], c["width"], torch.float32, device, generators)
        return latents, {"img_ids": image_ids}


class QwenImageLoop(PackedLoop):
    """QwenImagePipeline: Qwen2.5-VL's hidden states with their mask (None when no token is padding), the
    latents' ``img_shapes``, and true CFG rescaled to the conditional prediction's norm per token."""

    def encode(self, prompt, device):
        embeds, mask = self.pipe.encode_prompt(prompt=prompt, device=device, num_images_per_prompt=self.n,
                                               max_sequence_length=self.max_sequence_length)
        return {"encoder_hidden_states": embeds, "encoder_hidden_states_mask": mask}

    def latents(self, generators, device):
        c, pipe = self.cfg, self.pipe
        latents = pipe.prepare_latents(self.n, pipe.transformer.config.in_channels // 4, c["height"], c["width"],
                                       torch.float32, device, generators)
        grid = (c["height"] // pipe.vae_scale_factor // 2, c["width"] // pipe.vae_scale_factor // 2)
        return latents, {"img_shapes": [[(1, *grid)]] * self.n}

    def guide(self, v, v_u):
        combined = v_u + self.cfg["true_cfg"] * (v - v_u)
        return combined * (torch.norm(v, dim=-1, keepdim=True) / torch.norm(combined, dim=-1, keepdim=True))


# The flow-grpo loop's family parts, by the binding's family name.
LOOPS = {"wan": WanLoop, "sd3": SD3Loop, "flux": FluxLoop, "qwen-image": QwenImageLoop}


class InProcess:
    """The family's diffusers pipeline (WanPipeline, StableDiffusion3Pipeline, FluxPipeline, QwenImagePipeline)
    loaded once; the two in-process ways of producing a group."""

    def __init__(self, model_dir: Path, cfg: dict):
        import diffusers
        import diffusers.utils.logging as dlog
        import transformers.utils.logging as tlog

        dlog.disable_progress_bar()
        tlog.disable_progress_bar()
        self.cfg = cfg
        self.info = read_model(model_dir)
        self.video = self.info.family.video
        # The text length the engine uses: the model's default (Wan 512; tiny-sd3 32, not the pipeline's 256).
        self.max_sequence_length = self.info.defaults["max_sequence_length"]
        t0 = time.perf_counter()
        self.pipe = getattr(diffusers, self.info.family.pipeline).from_pretrained(model_dir, dtype=torch.float32)
        self.pipe.set_progress_bar_config(disable=True)
        self.load_s = time.perf_counter() - t0
        self.loop = LOOPS[self.info.family.family](self.pipe, cfg, self.max_sequence_length)
        # Flow-match Euler with the serving scheduler's shift and training steps (FLUX, Qwen-Image: its whole
        # dynamic-shift config), as the engine's rollouts.
        self.rollout_template = schedulers.rollout_template_for(schedulers.load_serving_template(self.info))

    def generators(self, seed: int) -> list[torch.Generator]:
        return [torch.Generator("cpu").manual_seed(seed + i) for i in range(self.cfg["n"])]

    def diffusers_batch(self, prompt: str, seed: int) -> torch.Tensor:
        """[N, C, F', H', W'] (SD3: [N, C, H', W']; FLUX, Qwen-Image: packed [N, seq, C * 4]) latents of the group
        through the pipeline's own call (its serving scheduler: UniPC for Wan, flow-match Euler for the others)."""
        c = self.cfg
        kw = dict(prompt=prompt, height=c["height"], width=c["width"], num_inference_steps=c["steps"],
                  generator=self.generators(seed), output_type="latent", max_sequence_length=self.max_sequence_length,
                  **guidance_fields(c))
        if self.video:
            return self.pipe(**kw, num_frames=c["num_frames"], num_videos_per_prompt=c["n"]).frames
        return self.pipe(**kw, num_images_per_prompt=c["n"]).images

    def flow_grpo_loop(self, prompt: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A Flow-GRPO-style rollout of the group: final latents [N, ...] and log-probs [N, steps]."""
        c, pipe, n, loop = self.cfg, self.pipe, self.cfg["n"], self.loop
        device = pipe._execution_device
        cond, uncond = loop.text(prompt, device)
        model = pipe.transformer
        gens = self.generators(seed)
        latents, extra = loop.latents(gens, device)
        params = GenerationParams(prompt=prompt, negative_prompt=c["negative_prompt"] or "", height=c["height"],
                                  width=c["width"], num_frames=c["num_frames"] if self.video else 1,
                                  num_inference_steps=c["steps"], guidance_scale=c["guidance"] or 1.0, seed=seed,
                                  output_type="latent", **loop.schedule(latents))
        scheduler = schedulers.build(self.rollout_template, params, device)
        sigmas = scheduler.sigmas
        s_max = sigma_max(sigmas)
        one = (1, *latents.shape[1:])
        log_probs = []
        for i, t in enumerate(scheduler.timesteps):
            v = loop.velocity(model, latents, t, cond, uncond, extra)
            # Each sample's noise from its own generator (after its initial noise), as the engine draws it: in
            # the shape of one sample's latents (FLUX, Qwen-Image: packed).
            noise = torch.cat([torch.randn(one, generator=gen, dtype=torch.float32) for gen in gens])
            step = sde_step(v, latents, sigmas[i], sigmas[i + 1], s_max, sde_type=SDE_TYPE, noise_level=NOISE_LEVEL,
                            noise=noise)
            latents = step.prev_sample
            if step.log_prob is not None:
                log_probs.append(step.log_prob)
        return latents, (torch.stack(log_probs, dim=1) if log_probs else torch.zeros(n, 0))


# --------------------------------------------------------------------------
# One preset
# --------------------------------------------------------------------------


def _frames(cfg: dict) -> str:
    return "image" if cfg["num_frames"] is None else f"{cfg['num_frames']} frames"


def _guidance(cfg: dict) -> str:
    """The preset's guidance in words: ``guidance 4.0``, ``embedded guidance 3.5``, ``true CFG 4.0``."""
    parts = []
    if cfg["guidance"] is not None:
        parts.append(f"{'embedded ' if 'true_cfg' in cfg else ''}guidance {cfg['guidance']}")
    if cfg.get("true_cfg") is not None:
        parts.append(f"true CFG {cfg['true_cfg']} (negative prompt {cfg['negative_prompt']!r})")
    return ", ".join(parts) or "no guidance"


def _max_diff(engine: dict, ref: torch.Tensor, seed: int, key: str = "output") -> float:
    """Max abs difference between the engine's samples (by seed) and the rows of ``ref`` ([N, ...])."""
    worst = 0.0
    for i in range(ref.shape[0]):
        e = engine[seed + i][key]
        worst = max(worst, (e.float().reshape(ref[i].shape) - ref[i].float()).abs().max().item())
    return worst


def run_preset(name: str, args) -> dict:
    cfg = dict(PRESETS[name])
    if args.n is not None:
        cfg["n"] = args.n
    repeats = args.repeats if args.repeats is not None else cfg["repeats"]
    n = cfg["n"]
    extra = ["--max-batch-size", str(args.max_batch_size), "--dtype", "float32",
             "--max-n", str(max(16, n)), "--max-pending", str(max(256, 2 * GROUPS * n))]
    load_start = os.getloadavg()
    engine = None
    print(f"\n== preset {name}: model {cfg['model']}, {cfg['height']}x{cfg['width']}, {_frames(cfg)}, "
          f"{cfg['steps']} steps, {_guidance(cfg)}, n={n}, repeats {repeats}", flush=True)
    if args.url:
        url = args.url.rstrip("/")
    else:
        print(f"starting engine: --model {cfg['model']} {' '.join(extra)}", flush=True)
        engine = EngineProcess(model=cfg["model"], extra=extra)
        url = engine.url
    times: dict[str, list[float]] = {}
    other_cores: dict[str, list[float]] = {}  # CPU other processes took during each timed run
    checks: dict[str, list[float]] = {"unipc_vs_diffusers": [], "sde_vs_loop_latents": [],
                                      "sde_vs_loop_log_probs": []}
    batch_seen: list[int] = []
    try:
        http = httpx.Client(base_url=url, timeout=args.request_timeout)
        health = http.get("/health").json()
        model_dir = Path(health["model"])
        info = read_model(model_dir)
        scheduler = info.scheduler_config.get("_class_name", "serving scheduler")
        row_sde = ROW_SDE.format(n=n)
        row_unipc = ROW_UNIPC.format(n=n, scheduler=SCHEDULER_NAMES.get(scheduler, scheduler))
        print(f"engine ready at {url}: {model_dir}; {len(health['workers'])} workers; "
              f"loading diffusers {info.family.pipeline} in-process", flush=True)
        torch.set_num_threads(os.cpu_count() or 1)
        local = InProcess(model_dir, cfg)
        prompts = Prompts()
        pids = [w["pid"] for w in health["workers"] if w.get("pid")] + ([engine.proc.pid] if engine else [])
        meter = CpuMeter(pids)  # this process and the engine's, against everything else on the machine

        def record(row: str, seconds: float, timed: bool) -> None:
            cpu = meter.stop()
            if timed:
                times.setdefault(row, []).append(seconds)
                if "cpu_cores_other" in cpu:
                    other_cores.setdefault(row, []).append(cpu["cpu_cores_other"])
            note = f"  (cores: ours {cpu['cpu_cores_ours']:.2f}, other {cpu['cpu_cores_other']:.2f})" if cpu else ""
            print(f"  {'' if timed else '(warm-up) '}{row:<52} {seconds:8.3f}s{note}", flush=True)
            meter.start()

        def timed_local(fn, *a):
            t0 = time.perf_counter()
            out = fn(*a)
            return time.perf_counter() - t0, out

        with torch.inference_mode():
            for r in range(repeats + 1):
                timed = r > 0
                seed = args.seed + 1000 * r
                p_sde, p_unipc = prompts.next("sde"), prompts.next("unipc")
                if cfg["multi_group"]:
                    conc = [rollout_body(cfg, prompts.next("group"), seed + 100 * k, True) for k in range(GROUPS)]
                    seq = [rollout_body(cfg, prompts.next("group"), seed + 100 * k, True) for k in range(GROUPS)]
                meter.start()
                # Engine rows (this process idle), then in-process rows (the engine idle).
                s, eng_sde = post_group(http, rollout_body(cfg, p_sde, seed, True))
                record(row_sde, s, timed)
                s, eng_unipc = post_group(http, rollout_body(cfg, p_unipc, seed, False))
                record(row_unipc, s, timed)
                batch_seen += [v["batch"] for v in (*eng_sde.values(), *eng_unipc.values()) if v["batch"]]
                if cfg["multi_group"]:
                    s, outs = post_concurrent(url, conc, args.request_timeout)
                    record(ROW_CONC, s, timed)
                    batch_seen += [v["batch"] for o in outs for v in o.values() if v["batch"]]
                    s, _ = post_sequential(http, seq)
                    record(ROW_SEQ_ENGINE, s, timed)
                s, ref = timed_local(local.diffusers_batch, p_unipc, seed)
                record(ROW_DIFF, s, timed)
                s, (lat, lps) = timed_local(local.flow_grpo_loop, p_sde, seed)
                record(ROW_LOOP, s, timed)
                if cfg["multi_group"]:
                    t0 = time.perf_counter()
                    for b in conc:
                        local.flow_grpo_loop(b["prompt"], b["seed"])
                    record(ROW_SEQ_LOOP, time.perf_counter() - t0, timed)
                    t0 = time.perf_counter()
                    for b in conc:
                        local.diffusers_batch(b["prompt"], b["seed"])
                    record(ROW_SEQ_DIFF, time.perf_counter() - t0, timed)
                meter.stop()
                checks["unipc_vs_diffusers"].append(_max_diff(eng_unipc, ref, seed))
                checks["sde_vs_loop_latents"].append(_max_diff(eng_sde, lat, seed))
                checks["sde_vs_loop_log_probs"].append(_max_diff(eng_sde, lps, seed, "log_probs"))
        http.close()
    finally:
        if engine is not None:
            engine.stop()
    med = {row: statistics.median(v) for row, v in times.items()}
    rows = []
    for row in (row_sde, row_unipc, ROW_DIFF, ROW_LOOP, ROW_CONC, ROW_SEQ_ENGINE, ROW_SEQ_LOOP, ROW_SEQ_DIFF):
        if row not in med:
            continue
        entry = {"row": row, "seconds": med[row], "runs_s": times[row], "vs_diffusers": med[row] / med[ROW_DIFF],
                 "other_cores_per_run": other_cores.get(row, []),
                 "samples_per_s": n * (GROUPS if row.startswith(f"{GROUPS} groups") else 1) / med[row]}
        if row.startswith(f"{GROUPS} groups"):
            entry["vs_4_seq_flow_grpo"] = med[row] / med[ROW_SEQ_LOOP]
            entry["vs_4_seq_diffusers"] = med[row] / med[ROW_SEQ_DIFF]
        rows.append(entry)
    targets = [
        {"target": f"one group ({row_sde}) <= 1.0x {ROW_DIFF}", "ratio": med[row_sde] / med[ROW_DIFF], "limit": 1.0},
        {"target": f"one group ({row_sde}) <= 1.0x {ROW_LOOP}", "ratio": med[row_sde] / med[ROW_LOOP], "limit": 1.0},
    ]
    if cfg["multi_group"]:
        targets += [
            {"target": f"{ROW_CONC} <= 0.7x {ROW_SEQ_LOOP}", "ratio": med[ROW_CONC] / med[ROW_SEQ_LOOP],
             "limit": 0.7},
            {"target": f"{ROW_CONC} <= 0.7x {ROW_SEQ_DIFF}", "ratio": med[ROW_CONC] / med[ROW_SEQ_DIFF],
             "limit": 0.7},
        ]
    for t in targets:
        t["met"] = t["ratio"] <= t["limit"]
    correctness = {k: max(v) for k, v in checks.items()}
    correctness["tolerance"] = TOLERANCE
    correctness["ok"] = all(correctness[k] <= TOLERANCE for k in checks)
    return {"preset": name, "config": {**cfg, "repeats": repeats, "seed": args.seed, "sde_type": SDE_TYPE,
                                       "noise_level": NOISE_LEVEL, "output_type": "latent"},
            "engine": {"url": url, "started_by_bench": engine is not None, "model_dir": str(model_dir),
                       "extra": extra if engine is not None else None,
                       "workers": [{k: w.get(k) for k in ("role", "index", "device", "pid")}
                                   for w in health["workers"]],
                       "largest_batch_seen": max(batch_seen) if batch_seen else None},
            "in_process": {"torch_threads": torch.get_num_threads(), "pipeline_load_s": local.load_s},
            "rows": rows, "targets": targets, "correctness": correctness, "checks_per_round": checks,
            "cpu_count": os.cpu_count(), "loadavg_at_start": load_start, "loadavg_at_end": os.getloadavg()}


# --------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------


def _f(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def print_report(res: dict) -> None:
    c, eng = res["config"], res["engine"]
    print(f"\npreset {res['preset']}: model {Path(eng['model_dir']).name}, {c['height']}x{c['width']}, "
          f"{_frames(c)}, {c['steps']} steps, {_guidance(c)}, latent output, n={c['n']}; "
          f"engine {'flags ' + ' '.join(eng['extra']) if eng['extra'] else eng['url'] + ' (external)'}, "
          f"largest denoise batch seen {eng['largest_batch_seen']}; in-process torch threads "
          f"{res['in_process']['torch_threads']}; median of {c['repeats']} timed run(s); CPU cores "
          f"{res['cpu_count']}; load average at start/end {res['loadavg_at_start'][0]:.1f}/"
          f"{res['loadavg_at_end'][0]:.1f}")
    head = (f"{'row':<54} {'seconds':>8} {'smp/s':>7} {'x diffusers':>12} "
            f"{'x 4 seq loop':>13} {'x 4 seq diff':>13}")
    print(head)
    print("-" * len(head))
    for r in res["rows"]:
        print(f"{r['row']:<54} {r['seconds']:>8.3f} {r['samples_per_s']:>7.1f} {r['vs_diffusers']:>12.2f} "
              f"{_f(r.get('vs_4_seq_flow_grpo')):>13} {_f(r.get('vs_4_seq_diffusers')):>13}")
    print("(x diffusers: seconds / the diffusers batch's; x 4 seq loop / diff: seconds / the 4 sequential "
          "in-process flow-grpo loops' / diffusers batches')")
    busy = [(r["row"], max(r["other_cores_per_run"])) for r in res["rows"]
            if r["other_cores_per_run"] and max(r["other_cores_per_run"]) > 0.2]
    if busy:
        print("WARNING: other processes used CPU during " + ", ".join(f"{n} ({c:.2f} cores)" for n, c in busy)
              + ": those numbers are skewed; rerun on an idle machine")
    print("targets:")
    for t in res["targets"]:
        print(f"  {t['target']}: {t['ratio']:.2f}x -> {'MET' if t['met'] else 'NOT MET'}")
    k = res["correctness"]
    print(f"correctness: max |engine rollout=false latents - diffusers latents| over the group "
          f"{k['unipc_vs_diffusers']:.2e}; max |engine sde - flow-grpo loop| latents "
          f"{k['sde_vs_loop_latents']:.2e}, log-probs {k['sde_vs_loop_log_probs']:.2e} -> "
          f"{'OK' if k['ok'] else 'MISMATCH'} (tolerance {k['tolerance']:g})")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    ap.add_argument("--preset", nargs="+", choices=sorted(PRESETS), default=["tiny", "small"],
                    help="presets to run, in order (default: tiny small)")
    ap.add_argument("--repeats", type=int, help="timed rounds per preset, median reported (tiny, tiny-sd3, "
                                                "tiny-flux, tiny-qwen-image: 3; small, small-sd3, small-flux, "
                                                "small-qwen-image: 1)")
    ap.add_argument("--n", type=int, help="samples per group (small: 8; the others: 16)")
    ap.add_argument("--max-batch-size", type=int, default=64, help="engine's launch.py --max-batch-size")
    ap.add_argument("--url", help="a running engine instead of starting one (only with one preset; its model "
                                  "must be the preset's, and its own flags apply)")
    ap.add_argument("--seed", type=int, default=0, help="first seed of the first round")
    ap.add_argument("--request-timeout", type=float, default=600.0, help="client timeout per request, s")
    ap.add_argument("--json", type=Path, help="write every number here")
    args = ap.parse_args(argv)
    if args.url and len(args.preset) != 1:
        ap.error("--url serves one model: give one --preset")
    if (args.repeats is not None and args.repeats < 1) or (args.n is not None and args.n < 1):
        ap.error("--repeats and --n must be >= 1")
    results = []
    for name in args.preset:
        results.append(run_preset(name, args))
    for res in results:
        print_report(res)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"torch": torch.__version__, "results": results}, indent=2))
        print(f"wrote {args.json}")
    return results


if __name__ == "__main__":
    main()
