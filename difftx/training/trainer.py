"""The training loop: ``train(config) -> TrainResult``, on CPU, one GPU, or many through torchrun.

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` sequences on each of
``world_size`` processes. Rank ``r`` reads rows ``r*B:(r+1)*B`` of the global batch (the data
loader does the slicing), so a run on W processes follows the same data as one process with
``W * batch_size`` sequences. Only rank 0 logs and writes checkpoints.

A run by role: :mod:`difftx.training.setup` (what it builds once: data, model, optimizer, loader),
:mod:`difftx.training.step` (one optimizer step), :mod:`difftx.training.saving` (its checkpoints, a resume),
:mod:`difftx.training.monitor` (metrics log, probes, validation); :mod:`difftx.training.run` puts them together and
holds the loop; :mod:`difftx.training.signals`, :mod:`difftx.training.stacked` (K models as one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from ..config import ModelConfig
from . import checkpointing as ckpt
from .config import TrainConfig
from .distributed import DistInfo, destroy_distributed, init_distributed, is_initialized
from .optim import TrainingDivergedError
from .monitor import evaluate, val_tokens
from .run import OneModel, Run, Stacked
from .setup import TrainResult, resolve_dtype
from .signals import stop_hint

__all__ = ["TrainResult", "TrainingDivergedError", "evaluate", "resolve_dtype", "stop_hint", "train", "train_stacked",
           "val_tokens"]


def train(config: TrainConfig, *, resume: bool = False, data: Any = None, stop_at: Optional[int] = None,
          model_config: Optional[ModelConfig] = None, probes: Optional[tuple[int, Callable]] = None,
          progress_bar: Optional[dict] = None) -> TrainResult:
    """Train (or continue training) the model described by ``config``.

    ``resume``: continue from ``config.out_dir``'s latest checkpoint (a fresh start if there is
    none); the continued run reproduces the uninterrupted one exactly on the same hardware.
    ``data``: an already prepared dataset (``difftx.data.prepare_data`` output) instead of the
    one ``config`` describes, or a *batch source* (an object with ``make_loader(config, dist)``,
    see :mod:`difftx.training.batches`: batches with loss masks and kinds, e.g. the compare
    task mixture). ``stop_at``: stop after this step, writing a checkpoint there, as a
    preempted job would (the schedule still runs to ``config.steps``). SIGTERM or SIGUSR1 also
    stop the run after the current step, with a checkpoint (``TrainResult.stopped_by``).
    ``model_config``: train exactly this model (``config.model`` / ``model_overrides`` are not
    used; no tokenizer is needed for a batch source, and then none is saved).
    ``probes``: ``(every, fn)``: ``fn(model) -> dict`` runs every ``every`` steps and at the last
    step (``config.steps``), model in eval mode, without gradients, on every rank (FSDP2 needs
    them all); logged to ``metrics.jsonl`` as ``{"step", "probe", "probe_s"}`` and kept in
    ``TrainResult.probes``. ``every`` = 0 disables it; a set of steps runs it at those steps only
    (0 among them: also on the initial model, before the first step, unless the run resumes).
    ``progress_bar``: extra ``tqdm`` arguments for the progress bar (e.g. ``desc``, ``position``).

    Under ``torchrun`` every process calls this; the process group is created (and destroyed at
    the end) here unless the caller already created one.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"train expects a TrainConfig, got {type(config).__name__}")
    owns_group = not is_initialized()  # a process group the caller made stays
    dist = init_distributed(config.device)
    try:
        return _train(config, dist, resume, data, stop_at, model_config, probes, progress_bar or {})
    finally:
        ckpt.unlock_run(config.out_dir)  # taken in _plan_start (rank 0); a no-op where not held
        if owns_group:
            destroy_distributed()


def _train(config: TrainConfig, dist: DistInfo, resume: bool, data: Any, stop_at: Optional[int],
           given_model: Optional[ModelConfig], probes: Optional[tuple[int, Callable]], bar_kw: dict) -> TrainResult:
    run = Run(config, dist, stop_at, _check_probes(probes))
    run.prepare(resume, data, given_model)
    run.open_output()
    return OneModel(run).loop(bar_kw)


def _check_probes(probes: Optional[tuple[int, Callable]]) -> tuple[int | frozenset, Optional[Callable]]:
    """``(every, fn)`` with ``every`` an int >= 0 or a frozenset of steps."""
    every, fn = probes if probes is not None else (0, None)
    if isinstance(every, (tuple, list, set, frozenset)):  # at these steps only
        every = frozenset(every)
    elif not isinstance(every, int) or every < 0:
        raise ValueError(f"probes: expected (every >= 0 or a set of steps, fn(model) -> dict), got {probes!r}")
    if every and not callable(fn):
        raise ValueError(f"probes: expected (every >= 0 or a set of steps, fn(model) -> dict), got {probes!r}")
    return every, fn


# -- stacked seeds ---------------------------------------------------------------------------------

# what the models of one stack may differ in (each run loads its own init_from before the stack is built)
STACK_FREE_FIELDS = ("seed", "out_dir", "progress", "init_from")


def train_stacked(configs: Sequence[TrainConfig], *, data: Sequence[Any], model_config: ModelConfig,
                  resume: bool = False, probes: Optional[Sequence[Optional[tuple[int, Callable]]]] = None,
                  stop_at: Optional[int] = None, progress_bar: Optional[dict] = None) -> list[TrainResult]:
    """Train ``K`` models of one ``model_config`` together as one *stacked* model
    (:mod:`difftx.training.stacked`): one forward and backward pass runs all of them, which
    divides the cost of a small model's many small calls by ``K``. Each model is what
    :func:`train` would make of ``(configs[i], data[i])``: its seed's initial weights, its own
    batches, gradient clipping, AdamW state, loss history, metrics log, probes (``probes[i]``),
    validation and checkpoints in its own ``out_dir``, in the ordinary format (load_model, eval,
    export and a later :func:`train` resume read them). Its losses equal separate training's to
    float32 rounding. ``resume``: every model continues its latest checkpoint; all must be at one
    step. The configs may differ only in ``seed``, ``out_dir`` and ``progress`` (the first's
    ``progress`` rules the one progress bar).

    One process, float32 (no DDP / FSDP, autocast or compile). ``TrainResult.train_time_s`` of
    each model is its share of the stack's time (the stack's time / ``K``). It tunes glibc's
    allocator for the whole process (:func:`difftx.training.stacked.tune_allocator`)."""
    configs = list(configs)
    if not configs or any(not isinstance(c, TrainConfig) for c in configs):
        raise TypeError("train_stacked expects a non-empty list of TrainConfig")
    data = list(data)
    probes = [None] * len(configs) if probes is None else list(probes)
    if len(data) != len(configs) or len(probes) != len(configs):
        raise ValueError(f"train_stacked: {len(configs)} configs need as many data sources and probes, got "
                         f"{len(data)} and {len(probes)}")
    _check_stackable(configs)
    owns_group = not is_initialized()  # a process group the caller made stays
    dist = init_distributed(configs[0].device)
    try:
        if dist.distributed:
            raise ValueError("train_stacked: a stack trains in one process; under torchrun train each model with "
                             "train() (data parallel)")
        runs = [Run(c, dist, stop_at, _check_probes(p)) for c, p in zip(configs, probes)]
        for run, d in zip(runs, data):
            run.prepare(resume, d, model_config)
        _check_stack_start(runs)  # before any run folder is written
        for run in runs:
            run.open_output()
        return Stacked(runs).loop(progress_bar or {})
    finally:
        for c in configs:
            ckpt.unlock_run(c.out_dir)
        if owns_group:
            destroy_distributed()


def _check_stackable(configs: list[TrainConfig]) -> None:
    first = configs[0].to_dict()
    for c in configs[1:]:
        other = c.to_dict()
        differ = sorted(k for k in first if k not in STACK_FREE_FIELDS and first[k] != other.get(k))
        if differ:
            raise ValueError(f"train_stacked: the models of a stack may differ only in {list(STACK_FREE_FIELDS)}; "
                             f"{c.out_dir} differs from {configs[0].out_dir} in {differ}")
    outs = [str(Path(c.out_dir).resolve()) for c in configs]
    if len(set(outs)) != len(outs):
        raise ValueError("train_stacked: each model needs its own out_dir")
    c = configs[0]
    if c.compile or c.dtype not in ("float32", "auto"):
        raise ValueError(f"train_stacked: a stack trains in float32 without compile (dtype={c.dtype}, "
                         f"compile={c.compile})")


def _check_stack_start(runs: list[Run]) -> None:
    if len({r.position.step for r in runs}) != 1:
        steps = ", ".join(f"{r.setup.out_dir}: {r.position.step}" for r in runs)
        raise ValueError(f"train_stacked: the models resume from different steps ({steps}); a stack moves in step")
    dtype = runs[0].setup.dtype
    if dtype != torch.float32:
        raise ValueError(f"train_stacked: a stack trains in float32 (this device resolves dtype to {dtype}); "
                         f"set dtype=float32")
