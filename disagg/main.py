"""``disagg``: one subcommand per module (serve.py, generate.py); this file only dispatches."""

from __future__ import annotations

import argparse
import sys

from disagg import generate, serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="disagg", description="Disaggregated serving of diffusion models.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve.add_parser(sub)
    generate.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["serve"]:  # launch.py parses its own flags (and its own --help)
        return serve.run(argv[1:])
    args = build_parser().parse_args(argv)
    return args.run(args)
