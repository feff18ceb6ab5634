"""``python -m common.builtin``: the one command line that writes built-in models, as a user runs it."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _digests(model_dir: Path) -> dict[str, str]:
    return {str(p.relative_to(model_dir)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(model_dir.rglob("*")) if p.is_file()}


def test_command_line_writes_each_model_as_the_cache_does(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "common.builtin", "tiny-sd3", "tiny-flux-smooth", "--out", str(out)],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [str((out / n).resolve()) for n in ("tiny-sd3", "tiny-flux-smooth")]
    index = json.loads((out / "tiny-sd3" / "model_index.json").read_text())
    assert index["_class_name"] == "StableDiffusion3Pipeline"
    assert json.loads((out / "tiny-sd3" / "serving_defaults.json").read_text())["height"] == 64
    # Into the cache instead: the same files, under the spec's cache key.
    cached = subprocess.run([sys.executable, "-m", "common.builtin", "tiny-sd3", "--cache-dir", str(tmp_path / "c")],
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert cached.returncode == 0, cached.stderr
    cache_dir = Path(cached.stdout.strip())
    assert cache_dir.parent == (tmp_path / "c").resolve() and cache_dir.name.startswith("tiny-sd3-")
    assert _digests(cache_dir) == _digests(out / "tiny-sd3")


def test_command_line_refuses_an_unknown_name(tmp_path):
    run = subprocess.run([sys.executable, "-m", "common.builtin", "tiny-sd4", "--out", str(tmp_path)],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "invalid choice: 'tiny-sd4'" in run.stderr
    assert not any(tmp_path.iterdir())
