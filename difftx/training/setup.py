"""What a training run builds once (:class:`RunSetup`: where it starts, its data, its model and optimizer, its data
loader), the autocast of its dtype, and what it produces (:class:`TrainResult`)."""

from __future__ import annotations

import contextlib
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from ..checkpoint import CheckpointError, load_config
from ..config import ModelConfig
from ..io import MODEL_MARKERS, RUN_MARKERS, WORK_MARKERS, work_marker
from ..data import PackedLoader, prepare_data
from ..model import Transformer
from . import checkpointing as ckpt
from .batches import is_batch_source
from .config import TrainConfig
from .distributed import DistInfo, broadcast_object, parallelize, unwrap
from .metrics import METRICS_NAME
from .optim import build_optimizer


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


def autocast(device: torch.device, dtype: torch.dtype):
    """The autocast context of a run's dtype (none for float32)."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def _prepare_data(config: TrainConfig, tokenizer_spec: str, dist: DistInfo):
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
    return PackedLoader(store, batch_size=config.batch_size, seq_len=config.seq_len, seed=config.seed,
                        rank=dist.rank, world_size=dist.world_size)


def tokenizer_name(tok: Any) -> Optional[str]:
    return getattr(tok, "name", None)


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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
    held = None if work_marker(out_dir, RUN_MARKERS, below=False) else \
        work_marker(out_dir, {**WORK_MARKERS, **MODEL_MARKERS}, below=False)
    if held is not None:  # a model folder's own config.json would go on being read as the model, not this run
        plan["error"] = ("value", f"TrainConfig.out_dir: {out_dir} holds {held[1]} ({held[0]}), not a training run; "
                                  f"a run writes a folder of its own: choose another out_dir (--out)")
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
            other = _other_tokenizer(config.tokenizer, plan["init_dir"])
            if other is not None:
                plan["error"] = ("value", other)
                return plan
        src = plan["resume_dir"] or plan["init_dir"]
        if plan["tokenizer"] is None:
            has_tok = src is not None and (src / ckpt.TOKENIZER_DIR).exists()
            plan["tokenizer"] = str(src / ckpt.TOKENIZER_DIR) if has_tok else "byte"
    except CheckpointError as e:
        plan["error"] = ("checkpoint", str(e))
    return plan


def _other_tokenizer(given: Optional[str], init_dir: Path) -> Optional[str]:
    """Why the tokenizer ``given`` (``--tokenizer``; None: the checkpoint's own) is not the one the checkpoint in
    ``init_dir`` was trained with (a fine-tune would train on garbage), or None."""
    from ..data.tokenizer import load_tokenizer, not_the_models_tokenizer

    saved = init_dir / ckpt.TOKENIZER_DIR
    if given is None or not saved.exists():
        return None
    try:
        return not_the_models_tokenizer(load_tokenizer(given), given, saved, init_dir)
    except (OSError, ValueError) as e:
        return f"--tokenizer {given}: {e}"


class RunSetup:
    """What a run of :func:`~difftx.training.train` builds once, in named steps: :meth:`start` (where from),
    :meth:`load_data`, :meth:`build_model` (the model, its optimizer and loss scaler) and :meth:`open_loader`
    (the data loader, at the position a resume gives). The steps run in this order, which fixes the order of
    random draws (the weights are drawn after the data is prepared), so a resumed run repeats the uninterrupted
    one bitwise. :mod:`difftx.training.run` puts a run together from it."""

    def __init__(self, config: TrainConfig, dist: DistInfo, stop_at: Optional[int]) -> None:
        self.t_start = time.perf_counter()
        self.config, self.dist, self.device = config, dist, dist.device
        self.dtype = resolve_dtype(config, self.device)
        if config.parallel == "fsdp" and dist.distributed and self.dtype == torch.float16:
            raise ValueError("TrainConfig.dtype: float16 (loss scaling) is not supported with parallel=fsdp; "
                             "use bfloat16")
        self.out_dir = Path(config.out_dir)
        self.end_step = config.steps if stop_at is None else min(config.steps, stop_at)
        self.train_dict = config.to_dict()
        if self.device.type == "cuda":  # TF32 for the float32 matmuls that autocast leaves (and float32 runs)
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True

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
                             f"{tok.vocab_size} ({tokenizer_name(tok)})")
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
        if self.device.type == "cpu":  # refused in one line, not killed partway (compare's estimate, the CPU kernels'
            # maps: eager's over every key, chunked's over at most its stored block)
            from ..attention.kernels import STORE_MAX_KEYS
            from .memory import check_training_fits, physical_bytes

            eager = self.model_config.backend == "eager"
            check_training_fits(self.model_config, config.batch_size, config.seq_len, physical_bytes(),
                                None if eager else min(config.seq_len, STORE_MAX_KEYS))
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

    def open_loader(self, loader_states: Optional[list] = None, rng_states: Optional[list] = None) -> None:
        """The data loader; a resume's (``loader_states``: every rank's) position in it and its RNG state."""
        dist = self.dist
        self.loader = self.source.make_loader(self.config, dist) if self.source is not None else \
            _make_loader(self.data.train, self.config, dist)
        if loader_states is None:
            return
        try:
            # same world size: each rank's own state; another one (same global batch): the loader's
            # position is global, so rank 0's serves every rank
            own = dist.rank if len(loader_states) == dist.world_size else 0
            saved = loader_states[own]
            if self.plan.get("new_data") is not None and isinstance(saved, dict) and hasattr(self.loader, "store"):
                # new text (allow_new_data): the same position in the stream, over the new text's windows
                saved = {**saved, "num_tokens": len(self.loader.store), "num_docs": self.loader.store.num_docs}
            self.loader.load_state_dict(saved)
            ckpt.set_rng_state(rng_states[own])
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise CheckpointError(f"{self.resume_dir / ckpt.STATE_NAME}: the saved data-loader / RNG state does "
                                  f"not fit this run's data ({type(e).__name__}: {e})") from e
