"""`torch.compile(fullgraph=True)` decode loops on kvcache's static caches: no graph breaks, no
recompilation across crops, logits equal to eager.

Graphs are counted with dynamo's own counter on the "eager" backend (the captured graph runs with
the same kernels as eager code, so a reference model's compiled logits must equal its eager logits
bit for bit). transformers' model code takes other branches when it is being traced (its own
static cache gives compiled logits that differ from its eager ones by up to 1.2e-7 here), so for
transformers models compiled and eager logits are compared with a tolerance of 1e-6.

How many graphs: a transformers Llama on kvcache's `StaticCache` compiles one graph for all decode
steps and crops (its layers hand traced code a device-side length, never a Python int), as on
transformers' own. A sliding-window layer must tell the mask its first position (a Python int),
and a recurrent layer counts tokens on the host: dynamo specializes on those ints once, then
makes them dynamic: one recompilation at the second step (transformers' own Gemma3 static cache
has the same), none after, crops included.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvcache.models import DecoderConfig, DecoderLM, HybridConfig, HybridLM

dynamo_testing = pytest.importorskip("torch._dynamo.testing")
pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 18  # five crops after the warm-up, each followed by steps of both shapes
TRANSFORMERS_ATOL = 1e-6


def _transformers_runner(kind: str) -> tuple[Any, Any]:
    pytest.importorskip("transformers", minversion="5.24")
    from test_transformers_models import tiny_model

    from kvcache.integrations.transformers import as_transformers_cache, cache_from_config

    model = tiny_model(kind)

    def forward(fn: Any, ids: torch.Tensor, cache: Any, position: int) -> torch.Tensor:
        positions = torch.arange(position, position + ids.shape[1])[None]
        return fn(ids, cache=as_transformers_cache(cache), use_cache=True, position_ids=positions).logits

    return model, (forward, lambda: cache_from_config(model.config, static=True, max_cache_len=96))


def _reference_runner(kind: str) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = (DecoderLM(DecoderConfig()) if kind == "decoder" else HybridLM(HybridConfig())).eval()
    if kind == "hybrid":
        model.set_return_intermediate_states(True)

    def forward(fn: Any, ids: torch.Tensor, cache: Any, position: int) -> torch.Tensor:
        return fn(ids, cache=cache)

    return model, (forward, lambda: model.new_static_cache(96))


def _decode(kind: str, crop_every: int, draft: int, back: int) -> tuple[list[int], list[float]]:
    """Prefill eagerly, then decode compiled and eagerly side by side: a 1-token step, and every
    `crop_every` steps a `draft + 1`-token verify step of which `back` tokens are cropped. Returns
    the graph count after each step and the largest compiled-vs-eager logit difference."""
    torch._dynamo.reset()
    reference = kind in ("decoder", "hybrid")
    model, (forward, new_cache) = _reference_runner(kind) if reference else _transformers_runner(kind)
    counter = dynamo_testing.CompileCounterWithBackend("eager")
    compiled = torch.compile(model.forward if reference else model, backend=counter, fullgraph=True)
    ids = torch.randint(1, 128, (1, 200), generator=torch.Generator().manual_seed(3))
    caches = [new_cache(), new_cache()]
    frames, diffs = [], []
    with torch.no_grad():
        for cache in caches:
            cache.activate_past_recording()
            forward(model, ids[:, :20], cache, 0)
        position = 20
        for step in range(STEPS + 6):
            n = draft + 1 if step % crop_every == crop_every - 1 else 1
            chunk = ids[:, position : position + n]
            got = forward(compiled, chunk, caches[0], position)
            want = forward(model, chunk, caches[1], position)
            diffs.append((got - want).abs().max().item())
            position += n
            if n > 1:
                for cache in caches:
                    cache.crop(-back)
                position -= back
            frames.append(counter.frame_count)
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == position
    return frames, diffs


def test_transformers_llama_compiles_one_graph_across_crops() -> None:
    frames, diffs = _decode("llama", crop_every=4, draft=0, back=1)  # 1-token steps, crops of 1
    assert frames[-1] == 1, frames
    assert max(diffs) <= TRANSFORMERS_ATOL


@pytest.mark.parametrize(
    ("kind", "back"),
    [
        ("decoder", 2),  # reference: full + sliding attention
        ("hybrid", 2),  # reference: recurrent, full, parallel hybrid, sliding (intermediate states: any crop)
        # with KVCACHE_SLOW=1 (54 s here): the reference models cover sliding, conv and recurrent layers by default
        pytest.param("gemma3", 2, marks=pytest.mark.slow),  # transformers: sliding first, then full
        pytest.param("lfm2", 2, marks=pytest.mark.slow),  # transformers: short conv (token-exact) + attention
        pytest.param("qwen3_next", 3, marks=pytest.mark.slow),  # gated delta net, no intermediate states: whole steps
    ],
)
def test_sliding_and_hybrid_models_decode_without_recompiling(kind: str, back: int) -> None:
    frames, diffs = _decode(kind, crop_every=4, draft=2, back=back)
    warm = frames[5]  # after the first steps of each shape and the first crop
    assert frames[-1] == warm, frames
    assert warm <= 4, frames  # 1-token and verify graphs, each specialized once on the host counters
    if kind in ("decoder", "hybrid"):
        assert max(diffs) == 0.0, diffs
    else:
        assert max(diffs) <= TRANSFORMERS_ATOL, diffs


def test_reference_models_compile_fullgraph_on_dynamic_caches_too() -> None:
    """No host syncs in the forward: `fullgraph=True` also traces a growing `DynamicCache` (shapes
    change per step, so dynamo recompiles, but never breaks the graph)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = HybridLM(HybridConfig()).eval()
    compiled = torch.compile(model.forward, backend="eager", fullgraph=True)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        a, b = model.new_cache(), model.new_cache()
        outs = [(compiled(ids[:, i : i + 4], cache=a), model(ids[:, i : i + 4], cache=b)) for i in range(0, 16, 4)]
    assert all(torch.equal(x, y) for x, y in outs)
