"""The ``trainmon`` command: ``csv2tb``, ``analyse``, ``grad-compare``, ``report``; ``trainmon --version``.

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
from typing import TYPE_CHECKING, NoReturn, cast

from trainmon import __version__
from trainmon.errors import UsageError

if TYPE_CHECKING:
    from trainmon.protocols import Subcommand

_SUBCOMMANDS = ("trainmon.csv2tb", "trainmon.anomaly.analyse", "trainmon.probe.compare", "trainmon.report")


_CONTROL = {code: f"\\x{code:02x}" for code in (*range(32), 127)}


def one_line(text: str) -> str:
    """``text`` with newlines and other control characters escaped (``\\x0a``): an error stays one
    line, and a file or path name cannot send escape sequences to the terminal."""
    return text.translate(_CONTROL)


class CommandParser(argparse.ArgumentParser):
    """argparse with a one-line error (argparse prints the usage first; ``--help`` still shows it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
