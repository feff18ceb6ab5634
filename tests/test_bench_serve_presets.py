"""bench/serve.py's presets stay runnable without starting anything: each names a built-in model, parses, and
an image preset's requests carry pictures the router decodes to the pixels the diffusers baseline is given
(another size and aspect than the output; several as a list), the repeats the same picture; the edit presets'
encoder and decode workers get every core on the CPU only."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from common.builtin import BUILTINS
from common.diffusion.parts.condition import NoCondition
from common.families import binding_for
from router.request.images import decode_image

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import serve  # noqa: E402

EDIT_PRESETS = [name for name, preset in serve.PRESETS.items() if "edit" in name or "kontext" in name]


@pytest.mark.parametrize("name", sorted(serve.PRESETS))
def test_every_preset_names_a_builtin_and_parses(name):
    args = serve.parse_args(["--preset", name])
    assert args.model in BUILTINS and args.model == serve.PRESETS[name]["model"]
    binding = binding_for(BUILTINS[args.model].PIPELINE)
    assert (args.num_frames is None) == (not binding.video)
    # The preset's images go to a model whose condition part takes an image (which, it says from the model
    # directory: not built here).
    if serve.PRESETS[name].get("images"):
        assert type(binding.condition).image_input is not NoCondition.image_input


def test_edit_presets_exist_and_take_their_images():
    assert {"small-qwen-image-edit", "small-qwen-image-edit-plus", "small-flux-kontext"} <= set(EDIT_PRESETS)
    for name in EDIT_PRESETS:
        args = serve.parse_args(["--preset", name])
        assert args.images_asked and args.pictures == (2 if name.endswith("-plus") else 1)
        assert args.encoder_threads == args.decode_threads == "all"
        # On a GPU the compact topology places the workers: no CPU thread file.
        gpu = serve.parse_args(["--preset", name, "--device", "cuda"])
        assert gpu.encoder_threads is None and gpu.decode_threads is None and gpu.topology == serve.DEFAULT_TOPOLOGY
        # A topology given on the command line wins.
        own = serve.parse_args(["--preset", name, "--topology", "encoder=1,denoise=2,decode=1"])
        assert own.encoder_threads is None and own.decode_threads is None
        assert own.topology == "encoder=1,denoise=2,decode=1"


def test_edit_presets_topology_file_gives_encoder_and_decode_every_core(tmp_path):
    import json

    args = serve.parse_args(["--preset", "small-qwen-image-edit"])
    entries = json.loads(Path(serve._topology_file(args, str(tmp_path))).read_text())
    cores = serve.os.cpu_count() or 1
    assert {e["role"]: e.get("threads") for e in entries} == {"encoder": cores, "denoise": None, "decode": cores}
    # A preset without decode_threads leaves the decode worker on its default.
    args = serve.parse_args(["--preset", "small-qwen-image-edit"])
    args.decode_threads = None
    entries = json.loads(Path(serve._topology_file(args, str(tmp_path))).read_text())
    assert "threads" not in entries[2] and entries[0]["threads"] == cores


def _work(pictures: int) -> serve.Workload:
    return serve.Workload(height=256, width=256, num_frames=1, steps=2, guidance=None, output_type="frames", n=1,
                          seed=3, video=False, true_cfg=4.0, images=2, pictures=pictures)


def _pixels(field) -> np.ndarray:
    return decode_image(field)


def test_an_edit_request_carries_the_baselines_picture():
    work = _work(1)
    body = work.body(0)
    assert "num_frames" not in body and "guidance_scale" not in body and body["true_cfg_scale"] == 4.0
    sent, given = _pixels(body["image"]), np.asarray(work.image(0))
    assert np.array_equal(sent, given)
    height, width = sent.shape[:2]
    assert (height, width) == serve.IMAGE_SIZE and height != body["height"] and width / height != 1
    # Request i + images repeats request i's picture (the encoder's cache); another request has another one,
    # and the warm-up's is its own.
    assert work.body(2)["image"] == body["image"] and work.body(1)["image"] != body["image"]
    assert work.warmup_body(0)["image"] not in (body["image"], work.body(1)["image"])


def test_several_pictures_go_as_a_list():
    work = _work(2)
    body = work.body(1)
    assert isinstance(body["image"], list) and len(body["image"]) == 2
    given = work.image(1)
    for field, picture in zip(body["image"], given):
        assert np.array_equal(_pixels(field), np.asarray(picture))
    assert given[0].size[::-1] == serve.IMAGE_SIZE and given[1].size == serve.IMAGE_SIZE  # the second transposed
    assert work.body(3)["image"] == body["image"]
    assert serve.parse_args(["--preset", "small-qwen-image-edit", "--pictures", "2"]).pictures == 2
    with pytest.raises(SystemExit):
        serve.parse_args(["--pictures", "0"])


def test_ltx2_preset_runs_the_pipelines_default_guidance_on_the_served_block():
    """small-ltx2: every guidance as LTX2Pipeline's own defaults run it (CFG, STG, modality, rescale on both
    streams), sent to the engine as fields LTX-2 declares and handed to the pipeline under the same names; STG's
    block is the model's stg_block, the pipeline's spatio_temporal_guidance_blocks; 8 requests all in flight."""
    import inspect

    import diffusers

    args = serve.parse_args(["--preset", "small-ltx2"])
    binding = binding_for(BUILTINS[args.model].PIPELINE)
    signature = inspect.signature(getattr(diffusers, binding.pipeline).__call__).parameters
    declared = {f.name for f in binding.request_fields}
    assert {"stg_scale", "modality_scale", "audio_guidance_scale"} <= set(args.fields)
    for name, value in args.fields.items():
        assert name in declared and signature[name].default == value, name
    # Every audio guidance field the pipeline has is sent (the engine's fall back to the video ones instead).
    assert {n for n in signature if n.startswith("audio_") and n != "audio_latents"} <= set(args.fields)
    assert args.guidance == signature["guidance_scale"].default
    spec = BUILTINS[args.model]
    assert (args.height, args.width, args.num_frames) == (spec.height, spec.width, spec.num_frames)
    assert serve.PIPELINE_ARGS["stg_block"](spec.stg_block) == {"spatio_temporal_guidance_blocks": [spec.stg_block]}
    assert "spatio_temporal_guidance_blocks" in signature and "stg_block" in declared
    assert args.concurrency == [1, 8] and args.requests >= 8
    assert args.encoder_threads == args.decode_threads == "all"
    work = serve.Workload(height=args.height, width=args.width, num_frames=args.num_frames, steps=args.steps,
                          guidance=args.guidance, output_type="frames", n=1, seed=0,
                          fields=tuple(args.fields.items()))
    assert all(work.body(i)[k] == v for i in (0, 5) for k, v in args.fields.items())
    assert work.warmup_body(0)["audio_guidance_scale"] == args.fields["audio_guidance_scale"]


def test_hunyuan_video15_preset_leaves_the_scale_to_the_models_guider():
    """small-hunyuan-video15: ``HunyuanVideo15Pipeline`` takes no ``guidance_scale`` (its guider holds the scale),
    so the requests carry none and both sides run the guider's, CFG on (the engine's default is the guider's
    scale); every argument the baseline hands the pipeline is one it takes; the built-in's size, frames and
    steps; one request at a time against diffusers."""
    import inspect

    import diffusers

    args = serve.parse_args(["--preset", "small-hunyuan-video15"])
    spec = BUILTINS[args.model]
    signature = inspect.signature(getattr(diffusers, binding_for(spec.pipeline).pipeline).__call__).parameters
    assert "guidance_scale" not in signature and args.guidance is None
    assert "guidance_scale" in spec.SERVING_DEFAULT_KEYS and spec.guidance_scale == spec.guider_scale > 1
    work = serve.Workload(height=args.height, width=args.width, num_frames=args.num_frames, steps=args.steps,
                          guidance=args.guidance, output_type="frames", n=1, seed=0)
    for body in (work.body(0), work.warmup_body(0)):
        sent = {"prompt", "negative_prompt", "height", "width", "num_frames", "num_inference_steps"}
        assert "guidance_scale" not in body and sent <= set(body) and sent <= set(signature)
    assert (args.height, args.width, args.num_frames, args.steps) == (spec.height, spec.width, spec.num_frames,
                                                                      spec.num_inference_steps)
    assert args.concurrency == [1] and serve.PRESETS["small-hunyuan-video15"]["target_p50_ratio"] == 1.05


def test_the_sender_keeps_a_waveform_where_the_answer_carries_one():
    """The check's waveform side: an answer's ``audio`` is kept beside its frames (and none where the answers
    have none), and the comparison sees a waveform that differs."""
    import asyncio

    import httpx
    import msgpack
    import torch

    from common.protocol.http_tensors import tensor_to_body

    frames, wave = torch.rand(9, 8, 8, 3), torch.randn(2, 400)

    def answer(request: httpx.Request) -> httpx.Response:
        sample = {"seed": 0, "output": tensor_to_body(frames, binary=True)}
        if b"with-sound" in request.content:
            sample.update(audio=tensor_to_body(wave, binary=True), sample_rate=24000)
        body = msgpack.packb({"samples": [sample], "timings": {}}, use_bin_type=True)
        return httpx.Response(200, content=body, headers={"content-type": serve.MSGPACK})

    async def send(prompt: str) -> serve.Sender:
        work = serve.Workload(height=8, width=8, num_frames=9, steps=1, guidance=None, output_type="frames", n=1,
                              seed=0)
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://engine") as http:
            sender = serve.Sender(http, work, keep=1, seen=set())
            assert (await sender.send(0, {**work.body(0), "prompt": prompt})).ok
        return sender

    with_sound, silent = asyncio.run(send("with-sound")), asyncio.run(send("silent"))
    assert torch.equal(with_sound.sounds[0][0], wave) and torch.equal(with_sound.outputs[0][0], frames)
    assert silent.sounds == {} and torch.equal(silent.outputs[0][0], frames)
    check = serve.compare({"c=1": with_sound.sounds}, {0: [wave + 1e-3]}, 1e-4)
    assert not check["ok"] and abs(check["max_abs_diff"] - 1e-3) < 1e-6
    assert serve.compare({"c=1": with_sound.sounds}, {0: [wave]}, 1e-4)["ok"]


def test_flux2_klein_preset_sends_no_negative_prompt_and_no_guidance():
    """small-flux2-klein: a step-distilled model, so guidance at most 1 (which its refusal lets through) and no
    negative prompt, which Flux2KleinPipeline does not take (the engine refuses even an empty one); pipelines
    that take one still get the empty one."""
    from types import SimpleNamespace

    args = serve.parse_args(["--preset", "small-flux2-klein"])
    spec = BUILTINS[args.model]
    binding = binding_for(spec.PIPELINE)
    assert spec.is_distilled and args.guidance <= 1.0 and args.concurrency == [1, 16]
    assert (args.height, args.width) == (spec.height, spec.width)
    assert not serve.takes_negative_prompt(binding.pipeline)
    assert serve.takes_negative_prompt("FluxPipeline") and serve.takes_negative_prompt("WanPipeline")
    work = serve.Workload(height=args.height, width=args.width, num_frames=1, steps=args.steps,
                          guidance=args.guidance, output_type="frames", n=1, seed=0, video=False,
                          negative_prompt=serve.takes_negative_prompt(binding.pipeline))
    info = SimpleNamespace(family=binding, index={"is_distilled": spec.is_distilled})
    for body in (work.body(0), work.warmup_body(0)):
        assert "negative_prompt" not in body and body["guidance_scale"] == args.guidance
        assert binding.guidance.refusal(info, body) is None
    # What the engine refuses, so the check above is not vacuous.
    assert binding.guidance.refusal(info, {**work.body(0), "negative_prompt": ""})[0] == "negative_prompt"
    assert binding.guidance.refusal(info, {**work.body(0), "guidance_scale": 4.0})[0] == "guidance_scale"
    assert serve.Workload(**{**work.__dict__, "negative_prompt": True}).body(0)["negative_prompt"] == ""


def test_z_image_preset_runs_turbos_setting_one_forward_a_step_on_both_sides():
    """small-z-image: Z-Image-Turbo's 8 steps at guidance_scale 0, which both the engine (its guidance part's
    switch) and ZImagePipeline (``do_classifier_free_guidance``: above 0) run without a negative pass; the
    guidance fields the baseline is handed as the model's serving defaults are the pipeline's own defaults."""
    import inspect
    from types import SimpleNamespace

    import diffusers

    args = serve.parse_args(["--preset", "small-z-image"])
    binding = binding_for(BUILTINS[args.model].PIPELINE)
    assert binding.family == "z-image" and args.steps == 8 and args.guidance == 0.0
    assert args.encoder_threads == args.decode_threads == "all"  # the CPU only (as the edit presets')
    assert serve.parse_args(["--preset", "small-z-image", "--device", "cuda"]).decode_threads is None
    assert not binding.guidance.uses_cfg(SimpleNamespace(guidance_scale=args.guidance, fields={}))
    pipeline = getattr(diffusers, binding.pipeline)
    assert not pipeline.do_classifier_free_guidance.fget(SimpleNamespace(_guidance_scale=args.guidance))
    signature = inspect.signature(pipeline.__call__).parameters
    own = [f.name for f in binding.request_fields if f.name.startswith("cfg_")]
    assert own and all(binding.defaults[name] == signature[name].default for name in own), own


def test_the_paired_comparison_takes_turns_and_compares_medians():
    """The c=1 target is checked on requests taking turns, the first of each pair alternating, so that a machine
    slowing down over the run weighs on the engine and the pipeline alike; the ratio is of the two medians."""
    order = []

    def engine(i):
        order.append(("engine", i))
        return [1.0, 5.0, 2.0, 3.0][i]  # the engine's own latency, as reported

    def pipeline(i):
        order.append(("diffusers", i))

    paired = serve._paired(4, engine, pipeline)
    assert order == [("engine", 0), ("diffusers", 0), ("diffusers", 1), ("engine", 1),
                     ("engine", 2), ("diffusers", 2), ("diffusers", 3), ("engine", 3)]
    assert paired["engine_latencies_s"] == [1.0, 5.0, 2.0, 3.0] and len(paired["diffusers_latencies_s"]) == 4
    assert paired["p50_ratio"] == serve.percentile([1.0, 5.0, 2.0, 3.0], 0.5) / paired["diffusers_p50_s"]
    assert serve.parse_args(["--preset", "small-z-image"]).pairs == 16
    assert serve.parse_args(["--preset", "small-z-image", "--no-diffusers"]).pairs == 0
