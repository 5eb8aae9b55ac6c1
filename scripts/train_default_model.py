"""Train the bundled default model: a small character-level `DecoderLM`.

Corpus: the English text of CPython's own help topics (`pydoc_data.topics.topics`, shipped with
every CPython install, so no download is needed). Topics are joined in sorted key order; the last
5% of characters are held out for validation. CPU only, one thread, seeded: about 10 minutes on
an idle core. The text of `pydoc_data` changes between Python releases; the shipped weights were
trained on CPython 3.11.7 (recorded in `default.json` with the recipe and the final losses).

    python scripts/train_default_model.py                 # writes kvcache/models/weights/
    python scripts/train_default_model.py --steps 50 --out /tmp/w   # a quick smoke run

Writes `default.safetensors` (fp16 weights) and `default.json` (config, alphabet, recipe, losses).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcache.models.decoder import DecoderConfig, DecoderLM
from kvcache.models.tokenizer import CharTokenizer

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "kvcache" / "models" / "weights"


def load_corpus() -> str:
    """CPython's help-topic text, topics joined in sorted key order."""
    from pydoc_data.topics import topics

    return "\n".join(topics[key] for key in sorted(topics))


def batches(data: torch.Tensor, batch: int, seq: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
    rows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])
    return rows[:, :-1], rows[:, 1:]


@torch.no_grad()
def evaluate(model: DecoderLM, data: torch.Tensor, seq: int) -> float:
    """Mean next-character loss over non-overlapping windows of `data`."""
    model.eval()
    usable = (len(data) - 1) // seq * seq
    inputs = data[:usable].view(-1, seq)
    targets = data[1 : usable + 1].view(-1, seq)
    total = 0.0
    for i in range(0, len(inputs), 64):
        logits = model(inputs[i : i + 64])
        total += F.cross_entropy(logits.flatten(0, 1), targets[i : i + 64].flatten(), reduction="sum").item()
    model.train()
    return total / targets.numel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--time-limit", type=float, default=None, help="stop early after this many minutes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    text = load_corpus()
    tokenizer = CharTokenizer.from_text(text)
    data = torch.tensor(tokenizer.encode(text), dtype=torch.long)
    split = int(len(data) * 0.95)
    train, val = data[:split], data[split:]
    config = DecoderConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_heads=4,
        num_kv_heads=2,
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=args.window,
    )
    model = DecoderLM(config)
    params = sum(p.numel() for p in model.parameters())
    print(f"corpus {len(text)} chars, vocab {tokenizer.vocab_size}, params {params}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    gen = torch.Generator().manual_seed(args.seed)
    start, smoothed, steps_done = time.time(), None, 0
    for step in range(args.steps):
        if args.time_limit is not None and time.time() - start > 60 * args.time_limit:
            print(f"time limit reached: stopping at step {step}", flush=True)
            break
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        inputs, targets = batches(train, args.batch, args.seq, gen)
        loss = F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        smoothed = loss.item() if smoothed is None else 0.98 * smoothed + 0.02 * loss.item()
        steps_done = step + 1
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            print(
                f"step {step + 1}/{args.steps}  train(ema) {smoothed:.4f}  val {evaluate(model, val, args.seq):.4f}"
                f"  lr {lr_at(step):.2e}  {time.time() - start:.0f}s",
                flush=True,
            )

    # Ship fp16 weights; report the losses of exactly what ships (fp16 rounded, run in fp32).
    shipped = {k: v.detach().to(torch.float16).contiguous() for k, v in model.state_dict().items()}
    shipped.pop("lm_head.weight", None)  # tied to embed.weight
    model.load_state_dict({k: v.float() for k, v in shipped.items()}, strict=False)
    train_loss = evaluate(model, train[-len(val) :], args.seq)  # a train slice the size of val
    val_loss = evaluate(model, val, args.seq)
    print(f"final (fp16 weights): train {train_loss:.4f}  val {val_loss:.4f}", flush=True)

    args.out.mkdir(parents=True, exist_ok=True)
    save_file(shipped, str(args.out / "default.safetensors"), metadata={"format": "kvcache-default-model"})
    os.chmod(args.out / "default.safetensors", 0o644)  # package data: readable by everyone
    meta = {
        "config": config.to_dict(),
        "alphabet": tokenizer.alphabet,
        "unknown": tokenizer.unknown,
        "recipe": {
            "corpus": "pydoc_data.topics (CPython help topics), sorted keys joined by newline, last 5% held out",
            "python": platform.python_version(),
            "corpus_chars": len(text),
            "steps": steps_done,
            "scheduled_steps": args.steps,
            "batch": args.batch,
            "seq": args.seq,
            "lr": args.lr,
            "warmup": args.warmup,
            "schedule": "linear warmup, cosine to 10% of lr",
            "optimizer": f"AdamW betas (0.9, 0.95), weight decay {args.weight_decay}, grad clip 1.0",
            "seed": args.seed,
            "threads": args.threads,
            "train_seconds": round(time.time() - start),
            "torch": torch.__version__,
        },
        "final_train_loss": round(train_loss, 4),
        "final_val_loss": round(val_loss, 4),
    }
    (args.out / "default.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
