"""One optimizer step: of one model (:class:`Stepper`: the micro-batches' forward and backward, the reduction
over ranks, the update) or of a stack of models (:class:`StackedStepper`), each measured as a
:class:`StepOutcome` per model."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from .batches import Batch, as_batch, batch_loss_rows
from .distributed import all_reduce_mean, full_state_dicts, full_tensor
from .optim import build_optimizer, lambda_scale_at, lr_at, set_lambda_scale, set_lr, update
from .setup import RunSetup, autocast
from .signals import _StopSignal
from .stacked import StackedTransformer, load_optimizer_states, train_step, tune_allocator


@dataclass
class StepOutcome:
    """What one optimizer step measured: losses are means over the global batch."""

    loss: float
    grad_norm: float
    lr: float
    tokens: int
    kind_losses: dict[str, float]
    stop_now: bool


class Stepper:
    """The optimizer steps of one model (on every rank: DDP / FSDP2 reduce the gradients), at the schedule's
    learning rate."""

    def __init__(self, setup: RunSetup) -> None:
        self.config, self.device, self.dtype, self.dist = setup.config, setup.device, setup.dtype, setup.dist
        self.model, self.bare, self.optimizer, self.scaler = setup.model, setup.bare, setup.optimizer, setup.scaler
        self.loader = setup.loader

    def _micro_loss(self, batch: Batch) -> torch.Tensor:
        """One micro-batch's loss, divided by ``grad_accum`` (its share of the step's gradient)."""
        config, device = self.config, self.device
        tokens, doc_ids = batch.tokens, batch.doc_ids  # (B, T+1) each
        x, y = tokens[:, :-1].to(device), batch.target_tokens().to(device)  # (B, T): inputs, their targets
        d = doc_ids[:, :-1].to(device) if config.doc_mask and doc_ids is not None else None
        with autocast(device, self.dtype):
            return self.model(x, doc_ids=d, targets=y, **batch_loss_rows(batch, device, self.dist.world_size)
                              ) / config.grad_accum

    def _accumulate(self) -> tuple[torch.Tensor, dict[str, list], int]:
        """Forward and backward over the step's ``grad_accum`` micro-batches; gradients are reduced
        across ranks on the last micro-batch only. Returns the summed loss, each batch kind's
        micro-batch losses and this rank's token count."""
        model, config = self.model, self.config
        loss_sum = torch.zeros((), device=self.device)
        step_tokens, kinds = 0, {}
        for micro in range(config.grad_accum):
            batch = as_batch(self.loader.next_batch())
            step_tokens += batch.tokens[:, :-1].numel()
            last = micro == config.grad_accum - 1
            if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
                model.set_requires_gradient_sync(last)
            sync = contextlib.nullcontext() if last or not hasattr(model, "no_sync") else model.no_sync()
            with sync:
                loss = self._micro_loss(batch)
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            loss_sum += loss.detach().float()
            if batch.kind is not None:
                kinds.setdefault(batch.kind, []).append(loss.detach().float())
        return loss_sum, kinds, step_tokens

    def _reduce(self, loss_sum: torch.Tensor, kinds: dict[str, list], signal: _StopSignal
                ) -> tuple[float, dict, bool]:
        """The step's loss and each kind's mean micro-batch loss over every rank, and whether any
        rank was asked to stop (one all-reduce carries them all)."""
        if self.dist.distributed:
            flags = torch.stack([loss_sum, *(torch.stack(v).sum() for v in kinds.values()),
                                 torch.tensor(float(signal.requested), device=self.device)])
            values = all_reduce_mean(flags).tolist()
            stop = values.pop() > 0
        else:  # no collective, no extra tensors
            values = [loss_sum.item(), *(sum(t.item() for t in v) for v in kinds.values())]
            stop = signal.requested
        kind_losses = {kind: v * self.config.grad_accum / len(micro)  # the mean of this kind's micro-batch losses
                       for (kind, micro), v in zip(kinds.items(), values[1:])}
        return values[0], kind_losses, stop

    def step(self, step: int, signal: _StopSignal) -> StepOutcome:
        """One optimizer step at the schedule's learning rate: the micro-batches' forward and backward, then
        :func:`~difftx.training.optim.update` (a stack's rule too)."""
        lr = lr_at(step, self.config)
        set_lr(self.optimizer, lr)
        if self.config.lambda_warmup:
            set_lambda_scale(self.bare, lambda_scale_at(step, self.config))
        loss_sum, kinds, step_tokens = self._accumulate()
        loss, kind_losses, stop_now = self._reduce(loss_sum, kinds, signal)
        grad_norm = update(self.model, self.optimizer, [loss], self.config.grad_clip, self.scaler, full_tensor)[0]
        return StepOutcome(loss, grad_norm, lr, step_tokens * self.dist.world_size, kind_losses, stop_now)


class StackedStepper:
    """The optimizer steps of ``K`` models of one setup each, stepped as one stacked model
    (:mod:`difftx.training.stacked`). The stack holds the optimizer state (resumed from each setup's optimizer,
    whose state it then owns: the setups' are dropped); each setup's own module is not stepped."""

    def __init__(self, setups: list[RunSetup]) -> None:
        tune_allocator()  # glibc keeps the stack's large blocks instead of mapping them anew every step
        self.setups, first = setups, setups[0]
        self.config, self.k = first.config, len(setups)
        self.stack = StackedTransformer.from_models([s.bare for s in setups])
        self.optimizer = build_optimizer(self.stack, self.config)
        if first.resume_dir is not None:
            load_optimizer_states(self.optimizer, self.stack, [full_state_dicts(s.model, s.optimizer)[1]
                                                               for s in setups])
        for s in setups:  # the stack holds the optimizer state now
            s.optimizer = None

    def step(self, step: int, signal: _StopSignal) -> list[StepOutcome]:
        """One optimizer step of every model (:func:`difftx.training.stacked.train_step`, what
        :meth:`Stepper.step` does for one model); a model whose loss or gradient is not finite stops the
        stack before the update (the loop names it)."""
        config = self.config
        micro = [[as_batch(s.loader.next_batch()) for s in self.setups] for _ in range(config.grad_accum)]
        lr = lr_at(step, config)
        if config.lambda_warmup:  # the stack computes; each run's own module is probed
            scale = lambda_scale_at(step, config)
            self.stack.set_lambda_scale(scale)
            for s in self.setups:
                set_lambda_scale(s.bare, scale)
        out = train_step(self.stack, self.optimizer, micro, lr, config.grad_clip, doc_mask=config.doc_mask)
        tokens = sum(batches[0].tokens[:, :-1].numel() for batches in micro)
        return [StepOutcome(out.losses[i], out.grad_norms[i], lr, tokens, out.kind_losses[i], signal.requested)
                for i in range(self.k)]
