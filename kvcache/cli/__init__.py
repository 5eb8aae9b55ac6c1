"""The `kvcache` command: one subcommand per module in this package."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence

from ..errors import KVCacheError

#: Modules that define `add_parser(subparsers)`; each sets `func(args) -> int` on its parser.
SUBCOMMAND_MODULES = ("inspect", "generate", "store", "serve")


def build_parser() -> argparse.ArgumentParser:
    import importlib

    from .. import __version__

    parser = argparse.ArgumentParser(prog="kvcache", description="KV caches with exact rollback.")
    parser.add_argument("--version", action="version", version=f"kvcache {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            continue
        module.add_parser(subparsers)
    return parser


def flag_names(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, str]:
    """Library parameter name -> the flag that sets it: each option's `dest` (`top_p` -> `--top-p`),
    plus what a subcommand declares for parameters its flags name otherwise (`flag_names`)."""
    names: dict[str, str] = {}
    for action in _subparser(parser, args)._actions:
        long = [s for s in action.option_strings if s.startswith("--")]
        if long:
            names[action.dest] = long[0]
    names.update(getattr(args, "flag_names", {}))
    return names


def _subparser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices.get(args.command, parser)
    return parser


def _one_line_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                      file: object = None, line: str | None = None) -> None:  # fmt: skip
    """Warnings as the command line prints them: one line, no source location."""
    print(f"kvcache: warning: {message}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; errors become one line on stderr and a non-zero status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    shown = warnings.showwarning
    warnings.showwarning = _one_line_warning
    try:
        return int(args.func(args) or 0)
    except KVCacheError as err:
        print(f"kvcache {args.command}: error: {err.renamed(flag_names(parser, args))}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as err:
        print(f"kvcache {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        warnings.showwarning = shown
