"""A composite cache as a JSON description plus named tensors, and back.

The description names the composite class (from an allow-list), its parameters, the lazy layer
factory (as the class and `meta_state` of the fresh layer it builds), and per layer its class,
`meta_state` and the dtype/shape of each tensor of its `state`, and whether layers created later
start recording. Tensors are named
`<part.>layers.<i>.<state name>`. Layers are built only through `LAYER_REGISTRY` and their own
`from_state`; nothing here knows a layer's internals.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ..cache import Cache
from ..caches import DynamicCache, StaticCache
from ..errors import CacheFormatError, CacheInputError
from ..layers.base import LAYER_REGISTRY, CacheLayer
from .header import check_json_value
from .reader import TORCH_DTYPES
from .writer import dtype_name

#: `Cache` attribute: layers created lazily from now on start recording (set by activate_past_recording).
_RECORD_NEW_LAYERS = "_record_new_layers"
#: The parts of an encoder-decoder cache, in file order.
ENCODER_DECODER_PARTS = ("self_attention_cache", "cross_attention_cache")


class TensorSource(Protocol):
    """Where `build_cache` gets tensors: checks name, dtype and shape against the file."""

    def take(self, name: str, dtype: str, shape: list[int], where: str, order: list[int] | None = None,
             target: Callable[[], torch.Tensor] | None = None) -> torch.Tensor:
        """Tensor `name` of logical `shape`, stored with its dims in `order`; `target()` allocates
        where the layer wants it (a loader may read it there, and then hands that tensor back)."""

    def charge(self, nbytes: int, where: str) -> None:
        """Count storage a layer is about to allocate beyond its tensors; raise past the budget."""


@dataclass(frozen=True)
class CompositeKind:
    """How one allow-listed composite class is described and rebuilt."""

    cls: type
    describe: Callable[[Any, str, dict[str, torch.Tensor]], dict[str, Any]]
    build: Callable[[dict[str, Any], str, TensorSource, str], Any]
    #: Keys its description holds besides "class".
    keys: frozenset[str]


# --------------------------------------------------------------------------------- describing
def describe_cache(cache: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The JSON description of `cache` and its tensors by file name (live views, not copies)."""
    tensors: dict[str, torch.Tensor] = {}
    return _describe(cache, "", tensors), tensors


#: The transformers adapters (`kvcache.integrations.transformers`): saving one saves the cache it wraps.
_ADAPTERS = ("TransformersCache", "TransformersEncoderDecoderCache")


def _describe(cache: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    if type(cache).__name__ in _ADAPTERS and type(cache).__module__.startswith("kvcache."):
        cache = cache.cache
    kind = composite_kinds().get(type(cache).__name__)
    if kind is None or type(cache) is not kind.cls:
        wrapped = getattr(cache, "cache", None)  # e.g. the transformers adapter around a kvcache cache
        hint = "" if wrapped is None else f"; save the kvcache cache it wraps (`.cache`, a {type(wrapped).__name__})"
        raise CacheInputError(
            f"cannot save a {type(cache).__name__}: only {sorted(composite_kinds())} can be saved{hint}"
        )
    return {"class": type(cache).__name__, **kind.describe(cache, prefix, tensors)}


def _check_registered(layer: Any, where: str) -> str:
    if not isinstance(layer, CacheLayer):
        raise CacheInputError(f"{where}: {type(layer).__name__} is not a CacheLayer")
    name = type(layer).__name__
    if LAYER_REGISTRY.get(name) is not type(layer):
        raise CacheInputError(f"{where}: {name} is not a registered layer class (use @register_layer)")
    return name


def _layer_meta(layer: CacheLayer, where: str) -> dict[str, Any]:
    meta = layer.meta_state
    if not isinstance(meta, dict):
        raise CacheInputError(f"{where}: meta_state must be a dict, got {type(meta).__name__}")
    check_json_value(meta, f"{where} meta_state")
    return meta


def _describe_layers(cache: Cache, prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    where = prefix.rstrip(".") or "cache"
    entries = []
    for i, layer in enumerate(cache.layers):
        at = f"{where} layer {i}"
        name = _check_registered(layer, at)
        specs = {}
        for state_name, tensor in layer.state.items():
            if not isinstance(state_name, str) or not isinstance(tensor, torch.Tensor):
                raise CacheInputError(f"{at}: state must map names to tensors, got {state_name!r}")
            if tensor.layout != torch.strided:
                raise CacheInputError(f"{at}: tensor {state_name!r} is not dense ({tensor.layout})")
            if tensor.device.type == "meta":
                raise CacheInputError(f"{at}: tensor {state_name!r} is on the meta device and holds no data to save")
            spec: dict[str, Any] = {"dtype": dtype_name(tensor.dtype, f"{at} {state_name}")}
            spec["shape"] = list(tensor.shape)
            order = memory_order(tensor)
            if order is not None:  # stored as it lies in memory: one write, and a load reads it in place
                spec["order"] = order
                tensor = tensor.permute(order)
            specs[state_name] = spec
            tensors[f"{prefix}layers.{i}.{state_name}"] = tensor
        entries.append({"class": name, "meta_state": _layer_meta(layer, at), "tensors": specs})
    return {
        "layers": entries,
        "layer_factory": _describe_factory(cache.layer_factory, where),
        "record_new_layers": bool(getattr(cache, _RECORD_NEW_LAYERS, False)),
    }


def memory_order(tensor: torch.Tensor) -> list[int] | None:
    """The order of `tensor`'s dims in memory (outermost first) when it is a permutation of a
    contiguous tensor other than its own order (a `[batch, heads, seq, dim]` view of memory laid
    out in another order); None when it is contiguous as it is, or not a permutation of contiguous memory."""
    if tensor.is_contiguous():
        return None
    # A size-1 dim's stride is arbitrary (it may tie with a real dim's): such dims go after the real one.
    order = sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), -tensor.shape[d]))
    return order if tensor.permute(order).is_contiguous() else None


def _describe_factory(factory: Callable[[], CacheLayer] | None, where: str) -> dict[str, Any] | None:
    """A lazy layer factory, described by the fresh layer it builds."""
    if factory is None:
        return None
    at = f"{where} layer_factory"
    layer = factory()
    name = _check_registered(layer, at)
    if layer.state:
        raise CacheInputError(f"{at}: builds a layer that already holds tensors; it must build empty layers")
    return {"class": name, "meta_state": _layer_meta(layer, at)}


def _describe_static(cache: StaticCache, prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {"max_cache_len": cache.max_cache_len, **_describe_layers(cache, prefix, tensors)}


def _describe_encoder_decoder(cache: Any, prefix: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    parts: dict[str, Any] = {}
    for part in ENCODER_DECODER_PARTS:
        sub = getattr(cache, part)
        if type(sub).__name__ == "EncoderDecoderCache":
            raise CacheInputError(f"cannot save an EncoderDecoderCache nested in {part}")
        parts[part] = _describe(sub, f"{prefix}{part}.", tensors)
    is_updated = {}
    for idx, flag in cache.is_updated.items():
        if isinstance(idx, bool) or not isinstance(idx, int) or idx < 0 or not isinstance(flag, bool):
            raise CacheInputError(f"is_updated must map layer indices to bools, got {idx!r}: {flag!r}")
        is_updated[str(idx)] = flag
    return {**parts, "is_updated": is_updated}


# ----------------------------------------------------------------------------------- building
def build_cache(description: dict[str, Any], source: TensorSource) -> Any:
    """Rebuild the cache `description` describes, taking its tensors from `source`.

    Raises `CacheFormatError` naming the part and layer for anything inconsistent.
    """
    return _build(description, "", source)


def _build(desc: Any, prefix: str, source: TensorSource) -> Any:
    where = prefix.rstrip(".") or "cache"
    if not isinstance(desc, dict):
        raise CacheFormatError(f"{where}: description must be a JSON object, got {type(desc).__name__}")
    name = desc.get("class")
    kind = composite_kinds().get(name) if isinstance(name, str) else None
    if kind is None:
        raise CacheFormatError(f"{where}: unknown cache class {name!r} (known: {sorted(composite_kinds())})")
    extra, missing = set(desc) - kind.keys - {"class"}, kind.keys - set(desc)
    if extra or missing:
        raise CacheFormatError(f"{where} ({name}): unexpected keys {sorted(extra)}, missing keys {sorted(missing)}")
    return kind.build(desc, prefix, source, where)


def _field(obj: dict[str, Any], key: str, typ: type, where: str) -> Any:
    value = obj.get(key)
    if not isinstance(value, typ) or isinstance(value, bool) is not (typ is bool):
        raise CacheFormatError(f"{where}: '{key}' must be a {typ.__name__}, got {value!r}"[:300])
    return value


def _layer_class(name: Any, where: str) -> type[CacheLayer]:
    cls = LAYER_REGISTRY.get(name) if isinstance(name, str) else None
    if cls is None:
        raise CacheFormatError(f"{where}: unknown layer class {name!r} (known: {sorted(LAYER_REGISTRY)})"[:400])
    return cls


def _shape(value: Any, where: str) -> list[int]:
    if not isinstance(value, list) or not all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value
    ):
        raise CacheFormatError(f"{where}: shape must be a list of non-negative ints, got {value!r}"[:300])
    return value


def _canonical(meta: Any) -> str:
    """JSON text that tells 1 from 1.0 and from True (Python's == does not)."""
    return json.dumps(meta, sort_keys=True)


def _from_state(cls: type[CacheLayer], meta: dict[str, Any], state: dict[str, torch.Tensor], where: str,
                adopt: bool = False) -> CacheLayer:  # fmt: skip
    """`cls.from_state` (`adopt_state` for tensors the loader gives up), with every failure a
    `CacheFormatError`, and a check that the layer describes itself as the file does (so no field
    was ignored or coerced)."""
    try:
        layer = cls.adopt_state(meta, state) if adopt else cls.from_state(meta, state)
        rebuilt = _canonical(layer.meta_state)
    except Exception as err:  # a layer's validation error, or any slip on bad input
        raise CacheFormatError(f"{where} ({cls.__name__}): {type(err).__name__}: {err}"[:500]) from err
    if rebuilt != _canonical(meta):
        raise CacheFormatError(
            f"{where} ({cls.__name__}): meta_state {_canonical(meta)} does not rebuild as itself (got {rebuilt})"[:500]
        )
    return layer


def _order(value: Any, ndim: int, where: str) -> list[int] | None:
    """A tensor's stored dim order (absent: as it is), checked to be a permutation of its dims."""
    if value is None:
        return None
    ok = isinstance(value, list) and all(type(d) is int for d in value) and sorted(value) == list(range(ndim))
    if not ok:
        raise CacheFormatError(f"{where}: order must be a permutation of the {ndim} dims, got {value!r}"[:300])
    return value


def _landing(cls: type[CacheLayer], meta: dict[str, Any], name: str, dtype: str, shape: list[int],
             where: str) -> torch.Tensor:  # fmt: skip
    """Where `cls` wants its tensor `name` read (`CacheLayer.load_target`), checked to be that tensor."""
    try:
        tensor = cls.load_target(meta, name, list(shape), TORCH_DTYPES[dtype])
    except Exception as err:  # a layer's validation error, or any slip on bad input
        raise CacheFormatError(f"{where} ({cls.__name__}): {type(err).__name__}: {err}"[:500]) from err
    if list(tensor.shape) != shape or tensor.dtype != TORCH_DTYPES[dtype] or tensor.device.type != "cpu":
        raise CacheFormatError(f"{where} ({cls.__name__}): load_target gave {tensor.dtype}{list(tensor.shape)} "
                               f"on {tensor.device} for {dtype}{shape}")  # fmt: skip
    return tensor


def _build_layers(desc: dict[str, Any], prefix: str, source: TensorSource, where: str) -> list[CacheLayer]:
    layers = []
    for i, entry in enumerate(_field(desc, "layers", list, where)):
        at = f"{where} layer {i}"
        if not isinstance(entry, dict) or set(entry) != {"class", "meta_state", "tensors"}:
            raise CacheFormatError(f"{at}: must be an object with keys class, meta_state, tensors")
        cls = _layer_class(entry["class"], at)
        meta = _field(entry, "meta_state", dict, at)
        state = {}
        for state_name, spec in _field(entry, "tensors", dict, at).items():
            if (not isinstance(spec, dict) or set(spec) - {"order"} != {"dtype", "shape"}
                    or not isinstance(spec["dtype"], str)):  # fmt: skip
                raise CacheFormatError(f"{at}: tensor {state_name!r} must be described by dtype and shape")
            shape = _shape(spec["shape"], f"{at} tensor {state_name!r}")
            order = _order(spec.get("order"), len(shape), f"{at} tensor {state_name!r}")
            target = functools.partial(_landing, cls, meta, state_name, spec["dtype"], shape, at)
            name = f"{prefix}layers.{i}.{state_name}"
            state[state_name] = source.take(name, spec["dtype"], shape, at, order, target)
        source.charge(_planned_nbytes(cls, meta, state, at), at)
        layers.append(_from_state(cls, meta, state, at, adopt=True))
    return layers


def _planned_nbytes(cls: type[CacheLayer], meta: dict[str, Any], state: dict[str, torch.Tensor], where: str) -> int:
    try:
        return int(cls.planned_nbytes(meta, state))
    except Exception as err:
        raise CacheFormatError(f"{where} ({cls.__name__}): {type(err).__name__}: {err}"[:500]) from err


def _fresh_layer(cls: type[CacheLayer], meta: dict[str, Any]) -> CacheLayer:
    return cls.from_state(meta, {})


def _install_factory(cache: Cache, composite: dict[str, Any], where: str) -> None:
    """Set `cache.layer_factory` (and whether new layers record) from the description, keeping the
    class's own factory when the description matches it (so a loaded `DynamicCache()` builds
    layers exactly as a new one)."""
    if _field(composite, "record_new_layers", bool, where):
        setattr(cache, _RECORD_NEW_LAYERS, True)
    desc = composite["layer_factory"]
    if desc is None:
        cache.layer_factory = None
        return
    at = f"{where} layer_factory"
    if not isinstance(desc, dict) or set(desc) != {"class", "meta_state"}:
        raise CacheFormatError(f"{at}: must be null or an object with keys class, meta_state")
    cls = _layer_class(desc["class"], at)
    meta = _field(desc, "meta_state", dict, at)
    if _from_state(cls, meta, {}, at).state:
        raise CacheFormatError(f"{at}: describes a layer that holds tensors")
    if cache.layer_factory is not None and _describe_factory(cache.layer_factory, where) == desc:
        return
    cache.layer_factory = functools.partial(_fresh_layer, cls, meta)


def _build_plain(desc: dict[str, Any], prefix: str, source: TensorSource, where: str) -> Cache:
    cache = Cache(_build_layers(desc, prefix, source, where))
    _install_factory(cache, desc, where)
    return cache


def _build_dynamic(desc: dict[str, Any], prefix: str, source: TensorSource, where: str) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = _build_layers(desc, prefix, source, where)
    _install_factory(cache, desc, where)
    return cache


def _build_static(desc: dict[str, Any], prefix: str, source: TensorSource, where: str) -> StaticCache:
    max_cache_len = _field(desc, "max_cache_len", int, where)
    try:
        cache = StaticCache(max_cache_len)
    except CacheInputError as err:
        raise CacheFormatError(f"{where}: {err}") from None
    cache.layers = _build_layers(desc, prefix, source, where)
    _install_factory(cache, desc, where)
    return cache


def _build_encoder_decoder(desc: dict[str, Any], prefix: str, source: TensorSource, where: str) -> Any:
    from ..encoder_decoder import EncoderDecoderCache

    parts = {}
    for part in ENCODER_DECODER_PARTS:
        if isinstance(desc[part], dict) and desc[part].get("class") == "EncoderDecoderCache":
            raise CacheFormatError(f"{where}: {part} cannot be an EncoderDecoderCache")
        parts[part] = _build(desc[part], f"{prefix}{part}.", source)
    is_updated = {}
    for key, flag in _field(desc, "is_updated", dict, where).items():
        if not (key.isascii() and key.isdigit()) or not isinstance(flag, bool):
            raise CacheFormatError(f"{where}: is_updated must map layer indices to bools, got {key!r}: {flag!r}")
        is_updated[int(key)] = flag
    try:
        cache = EncoderDecoderCache(parts["self_attention_cache"], parts["cross_attention_cache"])
    except CacheInputError as err:
        raise CacheFormatError(f"{where}: {err}") from None
    cache.is_updated = is_updated
    return cache


_LAYER_KEYS = frozenset({"layers", "layer_factory", "record_new_layers"})


@functools.cache
def composite_kinds() -> dict[str, CompositeKind]:
    """The composite classes that can be saved and loaded, by class name."""
    kinds = {
        "Cache": CompositeKind(Cache, _describe_layers, _build_plain, _LAYER_KEYS),
        "DynamicCache": CompositeKind(DynamicCache, _describe_layers, _build_dynamic, _LAYER_KEYS),
        "StaticCache": CompositeKind(StaticCache, _describe_static, _build_static, _LAYER_KEYS | {"max_cache_len"}),
    }
    try:
        from ..encoder_decoder import EncoderDecoderCache
    except ModuleNotFoundError as err:  # not part of this build
        if err.name != f"{__package__.rpartition('.')[0]}.encoder_decoder":
            raise
        return kinds
    kinds["EncoderDecoderCache"] = CompositeKind(
        EncoderDecoderCache,
        _describe_encoder_decoder,
        _build_encoder_decoder,
        frozenset({*ENCODER_DECODER_PARTS, "is_updated"}),
    )
    return kinds
