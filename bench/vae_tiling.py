"""VAE decode whole vs tiled: the decode's peak memory, its time and how far the tiles move the frames.

    python bench/vae_tiling.py [--cases wan qwen-image sd3] [--frames 5] [--device cpu|cuda] [--json FILE]

Each case builds a VAE of its family's class with random weights (seed 0; the real models' layouts with
narrower channels, so that a CPU decodes a large picture in seconds: see ``CASES``), and decodes the same latents
through the family's decoder (``common/families/*/vae.py``, what the decode worker runs) twice, each in a fresh
process: ``--vae-tiling off`` and ``on`` with diffusers' own tile sizes (Wan and Qwen-Image: 256-pixel tiles 192
apart; AutoencoderKL: its config's ``sample_size``, 512 here, with a quarter overlap).

Peak: what the decode added to the process's peak, read as the decode worker's ``peak_memory`` reads it
(``common/runtime/peak_memory.py``): on the CPU the peak resident set during the decode (``VmHWM``, reset through
``/proc/self/clear_refs``) minus the resident set just before it (the VAE and latents already loaded); on a GPU
``torch.cuda.max_memory_allocated`` minus what was allocated before. Frames: the largest and the mean absolute
difference, tiled vs whole, in [0, 1] (random weights move seams far more than trained ones do).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.diffusion.vae_tiling import VaeTiling  # noqa: E402
from common.runtime.component_memory import memory_usage  # noqa: E402
from common.runtime.peak_memory import PeakMemory  # noqa: E402

MiB = 1 << 20
# case: what it decodes (frames, height, width) and the VAE's layout.
CASES = {
    "wan": dict(frames=5, height=480, width=832, vae="AutoencoderKLWan(base_dim=32) (Wan2.1's 96)"),
    "qwen-image": dict(frames=1, height=1024, width=1024, vae="AutoencoderKLQwenImage(base_dim=32) (Qwen-Image's 96)"),
    "sd3": dict(frames=1, height=1024, width=1024,
                vae="AutoencoderKL(block_out_channels=(32, 64, 128, 128), sample_size=512) (SD3's 128..512, 1024)"),
}


def _in_use(device: torch.device) -> int:
    """What the process holds now, as PeakMemory counts its peak: CUDA allocations, or the resident set."""
    usage = memory_usage({device})
    return usage[f"{device}.allocated"] if device.type == "cuda" else usage["rss"]


def _decoder(case: str, tiling: VaeTiling, device: torch.device):
    """The family's decoder around a seeded random VAE, and latents for the case's size."""
    c = CASES[case]
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if case == "wan":
        from diffusers import AutoencoderKLWan

        from common.families.wan.vae import WanDecoder

        decoder = WanDecoder(AutoencoderKLWan(base_dim=32).to(device).eval(), device, tiling)
        shape = (1, 16, (c["frames"] - 1) // 4 + 1, c["height"] // 8, c["width"] // 8)
        return decoder, torch.randn(shape, generator=g)
    if case == "qwen-image":
        from diffusers import AutoencoderKLQwenImage

        from common.families import read_model
        from common.builtin import ensure_builtin
        from common.families.qwen_image.vae import QwenImageDecoder

        info = read_model(ensure_builtin("tiny-qwen-image"))  # for its token grid: 2x2 latents per token, 8x VAE
        decoder = QwenImageDecoder(AutoencoderKLQwenImage(base_dim=32).to(device).eval(), device, tiling)
        packed = torch.randn(1, (c["height"] // 16) * (c["width"] // 16), 64, generator=g)
        return decoder, info.family.latents.unpack(packed, info, c["height"], c["width"])
    from diffusers import AutoencoderKL

    from common.diffusion.parts.decoder import AutoencoderKLDecoder

    vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, sample_size=512, layers_per_block=2,
                        block_out_channels=(32, 64, 128, 128), norm_num_groups=32,
                        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                        scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False)
    return AutoencoderKLDecoder(vae.to(device).eval(), device, tiling), torch.randn(1, 16, c["height"] // 8,
                                                                                    c["width"] // 8, generator=g)


def measure_one(case: str, mode: str, out: Path, device: torch.device) -> dict:
    """In this process: one decode, its peak above the loaded state, its time; the frames saved to ``out``."""
    c = CASES[case]
    decoder, latents = _decoder(case, VaeTiling(mode), device)
    meter = PeakMemory(device)
    meter.reset()
    before = _in_use(device)
    t0 = time.perf_counter()
    frames = decoder.decode(latents, c["height"], c["width"])
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    peak = meter.read() - before
    save_file({"frames": frames.cpu().contiguous()}, out)
    return {"peak_bytes": peak, "seconds": seconds, "frames_bytes": frames.numel() * 4}


def run_case(case: str, threads: int, device: str) -> dict:
    row = {"case": case, **{k: CASES[case][k] for k in ("frames", "height", "width", "vae")}}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("off", "on"):
            out = Path(tmp) / f"{mode}.safetensors"
            r = subprocess.run([sys.executable, __file__, "--one", case, mode, str(out), "--threads", str(threads),
                                "--frames", str(CASES["wan"]["frames"]), "--device", device], capture_output=True,
                               text=True, check=True)
            row[mode] = json.loads(r.stdout.strip().splitlines()[-1])
        whole, tiled = (load_file(Path(tmp) / f"{mode}.safetensors")["frames"] for mode in ("off", "on"))
    diff = (tiled - whole).abs()
    row.update(max_diff=diff.max().item(), mean_diff=diff.mean().item(),
               peak_ratio=row["on"]["peak_bytes"] / row["off"]["peak_bytes"],
               time_ratio=row["on"]["seconds"] / row["off"]["seconds"])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--frames", type=int, default=None, help="the wan case's frames (4k+1; default 5)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", default=None)
    p.add_argument("--one", nargs=3, metavar=("CASE", "MODE", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.frames:
        CASES["wan"]["frames"] = args.frames
    torch.set_num_threads(args.threads)
    if args.one:
        case, mode, out = args.one
        print(json.dumps(measure_one(case, mode, Path(out), torch.device(args.device))))
        return
    rows = [run_case(case, args.threads, args.device) for case in args.cases]
    print(f"{'case':<11} {'F x H x W':>15} {'whole MiB':>10} {'tiled MiB':>10} {'ratio':>6} {'whole s':>8} "
          f"{'tiled s':>8} {'max |d|':>8} {'mean |d|':>9}")
    for r in rows:
        size = f"{r['frames']}x{r['height']}x{r['width']}"
        print(f"{r['case']:<11} {size:>15} {r['off']['peak_bytes'] / MiB:>10.0f} {r['on']['peak_bytes'] / MiB:>10.0f} "
              f"{r['peak_ratio']:>6.2f} {r['off']['seconds']:>8.1f} {r['on']['seconds']:>8.1f} "
              f"{r['max_diff']:>8.3f} {r['mean_diff']:>9.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
