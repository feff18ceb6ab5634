"""``launch.py``'s flags for other engines' APIs, and the engine settings they make."""

from __future__ import annotations

import argparse

from common.diffusion.weights import resolve_weight_roots


def add_peer_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image-root", action="append", default=[], metavar="DIR", type=_directory,
                   help="requests may name image files below DIR (SGLang's image_path; repeatable); default: none")
    p.add_argument("--peer-api", choices=("native", "sglang"), default="native",
                   help="who answers root routes a peer protocol shares with bodies alike: the bare "
                        "release / resume_memory_occupation (sglang: SGLang's meaning, the weights kept)")
    p.add_argument("--sglang-tensors", choices=("bytes", "base64"), default="bytes",
                   help="SGLang answers' tensor data: safetensors bytes (sglang 0.5.23) or their base64 (older)")


def _directory(value: str) -> str:
    try:
        return resolve_weight_roots([value], "--image-root")[0]
    except ValueError as e:  # argparse's one-line error
        raise argparse.ArgumentTypeError(str(e).removeprefix("--image-root ")) from None


def peer_settings(args: argparse.Namespace) -> dict:
    """EngineConfig's fields from the flags."""
    return {"image_roots": resolve_weight_roots(args.image_root, "--image-root"), "peer_api": args.peer_api,
            "sglang_tensors": args.sglang_tensors}
