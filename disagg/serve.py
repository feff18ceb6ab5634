"""``disagg serve [launch flags]``: exactly ``launch.py`` with those flags."""

from __future__ import annotations

import sys


def add_parser(sub) -> None:
    # Listed for `disagg --help` only: main() hands `serve`'s arguments to launch.py untouched.
    sub.add_parser("serve", add_help=False, help="start an engine (launch.py's flags; disagg serve --help)")


def run(argv: list[str]) -> int:
    import launch  # the whole engine (torch): imported only when serving

    sys.argv[0] = "disagg serve"  # argparse names the program after argv[0]: usage and errors say what was typed
    return launch.main(argv)
