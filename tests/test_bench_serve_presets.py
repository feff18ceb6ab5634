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
from router.api.images import decode_image

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
