"""A trainer's params are the engine's: ``TrainerPolicy.params`` makes, from a request's fields, the
``GenerationParams`` the router makes from the same body (one conversion), and refuses what the router
refuses with the same error naming the field. In process, on the tiny built-ins."""

import msgspec
import pytest

from common.builtin import ensure_builtin
from common.config.engine import Limits
from common.diffusion.params import FieldError
from rl import TrainerPolicy
from router.request.schemas import GenerateBody, RolloutBody
from router.core import errors
from router.core.request_params import to_params

_TRAINERS: dict[str, TrainerPolicy] = {}


def trainer(model: str) -> TrainerPolicy:
    if model not in _TRAINERS:
        _TRAINERS[model] = TrainerPolicy(ensure_builtin(model))
    return _TRAINERS[model]


# Bodies with each family's own fields, given and left to their defaults.
BODIES = [
    ("tiny-flux", GenerateBody, dict(prompt="a fox", negative_prompt="blurry", true_cfg_scale=2.5, guidance_scale=3.0)),
    ("tiny-flux", GenerateBody, dict(prompt="a fox", height=32, width=48, max_sequence_length=24)),
    ("tiny-qwen-image", GenerateBody, dict(prompt="a fox", negative_prompt=" ", seed=4, n=2)),
    ("tiny-qwen-image", RolloutBody, dict(prompt="a fox", true_cfg_scale=1.0, sde_type="cps", noise_level=0.8,
                                          sde_step_indices=[2, 0], output_type="latent", mu=0.5)),
    ("tiny-moe", GenerateBody, dict(prompt="a fox", negative_prompt="blurry", guidance_scale_2=3.0, num_frames=5)),
    ("tiny-moe", RolloutBody, dict(prompt="a fox", guidance_scale=4.0, sde_type="sde", return_trajectory=True,
                                   output_type="latent")),
    ("tiny", GenerateBody, dict(prompt="a fox", num_frames=9, height=64, width=32, num_inference_steps=3)),
    ("tiny-sd3", RolloutBody, dict(prompt="a fox", negative_prompt="", max_sequence_length=16, sde_type="ode",
                                   lora_name="a", lora_scale=0.5, output_type="latent")),
    ("tiny-sana", GenerateBody, dict(prompt="a fox", use_resolution_binning=False, height=64, width=96)),
    ("tiny-sana", RolloutBody, dict(prompt="a fox", negative_prompt="blurry", sde_type="sde", output_type="latent")),
]


@pytest.mark.parametrize("model,body_type,body", BODIES, ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(BODIES)])
def test_the_trainers_params_equal_the_routers(model, body_type, body):
    t = trainer(model)
    router = to_params(body_type(**body), t.info, Limits())
    mine = t.params(**body)
    assert msgspec.structs.asdict(mine) == msgspec.structs.asdict(router)
    assert mine == router


def test_family_fields_take_their_defaults_and_rules():
    qwen = trainer("tiny-qwen-image")
    # true CFG only with a negative prompt: left out without one it is 1, as the pipelines run it.
    assert qwen.info.defaults["true_cfg_scale"] == 4.0
    assert qwen.params("a fox").fields["true_cfg_scale"] == 1.0
    assert qwen.params("a fox", "").fields["true_cfg_scale"] == 4.0
    assert qwen.family.guidance.scale(qwen.params("a fox", "blurry", true_cfg_scale=3.0)) == 3.0
    assert trainer("tiny").params("a fox").fields == {}  # guidance_scale_2 absent unless given


@pytest.mark.parametrize("model,fields,field", [
    ("tiny", {"true_cfg_scale": 2.0}, "true_cfg_scale"),  # a field the family does not declare
    ("tiny-flux", {"guidance_scale_2": 2.0}, "guidance_scale_2"),
    ("tiny-sd3", {"num_frames": 5}, "num_frames"),  # an image family
    ("tiny", {"guidance_scale_2": 2.0}, "guidance_scale_2"),  # the family's, not this model's (one expert)
    ("tiny-flux", {"negative_prompt": "x", "true_cfg_scale": -1.0}, "true_cfg_scale"),  # out of bounds
    ("tiny-flux", {"true_cfg_scale": 2.0}, "true_cfg_scale"),  # above 1 without a negative prompt
    ("tiny-moe", {"guidance_scale_2": "high"}, "guidance_scale_2"),  # not a number
    ("tiny-qwen-image", {"max_sequence_length": 2048}, "max_sequence_length"),
    ("tiny", {"height": 1400}, "height"),  # beyond the engine's default limits
    ("tiny", {"sde_type": "cps", "noise_level": 1.5}, "noise_level"),  # the step variant's own rule
    ("tiny-sana", {"clean_caption": True}, "clean_caption"),  # declared, refused
])
def test_a_field_refused_names_it_as_the_router_does(model, fields, field):
    t = trainer(model)
    with pytest.raises(FieldError) as mine:
        t.params("a fox", **fields)
    assert mine.value.field == field
    body = RolloutBody if "sde_type" in fields else GenerateBody
    with pytest.raises(errors.FieldError) as router:
        to_params(body(prompt="a fox", **fields), t.info, Limits())
    assert router.value.field == field and str(router.value) == str(mine.value)
