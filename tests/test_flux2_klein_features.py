"""FLUX.2 [klein]'s other features in process (tests/family_harness.py): LoRA, sleep and wake of every
component, groups.

1. LoRA: a diffusers file (``Flux2KleinPipeline.save_lora_weights``) and a peft folder on the family's default
   targets, which are the double-stream blocks' attention projections of both streams (``to_q/k/v``,
   ``to_out.0``, ``add_q/k/v_proj``, ``to_add_out``; the single-stream blocks' fused ``to_qkv_mlp_proj`` and
   ``to_out`` are not among them): served equal to ``Flux2KleinPipeline`` with ``load_lora_weights`` (latents
   and frames, 1e-4, with CFG and with a reference image); rollout log-probs equal to the trainer's policy with
   the same adapter put in by peft (1e-5); several adapters in one batched step each equal to its request alone.
2. Sleep: the decode worker's ``vae`` holds the VAE, the encoder's ``text_encoder`` Qwen3 and the VAE's encoder
   half for the reference images; each released and resumed (level 1, level 2 with a push or from disk) gives
   every output back bit for bit.
3. Groups: the encoder stage encodes a group's texts (and its reference image) once; ``initial_noise_seed`` +
   ``share_prefix`` branches equal each sample run alone.
"""

from __future__ import annotations

import pytest
import torch

import lora_fixtures as lf
from common.protocol.messages import LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, \
    TRAJECTORY_TIMESTEPS
from edit_models import SCALE, EditModels, no_grad
from group_checks import branch_diffs, encode_group
from family_harness import compare_tasks, gradient_picture, max_diff
from rl import Trajectory
from test_flux2_klein_rollouts import rollout

SERVE_TOL, ROLLOUT_TOL = 1e-4, 1e-5
MODEL = "tiny-flux2-klein"
# The built-in with a diffusers LoRA file and a peft folder on the family's default targets (edit_models.py).
models = EditModels()


@pytest.fixture(scope="module", autouse=True)
def _module():
    yield from models.module_scope()


def picture():
    return gradient_picture(70, 90, seed=2)  # cropped to 64x96 by the pipeline's processor


# --- LoRA -----------------------------------------------------------------------------------------------------


def test_the_default_targets_are_the_double_stream_attentions_of_both_streams(tmp_path_factory):
    m = models.get(MODEL, tmp_path_factory)
    model = m.eng.policy.experts["transformer"]
    projections = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    want = {f"transformer_blocks.{b}.attn.{p}" for b in range(len(model.transformer_blocks)) for p in projections}
    for kind, (files, adapter) in m.adapters.items():
        assert set(adapter.experts["transformer"]) == want, kind
        assert {k.rsplit(".lora_", 1)[0] for k in files.state_dict} == want, kind


def _reference(pipe, adapter_path, p, images):
    """``Flux2KleinPipeline`` with the adapter loaded by diffusers and active at SCALE (unloaded after): its
    final packed latents (the step-end callback) and frames [1, 1, H, W, 3]."""
    seen = {}

    def keep(pipe, i, t, kwargs):
        seen["latents"] = kwargs["latents"].clone()
        return {}

    pipe.load_lora_weights(str(adapter_path), adapter_name="ref")
    try:
        pipe.set_adapters(["ref"], [SCALE])
        with torch.no_grad():
            out = pipe(image=images, prompt=p.prompt, height=p.height, width=p.width,
                       num_inference_steps=p.num_inference_steps, guidance_scale=p.guidance_scale,
                       max_sequence_length=p.max_sequence_length, output_type="np", callback_on_step_end=keep,
                       generator=torch.Generator("cpu").manual_seed(p.seed))
    finally:
        pipe.unload_lora_weights()
    return seen["latents"], torch.from_numpy(out.images)[:, None]


# (adapter kind, request over the serving defaults, with a reference image)
LORA_CASES = {"file-cfg": ("file", dict(guidance_scale=3.0, seed=4), False),
              "peft-edit": ("peft", dict(guidance_scale=2.0, height=48, width=80, seed=5), True)}


@pytest.mark.parametrize("case", list(LORA_CASES))
def test_lora_serving_equals_the_pipeline_with_load_lora_weights(case, tmp_path_factory, record_property):
    kind, over, edit = LORA_CASES[case]
    m = models.get(MODEL, tmp_path_factory)
    eng, pipe = m.eng, models.pipe(m.model_dir)
    files, adapter = m.adapters[kind]
    # diffusers reads no peft folder: its twin holds the same tensors and LoraConfig (lora_fixtures.diffusers_twin)
    path = files.path if kind == "file" else lf.diffusers_twin(files, tmp_path_factory.mktemp("twin"))
    image = picture() if edit else None
    p = eng.params(**over)
    task = eng.run(p, lora=(adapter, SCALE), image=image)
    want_latents, want_frames = _reference(pipe, path, p, None if image is None else [image])
    diffs = {"latents": max_diff(task.latents, want_latents),
             "frames": max_diff(eng.frames(task.latents, p), want_frames)}
    record_property("diffs", diffs)
    assert all(d <= SERVE_TOL for d in diffs.values()), diffs
    assert max_diff(eng.run(p, image=image).latents, task.latents) > 1e-3  # the adapter acts


@pytest.mark.parametrize("kind, edit", [("file", False), ("peft", True)])
def test_lora_rollout_log_probs_equal_the_trainers_peft_recompute(kind, edit, tmp_path_factory, record_property):
    m = models.get(MODEL, tmp_path_factory)
    eng = m.eng
    torch.set_num_threads(1)  # both sides' encoders round by the thread count
    image = picture() if edit else None
    p = rollout(eng, "sde", 3.0, sde_step_indices=[0, 1])
    ex = eng.run(p, lora=m.lora(kind), image=image).extras()
    trainer = models.trainer_with(m, kind)
    inputs = None if image is None else trainer.image(p, image)
    embeddings = no_grad(trainer.embeddings, p, inputs)
    diffs = {}
    for i in range(p.n):
        sample = Trajectory(ex[TRAJECTORY_LATENTS.name][i], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])
        got = no_grad(trainer.log_probs, sample, ex[LOG_PROB_STEPS.name], p, embeddings=embeddings, image=inputs)
        diffs[i] = max_diff(got, ex[LOG_PROBS.name][i])
    record_property("diffs", diffs)
    assert all(d <= ROLLOUT_TOL for d in diffs.values()), diffs  # (a NaN fails)
    base = eng.run(p, image=image).extras()  # not vacuous: the adapter moves the trajectory
    assert max_diff(base[TRAJECTORY_LATENTS.name], ex[TRAJECTORY_LATENTS.name]) > 1e-3


def test_several_adapters_in_one_batched_step_each_equal_alone(tmp_path_factory, record_property):
    m = models.get(MODEL, tmp_path_factory)
    eng = m.eng
    p = rollout(eng, "sde", 3.0, n=1, sde_step_indices=[0, 1])
    file, peft = m.adapters["file"][1], m.adapters["peft"][1]
    loras = [(file, SCALE), (peft, SCALE), None, (file, 0.5)]
    tasks = [eng.task(p, lora=lo) for lo in loras]  # one seed: the rows differ by their adapter and scale alone
    shared = eng.shared_forwards
    while not all(t.done for t in tasks):
        eng.step(tasks)
    assert eng.shared_forwards > shared  # the four requests' rows went through shared forwards
    diffs = [compare_tasks(t, eng.run(p, lora=lo)) for t, lo in zip(tasks, loras)]
    record_property("diffs", diffs)
    assert all(d <= ROLLOUT_TOL for d in diffs), diffs
    assert max_diff(tasks[0].latents, tasks[3].latents) > 1e-3  # the scale reaches the rows


# --- sleep and wake -------------------------------------------------------------------------------------------


def _outputs(eng, image) -> dict[str, torch.Tensor]:
    """What each component computes for one request: its text and reference-image wire tensors, the latents
    (CFG: both texts' forwards), the frames decoded from them."""
    p = eng.params(guidance_scale=3.0, seed=6)
    torch.set_num_threads(1)
    texts = eng.encoder.wire_tensors([p.prompt, p.negative_prompt], p.max_sequence_length)
    out = {f"text{i}.{k}": t for i, wire in enumerate(texts) for k, t in wire.items()}
    out.update({f"image.{k}": t for k, t in eng.image_wire(p, image).items()})
    out["latents"] = eng.run(p, image=image).latents
    out["frames"] = eng.frames(out["latents"], p)
    return out


def test_every_component_sleeps_and_wakes_bit_identical(tmp_path_factory):
    from common.builtin import ensure_builtin
    from common.runtime.component_memory import modules_of
    from test_sleep import _unsettled, assert_sleep_cycles

    eng = models.engine(ensure_builtin(MODEL))
    info = eng.info
    components = {"transformer": eng.policy.experts,
                  "text_encoder": modules_of({"text_encoder": eng.encoder, "images": eng.images}),
                  "vae": modules_of({"decoder": eng.decoder})}
    kinds = {tag: sorted(type(m).__name__ for m in modules.values()) for tag, modules in components.items()}
    assert kinds == {"transformer": ["Flux2Transformer2DModel"], "vae": ["AutoencoderKLFlux2"],
                     "text_encoder": ["AutoencoderKLFlux2", "Qwen3ForCausalLM"]}, kinds
    assert _unsettled(components) == {}
    image = picture()
    assert _outputs(eng, image)["image.reference_latents"].numel() > 0
    assert_sleep_cycles(info, components, lambda: _outputs(eng, image))


# --- groups ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("edit", [False, True])
def test_a_group_encodes_once_and_branches_as_its_samples_alone(edit, record_property):
    from common.builtin import ensure_builtin

    eng = models.engine(ensure_builtin(MODEL))
    image = picture() if edit else None
    window = [1, 2]
    p = rollout(eng, "sde", 3.0, n=2, sde_step_indices=window, share_prefix=True)
    encode_group(eng, p, image)
    diffs = branch_diffs(eng, p, window, image)
    record_property("diffs", diffs)
    assert all(d <= ROLLOUT_TOL for d in diffs.values()), diffs  # (a NaN fails)
