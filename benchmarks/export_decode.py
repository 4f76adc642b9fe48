"""What serving an exported model costs in transformers: the decode step of exported difftx models beside Llama's,
measured side by side in one run.

Usage:
    python benchmarks/export_decode.py                                 # 4 layers, width 256, 8 heads, 4 kv groups
    python benchmarks/export_decode.py --dim 512 --layers 4 --prompt 1024 --tokens 32 --rounds 12

Every arm is a folder loaded with ``transformers.AutoModelForCausalLM.from_pretrained`` (float32, eval mode, one
thread, ``trust_remote_code=True`` where difftx wrote the modeling code), in two pairs:

- ``llama``: a random ``LlamaForCausalLM`` (the source), and ``mirror (remote code)``: its ``difftx convert
  --method mirror`` conversion exported by ``difftx export`` (difftx's ``DifftxForCausalLM``, the same function
  with the second map's cost);
- ``baseline (Llama)``: a random difftx ``standard`` model, the parameter-matched baseline of the next, exported as
  ``LlamaForCausalLM``; ``diff (DiffLlama)``: a random difftx ``diff`` model exported as transformers'
  ``DiffLlamaForCausalLM``; ``diff (remote code)``: the same model exported with difftx's own modeling code.

A round times, per arm, ``--tokens`` greedy decoding steps with the KV cache (``model(next, past_key_values=...)``,
batch 1) after a ``--prompt``-token prefill (not timed), in CPU seconds per token; the arms' order alternates
between rounds (ABBA). Each pair's ratio is the median of the per-round ratios to its first arm with a
distribution-free 95% interval (:func:`difftx.eval.stats.median_interval`); tokens/s as a share of the first arm is
its inverse. Measured: docs/results.md ("What serving costs").
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import tempfile
import time
from pathlib import Path

import torch

from difftx.checkpoint import save_model
from difftx.config import ModelConfig, baseline_config
from difftx.eval.stats import median_interval
from difftx.interop.convert import convert_model
from difftx.interop.hf import export_hf
from difftx.model import Transformer


def _folders(tmp: Path, args) -> dict[str, tuple[str, str]]:
    """``{arm: (folder, reference arm)}``: every arm written under ``tmp``."""
    import transformers

    torch.manual_seed(0)
    shape = dict(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.dim * 8 // 3,
                 num_hidden_layers=args.layers, num_attention_heads=2 * args.heads,
                 num_key_value_heads=2 * args.kv_heads, max_position_embeddings=args.prompt + args.tokens + 1)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).save_pretrained(tmp / "llama")
    convert_model(tmp / "llama", tmp / "mirror", method="mirror")
    export_hf(tmp / "mirror", tmp / "mirror-hf")
    cfg = ModelConfig(vocab_size=args.vocab, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                      n_kv_heads=args.kv_heads, max_seq_len=args.prompt + args.tokens + 1, attention="diff")
    for name, c in (("diff", cfg), ("baseline", baseline_config(cfg))):
        save_model(Transformer(c), tmp / name)
    export_hf(tmp / "baseline", tmp / "baseline-hf")
    export_hf(tmp / "diff", tmp / "diff-hf")
    export_hf(tmp / "diff", tmp / "diff-remote", remote_code=True)
    return {"llama": (str(tmp / "llama"), "llama"), "mirror (remote code)": (str(tmp / "mirror-hf"), "llama"),
            "baseline (Llama)": (str(tmp / "baseline-hf"), "baseline (Llama)"),
            "diff (DiffLlama)": (str(tmp / "diff-hf"), "baseline (Llama)"),
            "diff (remote code)": (str(tmp / "diff-remote"), "baseline (Llama)")}


def _decode_seconds(model, prompt: torch.Tensor, tokens: int) -> float:
    """CPU seconds per greedy cached decoding step after prefilling ``prompt`` (the cache passed as ``cache`` where
    the forward takes it, transformers 5's name, else as ``past_key_values``)."""
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache, nxt = getattr(out, name), out.logits[:, -1:].argmax(-1)
        t0 = time.process_time()
        for _ in range(tokens):
            out = model(nxt, use_cache=True, **{name: cache})
            cache, nxt = getattr(out, name), out.logits[:, -1:].argmax(-1)
        return (time.process_time() - t0) / tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4, help="differential heads (Llama and the baseline get twice as "
                                                        "many); default 4")
    ap.add_argument("--kv-heads", type=int, default=2, help="differential kv groups (default 2)")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--prompt", type=int, default=256, help="tokens in the cache before the timed steps")
    ap.add_argument("--tokens", type=int, default=32, help="timed decoding steps per round and arm")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    if min(args.dim, args.layers, args.heads, args.kv_heads, args.prompt, args.tokens, args.rounds) < 1:
        raise SystemExit("every size must be positive")
    torch.set_num_threads(args.threads)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    with tempfile.TemporaryDirectory() as tmp:
        folders = _folders(Path(tmp), args)
        models = {a: transformers.AutoModelForCausalLM.from_pretrained(f, trust_remote_code=True,
                                                                       dtype=torch.float32).eval()
                  for a, (f, _) in folders.items()}
        prompt = torch.randint(0, args.vocab, (1, args.prompt), generator=torch.Generator().manual_seed(1))
        for m in models.values():  # warm-up: allocator, kernels
            _decode_seconds(m, prompt, 2)
        times: dict[str, list[float]] = {a: [] for a in models}
        order = list(models)
        for r in range(args.rounds):
            for a in (order if r % 2 == 0 else order[::-1]):
                times[a].append(_decode_seconds(models[a], prompt, args.tokens))
    print(f"decode in transformers {transformers.__version__}, torch {torch.__version__}: width {args.dim}, "
          f"{args.layers} layers, {2 * args.heads} heads of {args.dim // (2 * args.heads)} ({args.heads} differential), "
          f"{2 * args.kv_heads} kv heads; batch 1, {args.prompt}-token prompt, {args.tokens} steps x {args.rounds} "
          f"rounds (ABBA), {args.threads} thread(s), CPU clock\n")
    print("| arm | ms per token | step / reference [95%] | tokens/s / reference |")
    print("|---|---:|---|---:|")
    for a, (_, ref) in folders.items():
        med, lo, hi = median_interval([t / s for t, s in zip(times[a], times[ref])])
        ci = f" [{lo:.3f}, {hi:.3f}]" if lo is not None else ""
        print(f"| {a} | {statistics.median(times[a]) * 1e3:.3f} | {med:.3f}{ci} (vs {ref}) | {1 / med:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
