"""Sampling with a KV cache: prefill once, then decode one token at a time.

Prompts of different lengths are left-padded; padding is masked out of attention and RoPE
positions count from each prompt's first real token, so a padded row produces the same
tokens as that prompt alone. Without the cache (``use_cache=False``, prompts of equal length)
every step re-runs the whole sequence.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Iterable, Mapping, Optional, Sequence, Union

import torch
from torch import Tensor

from .io import eval_mode
from .model import KVCache, StaticKVCache, Transformer


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: Optional[int] = None,
                top_p: Optional[float] = None, generator: Optional[torch.Generator] = None) -> Tensor:
    """Next token ids ``(B,)`` from last-position logits ``(B, V)``; ``temperature == 0`` is greedy."""
    check_sampling(temperature, top_k, top_p)
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    # shifted by each row's largest logit first: the same distribution, and a tiny temperature gives the greedy
    # token(s) (0 / t = 0, the rest -inf) rather than an overflow to inf and a NaN softmax; one below float32's
    # smallest normal number would round to 0 in the division (0 / 0)
    logits = (logits - logits.amax(dim=-1, keepdim=True)) / max(temperature, torch.finfo(torch.float32).tiny)
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


def check_sampling(temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None) -> None:
    """ValueError naming the argument unless ``temperature`` is a finite number >= 0, ``top_k`` a
    positive integer and ``top_p`` in (0, 1] (``None``: not used)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real) \
            or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral) or top_k <= 0):
        raise ValueError(f"top_k must be a positive integer, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, numbers.Real)
                              or not 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


class CacheTooLargeError(ValueError):
    """The KV cache a generation asks for would not fit in the memory available."""


def kv_cache_bytes(model: Transformer, batch_size: int, length: int) -> int:
    """Bytes of the :class:`KVCache` that ``batch_size`` rows of ``length`` positions take."""
    per_position = 0
    for block in model.layers:
        (kh, kd), (vh, vd) = block.attn.cache_shapes()
        per_position += kh * kd + vh * vd
    return batch_size * length * per_position * next(model.parameters()).element_size()


def available_memory(device: torch.device | str) -> Optional[int]:
    """Bytes that can still be allocated on ``device``, as far as can be told cheaply (free GPU
    memory; on the host the least of MemAvailable, the cgroup limit and the address-space
    limit); ``None`` when unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        try:
            return int(torch.cuda.mem_get_info(device)[0])
        except (RuntimeError, AssertionError):
            return None
    if device.type != "cpu":
        return None
    found = []
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        try:
            found.append(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        except (AttributeError, ValueError, OSError):
            pass
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit.isdigit():
            with open("/sys/fs/cgroup/memory.current") as f:
                found.append(int(limit) - int(f.read().strip()))
    except (OSError, ValueError):
        pass
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_AS)[0]
        if soft != resource.RLIM_INFINITY:
            found.append(soft)  # an upper bound: part of it is already in use
    except (ImportError, OSError, ValueError):
        pass
    return min(found) if found else None


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


def check_cache_fits(model: Transformer, batch_size: int, length: int, what: str) -> None:
    """:class:`CacheTooLargeError` when the KV cache of ``batch_size`` x ``length`` positions
    would take more than 80% of the memory available on the model's device (``what`` says
    which request it is, for the message)."""
    need = kv_cache_bytes(model, batch_size, length)
    device = next(model.parameters()).device
    avail = available_memory(device)
    if avail is not None and need > 0.8 * avail:
        raise CacheTooLargeError(f"{what}: the KV cache of {batch_size} x {length:,} positions would take "
                                 f"{_fmt_bytes(need)}, more than the {_fmt_bytes(avail)} of memory available on "
                                 f"{device.type}; ask for fewer tokens")


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


def _append(out: list[list[int]], done: Tensor, nxt: Tensor, stops: set) -> bool:
    """Add each unfinished row's next token ``nxt[i]`` to ``out[i]``, marking rows that emitted a
    stop token done; whether every row is done."""
    for i, t in enumerate(nxt.tolist()):
        if not done[i]:
            out[i].append(t)
            if t in stops:
                done[i] = True
    return bool(done.all())


@torch.no_grad()
def generate(model: Transformer, prompts: Union[Sequence[Sequence[int]], Tensor], max_new_tokens: int = 64, *,
             temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
             stop_tokens: Union[Iterable[int], int] = (), seed: Optional[int] = None, pad_id: int = 0,
             backend: Optional[str] = None, use_cache: bool = True, static_cache: bool = False,
             compile: Union[bool, Mapping] = False) -> list[list[int]]:
    """Continue each prompt by up to ``max_new_tokens`` tokens; returns only the new tokens.

    ``prompts``: lists of token ids, or a ``(B, T)`` tensor of them (one prompt a row).
    A row stops after emitting a token in ``stop_tokens`` (one id or several; that token is kept). ``seed``
    makes sampling reproducible; ``temperature=0`` decodes greedily. ``use_cache=False``
    re-runs the whole sequence each step (prompts of equal length only; ``model`` may then be any
    module mapping tokens ``(B, T)`` to logits ``(B, T, V)``): a kernel whose result depends on the
    number of query rows per call (per-tensor logit quantisation) then sees the same rows as a
    full forward.

    ``static_cache=True`` decodes with a :class:`~difftx.model.StaticKVCache`: every step has the same shapes and
    graph (the cache position a tensor, attention over the whole preallocated buffer with the keys beyond it
    masked), the same tokens as the ordinary cache. ``compile=True`` (static cache only) runs that step under
    ``torch.compile(fullgraph=True, dynamic=False)``, on CUDA with ``mode="reduce-overhead"`` (CUDA graphs: no
    per-op launch cost); a mapping gives torch.compile keywords instead (``{"backend": "aot_eager"}``). The
    compiled step serves every position; the cache length is then rounded up to a multiple of
    :data:`STATIC_LENGTH_MULTIPLE`, so that calls of similar lengths share one graph. Backends: ``auto`` (which
    is ``eager`` there), ``eager``, ``sdpa`` and its forms; kinds: those whose forward is AttentionKind's.
    """
    if isinstance(prompts, Tensor):  # token ids (B, T): one prompt a row
        if prompts.dim() != 2 or prompts.is_floating_point() or prompts.is_complex():
            raise ValueError(f"prompts: a tensor of prompts must hold integer token ids (B, T), one prompt a row; "
                             f"got {prompts.dtype} of shape {tuple(prompts.shape)}")
        prompts = prompts.tolist()
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be an integer >= 0, got {max_new_tokens!r}")
    check_sampling(temperature, top_k, top_p)
    if compile is not False and not static_cache:
        raise ValueError("compile: compiled decoding needs static_cache=True (the ordinary cache's step changes "
                         "shape at every position)")
    if static_cache and not use_cache:
        raise ValueError("static_cache: needs use_cache=True")
    if static_cache:
        from .decode import check_static

        check_static(model, backend)
    if not use_cache and len({len(p) for p in prompts}) > 1:
        raise ValueError("generate(use_cache=False) needs prompts of equal length")
    device = next(model.parameters()).device
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    for p in prompts if vocab is not None else ():
        bad = [t for t in p if not 0 <= int(t) < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    tokens, mask = left_pad(prompts, pad_id, device)
    B, P = tokens.shape
    gen = None
    if seed is not None:
        gen = torch.Generator(device=device)
        gen.manual_seed(seed)
    stops = {int(stop_tokens)} if isinstance(stop_tokens, numbers.Integral) else set(int(t) for t in stop_tokens)
    out: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=device)
    if not use_cache:
        with eval_mode(model):
            run = (lambda t: model(t)) if backend is None else (lambda t: model(t, backend=backend))  # any module
            logits = run(tokens)
            for step in range(max_new_tokens):
                nxt = sample_next(logits[:, -1], temperature, top_k, top_p, gen)  # (B,)
                if _append(out, done, nxt, stops) or step == max_new_tokens - 1:
                    break
                tokens = torch.cat([tokens, nxt[:, None]], dim=1)
                logits = run(tokens)
        return out
    length = P + max_new_tokens
    if static_cache and compile is not False:
        length = -(-length // STATIC_LENGTH_MULTIPLE) * STATIC_LENGTH_MULTIPLE
    check_cache_fits(model, B, length, f"max_new_tokens={max_new_tokens} (after prompts of up to {P} tokens)")
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # (B, P): RoPE positions from each first real token
    if static_cache:
        return _generate_static(model, tokens, mask, positions, length, max_new_tokens, out, done, stops,
                                (temperature, top_k, top_p, gen), backend, compile)
    cache = KVCache(model, B, length)
    with eval_mode(model):
        logits = model(tokens, positions=positions, attention_mask=mask, cache=cache, backend=backend)
        next_pos = positions[:, -1:] + 1  # (B, 1)
        for step in range(max_new_tokens):
            nxt = sample_next(logits[:, -1], temperature, top_k, top_p, gen)  # (B,)
            if _append(out, done, nxt, stops) or step == max_new_tokens - 1:
                break
            mask = torch.cat([mask, torch.ones(B, 1, dtype=mask.dtype, device=device)], dim=1)
            logits = model(nxt[:, None], positions=next_pos, attention_mask=mask, cache=cache, backend=backend)
            next_pos = next_pos + 1
    return out


# A compiled static decoder's cache length is rounded up to a multiple of this: generations of similar lengths
# then share one compiled graph (each length is a shape of its own), at the cost of attending over a few masked
# positions more.
STATIC_LENGTH_MULTIPLE = 64


def _generate_static(model: Transformer, tokens: Tensor, mask: Tensor, positions: Tensor, length: int,
                     max_new_tokens: int, out: list[list[int]], done: Tensor, stops: set, sampling: tuple,
                     backend: Optional[str], compile) -> list[list[int]]:
    """:func:`generate`'s loop on a :class:`StaticKVCache` (the prompt prefilled by the ordinary forward)."""
    from .decode import static_decoder

    B = tokens.shape[0]
    cache = StaticKVCache(model, B, length)
    with eval_mode(model):
        logits = cache.prefill(model, tokens, positions=positions, attention_mask=mask, backend=backend)[:, -1]
        step = static_decoder(model, cache, backend=backend, compile=compile)
        next_pos = positions[:, -1:] + 1  # (B, 1)
        for i in range(max_new_tokens):
            nxt = sample_next(logits, *sampling)  # (B,)
            if _append(out, done, nxt, stops) or i == max_new_tokens - 1:
                break
            logits = step(nxt[:, None], next_pos)
            next_pos = next_pos + 1
    return out
