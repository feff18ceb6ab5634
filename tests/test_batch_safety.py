"""Batches never fail a request that would succeed alone, for every family, in one process: the denoise worker's
own stage (``DenoiseStage``: its batch choice, its forwards, its failure path; tests/family_harness.py
``InStage``) fed the encoder worker's wire tensors, on the tiny built-ins.

1. Texts of different lengths: three requests held at once, one with another ``max_sequence_length`` (and
   prompts of other lengths). Each answer equals the request's run alone (<= 1e-5 of the tensor's scale). Where
   the family's transformer masks text padding (Qwen-Image) all three share forwards; elsewhere the one of
   another length runs in forwards of its own (its ``batch`` is 1) while the two others share theirs.
2. A forward that fails for one request's rows: that request fails, the others (one of them caching steps, one
   a rollout) are answered equal to their runs alone, with the same transformer passes and cached steps.

The launched engine's case (the same over HTTP on ``tiny``) is in tests/test_batching.py.
"""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from common.builtin import ensure_builtin
from common.protocol.messages import CacheParams, RolloutParams
from family_harness import InProcess, InStage

TOL = 1e-5  # of the tensor's scale: max |a - b| <= TOL * max(1, max |b|)

# Per family: the built-in, the other request's max_sequence_length (None: the model takes only one; prompts of
# other lengths only), and the answers' ``batch``: a and c always share forwards, b (the other length) with
# them only where the transformer masks text padding.
CASES = {
    "wan": ("tiny", 1, {"a": 2, "b": 1, "c": 2}),
    "wan-i2v": ("tiny-wan-i2v-a14b", 1, {"a": 2, "b": 1, "c": 2}),
    "wan-i2v-clip": ("tiny-wan-i2v", None, {"a": 3, "b": 3, "c": 3}),  # CLIP's attention: 512 tokens, always
    "sd3": ("tiny-sd3", 8, {"a": 2, "b": 1, "c": 2}),
    "flux": ("tiny-flux", 48, {"a": 2, "b": 1, "c": 2}),
    "qwen-image": ("tiny-qwen-image", 3, {"a": 3, "b": 3, "c": 3}),
    "sana": ("tiny-sana", 24, {"a": 3, "b": 3, "c": 3}),
    "z-image": ("tiny-z-image", 16, {"a": 3, "b": 3, "c": 3}),  # its captions: a list, padded with a mask
    "flux2-klein": ("tiny-flux2-klein", 32, {"a": 2, "b": 1, "c": 2}),  # every padding token attended
    "hunyuan-video15": ("tiny-hunyuan-video15", None, {"a": 3, "b": 3, "c": 3}),  # the pipeline's fixed 1000
}


def _picture(seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (40, 24, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def stages(tmp_path_factory):
    made: dict[str, InStage] = {}

    def get(model: str) -> InStage:
        if model not in made:
            made[model] = InStage(InProcess(ensure_builtin(model)), tmp_path_factory.mktemp(model))
        return made[model]

    return get


def _params(st: InStage, **over):
    p = st.eng.params(output_type="latent", **over)
    if st.eng.family.cfg_field == "true_cfg_scale":  # FLUX's default runs no unconditional pass: give it one
        p = msgspec.structs.replace(p, fields={**p.fields, "true_cfg_scale": 2.0}, negative_prompt="blurry")
    return p


def _image(st: InStage):
    return _picture(1) if st.eng.family.condition.image_input(st.eng.info) == "required" else None


def _scaled(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item() / max(1.0, b.float().abs().max().item())


def _alone(st: InStage, p, image) -> dict:
    out = st.serve({"alone": (p, image)})["alone"]
    assert not isinstance(out, BaseException), out
    assert out.msg.info["batch"] == p.n
    return out


def _assert_equal_alone(st: InStage, answers: dict, requests: dict) -> list[float]:
    diffs = []
    for rid, (p, image) in requests.items():
        got, alone = answers[rid], _alone(st, p, image)
        assert set(got.tensors) == set(alone.tensors)
        for name in got.tensors:
            diffs.append(_scaled(got.tensors[name], alone.tensors[name]))
        for count in ("transformer_passes", "cached_steps"):
            assert got.msg.info[count] == alone.msg.info[count], (rid, count)
    return diffs


@pytest.mark.parametrize("case", list(CASES))
def test_texts_of_different_lengths_each_equal_their_run_alone(case, stages, record_property):
    model, other_length, batches = CASES[case]
    st = stages(model)
    image = _image(st)
    short = {} if other_length is None else {"max_sequence_length": other_length}
    requests = {
        "a": (_params(st, prompt="a fox", seed=1), image),
        "b": (_params(st, prompt="a cat", seed=2, **short), image),
        "c": (_params(st, prompt="a long prompt about a red kite over a grey winter sea at dawn", seed=3,
                      rollout=RolloutParams(sde_type="sde", noise_level=0.7, return_trajectory=True)), image),
    }
    answers = st.serve(requests)
    errors = {rid: out for rid, out in answers.items() if isinstance(out, BaseException)}
    assert not errors
    assert {rid: out.msg.info["batch"] for rid, out in answers.items()} == batches
    diffs = _assert_equal_alone(st, answers, requests)
    record_property("max_diff", max(diffs))
    print(f"\n[{case}] batched vs alone: {max(diffs):.3g}")
    assert max(diffs) <= TOL


@pytest.mark.parametrize("case", ["wan", "wan-i2v", "sd3", "flux", "qwen-image", "z-image", "flux2-klein",
                                  "hunyuan-video15"])
def test_a_forward_that_fails_for_one_request_fails_only_that_request(case, stages, record_property):
    model = CASES[case][0]
    st = stages(model)
    image = _image(st)
    requests = {
        "poison": (_params(st, prompt="the request whose rows fail", seed=4), image),
        "cached": (_params(st, prompt="a fox", seed=5, cache=CacheParams(method="first_block", threshold=1e-3)),
                   image),
        "rollout": (_params(st, prompt="a fox", seed=6,
                            rollout=RolloutParams(sde_type="sde", noise_level=0.7, return_trajectory=True)), image),
    }
    # The only fake part: a forward that raises whenever the poisoned request's rows are in it from its second
    # step on (after the caching request has a signal to compare with), as a transformer would on tensors it
    # cannot take; nothing else of the stage is replaced.
    policy, real = st.stage.policy, st.stage.policy.batched_velocity
    failed = []

    def batched_velocity(inputs):
        held = {id(r.task.cond): r for r in st.stage.denoiser.requests}
        poisoned = [held[id(x.cond)] for x in inputs if id(x.cond) in held and held[id(x.cond)].id == "poison"]
        if poisoned and poisoned[0].task.step >= 1:
            failed.append(len(inputs))
            raise RuntimeError("injected: this forward holds the poisoned request's rows")
        return real(inputs)

    policy.batched_velocity = batched_velocity
    try:
        answers = st.serve(requests)
    finally:
        del policy.batched_velocity
    assert len(failed) == 2 and failed[0] > 1 and failed[1] == 1  # the shared forward, then the poisoned one's own
    assert isinstance(answers["poison"], RuntimeError) and "injected" in str(answers["poison"])
    rest = {rid: requests[rid] for rid in ("cached", "rollout")}
    assert not any(isinstance(answers[rid], BaseException) for rid in rest)
    diffs = _assert_equal_alone(st, answers, rest)
    record_property("max_diff", max(diffs))
    print(f"\n[{case}] survivors vs alone: {max(diffs):.3g}")
    assert max(diffs) <= TOL
