"""Checkpoints as downloaded (common/diffusion/loading.py), each served equal to diffusers loading the same files,
and broken ones refused at launch in one line (common/diffusion/checkpoint_check.py, common/families/checkpoints.py).

1. Built-ins written as real checkpoints ship (common/builtin/spec.py ``with_layout``): bf16 weights in shards with
   an index, and fp16 ``variant`` files only. Through the family registry (every pipeline with DISAGG_HEAVY=1, a
   few by default): every module the engine's workers load equals, tensor for tensor, the one diffusers' or
   transformers' ``from_pretrained`` loads from the same folder (``variant=``), in float32 (upcast). On Wan, the
   served latents equal diffusers' on both layouts (1e-4), and computed in bf16 (fp16) they equal diffusers' in it.
2. ``--transformer-file``: one .safetensors (diffusers' names; Wan's original names, which diffusers' converter
   renames) and a GGUF Q8_0 file (diffusers' names on FLUX.1, Wan's original names) with the rest of the pipeline
   from the base directory, served equal to diffusers' ``from_single_file`` (with ``GGUFQuantizationConfig``) on
   the same file; a reload from disk (sleep level 2) and a trainer's copy read the file again; a LoRA in Wan's own
   names (a community format diffusers' loader converts) served equal to ``load_lora_weights``.
3. Broken: a shard missing from its index, a truncated file, a shape the config's model does not hold, a config
   the model class cannot be built from, an integer dtype for a float weight, a single file of another model, a
   class from_single_file does not map, a directory of another pipeline, weights of two variants and no plain
   ones: ``launch.main`` exits non-zero naming the file or property, before any worker starts; one launched run
   checks the process boundary (one line, no traceback).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import family_harness
from common.builtin import BUILTINS, ensure_builtin
from common.builtin.spec import with_layout
from common.diffusion.weights import save_weights, state_dict_checksum
from common.families.checkpoints import checkpoint_problem
from common.runtime.component_memory import modules_of
from family_builtins import tiny_per_pipeline
from family_harness import InProcess, max_diff
from rl import TrainerPolicy

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-4
LAYOUTS = {"bf16-sharded": dict(weights_dtype="bfloat16", max_shard_size="32KB"),
           "fp16-variant": dict(weights_dtype="float16", variant="fp16")}
DEFAULT_PIPELINES = ("WanPipeline", "FluxPipeline", "QwenImagePipeline")  # the rest: DISAGG_HEAVY=1
WAN_TO_ORIGINAL = (  # diffusers' names -> Wan's own (the inverse of diffusers' convert_wan_transformer_to_diffusers)
    ("condition_embedder.time_embedder.linear_", "time_embedding.@"), ("condition_embedder.text_embedder.linear_",
    "text_embedding.@"), ("condition_embedder.time_proj", "time_projection.1"), ("attn1", "self_attn"),
    ("attn2", "cross_attn"), (".to_out.0.", ".o."), (".to_q.", ".q."), (".to_k.", ".k."), (".to_v.", ".v."),
    ("ffn.net.0.proj", "ffn.0"), ("ffn.net.2", "ffn.2"), ("norm2", "norm3"), ("proj_out", "head.head"))


def layout_dir(name: str, layout: str) -> Path:
    return ensure_builtin(with_layout(BUILTINS[name], **LAYOUTS[layout]))


def _registry():
    return [pytest.param(pipeline, name, marks=() if pipeline in DEFAULT_PIPELINES else pytest.mark.heavy)
            for pipeline, name in sorted(tiny_per_pipeline().items())]


def diffusers_pipeline(model_dir: Path, dtype=torch.float32, variant=None, **components):
    import diffusers
    from conftest import reference_pipeline

    cls = getattr(diffusers, json.loads((model_dir / "model_index.json").read_text())["_class_name"])
    return reference_pipeline(cls.from_pretrained(model_dir, dtype=dtype, variant=variant, **components))


def diffusers_latents(pipe, eng: InProcess, p) -> torch.Tensor:
    """The pipeline's final latents for request ``p`` (Wan: [1, C, F, H, W]; FLUX.1: packed [1, seq, 64])."""
    kw = dict(prompt=p.prompt, height=p.height, width=p.width, num_inference_steps=p.num_inference_steps,
              generator=torch.Generator("cpu").manual_seed(p.seed), output_type="latent")
    if eng.family.pipeline == "WanPipeline":
        out = pipe(negative_prompt=p.negative_prompt, num_frames=p.num_frames, guidance_scale=p.guidance_scale, **kw)
        return out.frames
    guidance = {"guidance_scale": p.guidance_scale} if eng.info.transformer_config.get("guidance_embeds") else {}
    return pipe(max_sequence_length=p.max_sequence_length, **guidance, **kw).images


def request(eng: InProcess):
    return eng.params(num_frames=eng.info.defaults.get("num_frames", 1), seed=3)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("pipeline, name", _registry())
def test_every_module_the_workers_load_is_the_one_diffusers_loads(pipeline, name, layout):
    model_dir = layout_dir(name, layout)
    files = [f.name for f in (model_dir / "transformer").iterdir()]
    if layout == "bf16-sharded":
        assert "diffusion_pytorch_model.safetensors.index.json" in files and len(files) > 3
    else:
        assert not [f for f in files if f.endswith(".safetensors") and ".fp16" not in f]
    assert checkpoint_problem(model_dir) is None
    eng = InProcess(model_dir)
    ours = {**eng.policy.experts, **modules_of({"encoder": eng.encoder, "decoder": eng.decoder, "images": eng.images})}
    theirs = diffusers_components(model_dir, LAYOUTS[layout].get("variant"))
    assert len(ours) >= 3 and all(m.dtype == torch.float32 for m in ours.values() if hasattr(m, "dtype"))
    assert {path for path, m in ours.items() if not any(holds(t, m) for t in theirs.values())} == set()


def diffusers_components(model_dir: Path, variant: str | None) -> dict[str, torch.nn.Module]:
    """Each model component of the directory as its library's own ``from_pretrained`` loads it (float32)."""
    from common.diffusion.checkpoint_check import model_class

    index = json.loads((model_dir / "model_index.json").read_text())
    classes = {name: model_class(*entry) for name, entry in index.items()
               if not name.startswith("_") and isinstance(entry, list) and entry[0] is not None}
    return {name: cls.from_pretrained(model_dir / name, dtype=torch.float32, variant=variant)
            for name, cls in classes.items() if cls is not None}


def holds(theirs: torch.nn.Module, ours: torch.nn.Module) -> bool:
    """Whether every tensor of ``ours`` is ``theirs``'s of that name, equal (a worker may keep part of a model:
    an image encoder's VAE without its decoder)."""
    a, b = ours.state_dict(), theirs.state_dict()
    return set(a) <= set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_served_latents_equal_diffusers_on_each_layout(layout, record_property):
    model_dir = layout_dir("tiny", layout)
    eng = InProcess(model_dir)
    p = request(eng)
    ref = diffusers_latents(diffusers_pipeline(model_dir, variant=LAYOUTS[layout].get("variant")), eng, p)
    record_property("max_diff", diff := max_diff(eng.run(p).latents, ref))
    assert diff <= TOL


@pytest.mark.parametrize("layout, dtype", [("bf16-sharded", torch.bfloat16), ("fp16-variant", torch.float16)])
def test_weights_computed_in_their_own_dtype_equal_diffusers_in_it(layout, dtype, monkeypatch, record_property):
    model_dir = layout_dir("tiny", layout)
    monkeypatch.setattr(family_harness, "DTYPE", dtype)  # as a worker started with --dtype bfloat16 / float16
    eng = InProcess(model_dir)
    assert eng.policy.dtype == dtype
    p = request(eng)
    ref = diffusers_latents(diffusers_pipeline(model_dir, dtype=dtype, variant=LAYOUTS[layout].get("variant")), eng, p)
    record_property("max_diff", diff := max_diff(eng.run(p).latents, ref))
    assert diff <= TOL


# --- one file for the transformer ------------------------------------------------------------------------------
def fine_tuned(model_dir: Path) -> dict[str, torch.Tensor]:
    """The base directory's transformer weights moved (a fine-tune: its outputs differ from the base's)."""
    from safetensors.torch import load_file

    gen = torch.Generator().manual_seed(7)
    state = load_file(model_dir / "transformer" / "diffusion_pytorch_model.safetensors")
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) * v.std().nan_to_num() for k, v in state.items()}


def wan_original_name(name: str) -> str:
    """A Wan transformer tensor's (or module's) name as Wan's own checkpoints spell it."""
    if name == "scale_shift_table":
        return "head.modulation"
    for ours, theirs in WAN_TO_ORIGINAL:
        name = name.replace(ours, theirs)
    return name.replace("@1", "0").replace("@2", "2").replace("scale_shift_table", "modulation")


def wan_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Wan's own checkpoint names (blocks.0.self_attn.q, head.modulation, ...), checked against diffusers'
    converter: it renames them back onto the model's."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    out = {wan_original_name(k): v for k, v in state.items()}
    assert set(convert_wan_transformer_to_diffusers(dict(out))) == set(state) and len(set(out) & set(state)) < 4
    return out


def write_gguf(state: dict[str, torch.Tensor], path: Path) -> Path:
    """``state`` as a GGUF file: each matrix whose rows split in 32-value blocks as Q8_0, the rest float32."""
    import gguf

    writer = gguf.GGUFWriter(path, arch="test")
    for name, tensor in state.items():
        values = tensor.float().numpy()
        if values.ndim == 2 and values.shape[-1] % 32 == 0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            writer.add_tensor(name, gguf.quants.quantize(values, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def single_file(tmp_path: Path, name: str, kind: str) -> Path:
    state = fine_tuned(ensure_builtin(name))
    if name == "tiny" and kind != "diffusers-names":
        state = wan_original(state)
    if kind.endswith("gguf"):
        return write_gguf(state, tmp_path / "transformer.gguf")
    return save_weights(state, tmp_path / "transformer.safetensors")


@pytest.mark.parametrize("name, kind", [("tiny-flux", "diffusers-names"), ("tiny", "original-names"),
                                        ("tiny-flux", "gguf"), ("tiny", "original-names-gguf")])
def test_a_transformer_file_serves_as_diffusers_loads_it(name, kind, tmp_path, record_property):
    import diffusers

    base, file = ensure_builtin(name), single_file(tmp_path, name, kind)
    assert checkpoint_problem(base, file) is None
    eng = InProcess(base, file)
    cls = getattr(diffusers, eng.family.transformer.model_class)
    quant = {}
    if file.suffix == ".gguf":
        quant["quantization_config"] = diffusers.GGUFQuantizationConfig(compute_dtype=torch.float32)
        assert any(hasattr(p, "quant_type") for p in eng.policy.experts["transformer"].parameters())
    transformer = cls.from_single_file(str(file), config=str(base), subfolder="transformer", **quant)
    p = request(eng)
    served = eng.run(p).latents
    diff = max_diff(served, diffusers_latents(diffusers_pipeline(base, transformer=transformer), eng, p))
    record_property("max_diff", diff)
    assert diff <= TOL
    assert max_diff(served, InProcess(base).run(p).latents) > 1e-3  # the file's weights, not the base's


@pytest.mark.parametrize("kind", ["diffusers-names", "gguf"])
def test_a_reload_from_disk_reads_the_transformer_file(kind, tmp_path):
    """Sleep level 2 drops the weights; a resume from disk loads them from the file again, the same bytes (GGUF's
    still quantized); a weight update of a GGUF transformer is refused naming why."""
    from common.config.engine import EngineConfig, WorkerSpec
    from denoise_worker.stage import DenoiseStage

    base, file = ensure_builtin("tiny-flux"), single_file(tmp_path, "tiny-flux", kind)
    config = EngineConfig(model=str(base), workers=[WorkerSpec(role="denoise", index=0)], router_endpoint="",
                          runtime_dir=str(tmp_path), transformer_file=str(file))
    stage = DenoiseStage(config, config.workers[0])
    stage.load()
    def quantized():  # GGUF's weights stay quantized (dequantized in each forward)
        return sum(hasattr(p, "quant_type") for p in stage.policy.experts["transformer"].parameters())

    loaded, held = state_dict_checksum(stage.policy.experts["transformer"]), quantized()
    assert loaded != state_dict_checksum(InProcess(base).policy.experts["transformer"])
    assert (held > 0) == (kind == "gguf")
    trainer = TrainerPolicy(base, transformer_file=file)  # a trainer's recompute reads the same file (GGUF: frozen)
    assert state_dict_checksum(trainer.policy.experts["transformer"]) == loaded
    stage.memory.release(2)
    stage.memory.resume(reload="disk")
    assert state_dict_checksum(stage.policy.experts["transformer"]) == loaded and quantized() == held
    if kind == "gguf":  # a trainer's push cannot replace quantized weights: refused, the weights kept
        from common.diffusion.weights import WeightsError, load_into

        with pytest.raises(WeightsError, match="GGUF-quantized"):
            load_into(stage.policy.experts["transformer"], fine_tuned(base))


def test_a_community_lora_serves_as_diffusers_loads_it(tmp_path, record_property):
    """A LoRA in Wan's own names as its trainers write them (``diffusion_model.blocks.0.self_attn.q.lora_down``,
    per-module ``alpha``): read through diffusers' WanPipeline converter, served equal to ``load_lora_weights``."""
    import lora_fixtures as lf
    from common.diffusion.lora import build_adapter
    from common.diffusion.lora_format import read_lora

    model_dir = ensure_builtin("tiny")
    made = lf.make_diffusers_lora(model_dir, tmp_path / "d", rank=4, alpha=8, target_modules=lf.ATTN, seed=1)
    tensors = {}
    for key, value in made.state_dict.items():  # blocks.0.attn1.to_q.lora_A.weight
        module, part = key.rsplit(".lora_", 1)
        name = "diffusion_model." + wan_original_name(module + ".")[:-1]
        tensors[f"{name}.lora_{'down' if part.startswith('A') else 'up'}.weight"] = value
        tensors[f"{name}.alpha"] = torch.tensor(float(made.alpha))
    file = lf.write_raw_lora(tmp_path / "wan_lora.safetensors", tensors)
    eng = InProcess(model_dir)
    adapter = build_adapter("c", 1, read_lora(str(file), None, pipeline="WanPipeline"), eng.policy.experts, 64)
    eng.policy.cover(adapter)
    p = request(eng)
    got = eng.run(p, lora=(adapter, 0.8)).latents
    pipe = diffusers_pipeline(model_dir)
    pipe.load_lora_weights(str(file), adapter_name="c")
    pipe.set_adapters(["c"], [0.8])
    record_property("max_diff", diff := max_diff(got, diffusers_latents(pipe, eng, p)))
    assert diff <= TOL and max_diff(got, eng.run(p).latents) > 1e-3  # equal, and the adapter changes the output


# --- refused at launch -----------------------------------------------------------------------------------------
def _broken(tmp_path: Path, case: str) -> tuple[list[str], str]:
    """A launch's flags for broken layout ``case`` and the words its refusal must hold."""
    sharded = shutil.copytree(layout_dir("tiny-flux", "bf16-sharded"), tmp_path / "m")
    shards = sorted((sharded / "transformer").glob("*-of-*.safetensors"))
    flux_file = ensure_builtin("tiny-flux") / "transformer" / "diffusion_pytorch_model.safetensors"
    if case == "missing shard":
        shards[1].unlink()
        return ["--model", str(sharded)], f"names shard {shards[1].name}, which is missing"
    if case == "truncated":
        with open(shards[0], "r+b") as f:
            f.truncate(shards[0].stat().st_size - 100)
        return ["--model", str(sharded)], f"{shards[0].name}: truncated"
    if case == "shape":
        config = sharded / "transformer" / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "joint_attention_dim": 48}))
        return ["--model", str(sharded)], "context_embedder.weight has shape"
    if case == "config that builds no model":
        config = sharded / "vae" / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "norm_num_groups": 3}))
        return ["--model", str(sharded)], "vae/config.json: does not build AutoencoderKL"
    if case == "integer dtype":
        from safetensors.torch import load_file

        flux = shutil.copytree(ensure_builtin("tiny-flux"), tmp_path / "f")
        state = load_file(flux / "transformer" / "diffusion_pytorch_model.safetensors")
        state["x_embedder.weight"] = state["x_embedder.weight"].to(torch.int32)
        save_weights(state, flux / "transformer")
        return ["--model", str(flux)], "x_embedder.weight is stored as I32"
    if case == "file of another model":
        sd3_file = ensure_builtin("tiny-sd3") / "transformer" / "diffusion_pytorch_model.safetensors"
        return ["--model", str(sharded), "--transformer-file", str(sd3_file)], "not a checkpoint of FluxTransformer2DModel"
    if case == "class without single files":
        return ["--model", str(ensure_builtin("tiny-hunyuan-video15")), "--transformer-file", str(flux_file)], \
            "HunyuanVideo15Transformer3DModel, which diffusers' from_single_file does not load"
    if case == "another pipeline":
        index = sharded / "model_index.json"
        index.write_text(index.read_text().replace('"FluxPipeline"', '"StableDiffusion3Pipeline"'))
        return ["--model", str(sharded)], "StableDiffusion3Pipeline needs"
    assert case == "two variants"
    for f in list((sharded / "vae").glob("diffusion_pytorch_model*")):
        for tag in ("fp16", "ema"):  # as save_pretrained(variant=tag) names them
            name = f.name.replace(".safetensors.index.json", f".safetensors.index.{tag}.json")
            shutil.copy(f, f.parent / (name if name != f.name else f.name.replace("_model", f"_model.{tag}", 1)))
        f.unlink()
    return ["--model", str(sharded)], "several variants (ema, fp16)"


CASES = ["missing shard", "truncated", "shape", "config that builds no model", "integer dtype", "file of another model",
         "class without single files", "another pipeline", "two variants"]


@pytest.mark.parametrize("case", CASES)
def test_a_broken_checkpoint_is_refused_before_any_worker_starts(case, tmp_path, monkeypatch):
    import launch
    from common.runtime.supervisor import Supervisor

    flags, words = _broken(tmp_path, case)
    monkeypatch.setattr(Supervisor, "start", lambda self: pytest.fail("a worker started"))
    with pytest.raises(SystemExit) as exited:
        launch.main([*flags, "--port", "0", "--data-dir", str(tmp_path / "jobs")])
    message = str(exited.value.code)
    assert message.startswith("launch.py: error: ") and "\n" not in message and words in message, message


def test_the_launcher_refuses_in_one_line_and_exits_non_zero(tmp_path):
    flags, words = _broken(tmp_path, "truncated")
    run = subprocess.run([sys.executable, str(ROOT / "launch.py"), *flags, "--port", "0", "--data-dir",
                          str(tmp_path / "jobs")], capture_output=True, text=True, timeout=120, cwd=ROOT)
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode != 0 and "Traceback" not in run.stderr and words in last and "starting" not in run.stderr
