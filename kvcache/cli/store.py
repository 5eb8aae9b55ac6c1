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
    parser.add_argument("where", help="the store's directory, or redis://host:port/db (redis+cluster:// for a cluster)")
    parser.add_argument("--clear", action="store_true", help="delete every entry")
    parser.add_argument("--max-bytes", type=int, metavar="N",
                        help="evict the least recently used entries until the store holds at most N bytes")
    parser.set_defaults(func=run, flag_names={"max_bytes": "--max-bytes"})  # fmt: skip


def run(args: argparse.Namespace) -> int:
    from ..store import open_store

    # strict: a report of a server that is down would read as an empty store
    budget = args.max_bytes if args.max_bytes is not None else 1 << 62
    store = open_store(args.where, strict=True, create=False, max_bytes=budget)  # evicts down to --max-bytes
    if args.clear:
        summary = store.backend.summary()
        store.clear()
        print(f"prefix store {store.location}: cleared {summary['chunks']} chunk(s), {summary['bytes']:,} bytes")
        return 0
    summary = store.backend.summary()
    counts = store.backend.counters()
    lookups, hits = counts.get("lookups", 0), counts.get("hits", 0)
    print(f"prefix store {store.location}")
    print(f"  chunks:        {summary['chunks']} ({summary['roots']} first chunk(s) of a prompt)")
    print(f"  bytes:         {summary['bytes']:,}")
    print(f"  lookups:       {lookups}")
    rate = f"{hits / lookups:.0%}" if lookups else "-"
    print(f"  hits:          {hits} (hit rate {rate})")
    print(f"  tokens reused: {counts.get('tokens_reused', 0)}")
    return 0
