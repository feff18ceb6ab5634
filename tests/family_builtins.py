"""One tiny built-in per served pipeline, from the family registry: a test parametrized over these covers every
family the engine serves, and a new family (a binding and its built-ins) joins it without an edit here."""

from __future__ import annotations

from common.builtin.sweep import base_specs
from common.families import BINDINGS


def tiny_per_pipeline() -> dict[str, str]:
    """Pipeline class -> the first ``tiny*`` built-in that makes one (its smooth-time variants aside)."""
    out = {pipeline: spec.name for pipeline, spec in base_specs().items() if pipeline in BINDINGS}
    missing = set(BINDINGS) - set(out)
    assert not missing, f"no tiny built-in for {sorted(missing)}"
    return out
