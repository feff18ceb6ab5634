"""Z-Image's other features in process (tests/family_harness.py): LoRA, sleep and wake of every component, groups.

1. LoRA: a diffusers file (``ZImagePipeline.save_lora_weights``) and a peft folder on the family's default targets,
   which reach the attention projections (``attention.to_q/to_k/to_v/to_out.0``) of the noise refiner's, the
   context refiner's and the main layers' blocks: served equal to ``ZImagePipeline`` with ``load_lora_weights``
   (latents and frames, 1e-4); rollout log-probs equal to the trainer's policy with the same adapter put in by
   peft (1e-5); several adapters in one batched step each equal to its request alone (1e-5).
2. Sleep: the transformer, the encoder's ``text_encoder`` (Qwen3) and the decoder's ``vae`` (``AutoencoderKL``),
   each released and resumed (level 1, level 2 with a push or from disk), give every output back bit for bit.
3. Groups: the encoder stage encodes a group's texts once; ``initial_noise_seed`` + ``share_prefix`` branches
   equal each sample run alone.
"""

from __future__ import annotations

import pytest
import torch

import lora_fixtures as lf
from common.protocol.messages import LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, \
    TRAJECTORY_TIMESTEPS
from edit_models import SCALE, EditModels, no_grad
from group_checks import branch_diffs, encode_group
from family_harness import compare_tasks, max_diff
from rl import Trajectory
from test_z_image import CASES as SERVING, request
from test_z_image_rollouts import rollout

SERVE_TOL, ROLLOUT_TOL = 1e-4, 1e-5
MODEL = "tiny-z-image"
# The built-in with a diffusers LoRA file and a peft folder on the family's default targets (edit_models.py).
models = EditModels()


@pytest.fixture(scope="module", autouse=True)
def _module():
    threads = torch.get_num_threads()  # the rollout tests pin one thread
    yield from models.module_scope()
    torch.set_num_threads(threads)


# --- LoRA -----------------------------------------------------------------------------------------------------


def test_the_default_targets_cover_every_blocks_attention(tmp_path_factory):
    m = models.get(MODEL, tmp_path_factory)
    model = m.eng.policy.experts["transformer"]
    blocks = [f"{stack}.{b}" for stack in ("noise_refiner", "context_refiner", "layers")
              for b in range(len(getattr(model, stack)))]
    want = {f"{b}.attention.{p}" for b in blocks for p in ("to_q", "to_k", "to_v", "to_out.0")}
    for kind, (files, adapter) in m.adapters.items():
        assert set(adapter.experts["transformer"]) == want, kind
        assert {k.rsplit(".lora_", 1)[0] for k in files.state_dict} == want, kind


def _reference(pipe, adapter_path, call, seed):
    """``ZImagePipeline`` with the adapter loaded by diffusers and active at SCALE (unloaded after)."""
    pipe.load_lora_weights(str(adapter_path), adapter_name="ref")
    try:
        pipe.set_adapters(["ref"], [SCALE])
        with torch.no_grad():
            latents = pipe(**call, generator=torch.Generator().manual_seed(seed), output_type="latent").images
            shown = pipe(**call, generator=torch.Generator().manual_seed(seed), output_type="pt").images
    finally:
        pipe.unload_lora_weights()
    return latents, shown


@pytest.mark.parametrize("kind, case", [("file", "cfg"), ("peft", "norm-trunc")])
def test_lora_serving_equals_the_pipeline_with_load_lora_weights(kind, case, tmp_path_factory, record_property):
    m = models.get(MODEL, tmp_path_factory)
    eng, pipe = m.eng, models.pipe(m.model_dir)
    files, adapter = m.adapters[kind]
    # diffusers reads no peft folder: its twin holds the same tensors and LoraConfig (lora_fixtures.diffusers_twin)
    path = files.path if kind == "file" else lf.diffusers_twin(files, tmp_path_factory.mktemp("twin"))
    p, call = request(eng, SERVING[case])
    lat = eng.run(p, lora=(adapter, SCALE)).output_latents()
    ref, shown = _reference(pipe, path, call, p.seed)
    frames = eng.frames(lat, p)
    diffs = {"latents": max_diff(lat, ref), "frames": max_diff(frames[:, 0], shown.permute(0, 2, 3, 1))}
    record_property("diffs", diffs)
    assert all(d <= SERVE_TOL for d in diffs.values()), diffs
    assert max_diff(lat, eng.run(p).output_latents()) > 1e-3  # not vacuous: the adapter moves the latents


@pytest.mark.parametrize("kind, guided", [("file", True), ("peft", False)])
def test_lora_rollout_log_probs_equal_the_trainers_peft_recompute(kind, guided, tmp_path_factory, record_property):
    m = models.get(MODEL, tmp_path_factory)
    eng = m.eng
    torch.set_num_threads(1)  # both sides' encoders round by the thread count
    p = rollout(eng, "sde", guided, sde_step_indices=[0, 1, 2])
    ex = eng.run(p, lora=m.lora(kind)).extras()
    trainer = models.trainer_with(m, kind)
    embeddings = no_grad(trainer.embeddings, p)
    diffs = {}
    for i in range(p.n):
        sample = Trajectory(ex[TRAJECTORY_LATENTS.name][i], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])
        got = no_grad(trainer.log_probs, sample, ex[LOG_PROB_STEPS.name], p, embeddings=embeddings)
        diffs[i] = max_diff(got, ex[LOG_PROBS.name][i])
    record_property("diffs", diffs)
    assert all(d <= ROLLOUT_TOL for d in diffs.values()), diffs  # (a NaN fails)
    base = eng.run(p).extras()  # not vacuous: the adapter moves the trajectory
    assert max_diff(base[TRAJECTORY_LATENTS.name], ex[TRAJECTORY_LATENTS.name]) > 1e-3


def test_several_adapters_in_one_batched_step_each_equal_alone(tmp_path_factory, record_property):
    m = models.get(MODEL, tmp_path_factory)
    eng = m.eng
    p = rollout(eng, "sde", True, n=1, sde_step_indices=[0, 1])
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


def _outputs(eng) -> dict[str, torch.Tensor]:
    """What each component computes for one request: its texts' wire tensors, the latents, the frames."""
    p, _ = request(eng, SERVING["norm-trunc"])
    torch.set_num_threads(1)
    texts = eng.encoder.wire_tensors([p.prompt, p.negative_prompt], p.max_sequence_length)
    out = {f"text{i}.{k}": t for i, wire in enumerate(texts) for k, t in wire.items()}
    out["latents"] = eng.run(p).latents
    out["frames"] = eng.frames(out["latents"], p)
    return out


def test_every_component_sleeps_and_wakes_bit_identical(tmp_path_factory):
    from common.runtime.component_memory import modules_of
    from test_sleep import _unsettled, assert_sleep_cycles

    eng = models.engine(models.get(MODEL, tmp_path_factory).model_dir)
    info = eng.info
    assert eng.images is None  # text to image: no image side
    components = {"transformer": eng.policy.experts,
                  "text_encoder": modules_of({"text_encoder": eng.encoder, "images": eng.images}),
                  "vae": modules_of({"decoder": eng.decoder})}
    kinds = {tag: sorted(type(m).__name__ for m in modules.values()) for tag, modules in components.items()}
    assert kinds == {"transformer": ["ZImageTransformer2DModel"], "text_encoder": ["Qwen3Model"],
                     "vae": ["AutoencoderKL"]}, kinds
    assert _unsettled(components) == {}
    assert_sleep_cycles(info, components, lambda: _outputs(eng))


# --- groups ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("guided", [True, False])
def test_a_group_encodes_once_and_branches_as_its_samples_alone(guided, tmp_path_factory, record_property):
    eng = models.engine(models.get(MODEL, tmp_path_factory).model_dir)
    window = [1, 2]
    p = rollout(eng, "sde", guided, n=2, sde_step_indices=window, share_prefix=True)
    text_calls = encode_group(eng, p)
    assert len(text_calls[0][0]) == (2 if guided else 1), text_calls[0][0]
    diffs = branch_diffs(eng, p, window)
    record_property("diffs", diffs)
    assert len(diffs) == 2 * 3 and all(d <= ROLLOUT_TOL for d in diffs.values()), diffs  # (a NaN fails)
