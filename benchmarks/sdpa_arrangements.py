"""How to feed differential attention to stock SDPA kernels: the arrangements of SPEC section 6.

Times the attention *core* (forward + backward) of one DIFF layer's worth of heads against
the baseline's single causal SDPA call, alternating candidates in one run:

- unequal: one call, q/k width d, value width 2d (flash kernels refuse it: math path)
- four-call: each map against each d-wide value half (as 2x the sub-heads in one call)
- padded: one call over all 2H sub-heads, q and k zero-padded to 2d (what `sdpa` uses)
- chunked: difftx's blocked materialised kernel (the CPU default)

Usage: python benchmarks/sdpa_arrangements.py [--seq-len 1024] [--heads 4] [--d 64] [--repeats 7]
"""

import argparse
import math
import statistics
import time

import torch
import torch.nn.functional as F

from difftx.attention import AttentionMask, kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=4, help="differential heads H (baseline: 2H)")
    ap.add_argument("--d", type=int, default=64, help="component width d")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    B, T, H, d = 1, a.seq_len, a.heads, a.d
    torch.manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, requires_grad=True)

    q, k = leaf(B, 2 * H, T, d), leaf(B, 2 * H, T, d)  # (B, 2H, T, d), component-major
    v = leaf(B, H, T, 2 * d)  # (B, H, T, 2d)
    vb = leaf(B, 2 * H, T, d)  # baseline value
    lam = 0.5
    s = 1 / math.sqrt(d)

    def baseline():
        return F.scaled_dot_product_attention(q, k, vb, is_causal=True)

    def unequal():
        vv = v.repeat(1, 2, 1, 1)  # (B, 2H, T, 2d)
        o = F.scaled_dot_product_attention(q, k, vv, is_causal=True, scale=s)
        return o[:, :H] - lam * o[:, H:]

    def four_call():
        halves = v.view(B, H, T, 2, d).permute(3, 0, 1, 2, 4).repeat(1, 1, 2, 1, 1)  # (2, B, 2H, T, d)
        qq, kk = q.repeat(1, 2, 1, 1), k.repeat(1, 2, 1, 1)  # (B, 4H, T, d)
        o = F.scaled_dot_product_attention(qq, kk, halves.permute(1, 0, 2, 3, 4).reshape(B, 4 * H, T, d),
                                           is_causal=True, scale=s)
        return o.view(B, 2, 2, H, T, d)  # (B, value half, component, H, T, d)

    def padded():
        o = F.scaled_dot_product_attention(F.pad(q, (0, d)), F.pad(k, (0, d)), v.repeat(1, 2, 1, 1),
                                           is_causal=True, scale=s)
        return o[:, :H] - lam * o[:, H:]

    lam_t = torch.tensor(lam)

    def chunked():
        # kernels take (B, T, heads, d) with adjacent component pairs
        qa = q.view(B, 2, H, T, d).permute(0, 3, 2, 1, 4).reshape(B, T, 2 * H, d)
        ka = k.view(B, 2, H, T, d).permute(0, 3, 2, 1, 4).reshape(B, T, 2 * H, d)
        return kernels.chunked(qa, ka, v.transpose(1, 2), lam_t, AttentionMask(), s)

    cands = {"baseline (1 causal SDPA call, 2H heads)": baseline, "unequal widths (1 call)": unequal,
             "four-call (d-wide value halves)": four_call, "padded q/k to 2d (1 call)": padded,
             "difftx chunked": chunked}
    times = {n: [] for n in cands}
    for rep in range(a.repeats + 1):
        for name, fn in cands.items():
            t0 = time.perf_counter()
            fn().sum().backward()
            if rep:
                times[name].append(time.perf_counter() - t0)
    base = statistics.median(times["baseline (1 causal SDPA call, 2H heads)"])
    print(f"T={T} H={H} d={d}, fwd+bwd of the attention core, {torch.get_num_threads()} threads, "
          f"median of {a.repeats}")
    print("| arrangement | ms | / baseline |\n|---|---:|---:|")
    for name in cands:
        ms = statistics.median(times[name])
        print(f"| {name} | {ms * 1e3:.1f} | {ms / base:.2f} |")


if __name__ == "__main__":
    main()
