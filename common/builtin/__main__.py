"""Write built-in models: each into the cache (generated if needed) or, with ``--out``, into ``DIR/NAME``;
prints each directory.

Usage::

    python -m common.builtin NAME... [--out DIR] [--cache-dir DIR] [--dtype D]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from common.builtin import BUILTINS, ensure_builtin
from common.builtin.cache import CACHE_ENV, DEFAULT_CACHE_DIR
from common.builtin.spec import WEIGHT_DTYPES


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python -m common.builtin", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", metavar="NAME", choices=list(BUILTINS),
                        help=f"built-in models: {', '.join(BUILTINS)}")
    parser.add_argument("--out", type=Path, default=None, help="write each model into DIR/NAME instead of the cache")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"cache root (default: ${CACHE_ENV} or {DEFAULT_CACHE_DIR})")
    parser.add_argument("--dtype", choices=WEIGHT_DTYPES, default=None,
                        help="dtype the weights are stored in (default: the spec's; another is cached separately)")
    args = parser.parse_args(argv)
    paths = []
    for name in args.names:
        spec = BUILTINS[name]
        if args.dtype is not None:
            spec = _with_dtype(spec, args.dtype)
        path = spec.build(args.out / name) if args.out is not None else ensure_builtin(spec, args.cache_dir)
        print(path.resolve(), flush=True)
        paths.append(path)
    return paths


def _with_dtype(spec, dtype: str):
    # A -smooth built-in stores its base's dtype.
    if hasattr(spec, "base"):
        return dataclasses.replace(spec, base=_with_dtype(spec.base, dtype))
    return dataclasses.replace(spec, weights_dtype=dtype)


if __name__ == "__main__":
    main()
