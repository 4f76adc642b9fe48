"""The training loop: ``train(config) -> TrainResult``, on CPU, one GPU, or many through torchrun.

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` sequences on each of
``world_size`` processes. Rank ``r`` reads rows ``r*B:(r+1)*B`` of the global batch (the data
loader does the slicing), so a run on W processes follows the same data as one process with
``W * batch_size`` sequences. Only rank 0 logs and writes checkpoints.
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import numpy as np
import torch
import torch.nn as nn

from ..checkpoint import CheckpointError, load_config
from ..config import ModelConfig
from ..io import eval_mode
from ..model import Transformer
from ..provenance import machine
from . import checkpointing as ckpt
from .batches import Batch, as_batch, batch_loss_rows, is_batch_source
from .config import TrainConfig
from .distributed import (
    DistInfo,
    all_gather_object,
    all_reduce_mean,
    broadcast_object,
    destroy_distributed,
    full_state_dicts,
    full_tensor,
    init_distributed,
    is_sharded,
    load_full_state_dicts,
    parallelize,
    unwrap,
)
from .metrics import METRICS_NAME, MetricsLogger, lambda_per_layer
from .optim import TrainingDivergedError, build_optimizer, lr_at, set_lr, update


@dataclass
class TrainResult:
    """What a run produced. ``losses`` maps each optimizer step run by this call to its training
    loss (mean over the global batch); ``val_losses`` maps steps to validation loss."""

    out_dir: Path
    step: int
    model_config: ModelConfig
    losses: dict[int, float] = field(default_factory=dict)
    val_losses: dict[int, float] = field(default_factory=dict)
    last_checkpoint: Optional[Path] = None
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    resumed_from: Optional[int] = None
    stopped_by: Optional[str] = None  # the signal (SIGTERM, SIGUSR1) that ended the run early
    train_time_s: float = 0.0  # time in training steps (not validation, checkpoints), the whole run's after a resume
    probes: dict[int, dict] = field(default_factory=dict)  # step -> what the probe hook returned (this call's)

    @property
    def final_loss(self) -> Optional[float]:
        return self.losses[max(self.losses)] if self.losses else None


def resolve_dtype(config: TrainConfig, device: torch.device) -> torch.dtype:
    """Autocast dtype: float32 on CPU (bf16/fp16 refused there), bf16 on GPUs that have it."""
    if device.type != "cuda":
        if config.dtype in ("bfloat16", "float16"):
            raise ValueError(f"TrainConfig.dtype: {config.dtype} autocast is GPU-only (the device is {device}); "
                             f"on CPU it is hundreds of times slower than float32; use dtype=float32 or auto")
        return torch.float32
    if config.dtype == "auto":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return getattr(torch, config.dtype)


def _prepare_data(config: TrainConfig, tokenizer_spec: str, dist: DistInfo):
    from ..data import prepare_data

    kwargs = {"source": config.data_source, "tokenizer": tokenizer_spec, "cache_dir": config.cache_dir,
              "val_fraction": config.val_fraction, "text_field": config.text_field, "progress": config.progress}
    if not dist.distributed:
        return prepare_data(**kwargs)
    data, failure = None, None
    if dist.is_main:  # rank 0 tokenizes and fills the cache first; the others then open it
        try:
            data = prepare_data(**kwargs)
        except (ValueError, OSError) as e:  # bad data (DataError), missing files: stop every rank
            failure = e
    message = broadcast_object(None if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    if message is not None:
        raise ValueError(f"rank 0 could not prepare the data: {message}")
    return data if data is not None else prepare_data(**kwargs)


def _make_loader(store, config: TrainConfig, dist: DistInfo):
    from ..data import PackedLoader

    return PackedLoader(store, batch_size=config.batch_size, seq_len=config.seq_len, seed=config.seed,
                        rank=dist.rank, world_size=dist.world_size)


def _tokenizer_name(tok: Any) -> Optional[str]:
    return getattr(tok, "name", None)


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


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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
    ``TrainResult.probes``. ``every`` = 0 disables it; a set of steps runs it at those steps only.
    ``progress_bar``: extra ``tqdm`` arguments for the progress bar (e.g. ``desc``, ``position``).

    Under ``torchrun`` every process calls this; the process group is created (and destroyed at
    the end) here unless the caller already created one.
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"train expects a TrainConfig, got {type(config).__name__}")
    owns_group = not _group_exists()
    dist = init_distributed(config.device)
    try:
        return _train(config, dist, resume, data, stop_at, model_config, probes, progress_bar or {})
    finally:
        ckpt.unlock_run(config.out_dir)  # taken in _plan_start (rank 0); a no-op where not held
        if owns_group:
            destroy_distributed()


def _group_exists() -> bool:
    import torch.distributed as tdist

    return tdist.is_available() and tdist.is_initialized()


def _train(config: TrainConfig, dist: DistInfo, resume: bool, data: Any, stop_at: Optional[int],
           given_model: Optional[ModelConfig], probes: Optional[tuple[int, Callable]], bar_kw: dict) -> TrainResult:
    run = _Run(config, dist, stop_at, _check_probes(probes))
    run.start(resume)
    run.load_data(data)
    run.build_model(given_model)
    run.restore()
    run.open_output()
    return run.loop(bar_kw)


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


@dataclass
class _StepOutcome:
    """What one optimizer step measured: losses are means over the global batch."""

    loss: float
    grad_norm: float
    lr: float
    tokens: int
    kind_losses: dict[str, float]
    stop_now: bool


class _Run:
    """One call of :func:`train`, in named steps: :meth:`start` (where from), :meth:`load_data`,
    :meth:`build_model`, :meth:`restore`, :meth:`open_output`, then :meth:`loop`, which runs
    :meth:`step`, :meth:`log`, :meth:`probe`, :meth:`validate` and :meth:`save`. The steps run in
    this order, which fixes the order of random draws (the weights are drawn after the data is
    prepared), so a resumed run repeats the uninterrupted one bitwise."""

    def __init__(self, config: TrainConfig, dist: DistInfo, stop_at: Optional[int],
                 probes: tuple[int | frozenset, Optional[Callable]]) -> None:
        self.t_start = time.perf_counter()
        self.config, self.dist, self.device = config, dist, dist.device
        self.dtype = resolve_dtype(config, self.device)
        if config.parallel == "fsdp" and dist.distributed and self.dtype == torch.float16:
            raise ValueError("TrainConfig.dtype: float16 (loss scaling) is not supported with parallel=fsdp; "
                             "use bfloat16")
        self.out_dir = Path(config.out_dir)
        self.end_step = config.steps if stop_at is None else min(config.steps, stop_at)
        self.probe_every, self.probe_fn = probes
        self.train_dict = config.to_dict()
        if self.device.type == "cuda":  # TF32 for the float32 matmuls that autocast leaves (and float32 runs)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
        # what restore() sets when it continues a checkpoint
        self.start_step, self.tokens_seen, self.train_time = 0, 0, 0.0
        self.loader_states: Optional[list] = None
        self.rng_states: Optional[list] = None

    # -- setup ----------------------------------------------------------------------------------

    def start(self, resume: bool) -> None:
        """Where the run starts (rank 0 decides, every rank agrees): a checkpoint to resume, one to
        initialise from (``init_from``), or nothing; and which tokenizer."""
        plan = _plan_start(self.config, self.out_dir, resume) if self.dist.is_main else None
        plan = broadcast_object(plan)
        if plan.get("error"):  # raised on every rank, so none waits in a collective
            kind, msg = plan["error"]
            raise (CheckpointError if kind == "checkpoint" else ValueError)(msg)
        if plan.get("note") and self.dist.is_main:
            print(plan["note"])
        self.plan = plan
        self.resume_dir, self.init_dir = plan["resume_dir"], plan["init_dir"]

    def load_data(self, data: Any) -> None:
        """Text data prepared here (or given), or a batch source; the validation split if usable."""
        config = self.config
        self.source = data if is_batch_source(data) else None
        if self.source is not None and config.eval_interval:
            raise ValueError("TrainConfig.eval_interval: validation passes run on prepared text data; a batch "
                             "source has no validation split (set eval_interval=0)")
        if data is None:
            data = _prepare_data(config, self.plan["tokenizer"], self.dist)
        self.data = data
        self.tokenizer = getattr(data, "tokenizer", None)
        self.val_store = getattr(data, "val", None)
        if self.val_store is not None and config.eval_interval and len(self.val_store) <= config.seq_len:
            if self.dist.is_main:  # rather than failing at the first validation pass
                print(f"difftx train: note: no validation: the held-out split has {len(self.val_store)} tokens, "
                      f"fewer than one window of seq_len+1={config.seq_len + 1}; give more text or a larger "
                      f"val_fraction", file=sys.stderr)
            self.val_store = None

    def _model_config(self, given: Optional[ModelConfig]) -> ModelConfig:
        config = self.config
        if given is not None:
            model_config = given
        elif self.init_dir is not None:
            model_config = ModelConfig.from_dict(self.plan["init_config"])
            if config.model_overrides:
                model_config = model_config.replace(**config.model_overrides)
        elif self.resume_dir is not None:
            model_config = config.model_config(vocab_size=None if config.explicit_vocab() else
                                               self.plan["resume_vocab"])
        else:
            model_config = config.model_config(vocab_size=self.tokenizer.vocab_size)
        if config.seq_len > model_config.max_seq_len:
            raise ValueError(f"TrainConfig.seq_len: {config.seq_len} exceeds the model's max_seq_len="
                             f"{model_config.max_seq_len}")
        tok = self.tokenizer
        if tok is not None and model_config.vocab_size < tok.vocab_size:
            raise ValueError(f"model vocab_size={model_config.vocab_size} is smaller than the tokenizer's "
                             f"{tok.vocab_size} ({_tokenizer_name(tok)})")
        return model_config

    def build_model(self, given: Optional[ModelConfig]) -> None:
        """The model (seeded: identical initial weights on every rank; FSDP2 shards them as they
        are), wrapped for DDP / FSDP2 / compile, its optimizer and, for float16, a loss scaler."""
        config = self.config
        _seed_everything(config.seed)
        self.model_config = self._model_config(given)
        model = Transformer(self.model_config)
        if self.init_dir is not None:
            model.load_state_dict(ckpt.load_model_state(self.init_dir, self.model_config))
        model.to(self.device)
        if self.dist.distributed:
            model = parallelize(model, config.parallel, self.device, compile=config.compile)
        elif config.compile:
            model = torch.compile(model)
        self.model, self.bare = model, unwrap(model)
        self.optimizer = build_optimizer(self.bare, config)
        self.scaler = torch.amp.GradScaler("cuda") if self.dtype == torch.float16 else None

    def _read_checkpoint(self) -> tuple[dict, dict, dict]:
        """Rank 0 reads and checks the checkpoint to resume; every rank gets its trainer state
        (and, under DDP, the full model and optimizer states)."""
        dist, resume_dir = self.dist, self.resume_dir
        state, model_sd, optim_sd, failure = None, {}, {}, None
        if dist.is_main:
            try:
                state = ckpt.read_trainer_state(resume_dir)
                ckpt.check_compatible(resume_dir, self.model_config, self.train_dict, dist.world_size,
                                      _tokenizer_name(self.tokenizer), state)
                model_sd = ckpt.load_model_state(resume_dir, self.model_config)
                optim_sd = ckpt.read_optimizer_state(resume_dir)
            except CheckpointError as e:
                failure = str(e)
        state, failure = broadcast_object((state, failure))
        if failure:  # on every rank, so none is left waiting
            raise CheckpointError(failure)
        if dist.distributed and not is_sharded(self.bare):  # DDP: every rank needs the full copy
            model_sd, optim_sd = broadcast_object((model_sd, optim_sd))
        return state, model_sd, optim_sd

    def restore(self) -> None:
        """Continue the checkpoint :meth:`start` chose: weights, optimizer, step, tokens, loss
        scaler; then the data loader's position and the RNG state (a fresh loader otherwise)."""
        config, resume_dir = self.config, self.resume_dir
        if resume_dir is not None:
            state, model_sd, optim_sd = self._read_checkpoint()
            try:  # FSDP2: rank 0's copy is broadcast shard by shard inside
                load_full_state_dicts(self.model, self.optimizer, model_sd, optim_sd)
            except (KeyError, ValueError) as e:
                raise CheckpointError(f"{resume_dir / ckpt.OPTIM_NAME}: does not fit this model/optimizer "
                                      f"({e})") from e
            self.start_step, self.tokens_seen = int(state["step"]), int(state.get("tokens_seen", 0))
            self.train_time = state.get("train_time_s")  # None: written by a difftx that did not record it
            self.loader_states, self.rng_states = state["loaders"], state["rng"]
            self.kept_sums = state.get("log_sums")  # None: a checkpoint at a log step, or from an older difftx
            if self.scaler is not None and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            if self.start_step > config.steps:  # before anything in the run folder is rewritten
                raise ValueError(f"TrainConfig.steps: {config.steps} is below the step {self.start_step} of the "
                                 f"checkpoint {resume_dir}; resume with steps >= {self.start_step}, or start a new "
                                 f"run from it (--init-from) for another schedule")
            if self.dist.is_main:
                note = _schedule_change_note(resume_dir, config, self.start_step)
                if note:
                    print(note)
        self._open_loader()

    def _open_loader(self) -> None:
        dist = self.dist
        self.loader = self.source.make_loader(self.config, dist) if self.source is not None else \
            _make_loader(self.data.train, self.config, dist)
        if self.loader_states is None:
            return
        try:
            # same world size: each rank's own state; another one (same global batch): the loader's
            # position is global, so rank 0's serves every rank
            own = dist.rank if len(self.loader_states) == dist.world_size else 0
            self.loader.load_state_dict(self.loader_states[own])
            ckpt.set_rng_state(self.rng_states[own])
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise CheckpointError(f"{self.resume_dir / ckpt.STATE_NAME}: the saved data-loader / RNG state does "
                                  f"not fit this run's data ({type(e).__name__}: {e})") from e

    def open_output(self) -> None:
        """The run folder's ``train_config.json``, the metrics log and the result."""
        config, dist, resumed = self.config, self.dist, self.resume_dir is not None
        if dist.is_main:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            ckpt.atomic_write(self.out_dir / ckpt.TRAIN_CONFIG_NAME,
                              lambda p: Path(p).write_text(config.to_json() + "\n"))
        self.logger = MetricsLogger(self.out_dir / METRICS_NAME,
                                    self.out_dir / "tensorboard" if config.tensorboard else None,
                                    enabled=dist.is_main, resume_step=self.start_step if resumed else None)
        self.result = TrainResult(out_dir=self.out_dir, step=self.start_step, model_config=self.model_config,
                                  tokens_seen=self.tokens_seen, last_checkpoint=self.resume_dir,
                                  resumed_from=self.start_step if resumed else None)

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
        return bool(every) and (step % every == 0 or step == self.config.steps)

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
        x, y = tokens[:, :-1].to(device), tokens[:, 1:].to(device)  # (B, T): inputs, next-token targets
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

    def save(self, step: int) -> None:
        """A checkpoint of this step, written by rank 0 (the full states are gathered first under
        FSDP2). A failed write stops every rank; the previous checkpoint is intact."""
        model_sd, optim_sd = {}, {}
        if self.dist.is_main or is_sharded(self.bare):  # collective under FSDP2; replicated (DDP) state: rank 0's
            model_sd, optim_sd = full_state_dicts(self.model, self.optimizer)
        self.write_checkpoint(step, model_sd, optim_sd)

    def write_checkpoint(self, step: int, model_sd: dict, optim_sd: dict, keep_last: Optional[int] = None) -> None:
        """Rank 0 writes the checkpoint of ``step`` from these full states, with every rank's data
        loader position and RNG state (then keeps ``keep_last`` checkpoints, default the config's)."""
        dist, result = self.dist, self.result
        loaders = all_gather_object(self.loader.state_dict())
        rngs = all_gather_object(ckpt.rng_state())
        failure: Optional[BaseException] = None
        if dist.is_main:
            try:
                result.last_checkpoint = ckpt.save_checkpoint(
                    self.out_dir, step, model_state=model_sd, model_config=self.model_config, optim_state=optim_sd,
                    trainer_state=self._trainer_state(step, loaders, rngs), train_config=self.train_dict,
                    tokenizer=self.tokenizer, keep_last=keep_last or self.config.keep_last)
            except Exception as e:  # the previous checkpoint is intact; stop every rank
                failure = e
        last, message = broadcast_object((result.last_checkpoint, None if failure is None else repr(failure)))
        if failure is not None:
            raise failure
        if message is not None:
            raise RuntimeError(f"rank 0 failed to write the checkpoint of step {step}: {message}")
        result.last_checkpoint = last

    def _trainer_state(self, step: int, loaders: list, rngs: list) -> dict:
        """``trainer_state.json``: what a resume needs besides the weights and optimizer."""
        result, train_time = self.result, self.train_time
        return {"step": step, "tokens_seen": result.tokens_seen, "world_size": self.dist.world_size,
                "train_time_s": None if train_time is None else train_time + result.train_time_s,
                "val_split_tokens": len(self.val_store) if self.val_store is not None else 0,
                "loaders": loaders, "rng": rngs, "tokenizer": _tokenizer_name(self.tokenizer),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                # the sums of the log record in progress (a stop between two records; start_sums)
                "log_sums": None if self.logs_at(step) else {"kinds": self.kind_log, "grad_norms": self.step_norms,
                                                              "tokens": self.tokens_at_log},
                "machine": machine(self.device)}  # where this checkpoint was computed (difftx.provenance)


# -- stacked seeds ---------------------------------------------------------------------------------

STACK_FREE_FIELDS = ("seed", "out_dir", "progress")  # what the models of one stack may differ in


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
    owns_group = not _group_exists()
    dist = init_distributed(configs[0].device)
    try:
        if dist.distributed:
            raise ValueError("train_stacked: a stack trains in one process; under torchrun train each model with "
                             "train() (data parallel)")
        runs = [_Run(c, dist, stop_at, _check_probes(p)) for c, p in zip(configs, probes)]
        for run, d in zip(runs, data):
            run.start(resume)
            run.load_data(d)
            run.build_model(model_config)
            run.restore()
        _check_stack_start(runs)  # before any run folder is written
        for run in runs:
            run.open_output()
        return _StackedRun(runs).loop(progress_bar or {})
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


def _check_stack_start(runs: list[_Run]) -> None:
    if len({r.start_step for r in runs}) != 1:
        raise ValueError("train_stacked: the models resume from different steps ("
                         + ", ".join(f"{r.out_dir}: {r.start_step}" for r in runs) + "); a stack moves in step")
    if runs[0].dtype != torch.float32:
        raise ValueError(f"train_stacked: a stack trains in float32 (this device resolves dtype to {runs[0].dtype}); "
                         f"set dtype=float32")


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


@contextlib.contextmanager
def _held_sigint() -> Iterator[None]:
    """A Ctrl-C (SIGINT) inside the block is held and raised as ``KeyboardInterrupt`` at its end
    (main thread only, where SIGINT is not ignored; elsewhere the block runs as is)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield
        return
    held: list = []
    old = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
    if held:
        raise KeyboardInterrupt


def _probe(fn: Callable, model: nn.Module, step: int, logger: MetricsLogger) -> dict:
    t = time.perf_counter()
    with eval_mode(model), torch.no_grad():
        got = fn(model)
    logger.log({"step": step, "probe": got, "probe_s": time.perf_counter() - t})
    return got


SCHEDULE_FIELDS = ("steps", "warmup_steps", "decay", "lr", "min_lr")


def _schedule_change_note(resume_dir: Path, config: TrainConfig, start_step: int) -> Optional[str]:
    """What a resume changes in the learning-rate schedule of the checkpoint it continues (``None``
    if nothing): the changed fields, the LR of the next step under the old and the new schedule,
    and the new warmup and decay."""
    import json

    try:
        saved = TrainConfig.from_dict(json.loads((resume_dir / ckpt.TRAIN_CONFIG_NAME).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None  # check_compatible has read this file already; nothing to compare with
    changed = [f"{k} {getattr(saved, k)} -> {getattr(config, k)}" for k in SCHEDULE_FIELDS
               if getattr(saved, k) != getattr(config, k)]
    if not changed:
        return None
    step = start_step + 1
    before, after = lr_at(step, saved), lr_at(step, config)
    warmup = f"warmup to {config.lr:.3g} until step {config.warmup_steps}" if config.warmup_steps > start_step \
        else f"no warmup (it ended at step {config.warmup_steps})"
    decay = f"then constant {config.lr:.3g}" if config.decay == "constant" else \
        f"{config.decay} decay to {config.min_lr:.3g} at step {config.steps}"
    return (f"difftx train: the resume changes the schedule ({', '.join(changed)}): the learning rate at step "
            f"{step} goes from {before:.3g} to {after:.3g}; from here: {warmup}, {decay}")


def _plan_start(config: TrainConfig, out_dir: Path, resume: bool) -> dict:
    """Rank 0's reading of the run folder and ``init_from``: where to start, which tokenizer.
    Errors are returned (not raised) so that they can be raised on every rank."""
    plan: dict = {"resume_dir": None, "init_dir": None, "tokenizer": config.tokenizer}
    try:
        ckpt.lock_run(out_dir)  # until train() returns: a second run on this folder is refused
        ckpt.clean_stale(out_dir)
        existing = ckpt.latest_checkpoint(out_dir) if ckpt.checkpoints_dir(out_dir).exists() else None
        if existing is not None and not resume:
            msg = (f"TrainConfig.out_dir: {out_dir} already holds checkpoints (latest {existing.name}); "
                   f"resume it (--resume / resume=True) or choose another out_dir")
            plan["error"] = ("value", msg)
            return plan
        if existing is None and not resume and (out_dir / METRICS_NAME).is_file():
            plan["error"] = ("value", f"TrainConfig.out_dir: {out_dir} holds the metrics.jsonl of an earlier run that "
                                      f"wrote no checkpoint; choose another out_dir (--out), delete that file, or "
                                      f"pass --resume to start that run again from scratch (replacing its log)")
            return plan
        if resume and existing is None:
            plan["note"] = f"difftx train: no checkpoint in {out_dir}; starting from scratch"
        if resume and existing is not None:
            plan["resume_dir"] = existing
            plan["resume_vocab"] = load_config(existing).vocab_size
        elif config.init_from:
            plan["init_dir"] = ckpt.resolve_checkpoint(config.init_from)
            plan["init_config"] = load_config(plan["init_dir"]).to_dict()
        src = plan["resume_dir"] or plan["init_dir"]
        if plan["tokenizer"] is None:
            has_tok = src is not None and (src / ckpt.TOKENIZER_DIR).exists()
            plan["tokenizer"] = str(src / ckpt.TOKENIZER_DIR) if has_tok else "byte"
    except CheckpointError as e:
        plan["error"] = ("checkpoint", str(e))
    return plan


# what the line of a run stopped by a signal tells to do next (difftx compare: run its command again)
STOP_HINT = ["continue with --resume"]


@contextlib.contextmanager
def stop_hint(text: str) -> Iterator[None]:
    """Within the block, the line of a run stopped by a signal ends with ``text``."""
    old, STOP_HINT[0] = STOP_HINT[0], text
    try:
        yield
    finally:
        STOP_HINT[0] = old


class _StopSignal:
    """SIGTERM / SIGUSR1 (what schedulers send before preempting a job) ask the loop to finish
    the current step, write a checkpoint and return. Installed only in the main thread."""

    SIGNALS = ("SIGTERM", "SIGUSR1")

    def __init__(self) -> None:
        import signal
        import threading

        self.requested, self.name, self._old = False, None, {}
        if threading.current_thread() is not threading.main_thread():
            return
        for name in self.SIGNALS:
            sig = getattr(signal, name, None)
            if sig is not None:
                self._old[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        import signal

        self.requested, self.name = True, signal.Signals(signum).name

    def restore(self) -> None:
        import signal

        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


def _diverged(what: str, value: float, step: int, last: Optional[Path]) -> str:
    where = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
    return (f"{what} is {value} at step {step}; stopped before applying this update ({where}). "
            f"Lower the learning rate, raise warmup, or check the data.")
