"""K models of one :class:`~difftx.config.ModelConfig` trained together as one *stacked* model.

The stack holds the one model's module tree (:class:`~difftx.model.Transformer`, built without drawing
weights) whose every parameter carries a leading ``K`` dimension: model ``i`` of the stack is
``{name: p[i]}``, an ordinary state dict under the one model's names. Its loss is the one model's own
``forward(x, targets=y, ...)`` (one code for the model and the stack), run one of two ways:

- the built-in attention kinds (:meth:`~difftx.attention.modules.AttentionKind.stacks_natively`): the tree
  itself runs that forward with its ``(K, ...)`` weights; every op the forward calls takes a leading ``K``
  (:mod:`difftx.ops`; the attention kernels see the ``K * B`` sequences as one batch, each model's lambda
  for its own);
- any other kind (one that overrides ``_qkv``, ``finish``, ``forward``...): ``torch.vmap`` over the one model
  (``torch.func.functional_call`` with each model's weights), which runs the kind's code as written; the
  model's own Functions have vmap rules that fold ``K`` into their batch. :class:`StackedTransformer` tries
  such a kind once when it is built and refuses it in one line if the map cannot run it.

So the many small calls of a small model's step are paid once per step instead of ``K`` times, and a
stacked step matches ``K`` separate steps to float32 rounding.

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

- :meth:`StackedTransformer.losses`: per-model loss ``(K,)``, the model's ``forward`` with
  :func:`difftx.model.loss_rows` of a loss mask (each model's rows padded to the largest count with
  weight 0).
- :func:`difftx.training.optim.clip_grad_norms_` and :func:`~difftx.training.optim.build_optimizer`
  take a stack as they take one model: each model's gradient clipped by its own norm, and AdamW with
  the groups decided on each parameter's per-model slice (AdamW is elementwise and the step count is
  shared, so one optimizer over the stacked tensors is ``K`` optimizers).
- :meth:`StackedTransformer.state_dict_of` / :meth:`~StackedTransformer.load_state_dicts`,
  :func:`optimizer_state_of` / :func:`load_optimizer_states`: one model's weights and AdamW state in
  the trainer's checkpoint format (parameter names as keys), and back.

Supported: every attention kind, every option of :data:`difftx.arm_table.ARMS`, tied embeddings, packed-document
masks (``doc_ids``), grad accumulation, float32 and float64 weights. Not supported: autocast / float16 /
bfloat16 (refused), DDP / FSDP (one process holds the whole stack), KV caches (training only;
:meth:`StackedTransformer.model` gives an ordinary model for probes and evaluation). The attention kernel is
the one the config's ``backend`` resolves to (``chunked`` on CPU); the code is device-agnostic but has only
run on CPU.

:func:`tune_allocator` (glibc): a stack's step allocates tensors K times a model's, which glibc serves by
fresh ``mmap`` calls (a page fault per 4 KiB, every step) unless told to keep freed blocks; call it once
in a process that trains a stack.

Speed against separate models: ``benchmarks/stack_throughput.py``; the measured ratios are in
docs/results.md ("Stacked seeds: throughput").
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch
import torch.nn as nn
from torch import Tensor
from torch.func import functional_call

from ..config import ModelConfig
from ..model import Transformer, _check_token_ids, loss_rows
from .batches import Batch
from .optim import set_lambda_scale, set_lr, update

__all__ = ["StackedTransformer", "StepResult", "load_optimizer_states", "optimizer_state_of",
           "stack_batches", "train_step", "tune_allocator"]


# -- the allocator ---------------------------------------------------------------------------------------------------

def tune_allocator(mmap_threshold: int = 1 << 30, trim_threshold: int = 1 << 30) -> bool:
    """Keep freed large blocks in glibc's heap instead of unmapping them: a stack's step allocates tensors of
    megabytes (K times a model's), which glibc otherwise serves by fresh ``mmap`` and pays a page fault per
    4 KiB on first touch, step after step (``sys`` time). Process-wide (every tensor, the separate models'
    too); the heap then keeps its peak size. Returns False where it does not apply (not glibc)."""
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
    parameters under the one model's names. Each model's loss is the one model's own ``forward``: the tree
    runs it with its ``(K, ...)`` weights when every attention kind stacks natively (``native``: every op takes
    the leading ``K``, :mod:`difftx.ops`), else ``torch.vmap`` runs it over the one model with each model's
    weights (see the module doc). Build it with :meth:`from_models` or :meth:`from_state_dicts`."""

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
        # the one model (meta weights) whose forward vmap runs for each model; not a submodule: no parameters
        self.__dict__["_one"] = _reference(config)
        self.native = all(type(b.attn).stacks_natively() for b in tree.layers)

    def set_lambda_scale(self, scale: float) -> None:
        """The lambda warm-up factor of every model of the stack (:func:`difftx.training.optim.set_lambda_scale`
        on the tree and on the one model that ``torch.vmap`` runs)."""
        for tree in (self.model_tree, self._one):
            set_lambda_scale(tree, scale)

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
        stack.check_runs()
        return stack

    def check_runs(self) -> None:
        """Try a kind that the stack maps with ``torch.vmap`` once, on 8 tokens of each model: a kind the map
        cannot run (a value read inside its forward, an op without a batching rule) raises one ValueError now,
        not mid-run, and a map that computed another loss than model 0's own would too. The built-in kinds
        need no try (their equality is tested)."""
        if self.native:
            return
        name = self.config.attention
        kind = type(self.model_tree.layers[0].attn).__name__
        device = self.model_tree.tok_embeddings.weight.device
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, self.config.vocab_size, (self.k, 1, 9), generator=g).to(device)
        try:
            loss = self.losses(tokens)
            loss.sum().backward()
        except Exception as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            alone = self._fails_alone(tokens[0])
            if alone is not None:  # the kind's own error: training alone (stack=1) would not help
                raise ValueError(f"attention kind {name!r} ({kind}) fails in its forward or backward, alone as "
                                 f"stacked ({alone}); fix the kind") from e
            raise ValueError(f"attention kind {name!r} ({kind}) cannot be trained stacked: torch.vmap over its "
                             f"forward failed ({type(e).__name__}: {first}); train its seeds one by one "
                             f"(difftx compare --set stack=1)") from e
        finally:
            self.zero_grad(set_to_none=True)
        with torch.no_grad():
            alone = float(self.model(0)(tokens[0, :, :-1], targets=tokens[0, :, 1:]))
        stacked = loss[0].item()
        if not math.isclose(stacked, alone, rel_tol=1e-4):
            raise ValueError(f"attention kind {name!r} ({kind}) computes another loss stacked ({stacked:.6f}) "
                             f"than alone ({alone:.6f}): its forward depends on something the map does not carry "
                             f"(module state, randomness); train its seeds one by one (difftx compare --set stack=1)")

    def _fails_alone(self, tokens: Tensor) -> Optional[str]:
        """``FILE:LINE: Error: message`` when model 0 alone fails a training step on ``tokens`` ``(1, T)`` (the line
        in the kind's own file where it has one), else None."""
        from ..attention.registry import code_digest, error_site

        model = self.model(0)
        try:
            model(tokens[:, :-1], targets=tokens[:, 1:]).backward()
        except Exception as e:  # noqa: BLE001 - described in one line for the caller's error
            where = code_digest(type(model.layers[0].attn))["file"]
            first = (str(e).strip().splitlines() or [""])[0]
            return f"{error_site(e, where) + ': ' if where else ''}{type(e).__name__}: {first}"
        finally:
            model.zero_grad(set_to_none=True)
        return None

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
    def _one_loss(self, params: dict, x: Tensor, y: Tensor, docs: Optional[Tensor], rows: Optional[Tensor],
                  weights: Optional[Tensor]) -> Tensor:
        """One model's loss: the one model's own ``forward`` with ``params`` (what ``torch.vmap`` maps over)."""
        return functional_call(self._one, params, (x,), {"doc_ids": docs, "targets": y, "loss_rows": rows,
                                                        "loss_weights": weights})

    def losses(self, tokens: Tensor, loss_mask: Optional[Tensor] = None, mask_total: Optional[Sequence] = None,
               doc_ids: Optional[Tensor] = None, targets: Optional[Tensor] = None) -> Tensor:
        """Each model's training loss ``(K,)`` on its batch: ``tokens`` ``(K, B, T+1)`` (inputs and
        next-token targets), ``loss_mask`` ``(K, B, T)`` bool or None, ``mask_total``: each model's
        global count of loss positions (``Batch.mask_total``; None entries: its own mean), ``doc_ids``
        ``(K, B, T)`` of the inputs or None, ``targets`` ``(K, B, T)`` or None (the next tokens). Each is the one
        model's ``forward(x, targets=y, ...)``
        (:func:`difftx.model.loss_rows` for a mask, padded to the models' largest count), all ``K`` in one
        call: the tree's own forward (``native``) or one ``torch.vmap`` over the stacked weights."""
        device_type = self.model_tree.tok_embeddings.weight.device.type
        if torch.is_autocast_enabled(device_type):
            raise ValueError("StackedTransformer: autocast is not supported (float32 or float64 weights only); "
                             "train the stack outside torch.autocast")
        if tokens.dim() != 3 or tokens.shape[0] != self.k:
            raise ValueError(f"tokens must be (K={self.k}, batch, time+1), got shape {tuple(tokens.shape)}")
        _check_token_ids(tokens, self.config.vocab_size)  # the map cannot read values
        if targets is not None:
            _check_token_ids(targets, self.config.vocab_size)
        x, y = tokens[..., :-1], (tokens[..., 1:] if targets is None else targets)
        rows = weights = None
        if loss_mask is not None:
            totals = [None] * self.k if mask_total is None else list(mask_total)
            n_max = max(int(loss_mask[i].sum()) for i in range(self.k))
            pairs = [loss_rows(loss_mask[i], totals[i], pad_to=max(n_max, 1)) for i in range(self.k)]
            rows, weights = (torch.stack(t) for t in zip(*pairs))
        if self.native:  # the one model's forward on its own tree, every weight with its leading K
            return self.model_tree(x, doc_ids=doc_ids, targets=y, loss_rows=rows, loss_weights=weights)
        params = dict(self.named_stacked())
        dims = (0, 0, 0, None if doc_ids is None else 0, None if rows is None else 0, None if rows is None else 0)
        return torch.vmap(self._one_loss, in_dims=dims)(params, x, y, doc_ids, rows, weights)

    def forward(self, tokens: Tensor, loss_mask: Optional[Tensor] = None, mask_total: Optional[Sequence] = None,
                doc_ids: Optional[Tensor] = None, targets: Optional[Tensor] = None) -> Tensor:
        """:meth:`losses`."""
        return self.losses(tokens, loss_mask, mask_total, doc_ids, targets)


# -- batches ---------------------------------------------------------------------------------------------------------

@dataclass
class StackedBatch:
    """``K`` models' batches of one step: ``tokens (K, B, T+1)``; ``loss_mask (K, B, T)`` or None;
    ``mask_total`` per model; ``kind`` (the same for every model, or None); ``doc_ids (K, B, T+1)`` or None;
    ``targets (K, B, T)`` or None (the next tokens)."""

    tokens: Tensor
    loss_mask: Optional[Tensor] = None
    mask_total: Optional[list] = None
    kind: Optional[str] = None
    doc_ids: Optional[Tensor] = None
    targets: Optional[Tensor] = None


def stack_batches(batches: Sequence[Batch], device=None) -> StackedBatch:
    """One step's :class:`~difftx.training.batches.Batch` of each model, stacked. Every model's batch
    must have the same shape and kind, and either all or none a loss mask."""
    if not batches:
        raise ValueError("stack_batches: need one batch per model")
    shapes = {tuple(b.tokens.shape) for b in batches}
    kinds = {b.kind for b in batches}
    masked = {b.loss_mask is not None for b in batches}
    targeted = {b.targets is not None for b in batches}
    if len(shapes) != 1 or len(kinds) != 1 or len(masked) != 1 or len(targeted) != 1:
        raise ValueError(f"stack_batches: the models' batches of one step differ (shapes {sorted(shapes)}, kinds "
                         f"{sorted(map(str, kinds))}, loss masks {sorted(masked)}, targets {sorted(targeted)}); a "
                         "stack needs one shape and kind")
    tokens = torch.stack([b.tokens for b in batches]).to(device)
    mask = totals = None
    if masked.pop():
        mask = torch.stack([b.loss_mask for b in batches]).to(device)
        totals = [b.mask_total for b in batches]
    docs = None
    if all(b.doc_ids is not None for b in batches):
        docs = torch.stack([b.doc_ids for b in batches]).to(device)
    targets = torch.stack([b.targets for b in batches]).to(device) if targeted.pop() else None
    return StackedBatch(tokens, mask, totals, kinds.pop(), docs, targets)


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


def train_step(stack: StackedTransformer, optimizer: torch.optim.Optimizer, micro_batches: Sequence[Sequence[Batch]],
               lr: float, grad_clip: float, *, doc_mask: bool = True) -> StepResult:
    """One optimizer step of every model, as :func:`difftx.training.train` takes it in one process:
    ``micro_batches[m][i]`` is model ``i``'s ``m``-th micro-batch (``grad_accum`` of them); the loss of
    each is divided by ``grad_accum``; then per-model clipping (``grad_clip`` <= 0: none), AdamW at
    ``lr`` and ``zero_grad`` (:func:`difftx.training.optim.update`, the one model's rule). ``doc_mask``
    (``TrainConfig.doc_mask``): batches' ``doc_ids`` keep packed documents apart. A non-finite loss or
    gradient norm of any model raises :class:`~difftx.training.optim.TrainingDivergedError` naming the
    models, before the update."""
    device = stack.model_tree.tok_embeddings.weight.device
    set_lr(optimizer, lr)
    accum = len(micro_batches)
    total = torch.zeros(stack.k, device=device)
    kinds: dict[str, list] = {}
    for batches in micro_batches:
        sb = stack_batches(batches, device)
        docs = sb.doc_ids[..., :-1] if doc_mask and sb.doc_ids is not None else None
        loss = stack.losses(sb.tokens, sb.loss_mask, sb.mask_total, docs, sb.targets) / accum  # (K,)
        loss.sum().backward()
        total += loss.detach()
        if sb.kind is not None:
            kinds.setdefault(sb.kind, []).append(loss.detach())
    losses = total.tolist()
    norms = update(stack, optimizer, losses, grad_clip)
    per_kind = {kind: (torch.stack(v).sum(0) * accum / len(v)).tolist() for kind, v in kinds.items()}
    return StepResult(losses, norms, [{kind: vals[i] for kind, vals in per_kind.items()} for i in range(stack.k)])
