"""Whether a model can run an engine's denoise layouts: a check of the topology against the model's family."""

from __future__ import annotations

from common.diffusion.cache_signals import cache_problem


def layout_problem(info, workers, cache=None) -> str | None:
    """Why the model's (``info``: its ModelInfo) transformer cannot run the topology's denoise layouts
    (``workers``: the engine's WorkerSpecs), or serve the default step caching ``cache`` (--cache) on them;
    None: it can."""
    family = info.family
    if not family.transformer.context_parallel:
        for spec in workers:
            if spec.role == "denoise" and (spec.ulysses > 1 or spec.ring > 1):
                return (f"--topology: {family.pipeline}'s transformer {family.transformer.no_context_parallel}, "
                        "so its denoise workers cannot use ulysses or ring (cfg works)")
    problem = None if cache is None else cache_problem(cache.method, family, workers, info)
    return problem and f"--cache: {problem}"
