"""Language-modelling metrics (SPEC section 5): token NLL, bits per byte, NLL by position
(also beyond the training length) and the AR-hit split of paper Table 6.

Conventions, defined once here:

- NLL is the natural-log cross-entropy of each *predicted* token (nats): a window of ``T+1``
  tokens gives ``T`` predictions, token ``t+1`` from tokens ``0..t``.
- Bits per byte: ``sum(NLL) / (ln 2 * n_bytes)`` where ``n_bytes`` is the UTF-8 size of the
  predicted text. With a constant ``bytes_per_token = n_bytes / n_tokens`` of the evaluated
  text (1.0 for a byte-level vocabulary) this is ``mean_nll / (ln 2 * bytes_per_token)``.
- AR-hit: predicted token ``x[t]`` (``t >= 1``) is an AR-hit when the bigram
  ``(x[t-1], x[t])`` already occurred at some earlier ``(x[s-1], x[s])``, ``s < t``, of the
  same window (the "associative recall" tokens of Zoology / paper Table 6).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..io import eval_mode


def bits_per_byte(mean_nll: float, bytes_per_token: float) -> float:
    """Bits per byte from the mean token NLL (nats) and the text's bytes per token."""
    if bytes_per_token <= 0:
        raise ValueError(f"bytes_per_token must be positive, got {bytes_per_token}")
    return mean_nll / (math.log(2) * bytes_per_token)


def bytes_per_token(text: str, n_tokens: int) -> float:
    """UTF-8 bytes per token of ``text`` tokenised into ``n_tokens`` tokens."""
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be positive, got {n_tokens}")
    return len(text.encode("utf-8")) / n_tokens


@torch.no_grad()
def token_nll(model: torch.nn.Module, windows: Tensor, *, backend: Optional[str] = None) -> Tensor:
    """Per-token NLL (nats) ``(B, T)`` of ``windows`` ``(B, T+1)``: entry ``t`` is the loss of
    ``windows[:, t+1]`` given ``windows[:, :t+1]``."""
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be (batch, time >= 2), got shape {tuple(windows.shape)}")
    with eval_mode(model):
        logits = model(windows[:, :-1], backend=backend).float()  # (B, T, V)
    nll = F.cross_entropy(logits.flatten(0, 1), windows[:, 1:].flatten(), reduction="none")
    return nll.view(windows.shape[0], -1)  # (B, T)


def ar_hit_mask(windows: Tensor) -> Tensor:
    """Boolean ``(B, T)`` aligned with :func:`token_nll`: entry ``t`` is True when predicted
    token ``windows[:, t+1]`` completes a bigram already seen earlier in its window."""
    if windows.dim() != 2:
        raise ValueError(f"windows must be (batch, time), got shape {tuple(windows.shape)}")
    B, L = windows.shape
    out = torch.zeros(B, max(L - 1, 0), dtype=torch.bool)
    rows = windows.tolist()
    for b, row in enumerate(rows):
        seen: set[tuple[int, int]] = set()
        for t in range(1, L):
            bigram = (row[t - 1], row[t])
            if bigram in seen:
                out[b, t - 1] = True
            seen.add(bigram)
    return out


@dataclass
class LMResult:
    """Language-modelling metrics of one model on one set of windows."""

    nll: float  # mean token NLL, nats
    bpb: float  # bits per byte
    perplexity: float
    n_tokens: int
    window: int  # predictions per window
    nll_by_position: list[float]  # mean NLL of prediction t, t = 0..window-1
    ar_hit_nll: Optional[float]  # mean NLL over AR-hit tokens (None if there are none)
    other_nll: Optional[float]
    ar_hit_fraction: float
    bytes_per_token: float = 1.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def windows_from_stream(tokens: Sequence[int] | Tensor, window: int, max_windows: Optional[int] = None) -> Tensor:
    """Non-overlapping windows ``(N, window+1)`` cut from a 1-D token stream (the tail that does
    not fill a window is dropped). Consecutive windows share their boundary token."""
    t = torch.as_tensor(tokens, dtype=torch.long).flatten()
    n = (t.numel() - 1) // window
    if max_windows is not None:
        n = min(n, max_windows)
    if n <= 0:
        raise ValueError(f"the token stream ({t.numel()} tokens) is shorter than one window of {window + 1}")
    idx = torch.arange(n)[:, None] * window + torch.arange(window + 1)[None]  # (N, window+1)
    return t[idx]


def spread_windows(stream: torch.Tensor, seq_len: int, n: int,
                   overlap: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Windows of ``seq_len`` predictions (``seq_len + 1`` tokens) from a 1-D stream.

    ``n > 0``: ``n`` windows with starts spread evenly over the whole stream, no tail. They never
    predict a token twice: when ``n`` disjoint windows do not fit, there are only as many as fit
    (``(len - 1) // seq_len``), unless ``overlap`` allows windows that share predicted tokens.
    ``n == 0``: consecutive windows sharing their boundary token, so every token after the first is
    predicted exactly once, and the shorter ``tail`` window that is left (``None`` if nothing is).
    Returns ``(windows (N, seq_len + 1), tail (1, m + 1) or None)``."""
    L = stream.numel()
    if n > 0:
        return torch.stack([stream[s:s + seq_len + 1] for s in window_starts(L, seq_len, n, overlap)]), None
    full = (L - 1) // seq_len
    windows = stream[:full * seq_len + 1].unfold(0, seq_len + 1, seq_len) if full else \
        stream.new_zeros((0, seq_len + 1))
    rest = stream[full * seq_len:]
    return windows, (rest[None] if rest.numel() >= 2 else None)


def window_starts(length: int, seq_len: int, n: int, overlap: bool = False) -> list[int]:
    """Starts of :func:`spread_windows`' ``n > 0`` windows in a stream of ``length`` tokens."""
    if length < seq_len + 1:
        raise ValueError(f"the held-out stream ({length} tokens) is shorter than one window of {seq_len + 1}")
    last = length - seq_len - 1
    count = min(n, last + 1 if overlap else (length - 1) // seq_len)
    return [round(i * last / max(count - 1, 1)) for i in range(count)] if count > 1 else [0]


def distinct_predictions(starts: Sequence[int], seq_len: int) -> int:
    """How many distinct tokens windows starting at ``starts`` predict (``start + 1 .. start + seq_len``)."""
    covered, end = 0, -1
    for s in sorted(starts):
        covered += max(0, s + seq_len - max(s, end))
        end = max(end, s + seq_len)
    return covered


def summarize_nll(nll: Tensor, hits: Tensor, bytes_per_token_: float = 1.0) -> LMResult:
    """Metrics from per-token NLL ``(N, T)`` and the AR-hit mask ``(N, T)`` of the same windows."""
    if nll.shape != hits.shape:
        raise ValueError(f"nll {tuple(nll.shape)} and AR-hit mask {tuple(hits.shape)} must have the same shape")
    mean = float(nll.mean())
    n_hit = int(hits.sum())
    n_other = hits.numel() - n_hit
    return LMResult(
        nll=mean, bpb=bits_per_byte(mean, bytes_per_token_), perplexity=math.exp(min(mean, 700.0)),
        n_tokens=nll.numel(), window=nll.shape[1], nll_by_position=nll.mean(0).tolist(),
        ar_hit_nll=float(nll[hits].mean()) if n_hit else None,
        other_nll=float(nll[~hits].mean()) if n_other else None,
        ar_hit_fraction=n_hit / max(nll.numel(), 1), bytes_per_token=bytes_per_token_,
    )


def evaluate_lm(model: torch.nn.Module, windows: Tensor, *, bytes_per_token: float = 1.0, batch_size: int = 8,
                backend: Optional[str] = None, progress: bool = False) -> LMResult:
    """Token NLL, bits per byte, NLL by position and the AR-hit split over ``windows`` ``(N, T+1)``."""
    if windows.dim() != 2 or windows.shape[1] < 2:
        raise ValueError(f"windows must be (n, time >= 2), got shape {tuple(windows.shape)}")
    nll = batched_token_nll(model, windows, batch_size, backend=backend, progress=progress)
    return summarize_nll(nll, ar_hit_mask(windows), bytes_per_token)


def batched_token_nll(model: torch.nn.Module, windows: Tensor, batch_size: int = 8, *, backend: Optional[str] = None,
                      progress: bool = False, desc: str = "lm eval") -> Tensor:
    """:func:`token_nll` of ``windows`` ``(N, T+1)`` in batches of ``batch_size`` windows: ``(N, T)`` on the CPU
    (``desc``: the progress bar's label)."""
    from tqdm.auto import tqdm

    device = next(model.parameters()).device
    # one output filled batch by batch: keeping each batch's small result instead pins the heap memory of the
    # large temporaries freed around it (measured: about 1 MB of resident memory per batch of 8 windows of 128)
    out = torch.empty((windows.shape[0], max(windows.shape[1] - 1, 0)), dtype=torch.float32)
    for i in tqdm(range(0, windows.shape[0], batch_size), desc=desc, disable=not progress, leave=False):
        out[i:i + batch_size].copy_(token_nll(model, windows[i:i + batch_size].to(device), backend=backend))
    return out


def length_extrapolation(model: torch.nn.Module, stream: Sequence[int] | Tensor, train_len: int, *,
                         factors: Sequence[int] = (1, 2, 4), max_windows: int = 16, bytes_per_token: float = 1.0,
                         batch_size: int = 4, backend: Optional[str] = None,
                         progress: bool = False) -> dict[int, LMResult]:
    """NLL by position at ``factor * train_len`` context for each factor (paper Fig. 4 style).

    One pass over windows of ``max(factors) * train_len`` predictions (at most ``max_windows``,
    cut from ``stream``): with causal attention the first ``f * train_len`` predictions of a
    window are exactly those of a window of that length with the same start, so every factor
    is scored on the same text. The windows' starts are spread evenly over the whole stream
    (every part of a multi-work held-out text is represented). ``result[f].extra`` holds the mean
    NLL within the training length and beyond it (``f > 1``).
    """
    for f in factors:
        if not isinstance(f, int) or f <= 0:
            raise ValueError(f"factors: must be positive integers, got {f!r}")
    w, _ = spread_windows(torch.as_tensor(stream, dtype=torch.long).flatten(), max(factors) * train_len, max_windows)
    nll = batched_token_nll(model, w, batch_size, backend=backend, progress=progress, desc="length extrapolation")
    hits = ar_hit_mask(w)  # (N, max_factor * train_len)
    out: dict[int, LMResult] = {}
    for f in sorted(factors):
        n = f * train_len
        res = summarize_nll(nll[:, :n], hits[:, :n], bytes_per_token)
        res.extra["factor"] = f
        res.extra["nll_within_train_len"] = float(nll[:, :train_len].mean())
        if f > 1:
            res.extra["nll_beyond_train_len"] = float(nll[:, train_len:n].mean())
        out[f] = res
    return out


def binned(values: Sequence[float], n_bins: int) -> list[float]:
    """Means of ``values`` over ``n_bins`` contiguous, nearly equal bins (for plotting long curves)."""
    v = torch.as_tensor(list(values), dtype=torch.float64)
    n_bins = max(1, min(n_bins, v.numel()))
    return [float(c.mean()) for c in torch.tensor_split(v, n_bins)]
