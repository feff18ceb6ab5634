"""The ``-smooth`` built-ins (common/builtin/smooth_time.py): each tiny family's builds, loads, runs, and its
time embedding moves a few percent per step where the base's moves tens, with no other weight changed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import diffusers
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from time_embedding import changes  # noqa: E402

from common.diffusion.compiled import warm_up  # noqa: E402
from common.diffusion.model_info import SERVING_DEFAULTS_FILE  # noqa: E402
from common.diffusion.policy import Policy  # noqa: E402
from common.families import read_model  # noqa: E402
from common.builtin import BUILTINS, SMOOTH_BASES, ensure_builtin  # noqa: E402
from common.builtin.smooth_time import (EXPERTS, SmoothTimeSpec, _OwnSinusoids, column_gains, first_layer,  # noqa: E402
                                       time_embedders)
from common.builtin.cache import cache_key as _cache_key  # noqa: E402

TINY = ("tiny", "tiny-moe", "tiny-sd3", "tiny-flux", "tiny-qwen-image", "tiny-wan-i2v", "tiny-sana", "tiny-z-image",
        "tiny-flux2-klein", "tiny-hunyuan-video15")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """Each tiny base's directory and its -smooth one's, built fresh (in a private cache) once."""
    cache = tmp_path_factory.mktemp("smooth")
    return lambda base: (ensure_builtin(base), ensure_builtin(f"{base}-smooth", cache))


def _experts(model_dir: Path) -> list[str]:
    return [e for e in EXPERTS if (model_dir / e / "config.json").is_file()]


def test_every_base_has_a_smooth_variant_of_its_own_cache_key():
    for base in SMOOTH_BASES:
        spec = BUILTINS[f"{base}-smooth"]
        assert isinstance(spec, SmoothTimeSpec) and spec.base is BUILTINS[base]
        assert _cache_key(spec).startswith(f"{base}-smooth-") and _cache_key(spec) == _cache_key(
            SmoothTimeSpec(name=spec.name, base=BUILTINS[base], keep_rad=spec.keep_rad, drop_rad=spec.drop_rad))


@pytest.mark.parametrize("base", TINY)
def test_only_the_time_embedders_first_layer_changes(base, built):
    base_dir, smooth_dir = built(base)
    for name in ("model_index.json", SERVING_DEFAULTS_FILE):
        assert (smooth_dir / name).read_text() == (base_dir / name).read_text()
    assert _experts(smooth_dir) == _experts(base_dir)
    for expert in _experts(base_dir):
        cls = getattr(diffusers, json.loads((base_dir / expert / "config.json").read_text())["_class_name"])
        a = cls.from_pretrained(base_dir / expert).state_dict()
        smooth = cls.from_pretrained(smooth_dir / expert)
        b = smooth.state_dict()
        spec = BUILTINS[f"{base}-smooth"]
        gains = column_gains(smooth, spec.step, spec.keep_rad, spec.drop_rad)
        assert a.keys() == b.keys()
        assert {k for k in a if not torch.equal(a[k], b[k])} == set(gains)
        for k, g in gains.items():
            assert g.max() == 1 and g.min() == 0  # the slow features kept, the fast ones dropped
            torch.testing.assert_close(b[k], (a[k].double() * g).to(a[k].dtype), rtol=0, atol=0)


@pytest.mark.parametrize("base", TINY)
def test_the_embedding_changes_a_few_percent_per_step(base, built):
    base_dir, smooth_dir = built(base)
    a, b = changes(base_dir, 50), changes(smooth_dir, 50)
    assert a.keys() == b.keys() and a
    for key in a:
        rough, smooth = a[key].median().item(), b[key].median().item()
        assert smooth < 0.25 * rough and smooth < 0.1, (key, rough, smooth)


@pytest.mark.parametrize("base", TINY)
def test_a_forward_feeds_the_embedders_the_sinusoids_the_measure_assumes(base, built):
    """One forward of each expert on example inputs, the engine's way (warm_up runs the policy's velocity;
    eager here): it runs, and each time embedder reads ``Timesteps(t / scale)`` of its t on the 0..1000
    scale, as :func:`common.builtin.smooth_time.time_embeddings` feeds it."""
    info = read_model(built(base)[1])
    policy = Policy.load(info, torch.float32, "cpu")
    seen = {}

    def keep_input(key):
        def hook(module, args):
            seen.setdefault(key, args[0].detach().clone())
        return hook

    for expert, model in policy.experts.items():
        for name, (embedder, _) in time_embedders(model).items():  # the sinusoids the first layer reads
            embedder.get_submodule(first_layer(embedder)).register_forward_pre_hook(keep_input((expert, name)))
    warm_up(policy, batch=1)  # the transformer at t = 999, a second expert at t = 0
    timestep_inputs = {k: v for k, v in seen.items() if not k[1].rpartition(".")[2].startswith("guidance")}
    assert {k[0] for k in timestep_inputs} == set(policy.experts)
    for (expert, name), x in timestep_inputs.items():
        source = time_embedders(policy.experts[expert])[name][1]
        t = torch.tensor([999.0 if expert == "transformer" else 0.0], dtype=torch.float64)
        if isinstance(source, _OwnSinusoids):  # Z-Image's time runs backwards (1000 - t): the same phase per step
            t = 1000.0 - t
        torch.testing.assert_close(x.float(), source(t / source.scale).float().expand_as(x), rtol=0, atol=1e-4)
