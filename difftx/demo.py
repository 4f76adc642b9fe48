"""A short DIFF-vs-baseline demo on built-in synthetic data (no files, no network).

Associative recall: a sequence of filler tokens hides ``n_pairs`` (key, value) pairs; it ends
with a query marker and one of the keys, and the model must produce that key's value. Both
models (DIFF and its parameter-matched baseline) start from the same seed and see the same
batches; the demo reports held-out accuracy, answer loss and the learned lambda per layer.
It is a smoke-scale illustration, not a research result: ``difftx compare`` is that.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .config import ModelConfig, baseline_config
from .model import Transformer

BOS, QUERY = 0, 1
N_KEYS, N_VALUES, N_FILLER = 16, 16, 30
KEY0, VALUE0 = 2, 2 + N_KEYS
FILLER0 = VALUE0 + N_VALUES
VOCAB = FILLER0 + N_FILLER


def recall_batch(batch: int, seq_len: int, n_pairs: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens ``(batch, seq_len)`` ending in ``QUERY key``, and the answer value ``(batch,)``."""
    if seq_len < 2 * n_pairs + 3:
        raise ValueError(f"seq_len {seq_len} too short for {n_pairs} pairs")
    tokens = torch.randint(FILLER0, VOCAB, (batch, seq_len), generator=generator)
    tokens[:, 0] = BOS
    answers = torch.empty(batch, dtype=torch.long)
    for b in range(batch):
        keys = torch.randperm(N_KEYS, generator=generator)[:n_pairs] + KEY0
        values = torch.randint(VALUE0, VALUE0 + N_VALUES, (n_pairs,), generator=generator)
        # non-overlapping pair slots between BOS and the query
        slots = torch.randperm((seq_len - 3) // 2, generator=generator)[:n_pairs] * 2 + 1
        for key, value, pos in zip(keys, values, slots):
            tokens[b, pos], tokens[b, pos + 1] = key, value
        pick = int(torch.randint(n_pairs, (1,), generator=generator))
        tokens[b, -2], tokens[b, -1] = QUERY, keys[pick]
        answers[b] = values[pick]
    return tokens, answers


@dataclass
class DemoResult:
    name: str
    parameters: int
    accuracy: float
    answer_loss: float
    seconds: float
    lambdas: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)


def _train_one(config: ModelConfig, steps: int, batch: int, seq_len: int, n_pairs: int, seed: int,
               lr: float, eval_samples: int, progress) -> DemoResult:
    torch.manual_seed(seed)
    model = Transformer(config)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(seed)  # same data order for both models
    t0 = time.perf_counter()
    losses = []
    for step in range(steps):
        tokens, answers = recall_batch(batch, seq_len, n_pairs, gen)
        loss = F.cross_entropy(model(tokens)[:, -1].float(), answers)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        progress(config.attention, step, loss.item())
    seconds = time.perf_counter() - t0
    model.eval()
    eval_gen = torch.Generator().manual_seed(10_000 + seed)
    tokens, answers = recall_batch(eval_samples, seq_len, n_pairs, eval_gen)
    with torch.no_grad():
        logits = model(tokens)[:, -1].float()
    lambdas = [float(b.attn.lambda_full().detach()) for b in model.layers if hasattr(b.attn, "lambda_full")]
    return DemoResult(config.attention, model.num_parameters(), (logits.argmax(-1) == answers).float().mean().item(),
                      F.cross_entropy(logits, answers).item(), seconds, lambdas, losses)


def run_demo(steps: int = 600, batch: int = 32, seq_len: int = 64, n_pairs: int = 6, dim: int = 64,
             n_layers: int = 2, n_heads: int = 2, seed: int = 0, lr: float = 3e-3, eval_samples: int = 1000,
             show_progress: bool = True) -> list[DemoResult]:
    """Train DIFF and its matched baseline on associative recall; return one result each."""
    from tqdm.auto import tqdm

    diff = ModelConfig(vocab_size=VOCAB, dim=dim, n_layers=n_layers, n_heads=n_heads, max_seq_len=seq_len)
    results = []
    for cfg in (diff, baseline_config(diff)):
        bar = tqdm(total=steps, desc=f"{cfg.attention:8s}", disable=not show_progress, leave=True)

        def progress(name, step, loss, bar=bar):
            bar.update(1)
            if step % 20 == 0:
                bar.set_postfix(loss=f"{loss:.3f}")

        results.append(_train_one(cfg, steps, batch, seq_len, n_pairs, seed, lr, eval_samples, progress))
        bar.close()
    return results


def format_results(results: list[DemoResult], n_pairs: int, eval_samples: int) -> str:
    lines = [f"Associative recall, {n_pairs} key-value pairs in filler, {eval_samples} held-out samples "
             f"(chance {1 / N_VALUES:.3f})", "",
             "| model | parameters | accuracy | answer loss (nats) | train time (s) | lambda per layer |",
             "|---|---:|---:|---:|---:|---|"]
    for r in results:
        lam = ", ".join(f"{x:.3f}" for x in r.lambdas) or "-"
        lines.append(f"| {r.name} | {r.parameters:,} | {r.accuracy:.3f} | {r.answer_loss:.3f} | {r.seconds:.1f} | {lam} |")
    lines += ["", "One seed at smoke scale: differences here are anecdotes, not evidence. "
              "Multi-seed statistics come from `difftx compare`."]
    return "\n".join(lines)
