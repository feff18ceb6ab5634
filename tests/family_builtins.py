"""One tiny built-in per served pipeline, from the family registry: a test parametrized over these covers every
family the engine serves, and a new family (a binding and its built-ins) joins it without an edit here."""

from __future__ import annotations

from common.builtin import BUILTINS
from common.families import BINDINGS


def tiny_per_pipeline() -> dict[str, str]:
    """Pipeline class -> the first ``tiny*`` built-in that makes one (its smooth-time variants aside)."""
    out: dict[str, str] = {}
    for name, spec in BUILTINS.items():
        pipeline = getattr(spec, "pipeline", None)
        if name.startswith("tiny") and not name.endswith("-smooth") and pipeline in BINDINGS:
            out.setdefault(pipeline, name)
    missing = set(BINDINGS) - set(out)
    assert not missing, f"no tiny built-in for {sorted(missing)}"
    return out
