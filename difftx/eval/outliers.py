"""Activation outliers (SPEC section 5; paper Table 5).

Over a fixed token budget, the magnitudes of (1) the scaled pre-softmax attention logits
of every layer (both maps for DIFF; masked entries excluded) and (2) the hidden states (each
block's output, every element) are summarised as the k-th largest value for
``k = 1, 2, 3, 10, 100``, the median, and top-1 / median.

The top-k are exact. The median is exact while at most ``sample_size`` values were seen, and
otherwise the median of a uniform random sample of that many values (seeded, so repeatable).
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np
import torch
from torch import Tensor

from ..io import eval_mode
from .capture import AttentionCapture, CapturedMaps

DEFAULT_KS: tuple[int, ...] = (1, 2, 3, 10, 100)


class MagnitudeStats:
    """Streaming top-k and median of ``|values|``; feed tensors with :meth:`update`."""

    def __init__(self, ks: Sequence[int] = DEFAULT_KS, sample_size: int = 2_000_000, seed: int = 0):
        if not ks or any(k <= 0 for k in ks):
            raise ValueError(f"ks: must be positive integers, got {list(ks)}")
        self.ks, self.sample_size = tuple(ks), sample_size
        self.top = torch.empty(0)
        self.sample = torch.empty(0)
        self.sample_keys = torch.empty(0)
        self.count = 0
        self.gen = torch.Generator().manual_seed(seed)

    def update(self, values: Tensor) -> None:
        v = values.detach().float().flatten().abs().cpu()
        v = v[torch.isfinite(v)]
        if v.numel() == 0:
            return
        self.count += v.numel()
        k = min(max(self.ks), v.numel() + self.top.numel())
        self.top = torch.topk(torch.cat([self.top, v]), k).values
        # uniform sample without replacement: keep the values with the smallest random keys
        keys = torch.rand(v.numel(), generator=self.gen)
        allv, allk = torch.cat([self.sample, v]), torch.cat([self.sample_keys, keys])
        if allv.numel() > self.sample_size:
            idx = torch.topk(allk, self.sample_size, largest=False).indices
            allv, allk = allv[idx], allk[idx]
        self.sample, self.sample_keys = allv, allk

    def result(self) -> dict[str, float]:
        """``{"top1": .., "top2": .., ..., "median": .., "top1_over_median": .., "count": n}``."""
        if self.count == 0:
            raise ValueError("no finite values were seen")
        out = {f"top{k}": float(self.top[k - 1]) if k <= self.top.numel() else math.nan for k in self.ks}
        med = float(np.median(self.sample.double().numpy()))  # mean of the two middle values when even
        out["median"] = med
        out["top1_over_median"] = float(self.top[0]) / med if med > 0 else math.inf
        out["count"] = self.count
        out["median_exact"] = self.count <= self.sample_size
        return out


def magnitude_stats(values: Tensor, ks: Sequence[int] = DEFAULT_KS) -> dict[str, float]:
    """Exact :class:`MagnitudeStats` of one tensor (non-finite entries ignored)."""
    s = MagnitudeStats(ks, sample_size=max(values.numel(), 1))
    s.update(values)
    return s.result()


@torch.no_grad()
def activation_outliers(model: torch.nn.Module, windows: Tensor, *, token_budget: Optional[int] = None,
                        batch_size: int = 4, ks: Sequence[int] = DEFAULT_KS, sample_size: int = 2_000_000,
                        seed: int = 0, progress: bool = False) -> dict[str, dict[str, float]]:
    """Outlier statistics of ``|attention logits|`` and ``|hidden states|`` over ``windows``
    ``(N, T)`` (cut to ``token_budget`` tokens: whole windows, at least one)."""
    from tqdm.auto import tqdm

    if windows.dim() != 2:
        raise ValueError(f"windows must be (n, time), got shape {tuple(windows.shape)}")
    if token_budget is not None:
        windows = windows[: max(1, token_budget // windows.shape[1])]
    logit_stats = MagnitudeStats(ks, sample_size, seed)
    hidden_stats = MagnitudeStats(ks, sample_size, seed + 1)

    def on_maps(c: CapturedMaps) -> None:
        logit_stats.update(c.logits)  # -inf (masked) entries are dropped by update()

    device = next(model.parameters()).device
    with eval_mode(model):
        with AttentionCapture(model, store=False, callback=on_maps,
                              hidden_callback=lambda _layer, h: hidden_stats.update(h)):
            for i in tqdm(range(0, windows.shape[0], batch_size), desc="outliers", disable=not progress, leave=False):
                model(windows[i:i + batch_size].to(device))
    return {"attention_logits": logit_stats.result(), "hidden_states": hidden_stats.result(),
            "tokens": int(windows.numel())}
