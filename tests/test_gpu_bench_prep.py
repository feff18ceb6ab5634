"""The GPU benchmark's pieces that can be checked without a GPU: the Wan2.1-1.3B-shaped spec, the cache keys
of the other specs, bench/serve.py's wan-1.3b preset and bench/gpu.sh's plumbing."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import serve  # noqa: E402
from common.config.engine import Limits  # noqa: E402
from common.builtin.cache import cache_key as _cache_key, keyed_fields as _keyed_fields  # noqa: E402
from common.builtin.specs.wan import SPECS, transformer_config, vae_config  # noqa: E402

SPEC = SPECS["wan2.1-1.3b"]

# transformer/config.json and vae/config.json of Wan-AI/Wan2.1-T2V-1.3B-Diffusers.
WAN21_13B_TRANSFORMER = dict(
    patch_size=[1, 2, 2], num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
)
WAN21_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                 temperal_downsample=[False, True, True], dropout=0.0)

# TinyWanSpec's fields before the ones that count in the cache key only when set.
ORIGINAL_FIELDS = {
    "name", "num_layers", "num_attention_heads", "attention_head_dim", "ffn_dim", "freq_dim", "text_dim",
    "text_layers", "text_heads", "text_d_ff", "text_d_kv", "vocab_size", "vae_base_dim", "flow_shift",
    "two_experts", "boundary_ratio", "seed", "height", "width", "num_frames", "num_inference_steps",
    "guidance_scale",
}


def test_transformer_and_vae_have_wan21_13b_shape():
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    cfg = transformer_config(SPEC)
    assert {**cfg, "patch_size": list(cfg["patch_size"])} == WAN21_13B_TRANSFORMER
    assert vae_config(SPEC) == WAN21_VAE
    with torch.device("meta"):  # shapes only: no memory, no init
        transformer = WanTransformer3DModel(**cfg)
        vae = AutoencoderKLWan(**vae_config(SPEC))
    assert sum(p.numel() for p in transformer.parameters()) == 1_418_996_800
    assert sum(p.numel() for p in vae.parameters()) == 126_892_531


def test_spec_text_encoder_and_defaults():
    assert (SPEC.text_dim, SPEC.text_heads * SPEC.text_d_kv, SPEC.text_d_ff) == (4096, 4096, 10240)
    assert SPEC.weights_dtype == "bfloat16"
    assert (SPEC.height, SPEC.width, SPEC.num_frames, SPEC.num_inference_steps, SPEC.guidance_scale) == \
        (480, 832, 81, 50, 5.0)


def test_existing_specs_keep_their_cache_keys():
    for name in ("tiny", "tiny-alt", "tiny-moe", "small"):
        spec = SPECS[name]
        assert set(_keyed_fields(spec)) == ORIGINAL_FIELDS, name
        assert _keyed_fields(spec) == {k: v for k, v in dataclasses.asdict(spec).items() if k in ORIGINAL_FIELDS}
    # Setting a newer field does change the key, so differently built models are cached apart.
    tiny = SPECS["tiny"]
    keys = {_cache_key(tiny), _cache_key(dataclasses.replace(tiny, weights_dtype="bfloat16")),
            _cache_key(dataclasses.replace(tiny, rope_max_seq_len=128)),
            _cache_key(dataclasses.replace(tiny, vae_dim_mult=(1, 2, 2, 2))),
            _cache_key(dataclasses.replace(tiny, vae_num_res_blocks=2))}
    assert len(keys) == 5
    assert _cache_key(dataclasses.replace(tiny, vae_dim_mult=[1, 1, 1, 1])) == _cache_key(tiny)


def test_wan_preset_flows_device_dtype_and_tolerance():
    args = serve.parse_args(["--preset", "wan-1.3b"])
    assert (args.model, args.device, args.dtype, args.tolerance) == ("wan2.1-1.3b", "cuda", "bfloat16", 0.25)
    assert args.launch_flags[-2:] == ["--dtype", "bfloat16"]
    # The request fits the model (WanPipeline's multiples, RoPE table) and the engine's default limits.
    h, w, f = args.height, args.width, args.num_frames
    assert h % 16 == 0 and w % 16 == 0 and f % 4 == 1
    assert max(h // 16, w // 16, (f - 1) // 4 + 1) <= SPEC.rope_max_seq_len
    limits = Limits()
    assert h <= limits.max_height and w <= limits.max_width and f <= limits.max_num_frames
    assert args.steps <= limits.max_steps


def test_dtype_defaults_and_conflicts():
    args = serve.parse_args([])
    assert (args.device, args.dtype, args.tolerance) == ("cpu", "float32", 1e-4)
    # on the CPU the engine computes on the threads the topology gives, as the baseline on all cores
    assert args.launch_flags == ["--dtype", "float32", "--cpu-numerics", "threaded"]
    assert "--cpu-numerics" not in serve.parse_args(["--extra=--cpu-numerics invariant"]).launch_flags[-2:]
    # A --dtype inside --extra is the engine's and the baseline's.
    args = serve.parse_args(["--extra=--max-batch-size 2 --dtype=bfloat16"])
    assert args.dtype == "bfloat16" and args.launch_flags == ["--max-batch-size", "2", "--dtype=bfloat16",
                                                             "--cpu-numerics", "threaded"]
    with pytest.raises(SystemExit):
        serve.parse_args(["--dtype", "float32", "--extra", "--dtype bfloat16"])


def test_gpu_script_syntax_and_fail_fast_without_gpu(tmp_path):
    script = ROOT / "bench" / "gpu.sh"
    subprocess.run(["bash", "-n", str(script)], check=True)
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: the no-GPU path does not apply")
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    env.pop("GPU_BENCH_DRY", None)
    r = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "torch.cuda.is_available() is False" in r.stdout + r.stderr
    assert not (tmp_path / "model.log").exists()  # stopped before generating anything
