"""Write built-in models: each into the cache (generated if needed) or, with ``--out``, into ``DIR/NAME``;
prints each directory.

Usage::

    python -m common.builtin NAME... [--out DIR] [--cache-dir DIR] [--dtype D] [--max-shard-size S] [--variant V]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from common.builtin import BUILTINS, ensure_builtin
from common.builtin.cache import CACHE_ENV, DEFAULT_CACHE_DIR
from common.builtin.spec import WEIGHT_DTYPES, with_layout


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python -m common.builtin", description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="+", metavar="NAME", choices=list(BUILTINS),
                        help=f"built-in models: {', '.join(BUILTINS)}")
    parser.add_argument("--out", type=Path, default=None, help="write each model into DIR/NAME instead of the cache")
    parser.add_argument("--cache-dir", type=Path, default=None,
                        help=f"cache root (default: ${CACHE_ENV} or {DEFAULT_CACHE_DIR})")
    parser.add_argument("--dtype", choices=WEIGHT_DTYPES, default=None,
                        help="dtype the weights are stored in (default: the spec's; another is cached separately)")
    parser.add_argument("--max-shard-size", default=None, metavar="SIZE",
                        help="each component's weights in shards of at most SIZE (e.g. 64KB) with an index")
    parser.add_argument("--variant", default=None, help="weight files of this variant only (e.g. fp16)")
    args = parser.parse_args(argv)
    layout = {k: v for k, v in (("weights_dtype", args.dtype), ("max_shard_size", args.max_shard_size),
                                ("variant", args.variant)) if v is not None}
    paths = []
    for name in args.names:
        spec = BUILTINS[name]
        if layout:
            spec = with_layout(spec, **layout)
        path = spec.build(args.out / name) if args.out is not None else ensure_builtin(spec, args.cache_dir)
        print(path.resolve(), flush=True)
        paths.append(path)
    return paths


if __name__ == "__main__":
    main()
