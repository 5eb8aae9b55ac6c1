"""A decode step that never makes the host wait, proven.

On every device: the driver's host reads of tensors (`bool`, `.item()`, `.tolist()`, `int`, ...,
made from `kvcache/generation`) are counted per step while `generate` runs with the deferred stop
check: exactly one per step, made after the next step's forward is queued. Adding an `.item()` or
a `bool(tensor)` to the decode step breaks the count or the order. (The reference models' own input
checks read token ids on the CPU only, where that costs nothing; they are not the driver's.)

On CUDA: the decode loop runs under `torch.cuda.set_sync_debug_mode("error")`, so any implicit
synchronization raises; and a static cache decodes under `torch.compile(mode="reduce-overhead")`
(CUDA graphs) through crops, against eager.
"""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.overrides import TorchFunctionMode

import kvcache
from kvcache.generation import generate
from kvcache.models import DecoderConfig, DecoderLM

pytestmark = pytest.mark.usefixtures("one_thread")

GENERATION = str(Path(kvcache.__file__).parent / "generation")
PACKAGE = str(Path(kvcache.__file__).parent)
#: Tensor methods that hand a value to the host (and wait for the device to produce it).
HOST_READS = {torch.Tensor.__bool__, torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__int__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy}  # fmt: skip
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class Log(TorchFunctionMode):
    """Writes "F" for each model forward and "R" for each host read made by the driver (the
    nearest kvcache frame of the call is in kvcache/generation)."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in HOST_READS:
            ours = [f.filename for f in traceback.extract_stack()[:-1] if f.filename.startswith(PACKAGE)]
            if ours and ours[-1].startswith(GENERATION):
                self.log.append("R")
        return func(*args, **(kwargs or {}))


def model_on(device: torch.device, layer_types: list[str] | None = None) -> DecoderLM:
    torch.manual_seed(0)
    config = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=4, num_kv_heads=2,
                           layer_types=layer_types or ["full_attention", "sliding_attention"], sliding_window=8)
    return DecoderLM(config).eval().to(device)


class Forwards:
    """The model, writing into `log` "P" for a forward of several tokens (the prefill) and "F"
    for one of one token (a decode step)."""

    def __init__(self, model: Any, log: list[str]) -> None:
        self.model, self.log = model, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, ids: torch.Tensor, **kwargs: Any) -> Any:
        self.log.append("P" if ids.shape[1] > 1 else "F")
        return self.model(ids, **kwargs)


@pytest.mark.parametrize("steps", [6, 12])
def test_the_driver_reads_the_device_once_per_step_one_step_late(device: torch.device, steps: int) -> None:
    model = model_on(device)
    prompt = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    with Log() as mode:
        wrapped = Forwards(model, mode.log)
        out = generate(wrapped, prompt, max_new_tokens=steps, eos_token_id=[63], defer_stop=True)
    assert out.sequences.shape[1] == 9 + steps  # no row reached the eos: every step ran
    log = "".join(mode.log)  # the input checks before the prefill read ids (once per call, not per step)
    decode = log[log.rindex("P") + 1 :]
    # step 0 takes its logits from the prefill; each later step queues its forward, then reads the
    # previous step's flag (whose copy has long since landed)
    assert decode == "FR" * (steps - 1), log


def test_an_eos_costs_no_extra_read(device: torch.device) -> None:
    """A run stopped by an eos at step k reads k flags: the stop is seen one step late, and the
    extra step is undone without reading anything more."""
    model = model_on(device)
    prompt = torch.randint(1, 64, (1, 9), generator=torch.Generator().manual_seed(1)).to(device)
    free = generate(model, prompt, max_new_tokens=10, eos_token_id=[]).sequences[0, 9:].tolist()
    eos = free[4]
    stop_at = free.index(eos)
    with Log() as mode:
        out = generate(Forwards(model, mode.log), prompt, max_new_tokens=10, eos_token_id=[eos], defer_stop=True)
    assert out.sequences[0, 9:].tolist() == free[: stop_at + 1]
    log = "".join(mode.log)
    assert log[log.rindex("P") + 1 :] == "FR" * (stop_at + 1), log


@cuda
def test_no_implicit_sync_in_a_cuda_decode_step() -> None:
    """Every decode step under sync debug mode "error" (the prefill, with its input checks, runs
    before it is switched on); the stop flag's read is of pinned host memory after an event, which
    is no implicit synchronization."""
    device = torch.device("cuda")
    model = model_on(device)
    prompt = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    want = generate(model, prompt, max_new_tokens=16, eos_token_id=[63], defer_stop=False)

    class Strict(Forwards):
        def __call__(self, ids: torch.Tensor, **kwargs: Any) -> Any:
            if ids.shape[1] == 1:  # decode steps from here on
                torch.cuda.set_sync_debug_mode("error")
            return self.model(ids, **kwargs)

    try:
        got = generate(Strict(model, []), prompt, max_new_tokens=16, eos_token_id=[63])  # defers on CUDA
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.sequences, want.sequences)


@cuda
def test_cuda_graphs_decode_a_static_cache_through_crops() -> None:
    """`torch.compile(mode="reduce-overhead")` on a static cache: 1-token steps and 3-token verify
    steps cropped by 2, against eager on another static cache (inductor's kernels are not eager's:
    compared within 1e-4 of the largest logit)."""
    device = torch.device("cuda")
    model = model_on(device, ["full_attention", "full_attention"])
    compiled = torch.compile(model.forward, mode="reduce-overhead")
    ids = torch.randint(1, 64, (1, 120), generator=torch.Generator().manual_seed(3)).to(device)
    caches = [model.new_static_cache(128), model.new_static_cache(128)]
    with torch.no_grad():
        for cache in caches:
            cache.activate_past_recording()
            model(ids[:, :16], cache=cache)
        position = 16
        for step in range(40):
            n = 3 if step % 4 == 3 else 1
            chunk = ids[:, position : position + n]
            got = compiled(chunk, cache=caches[0]).clone()
            want = model(chunk, cache=caches[1])
            assert (got - want).abs().max() <= 1e-4 * want.abs().max(), step
            position += n
            if n > 1:
                for cache in caches:
                    cache.crop(-2)
                position -= 2
    assert caches[0].get_seq_length() == caches[1].get_seq_length() == position
