"""The package layout's rules: layers import downwards only (the router's parts too), each worker directory
and rl/ only what they may, no module uses another's private names in router/, wire tensor names spelled once
(in the message contracts), product files of readable size."""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Each common/ layer may import itself and the layers listed.
LAYERS = {
    "protocol": {"protocol"},
    "config": {"protocol", "config"},
    "transport": {"protocol", "config", "transport"},
    "diffusion": {"protocol", "diffusion"},
    "families": {"protocol", "diffusion", "families"},
    # The built-in random-weight models: their specs, components and cache; resolved by name above it.
    "builtin": {"protocol", "diffusion", "families", "builtin"},
    "runtime": {"protocol", "config", "transport", "diffusion", "families", "runtime"},
    "placement": {"protocol", "config", "transport", "diffusion", "families", "builtin", "runtime",
                  "placement"},  # launch.py --ray
}
# Top-level packages and what (besides common) each may import.
PACKAGES = {
    "encoder_worker": {"encoder_worker"},
    "denoise_worker": {"denoise_worker"},
    "decode_worker": {"decode_worker"},
    "router": {"router"},
    "rl": {"rl"},
    "disagg": {"disagg", "launch"},  # the command: an engine as a child process, or launch.py itself (serve)
    # the engine in one process: launch.py's flags, the stages and the router's core
    "local_engine": {"local_engine", "launch", "router", "encoder_worker", "denoise_worker", "decode_worker"},
}
OURS = {"common", "launch", *PACKAGES}
MAX_PRODUCT_LINES = 400


def _product_files() -> list[Path]:
    try:
        files = subprocess.check_output(["git", "ls-files", "*.py"], cwd=ROOT, text=True,
                                        stderr=subprocess.DEVNULL).split()
    except (OSError, subprocess.CalledProcessError):  # an exported tree, not a checkout
        files = [str(p.relative_to(ROOT)) for p in ROOT.rglob("*.py")]
    tops = {"common", "launch.py", *PACKAGES}
    return sorted(ROOT / f for f in files if f.split("/")[0] in tops)


def _imports(path: Path) -> set[str]:
    """Dotted names of this project's modules that ``path`` imports (absolute imports only)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}: relative import"
            names.add(node.module)
    return {n for n in names if n.split(".")[0] in OURS}


@pytest.mark.parametrize("path", _product_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_layers(path):
    rel = path.relative_to(ROOT).parts
    for name in _imports(path):
        top, *rest = name.split(".")
        if rel[0] == "common":
            assert top == "common", f"{name}: common/ imports nothing above it"
            if len(rel) > 2 and rest:
                assert rest[0] in LAYERS[rel[1]], f"common/{rel[1]} may not import {name}"
        elif rel[0] in PACKAGES:
            assert top == "common" or top in PACKAGES[rel[0]], f"{rel[0]}/ may not import {name}"


def test_common_has_only_its_layers():
    assert {p.name for p in (ROOT / "common").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(LAYERS)
    assert not [p for p in (ROOT / "common").glob("*.py") if p.name != "__init__.py"]


def _import_graph(top: str) -> dict[str, set[str]]:
    """Every module under ``top`` -> the modules under ``top`` it imports: every import statement, at module level,
    in a function or under ``if TYPE_CHECKING:`` (``from package import module`` names the module). A package's
    ``__init__`` that Python runs on the way to a submodule is no edge: only what a module names."""
    modules = {}
    for path in _product_files():
        rel = path.relative_to(ROOT).with_suffix("").parts
        if rel[0] == top:
            modules[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = path
    graph = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    sub = f"{node.module}.{a.name}"
                    edges.update({sub} if sub in modules else {node.module} & set(modules))
        graph[name] = edges - {name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph``: each set of modules that reach one another (Tarjan's strongly connected
    components of more than one module), sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def test_the_cycle_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a", "e"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]] and _cycles({**graph, "c": set()}) == []
    edges = _import_graph("common")
    assert "common.diffusion.binding" in edges["common.diffusion.model_info"]  # a module-level import
    assert "common.diffusion.model_facts" in edges["common.diffusion.parts.text"]  # a type-only one


@pytest.mark.parametrize("top", ["common", "denoise_worker", "encoder_worker", "decode_worker", "router", "rl"])
def test_no_import_circle(top):
    """No module of a package reaches itself through its imports, type-only and function-local ones included:
    a part takes the directory's facts (ModelFacts), never the binding that holds it; the denoise worker's
    control handlers see the stage through a protocol (denoise_worker/controls.py), never its module."""
    assert _cycles(_import_graph(top)) == []


@pytest.mark.parametrize("path", _product_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_product_files_stay_readable(path):
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_PRODUCT_LINES, f"{lines} lines: split it where its jobs part"


def test_wire_tensor_names_are_spelled_once():
    """Stages use the names the message kinds declare (common/protocol/messages.py), never literals."""
    from common.protocol.messages import NEGATIVE_PROMPT_EMBEDS, PROMPT_EMBEDS, ROLLOUT_OUTPUTS

    wire_only = {PROMPT_EMBEDS.name, NEGATIVE_PROMPT_EMBEDS.name} | {f.name for f in ROLLOUT_OUTPUTS
                                                                     if "." in f.name}
    contracts = ROOT / "common" / "protocol" / "messages.py"
    for path in _product_files():
        if path == contracts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                assert node.value not in wire_only and not node.value.startswith("trajectory."), \
                    f"{path.relative_to(ROOT)}:{node.lineno}: spell {node.value!r} through its TensorField"


def test_the_router_core_speaks_no_http():
    """The router's core, its link to the workers and its control fan-outs import neither FastAPI nor Starlette,
    not even indirectly: the HTTP fronts (router/api/, router/openai/) call the core, never the other way."""
    code = ("import sys, router.core.engine; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'starlette', 'uvicorn'}))")
    out = subprocess.check_output([sys.executable, "-c", code], cwd=ROOT, text=True)
    assert out.strip() == "[]", f"router.core.engine imports {out.strip()}"
    for folder in ("request", "core", "link", "control"):
        for path in sorted((ROOT / "router" / folder).glob("*.py")):
            http = {n for n in _all_imports(path) if n.split(".")[0] in ("fastapi", "starlette")}
            assert not http, f"{path.relative_to(ROOT)} imports {sorted(http)}"


def _all_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


# The router's parts, lowest first: request/ (the bodies every part takes) <- core/, link/, control/ (the
# engine, no HTTP) <- the HTTP fronts. What each part below the fronts may not import (request/: anything of
# the router but itself and the errors).
ROUTER_FRONTS = ("api", "openai", "peers")
ROUTER_BELOW = {"request": None, "core": ROUTER_FRONTS, "link": ROUTER_FRONTS, "control": ROUTER_FRONTS}
REQUEST_MAY_IMPORT = ("router.request", "router.core.errors")


def _router_imports(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every router module ``source`` imports, wherever the import stands (a function's
    body, ``if TYPE_CHECKING:``); ``from router.x import y`` names both ``router.x`` and ``router.x.y``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            found += [(node.lineno, node.module)] + [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return sorted(((line, name) for line, name in found if name == "router" or name.startswith("router.")),
                  key=lambda found: found[0])


def _layer_breaks(part: str, source: str) -> list[str]:
    """The imports of a module of router/``part`` that go up (or sideways, for request/)."""
    broken = []
    for line, name in _router_imports(source):
        target = name.split(".")[1] if "." in name else ""
        if (ROUTER_BELOW[part] is None and not name.startswith(REQUEST_MAY_IMPORT)) \
                or target in (ROUTER_BELOW[part] or ()):
            broken.append(f"{line}: {name}")
    return broken


def _private_uses(source: str) -> list[str]:
    """Where ``source`` uses another module's or object's private name: ``from x import _y``, or ``x._y`` on
    anything but ``self``, ``cls`` or ``super()`` (a library's own private, where nothing else will do, is
    marked ``# noqa: SLF001`` with its reason)."""
    lines, found = source.splitlines(), []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            owner = node.value
            own = (isinstance(owner, ast.Name) and owner.id in ("self", "cls")) or (
                isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super")
            if not own and "noqa: SLF001" not in lines[node.lineno - 1]:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def _router_files() -> list[Path]:
    return [p for p in _product_files() if p.relative_to(ROOT).parts[0] == "router"]


def test_the_router_imports_downwards():
    """The core, the link and the controls import no HTTP front (api/, openai/, peers/), and request/ only the
    router's errors: the fronts call the core, never the other way."""
    broken = {}
    for path in _router_files():
        part = path.relative_to(ROOT).parts[1]
        if part in ROUTER_BELOW:
            broken[str(path.relative_to(ROOT))] = _layer_breaks(part, path.read_text())
    assert {"request", "core", "link", "control"} <= {Path(p).parts[1] for p in broken}
    assert not {p: b for p, b in broken.items() if b}, broken


def test_no_router_module_uses_anothers_private_names():
    used = {str(p.relative_to(ROOT)): _private_uses(p.read_text()) for p in _router_files()}
    assert not {p: u for p, u in used.items() if u}, "give what two modules share a public name"


def test_the_router_rules_catch_what_they_are_for():
    """Imports wherever they stand (type-only, in a function) and private names through a module or object."""
    upward = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from router.api.schemas import X\n"
              "def f():\n    import router.openai.jobs\n    from router import peers\n"
              "from router.core.errors import FieldError\nfrom router.link.join import Outcome\n")
    assert _layer_breaks("core", upward) == ["3: router.api.schemas", "3: router.api.schemas.X",
                                             "5: router.openai.jobs", "6: router.peers"]
    assert _layer_breaks("request", upward)[-2:] == ["8: router.link.join", "8: router.link.join.Outcome"]
    private = ("from router.api.http_errors import _first_error\nimport router.api.media as media\n"
               "def f(api, self):\n    api._check_model(1)\n    media._frames()\n    self._own()\n"
               "    super()._own()\n    shm._name  # noqa: SLF001 (the library's key)\n")
    assert _private_uses(private) == ["1: from router.api.http_errors import _first_error",
                                      "4: api._check_model", "5: media._frames"]



def _words(name: str) -> str:
    """``name`` split at case changes and separators: lower-case words joined by ``_``."""
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    name = re.sub(r"([A-Z])([A-Z][a-z])", r"\1_\2", name).lower()
    return re.sub(r"[-_. /]+", "_", name)


def _family_words() -> re.Pattern:
    """Every served family as it appears in identifiers and strings: its name, its pipeline class and the words its
    binding declares (``Binding.words``), from the registry, so a new family is covered as it registers."""
    from common.families import BINDINGS

    names = {_words(n) for b in BINDINGS.values() for n in (b.family, b.pipeline, *b.words)}
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return re.compile(rf"(?<![a-z])({alternatives})(?![a-z])")


FAMILY_WORDS = _family_words()
DOC_KEYWORDS = {"help", "description", "doc", "epilog", "title"}  # keyword arguments that document
# A trainer's name for its own rollout step (a step variant's wire name and class), not a branch on a family.
TRAINER_STEP_NAMES = {"flow_grpo_wan", "FlowGrpoWan"}


def _family_names(path: Path) -> list[str]:
    """Identifiers and string constants of ``path``'s code naming a family (docstrings, comments and the
    documenting keyword arguments left out: they may give examples)."""
    tree = ast.parse(path.read_text())
    skip = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant):
            skip.add(id(body[0].value))
        if isinstance(node, ast.keyword) and node.arg in DOC_KEYWORDS:
            skip.update(id(n) for n in ast.walk(node.value))
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        names = {ast.Name: lambda n: [n.id], ast.Attribute: lambda n: [n.attr], ast.arg: lambda n: [n.arg],
                 ast.FunctionDef: lambda n: [n.name], ast.ClassDef: lambda n: [n.name],
                 ast.alias: lambda n: [n.name, n.asname or ""], ast.ImportFrom: lambda n: [n.module or ""],
                 ast.Constant: lambda n: [n.value] if isinstance(n.value, str) else []}.get(type(node))
        found += [f"{node.lineno}: {s[:60]!r}" for s in (names(node) if names else [])
                  if s not in TRAINER_STEP_NAMES and FAMILY_WORDS.search(_words(s))]
    return found


def test_family_words_are_caught():
    """Every registered family's words are caught, in identifiers and strings; words that merely contain one are not."""
    from common.families import BINDINGS

    assert all(FAMILY_WORDS.search(_words(n)) for b in BINDINGS.values() for n in (b.family, b.pipeline, *b.words))
    assert all(b.words for b in BINDINGS.values())  # each binding names its model beside its pipeline class
    caught = ("WanPipeline", "AutoencoderKLWan", "tiny-qwen-image", "SD3Binding", "flux_dev", "LTX2Transformer",
              "ltx2-i2v", "HunyuanVideo15Decoder", "tiny_z_image", "ZImageTurbo", "Flux2KleinPipeline", "KONTEXT",
              "small-sana", "StableDiffusion3Pipeline")
    assert [s for s in caught if not FAMILY_WORDS.search(_words(s))] == []
    assert [s for s in ("want", "swan", "wanted", "sanatorium", "fluxes", "qwenish", "image", "video", "pipeline")
            if FAMILY_WORDS.search(_words(s))] == []


@pytest.mark.parametrize("path", [p for p in _product_files() if not str(p.relative_to(ROOT)).startswith(
    ("common/families/", "common/builtin/"))], ids=lambda p: str(p.relative_to(ROOT)))
def test_only_the_families_name_a_family(path):
    """Outside common/families/ (and common/builtin/, which makes each family's built-in models) nothing
    branches on a family: the stages call a binding's parts. A family's name in code (an identifier or a string) says the code does."""
    assert not _family_names(path), f"{path.relative_to(ROOT)} names a family: {_family_names(path)}"


def _family_fields() -> set[str]:
    """The request fields some family declares beyond GenerationParams' own."""
    from common.families import BINDINGS
    from common.protocol.messages import GenerationParams

    return {f.name for b in BINDINGS.values() for f in b.request_fields} - set(GenerationParams.__struct_fields__)


def test_the_router_names_no_familys_field():
    """The router and the trainer's side (rl/) take a family's own request fields from its binding
    (common/diffusion/request_fields.py): none of their modules spells one in code (a string, a name, an
    attribute, a keyword)."""
    own = _family_fields()
    assert own  # e.g. a second expert's guidance scale
    for path in sorted(p for top in ("router", "rl") for p in (ROOT / top).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            spelled = {ast.Constant: lambda n: n.value, ast.Name: lambda n: n.id, ast.Attribute: lambda n: n.attr,
                       ast.keyword: lambda n: n.arg, ast.arg: lambda n: n.arg}.get(type(node), lambda n: None)(node)
            assert spelled not in own, f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}: {spelled!r}"


def test_the_denoise_step_reads_in_one_place():
    """The Denoiser's step and its one batch's phases fit a screen; a request's state holds at most 14 fields in
    each of its parts (its task, how its steps are taken, what it returns)."""
    import dataclasses
    import inspect

    from denoise_worker.denoiser import Denoiser, Request
    from denoise_worker.rollout_record import RolloutRecord
    from denoise_worker.task import DenoiseTask, StepRule

    for phase in (Denoiser.step, Denoiser.run):
        assert len(inspect.getsource(phase).splitlines()) <= 40, phase.__name__
    for state in (DenoiseTask, StepRule, RolloutRecord, Request):
        assert len(dataclasses.fields(state)) <= 14, state.__name__


def test_no_script_shadows_a_package():
    """Tests put bench/ first on sys.path to import its scripts: a script named like one of our packages would
    replace that package for every test collected after it."""
    for folder in ("bench", "scripts", "tests"):
        clashes = {p.stem for p in (ROOT / folder).glob("*.py")} & OURS
        assert not clashes, f"{folder}/ has scripts named like packages: {sorted(clashes)}"
