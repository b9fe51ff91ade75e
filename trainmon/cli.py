"""The ``trainmon`` command: ``csv2tb``, ``analyse``, ``grad-compare``."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from trainmon.errors import UsageError

_SUBCOMMANDS = ("trainmon.csv2tb", "trainmon.anomaly.analyse", "trainmon.probe.compare")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainmon", description="trainmon offline tools")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name in _SUBCOMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except UsageError as exc:
        print(f"trainmon {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
