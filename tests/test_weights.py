"""common.diffusion.weights: checksums, reading safetensors layouts, validated in-place loading."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from diffusers import WanTransformer3DModel

from common.builtin import ensure_builtin
from common.diffusion.weights import (
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    WeightsError,
    load_into,
    read_weights,
    save_weights,
    state_dict_checksum,
    validate_against,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def transformer_dir() -> Path:
    return ensure_builtin("tiny") / "transformer"


@pytest.fixture
def model(transformer_dir) -> WanTransformer3DModel:
    return WanTransformer3DModel.from_pretrained(transformer_dir).eval()


def _forward(m: WanTransformer3DModel) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    latents = torch.randn(1, m.config.in_channels, 2, 4, 4, generator=gen)
    text = torch.randn(1, 8, m.config.text_dim, generator=gen)
    with torch.no_grad():
        return m(hidden_states=latents, timestep=torch.tensor([500.0]), encoder_hidden_states=text,
                 return_dict=False)[0]


def _perturbed(state, seed: int = 1, scale: float = 0.05) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in state.items()}


def _cloned(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in m.state_dict().items()}


def _assert_same_state(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


# --------------------------------------------------------------------------
# Checksum
# --------------------------------------------------------------------------


def test_checksum_same_in_another_process(model, transformer_dir, tmp_path):
    f32 = save_weights(model, tmp_path / "f32.safetensors")
    bf16 = save_weights({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()},
                        tmp_path / "bf16.safetensors")
    code = (
        "import sys\n"
        "from diffusers import WanTransformer3DModel\n"
        "from common.diffusion.weights import read_weights, state_dict_checksum\n"
        "print(state_dict_checksum(read_weights(sys.argv[1])))\n"
        "print(state_dict_checksum(read_weights(sys.argv[2])))\n"
        "print(state_dict_checksum(WanTransformer3DModel.from_pretrained(sys.argv[3])))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, "-c", code, str(f32), str(bf16), str(transformer_dir)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    from_file, from_bf16, from_folder = out.stdout.split()

    here = state_dict_checksum(model)
    assert len(here) == 64 and int(here, 16) >= 0
    assert here == state_dict_checksum(model.state_dict())
    assert from_file == here
    assert from_folder == here
    assert from_bf16 == state_dict_checksum({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
    assert from_bf16 != here


def test_checksum_changes_on_one_element(model):
    state = _cloned(model)
    base = state_dict_checksum(state)
    names = sorted(state)
    for name in (names[0], names[len(names) // 2], names[-1]):
        flat = state[name].view(-1)
        i = flat.numel() // 2
        old = flat[i].clone()
        # The smallest possible change: one ulp.
        flat[i] = torch.nextafter(old, old + 1)
        assert state_dict_checksum(state) != base, name
        flat[i] = old
        assert state_dict_checksum(state) == base, name


def test_checksum_dtype_names_shapes(model):
    state = _cloned(model)
    base = state_dict_checksum(state)
    bf16 = {k: v.to(torch.bfloat16) for k, v in state.items()}
    f16 = {k: v.to(torch.float16) for k, v in state.items()}
    assert len({base, state_dict_checksum(bf16), state_dict_checksum(f16)}) == 3

    # Same bytes under another dtype of the same width.
    first = sorted(state)[0]
    assert state_dict_checksum({**state, first: state[first].view(torch.int32)}) != base

    renamed = dict(state)
    renamed["renamed." + first] = renamed.pop(first)
    assert state_dict_checksum(renamed) != base

    # Same names and bytes, different shape.
    reshaped = {**state, first: state[first].reshape(-1)}
    if reshaped[first].shape != state[first].shape:
        assert state_dict_checksum(reshaped) != base

    # Two same-shaped tensors swapped between names.
    by_shape: dict[tuple, list[str]] = {}
    for k, v in state.items():
        by_shape.setdefault(tuple(v.shape), []).append(k)
    a, b = next(ks for ks in by_shape.values() if len(ks) >= 2)[:2]
    assert state_dict_checksum({**state, a: state[b], b: state[a]}) != base

    # Order of insertion, memory layout and requires_grad do not matter.
    assert state_dict_checksum(dict(reversed(list(state.items())))) == base
    weight = next(k for k, v in state.items() if v.ndim == 2)
    strided = state[weight].t().contiguous().t()
    assert not strided.is_contiguous()
    assert state_dict_checksum({**state, weight: strided}) == base
    assert state_dict_checksum({k: v.requires_grad_(True) for k, v in _cloned(model).items()}) == base


def test_checksum_format_is_pinned():
    # Trainer and engine may run different versions of this code: the
    # format must not drift.
    state = {
        "b": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "a": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
        "c": torch.tensor(3, dtype=torch.int64),
    }
    # Per name in sorted order: a JSON header line [name, dtype, shape,
    # nbytes], then the little-endian element bytes.
    spelled_out = hashlib.sha256()
    spelled_out.update(b'["a", "bfloat16", [2], 4]\n' + bytes([0xC0, 0x3F, 0x00, 0xC0]))
    spelled_out.update(b'["b", "float32", [2, 3], 24]\n' + struct.pack("<6f", 0, 1, 2, 3, 4, 5))
    spelled_out.update(b'["c", "int64", [], 8]\n' + struct.pack("<q", 3))
    pinned = "da6d0091a819f0aee17573fab3e9020ad5867610a2e0b48b04aa422339b50797"
    assert spelled_out.hexdigest() == pinned
    assert state_dict_checksum(state) == pinned


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["file", "saved-folder", "sharded-folder", "one-file-folder", "own-folder"])
def test_read_weights_layouts(model, tmp_path, layout):
    if layout == "file":
        path = save_weights(model, tmp_path / "weights.safetensors")
    elif layout == "saved-folder":
        path = tmp_path / "ckpt"
        model.save_pretrained(path)
        assert (path / WEIGHTS_NAME).is_file()
    elif layout == "sharded-folder":
        path = tmp_path / "ckpt"
        model.save_pretrained(path, max_shard_size="20KB")
        assert (path / WEIGHTS_INDEX_NAME).is_file()
        assert len(list(path.glob("diffusion_pytorch_model-*-of-*.safetensors"))) > 2
        assert not (path / WEIGHTS_NAME).exists()
    elif layout == "one-file-folder":
        path = tmp_path / "ckpt"
        save_weights(model, path / "step_100.safetensors")
        (path / "notes.txt").write_text("not weights")
    else:
        path = save_weights(model, tmp_path / "ckpt").parent
        assert (path / WEIGHTS_NAME).is_file()
        assert not [p for p in path.iterdir() if p.name != WEIGHTS_NAME]  # no temporary files left
    _assert_same_state(read_weights(path), model.state_dict())


def test_read_weights_tilde_and_str(model, tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    save_weights(model, tmp_path / "w.safetensors")
    _assert_same_state(read_weights("~/w.safetensors"), model.state_dict())


def test_sharded_index_must_match_shards(model, tmp_path):
    path = tmp_path / "ckpt"
    model.save_pretrained(path, max_shard_size="20KB")
    index = json.loads((path / WEIGHTS_INDEX_NAME).read_text())
    name = sorted(index["weight_map"])[0]
    index["weight_map"][name + ".ghost"] = index["weight_map"][name]
    (path / WEIGHTS_INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="ghost"):
        read_weights(path)

    index["weight_map"] = {name: "../outside.safetensors"}
    (path / WEIGHTS_INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(WeightsError, match="not a plain file name"):
        read_weights(path)


def test_save_weights_tied_and_bf16(tmp_path):
    shared = torch.randn(4, 3)
    state = {"a": shared, "b": shared, "view": shared[1], "h": torch.randn(5).to(torch.bfloat16)}
    path = save_weights(state, tmp_path / "tied.safetensors")
    _assert_same_state(read_weights(path), {k: v.contiguous() for k, v in state.items()})
    assert state_dict_checksum(read_weights(path)) == state_dict_checksum(state)


# --------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------


def test_load_into_changes_outputs_and_checksum(model):
    before = _forward(model)
    params = {k: (id(p), p.data_ptr()) for k, p in model.named_parameters()}
    new = _perturbed(model.state_dict())
    load_into(model, new)

    assert not torch.allclose(_forward(model), before)
    assert state_dict_checksum(model) == state_dict_checksum(new)
    _assert_same_state(model.state_dict(), new)
    # Updated in place: the same parameter objects and storage.
    assert {k: (id(p), p.data_ptr()) for k, p in model.named_parameters()} == params
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_load_into_casts_to_module_dtype(model):
    new_bf16 = {k: v.to(torch.bfloat16) for k, v in _perturbed(model.state_dict()).items()}
    load_into(model, new_bf16)
    assert all(v.dtype == torch.float32 for v in model.state_dict().values())
    assert state_dict_checksum(model) == state_dict_checksum({k: v.float() for k, v in new_bf16.items()})
    assert state_dict_checksum(model) != state_dict_checksum(new_bf16)

    # And the other way round: a bf16 module fed float32 weights.
    model.to(torch.bfloat16)
    new_f32 = _perturbed({k: v.float() for k, v in model.state_dict().items()}, seed=2)
    load_into(model, new_f32)
    assert state_dict_checksum(model) == state_dict_checksum({k: v.to(torch.bfloat16) for k, v in new_f32.items()})


@pytest.mark.parametrize("shard", [None, "20KB"], ids=["single", "sharded"])
def test_load_saved_perturbed_model_matches_its_forward(model, transformer_dir, tmp_path, shard):
    other = WanTransformer3DModel.from_pretrained(transformer_dir).eval()
    load_into(other, _perturbed(other.state_dict(), seed=3))
    kwargs = {"max_shard_size": shard} if shard else {}
    other.save_pretrained(tmp_path / "ckpt", **kwargs)
    expected = _forward(other)
    assert not torch.equal(_forward(model), expected)

    load_into(model, read_weights(tmp_path / "ckpt"))
    assert torch.equal(_forward(model), expected)
    assert state_dict_checksum(model) == state_dict_checksum(other)


# --------------------------------------------------------------------------
# Errors leave the module untouched
# --------------------------------------------------------------------------


def _corrupt(kind: str, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """All tensors changed (so a partial load would show), plus one fault in the last name."""
    state = _perturbed(state)
    last = sorted(state)[-1]
    weight = sorted(k for k, v in state.items() if v.ndim == 2)[-1]
    if kind == "missing":
        del state[last]
        return state, rf"1 missing \({last}\)"
    if kind == "unexpected":
        state["blocks.99.extra.weight"] = torch.zeros(3)
        return state, r"0 missing; 1 unexpected \(blocks\.99\.extra\.weight\)"
    if kind == "shape":
        rows, cols = state[weight].shape
        state[weight] = torch.zeros(rows, cols + 1)
        return state, rf"{weight}: expected \({rows}, {cols}\), got \({rows}, {cols + 1}\)"
    if kind == "nan":
        state[last].view(-1)[0] = float("nan")
        return state, rf"non-finite.*{last}: 1 of"
    if kind == "inf":
        state[weight].view(-1)[-1] = float("-inf")
        return state, rf"non-finite.*{weight}: 1 of"
    if kind == "int":
        state[last] = state[last].to(torch.int32)
        return state, rf"{last}: expected float32, got int32"
    if kind == "not-tensor":
        state[last] = state[last].tolist()
        return state, "must be tensors"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["missing", "unexpected", "shape", "nan", "inf", "int", "not-tensor"])
def test_bad_state_leaves_module_untouched(model, kind):
    before_sum, before_out = state_dict_checksum(model), _forward(model)
    state, message = _corrupt(kind, model.state_dict())
    with pytest.raises(WeightsError, match=message):
        validate_against(model, state)
    with pytest.raises(WeightsError, match=message):
        load_into(model, state)
    assert state_dict_checksum(model) == before_sum
    assert torch.equal(_forward(model), before_out)


class _RunsCodeWhenUnpickled:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def _bad_path(kind: str, model, tmp: Path) -> tuple[Path, list[Path] | None, str]:
    inside, outside = tmp / "inside", tmp / "outside"
    inside.mkdir()
    outside.mkdir()
    good = _perturbed(model.state_dict())
    if kind == "nonexistent":
        return inside / "nope.safetensors", None, "does not exist"
    if kind == "pickle-bin":
        path = inside / "pytorch_model.bin"
        path.write_bytes(pickle.dumps(_RunsCodeWhenUnpickled(tmp / "pwned")))
        return path, None, "only safetensors"
    if kind == "pickle-named-safetensors":
        path = inside / "model.safetensors"
        path.write_bytes(pickle.dumps(_RunsCodeWhenUnpickled(tmp / "pwned")))
        return path, None, "not a readable safetensors file"
    if kind == "folder-with-bin":
        (inside / "pytorch_model.bin").write_bytes(pickle.dumps(_RunsCodeWhenUnpickled(tmp / "pwned")))
        return inside, None, r"no \.safetensors weights; found pytorch_model\.bin"
    if kind == "text-file":
        path = inside / "weights.txt"
        path.write_text("hello")
        return path, None, "not a .safetensors file"
    if kind == "text-named-safetensors":
        path = inside / "weights.safetensors"
        path.write_text("hello, this is not a tensor file")
        return path, None, "not a readable safetensors file"
    if kind == "empty-folder":
        return inside, None, "no .safetensors weights"
    if kind == "two-files-folder":
        save_weights(good, inside / "a.safetensors")
        save_weights(good, inside / "b.safetensors")
        return inside, None, "several .safetensors files"
    if kind == "nonexistent-outside-roots":
        return outside / "nope.safetensors", [inside], "outside the allowed"
    if kind == "outside-roots":
        return save_weights(good, outside / "w.safetensors"), [inside], "outside the allowed"
    if kind == "dotdot":
        save_weights(good, outside / "w.safetensors")
        return inside / ".." / "outside" / "w.safetensors", [inside], "outside the allowed"
    if kind == "file-symlink":
        (inside / "w.safetensors").symlink_to(save_weights(good, outside / "w.safetensors"))
        return inside / "w.safetensors", [inside], "resolves to .*outside.* outside the allowed"
    if kind == "folder-symlink":
        save_weights(good, outside / "ckpt")
        (inside / "ckpt").symlink_to(outside / "ckpt", target_is_directory=True)
        return inside / "ckpt", [inside], "outside the allowed"
    if kind == "shard-symlink":
        model.save_pretrained(inside / "ckpt", max_shard_size="20KB")
        shard = sorted((inside / "ckpt").glob("*-of-*.safetensors"))[-1]
        shard.rename(outside / shard.name)
        shard.symlink_to(outside / shard.name)
        return inside / "ckpt", [inside], "outside the allowed"
    raise AssertionError(kind)


PATH_ERRORS = ["nonexistent", "pickle-bin", "pickle-named-safetensors", "folder-with-bin", "text-file",
               "text-named-safetensors", "empty-folder", "two-files-folder", "nonexistent-outside-roots", "outside-roots", "dotdot",
               "file-symlink", "folder-symlink", "shard-symlink"]


@pytest.mark.parametrize("kind", PATH_ERRORS)
def test_bad_path_leaves_module_untouched(model, tmp_path, kind):
    before = state_dict_checksum(model)
    path, roots, message = _bad_path(kind, model, tmp_path)
    with pytest.raises(WeightsError, match=message):
        load_into(model, read_weights(path, allowed_roots=roots))
    assert state_dict_checksum(model) == before
    assert not (tmp_path / "pwned").exists()  # no pickle was ever loaded


def test_pipeline_folder_gets_a_hint(transformer_dir):
    with pytest.raises(WeightsError, match="pass its transformer subfolder"):
        read_weights(transformer_dir.parent)


def test_allowed_roots_accept_paths_inside(model, tmp_path):
    real_root = tmp_path / "real"
    new = _perturbed(model.state_dict())
    target = save_weights(new, real_root / "step1" / "w.safetensors")
    (real_root / "latest.safetensors").symlink_to(target)  # symlink staying inside
    (tmp_path / "alias").symlink_to(real_root, target_is_directory=True)  # root given via a symlink
    for path, roots in [(target, [real_root]), (real_root / "latest.safetensors", [real_root]),
                        (target.parent, [tmp_path / "alias"]), (tmp_path / "alias" / "step1", [real_root]),
                        (target, [tmp_path / "elsewhere", real_root])]:
        _assert_same_state(read_weights(path, allowed_roots=roots), new)
    load_into(model, read_weights(target, allowed_roots=[real_root]))
    assert state_dict_checksum(model) == state_dict_checksum(new)
