"""launch.py's memory flags: VAE tiling (decode, and image-to-video's image encode) and the text encoder's device;
and how CPU workers use their threads (``--cpu-numerics``)."""

from __future__ import annotations

import argparse

import torch

from common.config.engine import CPU_NUMERICS
from common.config.topology import is_device
from common.diffusion.vae_tiling import DEFAULT_TILING_PIXELS, TILING_MODES


def _device(value: str) -> str:
    if not is_device(value):
        raise argparse.ArgumentTypeError(f"{value!r} is not a device: cpu, cuda or cuda:N")
    return value


def add_memory_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vae-tiling", choices=TILING_MODES, default="auto",
                   help="VAE decode (and image-to-video's image encode) in diffusers' tiles: auto above "
                        "--vae-tiling-pixels, on, off")
    p.add_argument("--vae-tiling-pixels", type=int, default=DEFAULT_TILING_PIXELS, metavar="PIXELS",
                   help="auto's budget: one sample's frames x height x width above which VAE calls run tiled "
                        f"(default {DEFAULT_TILING_PIXELS})")
    p.add_argument("--text-encoder-device", type=_device, default=None, metavar="DEVICE",
                   help="encoder workers run their text encoders on DEVICE (cpu, cuda or cuda:N; cpu: a GPU too "
                        "small for them beside the rest); default: the worker's own device")
    p.add_argument("--cpu-numerics", choices=CPU_NUMERICS, default="invariant",
                   help="invariant: workers compute at one CPU thread, so outputs are the same bits whatever the "
                        "topology's threads, the machine's cores or the batch; threaded: the topology's threads "
                        "(faster on a large CPU model; outputs then round with the thread count)")


def check_memory_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse what no worker could run, before any starts (with --ray the GPUs are the nodes', not checked here)."""
    if args.vae_tiling_pixels < 1:
        p.error("--vae-tiling-pixels must be >= 1")
    device = args.text_encoder_device
    if device is None or device == "cpu" or args.ray is not None:
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if int(device.partition(":")[2] or 0) >= count:
        p.error(f"--text-encoder-device {device}: this machine has {count} visible GPU(s)")


def memory_settings(args: argparse.Namespace) -> dict:
    """The flags' EngineConfig fields."""
    return {"vae_tiling": args.vae_tiling, "vae_tiling_pixels": args.vae_tiling_pixels,
            "text_encoder_device": args.text_encoder_device, "cpu_numerics": args.cpu_numerics}
