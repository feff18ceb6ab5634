"""HunyuanVideo 1.5's other features in process (tests/family_harness.py): LoRA, sleep and wake of every
component, groups.

1. LoRA: a diffusers file and a peft folder on the family's default targets (the joint attention's projections
   of both streams in every block, and the text token refiner's self-attention): served equal to
   ``HunyuanVideo15Pipeline`` with the adapter loaded by diffusers (1e-4); rollout log-probs equal to the
   trainer's policy with the same adapter put in by peft (1e-5); several adapters in one batched step each equal
   to its request alone (1e-5). diffusers gives the HunyuanVideo 1.5 pipelines no LoRA loader: the file is
   written by ``HunyuanVideoLoraLoaderMixin.save_lora_weights`` (the transformer-only ``transformer.`` layout
   every such saver writes) and loaded by the transformer's own ``load_lora_adapter`` (``PeftAdapterMixin``),
   what ``load_lora_weights`` does for a transformer-only pipeline.
2. Sleep: the encoder's ``text_encoder`` holds Qwen2.5-VL and ByT5 (image-to-video: also SigLIP and the VAE's
   encoder), the decode worker's ``vae`` the VAE's decoder; each released and resumed (level 1, level 2 with a
   push or from disk) gives every output back bit for bit.
3. Groups: the encoder stage encodes a group's texts (and image) once; ``initial_noise_seed`` + ``share_prefix``
   branches equal each sample run alone.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import lora_fixtures as lf
from common.builtin import ensure_builtin
from common.protocol.messages import LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, \
    TRAJECTORY_TIMESTEPS
from edit_models import SCALE, EditModels, Made, no_grad
from group_checks import branch_diffs, encode_group
from family_harness import compare_tasks, max_diff
from family_harness import gradient_picture as picture
from rl import Trajectory
from test_hunyuan_video15 import CASES as SERVING, request
from test_hunyuan_video15_rollouts import rollout_params

SERVE_TOL, ROLLOUT_TOL = 1e-4, 1e-5
SAVER = "HunyuanVideoPipeline"  # the saver (and diffusers_twin's) for a transformer-only `transformer.` file


def make_file(model_dir, out_dir, targets) -> lf.Adapter:
    """A diffusers LoRA file of the directory's transformer, with its LoraConfig in the header."""
    import diffusers

    sd, config = lf.lora_state_dict(model_dir, 4, 8, targets, seed=1)
    getattr(diffusers, SAVER).save_lora_weights(out_dir, transformer_lora_layers=sd,
                                                transformer_lora_adapter_metadata=config.to_dict())
    return lf.Adapter(out_dir, 4, 8, list(targets), {"transformer": sd}, pipeline=SAVER)


class Models(EditModels):
    """EditModels with this family's two adapters (its pipeline has no saver of its own)."""

    def get(self, model: str, tmp_path_factory) -> Made:
        from common.diffusion.lora import build_adapter
        from common.diffusion.lora_format import read_lora

        if model not in self.made:
            model_dir = ensure_builtin(model)
            eng = self.engine(model_dir)
            targets = eng.family.transformer.lora_targets
            peft_files = lf.make_peft_lora(model_dir, tmp_path_factory.mktemp(f"{model}-peft"), rank=2, alpha=4,
                                           target_modules=targets, seed=2)
            files = {"file": make_file(model_dir, tmp_path_factory.mktemp(f"{model}-file"), targets),
                     "peft": dataclasses.replace(peft_files, pipeline=SAVER)}
            m = Made(eng, model_dir)
            for i, (kind, files_) in enumerate(files.items()):
                adapter = build_adapter(kind, i + 1, read_lora(str(files_.path), None), eng.policy.experts, 64)
                eng.policy.cover(adapter)
                m.adapters[kind] = (files_, adapter)
            self.made[model] = m
        return self.made[model]


models = Models()


@pytest.fixture(scope="module", autouse=True)
def _module():
    yield from models.module_scope()


# --- LoRA -----------------------------------------------------------------------------------------------------


def test_the_default_targets_cover_both_streams_and_the_token_refiner(tmp_path_factory):
    m = models.get("tiny-hunyuan-video15", tmp_path_factory)
    model = m.eng.policy.experts["transformer"]
    joint = ("to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
    want = {f"transformer_blocks.{b}.attn.{p}" for b in range(len(model.transformer_blocks)) for p in joint}
    refiner = model.context_embedder.token_refiner.refiner_blocks
    want |= {f"context_embedder.token_refiner.refiner_blocks.{b}.attn.{p}" for b in range(len(refiner))
             for p in ("to_q", "to_k", "to_v", "to_out.0")}
    for kind, (files, adapter) in m.adapters.items():
        assert set(adapter.experts["transformer"]) == want, kind
        assert {k.rsplit(".lora_", 1)[0] for k in files.state_dict} == want, kind


def _reference(pipe, adapter_path, call):
    """The pipeline with the adapter loaded into its transformer by diffusers, active at SCALE (deleted after)."""
    pipe.transformer.load_lora_adapter(str(adapter_path), weight_name=lf.DIFFUSERS_FILE, prefix="transformer",
                                       adapter_name="ref")
    try:
        pipe.transformer.set_adapters(["ref"], [SCALE])
        with torch.no_grad():
            latents = pipe(**call, output_type="latent").frames
            call = {**call, "generator": torch.Generator().manual_seed(call["generator"].initial_seed())}
            shown = pipe(**call, output_type="pt").frames
    finally:
        pipe.transformer.delete_adapters("ref")
    return latents, shown


@pytest.mark.parametrize("kind", ["file", "peft"])
def test_lora_serving_equals_the_pipeline_with_the_adapter_loaded(kind, tmp_path_factory, record_property):
    m = models.get("tiny-hunyuan-video15", tmp_path_factory)
    eng, pipe = m.eng, models.pipe(m.model_dir)
    files, adapter = m.adapters[kind]
    # diffusers reads no peft folder: its twin holds the same tensors and LoraConfig (lora_fixtures.diffusers_twin)
    path = files.path if kind == "file" else lf.diffusers_twin(files, tmp_path_factory.mktemp("twin"))
    p, call = request(eng, SERVING["cfg-quoted"], None)
    pipe.guider = pipe.guider.new(guidance_scale=p.guidance_scale)
    lat = eng.run(p, lora=(adapter, SCALE)).output_latents()
    ref, shown = _reference(pipe, path, call)
    frames = eng.frames(lat, p)
    diffs = {"latents": max_diff(lat, ref), "frames": max_diff(frames[0], shown[0].permute(0, 2, 3, 1))}
    record_property("diffs", diffs)
    assert all(d <= SERVE_TOL for d in diffs.values()), diffs
    assert max_diff(lat, eng.run(p).output_latents()) > 1e-3  # the adapter acts


@pytest.mark.parametrize("model, kind", [("tiny-hunyuan-video15", "file"), ("tiny-hunyuan-video15-i2v", "peft")])
def test_lora_rollout_log_probs_equal_the_trainers_peft_recompute(model, kind, tmp_path_factory, record_property):
    m = models.get(model, tmp_path_factory)
    eng = m.eng
    trainer = models.trainer_with(m, kind)
    image = picture(50, 70) if model.endswith("i2v") else None
    p = rollout_params(trainer, "sde", 6.0, image, sde_step_indices=[0, 1])
    ex = eng.run(p, lora=m.lora(kind), image=image).extras()
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
    m = models.get("tiny-hunyuan-video15", tmp_path_factory)
    eng = m.eng
    p = rollout_params(models.trainer(m.model_dir), "sde", 6.0, n=1, sde_step_indices=[0, 1])
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
    """What each component computes for one request: its text (and image) wire tensors, the latents and the
    frames decoded from them."""
    p, _ = request(eng, SERVING["cfg-quoted"], image)
    texts = eng.encoder.wire_tensors([p.prompt, p.negative_prompt], p.max_sequence_length)
    out = {f"text{i}.{k}": t for i, wire in enumerate(texts) for k, t in wire.items()}
    if image is not None:
        out.update({f"image.{k}": t for k, t in eng.image_wire(p, image).items()})
    out["latents"] = eng.run(p, image=image).latents
    out["frames"] = eng.frames(out["latents"], p)
    return out


@pytest.mark.parametrize("model", ["tiny-hunyuan-video15", "tiny-hunyuan-video15-i2v"])
def test_every_component_sleeps_and_wakes_bit_identical(model):
    from common.runtime.component_memory import modules_of
    from test_sleep import _unsettled, assert_sleep_cycles

    eng = models.engine(ensure_builtin(model))
    info = eng.info
    components = {"transformer": eng.policy.experts,
                  "text_encoder": modules_of({"text_encoder": eng.encoder, "images": eng.images}),
                  "vae": modules_of({"decoder": eng.decoder})}
    kinds = {tag: sorted(type(m).__name__ for m in modules.values()) for tag, modules in components.items()}
    assert kinds["vae"] == ["AutoencoderKLHunyuanVideo15"]
    image_side = ["AutoencoderKLHunyuanVideo15", "SiglipVisionModel"] if eng.images is not None else []
    assert kinds["text_encoder"] == sorted(["Qwen2_5_VLTextModel", "T5EncoderModel", *image_side])
    assert kinds["transformer"] == ["HunyuanVideo15Transformer3DModel"]
    assert _unsettled(components) == {}
    image = picture(50, 70) if eng.images is not None else None
    assert_sleep_cycles(info, components, lambda: _outputs(eng, image))


# --- groups ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny-hunyuan-video15", "tiny-hunyuan-video15-i2v"])
def test_a_group_encodes_once_and_branches_as_its_samples_alone(model, record_property):
    model_dir = ensure_builtin(model)
    eng = models.engine(model_dir)
    image = picture(50, 70) if eng.images is not None else None
    window = [1, 2]
    p = rollout_params(models.trainer(model_dir), "sde", 6.0, image, n=2, sde_step_indices=window,
                       share_prefix=True)
    encode_group(eng, p, image)
    diffs = branch_diffs(eng, p, window, image)
    record_property("diffs", diffs)
    assert len(diffs) == 2 * 3 and all(d <= ROLLOUT_TOL for d in diffs.values()), diffs  # (a NaN fails)
