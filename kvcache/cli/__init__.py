"""The `kvcache` command: one subcommand per module in this package."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ..errors import KVCacheError

#: Modules that define `add_parser(subparsers)`; each sets `func(args) -> int` on its parser.
SUBCOMMAND_MODULES = ("inspect", "generate", "store")


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


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; errors become one line on stderr and a non-zero status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KVCacheError as err:
        print(f"kvcache {args.command}: error: {err}", file=sys.stderr)
        return 2
    except (OSError, ValueError) as err:
        print(f"kvcache {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
