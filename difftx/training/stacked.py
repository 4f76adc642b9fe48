"""K models of one :class:`~difftx.config.ModelConfig` trained together as one *stacked* model.

The stack is the one model's module tree (:class:`~difftx.model.Transformer`, built without drawing
weights) whose every parameter carries a leading ``K`` dimension: model ``i`` of the stack is
``{name: p[i]}``, an ordinary state dict under the one model's names. The tree's own modules compute
each model's part of a layer: the block norms and the MLP (:mod:`difftx.ops` broadcasts a stacked
weight over ``K``), and each attention kind's ``kernel_lambda`` and ``finish`` (the lambda, gate,
head norm or V2 pairing, written once in :mod:`difftx.attention.modules`). What only a stack does is
here: the embedding lookup in ``K`` vocabularies, q, k, v and the kind's extra projection in one batched
product, the attention core over the ``K * B`` sequences as one batch (one lambda per model), and the
LM head fused with the loss. So the many small calls of a small model's step are paid once per step
instead of ``K`` times, and a stacked step matches ``K`` separate steps to float32 rounding. A new
attention kind (a subclass and a line in :data:`difftx.attention.modules.ATTENTIONS`) trains stacked
with no code here.

What the trainer calls (one process, float32; see :func:`train_step` for one whole step)::

    models = [Transformer(config) for each seed]          # seeded as the trainer seeds them
    stack = StackedTransformer.from_models(models)        # or from_state_dicts(config, dicts)
    opt = build_optimizer(stack, train_config)            # difftx.training.optim: = one AdamW per model
    for step ...:
        batches = [as_batch(loader.next_batch()) for loader in loaders]    # one loader per model
        out = train_step(stack, opt, [batches], lr_at(step, tc), tc.grad_clip)
        out.losses[i], out.grad_norms[i], out.kind_losses[i]          # per model
    stack.state_dict_of(i), optimizer_state_of(opt, stack, i)         # today's checkpoint format
    load_optimizer_states(opt, stack, [state_0, ...])                 # exact resume

Pieces, each equal to what the one-model trainer does:

- :meth:`StackedTransformer.losses`: per-model loss ``(K,)``: :func:`difftx.model.lm_loss` without a
  loss mask, ``masked_lm_loss`` with one (the LM head runs on each model's mask positions, padded to
  the largest count with weight 0, so the loss equals ``model(x, logits_at=mask)``'s).
- :func:`difftx.training.optim.clip_grad_norms_` and :func:`~difftx.training.optim.build_optimizer`
  take a stack as they take one model: each model's gradient clipped by its own norm, and AdamW with
  the groups decided on each parameter's per-model slice (AdamW is elementwise and the step count is
  shared, so one optimizer over the stacked tensors is ``K`` optimizers).
- :meth:`StackedTransformer.state_dict_of` / :meth:`~StackedTransformer.load_state_dicts`,
  :func:`optimizer_state_of` / :func:`load_optimizer_states`: one model's weights and AdamW state in
  the trainer's checkpoint format (parameter names as keys), and back.

Supported: every attention kind of :data:`~difftx.attention.modules.ATTENTIONS` and every option of
:data:`difftx.config.ARMS`, tied embeddings, packed-document masks (``doc_ids``), grad accumulation, float32 and
float64 weights. Not supported: autocast / float16 / bfloat16 (refused), DDP / FSDP (one process holds
the whole stack), KV caches (training only; :meth:`StackedTransformer.model` gives an ordinary model for
probes and evaluation). The attention core is its own blocked materialised kernel (the ``chunked``
kernel's algorithm with one lambda per model, RoPE fused into its layout copy), whatever
``ModelConfig.backend`` says; the code is device-agnostic but has only run on CPU, and on a GPU it would
not be the flash kernel (``sdpa`` / ``triton``) the one-model trainer uses. Not ``torch.func.vmap``: the
stock model does not vmap (its ``chunked`` kernel, DIFF's lambda and head norm are ``autograd.Function`` s
without ``setup_context``, and the token-range check reads a value), and for the baseline, where vmap
runs with the ``eager`` backend, it is slower than separate models (``benchmarks/stack_throughput.py
--vmap``).

:func:`tune_allocator` (glibc): a stack's step allocates tensors K times a model's, which glibc serves by
fresh ``mmap`` calls (a page fault per 4 KiB, every step) unless told to keep freed blocks; call it once
in a process that trains a stack.

Speed against separate models: ``benchmarks/stack_throughput.py``; the measured ratios, and why they
stay far from K, are in docs/results.md ("Stacked seeds: throughput").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from ..attention.kernels import STORE_MAX_KEYS, _diag_bias
from ..attention.masks import AttentionMask
from ..attention.rope import rope_angles
from ..config import ModelConfig
from ..model import Transformer
from ..ops import linear
from .batches import Batch
from .optim import clip_grad_norms_

__all__ = ["StackDivergedError", "StackedTransformer", "StepResult", "load_optimizer_states", "optimizer_state_of",
           "stack_batches", "train_step", "tune_allocator"]


# -- the attention core: K*B sequences at once, one lambda per model -------------------------------------------------

@dataclass(frozen=True)
class _Geometry:
    """Head layout of one attention layer (the same in every layer of a config)."""

    K: int  # models
    Hkv: int  # key/value groups
    R: int  # query heads per group
    C: int  # maps per head: 2 for DIFF V1, else 1
    d: int  # query/key width
    dv: int  # value width
    scale: float

    @property
    def q_cols(self) -> int:
        return self.Hkv * self.R * self.C * self.d

    @property
    def k_cols(self) -> int:
        return self.Hkv * self.C * self.d

    @property
    def v_cols(self) -> int:
        return self.Hkv * self.dv


# Query rows per block of the stacked attention core (a block of rows needs only the keys up to its last row). Smaller
# blocks skip more of the causal mask's upper half, but were slower at T = 64 on CPU (stack of 5 DIFF models: 64, 32,
# 16 rows 4%, 7%, 12% slower per step than one 128-row block), as for the chunked kernel (CHUNK_ROWS = 128).
BLOCK_ROWS = 128


def _as_complex(x: Tensor, copy_ok: bool = True) -> Tensor:
    """``x`` ``(..., 2m)`` as ``m`` complex numbers (pairs ``(2i, 2i+1)``: RoPE's GPT-J convention): a view,
    or (``copy_ok``, to read from) a copy where an odd stride or offset does not allow one."""
    pairs = x.unflatten(-1, (-1, 2))
    if pairs.storage_offset() % 2 or any(st % 2 for st in pairs.stride()[:-1]):
        if not copy_ok:
            raise ValueError("_as_complex: odd strides, no complex view to write to")
        pairs = pairs.contiguous()
    return torch.view_as_complex(pairs)


def _rotate_into(out: Tensor, x: Tensor, rot: Tensor) -> None:
    """``out = RoPE(x)``: the complex product ``x * rot`` of each pair (``(x0 cos - x1 sin, x0 sin + x1 cos)``,
    ``apply_rope``'s arithmetic); ``out``, ``x`` complex views of one shape, ``rot`` broadcastable."""
    torch.mul(x, rot, out=out)


class _Attention:
    """One call's tensors in the blocked kernel's 3-D form: ``q3 (KB*Hkv*C, T*R, d)`` (rotated),
    ``k3 (KB*Hkv*C, T, d)`` (rotated), ``v3 (KB*Hkv, T, dv)``; ``neg_lam`` ``(K, 1, 1, 1)``."""

    def __init__(self, qkv: Tensor, lam: Optional[Tensor], rot: Tensor, geo: _Geometry, doc_ids: Optional[Tensor]):
        g = geo
        KB, T = qkv.shape[:2]
        self.geo, self.KB, self.T, self.rot = g, KB, T, rot  # rot: (T, d/2) complex
        h = g.d // 2
        self.q3 = qkv.new_empty(KB * g.Hkv * g.C, T * g.R, g.d)
        self.k3 = qkv.new_empty(KB * g.Hkv * g.C, T, g.d)
        _rotate_into(self.q_pairs(self.q3), _as_complex(qkv[..., :g.q_cols]).view(KB, T, g.Hkv, g.R, g.C, h),
                     rot.view(T, 1, 1, 1, h))
        k_cols = qkv[..., g.q_cols:g.q_cols + g.k_cols]
        _rotate_into(self.k_pairs(self.k3), _as_complex(k_cols).view(KB, T, g.Hkv, g.C, h), rot.view(T, 1, 1, h))
        v = qkv[..., g.q_cols + g.k_cols:].view(KB, T, g.Hkv, g.dv).transpose(1, 2)  # (KB, Hkv, T, dv)
        self.v3 = v.reshape(KB * g.Hkv, T, g.dv)
        self.neg_lam = None if lam is None else (-lam.detach()).view(g.K, 1, 1, 1)
        self.mask = None if doc_ids is None else AttentionMask(doc_ids=doc_ids)

    def q_pairs(self, q3: Tensor) -> Tensor:
        """``q3``'s complex pairs in the projection's order ``(KB, T, Hkv, R, C, d/2)`` (a view)."""
        g = self.geo
        return torch.view_as_complex(q3.view(self.KB, g.Hkv, g.C, self.T, g.R, g.d // 2, 2)).permute(0, 3, 1, 4, 2, 5)

    def k_pairs(self, k3: Tensor) -> Tensor:
        """``k3``'s complex pairs in the projection's order ``(KB, T, Hkv, C, d/2)`` (a view)."""
        g = self.geo
        return torch.view_as_complex(k3.view(self.KB, g.Hkv, g.C, self.T, g.d // 2, 2)).permute(0, 3, 1, 2, 4)

    def probs(self, r0: int, r1: int) -> Tensor:
        """Softmax maps ``(KB*Hkv*C, t*R, r1)`` of query rows ``r0:r1`` (causal: keys ``0..r1-1``)."""
        R, t, s = self.geo.R, r1 - r0, r1
        qb, kb = self.q3[:, r0 * R:r1 * R], self.k3[:, :s].transpose(1, 2)
        bias = _diag_bias(t, R, qb.device, qb.dtype)  # the chunked kernel's, cached per shape
        if s == t:
            logits = torch.baddbmm(bias, qb, kb, alpha=self.geo.scale)
        else:
            logits = qb.new_empty(qb.shape[0], qb.shape[1], s).baddbmm_(qb, kb, beta=0.0, alpha=self.geo.scale)
            logits[:, :, r0:s].add_(bias)
        if self.mask is not None:
            allowed = self.mask.dense(self.T, self.T, logits.device, rows=slice(r0, r1), keys=s)  # (KB, t, s)
            logits.view(self.KB, -1, t, R, s).masked_fill_(~allowed[:, None, :, None, :], float("-inf"))
        return torch.softmax(logits, dim=-1)

    def effective(self, probs: Tensor) -> Tensor:
        """``(KB*Hkv, t*R, s)``: ``A1 - lam_k A2`` (each model its own lambda), or the map itself."""
        if self.neg_lam is None:
            return probs
        p = probs.view(self.geo.K, -1, 2, *probs.shape[1:])  # (K, B*Hkv, 2, t*R, s)
        return torch.addcmul(p[:, :, 0], p[:, :, 1], self.neg_lam).view(-1, *probs.shape[1:])


class _StackedAttention(torch.autograd.Function):
    """RoPE + causal (A1 - lambda A2) V for K*B sequences, from the fused projection output ``qkv``
    ``(KB, T, q|k|v columns)``: returns ``(KB, T, H, dv)``; the backward returns the gradient of
    ``qkv`` in one tensor and of ``lam`` ``(K,)``. Blocks of ``BLOCK_ROWS`` query rows as in the
    ``chunked`` kernel, maps kept for blocks of at most ``STORE_MAX_KEYS`` keys (longer ones recomputed)."""

    @staticmethod
    def forward(ctx, qkv, lam, rot, geo, doc_ids):
        at = _Attention(qkv, lam, rot, geo, doc_ids)
        g, T = geo, at.T
        out = at.v3.new_empty(at.KB * g.Hkv, T * g.R, g.dv)
        blocks = []
        for r0 in range(0, T, BLOCK_ROWS):
            r1 = min(T, r0 + BLOCK_ROWS)
            probs = at.probs(r0, r1)
            eff = at.effective(probs)
            torch.bmm(eff, at.v3[:, :r1], out=out[:, r0 * g.R:r1 * g.R])
            blocks.append((r0, r1, (probs, eff) if r1 <= STORE_MAX_KEYS else None))
        ctx.at, ctx.blocks = at, blocks
        out = out.view(at.KB, g.Hkv, T, g.R, g.dv).transpose(1, 2)
        return out.reshape(at.KB, T, g.Hkv * g.R, g.dv).contiguous()

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        at, g = ctx.at, ctx.at.geo
        KB, T, R, C = at.KB, at.T, g.R, g.C
        do3 = dout.view(KB, T, g.Hkv, R, g.dv).transpose(1, 2).reshape(KB * g.Hkv, T * R, g.dv)
        dq3, dk3, dv3 = torch.empty_like(at.q3), torch.empty_like(at.k3), torch.empty_like(at.v3)
        dlam = at.v3.new_zeros(g.K) if at.neg_lam is not None else None
        first = True
        for r0, r1, stored in reversed(ctx.blocks):  # the last block sees every key: it initialises dk, dv
            t, s = r1 - r0, r1
            rows = slice(r0 * R, r1 * R)
            beta = 0.0 if first else 1.0
            first = False
            probs, eff = stored if stored is not None else (None, None)
            if probs is None:
                probs = at.probs(r0, r1)
                eff = at.effective(probs)
            dob = do3[:, rows]
            dv3[:, :s].baddbmm_(eff.transpose(1, 2), dob, beta=beta)
            deff = torch.bmm(dob, at.v3[:, :s].transpose(1, 2))  # (KB*Hkv, t*R, s)
            p = probs.view(KB * g.Hkv, C, t * R, s)
            ds = p * deff[:, None]
            rsum = ds.sum(-1, keepdim=True)
            ds.addcmul_(p, rsum, value=-1.0)  # softmax backward, linear in dP (dP2 = -lambda dP1)
            if at.neg_lam is not None:
                ds.view(g.K, -1, C, t * R, s)[:, :, 1].mul_(at.neg_lam)
                dlam -= rsum.view(g.K, -1, C, t * R)[:, :, 1].sum((1, 2))  # dL/dlambda = -sum(deff * A2)
            ds = ds.view(KB * g.Hkv * C, t * R, s)
            dq3[:, rows].baddbmm_(ds, at.k3[:, :s], beta=0.0, alpha=g.scale)
            dk3[:, :s].baddbmm_(ds.transpose(1, 2), at.q3[:, rows], beta=beta, alpha=g.scale)
        dqkv = dout.new_empty(KB, T, g.q_cols + g.k_cols + g.v_cols)
        back = at.rot.conj().resolve_conj()  # the rotation by the opposite angle
        h = g.d // 2
        dq = _as_complex(dqkv[..., :g.q_cols], copy_ok=False).view(KB, T, g.Hkv, R, C, h)
        _rotate_into(dq, at.q_pairs(dq3), back.view(T, 1, 1, 1, h))
        dk = _as_complex(dqkv[..., g.q_cols:g.q_cols + g.k_cols], copy_ok=False).view(KB, T, g.Hkv, C, h)
        _rotate_into(dk, at.k_pairs(dk3), back.view(T, 1, 1, h))
        dqkv[..., g.q_cols + g.k_cols:].view(KB, T, g.Hkv, g.dv).copy_(dv3.view(KB, g.Hkv, T, g.dv).transpose(1, 2))
        return dqkv, dlam, None, None, None


# -- the fused LM head and loss -------------------------------------------------------------------------------------

# The LM head's width is padded to a multiple of this (zero rows, their logits -inf): a 623-wide head (the
# compare vocabulary) runs at half the speed of a 640-wide one in MKL on this project's CPU.
HEAD_PAD = 64


class _HeadLoss(torch.autograd.Function):
    """Each model's next-token cross-entropy from hidden states ``h`` ``(K, N, D)`` and its LM head ``w``
    ``(K, V, D)``: ``sum_n nll_n * mult_k / div_k`` over the rows with ``valid`` (all rows when None), so
    ``mult = 1, div = N`` is ``lm_loss``'s mean and ``mult = 1 / total`` the masked sum. One node: the
    head's product, ``log_softmax`` (as ``F.cross_entropy``) and the closed-form backward
    ``(softmax - onehot) * weight`` into both products."""

    @staticmethod
    def forward(ctx, h, w, targets, valid, mult, div):
        V = w.shape[1]
        Vp = -(-V // HEAD_PAD) * HEAD_PAD
        wp = w if Vp == V else F.pad(w, (0, 0, 0, Vp - V))
        logits = torch.bmm(h, wp.transpose(1, 2))  # (K, N, Vp)
        if Vp != V:
            logits[..., V:] = float("-inf")
        logp = torch.log_softmax(logits.float(), dim=-1)  # in float32 whatever the weights, as lm_loss
        nll = logp.gather(-1, targets[..., None]).squeeze(-1).neg_()  # (K, N)
        if valid is not None:
            nll = nll.masked_fill_(~valid, 0.0)
        ctx.save_for_backward(h, wp, logp, targets, valid, mult, div)
        ctx.V = V
        return nll.sum(1) * mult.to(nll.dtype) / div.to(nll.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):
        h, wp, logp, targets, valid, mult, div = ctx.saved_tensors
        K, N = targets.shape
        row = (g * mult / div).to(logp.dtype)[:, None].expand(K, N)  # dL/dnll_n
        if valid is not None:
            row = row * valid
        dlogits = logp.exp_().mul_(row[..., None])  # logp is this node's own: reused in place
        dlogits.scatter_add_(-1, targets[..., None], -row[..., None])
        dlogits = dlogits.to(wp.dtype)
        dh = torch.bmm(dlogits, wp) if ctx.needs_input_grad[0] else None
        dw = torch.bmm(dlogits.transpose(1, 2), h)[:, :ctx.V] if ctx.needs_input_grad[1] else None
        return dh, dw, None, None, None, None


# -- the allocator ---------------------------------------------------------------------------------------------------

def tune_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = 1 << 30) -> bool:
    """Keep freed large blocks in glibc's heap instead of unmapping them: a stack's step allocates tensors of
    megabytes (K times a model's), which glibc otherwise serves by fresh ``mmap`` and pays a page fault per
    4 KiB on first touch, step after step (``sys`` time). Process-wide (every tensor, the separate models'
    too); the heap then keeps its peak size. Returns False where it does not apply (not glibc)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    return bool(libc.mallopt(M_MMAP_THRESHOLD, int(mmap_threshold))) and \
        bool(libc.mallopt(M_TRIM_THRESHOLD, int(trim_threshold)))


# -- the stacked model -----------------------------------------------------------------------------------------------

def _reference(config: ModelConfig) -> Transformer:
    """A weightless (meta) model of ``config``: names, shapes, module attributes. The global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        return Transformer(config)


def _stack_parameters(tree: nn.Module, k: int, device, dtype) -> None:
    """Give every parameter of ``tree`` (a meta model) a leading ``K``: zeroed ``(K, *shape)`` parameters
    in place of the old ones, a tied weight still shared."""
    new: dict[int, nn.Parameter] = {}
    for module in tree.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.zeros(k, *p.shape, device=device, dtype=dtype))
            module._parameters[name] = new[id(p)]


class StackedTransformer(nn.Module):
    """``K`` :class:`~difftx.model.Transformer` models of one config as one model whose parameters
    have a leading ``K`` dimension. ``model_tree`` is the one model's module tree holding those stacked
    parameters under the one model's names; its attention modules, norms and MLPs compute each model's
    part (:mod:`difftx.ops` broadcasts over ``K``), and this class adds what only a stack does: the
    embedding lookup of ``K`` vocabularies, the fused projection and attention core of ``K * B``
    sequences, and the fused LM head and loss. Build it with :meth:`from_models` or
    :meth:`from_state_dicts`."""

    def __init__(self, config: ModelConfig, k: int, *, device=None, dtype=torch.float32):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise TypeError(f"StackedTransformer expects a ModelConfig, got {type(config).__name__}")
        if not isinstance(k, int) or k < 1:
            raise ValueError(f"StackedTransformer: k must be a positive integer, got {k!r}")
        tree = _reference(config)
        self.config, self.k = config, k
        self.shapes = {n: tuple(p.shape) for n, p in tree.named_parameters()}
        self.state_keys = list(tree.state_dict())
        _stack_parameters(tree, k, device, dtype)
        self.model_tree = tree
        a = tree.layers[0].attn
        C = a.components
        self._geo = _Geometry(K=k, Hkv=a.v_groups, R=a.q_heads // (C * a.v_groups), C=C, d=a.head_dim, dv=a.v_width,
                              scale=1.0 / math.sqrt(a.head_dim))

    # -- building and reading back --------------------------------------------------------------------------------
    @classmethod
    def from_state_dicts(cls, config: ModelConfig, state_dicts: Sequence[dict], *, device=None
                         ) -> "StackedTransformer":
        """The stack of ``K`` ordinary ``Transformer`` state dicts (checkpoints, or ``model.state_dict()``)."""
        if not state_dicts:
            raise ValueError("StackedTransformer.from_state_dicts: need at least one state dict")
        first = next(iter(state_dicts[0].values()))
        stack = cls(config, len(state_dicts), device=device if device is not None else first.device,
                    dtype=first.dtype)
        stack.load_state_dicts(state_dicts)
        return stack

    @classmethod
    def from_models(cls, models: Sequence[Transformer]) -> "StackedTransformer":
        """The stack of ``K`` models of one config (their weights are copied)."""
        configs = {m.config for m in models}
        if len(configs) != 1:
            raise ValueError(f"StackedTransformer.from_models: the models must share one ModelConfig, got "
                             f"{len(configs)} different ones")
        return cls.from_state_dicts(models[0].config, [m.state_dict() for m in models])

    @torch.no_grad()
    def load_state_dicts(self, state_dicts: Sequence[dict]) -> None:
        """Copy ``K`` ordinary state dicts into the stack (exact)."""
        if len(state_dicts) != self.k:
            raise ValueError(f"load_state_dicts: expected {self.k} state dicts, got {len(state_dicts)}")
        for i, sd in enumerate(state_dicts):
            missing = sorted(set(self.state_keys) - set(sd))
            unexpected = sorted(set(sd) - set(self.state_keys))
            if missing or unexpected:
                raise KeyError(f"state dict {i} does not fit {self.config.attention} model: missing {missing}, "
                               f"unexpected {unexpected}")
            for name, p in self.named_stacked():
                t = sd[name]
                if tuple(t.shape) != self.shapes[name]:
                    raise ValueError(f"state dict {i}: {name} has shape {tuple(t.shape)}, expected {self.shapes[name]}")
                p[i].copy_(t)

    def named_stacked(self):
        """``(name, stacked parameter (K, *shape))`` in the one model's ``named_parameters()`` order (a tied
        LM head is the embedding)."""
        return self.model_tree.named_parameters()

    def state_dict_of(self, i: int) -> dict[str, Tensor]:
        """Model ``i``'s ordinary ``Transformer`` state dict (copies on CPU; a tied head under both keys)."""
        sd = {n: p[i].detach().cpu().clone() for n, p in self.named_stacked()}
        return {key: sd[key] if key in sd else sd["tok_embeddings.weight"] for key in self.state_keys}

    def model(self, i: int) -> Transformer:
        """Model ``i`` as an ordinary ``Transformer`` holding a copy of its weights, on the stack's device (for
        probes and evaluation; built without drawing initial weights, the global RNG left as it was)."""
        m = _reference(self.config)
        device = self.model_tree.tok_embeddings.weight.device
        m.load_state_dict({k: v.to(device) for k, v in self.state_dict_of(i).items()}, assign=True)
        if self.config.tie_embeddings:
            m.lm_head.weight = m.tok_embeddings.weight
        return m

    # -- forward --------------------------------------------------------------------------------------------------
    def hidden(self, tokens: Tensor, doc_ids: Optional[Tensor] = None) -> Tensor:
        """Final-normed hidden states ``(K, B*T, D)`` of each model on its tokens ``(K, B, T)``
        (``doc_ids`` ``(K, B, T)``: packed documents attend within themselves)."""
        if tokens.dim() != 3 or tokens.shape[0] != self.k:
            raise ValueError(f"tokens must be (K={self.k}, batch, time), got shape {tuple(tokens.shape)}")
        c, g, tree = self.config, self._geo, self.model_tree
        K, B, T = tokens.shape
        V, D = c.vocab_size, c.dim
        lo, hi = (int(v) for v in torch.aminmax(tokens))
        if lo < 0 or hi >= V:
            raise ValueError(f"tokens: ids must be in [0, vocab_size={V}), got min {lo} and max {hi}")
        offsets = torch.arange(K, device=tokens.device).mul_(V).view(K, 1, 1)
        x = F.embedding((tokens + offsets).view(K, B * T), tree.tok_embeddings.weight.view(K * V, D))  # (K, N, D)
        cos, sin = rope_angles(torch.arange(T, device=tokens.device)[None], g.d, c.rope_theta,
                               torch.promote_types(x.dtype, torch.float32))
        rot = torch.complex(cos[0, :, 0].to(x.dtype), sin[0, :, 0].to(x.dtype))  # (T, d/2): cos + i sin
        docs = None if doc_ids is None else doc_ids.reshape(K * B, T)
        for block in tree.layers:  # the one model's Block.forward, with the attention's projections and core fused
            x = self._attention(block.attn, x, block.attn_norm(x), B, T, rot, docs)
            x = block.mlp(block.mlp_norm(x), residual=x)
        return tree.norm(x)

    def _attention(self, attn: nn.Module, x: Tensor, h: Tensor, B: int, T: int, rot: Tensor, docs: Optional[Tensor]
                   ) -> Tensor:
        """``x + attn(h)`` of one layer, ``h`` the normed ``x`` ``(K, N, D)``: q, k, v and the kind's extra
        projection in one product, the core over ``K * B`` sequences, then the kind's own ``finish``."""
        K, N = self.k, B * T
        extra = getattr(attn, attn.extra_proj) if attn.extra_proj else None
        w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
                      + ([extra.weight] if extra is not None else []), dim=1)  # (K, q+k+v[+extra], D)
        proj = linear(h, w)  # (K, N, columns)
        cols = extra.out_features if extra is not None else 0
        qkv = (proj[..., :-cols] if cols else proj).view(K * B, T, -1)
        lam = attn.kernel_lambda()
        if lam is not None and lam.dim() == 0:  # one constant for every model (DIFF's no-subtraction control)
            lam = lam.expand(K)
        out = _StackedAttention.apply(qkv, lam, rot, self._geo, docs)  # (KB, T, heads, dv)
        out = attn.finish(out.view(K, N, *out.shape[2:]), proj[..., -cols:] if cols else None)
        return linear(out.reshape(K, N, -1), attn.out_proj.weight, residual=x)

    def _head_weight(self) -> Tensor:
        return self.model_tree.lm_head.weight  # the embedding when tied

    def losses(self, tokens: Tensor, loss_mask: Optional[Tensor] = None, mask_total: Optional[Sequence] = None,
               doc_ids: Optional[Tensor] = None) -> Tensor:
        """Each model's training loss ``(K,)`` on its batch: ``tokens`` ``(K, B, T+1)`` (inputs and
        next-token targets), ``loss_mask`` ``(K, B, T)`` bool or None, ``mask_total``: each model's
        global count of loss positions (``Batch.mask_total``; None entries: its own mean), ``doc_ids``
        ``(K, B, T)`` of the inputs or None. Equal to the trainer's ``lm_loss`` / ``masked_lm_loss``
        of each model in one process."""
        device_type = self.model_tree.tok_embeddings.weight.device.type
        if torch.is_autocast_enabled(device_type):
            raise ValueError("StackedTransformer: autocast is not supported (float32 or float64 weights only); "
                             "train the stack outside torch.autocast")
        x, y = tokens[..., :-1], tokens[..., 1:]
        K, B, T = x.shape
        h = self.hidden(x, doc_ids)  # (K, N, D)
        w = self._head_weight()
        if loss_mask is None:
            one = h.new_ones(K)
            return _HeadLoss.apply(h, w, y.reshape(K, B * T), None, one, one * (B * T))
        return self._masked_losses(h, w, y.reshape(K, B * T), loss_mask.reshape(K, B * T), mask_total)

    @staticmethod
    def _masked_losses(h: Tensor, w: Tensor, y: Tensor, mask: Tensor, totals: Optional[Sequence]) -> Tensor:
        """The LM head on each model's loss positions only, padded to the largest count (rows of weight 0):
        ``masked_lm_loss`` of each model (its sum over ``total`` positions, or its mean when None)."""
        K = h.shape[0]
        counts = mask.sum(1)  # (K,)
        n_max = max(int(counts.max()), 1)
        # each model's positions in row-major order first (as h[mask]), then its padding
        order = torch.sort(mask.to(torch.int8), dim=1, descending=True, stable=True).indices[:, :n_max]  # (K, n_max)
        valid = torch.arange(n_max, device=h.device)[None] < counts[:, None]  # (K, n_max)
        hs = torch.gather(h, 1, order[..., None].expand(K, n_max, h.shape[-1]))  # (K, n_max, D)
        totals = [None] * K if totals is None else list(totals)
        mult = [1.0 if t is None else 1.0 / max(t, 1) for t in totals]  # masked_lm_loss: sum * (1 / total)
        div = [float(max(c, 1)) if t is None else 1.0 for t, c in zip(totals, counts.tolist())]  # or the mean
        return _HeadLoss.apply(hs, w, torch.gather(y, 1, order), valid, h.new_tensor(mult), h.new_tensor(div))

    def forward(self, tokens: Tensor, loss_mask: Optional[Tensor] = None, mask_total: Optional[Sequence] = None,
                doc_ids: Optional[Tensor] = None) -> Tensor:
        """:meth:`losses`."""
        return self.losses(tokens, loss_mask, mask_total, doc_ids)


# -- batches ---------------------------------------------------------------------------------------------------------

@dataclass
class StackedBatch:
    """``K`` models' batches of one step: ``tokens (K, B, T+1)``; ``loss_mask (K, B, T)`` or None;
    ``mask_total`` per model; ``kind`` (the same for every model, or None); ``doc_ids (K, B, T+1)`` or None."""

    tokens: Tensor
    loss_mask: Optional[Tensor] = None
    mask_total: Optional[list] = None
    kind: Optional[str] = None
    doc_ids: Optional[Tensor] = None


def stack_batches(batches: Sequence[Batch], device=None) -> StackedBatch:
    """One step's :class:`~difftx.training.batches.Batch` of each model, stacked. Every model's batch
    must have the same shape and kind, and either all or none a loss mask."""
    if not batches:
        raise ValueError("stack_batches: need one batch per model")
    shapes = {tuple(b.tokens.shape) for b in batches}
    kinds = {b.kind for b in batches}
    masked = {b.loss_mask is not None for b in batches}
    if len(shapes) != 1 or len(kinds) != 1 or len(masked) != 1:
        raise ValueError(f"stack_batches: the models' batches of one step differ (shapes {sorted(shapes)}, kinds "
                         f"{sorted(map(str, kinds))}, loss masks {sorted(masked)}); a stack needs one shape and kind")
    tokens = torch.stack([b.tokens for b in batches]).to(device)
    mask = totals = None
    if masked.pop():
        mask = torch.stack([b.loss_mask for b in batches]).to(device)
        totals = [b.mask_total for b in batches]
    docs = None
    if all(b.doc_ids is not None for b in batches):
        docs = torch.stack([b.doc_ids for b in batches]).to(device)
    return StackedBatch(tokens, mask, totals, kinds.pop(), docs)


# -- optimizer state per model: the trainer's checkpoint format ------------------------------------------------------

def _param_names(optimizer: torch.optim.Optimizer, stack: StackedTransformer) -> list[str]:
    name_of = {id(p): n for n, p in stack.named_stacked()}
    return [name_of[id(p)] for group in optimizer.param_groups for p in group["params"]]


def optimizer_state_of(optimizer: torch.optim.Optimizer, stack: StackedTransformer, i: int) -> dict:
    """Model ``i``'s AdamW state as the one-model trainer writes it (``full_state_dicts``): ``{"state":
    {name: {"step", "exp_avg", "exp_avg_sq"}}, "param_groups": [{..., "params": [names]}]}``, CPU copies."""
    sd = optimizer.state_dict()
    order = _param_names(optimizer, stack)
    state = {}
    for j, st in sd["state"].items():
        state[order[j]] = {k: (v.detach().cpu().clone() if k == "step" else v[i].detach().cpu().clone())
                           if isinstance(v, Tensor) else v for k, v in st.items()}
    groups = [{**g, "params": [order[j] for j in g["params"]]} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def load_optimizer_states(optimizer: torch.optim.Optimizer, stack: StackedTransformer, states: Sequence[dict]
                          ) -> None:
    """Load ``K`` one-model AdamW states (:func:`optimizer_state_of`'s format, as in a checkpoint) into the
    stack's optimizer. The models must be at the same step with the same group settings."""
    if len(states) != stack.k:
        raise ValueError(f"load_optimizer_states: expected {stack.k} states, got {len(states)}")
    order = _param_names(optimizer, stack)
    groups0 = states[0]["param_groups"]
    for i, st in enumerate(states):
        if st["param_groups"] != groups0:
            raise ValueError(f"load_optimizer_states: model {i}'s param_groups differ from model 0's")
    index = {n: j for j, n in enumerate(order)}
    state = {}
    for name in order:
        per = [st["state"].get(name) for st in states]
        if all(p is None for p in per):
            continue
        if any(p is None for p in per):
            raise ValueError(f"load_optimizer_states: {name} has optimizer state in some models only")
        entry = {}
        for key, v0 in per[0].items():
            if key == "step":
                steps = {float(p[key]) for p in per}
                if len(steps) != 1:
                    raise ValueError(f"load_optimizer_states: {name}: the models are at different steps {steps}")
                entry[key] = v0.clone() if isinstance(v0, Tensor) else v0
            elif isinstance(v0, Tensor):
                entry[key] = torch.stack([p[key] for p in per])
            else:
                entry[key] = v0
        state[index[name]] = entry
    groups = [{**g, "params": [index[n] for n in g["params"]]} for g in groups0]
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# -- one training step -----------------------------------------------------------------------------------------------

@dataclass
class StepResult:
    """One stacked step: per model, the loss (the mean over the micro-batches, as the trainer logs it),
    the gradient norm before clipping, and ``{kind: mean loss of this step's micro-batches of that kind}``."""

    losses: list[float]
    grad_norms: list[float]
    kind_losses: list[dict[str, float]]


class StackDivergedError(RuntimeError):
    """A model's loss or gradient norm became NaN/inf; the step stopped before the update (no model was
    changed). ``models``: the indices in the stack; ``what``: ``"loss"`` or ``"gradient norm"``; ``values``:
    every model's value."""

    def __init__(self, what: str, models: list[int], values: list[float]):
        self.what, self.models, self.values = what, models, values
        super().__init__(f"{what} is not finite for model(s) {models} of the stack: {values}")


def _stop_unless_finite(optimizer: torch.optim.Optimizer, what: str, values: list[float]) -> None:
    bad = [i for i, v in enumerate(values) if not math.isfinite(v)]
    if bad:
        optimizer.zero_grad(set_to_none=True)
        raise StackDivergedError(what, bad, values)


def train_step(stack: StackedTransformer, optimizer: torch.optim.Optimizer, micro_batches: Sequence[Sequence[Batch]],
               lr: float, grad_clip: float, *, doc_mask: bool = True) -> StepResult:
    """One optimizer step of every model, as :func:`difftx.training.train` takes it in one process:
    ``micro_batches[m][i]`` is model ``i``'s ``m``-th micro-batch (``grad_accum`` of them); the loss of
    each is divided by ``grad_accum``; then per-model clipping (``grad_clip`` <= 0: none), AdamW at
    ``lr`` and ``zero_grad``. ``doc_mask`` (``TrainConfig.doc_mask``): batches' ``doc_ids`` keep packed
    documents apart. A non-finite loss or gradient norm of any model raises :class:`StackDivergedError`
    before the update, as the trainer stops before applying it."""
    device = stack.model_tree.tok_embeddings.weight.device
    for group in optimizer.param_groups:
        group["lr"] = lr
    accum = len(micro_batches)
    total = torch.zeros(stack.k, device=device)
    kinds: dict[str, list] = {}
    for batches in micro_batches:
        sb = stack_batches(batches, device)
        docs = sb.doc_ids[..., :-1] if doc_mask and sb.doc_ids is not None else None
        loss = stack.losses(sb.tokens, sb.loss_mask, sb.mask_total, docs) / accum  # (K,)
        loss.sum().backward()
        total += loss.detach()
        if sb.kind is not None:
            kinds.setdefault(sb.kind, []).append(loss.detach())
    losses = total.tolist()
    _stop_unless_finite(optimizer, "loss", losses)
    norms = clip_grad_norms_(stack, grad_clip if grad_clip > 0 else float("inf")).tolist()
    _stop_unless_finite(optimizer, "gradient norm", norms)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    per_kind = {kind: (torch.stack(v).sum(0) * accum / len(v)).tolist() for kind, v in kinds.items()}
    return StepResult(losses, norms, [{kind: vals[i] for kind, vals in per_kind.items()} for i in range(stack.k)])
