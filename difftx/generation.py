"""Sampling with a KV cache: prefill once, then decode one token at a time.

Prompts of different lengths are left-padded; padding is masked out of attention and RoPE
positions count from each prompt's first real token, so a padded row produces the same
tokens as that prompt alone.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

import torch
from torch import Tensor

from .model import KVCache, Transformer


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> Tensor:
    """Next token ids ``(B,)`` from last-position logits ``(B, V)``; ``temperature == 0`` is greedy."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise ValueError(f"top_k must be a positive integer, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        drop = probs.cumsum(-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int = 0, device=None) -> tuple[Tensor, Tensor]:
    """Tokens ``(B, P)`` and mask ``(B, P)`` (1 = real token) for prompts padded on the left."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    P = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), P), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros((len(prompts), P), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):
        tokens[i, P - len(p):] = torch.as_tensor(list(p), dtype=torch.long, device=device)
        mask[i, P - len(p):] = 1
    return tokens, mask


@torch.no_grad()
def generate(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int = 64, *,
             temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
             stop_tokens: Iterable[int] = (), seed: Optional[int] = None, pad_id: int = 0,
             backend: Optional[str] = None) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens; returns only the new tokens.

    A row stops after emitting a token in ``stop_tokens`` (that token is kept). ``seed``
    makes sampling reproducible; ``temperature=0`` decodes greedily.
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    for p in prompts:
        bad = [t for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    tokens, mask = left_pad(prompts, pad_id, device)
    B, P = tokens.shape
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
    stops = set(int(t) for t in stop_tokens)
    was_training = model.training
    model.eval()
    cache = KVCache(model, B, P + max_new_tokens)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P): RoPE positions from each first real token
    out: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    try:
        logits = model(tokens, positions=positions, attention_mask=mask, cache=cache, backend=backend)
        next_pos = positions[:, -1:] + 1  # (B, 1)
        for step in range(max_new_tokens):
            nxt = sample_next(logits[:, -1], temperature, top_k, top_p, gen)  # (B,)
            for i in range(B):
                if not done[i]:
                    out[i].append(int(nxt[i]))
                    if int(nxt[i]) in stops:
                        done[i] = True
            if bool(done.all()) or step == max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=device)], dim=1)
            logits = model(nxt[:, None], positions=next_pos, attention_mask=mask, cache=cache, backend=backend)
            next_pos = next_pos + 1
    finally:
        model.train(was_training)
    return out
