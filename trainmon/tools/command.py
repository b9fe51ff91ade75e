"""What every ``trainmon`` subcommand shares: the one-line-error parser and the subcommand protocol."""

from __future__ import annotations

import argparse
from typing import NoReturn, Protocol, TypeAlias

_CONTROL = {code: f"\\x{code:02x}" for code in (*range(32), 127)}


def one_line(text: str) -> str:
    """``text`` with newlines and other control characters escaped (``\\x0a``): an error stays one
    line, and a file or path name cannot send escape sequences to the terminal."""
    return text.translate(_CONTROL)


class CommandParser(argparse.ArgumentParser):
    """argparse with a one-line error (argparse prints the usage first; ``--help`` still shows it)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


Subparsers: TypeAlias = "argparse._SubParsersAction[CommandParser]"
"""The ``trainmon`` command's subparsers, which each subcommand module adds its parser to."""


class Subcommand(Protocol):
    """A module of a ``trainmon`` subcommand (``csv2tb``, ``analyse``, ``grad-compare``, ``report``, ``query``,
    ``convert``)."""

    def add_parser(self, sub: Subparsers) -> object:
        """Add the subcommand's parser to ``sub``; its ``func`` default runs it and returns the exit code."""
        ...
