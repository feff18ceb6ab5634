"""Why a model directory's weights would not load, found before any worker starts, as one line naming the file.

Each model component's folder is read as ``from_pretrained`` would read it (common/diffusion/loading.py: its
variant, its index and shards) but from the files' headers alone (common/diffusion/weight_headers.py), and
compared with the tensors its config makes: the model class instantiated on the ``meta`` device (no memory, no
weights) gives every name, shape and dtype cheaply. Found: a shard the index names that is missing or lacks the
tensors the index places in it, a truncated file, a tensor whose shape differs from the config's model or whose
integer dtype cannot hold a floating-point weight, a folder of another model (few of the model's tensors),
weights of several variants and no plain ones, a folder with no weights. ``--transformer-file`` is checked the
same way, through the converter diffusers' ``from_single_file`` runs on it (run on ``meta`` tensors).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from common.diffusion.loading import single_file_support, variants_in, weight_variant
from common.diffusion.weight_headers import HeaderError, TensorEntry, entries_of, safetensors_entries

_BASES = ("diffusion_pytorch_model", "model")
_SHOWN = 3  # names an error message lists before summarising


def _listed(names) -> str:
    names = sorted(names)
    return ", ".join(names[:_SHOWN]) + (f", ... ({len(names)} in all)" if len(names) > _SHOWN else "")


def _dotted(variant: str | None) -> str:
    return "" if variant is None else f".{variant}"


def model_class(library: str, class_name: str):
    """The class ``model_index.json`` names, when it is a model with weights (else None); a library other than
    diffusers and transformers is a diffusers pipeline's own module (a family's vocoder or connectors)."""
    import importlib

    import diffusers
    import transformers

    try:
        module = {"diffusers": diffusers, "transformers": transformers}.get(library) or importlib.import_module(
            f"diffusers.pipelines.{library}")
    except ImportError:
        return None
    cls = getattr(module, class_name, None)
    if isinstance(cls, type) and issubclass(cls, (diffusers.ModelMixin, transformers.PreTrainedModel)):
        return cls
    return None


def meta_tensors(cls, folder: Path) -> dict[str, torch.Tensor] | None:
    """The state dict of ``cls`` built from ``folder``'s config without weights (names, shapes, dtypes). A
    diffusers model is built as its ``from_pretrained`` builds it (accelerate's ``init_empty_weights``), so a
    config it cannot build from raises HeaderError; a transformers model on the ``meta`` device, None when it
    cannot be built so (its shapes are then not compared, never a refusal)."""
    import diffusers
    from accelerate import init_empty_weights

    if issubclass(cls, diffusers.ModelMixin):
        try:
            with init_empty_weights():
                return cls.from_config(cls.load_config(folder)).state_dict()
        except Exception as e:  # what the worker's from_pretrained would raise
            raise HeaderError(f"{folder / 'config.json'}: does not build {cls.__name__} "
                              f"({type(e).__name__}: {e})") from e
    try:
        with torch.device("meta"):
            return cls._from_config(cls.config_class.from_pretrained(folder)).state_dict()
    except Exception:  # a class whose __init__ reads values: no shapes to compare with, nothing refused
        return None


def fit_problem(where: str, entries: dict[str, TensorEntry], expected: dict[str, torch.Tensor], owner: str,
                names_must_match: bool) -> str | None:
    """Why tensors ``entries`` (read from ``where``) do not fit model ``owner``'s ``expected`` ones: a shape that
    differs, an integer dtype where the model holds floats; with ``names_must_match`` (a diffusers model, whose
    names are the files' own), too few of the model's tensors."""
    common = set(entries) & set(expected)
    missing = set(expected) - set(entries)
    if names_must_match and missing and (len(common) < len(expected) / 2 or not set(entries) - set(expected)):
        return f"{where}: lacks {len(missing)} of the {len(expected)} tensors of {owner} ({_listed(missing)})"
    for name in sorted(common):
        want, got = expected[name], entries[name]
        if tuple(want.shape) != got.shape:
            return (f"{where}: {name} has shape {list(got.shape)}, but {owner} (as its config makes it) has "
                    f"{list(want.shape)}")
        if want.is_floating_point() and not got.is_float:
            return f"{where}: {name} is stored as {got.dtype}, but {owner} holds floating-point values there"
    return None


def _index_entries(index: Path) -> dict[str, TensorEntry]:
    """Every tensor a sharded folder's index places, read from its shards' headers."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        assert isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())
    except (OSError, ValueError, KeyError, TypeError, AssertionError):
        raise HeaderError(f"{index}: not a valid safetensors index (no weight_map of tensor names to shard files)")
    entries: dict[str, TensorEntry] = {}
    for shard in sorted(set(weight_map.values())):
        file = index.parent / shard
        if Path(shard).name != shard or not file.is_file():
            raise HeaderError(f"{index}: names shard {shard}, which is missing")
        found = safetensors_entries(file)
        absent = {k for k, v in weight_map.items() if v == shard} - set(found)
        if absent:
            raise HeaderError(f"{file}: lacks {len(absent)} tensors that {index.name} places in it "
                              f"({_listed(absent)})")
        entries.update(found)
    return entries


def folder_entries(folder: Path) -> dict[str, TensorEntry] | None:
    """The tensors a component folder's weights declare, as ``from_pretrained`` would find them (its variant,
    sharded or not); None for pickle-only weights (.bin: their headers are not read). Raises HeaderError."""
    try:
        variant = weight_variant(folder)
    except ValueError as e:
        raise HeaderError(str(e)) from e
    for base in _BASES:
        index = folder / f"{base}.safetensors.index{_dotted(variant)}.json"
        if index.is_file():
            return _index_entries(index)
        single = folder / f"{base}{_dotted(variant)}.safetensors"
        if single.is_file():
            return safetensors_entries(single)
    if variants_in(folder):
        return None  # .bin weights only
    raise HeaderError(f"{folder}: no weight files (diffusion_pytorch_model.safetensors, model.safetensors or "
                      "an index of shards)")


def component_problem(folder: Path, library: str, class_name: str) -> str | None:
    """Why component folder ``folder`` (a model of ``class_name`` per model_index.json) would not load."""
    cls = model_class(library, class_name)
    if cls is None:
        return None
    config = folder / "config.json"
    if not config.is_file():
        return f"{folder}: missing (model_index.json names {class_name} there), or it has no config.json"
    named = json.loads(config.read_text()).get("_class_name")
    if library == "diffusers" and named and named != class_name:
        return f"{config}: names {named}, but model_index.json names {class_name} (a folder of another model?)"
    if named and named != class_name:  # a pipeline's own module: the config says which of its classes
        cls = model_class(library, named) or cls
    try:
        entries = folder_entries(folder)
    except HeaderError as e:
        return str(e)
    try:
        expected = meta_tensors(cls, folder)
    except HeaderError as e:
        return str(e)
    if expected is None or entries is None:
        return None
    return fit_problem(str(folder), entries, expected, class_name, names_must_match=library != "transformers")


def single_file_problem(class_name: str, file: Path, config_folder: Path) -> str | None:
    """Why ``--transformer-file FILE`` would not load as a ``class_name`` of ``config_folder``'s config."""
    import diffusers

    cls = getattr(diffusers, class_name)
    if not file.is_file():
        return f"--transformer-file {file}: no such file"
    if file.suffix not in (".safetensors", ".gguf"):
        return f"--transformer-file {file}: not a .safetensors or .gguf file"
    if not single_file_support(cls):
        return (f"--transformer-file: the model's transformer is {class_name}, which diffusers' from_single_file "
                "does not load; use a model directory instead")
    try:
        entries = entries_of(file)
    except HeaderError as e:
        return f"--transformer-file {e}"
    try:
        expected = meta_tensors(cls, config_folder)
    except HeaderError as e:
        return str(e)
    if set(expected) - set(entries):  # the original format: the names diffusers' converter makes of it
        converted = _converted(cls, entries, config_folder)
        if isinstance(converted, str):
            return f"--transformer-file {file}: not a checkpoint of {class_name} ({converted})"
        entries = converted
    return fit_problem(f"--transformer-file {file}", entries, expected, f"{class_name} of {config_folder}",
                       names_must_match=True)


def _converted(cls, entries: dict[str, TensorEntry], config_folder: Path) -> dict[str, TensorEntry] | str:
    """``entries`` renamed as diffusers' single-file converter for ``cls`` renames them (run on meta tensors),
    or why the converter could not read them."""
    from diffusers.loaders.single_file_model import (SINGLE_FILE_LOADABLE_CLASSES,
                                                     _get_single_file_loadable_mapping_class)

    convert = SINGLE_FILE_LOADABLE_CLASSES[_get_single_file_loadable_mapping_class(cls)]["checkpoint_mapping_fn"]
    meta = {k: torch.empty(e.shape, dtype=torch.float32 if e.is_float else torch.int64, device="meta")
            for k, e in entries.items()}
    try:
        out = convert(config=dict(cls.load_config(config_folder)), checkpoint=meta)
    except (KeyError, IndexError, ValueError, RuntimeError) as e:
        found = f"found no {e}" if isinstance(e, KeyError) else f"stopped: {type(e).__name__}: {e}"
        return f"neither its diffusers names nor the original ones diffusers' converter reads; the converter {found}"
    if not out:
        return "diffusers' converter found none of its tensors"
    return {k: TensorEntry("F32" if t.is_floating_point() else "I64", tuple(t.shape), t.is_floating_point())
            for k, t in out.items()}

