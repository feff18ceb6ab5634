"""LTX-2's other features in process (tests/family_harness.py): LoRA on both streams, sleep and wake of every
component, groups.

1. LoRA: a diffusers file (``LTX2Pipeline.save_lora_weights``) and a peft folder on the family's default targets,
   which cover the projections of both streams' self- and cross-attentions and of the two audio-video
   cross-attentions: served equal to ``LTX2Pipeline`` with ``load_lora_weights`` (both streams' latents and the
   waveform, 1e-4); rollout log-probs (joint and per stream) equal to the trainer's policy with the same adapter
   put in by peft (1e-5); several adapters in one batched step each equal to its request alone (1e-5).
2. Sleep: the decode worker's ``vae`` holds the video VAE, the audio VAE and the vocoder, the encoder's
   ``text_encoder`` Gemma and the connectors (and for image-to-video the VAE it encodes the image with); each
   released and resumed (level 1, level 2 with a push or from disk) gives every output back bit for bit.
3. Groups: the encoder stage encodes a group's texts (and image) once; ``initial_noise_seed`` + ``share_prefix``
   branches equal each sample run alone.
4. Weight sync (heavy: a launched engine): a perturbed transformer from disk and from the trainer's memory each
   changes both streams; the original weights pushed back give the first answer back bit for bit.
"""

from __future__ import annotations

import msgspec
import pytest
import torch

import lora_fixtures as lf
from common.families.ltx2.latents import geometry_of
from common.protocol.messages import LOG_PROB_STEPS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, \
    TRAJECTORY_TIMESTEPS
from edit_models import SCALE, EditModels, no_grad
from group_checks import branch_diffs, encode_group
from family_harness import compare_tasks, max_diff
from rl import Trajectory
from test_ltx2 import CASES as SERVING, pipeline_latents, request
from test_ltx2_rollouts import picture, rollout as one_frame_rollout

SERVE_TOL, ROLLOUT_TOL = 1e-4, 1e-5
# The built-ins, each with a diffusers LoRA file and a peft folder on the family's default targets (edit_models.py).
models = EditModels()


@pytest.fixture(scope="module", autouse=True)
def _module():
    yield from models.module_scope()


def rollout(eng, sde_type, guided, **fields):
    """test_ltx2_rollouts' rollout at the model's default frame count: image to video has video tokens of
    its own past the image's frame 0 (at one frame every video token is the condition's)."""
    p = one_frame_rollout(eng, sde_type, guided, **fields)
    return msgspec.structs.replace(p, num_frames=eng.info.defaults["num_frames"])


# --- LoRA -----------------------------------------------------------------------------------------------------


def test_the_default_targets_cover_both_streams_and_the_cross_modal_attentions(tmp_path_factory):
    m = models.get("tiny-ltx2", tmp_path_factory)
    model = m.eng.policy.experts["transformer"]
    attentions = ("attn1", "attn2", "audio_attn1", "audio_attn2", "audio_to_video_attn", "video_to_audio_attn")
    want = {f"transformer_blocks.{b}.{a}.{p}" for b in range(len(model.transformer_blocks)) for a in attentions
            for p in ("to_q", "to_k", "to_v", "to_out.0")}
    for kind, (files, adapter) in m.adapters.items():
        assert set(adapter.experts["transformer"]) == want, kind
        assert {k.rsplit(".lora_", 1)[0] for k in files.state_dict} == want, kind


def _reference(pipe, adapter_path, call):
    """``LTX2Pipeline`` with the adapter loaded by diffusers and active at SCALE (unloaded after)."""
    pipe.load_lora_weights(str(adapter_path), adapter_name="ref")
    try:
        pipe.set_adapters(["ref"], [SCALE])
        with torch.no_grad():
            latents = pipe(**call, output_type="latent")
            call = {**call, "generator": torch.Generator().manual_seed(call["generator"].initial_seed())}
            shown = pipe(**call, output_type="pt")
    finally:
        pipe.unload_lora_weights()
    return latents, shown


@pytest.mark.parametrize("kind", ["file", "peft"])
def test_lora_serving_equals_the_pipeline_with_load_lora_weights(kind, tmp_path_factory, record_property):
    m = models.get("tiny-ltx2", tmp_path_factory)
    eng, pipe = m.eng, models.pipe(m.model_dir)
    files, adapter = m.adapters[kind]
    # diffusers reads no peft folder: its twin holds the same tensors and LoraConfig (lora_fixtures.diffusers_twin)
    path = files.path if kind == "file" else lf.diffusers_twin(files, tmp_path_factory.mktemp("twin"))
    p, call = request(eng, SERVING["all-rescale"])
    lat = eng.run(p, lora=(adapter, SCALE)).output_latents()
    ref, shown = _reference(pipe, path, call)
    video, audio = pipeline_latents(pipe, lat, eng, p)
    out = eng.decoded(lat, p)
    diffs = {"video latents": max_diff(video, ref.frames), "audio latents": max_diff(audio, ref.audio),
             "waveform": max_diff(out.audio, shown.audio)}
    record_property("diffs", diffs)
    assert all(d <= SERVE_TOL for d in diffs.values()), diffs
    base = geometry_of(eng.info, p).split(eng.run(p).output_latents())
    for k, stream in enumerate(geometry_of(eng.info, p).split(lat)):  # the adapter acts on both streams
        assert max_diff(stream, base[k]) > 1e-3, k


@pytest.mark.parametrize("model, kind", [("tiny-ltx2", "file"), ("tiny-ltx2-i2v", "peft")])
def test_lora_rollout_log_probs_equal_the_trainers_peft_recompute(model, kind, tmp_path_factory, record_property):
    m = models.get(model, tmp_path_factory)
    eng = m.eng
    torch.set_num_threads(1)  # both sides' encoders round by the thread count
    image = picture() if model.endswith("i2v") else None
    p = rollout(eng, "sde", True, sde_step_indices=[0, 1])
    ex = eng.run(p, lora=m.lora(kind), image=image).extras()
    trainer = models.trainer_with(m, kind)
    inputs = None if image is None else trainer.image(p, image)
    embeddings = no_grad(trainer.embeddings, p, inputs)
    diffs = {}
    for i in range(p.n):
        sample = Trajectory(ex[TRAJECTORY_LATENTS.name][i], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])
        got = no_grad(trainer.log_probs_by_stream, sample, ex[LOG_PROB_STEPS.name], p, embeddings=embeddings,
                      image=inputs)
        assert sorted(got) == ["log_probs", "log_probs_audio", "log_probs_video"]
        diffs.update({f"{name}[{i}]": max_diff(v, ex[name][i]) for name, v in got.items()})
    record_property("diffs", diffs)
    assert all(d <= ROLLOUT_TOL for d in diffs.values()), diffs  # (a NaN fails)
    base = eng.run(p, image=image).extras()  # not vacuous: the adapter moves the trajectory
    assert max_diff(base[TRAJECTORY_LATENTS.name], ex[TRAJECTORY_LATENTS.name]) > 1e-3


def test_several_adapters_in_one_batched_step_each_equal_alone(tmp_path_factory, record_property):
    m = models.get("tiny-ltx2", tmp_path_factory)
    eng = m.eng
    # One frame, as test_ltx2_rollouts' batching: at the default 9 frames with CFG, STG, modality, rescale and
    # audio guidance 5, four rows without any adapter already batch 1.05e-5 from alone (latents of about 5;
    # guidance multiplies the forwards' rounding), which is not the adapters' part to measure.
    p = one_frame_rollout(eng, "sde", True, n=1, sde_step_indices=[0, 1])
    file, peft = m.adapters["file"][1], m.adapters["peft"][1]
    loras = [(file, SCALE), (peft, SCALE), None, (file, 0.5)]
    requests = [p] * len(loras)  # one seed: the rows differ by their adapter and scale alone
    tasks = [eng.task(q, lora=lo) for q, lo in zip(requests, loras)]
    shared = eng.shared_forwards
    while not all(t.done for t in tasks):
        eng.step(tasks)
    assert eng.shared_forwards > shared  # the four requests' rows went through shared forwards
    diffs = [compare_tasks(t, eng.run(q, lora=lo)) for t, q, lo in zip(tasks, requests, loras)]
    record_property("diffs", diffs)
    assert all(d <= ROLLOUT_TOL for d in diffs), diffs
    assert max_diff(tasks[0].latents, tasks[3].latents) > 1e-3  # the scale reaches the rows


# --- sleep and wake -------------------------------------------------------------------------------------------


def _outputs(eng, image) -> dict[str, torch.Tensor]:
    """What each component computes for one request: its text (and image) wire tensors, both streams' latents,
    the frames and the waveform decoded from them."""
    p, _ = request(eng, SERVING["all-rescale"])
    torch.set_num_threads(1)
    texts = eng.encoder.wire_tensors([p.prompt, p.negative_prompt], p.max_sequence_length)
    out = {f"text{i}.{k}": t for i, wire in enumerate(texts) for k, t in wire.items()}
    out.update({f"image.{k}": t for k, t in eng.image_wire(p, image).items()})
    out["latents"] = eng.run(p, image=image).latents
    decoded = eng.decoded(out["latents"], p)
    out["frames"], out["audio"] = decoded.frames, decoded.audio
    return out


@pytest.mark.parametrize("model", ["tiny-ltx2", "tiny-ltx2-i2v"])
def test_every_component_sleeps_and_wakes_bit_identical(model, tmp_path_factory):
    from common.runtime.component_memory import modules_of
    from test_sleep import _unsettled, assert_sleep_cycles

    eng = models.engine(models.get(model, tmp_path_factory).model_dir)
    info = eng.info
    components = {"transformer": eng.policy.experts,
                  "text_encoder": modules_of({"text_encoder": eng.encoder, "images": eng.images}),
                  "vae": modules_of({"decoder": eng.decoder})}
    kinds = {tag: sorted(type(m).__name__ for m in modules.values()) for tag, modules in components.items()}
    assert kinds["vae"] == ["AutoencoderKLLTX2Audio", "AutoencoderKLLTX2Video", "LTX2Vocoder"]
    assert kinds["text_encoder"] == sorted(["Gemma3ForConditionalGeneration", "LTX2TextConnectors",
                                            *(["AutoencoderKLLTX2Video"] if eng.images is not None else [])])
    assert kinds["transformer"] == ["LTX2VideoTransformer3DModel"]
    assert _unsettled(components) == {}
    image = picture() if eng.images is not None else None
    assert_sleep_cycles(info, components, lambda: _outputs(eng, image))


# --- groups ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["tiny-ltx2", "tiny-ltx2-i2v"])
def test_a_group_encodes_once_and_branches_as_its_samples_alone(model, tmp_path_factory, record_property):
    eng = models.engine(models.get(model, tmp_path_factory).model_dir)
    image = picture() if eng.images is not None else None
    window = [1, 2]
    p = rollout(eng, "sde", True, n=2, sde_step_indices=window, share_prefix=True)
    encode_group(eng, p, image)
    diffs = branch_diffs(eng, p, window, image)
    record_property("diffs", diffs)
    assert len(diffs) == 2 * 5 and all(d <= ROLLOUT_TOL for d in diffs.values()), diffs  # (a NaN fails)


# --- weight sync (a launched engine: the workers' update paths) -----------------------------------------------


@pytest.mark.heavy
def test_weight_sync_from_disk_and_memory_changes_both_streams_and_the_originals_restore_them(
        engine_factory, lora_root, record_property):
    from common.builtin import ensure_builtin
    from common.diffusion.weights import save_weights, state_dict_checksum
    from rl import TrainerPolicy
    from router.client import EngineClient

    model_dir = ensure_builtin("tiny-ltx2")
    eng = models.engine(model_dir)
    original = TrainerPolicy(model_dir).transformer.state_dict()

    def changed(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        return {k: v + 0.05 * torch.randn(v.shape, generator=g, dtype=v.dtype) for k, v in original.items()}

    engine = engine_factory("tiny-ltx2", extra=["--weight-root", str(lora_root), "--weight-sync-from-memory"])
    req = dict(prompt="a dog barks at the sea", negative_prompt="blurry", seed=3, num_inference_steps=3,
               guidance_scale=4.0, stg_scale=1.0, output_type="latent")
    g = geometry_of(eng.info, eng.params(**{k: v for k, v in req.items() if k != "output_type"}))
    with EngineClient(engine.url) as client:
        def streams():
            return g.split(client.generate(**req)["samples"][0]["output"])

        base = streams()
        new = changed(1)
        save_weights(new, lora_root / "ltx2-step-1")
        assert client.update_weights_from_disk(str(lora_root / "ltx2-step-1"))["sha256"] == state_dict_checksum(new)
        from_disk = streams()
        other = changed(2)
        assert client.update_weights_from_tensors(other)["sha256"] == state_dict_checksum(other)
        from_memory = streams()
        assert client.update_weights_from_tensors(original)["sha256"] == state_dict_checksum(original)
        restored = streams()
    diffs = {f"{name}[{k}]": max_diff(run[k], base[k]) for name, run in (("disk", from_disk), ("memory", from_memory))
             for k in (0, 1)}
    record_property("diffs", diffs)
    assert min(diffs.values()) > 1e-3, diffs  # each update changes the video and the audio latents
    assert max_diff(from_memory[0], from_disk[0]) > 1e-3
    assert all(torch.equal(r, b) for r, b in zip(restored, base))  # bit for bit
