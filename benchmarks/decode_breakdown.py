"""Where a DIFF decoding step spends its time beyond its baseline's: a cost breakdown.

Usage:
    python benchmarks/decode_breakdown.py                      # T = 128, batch 1, 200 rounds
    python benchmarks/decode_breakdown.py --seq-len 1024 --batch 8 --rounds 100

One decoding step of the 2-layer model of ``difftx bench --decode`` (D = 512, H = 4, float32, one
thread, this process's CPU time), DIFF against its baseline with PyTorch's SDPA, and DIFF with parts
of its attention replaced by what the baseline does, all alternating round by round:

- ``diff``: DIFF as shipped (``backend="auto"``: the ``eager`` kernel for one query row);
- ``diff, sdpa-cost core``: the attention core replaced by the baseline's single SDPA call on DIFF's
  tensors (its ``2H`` query sub-heads against its ``2Hkv`` key sub-heads and ``2Hkv`` value halves,
  the output regrouped into ``H`` heads of ``2d``). **Wrong values**: a cost probe, not attention;
- ``... without head norm``: also the per-head RMSNorm skipped (only the ``1 - lambda_init`` scale);
- ``... and a constant lambda``: also lambda taken as a fixed tensor instead of the module's cached value.

What is left between the last row and the baseline is the rest of DIFF's module (the split value cache,
views). Each row gives DIFF's tokens/s as a share of the baseline's: the median of the round-by-round
ratios with its distribution-free 95% interval. The probes patch the library for the duration of one
call and restore it; nothing here is used outside this script.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time

import torch

from difftx.attention import kernels, modules
from difftx.bench import _time_alternating
from difftx.config import ModelConfig, baseline_config
from difftx.model import KVCache, Transformer


def _sdpa_cost(q, k, v, lam, mask, scale, return_maps=False):
    """The baseline's SDPA call on DIFF's tensors (wrong values, the baseline's cost)."""
    B, T, d = q.shape[0], q.shape[1], k.shape[-1]
    # the value halves as 2*Hkv heads of width d (split cache rows, or whole 2d rows cut in two)
    v = v.flatten(2, 3) if v.dim() == 5 else v.unflatten(-1, (-1, d)).flatten(2, 3)
    out = kernels.sdpa(q, k, v, None, mask, scale)  # (B, T, 2H, d)
    return out.reshape(B, T, out.shape[2] // 2, 2 * d)


_sdpa_cost.split_values = True
PROBE = "sdpa_cost_probe"  # registered for one run of main()


@contextlib.contextmanager
def _patched(norm: bool, lam: bool):
    """Skip the per-head norm (``norm=False``) and/or use a constant lambda (``lam=False``) inside."""
    saved = modules.DiffAttention.head_norm, modules.DiffAttention.lambda_full
    const = torch.tensor(0.5)
    if not norm:
        modules.DiffAttention.head_norm = lambda self, o: o * self.out_scale
    if not lam:
        modules.DiffAttention.lambda_full = lambda self: const
    try:
        yield
    finally:
        modules.DiffAttention.head_norm, modules.DiffAttention.lambda_full = saved


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=128, help="tokens in the KV cache (default 128)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--rounds", type=int, default=200, help="timed rounds (default 200)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    kernels.register_backend(PROBE, _sdpa_cost)
    try:
        return _run(args)
    finally:
        kernels.BACKENDS.pop(PROBE, None)  # the probe is never left selectable


def _run(args) -> int:
    T, B = args.seq_len, args.batch
    cfg = ModelConfig(vocab_size=256, dim=512, n_layers=2, n_heads=4, attention="diff", max_seq_len=T + 1)
    torch.manual_seed(0)
    diff, base = Transformer(cfg).eval(), Transformer(baseline_config(cfg)).eval()
    prompt, nxt = torch.randint(0, 256, (B, T)), torch.randint(0, 256, (B, 1))
    caches = {}
    with torch.no_grad():
        for m in (diff, base):
            caches[id(m)] = KVCache(m, B, T + 1)
            m(prompt, cache=caches[id(m)])
    variants = {  # name: (model, backend, keep the norm, keep lambda)
        "baseline/sdpa": (base, "sdpa", True, True),
        "diff": (diff, "auto", True, True),
        "diff, sdpa-cost core": (diff, PROBE, True, True),
        "... without head norm": (diff, PROBE, False, True),
        "... and a constant lambda": (diff, PROBE, False, False),
    }

    def step(name: str) -> None:
        model, backend, norm, lam = variants[name]
        caches[id(model)].length = T
        with torch.no_grad(), _patched(norm, lam):
            model(nxt, cache=caches[id(model)], backend=backend)

    print(f"# decode step, 2 layers, D=512, H=4, T={T}, batch {B}, {args.rounds} rounds, CPU time, 1 thread")
    rows = _time_alternating({n: (lambda n=n: step(n)) for n in variants}, T, "decode", args.rounds, 5,
                             torch.device("cpu"), time.process_time, False, {})
    print("| variant | ms | tokens/s vs baseline/sdpa [95%] |")
    print("|---|---:|---|")
    for r in rows:
        ci = "-" if r.paired_low is None else f"{1 / r.paired:.3f} [{1 / r.paired_high:.3f}, {1 / r.paired_low:.3f}]"
        print(f"| {r.name} | {r.ms:.3f} | {ci} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
