"""The ``trainmon`` command: ``csv2tb``, ``analyse``, ``grad-compare``, ``report``, ``query``, ``convert``, ``serve``;
``trainmon --version``.

Exit codes: 0 on success, 2 on bad usage or bad input (one line on stderr: ``trainmon COMMAND:
error: ...`` naming the argument, file or folder at fault), 130 on Ctrl-C. Bad input never ends in
a traceback or a hang.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from trainmon.errors import UsageError
from trainmon.tools.command import CommandParser, one_line
from trainmon.version import __version__

if TYPE_CHECKING:
    from trainmon.tools.command import Subcommand

_SUBCOMMANDS = ("trainmon.tools.csv2tb", "trainmon.tools.analyse", "trainmon.tools.grad_compare",
                "trainmon.tools.report", "trainmon.tools.query", "trainmon.tools.convert", "trainmon.tools.serve")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="trainmon", description="trainmon offline tools",
                     epilog="Exit codes: 0 success, 2 bad usage or bad input (one line on stderr), 130 interrupted.")
    parser.add_argument("--version", action="version", version=f"trainmon {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in _SUBCOMMANDS:
        try:
            module = cast("Subcommand", importlib.import_module(module_name))
        except ImportError:
            continue
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        for name, value in vars(args).items():  # only a caller in Python can pass one; no OS call takes it
            if isinstance(value, str) and "\0" in value:
                raise UsageError(f"{name}: a path cannot contain a NUL character")
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"trainmon {args.command}: error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `trainmon analyse RUN | head`: stop quietly, as other commands do
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if TYPE_CHECKING:  # read by mypy only: each subcommand module satisfies the protocol (never imported at run time)
    from trainmon.tools import analyse, convert, csv2tb, grad_compare, query, report, serve

    _SUBCOMMAND_MODULES: tuple[Subcommand, ...] = (csv2tb, analyse, grad_compare, report, query, convert, serve)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
