"""`kvcache store DIR_OR_URL`: what a prefix store holds, its size and its hit rate."""

from __future__ import annotations

import argparse
from typing import Any


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "store",
        help="show what a prefix store (a directory or a Redis URL) holds",
        description="Show a prefix store's entries, bytes, and lookup counters (shared by every process using it).",
    )
    parser.add_argument("where", help="the store's directory, or redis://host:port/db")
    parser.add_argument("--clear", action="store_true", help="delete every entry")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..store import open_store

    store = open_store(args.where, strict=True, create=False)  # a report of a server that is down would be zeros
    if args.clear:
        chunks, held = len(store), store.nbytes
        store.clear()
        print(f"prefix store {store.location}: cleared {chunks} chunk(s), {held:,} bytes")
        return 0
    infos = list(store.backend.infos())
    roots = sum(1 for info in infos if info.parent is None)
    counts = store.backend.counters()
    lookups, hits = counts.get("lookups", 0), counts.get("hits", 0)
    print(f"prefix store {store.location}")
    print(f"  chunks:        {len(infos)} ({roots} first chunk(s) of a prompt)")
    print(f"  bytes:         {store.nbytes:,}")
    print(f"  lookups:       {lookups}")
    rate = f"{hits / lookups:.0%}" if lookups else "-"
    print(f"  hits:          {hits} (hit rate {rate})")
    print(f"  tokens reused: {counts.get('tokens_reused', 0)}")
    return 0
