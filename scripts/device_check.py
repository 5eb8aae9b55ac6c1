"""The prepared device check: one command for a machine with an accelerator, that runs to the end on
the CPU too (`--device cpu`), so a GPU run needs no editing.

    python scripts/device_check.py                 # auto: CUDA, then MPS, then the CPU
    python scripts/device_check.py --device cpu    # the same checks, CPU-sized models

1. The device-matrix tests (`tests/test_devices.py`, `tests/test_device_sync.py`) on every device
   present (the CUDA-only ones run where CUDA is).
2. Side by side, in one run, printed as Markdown tables:
   - tokens/s of kvcache `generate` against transformers' `generate` at batch 1 and 8, greedy, on a
     random Llama (~1B-parameter shape in bfloat16 on an accelerator; a small shape on the CPU);
   - host reads per decode step of kvcache's driver (the deferred stop check: one, one step late);
   - loading a cache file (2 GiB on an accelerator) into device memory with `load_cache(device=)`
     against safetensors' `load_file(device=)` of the same tensors;
   - a 1,024-token prefill through `generate(max_new_tokens=0)` against one bare forward;
   - the server's engine: tokens/s at 1 and 8 concurrent requests.
Needs the `transformers` extra for the Llama; every figure is a median of `--repeats` runs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

#: Model shapes: an accelerator gets a ~1B-parameter Llama (Llama-3.2-1B's shape), the CPU a small one.
SHAPES = {
    "1b": {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
           "num_key_value_heads": 8, "vocab_size": 32000},
    "small": {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 8,
              "num_key_value_heads": 2, "vocab_size": 4096},
}  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    """Median seconds of `fn` (one warm-up call first), the device drained around each call."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def table(title: str, header: list[str], rows: list[list[str]]) -> None:
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def run_tests(device: torch.device) -> bool:
    """The device-matrix tests; True when they pass."""
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_devices.py", "tests/test_device_sync.py"],
                          cwd=ROOT, capture_output=True, text=True, timeout=1800)  # fmt: skip
    tail = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-500:]
    print(f"device-matrix tests on {', '.join(str(d) for d in _present())}: {tail}")
    if done.returncode:
        print(done.stdout[-4000:])
    return done.returncode == 0


def _present() -> list[torch.device]:
    from kvcache.devices import available_devices

    return available_devices()


def llama(device: torch.device, shape: str, dtype: torch.dtype) -> Any:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPES[shape], max_position_embeddings=4096)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    return model.to(dtype).eval()


def generate_figures(model: Any, device: torch.device, repeats: int, new: int) -> list[list[str]]:
    from kvcache.generation import generate
    from kvcache.integrations.transformers import wrap_model

    wrapped = wrap_model(model)
    rows = []
    for batch in (1, 8):
        ids = torch.randint(1, 1000, (batch, 32), generator=torch.Generator().manual_seed(batch)).to(device)
        mask = torch.ones_like(ids)
        ours = timed(lambda ids=ids: generate(wrapped, ids, max_new_tokens=new, eos_token_id=[]), device, repeats)
        theirs = timed(lambda ids=ids, mask=mask: model.generate(ids, attention_mask=mask, max_new_tokens=new,
                                                                 do_sample=False, eos_token_id=None,
                                                                 pad_token_id=0), device, repeats)  # fmt: skip
        same = torch.equal(generate(wrapped, ids, max_new_tokens=new, eos_token_id=[]).sequences,
                           model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                          eos_token_id=None, pad_token_id=0))  # fmt: skip
        rows.append([str(batch), f"{batch * new / ours:,.1f}", f"{batch * new / theirs:,.1f}", f"{theirs / ours:.2f}",
                     "yes" if same else "no (bf16 ties differ)"])  # fmt: skip
    return rows


def host_reads_per_step(device: torch.device) -> list[list[str]]:
    from test_device_sync import Forwards, Log, model_on

    from kvcache.generation import generate

    model = model_on(device)
    prompt = torch.randint(1, 64, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    with Log() as mode:
        generate(Forwards(model, mode.log), prompt, max_new_tokens=32, eos_token_id=[63], defer_stop=True)
    log = "".join(mode.log)
    decode = log[log.rindex("P") + 1 :]
    steps = decode.count("F")
    late = decode == "FR" * steps
    return [[str(steps + 1), f"{decode.count('R') / (steps + 1):.2f}", "yes" if late else f"no: {decode[:40]}"]]


def load_figures(device: torch.device, gib: float, repeats: int) -> list[list[str]]:
    from safetensors.torch import load_file, save_file

    from kvcache import DynamicLayer, load_cache, save_cache
    from kvcache.cache import Cache

    layers, heads, dim = 16, 8, 128
    tokens = max(16, int(gib * (1 << 30) / (layers * 2 * heads * dim * 2)))
    cache = Cache([DynamicLayer() for _ in range(layers)])
    for i, layer in enumerate(cache):
        k = torch.randn(1, heads, tokens, dim, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
        layer.update(k, k.clone())
    plain = {f"{i}.{n}": t.contiguous() for i, layer in enumerate(cache) for n, t in layer.state.items()}
    nbytes = sum(t.nbytes for t in plain.values())
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = Path(tmp) / "cache.kvcache", Path(tmp) / "plain.safetensors"
        save_cache(cache, ours)
        save_file(plain, str(theirs))
        del cache, plain
        target = str(device)
        t_ours = timed(lambda: load_cache(ours, device=target), device, repeats)
        t_fast = timed(lambda: load_cache(ours, device=target, verify=False), device, repeats)
        if device.type == "cpu":  # load_file maps the file on the CPU: touch every page, as a load reads it
            t_theirs = timed(lambda: [t.view(-1)[:: max(1, 4096 // t.element_size())].sum()
                                      for t in load_file(str(theirs)).values()], device, repeats)  # fmt: skip
        else:
            t_theirs = timed(lambda: load_file(str(theirs), device=target), device, repeats)
    gb = nbytes / 1e9
    return [[f"{nbytes / (1 << 30):.2f} GiB", f"{gb / t_ours:.2f}", f"{gb / t_fast:.2f}", f"{gb / t_theirs:.2f}",
             f"{t_theirs / t_fast:.2f}"]]  # fmt: skip


def prefill_figures(model: Any, device: torch.device, repeats: int) -> list[list[str]]:
    from kvcache.generation import generate
    from kvcache.integrations.transformers import wrap_model

    wrapped = wrap_model(model)
    ids = torch.randint(1, 1000, (1, 1024), generator=torch.Generator().manual_seed(7)).to(device)
    with torch.no_grad():
        ours = timed(lambda: generate(wrapped, ids, max_new_tokens=0), device, repeats)
        bare = timed(lambda: model(ids[:, :-1]), device, repeats)
    return [["1,024", f"{ours * 1e3:.1f}", f"{bare * 1e3:.1f}", f"{bare / ours:.2f}"]]


def serve_figures(model: Any, device: torch.device, new: int) -> list[list[str]]:
    from kvcache.generation.sampling import Sampling
    from kvcache.integrations.transformers import wrap_model
    from kvcache.serve.engine import Engine, Request
    from kvcache.store import PrefixStore

    rows = []
    for clients in (1, 8):
        engine = Engine(wrap_model(model), PrefixStore(chunk_size=16), eos=[])
        done = [threading.Event() for _ in range(clients)]
        requests = [Request(prompt=list(range(10 + i, 200 + i)), max_tokens=new, sampling=Sampling(False),
                            on_event=lambda e, d=d: d.set() if e[0] in ("done", "error") else None)
                    for i, d in enumerate(done)]  # fmt: skip
        engine.start()
        try:
            start = time.perf_counter()
            for request in requests:
                engine.submit(request)
            ok = all(d.wait(1800) for d in done)
            elapsed = time.perf_counter() - start
        finally:
            engine.stop()
        tokens = sum(len(r.tokens) for r in requests)
        rows.append([str(clients), f"{tokens / elapsed:,.1f}", "yes" if ok else "timed out"])
    return rows


def main(argv: list[str] | None = None) -> int:
    from kvcache.devices import resolve_device

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N or mps (default auto)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--skip-tests", action="store_true", help="only the figures")
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    accelerated = device.type != "cpu"
    shape, dtype = ("1b", torch.bfloat16) if accelerated else ("small", torch.float32)
    new, gib = (128, 2.0) if accelerated else (32, 0.125)
    name = f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""
    print(f"# kvcache device check on {device}{name}; torch {torch.__version__}\n")
    passed = True if args.skip_tests else run_tests(device)
    table("Host reads per decode step of `generate` (deferred stop check)", ["steps", "reads per step",
          "one step late"], host_reads_per_step(device))  # fmt: skip
    table(f"Loading a cache file into {device} memory, GB/s", ["size", "load_cache", "load_cache verify=False",
          "safetensors load_file", "ours / theirs"], load_figures(device, gib, args.repeats))  # fmt: skip
    try:
        model = llama(device, shape, dtype)
    except ImportError:
        print("\n(transformers is not installed: the Llama figures are not measured)")
        return 0 if passed else 1
    params = sum(p.numel() for p in model.parameters()) / 1e9
    label = f"random Llama, {params:.2f}B parameters, {str(dtype).removeprefix('torch.')}"
    with torch.no_grad():
        table(f"`generate` against transformers' `generate`, greedy, {new} new tokens ({label}), tokens/s",
              ["batch", "kvcache", "transformers", "kvcache / transformers", "same tokens"],
              generate_figures(model, device, args.repeats, new))  # fmt: skip
        table(f"Prefill of 1,024 tokens ({label}), ms", ["prompt", "generate(max_new_tokens=0)", "one forward",
              "forward / ours"], prefill_figures(model, device, args.repeats))  # fmt: skip
        table(f"The server's engine, {new} new tokens per request ({label})", ["concurrent requests", "tokens/s",
              "all answered"], serve_figures(model, device, new))  # fmt: skip
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
