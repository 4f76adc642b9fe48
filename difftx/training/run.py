"""A run put together from its roles, and the one training loop.

A :class:`Run` is one model's run: its :class:`~difftx.training.setup.RunSetup` (built once), the
:class:`~difftx.training.saving.Position` it starts from, its :class:`~difftx.training.monitor.Monitor` (metrics
log, probes, validation) and :class:`~difftx.training.saving.Saver` (checkpoints). :func:`_loop` steps it alone
(:class:`OneModel`, a :class:`~difftx.training.step.Stepper`) or with others as one stack (:class:`Stacked`, a
:class:`~difftx.training.step.StackedStepper`)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ..config import ModelConfig
from . import checkpointing as ckpt
from .config import TrainConfig
from .distributed import DistInfo
from .monitor import Monitor
from .optim import TrainingDivergedError
from .saving import Position, Saver, resume
from .setup import RunSetup, TrainResult
from .signals import STOP_HINT, _held_sigint, _StopSignal
from .stacked import optimizer_state_of
from .step import StackedStepper, Stepper, StepOutcome


class Run:
    """One call of :func:`~difftx.training.train` (or one model of a stack): :meth:`prepare` (where from, the
    data, the model, the checkpoint it resumes, the data loader), then :meth:`open_output` (the run folder's
    config, the metrics log, the result). The steps run in this order, which fixes the order of random draws
    (the weights are drawn after the data is prepared), so a resumed run repeats the uninterrupted one
    bitwise."""

    def __init__(self, config: TrainConfig, dist: DistInfo, stop_at: Optional[int],
                 probes: tuple[int | frozenset, Optional[Callable]]) -> None:
        self.setup = RunSetup(config, dist, stop_at)
        self.probes = probes

    def prepare(self, resume_run: bool, data: Any, model_config: Optional[ModelConfig]) -> None:
        """Where the run starts, its data and model, the checkpoint it resumes (if any) and its data loader."""
        setup = self.setup
        setup.start(resume_run)
        setup.load_data(data)
        setup.build_model(model_config)
        self.position: Position = resume(setup)
        setup.open_loader(self.position.loaders, self.position.rngs)

    def open_output(self) -> None:
        """The run folder's ``train_config.json``, the metrics log and the result."""
        setup, position = self.setup, self.position
        resumed = setup.resume_dir is not None
        if setup.dist.is_main:
            setup.out_dir.mkdir(parents=True, exist_ok=True)
            ckpt.atomic_write(setup.out_dir / ckpt.TRAIN_CONFIG_NAME,
                              lambda p: Path(p).write_text(setup.config.to_json() + "\n"))
        self.result = TrainResult(out_dir=setup.out_dir, step=position.step, model_config=setup.model_config,
                                  tokens_seen=position.tokens_seen, last_checkpoint=setup.resume_dir,
                                  resumed_from=position.step if resumed else None)
        self.monitor = Monitor(setup, position, self.result, self.probes)
        self.saver = Saver(setup, position, self.result)

    @property
    def config(self) -> TrainConfig:
        return self.setup.config

    def due(self, step: int, stop: bool) -> bool:
        """Whether anything after this step reads the weights (a log record's λ, a probe, a
        validation pass, a checkpoint)."""
        return self.monitor.reads_weights_at(step) or self.saver.saves_at(step, stop)

    def stopped(self, step: int, signal: _StopSignal, bar) -> None:
        self.result.stopped_by = signal.name or "a signal on another rank"
        if self.setup.dist.is_main:
            bar.write(f"difftx train: stopped by {self.result.stopped_by} after step {step}; checkpoint "
                      f"{self.result.last_checkpoint}; {STOP_HINT[0]}")

    def finish(self) -> TrainResult:
        result, train_time = self.result, self.position.train_time
        result.elapsed_s = time.perf_counter() - self.setup.t_start
        if train_time is not None:
            result.train_time_s += train_time
        return result


class OneModel:
    """One run stepped alone (:class:`~difftx.training.step.Stepper`), saving its own checkpoints."""

    def __init__(self, run: Run) -> None:
        self.runs = [run]
        self.stepper = Stepper(run.setup)

    def loop(self, bar_kw: dict) -> TrainResult:
        """Steps from the start step to the end step (:func:`_loop`)."""
        self.runs[0].setup.model.train()
        return _loop(self, bar_kw)[0]

    def step_all(self, step: int, signal: _StopSignal) -> list[StepOutcome]:
        return [self.stepper.step(step, signal)]

    def after_steps(self, step: int, outcomes: list[StepOutcome], bar) -> None:
        """Log, probe, validate and save as this step asks."""
        run, outcome = self.runs[0], outcomes[0]
        run.monitor.after_step(step, outcome, bar)
        if run.saver.saves_at(step, outcome.stop_now):
            run.saver.save(step, run.monitor.pending_sums(step))


class Stacked:
    """``K`` runs (each set up as :func:`~difftx.training.train` sets one up: their own seed's weights,
    checkpoint, loader, metrics log) stepped as one stacked model (:class:`~difftx.training.step.StackedStepper`).
    Each run's own module holds a copy of its weights, refreshed from the stack before anything reads them (a
    log record's λ, a probe, a validation pass); its checkpoints are written from the stack."""

    def __init__(self, runs: list[Run]) -> None:
        self.runs = runs
        self.stepper = StackedStepper([r.setup for r in runs])

    def loop(self, bar_kw: dict) -> list[TrainResult]:
        """Steps from the start step to the end step (:func:`_loop`), every model in each."""
        return _loop(self, {"desc": f"train x{len(self.runs)}", **bar_kw})

    def step_all(self, step: int, signal: _StopSignal) -> list[StepOutcome]:
        return self.stepper.step(step, signal)

    def after_steps(self, step: int, outcomes: list[StepOutcome], bar) -> None:
        """Each model's log record, probes, validation and checkpoint of ``step``. The checkpoints of
        a step are one unit: each model keeps its previous checkpoint until every model wrote this
        one, and a Ctrl-C meanwhile waits until they are written (a kill leaves every model the
        previous one in common, where ``difftx compare`` puts the stack back: exact resume)."""
        stack, optimizer = self.stepper.stack, self.stepper.optimizer
        saving = [r for r, o in zip(self.runs, outcomes) if r.saver.saves_at(step, o.stop_now)]
        with _held_sigint() if saving else contextlib.nullcontext():
            for i, (r, o) in enumerate(zip(self.runs, outcomes)):
                if not r.due(step, o.stop_now):
                    continue
                state = stack.state_dict_of(i)
                r.setup.bare.load_state_dict(state)
                r.monitor.after_step(step, o, bar)
                if r in saving:
                    r.saver.write(step, {k: v.detach().cpu() for k, v in state.items()},
                                  optimizer_state_of(optimizer, stack, i), r.monitor.pending_sums(step),
                                  keep_last=r.config.keep_last + 1)
            for r in saving:
                ckpt.prune_checkpoints(r.setup.out_dir, r.config.keep_last)


def _loop(driver, bar_kw: dict) -> list[TrainResult]:
    """The one training loop, for one model (:class:`OneModel`) and for a stack (:class:`Stacked`):
    ``driver.runs`` (the runs it steps, each with its own record, log and checkpoints),
    ``driver.step_all`` (one optimizer step of every run) and ``driver.after_steps`` (each run's
    logging, probes, validation and checkpoint). Each step's time is shared out evenly over the runs.
    SIGTERM / SIGUSR1 end it after the current step, with a checkpoint of every run."""
    runs = driver.runs
    first = runs[0]
    stacked = len(runs) > 1
    for r in runs:  # the initial model, where its probe steps ask for it (before the throughput clock starts)
        r.monitor.probe_start()
    bar = first.monitor.begin(bar_kw, banner=not stacked)
    for r in runs[1:]:
        r.monitor.start_sums()
    if stacked and first.config.progress:
        bar.write(first.monitor.banner().replace(" model, ", f" model x {len(runs)} stacked (seeds "
                                                 f"{', '.join(str(r.config.seed) for r in runs)}), "))
    stop_signal = _StopSignal()
    try:
        for step in range(first.position.step + 1, first.setup.end_step + 1):
            t = time.perf_counter()
            try:
                outcomes = driver.step_all(step, stop_signal)
            except TrainingDivergedError as e:  # the one divergence error, said with the run's context
                r = runs[e.models[0]] if e.models else first
                raise TrainingDivergedError((f"{r.setup.out_dir}: " if stacked else "") + _diverged(
                    e.what, e.values[e.models[0]], step, r.result.last_checkpoint), e.what, e.models, e.values) from e
            share = (time.perf_counter() - t) / len(runs)
            for r, o in zip(runs, outcomes):
                r.monitor.record(step, o, share)
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
            r.monitor.logger.close()
    return [r.finish() for r in runs]


def _diverged(what: str, value: float, step: int, last: Optional[Path]) -> str:
    where = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
    return (f"{what} is {value} at step {step}; stopped before applying this update ({where}). "
            f"Lower the learning rate, raise warmup, or check the data.")
