"""What a run tells while it trains (:class:`Monitor`): the progress bar and its banner, a metrics record every
``log_interval`` steps (with the sums since the last one), the probe hook, and validation passes
(:func:`evaluate`)."""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch
import torch.nn as nn
from tqdm.auto import tqdm

from ..io import eval_mode
from .config import TrainConfig
from .distributed import is_sharded
from .metrics import METRICS_NAME, MetricsLogger, lambda_per_layer
from .optim import lambda_scale_at, set_lambda_scale
from .saving import Position
from .setup import RunSetup, TrainResult, autocast
from .step import StepOutcome


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
            with autocast(device, dtype):
                total += float(model(x, doc_ids=d, targets=y)) * x.shape[0]  # the last batch may be smaller
            rows += x.shape[0]
    return total / rows if rows else None


def val_tokens(store, config: TrainConfig, world_size: int = 1) -> int:
    """Tokens one validation pass of :func:`evaluate` scores (predicted positions)."""
    if store is None:
        return 0
    windows = max(0, (len(store) - 1) // config.seq_len)
    return min(windows, config.eval_batches * config.batch_size * world_size) * config.seq_len


class Monitor:
    """A run's metrics log (``metrics.jsonl``) and progress bar, and what it records of each step taken
    (:meth:`record`): the result's losses and tokens, and the sums the next log record reports. After a step,
    :meth:`after_step` writes the log record, runs the probe hook and the validation pass where they are due."""

    def __init__(self, setup: RunSetup, position: Position, result: TrainResult,
                 probes: tuple[int | frozenset, Optional[Callable]]) -> None:
        self.setup, self.position, self.result = setup, position, result
        self.config = setup.config
        self.probe_every, self.probe_fn = probes
        resumed = setup.resume_dir is not None
        self.logger = MetricsLogger(setup.out_dir / METRICS_NAME,
                                    setup.out_dir / "tensorboard" if self.config.tensorboard else None,
                                    enabled=setup.dist.is_main, resume_step=position.step if resumed else None)

    # -- when -----------------------------------------------------------------------------------

    def logs_at(self, step: int) -> bool:
        return step % self.config.log_interval == 0 or step == self.setup.end_step

    def probes_at(self, step: int) -> bool:
        every = self.probe_every
        if isinstance(every, frozenset):
            return step in every
        return bool(every) and step > 0 and (step % every == 0 or step == self.config.steps)

    def validates_at(self, step: int) -> bool:
        config = self.config
        return bool(config.eval_interval) and self.setup.val_store is not None and (
            step % config.eval_interval == 0 or step == config.steps)

    def reads_weights_at(self, step: int) -> bool:
        """Whether anything this monitor does after this step reads the weights (a log record's λ, a probe, a
        validation pass)."""
        return self.logs_at(step) or self.probes_at(step) or self.validates_at(step)

    # -- the bar and the sums -------------------------------------------------------------------

    def begin(self, bar_kw: dict, banner: bool = True):
        """The progress bar (and the banner line above it); the metrics record's sums start empty."""
        config, dist = self.config, self.setup.dist
        bar = tqdm(total=config.steps, initial=self.position.step, disable=not (dist.is_main and config.progress),
                   **{"desc": "train", "unit": "step", "dynamic_ncols": True, **bar_kw})
        if banner and dist.is_main and config.progress:
            bar.write(self.banner())
        self.start_sums()
        return bar

    def banner(self) -> str:
        setup, config = self.setup, self.config
        dist = setup.dist
        start = f"resuming at step {self.position.step}" if setup.resume_dir is not None else (
            f"from {setup.init_dir}" if setup.init_dir is not None else "from scratch")
        rows = config.batch_size * config.grad_accum * dist.world_size
        per_step = f"{rows * config.seq_len:,} tokens/step" if setup.source is None else f"{rows} sequences/step"
        impl = getattr(setup.optimizer, "difftx_implementation", None)  # a stack's optimizer is its own
        parts = (f"AdamW {impl}" if impl else None, "compiled" if config.compile else None)
        how = "".join(f", {part}" for part in parts if part)
        return (f"difftx train: {setup.model_config.attention} model, {setup.bare.num_parameters():,} parameters, "
                f"{per_step} on {dist.world_size} x {setup.device} ({str(setup.dtype)[6:]}{how}); {start}; "
                f"writing to {setup.out_dir}")

    def start_sums(self) -> None:
        """The sums since the last log record: empty, or (a resume between two records) as the checkpoint
        kept them, so the record after it covers the steps before the stop too."""
        kept = self.position.log_sums or {}
        self.t_log, self.tokens_at_log = time.perf_counter(), int(kept.get("tokens", 0))
        # batch kind -> [sum of step losses, steps] since the last log record
        self.kind_log: dict[str, list] = {k: list(v) for k, v in kept.get("kinds", {}).items()}
        self.step_norms: list[float] = list(kept.get("grad_norms", []))  # each step's gradient norm since the record

    def pending_sums(self, step: int) -> Optional[dict]:
        """The sums of the log record in progress after this step (a checkpoint keeps them for a resume); None
        at a log step."""
        if self.logs_at(step):
            return None
        return {"kinds": self.kind_log, "grad_norms": self.step_norms, "tokens": self.tokens_at_log}

    def record(self, step: int, outcome: StepOutcome, seconds: float) -> None:
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

    def after_step(self, step: int, outcome: StepOutcome, bar) -> None:
        """The log record, the probe hook and the validation pass, where this step asks for them."""
        self.log(step, outcome, bar)
        self.probe(step)
        self.validate(step, bar)

    def log(self, step: int, outcome: StepOutcome, bar) -> None:
        """A metrics record every ``log_interval`` steps and at the end step: the step's loss, LR
        and gradient norm, every gradient norm since the last record, throughput, λ per layer, and
        each batch kind's mean loss since the last record."""
        if not self.logs_at(step):
            return
        lambdas = lambda_per_layer(self.setup.bare)  # collective under FSDP2
        now = time.perf_counter()
        tok_s = self.tokens_at_log / max(now - self.t_log, 1e-9)
        self.t_log, self.tokens_at_log = now, 0
        time_s = (self.position.train_time or 0.0) + self.result.train_time_s
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
        setup = self.setup
        return setup.model if is_sharded(setup.bare) else setup.bare

    def probe(self, step: int) -> None:
        """The probe hook at its steps and at the last step of the schedule (before a checkpoint
        of this step)."""
        if not self.probes_at(step):
            return
        model, t = self._eval_model(), time.perf_counter()
        with eval_mode(model), torch.no_grad():
            got = self.probe_fn(model)
        self.logger.log({"step": step, "probe": got, "probe_s": time.perf_counter() - t})
        self.result.probes[step] = got

    def probe_start(self) -> None:
        """The probe hook on the initial model (step 0), before the first step of a run that starts
        afresh, when its steps (a set) hold 0; a warm-up's lambda factor is the first step's."""
        if self.position.step or not isinstance(self.probe_every, frozenset) or 0 not in self.probe_every:
            return
        if self.config.lambda_warmup:
            set_lambda_scale(self.setup.bare, lambda_scale_at(1, self.config))
        self.probe(0)

    def validate(self, step: int, bar) -> None:
        """A validation pass every ``eval_interval`` steps and at the last step of the schedule."""
        if not self.validates_at(step):
            return
        setup, config = self.setup, self.config
        val_store, ws = setup.val_store, setup.dist.world_size
        val = evaluate(self._eval_model(), val_store, config, setup.device, setup.dtype, ws)
        if val is None:
            return
        self.result.val_losses[step] = val
        self.logger.log({"step": step, "val_loss": val, "val_tokens": val_tokens(val_store, config, ws)})
        if setup.dist.is_main and config.progress:
            bar.write(f"step {step}: val_loss {val:.4f}")
