#!/usr/bin/env bash
# The GPU serving benchmark as one command: a Wan2.1-T2V-1.3B-shaped random-weight model in bfloat16 on
# one GPU, served by the engine and run through diffusers' WanPipeline in-process (bench/serve.py --preset
# wan-1.3b), after the CUDA tests and the GPU-to-GPU transfer benchmark, then weight sync into the GPU
# worker (bench/weight_sync.py, with CUDA IPC), then one request on denoise layouts (bench/denoise_layouts.py:
# --compile, and Ulysses 2 / CFG parallel where there are several GPUs), then releasing and resuming the
# workers' weights (bench/sleep.py: times, and each worker's torch.cuda.memory_allocated / memory_reserved
# before, released and resumed), then step caching on the small -smooth models (bench/cache.py: teacache and
# first_block against uncached requests, one at a time and 16 at once), then one image edit at a time against
# diffusers' QwenImageEditPipeline in-process (bench/serve.py --preset small-qwen-image-edit: the reference's
# image encode and its tokens beside the noise tokens). Sized for one H100/H200-class GPU in about 14 minutes.
#
#   bash bench/gpu.sh wheels            # on a machine with PyPI: fetch the Python packages a bare CUDA image
#                                       # lacks into .cache/gpu-wheels (CPython 3.12, x86-64); take that folder along
#   bash bench/gpu.sh                   # on the GPU machine: checks, model, benchmark, CUDA tests
#   GPU_BENCH_DRY=1 bash bench/gpu.sh   # the same steps with the tiny model on the CPU, to try the plumbing
#
# Environment:
#   OUT                     results and logs (default: bench/results/gpu, or bench/results/gpu-dry)
#   PYTHON                  interpreter (default: the first of .venv/bin/python, python3 whose torch sees a GPU)
#   DISAGG_DIFFUSION_CACHE  model cache (default ~/.cache/disagg-diffusion); the only thing written outside
#                           the repository apart from the engine's temporary directories
#   TEST_TIMEOUT, TRANSFER_TIMEOUT, GEN_TIMEOUT, SERVE_TIMEOUT, WSYNC_TIMEOUT, LAYOUT_TIMEOUT, SLEEP_TIMEOUT,
#   CACHE_TIMEOUT, EDIT_TIMEOUT
#                           seconds per step (default 90, 60, 120, 300, 300, 420, 240, 300, 150; typical runs
#                           take far less)
#   SERVE_ARGS              more bench/serve.py flags, e.g. SERVE_ARGS='--requests 4'
#
# Wheels found in .cache/gpu-wheels are installed (offline, no dependencies) into .cache/gpu-site, which goes
# first on PYTHONPATH: the engine's workers inherit it. Exit status: 0 when every step passed.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
WHEELS="$ROOT/.cache/gpu-wheels"
SITE="$ROOT/.cache/gpu-site"
# What the engine needs beyond a CUDA image's usual torch/numpy/httpx/msgpack/yaml/matplotlib/pytest;
# versions from the local environment, so both run the same code.
WHEEL_PACKAGES="diffusers transformers importlib_metadata lazy-importer pyzmq msgspec fastapi starlette uvicorn
 pydantic pydantic_core typing_inspection annotated_types annotated_doc opentelemetry-api typing_extensions ftfy
 wcwidth anyio h11 regex"

die() { echo "gpu.sh: $*" >&2; exit 2; }

if [ "${1:-}" = "wheels" ]; then
    py="${PYTHON:-$ROOT/.venv/bin/python}"
    [ -x "$py" ] || py=python3
    pins=$("$py" - $WHEEL_PACKAGES <<'EOF'
import importlib.metadata as m, sys
print(" ".join(f"{name}=={m.version(name)}" for name in sys.argv[1:]))
EOF
    ) || die "cannot read the local package versions with $py"
    mkdir -p "$WHEELS"
    # shellcheck disable=SC2086  # one argument per pin
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" $pins || die "pip download failed"
    du -sh "$WHEELS"
    echo "carry .cache/gpu-wheels to the GPU machine (it is ignored by git), then run: bash bench/gpu.sh"
    exit 0
fi
[ $# -eq 0 ] || die "usage: bash bench/gpu.sh [wheels]"

DRY="${GPU_BENCH_DRY:-0}"
if [ "$DRY" = 1 ]; then
    OUT="${OUT:-$ROOT/bench/results/gpu-dry}"
else
    OUT="${OUT:-$ROOT/bench/results/gpu}"
fi
export PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1  # everything is local: never wait on a hub that cannot be reached

# ---- interpreter and packages ----------------------------------------------------------------------------
has_gpu() { "$1" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ "$DRY" = 1 ]; then
    PY="$ROOT/.venv/bin/python"
    [ -x "$PY" ] || PY=python3
else
    PY=python3
    for cand in "$ROOT/.venv/bin/python" python3; do
        if command -v "$cand" >/dev/null 2>&1 && has_gpu "$cand"; then
            PY="$cand"
            break
        fi
    done
fi
# Fail fast: this machine cannot install a CUDA torch (no network).
if [ "$DRY" != 1 ] && ! has_gpu "$PY"; then
    die "torch.cuda.is_available() is False (python: $PY; without PYTHON, .venv/bin/python and python3 were
tried): no usable GPU or a CPU-only torch. Use a CUDA build of torch, or GPU_BENCH_DRY=1 for a CPU dry run."
fi
mkdir -p "$OUT" || die "cannot create $OUT"
OUT="$(cd "$OUT" && pwd)"

# (Not in a dry run: the wheels are for the GPU machine's CPython 3.12; the local environment has it all.)
if [ "$DRY" != 1 ] && [ -n "$(ls "$WHEELS"/*.whl 2>/dev/null)" ]; then
    echo "== installing $(ls "$WHEELS"/*.whl | wc -l) wheels from .cache/gpu-wheels into .cache/gpu-site"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl || die "installing the wheels failed (they are for CPython 3.12 on x86-64)"
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi

"$PY" - "$DRY" <<'EOF' 2>&1 | tee "$OUT/env.txt" || die "environment check failed (see above)"
import importlib, importlib.metadata as m, os, platform, sys
dry = sys.argv[1] == "1"
missing = []
for mod in ("torch", "diffusers", "transformers", "tokenizers", "safetensors", "zmq", "msgspec", "msgpack",
            "fastapi", "uvicorn", "pydantic", "httpx", "yaml", "ftfy", "matplotlib", "pytest"):
    try:
        importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - any failure to import is the same problem here
        missing.append(f"{mod} ({type(e).__name__}: {e})")
if not missing:
    try:  # imports the pipeline's modules: catches a diffusers/transformers/torch mismatch now
        from diffusers import WanPipeline  # noqa: F401
    except Exception as e:  # noqa: BLE001
        missing.append(f"diffusers.WanPipeline ({type(e).__name__}: {e})")
if missing:
    sys.exit("missing or broken Python packages:\n  " + "\n  ".join(missing)
             + "\nOn a machine with PyPI run `bash bench/gpu.sh wheels` and bring .cache/gpu-wheels along.")
import torch
print(f"python {platform.python_version()} {sys.executable}; cpus {os.cpu_count()}")
print("; ".join(f"{p} {m.version(p)}" for p in ("torch", "diffusers", "transformers", "tokenizers")))
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"GPU: {torch.cuda.get_device_name(0)}, {p.total_memory / 2**30:.0f} GiB, "
          f"{torch.cuda.device_count()} visible; CUDA {torch.version.cuda}")
elif not dry:
    sys.exit("torch.cuda.is_available() is False: no usable GPU (driver, CUDA_VISIBLE_DEVICES, CPU-only torch?)")
else:
    print("dry run: CPU only")
EOF

if [ "$DRY" = 1 ]; then
    MODEL=tiny
    # The GPU preset's plumbing (bfloat16 for engine and baseline, its levels and tolerance) on the CPU
    # with the tiny model's own sizes.
    SERVE=(--preset wan-1.3b --model tiny --device cpu --requests 4)
    TRANSFER=(--device cpu --sizes 1 16 --repeats 3)
    WSYNC=(--models tiny --repeats 1)
    LAYOUTS=(--preset tiny --device cpu --repeats 1 --rows diffusers one compile cfg2)
    SLEEP=(--model tiny --repeats 1)
    CACHE=(--models tiny-smooth --steps 6 --requests 1 --concurrency 2 --thresholds 0.08)
    EDIT=(--preset small-qwen-image-edit --model tiny-qwen-image-edit --device cpu --steps 2 --requests 2)
else
    MODEL=wan2.1-1.3b
    SERVE=(--preset wan-1.3b --device cuda --dtype bfloat16)
    TRANSFER=(--device cuda --sizes 1 16 64 256 --repeats 7)
    WSYNC=(--models wan2.1-1.3b --repeats 3)
    LAYOUTS=(--preset wan-1.3b --device cuda --repeats 3 --rows diffusers one compile)
    SLEEP=(--model wan2.1-1.3b --repeats 3)
    # The 1.3B model has no -smooth variant (a random time MLP makes TeaCache's signal meaningless): the small
    # ones at their Wan default size, 50 steps.
    CACHE=(--models small-smooth small-flux-smooth --height 128 --width 128 --num-frames 9 --requests 3)
    # float32 as on the CPU (the parity check's 1e-4); the workers on the GPU (the compact topology).
    EDIT=(--preset small-qwen-image-edit --device cuda)
    if [ "$("$PY" -c 'import torch; print(torch.cuda.device_count())')" -ge 2 ]; then
        LAYOUTS+=(ulysses2 cfg2)  # each of those denoise workers takes two GPUs of the compact topology's round
    fi
fi

failed=()
step() {  # step NAME TIMEOUT CMD...: run CMD, log to $OUT/NAME.log; SIGINT at the limit lets Python clean up
    local name=$1 limit=$2 rc t0=$SECONDS
    shift 2
    echo "== $name (limit ${limit}s): $*"
    timeout -s INT -k 20 "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    rc=${PIPESTATUS[0]}
    echo "== $name: exit $rc after $((SECONDS - t0))s"
    [ "$rc" -eq 0 ] || failed+=("$name (exit $rc)")
    return "$rc"
}

# ---- 1. CUDA tests (first: quick, and what the other numbers rest on) -------------------------------------
tests=(tests/test_cuda*.py)
if [ -e "${tests[0]}" ]; then
    step cuda-tests "${TEST_TIMEOUT:-90}" "$PY" -m pytest -q -p no:cacheprovider "${tests[@]}"
else
    echo "== cuda-tests: none (no tests/test_cuda*.py)"
fi

# ---- 2. one tensor GPU to GPU between two processes: host staging vs CUDA IPC --------------------------------
step transfer "${TRANSFER_TIMEOUT:-60}" "$PY" bench/transfer.py "${TRANSFER[@]}" --json "$OUT/transfer-gpu.json"

# ---- 3. model ----------------------------------------------------------------------------------------------
if step model "${GEN_TIMEOUT:-120}" "$PY" -m common.builtin "$MODEL"; then
    du -sh "$(tail -n 1 "$OUT/model.log")" 2>/dev/null
    # ---- 4. benchmark ------------------------------------------------------------------------------------------
    # shellcheck disable=SC2086  # SERVE_ARGS is a flag list
    step serve "${SERVE_TIMEOUT:-300}" "$PY" bench/serve.py "${SERVE[@]}" ${SERVE_ARGS:-} \
        --json "$OUT/serve-gpu.json" --png "$OUT/serve-gpu.png"
    # ---- 5. weight sync into GPU workers: disk, shared memory, CUDA IPC, gloo --------------------------------
    step weight-sync "${WSYNC_TIMEOUT:-300}" "$PY" bench/weight_sync.py "${WSYNC[@]}" --json "$OUT/weight-sync-gpu.json"
    # ---- 6. one request on denoise layouts: eager, --compile, multi-GPU workers --------------------------------
    step layouts "${LAYOUT_TIMEOUT:-420}" "$PY" bench/denoise_layouts.py "${LAYOUTS[@]}" --json "$OUT/layouts-gpu.json"
    # ---- 7. releasing and resuming the weights (a colocated trainer): times and each worker's GPU memory --------
    step sleep "${SLEEP_TIMEOUT:-240}" "$PY" bench/sleep.py "${SLEEP[@]}" --json "$OUT/sleep-gpu.json"
fi
# ---- 8. step caching: teacache and first_block against uncached requests (built-in models, generated here) ----
step cache "${CACHE_TIMEOUT:-300}" "$PY" bench/cache.py "${CACHE[@]}" --json "$OUT/cache-gpu.json"
# ---- 9. image editing: one request at a time against QwenImageEditPipeline, the reference's image encode ------
step serve-edit "${EDIT_TIMEOUT:-150}" "$PY" bench/serve.py "${EDIT[@]}" --json "$OUT/serve-edit-gpu.json"

echo "== results in $OUT: $(cd "$OUT" && ls | tr '\n' ' ')"
if [ ${#failed[@]} -gt 0 ]; then
    echo "== FAILED: ${failed[*]}"
    exit 1
fi
echo "== all steps passed"
