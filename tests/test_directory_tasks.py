"""Every task diffusers runs from one directory's weights is served from it, whichever pipeline class its
``model_index.json`` names: a request with an image takes the image task's path, one without the text-only
task's, each equal to that task's diffusers pipeline loaded from the same directory.

The pairs (another served pipeline class's ``from_pretrained`` loads the directory with the same components and
runs another task on it; docs/architecture.md's family table):

- ``LTX2Pipeline`` <-> ``LTX2ImageToVideoPipeline``, either class's directory (Lightricks/LTX-2 names the first);
  common/diffusion/tasks.py's ``serving_both``. Latents (both streams) within 1e-4 of the task's pipeline; a
  rollout with an image on the text-to-video directory recomputed by the trainer within 1e-5; image and text
  requests held at once never share a forward and each equals its run alone;
- ``WanPipeline`` <-> ``WanImageToVideoPipeline`` on ``expand_timesteps`` models (Wan2.2 TI2V-5B): the
  ``WanPipeline`` directory is tests/test_wan_i2v.py's; here the same weights saved under the image class;
- ``FluxKontextPipeline``'s directory -> ``FluxPipeline``: Kontext's own path without an image, at ``max_area``
  = height x width, is ``FluxPipeline``'s text to image.

And the router says so: ``image`` optional in ``/v1/models`` and ``/openapi.json``, the image task's own field
(``image_crf``) refused without an image.
"""

from __future__ import annotations

import json
import shutil

import msgspec
import pytest
import torch

from common.builtin import ensure_builtin
from common.config.engine import EngineConfig, Limits
from common.config.topology import parse_topology
from common.protocol.messages import LOG_PROB_STEPS, LOG_PROBS, TRAJECTORY_LATENTS, TRAJECTORY_SIGMAS, \
    TRAJECTORY_TIMESTEPS, RolloutParams
from family_harness import InStage, ModuleModels, max_diff
from family_harness import gradient_picture as picture
from rl import Trajectory
from test_ltx2 import pipeline_latents, request

TOL, ROLLOUT_TOL = 1e-4, 1e-5
IMAGE = picture(50, 70)
LTX2_GUIDED = dict(guidance_scale=4.0, stg_scale=1.0, modality_scale=2.0, guidance_rescale=0.5)
_MODELS = ModuleModels()


@pytest.fixture(scope="module", autouse=True)
def _module_state():
    yield from _MODELS.module_scope()


@pytest.fixture(scope="module")
def ti2v_as_i2v(tmp_path_factory):
    """tiny-wan-ti2v's weights saved under ``WanImageToVideoPipeline`` (as its save_pretrained writes them)."""
    path = tmp_path_factory.mktemp("ti2v-as-i2v") / "model"
    shutil.copytree(ensure_builtin("tiny-wan-ti2v"), path)
    index = json.loads((path / "model_index.json").read_text())
    index.update(_class_name="WanImageToVideoPipeline", image_encoder=[None, None], image_processor=[None, None])
    (path / "model_index.json").write_text(json.dumps(index))
    return path


# --- LTX-2 ------------------------------------------------------------------------------------------------------

TASKS = {"text": "LTX2Pipeline", "image": "LTX2ImageToVideoPipeline"}


@pytest.mark.parametrize("task", list(TASKS))
@pytest.mark.parametrize("model", ["tiny-ltx2", "tiny-ltx2-i2v"])
def test_an_ltx2_directory_serves_both_tasks_as_their_pipelines(model, task, record_property):
    model_dir = ensure_builtin(model)
    eng, pipe = _MODELS.engine(model_dir), _MODELS.pipe(model_dir, TASKS[task])
    assert eng.family.condition.image_input(eng.info) == "optional"
    image = IMAGE if task == "image" else None
    p, call = request(eng, LTX2_GUIDED)
    video, audio = pipeline_latents(pipe, eng.run(p, image=image).output_latents(), eng, p)
    ref = pipe(**call, **({} if image is None else {"image": image}), output_type="latent")
    diffs = {"video": max_diff(video, ref.frames), "audio": max_diff(audio, ref.audio)}
    record_property("diffs", diffs)
    assert all(d <= TOL for d in diffs.values()), diffs


def test_the_image_conditions_the_ltx2_text_to_video_directory():
    """Not a vacuous match: the image's frame 0 changes the video, with or without it the same model."""
    eng = _MODELS.engine(ensure_builtin("tiny-ltx2"))
    p, _ = request(eng, LTX2_GUIDED)
    with_image, without = eng.run(p, image=IMAGE).output_latents(), eng.run(p).output_latents()
    assert max_diff(with_image, without) > 1e-2


def _rollout(eng, n: int = 2, seed: int = 3):
    return eng.params(num_inference_steps=3, n=n, seed=seed, prompt="a dog barks at the sea", num_frames=9,
                      negative_prompt="blurry, silent", **LTX2_GUIDED,
                      rollout=RolloutParams(sde_type="sde", noise_level=0.7, return_trajectory=True,
                                            sde_step_indices=[0, 1]))


def test_a_rollout_with_an_image_on_the_text_to_video_directory_is_the_trainers():
    """The trainer (its TrainerPolicy on the same LTX2Pipeline directory, given the image) recomputes the
    rollout's log-probs (frame 0, the image's, left out of them as image-to-video's)."""
    model_dir = ensure_builtin("tiny-ltx2")
    eng, trainer = _MODELS.engine(model_dir), _MODELS.trainer(model_dir)
    torch.set_num_threads(1)
    p = _rollout(eng)
    ex = eng.run(p, image=IMAGE).extras()
    inputs = trainer.image(p, IMAGE)
    embeddings = trainer.embeddings(p, inputs)
    diffs = []
    for i in range(p.n):
        sample = Trajectory(ex[TRAJECTORY_LATENTS.name][i], ex[TRAJECTORY_TIMESTEPS.name], ex[TRAJECTORY_SIGMAS.name])
        with torch.no_grad():
            got = trainer.log_probs(sample, ex[LOG_PROB_STEPS.name], p, embeddings=embeddings, image=inputs)
        diffs.append(max_diff(got, ex[LOG_PROBS.name][i]))
    assert max(diffs) <= ROLLOUT_TOL, diffs
    text_only = eng.run(msgspec.structs.replace(p, n=1)).extras()[LOG_PROBS.name][0]
    assert max_diff(text_only, ex[LOG_PROBS.name][0]) > 1e-3  # the image's path, not the text's


def test_image_and_text_requests_of_one_directory_share_no_forward(tmp_path):
    """The denoise worker's own stage holding both at once: its batch choice keeps them apart (their timesteps
    differ in shape: a shared forward would fail and fall back to forwards alone), each equals its run alone."""
    eng = _MODELS.engine(ensure_builtin("tiny-ltx2"))
    st = InStage(eng, tmp_path)
    p, _ = request(eng, LTX2_GUIDED)
    requests = {"image": (p, IMAGE), "text": (p, None)}
    held, real = [], st.stage.denoiser.run  # the requests of each batched step
    st.stage.denoiser.run = lambda batch: held.append(len(batch)) or real(batch)
    together = st.serve(requests)
    assert held and max(held) == 1
    for rid, (params, image) in requests.items():
        alone = st.serve({rid: (params, image)})[rid]
        assert together[rid].msg.info["batch"] == 1
        for name, t in alone.tensors.items():
            assert max_diff(together[rid].tensors[name], t) <= ROLLOUT_TOL, (rid, name)


# --- Wan2.2 TI2V under the image class; FLUX.1 Kontext's text to image ------------------------------------------

def _wan_reference(pipe, p, image=None) -> torch.Tensor:
    return torch.as_tensor(pipe(prompt=p.prompt, negative_prompt=p.negative_prompt, height=p.height, width=p.width,
                                num_frames=p.num_frames, num_inference_steps=p.num_inference_steps,
                                guidance_scale=p.guidance_scale, max_sequence_length=p.max_sequence_length,
                                generator=torch.Generator("cpu").manual_seed(p.seed), output_type="latent",
                                **({} if image is None else {"image": image})).frames)


@pytest.mark.parametrize("task", ["text", "image"])
def test_a_wan_ti2v_directory_of_the_image_class_serves_both_tasks(task, ti2v_as_i2v):
    eng = _MODELS.engine(ti2v_as_i2v)
    assert eng.family.pipeline == "WanImageToVideoPipeline" and eng.info.expand_timesteps
    image = IMAGE if task == "image" else None
    p = eng.params(num_frames=eng.info.defaults["num_frames"], negative_prompt="blurry, still", seed=3)
    pipe = _MODELS.pipe(ti2v_as_i2v, "WanPipeline" if image is None else "WanImageToVideoPipeline")
    assert max_diff(eng.run(p, image=image).output_latents(), _wan_reference(pipe, p, image)) <= TOL


def test_a_flux_kontext_directory_serves_flux_text_to_image():
    model_dir = ensure_builtin("tiny-flux-kontext")
    eng = _MODELS.engine(model_dir)
    p = eng.params(height=64, width=32, max_area=64 * 32, seed=5)
    ref = _MODELS.pipe(model_dir, "FluxPipeline")(
        prompt=p.prompt, height=p.height, width=p.width, guidance_scale=p.guidance_scale,
        num_inference_steps=p.num_inference_steps, max_sequence_length=p.max_sequence_length,
        generator=torch.Generator("cpu").manual_seed(p.seed), output_type="latent").images
    assert max_diff(eng.run(p).latents, ref) <= TOL


# --- what the router says ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["tiny-ltx2", "tiny-ltx2-i2v", "ti2v-as-i2v"])
def test_the_router_takes_an_image_as_optional(model, ti2v_as_i2v, tmp_path):
    from router.api.app import create_app
    from router.request.schemas import GenerateBody
    from router.core.engine import Engine
    from router.core.errors import FieldError
    from router.core.request_params import to_params
    from router.link.dispatcher import Dispatcher

    model_dir = ti2v_as_i2v if model == "ti2v-as-i2v" else ensure_builtin(model)
    config = EngineConfig(model=str(model_dir), workers=parse_topology("encoder=1,denoise=1,decode=1", tmp_path),
                          router_endpoint=f"ipc://{tmp_path}/router.sock", runtime_dir=str(tmp_path),
                          limits=Limits(data_dir=str(tmp_path / "jobs")))
    engine = Engine(config, Dispatcher(config))
    assert engine.models()["data"][0]["image_input"] == "optional"
    schema = create_app(engine).openapi()["paths"]["/generate"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]
    assert schema["required"] == ["prompt"]
    assert any(kind.get("type") != "null" for kind in schema["properties"]["image"]["anyOf"])
    info = engine.info
    pixels = {"image": torch.zeros(64, 96, 3, dtype=torch.uint8)}
    assert to_params(GenerateBody(prompt="a fox", image="x"), info, Limits(), None, pixels).prompt == "a fox"
    assert to_params(GenerateBody(prompt="a fox"), info, Limits()).prompt == "a fox"
    if model != "ti2v-as-i2v":  # the image task's own field: with an image only
        assert to_params(GenerateBody(prompt="a fox", image="x", image_crf=0), info, Limits(), None,
                         pixels).fields["image_crf"] == 0
        with pytest.raises(FieldError) as e:
            to_params(GenerateBody(prompt="a fox", image_crf=0), info, Limits())
        assert e.value.field == "image_crf" and "with an image only" in str(e.value)
