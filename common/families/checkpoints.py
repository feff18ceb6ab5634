"""Whether a model directory (and a ``--transformer-file``) loads as its family's pipeline: the launcher's check,
before any worker starts, with one line naming the file or property that would not (see
common/diffusion/checkpoint_check.py for the weights; here the pipeline's components and the family's classes)."""

from __future__ import annotations

from pathlib import Path

from common.diffusion.binding import Binding
from common.diffusion.checkpoint_check import component_problem, single_file_problem
from common.diffusion.model_info import read_index
from common.families import UnknownFamily, binding_for, read_model

EXPERTS = ("transformer", "transformer_2")


def _components(index: dict) -> dict[str, tuple[str, str]]:
    """model_index.json's components that are present: name -> (library, class)."""
    return {name: (entry[0], entry[1]) for name, entry in index.items()
            if not name.startswith("_") and isinstance(entry, list) and len(entry) == 2 and entry[0] is not None}


def pipeline_problem(path: Path, index: dict, binding: Binding) -> str | None:
    """Why the directory is not one the family's pipeline runs: a component its pipeline class needs that
    model_index.json lacks, or a transformer of another class than the family's."""
    import diffusers

    pipeline = getattr(diffusers, binding.pipeline)
    needed, optional = pipeline._get_signature_keys(pipeline)
    absent = sorted(set(needed) - set(optional) - set(index))
    if absent:
        return f"{path}/model_index.json: lacks {', '.join(absent)}, which {binding.pipeline} needs"
    components = _components(index)
    for name in EXPERTS:
        if name in components and components[name][1] != binding.transformer.model_class:
            return (f"{path}/model_index.json: {name} is {components[name][1]}, but {binding.pipeline} runs "
                    f"{binding.transformer.model_class} (a directory of another pipeline?)")
    return None


def checkpoint_problem(path: str | Path, transformer_file: str | Path | None = None) -> str | None:
    """Why the model directory ``path`` (its transformer's weights from ``transformer_file`` where given) would
    not load or serve as its family's pipeline; None: it would."""
    path = Path(path)
    try:
        index = read_index(path)
        binding = binding_for(index.get("_class_name"))
    except (UnknownFamily, FileNotFoundError, ValueError) as e:
        return str(e)
    problem = pipeline_problem(path, index, binding)
    for name, (library, class_name) in _components(index).items():
        if problem:
            return problem
        if name == "transformer" and transformer_file is not None:
            continue  # its weights come from the file (checked below); its config from here
        problem = component_problem(path / name, library, class_name)
    if problem:
        return problem
    if transformer_file is not None:
        problem = single_file_problem(binding.transformer.model_class, Path(transformer_file), path / "transformer")
        if problem:
            return problem
    try:
        read_model(path, transformer_file)  # the facts every process reads from the directory
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{path}: cannot read the model's settings ({type(e).__name__}: {e})"
    return None
