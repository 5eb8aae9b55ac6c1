"""`kvcache inspect FILE`: what a saved cache holds, without running a model.

Prints the cache class, then per layer its class, token count, recording flag, parameters and
tensors (dtype, shape, bytes), the totals and the user metadata. `--json` prints the same as one
JSON object. The file is fully validated first (loaded on CPU, every byte checked against its digest), so
a file `inspect` accepts is one `load_cache` accepts.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch and the loader are imported when the command runs, not for --help
    from ..persistence import CacheFile

#: meta_state entries shown as columns rather than among the parameters.
_COLUMNS = ("seq_length", "record_past")


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser("inspect", help="show the layers, tensors and metadata of a saved cache file")
    parser.add_argument("file", help="a .safetensors file written by kvcache.save_cache")
    parser.add_argument("--json", action="store_true", help="print one machine-readable JSON object")
    parser.set_defaults(func=run)


def summarize(loaded: CacheFile, path: str) -> dict[str, Any]:
    """A JSON-able summary of a loaded cache file."""
    from ..persistence.writer import DTYPE_NAMES

    itemsize = {name: dtype.itemsize for dtype, name in DTYPE_NAMES.items()}
    desc = loaded.description
    if desc["class"] == "EncoderDecoderCache":
        names = ("self_attention_cache", "cross_attention_cache")
        parts = [(name, desc[name], getattr(loaded.cache, name)) for name in names]
    else:
        parts = [("", desc, loaded.cache)]
    total_bytes = num_tensors = 0
    part_summaries = []
    for part, part_desc, part_cache in parts:
        prefix = f"{part}." if part else ""
        layers = []
        for i, (entry, layer) in enumerate(zip(part_desc["layers"], part_cache.layers, strict=True)):
            tensors = []
            for name, spec in entry["tensors"].items():
                dtype, shape = loaded.specs[f"{prefix}layers.{i}.{name}"]
                nbytes = math.prod(shape) * itemsize[dtype]
                stored = {"order": spec["order"]} if "order" in spec else {}  # dims as stored in the file
                tensors.append({"name": name, "dtype": dtype, "shape": shape, "bytes": nbytes, **stored})
                total_bytes += nbytes
                num_tensors += 1
            layers.append(
                {
                    "index": i,
                    "class": entry["class"],
                    "seq_length": layer.get_seq_length(),
                    "record_past": layer.record_past,
                    "meta_state": entry["meta_state"],
                    "tensors": tensors,
                }
            )
        summary = {"part": part or None, "class": part_desc["class"], "layer_factory": part_desc["layer_factory"]}
        if "max_cache_len" in part_desc:
            summary["max_cache_len"] = part_desc["max_cache_len"]
        part_summaries.append({**summary, "layers": layers})
    out = {
        "path": path,
        "format_version": loaded.version,
        "integrity": loaded.integrity,
        "cache_class": desc["class"],
        "parts": part_summaries,
        "num_tensors": num_tensors,
        "total_bytes": total_bytes,
        "metadata": loaded.metadata,
    }
    if "is_updated" in desc:
        out["is_updated"] = desc["is_updated"]
    return out


def _human(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024  # type: ignore[assignment]
    raise AssertionError


def _short(value: Any, width: int = 100) -> str:
    text = json.dumps(value)
    return text if len(text) <= width else f"{text[: width - 20]}... ({len(text)} chars)"


def format_summary(summary: dict[str, Any]) -> str:
    """The human-readable table `kvcache inspect` prints."""
    lines = [f"{summary['path']}: {summary['cache_class']}"]
    lines.append(f"  format version {summary['format_version']}, verified: {summary['integrity'] or 'header only'}")
    if "is_updated" in summary:
        lines.append(f"  is_updated: {_short(summary['is_updated'])}")
    for part in summary["parts"]:
        head = f"{part['part']}: {part['class']}" if part["part"] else part["class"]
        extra = [f"{len(part['layers'])} layer(s)"]
        if "max_cache_len" in part:
            extra.append(f"max_cache_len={part['max_cache_len']}")
        if part["layer_factory"]:
            extra.append(f"new layers: {part['layer_factory']['class']}")
        lines.append(f"{head} ({', '.join(extra)})")
        lines.append(f"  {'layer':>5}  {'class':<20} {'tokens':>8}  {'rec':<3}  params")
        for layer in part["layers"]:
            params = {k: v for k, v in layer["meta_state"].items() if k not in _COLUMNS}
            rec = "yes" if layer["record_past"] else "no"
            lines.append(
                f"  {layer['index']:>5}  {layer['class']:<20} {layer['seq_length']:>8}  {rec:<3}  {_short(params, 70)}"
            )
            for t in layer["tensors"]:
                lines.append(
                    f"  {'':>5}    {t['name']:<26} {t['dtype']:<5} {t['shape']!s:<24} {t['bytes']:>12,d} B"
                )
    total = summary["total_bytes"]
    lines.append(f"total: {summary['num_tensors']} tensor(s), {total:,d} bytes ({_human(total)})")
    if summary["metadata"]:
        lines.append("metadata:")
        lines.extend(f"  {key}: {_short(value)}" for key, value in summary["metadata"].items())
    else:
        lines.append("metadata: (none)")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from ..persistence import inspect_cache_file

    summary = summarize(inspect_cache_file(args.file), args.file)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0
