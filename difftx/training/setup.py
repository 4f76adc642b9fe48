"""Where a training run starts and what it writes: the run's setup (:class:`RunSetup`: where from, its data,
its model, a checkpoint restored, the run folder, checkpoints written) and :class:`TrainResult`."""

from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from .. import __version__
from ..attention.registry import kind_code
from ..checkpoint import CheckpointError, load_config
from ..config import ModelConfig
from ..model import Transformer
from ..provenance import machine
from . import checkpointing as ckpt
from .batches import is_batch_source
from .config import TrainConfig
from .distributed import (
    DistInfo,
    all_gather_object,
    broadcast_object,
    full_state_dicts,
    is_sharded,
    load_full_state_dicts,
    parallelize,
    unwrap,
)
from .metrics import METRICS_NAME, MetricsLogger
from .optim import build_optimizer, lr_at


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


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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


def _inside_data(config: TrainConfig, out_dir: Path) -> Optional[str]:
    """Why ``out_dir`` cannot be used when it lies inside the ``data_source`` folder (the run's own files would
    be read back as training text, and a resume would find its text changed), else None."""
    if not config.data_source:
        return None
    data = Path(config.data_source).expanduser().resolve()
    out = Path(out_dir).expanduser().resolve()
    if data.is_dir() and (out == data or data in out.parents):
        return (f"TrainConfig.out_dir: {out_dir} is inside the data_source folder {config.data_source} (the run's "
                f"metrics and checkpoints would be read back as training text); choose an out_dir outside it")
    return None


def _plan_start(config: TrainConfig, out_dir: Path, resume: bool) -> dict:
    """Rank 0's reading of the run folder and ``init_from``: where to start, which tokenizer.
    Errors are returned (not raised) so that they can be raised on every rank."""
    plan: dict = {"resume_dir": None, "init_dir": None, "tokenizer": config.tokenizer}
    inside = _inside_data(config, out_dir)
    if inside is not None:  # before the lock: nothing is written there
        plan["error"] = ("value", inside)
        return plan
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
            resumed = load_config(existing)
            plan["resume_vocab"], plan["resume_config"] = resumed.vocab_size, resumed.to_dict()
            change = ckpt.text_change(existing, config.to_dict())  # before any text is read or tokenized
            if change is not None and not config.allow_new_data:
                plan["error"] = ("checkpoint", ckpt.text_change_error(existing, change))
                return plan
            plan["new_data"] = change
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


class RunSetup:
    """A run of :func:`~difftx.training.train` before and around its steps, in named steps: :meth:`start`
    (where from), :meth:`load_data`, :meth:`build_model`, :meth:`restore`, :meth:`open_output`; and
    :meth:`save` / :meth:`write_checkpoint` after a step. The steps run in this order, which fixes the order of
    random draws (the weights are drawn after the data is prepared), so a resumed run repeats the uninterrupted
    one bitwise. :class:`difftx.training.run._Run` adds the steps themselves."""

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
        self.new_data: list[dict] = []  # each resume that continued on changed text (allow_new_data), for trainer_state

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

    def _record_source_model(self) -> None:
        """A run started from ``init_from`` trains that checkpoint's architecture, whatever model its config
        named (a preset's placeholder): its config, saved with the run, records the checkpoint's ModelConfig
        mapping as ``model`` (``model_overrides`` still apply on top). A resumed run whose config names a preset
        (saved before this was recorded) takes its checkpoint's own."""
        config, plan = self.config, self.plan
        if self.init_dir is not None:
            model = plan["init_config"]
        elif self.resume_dir is not None and isinstance(config.model, str):
            model = plan["resume_config"]
        else:
            return
        if config.model != model:
            self.config = config.replace(model=model)
            self.train_dict = self.config.to_dict()

    def build_model(self, given: Optional[ModelConfig]) -> None:
        """The model (seeded: identical initial weights on every rank; FSDP2 shards them as they
        are), wrapped for DDP / FSDP2 / compile, its optimizer and, for float16, a loss scaler."""
        if given is None and self.config.init_from is not None:
            self._record_source_model()
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
                ckpt.check_kind_code(resume_dir, self.model_config.attention, state.get("kind_code"))
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
            self._record_new_data(state)
            if self.start_step > config.steps:  # before anything in the run folder is rewritten
                raise ValueError(f"TrainConfig.steps: {config.steps} is below the step {self.start_step} of the "
                                 f"checkpoint {resume_dir}; resume with steps >= {self.start_step}, or start a new "
                                 f"run from it (--init-from) for another schedule")
            if self.dist.is_main:
                note = _schedule_change_note(resume_dir, config, self.start_step)
                if note:
                    print(note)
        self._open_loader()

    def _record_new_data(self, state: dict) -> None:
        """The checkpoint's record of resumes on changed text, and this one's when it is one (said on stderr)."""
        kept = state.get("new_data")
        self.new_data = [r for r in kept if isinstance(r, dict)] if isinstance(kept, list) else []
        change = self.plan.get("new_data")
        if change is None:
            return
        self.new_data.append({"step": self.start_step, **change})
        if self.dist.is_main:
            print(f"difftx train: note: {change['data_source']} changed since the checkpoint of step {self.start_step} "
                  f"(SHA-256 {change['old_sha256'][:12]} then, {change['new_sha256'][:12]} now); continuing on the new "
                  f"text as allow_new_data asks (recorded in trainer_state.json under new_data)", file=sys.stderr)

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
            saved = self.loader_states[own]
            if self.plan.get("new_data") is not None and isinstance(saved, dict) and hasattr(self.loader, "store"):
                # new text (allow_new_data): the same position in the stream, over the new text's windows
                saved = {**saved, "num_tokens": len(self.loader.store), "num_docs": self.loader.store.num_docs}
            self.loader.load_state_dict(saved)
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

    def _kind_code(self) -> dict:
        """``{"kind_code": {"file", "sha256"}}`` when the model's attention kind is not built into difftx (the file
        that defines it, :func:`difftx.attention.registry.kind_code`), so that a resume after the file is edited is
        refused; else empty."""
        code = kind_code(self.model_config.attention)
        return {} if code is None else {"kind_code": code}

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
                "machine": machine(self.device),  # where this checkpoint was computed (difftx.provenance)
                "difftx": __version__, **self._kind_code(),  # the code it was computed with
                **({"new_data": self.new_data} if self.new_data else {})}  # resumes that continued on changed text
