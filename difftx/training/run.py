"""The training loop and the steps of a run: :func:`_loop` drives one model (:class:`_Run`) or a stack
(:class:`_StackedRun`), each step followed by logging, probes, validation and checkpoints; :func:`evaluate`
(the validation pass)."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn

from ..io import eval_mode
from . import checkpointing as ckpt
from .batches import Batch, as_batch, batch_loss_rows
from .config import TrainConfig
from .distributed import all_reduce_mean, full_state_dicts, full_tensor, is_sharded
from .metrics import MetricsLogger, lambda_per_layer
from .optim import TrainingDivergedError, build_optimizer, lambda_scale_at, lr_at, set_lambda_scale, set_lr, update
from .setup import RunSetup, TrainResult
from .signals import STOP_HINT, _held_sigint, _StopSignal


@dataclass
class _StepOutcome:
    """What one optimizer step measured: losses are means over the global batch."""

    loss: float
    grad_norm: float
    lr: float
    tokens: int
    kind_losses: dict[str, float]
    stop_now: bool


@torch.no_grad()
def evaluate(model: nn.Module, store, config: TrainConfig, device: torch.device, dtype: torch.dtype,
             world_size: int = 1) -> Optional[float]:
    """Mean validation loss over the first ``eval_batches`` batches of the global batch size
    (``batch_size * world_size`` sequences) of ``store``: the same windows whatever the number
    of processes. Every rank evaluates all of them (simple, and FSDP2 needs every rank in
    every forward); ``None`` if ``store`` holds no window."""
    total, rows = 0.0, 0
    with eval_mode(model):
        for tokens, doc_ids in store.eval_batches(config.batch_size * world_size, config.seq_len,
                                                  max_batches=config.eval_batches):
            x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # (b, T) each
            d = doc_ids[:, :-1].to(device) if config.doc_mask else None
            with _autocast(device, dtype):
                total += float(model(x, doc_ids=d, targets=y)) * x.shape[0]  # the last batch may be smaller
            rows += x.shape[0]
    return total / rows if rows else None


def val_tokens(store, config: TrainConfig, world_size: int = 1) -> int:
    """Tokens one validation pass of :func:`evaluate` scores (predicted positions)."""
    if store is None:
        return 0
    windows = max(0, (len(store) - 1) // config.seq_len)
    return min(windows, config.eval_batches * config.batch_size * world_size) * config.seq_len


def _autocast(device: torch.device, dtype: torch.dtype):
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


class _Run(RunSetup):
    """One call of :func:`train`, in named steps: :meth:`start` (where from), :meth:`load_data`,
    :meth:`build_model`, :meth:`restore`, :meth:`open_output`, then :meth:`loop`, which runs
    :meth:`step`, :meth:`log`, :meth:`probe`, :meth:`validate` and :meth:`save`. The steps run in
    this order, which fixes the order of random draws (the weights are drawn after the data is
    prepared), so a resumed run repeats the uninterrupted one bitwise."""

    # -- the loop -------------------------------------------------------------------------------

    # the one-model run as a driver of :func:`_loop`: one run, stepped by its own optimizer

    @property
    def runs(self) -> list[_Run]:
        return [self]

    def loop(self, bar_kw: dict) -> TrainResult:
        """Steps from the start step to the end step (:func:`_loop`)."""
        self.model.train()
        return _loop(self, bar_kw)[0]

    def step_all(self, step: int, signal: "_StopSignal") -> list[_StepOutcome]:
        return [self.step(step, signal)]

    def after_steps(self, step: int, outcomes: list[_StepOutcome], bar) -> None:
        self.after_step(step, outcomes[0], bar)

    def begin(self, bar_kw: dict, banner: bool = True):
        """The progress bar (and the banner line above it); the metrics record's sums start empty."""
        from tqdm.auto import tqdm

        config, dist = self.config, self.dist
        bar = tqdm(total=config.steps, initial=self.start_step, disable=not (dist.is_main and config.progress),
                   **{"desc": "train", "unit": "step", "dynamic_ncols": True, **bar_kw})
        if banner and dist.is_main and config.progress:
            bar.write(self._banner())
        self.start_sums()
        return bar

    def start_sums(self) -> None:
        """The sums since the last log record: empty, or (a resume between two records) as the checkpoint
        kept them, so the record after it covers the steps before the stop too."""
        kept = getattr(self, "kept_sums", None) or {}
        self.t_log, self.tokens_at_log = time.perf_counter(), int(kept.get("tokens", 0))
        # batch kind -> [sum of step losses, steps] since the last log record
        self.kind_log: dict[str, list] = {k: list(v) for k, v in kept.get("kinds", {}).items()}
        self.step_norms: list[float] = list(kept.get("grad_norms", []))  # each step's gradient norm since the record

    def after_step(self, step: int, outcome: _StepOutcome, bar) -> None:
        """Log, probe, validate and save as this step asks (:meth:`due`)."""
        self.log(step, outcome, bar)
        self.probe(step)
        self.validate(step, bar)
        if self.saves_at(step, outcome.stop_now):
            self.save(step)

    def stopped(self, step: int, signal: "_StopSignal", bar) -> None:
        self.result.stopped_by = signal.name or "a signal on another rank"
        if self.dist.is_main:
            bar.write(f"difftx train: stopped by {self.result.stopped_by} after step {step}; checkpoint "
                      f"{self.result.last_checkpoint}; {STOP_HINT[0]}")

    def finish(self) -> TrainResult:
        result = self.result
        result.elapsed_s = time.perf_counter() - self.t_start
        if self.train_time is not None:
            result.train_time_s += self.train_time
        return result

    # what a step asks for after it

    def logs_at(self, step: int) -> bool:
        return step % self.config.log_interval == 0 or step == self.end_step

    def probes_at(self, step: int) -> bool:
        every = self.probe_every
        if isinstance(every, frozenset):
            return step in every
        return bool(every) and step > 0 and (step % every == 0 or step == self.config.steps)

    def validates_at(self, step: int) -> bool:
        config = self.config
        return bool(config.eval_interval) and self.val_store is not None and (
            step % config.eval_interval == 0 or step == config.steps)

    def saves_at(self, step: int, stop: bool) -> bool:
        interval = self.config.ckpt_interval
        return bool(interval and step % interval == 0) or step == self.end_step or stop

    def due(self, step: int, stop: bool) -> bool:
        """Whether anything after this step reads the weights (a log record's λ, a probe, a
        validation pass, a checkpoint)."""
        return self.logs_at(step) or self.probes_at(step) or self.validates_at(step) or self.saves_at(step, stop)

    def _banner(self) -> str:
        config, dist = self.config, self.dist
        start = f"resuming at step {self.start_step}" if self.resume_dir is not None else (
            f"from {self.init_dir}" if self.init_dir is not None else "from scratch")
        rows = config.batch_size * config.grad_accum * dist.world_size
        per_step = f"{rows * config.seq_len:,} tokens/step" if self.source is None else f"{rows} sequences/step"
        return (f"difftx train: {self.model_config.attention} model, {self.bare.num_parameters():,} parameters, "
                f"{per_step} on {dist.world_size} x {self.device} ({str(self.dtype)[6:]}); {start}; "
                f"writing to {self.out_dir}")

    def _micro_loss(self, batch: Batch) -> torch.Tensor:
        """One micro-batch's loss, divided by ``grad_accum`` (its share of the step's gradient)."""
        config, device = self.config, self.device
        tokens, doc_ids = batch.tokens, batch.doc_ids  # (B, T+1) each
        x, y = tokens[:, :-1].to(device), batch.target_tokens().to(device)  # (B, T): inputs, their targets
        d = doc_ids[:, :-1].to(device) if config.doc_mask and doc_ids is not None else None
        with _autocast(device, self.dtype):
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

    def _reduce(self, loss_sum: torch.Tensor, kinds: dict[str, list], signal: "_StopSignal"
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

    def step(self, step: int, signal: "_StopSignal") -> _StepOutcome:
        """One optimizer step at the schedule's learning rate (:func:`_loop` records it): the micro-batches'
        forward and backward, then :func:`~difftx.training.optim.update` (a stack's rule too)."""
        lr = lr_at(step, self.config)
        set_lr(self.optimizer, lr)
        if self.config.lambda_warmup:
            set_lambda_scale(self.bare, lambda_scale_at(step, self.config))
        loss_sum, kinds, step_tokens = self._accumulate()
        loss, kind_losses, stop_now = self._reduce(loss_sum, kinds, signal)
        grad_norm = update(self.model, self.optimizer, [loss], self.config.grad_clip, self.scaler, full_tensor)[0]
        return _StepOutcome(loss, grad_norm, lr, step_tokens * self.dist.world_size, kind_losses, stop_now)

    def record(self, step: int, outcome: _StepOutcome, seconds: float) -> None:
        """Count a step taken: the result's step, tokens, loss and training time, and what the next
        metrics record sums (each kind's loss, every gradient norm, tokens since the last record)."""
        for kind, v in outcome.kind_losses.items():
            acc = self.kind_log.setdefault(kind, [0.0, 0])
            acc[0] += v
            acc[1] += 1
        self.step_norms.append(outcome.grad_norm)
        result = self.result
        result.step, result.tokens_seen = step, result.tokens_seen + outcome.tokens
        result.losses[step] = outcome.loss
        self.tokens_at_log += outcome.tokens
        result.train_time_s += seconds

    # -- after a step ---------------------------------------------------------------------------

    def log(self, step: int, outcome: _StepOutcome, bar) -> None:
        """A metrics record every ``log_interval`` steps and at the end step: the step's loss, LR
        and gradient norm, every gradient norm since the last record, throughput, λ per layer, and
        each batch kind's mean loss since the last record."""
        if not self.logs_at(step):
            return
        lambdas = lambda_per_layer(self.bare)  # collective under FSDP2
        now = time.perf_counter()
        tok_s = self.tokens_at_log / max(now - self.t_log, 1e-9)
        self.t_log, self.tokens_at_log = now, 0
        time_s = (self.train_time or 0.0) + self.result.train_time_s
        self.logger.log({"step": step, "loss": outcome.loss, "lr": outcome.lr, "grad_norm": outcome.grad_norm,
                         "grad_norms": self.step_norms, "tokens_per_s": tok_s, "tokens": self.result.tokens_seen,
                         "time_s": time_s, "lambda": lambdas,
                         **({"lambda_scale": lambda_scale_at(step, self.config)} if self.config.lambda_warmup
                            else {}),
                         **{f"{k}_loss": v / n for k, (v, n) in self.kind_log.items() if n}})
        self.kind_log, self.step_norms = {}, []
        post = {"loss": f"{outcome.loss:.4f}", "tok/s": f"{tok_s:,.0f}"}
        if lambdas:
            post["λ"] = ",".join(f"{v:.2f}" for v in lambdas[:8]) + ("…" if len(lambdas) > 8 else "")
        bar.set_postfix(post, refresh=False)

    def _eval_model(self) -> nn.Module:
        """The model for probes and validation: the wrapper under FSDP2 (its forward gathers the
        shards), the bare module otherwise."""
        return self.model if is_sharded(self.bare) else self.bare

    def probe(self, step: int) -> None:
        """The probe hook at its steps and at the last step of the schedule (before a checkpoint
        of this step)."""
        if self.probes_at(step):
            self.result.probes[step] = _probe(self.probe_fn, self._eval_model(), step, self.logger)

    def probe_start(self) -> None:
        """The probe hook on the initial model (step 0), before the first step of a run that starts
        afresh, when its steps (a set) hold 0; a warm-up's lambda factor is the first step's."""
        if self.start_step or not isinstance(self.probe_every, frozenset) or 0 not in self.probe_every:
            return
        if self.config.lambda_warmup:
            set_lambda_scale(self.bare, lambda_scale_at(1, self.config))
        self.probe(0)

    def validate(self, step: int, bar) -> None:
        """A validation pass every ``eval_interval`` steps and at the last step of the schedule."""
        if not self.validates_at(step):
            return
        config, val_store = self.config, self.val_store
        ws = self.dist.world_size
        val = evaluate(self._eval_model(), val_store, config, self.device, self.dtype, ws)
        if val is None:
            return
        self.result.val_losses[step] = val
        self.logger.log({"step": step, "val_loss": val, "val_tokens": val_tokens(val_store, config, ws)})
        if self.dist.is_main and config.progress:
            bar.write(f"step {step}: val_loss {val:.4f}")


class _StackedRun:
    """``K`` :class:`_Run` objects (set up as :func:`train` sets one up: their own seed's weights,
    checkpoint, loader, metrics log) stepped as one stacked model. Each run's own module holds a
    copy of its weights, refreshed from the stack before anything reads them (a log record's λ, a
    probe, a validation pass); its checkpoints are written from the stack."""

    def __init__(self, runs: list[_Run]) -> None:
        from .stacked import StackedTransformer, load_optimizer_states, tune_allocator

        tune_allocator()  # glibc keeps the stack's large blocks instead of mapping them anew every step
        self.runs, first = runs, runs[0]
        self.config, self.k = first.config, len(runs)
        self.stack = StackedTransformer.from_models([r.bare for r in runs])
        self.optimizer = build_optimizer(self.stack, self.config)
        if first.resume_dir is not None:
            load_optimizer_states(self.optimizer, self.stack, [full_state_dicts(r.model, r.optimizer)[1] for r in runs])
        for r in runs:  # the stack holds the optimizer state now
            r.optimizer = None

    def loop(self, bar_kw: dict) -> list[TrainResult]:
        """Steps from the start step to the end step (:func:`_loop`), every model in each."""
        return _loop(self, {"desc": f"train x{self.k}", **bar_kw})

    def step_all(self, step: int, signal: "_StopSignal") -> list[_StepOutcome]:
        """One optimizer step of every model (:func:`difftx.training.stacked.train_step`, what
        :meth:`_Run.step` does for one model); a model whose loss or gradient is not finite stops the
        stack before the update (:func:`_loop` names it)."""
        from .stacked import train_step

        config = self.config
        micro = [[as_batch(r.loader.next_batch()) for r in self.runs] for _ in range(config.grad_accum)]
        lr = lr_at(step, config)
        if config.lambda_warmup:  # the stack computes; each run's own module is probed
            scale = lambda_scale_at(step, config)
            self.stack.set_lambda_scale(scale)
            for r in self.runs:
                set_lambda_scale(r.bare, scale)
        out = train_step(self.stack, self.optimizer, micro, lr, config.grad_clip, doc_mask=config.doc_mask)
        tokens = sum(batches[0].tokens[:, :-1].numel() for batches in micro)
        return [_StepOutcome(out.losses[i], out.grad_norms[i], lr, tokens, out.kind_losses[i], signal.requested)
                for i in range(self.k)]

    def after_steps(self, step: int, outcomes: list[_StepOutcome], bar) -> None:
        """Each model's log record, probes, validation and checkpoint of ``step``. The checkpoints of
        a step are one unit: each model keeps its previous checkpoint until every model wrote this
        one, and a Ctrl-C meanwhile waits until they are written (a kill leaves every model the
        previous one in common, where ``difftx compare`` puts the stack back: exact resume)."""
        from .stacked import optimizer_state_of

        saving = [r for r, o in zip(self.runs, outcomes) if r.saves_at(step, o.stop_now)]
        with _held_sigint() if saving else contextlib.nullcontext():
            for i, (r, o) in enumerate(zip(self.runs, outcomes)):
                if not r.due(step, o.stop_now):
                    continue
                state = self.stack.state_dict_of(i)
                r.bare.load_state_dict(state)
                r.log(step, o, bar)
                r.probe(step)
                r.validate(step, bar)
                if r in saving:
                    r.write_checkpoint(step, {k: v.detach().cpu() for k, v in state.items()},
                                       optimizer_state_of(self.optimizer, self.stack, i),
                                       keep_last=r.config.keep_last + 1)
            for r in saving:
                ckpt.prune_checkpoints(r.out_dir, r.config.keep_last)


def _loop(driver, bar_kw: dict) -> list[TrainResult]:
    """The one training loop, for one model (:class:`_Run`) and for a stack (:class:`_StackedRun`):
    ``driver.runs`` (the runs it steps, each with its own record, log and checkpoints),
    ``driver.step_all`` (one optimizer step of every run) and ``driver.after_steps`` (each run's
    logging, probes, validation and checkpoint). Each step's time is shared out evenly over the runs.
    SIGTERM / SIGUSR1 end it after the current step, with a checkpoint of every run."""
    runs = driver.runs
    first = runs[0]
    stacked = len(runs) > 1
    for r in runs:  # the initial model, where its probe steps ask for it (before the throughput clock starts)
        r.probe_start()
    bar = first.begin(bar_kw, banner=not stacked)
    for r in runs[1:]:
        r.start_sums()
    if stacked and first.config.progress:
        bar.write(first._banner().replace(" model, ", f" model x {len(runs)} stacked (seeds "
                                          f"{', '.join(str(r.config.seed) for r in runs)}), "))
    stop_signal = _StopSignal()
    try:
        for step in range(first.start_step + 1, first.end_step + 1):
            t = time.perf_counter()
            try:
                outcomes = driver.step_all(step, stop_signal)
            except TrainingDivergedError as e:  # the one divergence error, said with the run's context
                r = runs[e.models[0]] if e.models else first
                raise TrainingDivergedError((f"{r.out_dir}: " if stacked else "") + _diverged(
                    e.what, e.values[e.models[0]], step, r.result.last_checkpoint), e.what, e.models, e.values) from e
            share = (time.perf_counter() - t) / len(runs)
            for r, o in zip(runs, outcomes):
                r.record(step, o, share)
            driver.after_steps(step, outcomes, bar)
            bar.update(1)
            if outcomes[0].stop_now:  # every run saved this step
                for r in runs:
                    r.stopped(step, stop_signal, bar)
                break
    finally:
        stop_signal.restore()
        bar.close()
        for r in runs:
            r.logger.close()
    return [r.finish() for r in runs]


def _probe(fn: Callable, model: nn.Module, step: int, logger: MetricsLogger) -> dict:
    t = time.perf_counter()
    with eval_mode(model), torch.no_grad():
        got = fn(model)
    logger.log({"step": step, "probe": got, "probe_s": time.perf_counter() - t})
    return got


def _diverged(what: str, value: float, step: int, last: Optional[Path]) -> str:
    where = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
    return (f"{what} is {value} at step {step}; stopped before applying this update ({where}). "
            f"Lower the learning rate, raise warmup, or check the data.")
