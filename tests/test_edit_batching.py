"""Edit requests batched by the denoise worker's own stage (tests/family_harness.py ``InStage``: its batch choice
and forwards), on the three edit models.

Requests whose images have other aspects have other reference grids: they cannot share a forward (neither
transformer takes a mask for image tokens), so they run in forwards of their own, while requests whose layouts
agree share theirs; FLUX.1 Kontext's text-only requests (its image is optional) share with each other, not with
the edits. Every request's latents, trajectory and log-probs equal its run alone within 1e-5; each forward's
layouts are recorded where the policy runs them.
"""

from __future__ import annotations

import msgspec
import pytest

from common.protocol.messages import LATENTS, LOG_PROBS, TRAJECTORY_LATENTS
from edit_models import MODELS, SLOW_MODELS, EditModels, images_for, rollout_params
from family_harness import InStage, max_diff

TOL = 1e-5
models = EditModels()


@pytest.fixture(scope="module", autouse=True)
def _module():
    yield from models.module_scope()


class Layouts:
    """Every forward of ``policy``: each input's reference grids (None: no image)."""

    def __init__(self, policy):
        self.policy, self.calls = policy, []

    def __enter__(self):
        real = self.policy.batched_velocity

        def record(inputs):
            self.calls.append([None if x.image is None else x.image.grids for x in inputs])
            return real(inputs)
        self.policy.batched_velocity = record
        return self

    def __exit__(self, *exc):
        del self.policy.batched_velocity


@pytest.mark.parametrize("model", SLOW_MODELS)
def test_edits_of_other_grids_run_apart_those_that_agree_share_and_each_equals_its_run_alone(
        model, tmp_path, tmp_path_factory, record_property):
    eng = models.get(model, tmp_path_factory).eng
    st = InStage(eng, tmp_path)
    base = rollout_params(eng, steps=2, n=1, sde_step_indices=[0])
    wide, tall = images_for(model, seed=0, aspect=(40, 56)), images_for(model, seed=3, aspect=(56, 40))
    same = images_for(model, seed=5, aspect=(40, 56))  # other pixels, wide's grid
    requests = {"wide": (base, wide), "tall": (msgspec.structs.replace(base, seed=8, prompt="a red boat"), tall),
                "same": (msgspec.structs.replace(base, seed=9), same)}
    if model == "tiny-flux-kontext":  # text-only requests beside the edits
        requests["text"] = (msgspec.structs.replace(base, seed=10, prompt="a cat"), None)
        requests["text-2"] = (msgspec.structs.replace(base, seed=11, prompt="a dog"), None)
    with Layouts(st.stage.policy) as forwards:
        together = st.serve({rid: (p, None if im is None else im[0]) for rid, (p, im) in requests.items()})
    grids = {rid: None if im is None else eng.image_wire(p, im)["reference_grids"] for rid, (p, im) in
             requests.items()}
    key = {rid: None if g is None else tuple(map(tuple, g.tolist())) for rid, g in grids.items()}
    assert key["wide"] == key["same"] != key["tall"]
    # No forward mixes layouts; those that agree shared theirs (wide and same, the two text-only requests).
    assert all(len(set(call)) == 1 for call in forwards.calls), forwards.calls
    sizes = {call[0]: len(call) for call in forwards.calls}
    assert sizes[key["wide"]] == 2 and sizes[key["tall"]] == 1
    if "text" in requests:
        assert sizes[None] == 2
    assert len(forwards.calls) == 2 * len(set(key.values()))  # one forward per layout and step

    worst = 0.0
    for rid, (p, im) in requests.items():
        alone = st.serve({rid: (p, None if im is None else im[0])})[rid]
        for name in (LATENTS.name, TRAJECTORY_LATENTS.name, LOG_PROBS.name):
            worst = max(worst, max_diff(together[rid].tensors[name], alone.tensors[name]))
    record_property("max_abs_diff", worst)
    record_property("forwards", [len(c) for c in forwards.calls])
    print(f"\n[{model}] batched vs alone {worst:.3g}, forwards {forwards.calls}")
    assert worst <= TOL
    assert max_diff(together["wide"].tensors[LATENTS.name], together["same"].tensors[LATENTS.name]) > 1e-3


# --- --compile ------------------------------------------------------------------------------------------------

COMPILE_TOL = 1e-4  # tests/test_wan_i2v.py's


@pytest.mark.heavy  # compiling a transformer takes 10-25 s here: tests/test_compile.py covers compiling by default
@pytest.mark.parametrize("model", MODELS)
def test_compiled_forwards_of_edits_equal_eager(model, tmp_path_factory, record_property):
    """The policy through inductor, warmed up as a --compile worker (the reference part's example): an edit's
    guided forward and a batch of two edits of one layout equal eager; Kontext's text-only request too."""
    import torch

    from common.diffusion.compiled import compile_experts, uncompile, warm_up
    from common.diffusion.policy import Policy
    from test_sd3 import _no_grad

    eager = models.get(model, tmp_path_factory).eng
    torch.set_num_threads(eager.max_threads)  # as a --compile worker: its one thread count (graphs guard on it)
    compiled = Policy.load(eager.info, torch.float32, "cpu")
    compile_experts(compiled, log_recompiles=False)
    try:
        warm_up(compiled)
        p = rollout_params(eager, steps=2, n=1, cfg=True)
        tasks = [eager.task(p, image=images_for(model)[0]),
                 eager.task(msgspec.structs.replace(p, seed=5), image=images_for(model, seed=5)[0])]
        if model == "tiny-flux-kontext":
            tasks.append(eager.task(msgspec.structs.replace(p, seed=6), image=None))
        diffs = {}
        single = tasks[0].model_input()
        diffs["guided"] = max_diff(_no_grad(compiled.velocity, single)[0], _no_grad(eager.policy.velocity, single)[0])
        inputs = [t.model_input() for t in tasks[:2]]
        got, want = _no_grad(compiled.batched_velocity, inputs)[0], _no_grad(eager.policy.batched_velocity, inputs)[0]
        diffs["batched"] = max(max_diff(a, b) for a, b in zip(got, want))
        if len(tasks) > 2:
            text = tasks[2].model_input()
            diffs["text-only"] = max_diff(_no_grad(compiled.velocity, text)[0], _no_grad(eager.policy.velocity, text)[0])
    finally:
        uncompile(compiled.experts)
    record_property("max_diff", diffs)
    print(f"\n[{model}] compiled vs eager {diffs}")
    assert max(diffs.values()) <= COMPILE_TOL, diffs
