"""Shared pieces of the family layer, in process, on the tiny built-in models:

1. ``text_roles.encode``: one encoder call for a prompt and a negative prompt, unless the encoder encodes a
   negative prompt apart (``negative_apart``), then one call per role, each text's tensors in order.
2. ``PaddedMaskedText``: a text padded to the request's budget with a mask over the padding; texts of other
   budgets stacked padded and masked to the longest, each row its own text followed by masked zeros.
3. ``LatentsPart.size``: a latents part that snaps sizes makes the request's noise at the snapped size, the
   params conversion takes a requested size that is no multiple (the rule holds for the snapped one) and keeps
   the requested size, which the decoder gives back.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.builtin import ensure_builtin
from common.config.engine import Limits
from common.diffusion import text_roles
from common.diffusion.params import FieldError, to_params
from common.diffusion.parts.experts import GUIDANCE_SCALE_2, BoundarySplit, OneExpert
from common.diffusion.parts.text import HIDDEN, PaddedMaskedText
from common.diffusion.policy import ModelInput, Policy
from common.families import read_model
from common.protocol.messages import PROMPT_EMBEDS
from denoise_worker.task import initial_noise


class _RoleEncoder:
    """Records its calls; a text's tensor says its role (what an instruction before prompts only does)."""

    def __init__(self, apart: bool):
        self.negative_apart, self.calls = apart, []

    def wire_tensors(self, prompts, max_sequence_length, negative=False):
        self.calls.append((list(prompts), negative))
        return [{PROMPT_EMBEDS.name: torch.full((len(p), 2), -1.0 if negative else 1.0)} for p in prompts]


@pytest.mark.parametrize("apart", [False, True])
def test_text_roles_one_call_unless_the_negative_is_encoded_apart(apart):
    enc = _RoleEncoder(apart)
    texts = [("a fox", False), ("blurry", True), ("a cat", False)]
    wires = text_roles.encode(enc, texts, 8)
    assert [w[PROMPT_EMBEDS.name].shape[0] for w in wires] == [5, 6, 5]  # in order
    if apart:
        assert enc.calls == [(["a fox", "a cat"], False), (["blurry"], True)]
        assert [float(w[PROMPT_EMBEDS.name][0, 0]) for w in wires] == [1.0, -1.0, 1.0]
    else:
        assert enc.calls == [(["a fox", "blurry", "a cat"], False)]
    assert text_roles.negative_apart(enc) is apart


def test_padded_masked_text_pads_to_the_budget_and_stacks_to_the_longest():
    part = PaddedMaskedText(fields=(PROMPT_EMBEDS,), load_encoder=None, example=None, mask="encoder_attention_mask")
    a = part.conditioning({PROMPT_EMBEDS.name: torch.randn(3, 4)}, 6).tensors
    b = part.conditioning({PROMPT_EMBEDS.name: torch.randn(5, 4)}, 9).tensors
    assert a[HIDDEN].shape == (1, 6, 4) and a["encoder_attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0]]
    assert torch.equal(a[HIDDEN][0, 3:], torch.zeros(3, 4))
    stacked = part.stack([a, b])
    assert stacked[HIDDEN].shape == (2, 9, 4)
    assert torch.equal(stacked[HIDDEN][0, :6], a[HIDDEN][0]) and torch.equal(stacked[HIDDEN][1], b[HIDDEN][0])
    assert stacked["encoder_attention_mask"].tolist() == [[1, 1, 1, 0, 0, 0, 0, 0, 0], [1] * 5 + [0] * 4]
    assert part.key([a, b]) == ()  # texts of any budget share a forward


def _snapped(inner):
    """``inner`` (a latents part) making every request at the next multiple of 64."""
    class Snapped(type(inner)):
        def size(self, info, height, width, fields):
            return -(-height // 64) * 64, -(-width // 64) * 64

    return Snapped(**{f.name: getattr(inner, f.name) for f in dataclasses.fields(inner)})


def test_a_latents_part_that_snaps_sizes_makes_noise_at_the_snapped_size():
    info = read_model(ensure_builtin("tiny-sd3"))
    snapped = dataclasses.replace(info, family=dataclasses.replace(info.family, latents=_snapped(
        info.family.latents)))
    with pytest.raises(FieldError) as e:
        to_params({"prompt": "a fox", "height": 72, "width": 64}, info, Limits())
    assert e.value.field == "height"
    p = to_params({"prompt": "a fox", "height": 72, "width": 100}, snapped, Limits())
    assert (p.height, p.width) == (72, 100)  # the requested size travels; the decoder gives it back
    noise = initial_noise(snapped, p, [torch.Generator("cpu").manual_seed(0)])
    assert noise.shape == info.latent_shape(128, 128)
    with pytest.raises(FieldError) as e:
        to_params({"prompt": "a fox", "height": 72, "width": 100_000}, snapped, Limits())
    assert e.value.field == "width"


def test_the_experts_part_picks_each_timesteps_expert_and_its_scale():
    two = dataclasses.make_dataclass("Dir", ["boundary_ratio", "num_train_timesteps", "has_transformer_2"])
    info, both = two(0.875, 1000, True), ("transformer", "transformer_2")
    split = BoundarySplit()
    assert split.names(info) == both and split.names(two(None, 1000, False)) == ("transformer",)
    assert [split.expert_for(info, both, t) for t in (999.0, 875.0, 874.9, 0.0)] == \
        ["transformer", "transformer", "transformer_2", "transformer_2"]
    assert split.expert_for(info, ("transformer",), 0.0) == "transformer"  # a policy holding the first alone
    assert split.expert_for(two(None, 1000, False), both, 0.0) == "transformer"
    assert OneExpert().expert_for(info, both, 0.0) == "transformer" and OneExpert().names(info) == ("transformer",)
    params = dataclasses.make_dataclass("Params", ["fields"])
    assert split.scales(params({GUIDANCE_SCALE_2.name: 3.0})) == (("transformer_2", 3.0),)
    assert split.scales(params({})) == () and OneExpert().scales(params({GUIDANCE_SCALE_2.name: 3.0})) == ()
    x = ModelInput(torch.zeros(1, 2), torch.tensor(0.0), torch.zeros(1, 3, 2), None, 5.0,
                   expert_scales=split.scales(params({GUIDANCE_SCALE_2.name: 3.0})))
    assert (Policy.guidance_scale("transformer", x), Policy.guidance_scale("transformer_2", x)) == (5.0, 3.0)


def test_the_policy_asks_its_familys_experts_part():
    """A two-expert built-in's policy splits where its part does; a one-expert family's runs its first everywhere."""
    for name, split in (("tiny-moe", True), ("tiny", False)):
        info = read_model(ensure_builtin(name))
        policy = Policy.load(info, torch.float32, "cpu")
        assert tuple(policy.experts) == (("transformer", "transformer_2") if split else ("transformer",))
        boundary = (info.boundary_ratio or 0.0) * info.num_train_timesteps
        assert {policy.expert_for(torch.tensor(t)) for t in (999.0, boundary - 1.0, 0.0)} == \
            ({"transformer", "transformer_2"} if split else {"transformer"})
