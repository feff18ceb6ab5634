"""Step caching (``first_block``, ``teacache``) on the three edit models, in process, on their ``-smooth``
built-ins (a time embedding that moves a few percent per step, as a trained model's: common/builtin/smooth_time.py).

- Each method skips steps of an edit request on each edit model; ``transformer_passes + cached_steps`` is
  steps x branches; the counts are in the assertion message (and docs/architecture.md's step-caching section).
- FLUX.1 Kontext with and without its image: the first block's residual covers the reference tokens too and
  its change from step to step differs, so ``first_block`` decides on another signal; TeaCache's signal is
  the timestep-modulated input (time, guidance, pooled text), which no token enters: its decisions are the
  same with and without the image.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

from common.diffusion.cache_signals import first_block_residuals
from common.diffusion.step_cache import rel_l1
from common.protocol.messages import CacheParams
from edit_models import SLOW_MODELS, images_for
from family_harness import ModuleModels
from common.builtin import ensure_builtin

STEPS = 8
THRESHOLDS = {"teacache": 0.3, "first_block": 0.3}  # tests/test_step_cache.py's
models = ModuleModels()


@pytest.fixture(scope="module", autouse=True)
def _module():
    yield from models.module_scope()


def engine(model: str):
    return models.engine(ensure_builtin(f"{model}-smooth"))


def params(eng, **over):
    fields = dict(num_inference_steps=STEPS, seed=3, prompt="make the fox blue", negative_prompt="blurry")
    if eng.family.cfg_field == "true_cfg_scale":
        fields["true_cfg_scale"] = 2.0
    return eng.params(**{**fields, **over})


def cached(eng, p, method: str, image) -> dict:
    task = eng.run(msgspec.structs.replace(p, cache=CacheParams(method=method, threshold=THRESHOLDS[method])),
                   image=image)
    return task.pass_counts()


@pytest.mark.parametrize("model", SLOW_MODELS)
def test_each_method_skips_steps_of_an_edit(model, record_property):
    eng = engine(model)
    p = params(eng)
    branches = 2 if eng.family.guidance.uses_cfg(p) else 1
    counts = {method: cached(eng, p, method, images_for(model)) for method in THRESHOLDS}
    record_property("counts", counts)
    message = f"{model}, {STEPS} steps x {branches} branches: {counts}"
    print(f"\n{message}")
    for c in counts.values():
        assert c["transformer_passes"][0] + c["cached_steps"][0] == STEPS * branches, message
        assert c["cached_steps"][0] > 0, message


def test_the_reference_tokens_change_the_first_block_signal_not_teacaches(record_property):
    eng = engine("tiny-flux-kontext")
    p = params(eng, true_cfg_scale=1.0)
    image = images_for("tiny-flux-kontext")[0]
    signals, shapes = {}, {}
    for name, im in (("edit", image), ("text", None)):
        task = eng.task(p, image=im)
        residuals = []
        for _ in range(3):  # the first block's residual at the first three steps, as first_block probes it
            residuals.append(first_block_residuals(eng.policy, "transformer", [task.model_input()])[0])
            eng.step([task])
        shapes[name] = tuple(residuals[0].shape)
        signals[name] = [rel_l1(b, a)[0].item() for a, b in zip(residuals, residuals[1:])]
    seq = eng.family.latents.image_seq_len(eng.info, p.height, p.width, 1)
    refs = eng.image_wire(p, image)["reference_latents"].shape[0]
    assert shapes["edit"][1] == seq + refs and shapes["text"][1] == seq  # the references are in the residual
    counts = {name: {m: cached(eng, p, m, im) for m in THRESHOLDS} for name, im in (("edit", image), ("text", None))}
    record_property("signals", signals)
    record_property("counts", counts)
    print(f"\n[kontext] first-block change per step {signals}; counts {counts}")
    assert all(abs(a - b) > 1e-3 * max(a, b) for a, b in zip(signals["edit"], signals["text"])), signals
    assert counts["edit"]["teacache"] == counts["text"]["teacache"], counts  # no token enters its signal
