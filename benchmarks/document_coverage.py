"""Held-out intervals on text made of documents: blocks by position against blocks by document (issue 38, item 2).

A set of 22 documents (the lengths of 22 works of the bundled Shakespeare, one token per byte), each
with its own offset of the mean NLL (normal, SD ``--doc-sd``), and per-window NLL within a document
an AR(1) series (``--rho`` per window of 128 tokens, SD ``--window-sd``) that starts afresh in each
document. Each run draws K of the 22 documents without replacement, in a random order, scores them
(every token in consecutive windows, or ``--windows N`` windows spread over the text as
``difftx compare`` does) and computes the 95% interval of the mean NLL over blocks of windows:

- by position (``difftx.eval.blocks.block_bounds``): what the intervals were before;
- as chosen where the documents are known (``difftx.eval.blocks.units``): blocks of whole documents
  from 4 documents on ("over documents like these"); below 4, blocks by position and the estimand
  "over windows of this one text".

It prints how often each interval covers the 22-document mean (the token-weighted mean of the 22
documents' offsets: what "over documents like these" claims), and how often the chosen interval
covers what it claims when it is "over windows of this one text" (the token-weighted mean of the K
drawn documents' offsets). The target (issue 38): the chosen interval covers the 22-document mean in
at least 90% of runs at 4 and 8 documents, and no interval across documents is printed below 4.

    python benchmarks/document_coverage.py [--runs 2000] [--draws 2,4,8] [--windows 0]

About 30 s at the defaults on two cores.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from difftx.eval.blocks import block_bounds, block_interval, units

WINDOW = 128  # predictions per window
POPULATION = 22


def lengths_of_documents(count: int = POPULATION) -> np.ndarray:
    """Windows per document: the first ``count`` works of the bundled corpus, one token per byte
    (character counts: the corpus is plain ASCII), in windows of :data:`WINDOW`."""
    from difftx.data import bundled_manifest

    chars = np.array([d["chars"] for d in bundled_manifest()[:count]])
    return np.maximum(chars // WINDOW, 1)


def ar1_with_resets(rng: np.random.Generator, starts: np.ndarray, rho: float, sd: float) -> np.ndarray:
    """``(runs, T)`` AR(1) series with marginal SD ``sd`` that starts afresh (a stationary draw)
    wherever ``starts`` ``(runs, T)`` is True: independent documents."""
    runs, T = starts.shape
    e = rng.normal(size=(T, runs)) * (sd * np.sqrt(1 - rho ** 2))
    x = np.empty((T, runs))
    x[0] = e[0] / np.sqrt(1 - rho ** 2)
    fresh = starts.T
    for t in range(1, T):
        x[t] = np.where(fresh[t], e[t] / np.sqrt(1 - rho ** 2), rho * x[t - 1] + e[t])
    return x.T


def simulate(rng: np.random.Generator, lengths: np.ndarray, k: int, runs: int, *, doc_sd: float, window_sd: float,
             rho: float, windows: int = 0) -> dict:
    """``runs`` draws of ``k`` of the documents: coverage of the position and the chosen intervals."""
    n_docs = lengths.size
    hits = {"position": 0, "chosen": 0, "chosen_windows": 0}
    counts = {"chosen": 0, "chosen_documents": 0, "chosen_windows": 0, "position": 0}
    blocks = {"position": [], "chosen": []}
    chunk = 250
    for lo in range(0, runs, chunk):
        m = min(chunk, runs - lo)
        offsets = rng.normal(0, doc_sd, size=(m, n_docs))
        drawn = np.array([rng.choice(n_docs, size=k, replace=False) for _ in range(m)])
        per = lengths[drawn]  # (m, k) windows per drawn document
        total = per.sum(1)
        T = int(total.max())
        starts = np.zeros((m, T), dtype=bool)
        doc_of = np.full((m, T), -1)
        for r in range(m):
            bounds = np.concatenate([[0], np.cumsum(per[r])])
            starts[r, bounds[:-1]] = True
            doc_of[r, :total[r]] = np.repeat(drawn[r], per[r])
        noise = ar1_with_resets(rng, starts, rho, window_sd)
        for r in range(m):
            n = int(total[r])
            x = offsets[r, doc_of[r, :n]] + noise[r, :n]
            doc = doc_of[r, :n]
            place = np.arange(n) * WINDOW
            if windows:  # spread windows: the window whose start is nearest each of `windows` even starts
                pick = np.unique(np.rint(np.linspace(0, n - 1, min(windows, n))).astype(int))
                x, doc, place = x[pick], doc[pick], place[pick]
            tokens = np.full(x.size, WINDOW)
            doc_starts = (np.flatnonzero(np.diff(doc)) + 1).tolist()
            population = float((offsets[r] * lengths).sum() / lengths.sum())
            weights = lengths[drawn[r]]
            this_text = float((offsets[r, drawn[r]] * weights).sum() / weights.sum())
            by_position = block_interval(x, tokens, block_bounds(tokens, place))
            if by_position.low is not None:
                counts["position"] += 1
                blocks["position"].append(by_position.blocks)
                hits["position"] += by_position.low <= population <= by_position.high
            u = units(tokens, place, doc_starts=doc_starts)
            ci = block_interval(x, tokens, u.bounds)
            if ci.low is None:
                continue
            counts["chosen"] += 1
            blocks["chosen"].append(ci.blocks)
            if u.estimand == "documents":
                counts["chosen_documents"] += 1
                hits["chosen"] += ci.low <= population <= ci.high
            else:
                counts["chosen_windows"] += 1
                hits["chosen_windows"] += ci.low <= this_text <= ci.high
    return {"k": k, "runs": runs, "hits": hits, "counts": counts,
            "blocks": {key: float(np.mean(v)) if v else None for key, v in blocks.items()}}


def _rate(hits: int, count: int) -> str:
    if not count:
        return "-"
    se = np.sqrt(max(hits / count * (1 - hits / count), 1e-12) / count)
    return f"{hits / count:.3f} (+-{se:.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2000, help="draws per number of documents (default 2000)")
    ap.add_argument("--draws", default="2,4,8", help="documents drawn of the 22 (default 2,4,8)")
    ap.add_argument("--windows", default="0,512",
                    help="windows scored: 0 every token in consecutive windows, N spread windows (default 0,512)")
    ap.add_argument("--doc-sd", type=float, default=0.1, help="SD of the documents' offsets, nats (default 0.1)")
    ap.add_argument("--window-sd", type=float, default=0.3, help="SD of a window's NLL in a document (default 0.3)")
    ap.add_argument("--rho", type=float, default=0.3, help="lag-1 autocorrelation of windows (default 0.3)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lengths = lengths_of_documents()
    print(f"22 documents of {lengths.min() * WINDOW:,}-{lengths.max() * WINDOW:,} tokens (windows of {WINDOW}); "
          f"offsets SD {args.doc_sd}, windows AR(1) rho {args.rho}, SD {args.window_sd}; {args.runs} draws per row\n")
    print("| documents drawn | windows scored | blocks by position: covers the 22-document mean | chosen: estimand | "
          "chosen, over documents: covers the 22-document mean | chosen, over windows of this text: covers its own "
          "mean | mean blocks (position / chosen) |")
    print("|---|---|---|---|---|---|---|")
    took = 0.0
    for w in (int(x) for x in args.windows.split(",")):
        for k in (int(x) for x in args.draws.split(",")):
            t = time.perf_counter()
            res = simulate(np.random.default_rng(args.seed + 100 * k + w), lengths, k, args.runs, doc_sd=args.doc_sd,
                           window_sd=args.window_sd, rho=args.rho, windows=w)
            h, c, b = res["hits"], res["counts"], res["blocks"]
            which = ("over documents like these" if c["chosen_documents"] == c["chosen"] else
                     "over windows of this one text" if c["chosen_documents"] == 0 else "mixed")
            print(f"| {k} | {'every token' if w == 0 else f'{w} spread'} | {_rate(h['position'], c['position'])} | "
                  f"{which} ({c['chosen_documents']} of {c['chosen']} intervals across documents) | "
                  f"{_rate(h['chosen'], c['chosen_documents'])} | {_rate(h['chosen_windows'], c['chosen_windows'])} | "
                  f"{b['position'] or 0:.1f} / {b['chosen'] or 0:.1f} |")
            took += time.perf_counter() - t
    print(f"\n({took:.0f} s of simulation)")


if __name__ == "__main__":
    main()
