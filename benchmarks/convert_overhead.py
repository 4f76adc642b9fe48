"""What a conversion costs: a standard-attention source against its conversions (``difftx convert``), measured
side by side in one run on this machine.

Usage:
    python benchmarks/convert_overhead.py                                  # a random 0.9M-parameter source
    python benchmarks/convert_overhead.py --source runs/src --methods mirror,dex --rounds 12
    python benchmarks/convert_overhead.py --dim 256 --layers 4 --heads 8 --kv-heads 4 --seq-len 512

For the source and each method's conversion (every head for ``dex``):

- ``params`` and ``KV B/token``: exact (parameters; float32 bytes the KV cache holds per token of context);
- ``train step``: CPU seconds of one optimizer step (forward and loss, backward, AdamW) on ``--batch-size`` x
  ``--seq-len`` random tokens, the median over ``--rounds`` rounds whose arm order alternates (ABBA); ``ratio``
  is the median of the per-round paired ratios against the source with its distribution-free 95% interval;
- ``decode``: CPU seconds per token of KV-cache decoding after a ``--seq-len`` prompt (batch 1), the same way;
- ``peak MiB``: in a fresh process per arm, how far the resident set size peaks (``VmHWM``, its high-water mark
  reset first through ``/proc/self/clear_refs``; elsewhere ``ru_maxrss``) above what the process holds once the
  model and batches exist, during ``--steps`` training steps: activations, gradients and AdamW state (PyTorch's
  CPU allocator is not instrumented; this is the OS's count).

The conversions are function-preserving, so the numbers are the cost of the second map (or of ``dex``'s value
map) at equal function. Measured: docs/results.md ("What a conversion costs").
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch

from difftx import KVCache, ModelConfig, Transformer
from difftx.checkpoint import load_model, save_model
from difftx.compare.source import kv_cache_bytes_per_token
from difftx.eval.stats import median_interval
from difftx.interop.convert import convert_model, read_source
from difftx.interop.hf import import_hf
from difftx.training.config import TrainConfig
from difftx.training.optim import build_optimizer


def _train_config(model) -> TrainConfig:
    """The trainer's defaults (AdamW, weight decay on matrices) for ``model``."""
    return TrainConfig(model=model.config.to_dict(), seq_len=model.config.max_seq_len, progress=False)


def _step(model, opt, x) -> None:
    loss = model(x[:, :-1], targets=x[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _train_seconds(model, opt, x, steps: int) -> float:
    t0 = time.process_time()
    for _ in range(steps):
        _step(model, opt, x)
    return (time.process_time() - t0) / steps


def _decode_seconds(model, prompt, tokens: int) -> float:
    with torch.no_grad():
        cache = KVCache(model, 1, prompt.shape[1] + tokens)
        logits = model(prompt, cache=cache)
        t0 = time.process_time()
        for _ in range(tokens):
            nxt = logits[:, -1:].argmax(-1)
            logits = model(nxt, cache=cache)
        return (time.process_time() - t0) / tokens


def _peak_growth(folder: str, batch: int, seq: int, steps: int, threads: int) -> float:
    """MiB the peak RSS grows by during ``steps`` training steps (run in a fresh process)."""
    torch.set_num_threads(threads)
    model = load_model(folder).train()
    opt = build_optimizer(model, _train_config(model))
    x = torch.randint(0, model.config.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    try:  # Linux: reset the high-water mark to the current RSS, so that import-time peaks do not hide the steps'
        Path("/proc/self/clear_refs").write_text("5")
        before = _status_kib("VmRSS")
    except OSError:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(steps):
        _step(model, opt, x)
    try:
        after = _status_kib("VmHWM")
    except OSError:
        after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return (after - before) / 1024


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise OSError(f"/proc/self/status has no {field}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source", help="a difftx standard model / run folder or transformers Llama folder (default: "
                                     "a random model of --dim/--layers/--heads/--kv-heads)")
    ap.add_argument("--methods", default="mirror,dex", help="comma-separated difftx convert methods (default "
                                                            "mirror,dex)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=257)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps", type=int, default=3, help="training steps per round (and in the memory process)")
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    with tempfile.TemporaryDirectory() as tmp:
        src = args.source
        if src is None:
            torch.manual_seed(0)
            cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                              n_kv_heads=args.kv_heads, max_seq_len=max(args.seq_len + args.decode_tokens, 64),
                              attention="standard")
            save_model(Transformer(cfg), Path(tmp) / "source")
            src = str(Path(tmp) / "source")
        kind, _, _, read = read_source(src)  # a run folder: its latest checkpoint; transformers: imported
        folders = {"source": str(read) if kind.startswith("difftx:") else str(import_hf(src, Path(tmp) / "imported"))}
        for m in methods:
            convert_model(src, Path(tmp) / m, method=m)
            folders[m] = str(Path(tmp) / m)
        models = {a: load_model(f).train() for a, f in folders.items()}
        cfg0 = models["source"].config
        if args.seq_len + args.decode_tokens > cfg0.max_seq_len:
            raise SystemExit(f"--seq-len + --decode-tokens exceeds the source's max_seq_len {cfg0.max_seq_len}")
        opts = {a: build_optimizer(m, _train_config(m)) for a, m in models.items()}
        g = torch.Generator().manual_seed(1)
        x = torch.randint(0, cfg0.vocab_size, (args.batch_size, args.seq_len + 1), generator=g)
        prompt = torch.randint(0, cfg0.vocab_size, (1, args.seq_len), generator=g)
        for a in models:  # warm-up: allocator and kernels
            _train_seconds(models[a], opts[a], x, 1)
        train = {a: [] for a in models}
        decode = {a: [] for a in models}
        order = list(models)
        for r in range(args.rounds):
            for a in (order if r % 2 == 0 else order[::-1]):
                train[a].append(_train_seconds(models[a], opts[a], x, args.steps))
                models[a].eval()
                decode[a].append(_decode_seconds(models[a], prompt, args.decode_tokens))
                models[a].train()
        ctx = mp.get_context("spawn")
        with ctx.Pool(1, maxtasksperchild=1) as pool:
            peak = {a: pool.apply(_peak_growth, (f, args.batch_size, args.seq_len, args.steps, args.threads))
                    for a, f in folders.items()}
        print(f"source: {args.source or 'random'} ({cfg0.dim} wide, {cfg0.n_layers} layers, {cfg0.n_heads} heads, "
              f"{cfg0.kv_groups} kv groups); batch {args.batch_size} x {args.seq_len}, {args.threads} thread(s), "
              f"CPU clock, {args.rounds} rounds (ABBA)\n")
        head = ["arm", "params", "KV B/token", "train step s", "ratio [95%]", "decode s/token", "ratio [95%]",
                "peak MiB"]
        rows = []
        for a, m in models.items():
            kv = kv_cache_bytes_per_token(m.config.to_dict())
            cells = [a, f"{m.num_parameters():,}", f"{kv:,}"]
            for times in (train, decode):
                cells.append(f"{statistics.median(times[a]):.4f}")
                if a == "source":
                    cells.append("1")
                else:
                    med, lo, hi = median_interval([t / s for t, s in zip(times[a], times["source"])])
                    cells.append(f"{med:.3f}" + (f" [{lo:.3f}, {hi:.3f}]" if lo is not None else ""))
            cells.append(f"{peak[a]:.1f}")
            rows.append(cells)
        widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
        for r in [head, ["-" * w for w in widths], *rows]:
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
