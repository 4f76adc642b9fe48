"""The decoder-only language model (SPEC section 3). DIFF and baseline share everything here;
only the attention module differs, picked by ``ModelConfig.attention``.

Legend: ``B`` batch, ``T`` new tokens, ``S`` cached + new tokens, ``D`` model width,
``V`` vocabulary.
"""

from __future__ import annotations

import math
import zlib
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .attention import ATTENTIONS, AttentionMask, LayerKV
from .config import ModelConfig
from .ops import embedding, head_loss, is_mapped, linear, rms_norm, swiglu


def make_attention(config: ModelConfig, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``'s attention module: the kind ``config.attention`` names in :data:`ATTENTIONS`
    (without RoPE when ``config.rope`` is false)."""
    module = ATTENTIONS[config.attention].from_config(config, layer_idx)
    if not config.rope:
        module.rope = False
    return module


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``; the weights may be stacked (:mod:`difftx.ops`)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor, residual: Optional[Tensor] = None) -> Tensor:
        """``residual + down(...)`` (a stack adds it inside its batched product)."""
        return linear(swiglu(linear(x, self.gate_proj.weight), linear(x, self.up_proj.weight)),
                      self.down_proj.weight, residual)


class RMSNorm(nn.RMSNorm):
    """``torch.nn.RMSNorm`` whose gain may be stacked (:func:`difftx.ops.rms_norm`)."""

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Block(nn.Module):
    """Pre-norm block: ``x + Attn(RMSNorm(x))`` then ``x + SwiGLU(RMSNorm(x))``."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.attn = make_attention(config, layer_idx)
        self.mlp_norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.mlp = SwiGLU(config.dim, config.hidden_dim)

    def forward(self, x: Tensor, **attn_kwargs) -> Tensor:
        x = x + self.attn(self.attn_norm(x), **attn_kwargs)
        return x + self.mlp(self.mlp_norm(x))


class KVCache:
    """Per-layer key/value buffers for incremental decoding; ``length`` tokens are filled."""

    def __init__(self, model: "Transformer", batch_size: int, max_len: int,
                 device: Optional[torch.device] = None, dtype: Optional[torch.dtype] = None):
        p = next(model.parameters())
        device, dtype = device or p.device, dtype or p.dtype
        self.max_len, self.length = max_len, 0
        self.layers: list[LayerKV] = []
        for block in model.layers:
            k_shape, v_shape = block.attn.cache_shapes()
            self.layers.append(LayerKV.empty(batch_size, max_len, k_shape, v_shape, device=device, dtype=dtype,
                                             v_parts=block.attn.cache_value_parts(device)))


class StaticKVCache:
    """A KV cache whose decoding step has the same shapes and the same graph at every position, so that the step
    can be captured once (``torch.compile(mode="reduce-overhead")``: CUDA graphs) and replayed at every position.

    It holds a :class:`KVCache`'s per-layer buffers (``kv``; :meth:`prefill` fills them by the ordinary cached
    forward) and two tensors on their device: ``pos``, the next position written (a 0-d int64 tensor), and
    ``key_valid`` ``(B, S_max)``, False at the prompts' padding. :meth:`Transformer.forward` with this cache is one
    static step: the new keys and values are written at ``pos`` (``index_copy_``), every query attends over the whole
    ``S_max`` buffer with the keys beyond it masked (``AttentionMask`` with a tensor ``q_offset``), and RoPE positions
    are tensors; no Python value depends on the position. The forward does not advance ``pos`` (a compiled graph
    would then mutate it); :meth:`advance` does, outside the graph, and keeps ``length``, its Python mirror, for the
    checks (:func:`difftx.decode.static_decoder` runs both)."""

    def __init__(self, model: "Transformer", batch_size: int, max_len: int, device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None, kv: Optional[KVCache] = None):
        self.kv = KVCache(model, batch_size, max_len, device, dtype) if kv is None else kv
        self.layers, self.max_len = self.kv.layers, self.kv.max_len
        dev = self.layers[0].k.device
        self.pos = torch.zeros((), dtype=torch.long, device=dev)
        self.key_valid = torch.ones(self.layers[0].k.shape[0], self.max_len, dtype=torch.bool, device=dev)
        self.length = self.kv.length
        self.pos.fill_(self.length)

    def tensors(self) -> list[Tensor]:
        """Every tensor a static step reads or writes in place (the buffers, ``pos``, ``key_valid``)."""
        return [*(t for lay in self.layers for t in (lay.k, lay.v)), self.pos, self.key_valid]

    def set_length(self, n: int) -> None:
        """Make the first ``n`` positions the cached ones (the next step writes at ``n``)."""
        if not 0 <= n <= self.max_len:
            raise ValueError(f"static cache: length {n} is outside its {self.max_len} positions")
        self.length = self.kv.length = n
        self.pos.fill_(n)

    def advance(self, n: int = 1) -> None:
        """Count ``n`` more positions as cached (after a step of ``n`` tokens)."""
        self.set_length(self.length + n)

    def check_room(self, n: int) -> None:
        """ValueError unless ``n`` more tokens fit."""
        if self.length + n > self.max_len:
            raise ValueError(f"static KV cache is full: {self.length} + {n} tokens do not fit in its {self.max_len} "
                             f"positions (allocate it with a larger max_len)")

    def prefill(self, model: "Transformer", tokens: Tensor, positions: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None, backend: Optional[str] = None) -> Tensor:
        """Logits ``(B, P, V)`` of the prompts ``tokens`` ``(B, P)`` (left-padded, ``attention_mask`` ``(B, P)``
        1 at real tokens), run by the ordinary cached forward into this cache's buffers from position 0; the key
        mask then holds the padding, and the next step writes at ``P``."""
        P = tokens.shape[-1]
        if P > self.max_len:
            raise ValueError(f"tokens: a prompt of {P} tokens is longer than the static cache's {self.max_len} "
                             f"positions")
        self.set_length(0)
        logits = model(tokens, positions=positions, attention_mask=attention_mask, cache=self.kv, backend=backend)
        self.key_valid.fill_(True)
        if attention_mask is not None:
            self.key_valid[:, :P] = attention_mask.bool()
        self.set_length(P)
        return logits


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"Transformer expects a ModelConfig, got {type(config).__name__}")
        self.config = config
        base = self._draw_base()  # before any module draws from the global RNG (see reset_parameters)
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.tok_embeddings.weight
        self.reset_parameters(base)

    @staticmethod
    def _draw_base() -> int:
        # the CPU generator, also when the model is built under a meta device
        return int(torch.randint(0, 2**62, (1,), device="cpu").item())

    def reset_parameters(self, base: Optional[int] = None) -> None:
        """Draw every parameter as ``config.init`` says; unit norm gains; each attention module as its kind's
        ``init_parameters`` says (which parameters it draws, and the lambda vectors' ``N(0, 0.1)``).

        ``init="normal"``: every linear map and embedding ``N(0, init_std)``. ``init="torch"``: PyTorch's module
        defaults, each parameter by the module that holds it: an ``nn.Linear`` weight uniform in
        ``+-1/sqrt(fan_in)`` (``kaiming_uniform_`` with ``a = sqrt(5)``), an ``nn.Embedding`` weight ``N(0, 1)``;
        a parameter of no such module (the lambda vectors) keeps the normal draw its kind asks for.

        Paired initialisation: one number ``base`` is drawn from the global RNG (by the
        constructor, before anything else draws), and every parameter is then drawn from its own
        generator seeded by ``base`` and the parameter's name. So after ``torch.manual_seed(s)`` a
        DIFF model and its baseline (or any other arm) hold identical values in every parameter with
        the same name and shape (embeddings, projections, MLP, head), which takes initialisation
        noise out of their paired difference."""
        base = self._draw_base() if base is None else base
        std, torch_init = self.config.init_std, self.config.init == "torch"
        owners = {f"{m_name}.{p_name}" if m_name else p_name: module for m_name, module in self.named_modules()
                  for p_name, _ in module.named_parameters(recurse=False)}

        def draw(name: str, sd: float) -> None:  # the paired draw of one parameter, by its name in the model
            p = params[name]
            if p.is_meta:  # built to be loaded into (checkpoint loading): nothing to draw
                return
            g = torch.Generator().manual_seed((base + zlib.crc32(name.encode()) * 1_000_003) % 2**63)
            owner = owners.get(name) if torch_init else None
            with torch.no_grad():
                if isinstance(owner, nn.Linear):  # U(-1/sqrt(fan_in), 1/sqrt(fan_in)), nn.Linear's default
                    bound = 1.0 / math.sqrt(p.shape[-1])
                    value = torch.rand(p.shape, generator=g, dtype=torch.float32, device="cpu").mul_(2 * bound)
                    p.copy_(value.sub_(bound))
                else:  # N(0, 1) for an nn.Embedding under "torch" (its default), else N(0, sd)
                    sd = 1.0 if isinstance(owner, nn.Embedding) else sd
                    p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32, device="cpu").mul_(sd))

        params = dict(self.named_parameters())
        for i, block in enumerate(self.layers):  # each attention kind initialises its own module
            prefix = f"layers.{i}.attn."
            block.attn.init_parameters(lambda name, sd, prefix=prefix: draw(prefix + name, sd), std)
        for name, p in params.items():
            if name.split(".")[2:3] == ["attn"] or p.is_meta:
                continue
            if name.endswith("norm.weight"):  # the block norms and the final norm: unit gains
                with torch.no_grad():
                    p.fill_(1.0)
            else:
                draw(name, std)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: Tensor, *, positions: Optional[Tensor] = None,
                attention_mask: Optional[Tensor] = None, doc_ids: Optional[Tensor] = None,
                cache: Optional[KVCache] = None, backend: Optional[str] = None,
                logits_at: Optional[Tensor] = None, targets: Optional[Tensor] = None,
                loss_rows: Optional[Tensor] = None, loss_weights: Optional[Tensor] = None) -> Tensor:
        """Logits ``(B, T, V)`` for ``tokens`` ``(B, T)``: ``lm_head(hidden(...))``, arguments as
        in :meth:`hidden`; or, with ``targets``, the training loss.

        ``logits_at`` ``(B, T)`` bool: return only the logits at its True positions, ``(N, V)`` in
        row-major order (equal to ``forward(...)[logits_at]``), running the LM head on those ``N``
        positions alone. A loss on a few positions per sequence (answer tokens) then skips most of
        the head's work; being part of ``forward``, it also works through DDP / FSDP2 wrappers.

        ``targets`` ``(B, T)`` (the next tokens): return ``sum_n loss_weights_n * nll_n`` over the rows
        ``loss_rows`` ``(N,)`` of the flattened ``(B*T)`` positions (default every position, each weighing
        ``1 / (B*T)``: the mean), the LM head run on those rows alone, fused with the cross-entropy
        (:func:`difftx.ops.head_loss`); :func:`loss_rows` makes both from a loss mask. The one training
        loss of the trainer and of a stack (which calls this under ``torch.vmap``)."""
        h = self.hidden(tokens, positions=positions, attention_mask=attention_mask, doc_ids=doc_ids, cache=cache,
                        backend=backend)  # (B, T, D)
        if targets is not None:
            if logits_at is not None:
                raise ValueError("forward: give logits_at or targets (a loss), not both")
            h, y = h.flatten(-3, -2), targets.flatten(-2)  # (..., B*T, D), (..., B*T)
            if loss_rows is not None:
                h = torch.take_along_dim(h, loss_rows[..., None], dim=-2)
                y = torch.take_along_dim(y, loss_rows, dim=-1)
            if loss_weights is None:
                loss_weights = torch.full(y.shape, 1.0 / max(y.shape[-1], 1), dtype=torch.float32, device=y.device)
            return head_loss(h, self.lm_head.weight, y, loss_weights)
        if logits_at is not None:
            if logits_at.dtype != torch.bool or tuple(logits_at.shape) != tuple(tokens.shape):
                raise ValueError(f"logits_at must be a bool tensor of shape {tuple(tokens.shape)}, got "
                                 f"{logits_at.dtype} {tuple(logits_at.shape)}")
            h = h[logits_at]  # (N, D)
        return self.lm_head(h)  # (B, T, V), or (N, V) with logits_at

    def hidden(self, tokens: Tensor, *, positions: Optional[Tensor] = None,
               attention_mask: Optional[Tensor] = None, doc_ids: Optional[Tensor] = None,
               cache: Optional[KVCache] = None, backend: Optional[str] = None) -> Tensor:
        """Final-normed hidden states ``(B, T, D)`` for ``tokens`` ``(B, T)`` (the LM head's input:
        a loss on a few positions can apply ``lm_head`` to those alone).

        ``attention_mask`` ``(B, S)``: 1 for real tokens, 0 for padding, over cached + new
        positions. ``positions`` ``(B, T)``: RoPE positions (default: counting from the cache
        length). ``doc_ids`` ``(B, T)``: packed documents attend only within themselves (not
        with a cache). ``cache``: a :class:`KVCache`; its ``length`` advances by ``T``. Or a
        :class:`StaticKVCache`: one static step of the ``T`` tokens at ``cache.pos`` (no ``attention_mask``: the
        cache's ``key_valid`` masks the padding), which does not advance the cache.
        """
        if not isinstance(tokens, Tensor):
            raise TypeError(f"tokens must be a torch.Tensor of token ids (batch, time), got {type(tokens).__name__}; "
                            "wrap it: torch.tensor(ids, dtype=torch.long)")
        weight = self.tok_embeddings.weight
        lead = tuple(weight.shape[:-2])  # (K,) in a stack's module tree (weights with a leading K), else ()
        if tokens.dim() != 2 + len(lead) or tuple(tokens.shape[:len(lead)]) != lead:
            raise ValueError(f"tokens must be {'(K=%d, batch, time)' % lead[0] if lead else '(batch, time)'}, got "
                             f"shape {tuple(tokens.shape)}")
        B, T = tokens.shape[-2:]
        if T == 0:
            raise ValueError("tokens: a sequence needs at least one token, got shape (batch, 0)")
        if tokens.device != weight.device and weight.device.type != "meta":
            raise ValueError(f"tokens are on {tokens.device} but the model is on {weight.device}; "
                             f"move one of them (tokens.to({str(weight.device)!r}))")
        _check_token_ids(tokens, self.config.vocab_size)
        if positions is not None and (not isinstance(positions, Tensor) or positions.dim() != 2
                                      or positions.shape[0] not in (1, B) or positions.shape[1] != T):
            got = tuple(positions.shape) if isinstance(positions, Tensor) else type(positions).__name__
            raise ValueError(f"positions must be a tensor of shape ({B}, {T}) or (1, {T}) (the RoPE positions of the "
                             f"new tokens), got {got}")
        if isinstance(cache, StaticKVCache):
            return self._static_step(tokens, positions, attention_mask, doc_ids, cache, backend, lead)
        offset = cache.length if cache is not None else 0
        S = offset + T
        if lead and (cache is not None or attention_mask is not None or positions is not None):
            raise ValueError("a stack's forward takes tokens, doc_ids and a loss only (no cache, attention_mask, "
                             "positions)")
        if attention_mask is not None and tuple(attention_mask.shape) != (B, S):
            raise ValueError(f"attention_mask must have shape {(B, S)} (cached + new tokens), "
                             f"got {tuple(attention_mask.shape)}")
        if doc_ids is not None:
            if cache is not None:
                raise ValueError("doc_ids (packed documents) cannot be combined with a KV cache")
            if tuple(doc_ids.shape) != (*lead, B, T):
                raise ValueError(f"doc_ids must have shape {(*lead, B, T)}, got {tuple(doc_ids.shape)}")
            doc_ids = doc_ids.reshape(-1, T)  # one row per sequence of the kernels' batch
        if cache is not None and S > cache.max_len:
            raise ValueError(f"KV cache is full: {S} tokens do not fit in its {cache.max_len} positions")
        mask = AttentionMask(causal=True, q_offset=offset,
                             key_valid=None if attention_mask is None else attention_mask.bool(),
                             doc_ids=doc_ids)
        x = embedding(tokens, weight)  # (..., B, T, D)
        for i, block in enumerate(self.layers):
            x = block(x, positions=positions, mask=mask, cache=None if cache is None else cache.layers[i],
                      backend=backend)
        if cache is not None:
            cache.length = S
        return self.norm(x)  # (B, T, D)


    def _static_step(self, tokens: Tensor, positions: Optional[Tensor], attention_mask: Optional[Tensor],
                     doc_ids: Optional[Tensor], cache: StaticKVCache, backend: Optional[str], lead: tuple) -> Tensor:
        """:meth:`hidden` for a :class:`StaticKVCache`: the ``T`` tokens written at ``cache.pos``, attending over
        the whole buffer (the key mask ``cache.key_valid``, and the keys beyond each query); ``cache`` is not
        advanced. Nothing here reads the position on the host, so a compiled step serves every position."""
        B, T = tokens.shape[-2:]
        if lead or attention_mask is not None or doc_ids is not None:
            raise ValueError("cache: a static KV cache's step takes tokens, positions and a backend only (its key "
                             "mask is the cache's key_valid; no attention_mask, doc_ids or stack)")
        if tuple(cache.key_valid.shape) != (B, cache.max_len):
            raise ValueError(f"tokens: {B} rows, but the static KV cache holds {cache.key_valid.shape[0]}")
        if not torch.compiler.is_compiling():  # a compiled step leaves this to its caller (a host-side counter)
            cache.check_room(T)
        if positions is None:
            positions = (cache.pos + torch.arange(T, device=tokens.device))[None]  # (1, T)
        mask = AttentionMask(causal=True, q_offset=cache.pos, key_valid=cache.key_valid)
        x = embedding(tokens, self.tok_embeddings.weight)
        for i, block in enumerate(self.layers):
            x = block(x, positions=positions, mask=mask, cache=cache.layers[i], backend=backend)
        return self.norm(x)


def _check_token_ids(tokens: Tensor, vocab_size: int) -> None:
    """ValueError unless every id is in ``[0, vocab_size)``: one min/max reduction (skipped while
    torch.compile traces), instead of torch's index error (a device assert on a GPU)."""
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"tokens must hold integer token ids, got dtype {tokens.dtype}")
    if tokens.numel() == 0 or tokens.device.type == "meta" or torch.compiler.is_compiling() or is_mapped(tokens):
        return
    lo, hi = (int(x) for x in torch.aminmax(tokens))
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"tokens: ids must be in [0, vocab_size={vocab_size}), got min {lo} and max {hi}")


def lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean next-token cross-entropy (nats); ``targets`` ``(B, T)`` already shifted."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=ignore_index)


def loss_rows(mask: Tensor, total: Optional[int] = None, world_size: int = 1, pad_to: Optional[int] = None
              ) -> tuple[Tensor, Tensor]:
    """``(loss_rows, loss_weights)`` for :meth:`Transformer.forward` from a loss mask ``(B, T)`` bool: the
    flat indices of its True positions in row-major order and each one's weight, ``1 / count`` (the
    mean) or, with ``total`` (the global batch's loss positions), ``world_size / total`` (data-parallel
    averaging then gives the global mean). ``pad_to``: padded to that many rows of weight 0 (a stack's
    models have equal row counts)."""
    rows = mask.flatten().nonzero().squeeze(1)
    n = rows.numel()
    w = 1.0 / max(n, 1) if total is None else world_size / max(total, 1)
    weights = torch.full((n,), w, dtype=torch.float32, device=mask.device)
    if pad_to is not None and pad_to > n:
        rows = torch.cat([rows, rows.new_zeros(pad_to - n)])
        weights = torch.cat([weights, weights.new_zeros(pad_to - n)])
    return rows, weights
