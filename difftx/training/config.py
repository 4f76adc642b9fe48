"""Training configuration: a typed dataclass validated on construction, named presets, and
loading from YAML / JSON files with dotted ``key=value`` overrides.

Precedence when the CLI builds a config: preset (default ``tiny``) < config file < ``--set``
overrides < dedicated flags (``--out``, ``--init-from``, ``--attention``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Union

from ..config import PRESETS as MODEL_PRESETS
from ..config import ModelConfig, preset

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DECAYS = ("cosine", "linear", "constant")
PARALLEL_MODES = ("ddp", "fsdp")


def _err(name: str, rule: str) -> ValueError:
    return ValueError(f"TrainConfig.{name}: {rule}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


@dataclass(frozen=True)
class TrainConfig:
    """Everything a training run needs. Saved as ``train_config.json`` beside every checkpoint.

    Batch arithmetic: each optimizer step consumes ``batch_size * grad_accum * world_size``
    sequences of ``seq_len`` tokens (``batch_size`` is per process and micro-step).
    """

    # -- model ----------------------------------------------------------------------------------
    model: Union[str, dict] = "tiny"  # a preset of difftx.config.PRESETS, or a full ModelConfig dict
    model_overrides: dict = field(default_factory=dict)  # ModelConfig fields applied on top
    # -- data -----------------------------------------------------------------------------------
    data_source: Optional[str] = None  # text file / folder / JSONL; None: the bundled corpus
    tokenizer: Optional[str] = None  # "byte", or a tokenizer.json / folder; None: init_from's, else "byte"
    cache_dir: Optional[str] = None  # token-shard cache (None: the data package's default)
    val_fraction: Optional[float] = None  # None: the data package's default split
    text_field: str = "text"  # JSONL field holding the text
    doc_mask: bool = True  # block-diagonal attention: packed documents do not see each other
    # -- batch ----------------------------------------------------------------------------------
    batch_size: int = 16
    seq_len: int = 256
    grad_accum: int = 1
    steps: int = 1000
    # -- optimizer (AdamW) and schedule ---------------------------------------------------------
    lr: float = 1e-3
    min_lr: float = 1e-4  # decayed to at the last step
    warmup_steps: int = 100
    decay: str = "cosine"  # cosine | linear | constant
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # not applied to norms, lambda parameters or embeddings
    grad_clip: float = 1.0  # max global grad norm; 0 disables clipping
    seed: int = 0
    # -- evaluation, logging, checkpoints -------------------------------------------------------
    eval_interval: int = 100  # steps between validation passes; 0 disables
    eval_batches: int = 8
    log_interval: int = 10
    ckpt_interval: int = 200  # steps between checkpoints; 0: only at the end
    keep_last: int = 3  # checkpoints kept on disk (oldest deleted first)
    out_dir: str = "runs/default"
    tensorboard: bool = True  # also log to TensorBoard when it is installed
    progress: bool = True  # tqdm progress bar
    # -- hardware -------------------------------------------------------------------------------
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 autocast on GPUs that support it
    compile: bool = False  # torch.compile the model
    parallel: str = "ddp"  # ddp | fsdp, used when launched by torchrun with more than one process
    # -- fine-tuning ----------------------------------------------------------------------------
    init_from: Optional[str] = None  # a difftx checkpoint folder (or run folder) to start from

    def __post_init__(self) -> None:
        # model
        if isinstance(self.model, str):
            if self.model not in MODEL_PRESETS:
                raise _err("model", f"unknown model preset {self.model!r}; choose one of {sorted(MODEL_PRESETS)} "
                                    f"or give a full ModelConfig mapping")
        elif not isinstance(self.model, dict):
            raise _err("model", f"must be a preset name or a ModelConfig mapping, got {type(self.model).__name__}")
        if not isinstance(self.model_overrides, dict):
            raise _err("model_overrides", f"must be a mapping of ModelConfig fields, got {self.model_overrides!r}")
        try:
            self.model_config()
        except (TypeError, ValueError) as e:
            raise _err("model", f"does not give a valid model: {e}") from e
        # optional strings
        for name in ("data_source", "tokenizer", "cache_dir", "init_from"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise _err(name, f"must be a non-empty string (a path) or null, got {v!r}")
        if not isinstance(self.text_field, str) or not self.text_field:
            raise _err("text_field", f"must be a non-empty string, got {self.text_field!r}")
        if not isinstance(self.out_dir, str) or not self.out_dir:
            raise _err("out_dir", f"must be a non-empty string, got {self.out_dir!r}")
        if self.val_fraction is not None and not (_is_num(self.val_fraction) and 0 < self.val_fraction < 1):
            raise _err("val_fraction", f"must be in (0, 1) or null, got {self.val_fraction!r}")
        # booleans
        for name in ("doc_mask", "tensorboard", "progress", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise _err(name, f"must be true or false, got {getattr(self, name)!r}")
        # positive / non-negative integers
        for name in ("batch_size", "seq_len", "grad_accum", "steps", "log_interval", "keep_last", "eval_batches"):
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                raise _err(name, f"must be a positive integer, got {v!r}")
        for name in ("warmup_steps", "eval_interval", "ckpt_interval", "seed"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise _err(name, f"must be a non-negative integer, got {v!r}")
        if self.warmup_steps > self.steps:
            raise _err("warmup_steps", f"warmup_steps={self.warmup_steps} must not exceed steps={self.steps} "
                                       f"(lower warmup_steps, or raise steps)")
        # floats
        if not _is_num(self.lr) or self.lr <= 0:
            raise _err("lr", f"must be a positive number, got {self.lr!r}")
        if not _is_num(self.min_lr) or not 0 <= self.min_lr <= self.lr:
            raise _err("min_lr", f"must be in [0, lr={self.lr}], got {self.min_lr!r}")
        for name in ("beta1", "beta2"):
            v = getattr(self, name)
            if not _is_num(v) or not 0 <= v < 1:
                raise _err(name, f"must be in [0, 1), got {v!r}")
        if not _is_num(self.eps) or self.eps <= 0:
            raise _err("eps", f"must be a positive number, got {self.eps!r}")
        for name in ("weight_decay", "grad_clip"):
            v = getattr(self, name)
            if not _is_num(v) or v < 0:
                raise _err(name, f"must be a non-negative number, got {v!r}")
        # choices
        for name, choices in (("decay", DECAYS), ("device", DEVICES), ("dtype", DTYPES), ("parallel", PARALLEL_MODES)):
            if getattr(self, name) not in choices:
                raise _err(name, f"must be one of {choices}, got {getattr(self, name)!r}")
        if self.device == "cpu" and self.dtype in ("bfloat16", "float16"):
            raise _err("dtype", f"{self.dtype} autocast is GPU-only: on CPUs without native support it is "
                                f"hundreds of times slower than float32; use dtype=float32 (or auto) on CPU")
        if self.init_from is None and self.seq_len > self.model_config().max_seq_len:  # init_from: checked in train
            raise _err("seq_len", f"{self.seq_len} exceeds the model's max_seq_len={self.model_config().max_seq_len}")

    # -- derived ----------------------------------------------------------------------------------
    def model_config(self, vocab_size: Optional[int] = None) -> ModelConfig:
        """The ModelConfig this run trains. ``vocab_size`` (the tokenizer's) replaces the preset's
        unless ``model_overrides`` / a full model mapping sets it explicitly."""
        overrides = dict(self.model_overrides)
        if isinstance(self.model, dict):
            base = ModelConfig.from_dict(dict(self.model))
            explicit_vocab = "vocab_size" in self.model or "vocab_size" in overrides
        else:
            base = preset(self.model)
            explicit_vocab = "vocab_size" in overrides
        known = {f.name for f in fields(ModelConfig)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(f"model_overrides: unknown ModelConfig field(s) {unknown}")
        if vocab_size is not None and not explicit_vocab:
            overrides["vocab_size"] = vocab_size
        return base.replace(**overrides) if overrides else base

    def explicit_vocab(self) -> bool:
        return "vocab_size" in self.model_overrides or (isinstance(self.model, dict) and "vocab_size" in self.model)

    # -- (de)serialisation ------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        if not isinstance(data, dict):
            raise ValueError(f"TrainConfig: expected a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"TrainConfig: unknown field(s) {unknown}; known fields are {sorted(known)}")
        data = dict(data)
        for f in fields(cls):  # YAML writes 1e-3 as a string and 3 for 3.0: coerce numbers to float fields
            if f.name in data and f.type in ("float", "Optional[float]"):
                v = data[f.name]
                if isinstance(v, str):
                    try:
                        data[f.name] = float(v)
                    except ValueError:
                        pass
                elif _is_int(v):
                    data[f.name] = float(v)
        return cls(**data)

    def replace(self, **changes) -> "TrainConfig":
        return TrainConfig.from_dict({**self.to_dict(), **changes})

    def with_overrides(self, overrides: list[str] | dict) -> "TrainConfig":
        """Apply dotted overrides: ``["lr=3e-4", "model_overrides.attention=standard"]`` or a mapping."""
        data = self.to_dict()
        items = overrides.items() if isinstance(overrides, dict) else (split_override(o) for o in overrides)
        for key, value in items:
            set_dotted(data, key, parse_value(value) if isinstance(value, str) else value)
        return TrainConfig.from_dict(data)


def split_override(text: str) -> tuple[str, str]:
    if "=" not in text:
        raise ValueError(f"override {text!r}: expected KEY=VALUE (e.g. lr=3e-4 or model_overrides.dim=128)")
    key, value = text.split("=", 1)
    key = key.strip()
    if not key:
        raise ValueError(f"override {text!r}: empty key")
    return key, value


def parse_value(text: str) -> Any:
    """A command-line value: JSON / YAML scalars (``3``, ``1e-3``, ``true``, ``null``, ``[1, 2]``), else the string."""
    text = text.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    low = text.lower()
    if low in ("true", "yes", "on"):
        return True
    if low in ("false", "no", "off"):
        return False
    if low in ("null", "none", "~"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def set_dotted(data: dict, key: str, value: Any) -> None:
    """``set_dotted(d, "model_overrides.dim", 128)`` sets ``d["model_overrides"]["dim"]``."""
    parts = key.split(".")
    if len(parts) > 1 and parts[0] == "model" and isinstance(data.get("model"), str):
        parts = ["model_overrides", *parts[1:]]  # a preset name: its fields are changed through model_overrides
    node = data
    for i, part in enumerate(parts[:-1]):
        if i == 0 and part not in data:
            raise ValueError(f"override {key!r}: unknown TrainConfig field {part!r}")
        nxt = node.get(part)
        if nxt is None:
            nxt = node[part] = {}
        if not isinstance(nxt, dict):
            raise ValueError(f"override {key!r}: {'.'.join(parts[:i + 1])} is not a mapping")
        node = nxt
    if len(parts) == 1 and parts[0] not in data:
        raise ValueError(f"override {key!r}: unknown TrainConfig field {parts[0]!r}; "
                         f"known fields are {sorted(data)}")
    node[parts[-1]] = value


def read_config_file(path: Union[str, Path]) -> dict:
    """A mapping from a ``.json``, ``.yaml`` or ``.yml`` file (YAML needs PyYAML)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: config file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text file ({e}); a training config is JSON or YAML") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml
        except ImportError as e:
            raise ValueError(f"{path}: reading YAML needs PyYAML (pip install pyyaml, or difftx[train]); "
                             f"or write the config as JSON") from e
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ValueError(f"{path}: invalid YAML: {e}") from e
    else:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a training config must be a mapping of fields, got {type(data).__name__}")
    return data


def load_train_config(path: Optional[Union[str, Path]] = None, overrides: Optional[list[str]] = None,
                      preset_name: Optional[str] = None, *, notes: Optional[list[str]] = None) -> TrainConfig:
    """Preset (``preset_name``, default ``tiny``), then the file's fields, then ``overrides``.

    A file may name its base preset with a top-level ``preset:`` key. Errors name the file.

    ``notes``: when given, a ``warmup_steps`` inherited from the preset or file that exceeds the
    ``steps`` of the overrides is scaled down (see :func:`fit_warmup`) and a sentence saying so is
    appended; without it (and for a ``warmup_steps`` set in ``overrides``) that is an error.
    """
    data: dict = {}
    if path is not None:
        data = read_config_file(path)
        file_preset = data.pop("preset", None)  # the command line's --preset wins over the file's
        preset_name = preset_name or file_preset
    base = train_preset(preset_name or "tiny")
    try:
        cfg = TrainConfig.from_dict({**base.to_dict(), **data}) if data else base
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    if not overrides:
        return cfg
    if notes is not None:
        return fit_warmup(cfg, overrides, notes)
    return cfg.with_overrides(overrides)


def fit_warmup(cfg: TrainConfig, overrides: list[str], notes: list[str]) -> TrainConfig:
    """``cfg.with_overrides(overrides)``, except that a ``warmup_steps`` the overrides leave alone
    and that now exceeds ``steps`` is scaled to the same fraction of the schedule it had in
    ``cfg`` (e.g. the ``tiny`` preset's 100 of 2000 steps, 5%, becomes 2 of 40), with a note.
    A ``warmup_steps`` set in the overrides themselves is never changed: exceeding ``steps``
    is then an error naming both values."""
    data = cfg.to_dict()
    explicit = False
    for key, value in (split_override(o) for o in overrides):
        set_dotted(data, key, parse_value(value))
        explicit = explicit or key.strip() == "warmup_steps"
    steps, warmup = data.get("steps"), data.get("warmup_steps")
    if (not explicit and _is_int(steps) and _is_int(warmup) and 0 < steps < warmup
            and data.get("warmup_steps") == cfg.warmup_steps):
        scaled = min(steps, int(round(cfg.warmup_steps * steps / cfg.steps)))
        data["warmup_steps"] = scaled
        notes.append(f"warmup_steps={warmup} (from the preset or config file) exceeds steps={steps}: scaled to "
                     f"{scaled}, the same {cfg.warmup_steps / cfg.steps:.0%} of the schedule; set "
                     f"--set warmup_steps=N to choose")
    return TrainConfig.from_dict(data)


# Fields that ``difftx train --resume`` may change from the run's saved train_config.json: they
# decide where and how the run executes and what it logs, not what it computes (``batch_size``
# only with another number of processes and the same global batch, which the trainer checks).
# ``steps`` may be raised: the run then continues longer (its decay follows the new length).
RESUME_MAY_CHANGE = ("out_dir", "device", "dtype", "compile", "parallel", "batch_size", "progress", "tensorboard",
                     "cache_dir", "log_interval", "eval_interval", "ckpt_interval", "keep_last", "steps")


def check_resume_changes(saved: TrainConfig, new: TrainConfig,
                         where: str = "the run's train_config.json") -> TrainConfig:
    """``new``, with the saved spelling of paths that name the same thing (``tok/`` for ``tok``, an
    unset tokenizer for ``byte``); ``ValueError`` naming every field in which it differs from the
    ``saved`` config of the run it resumes, except :data:`RESUME_MAY_CHANGE` (``steps`` only
    upwards)."""
    a, b = saved.to_dict(), new.to_dict()

    def same(k: str) -> bool:  # paths spelled differently ("tok/", "./tok") and byte == the default are the same
        x, y = a[k], b[k]
        if k == "tokenizer" and a["init_from"] is None and b["init_from"] is None:
            x, y = x or "byte", y or "byte"
        if k in ("data_source", "tokenizer", "init_from") and isinstance(x, str) and isinstance(y, str):
            x, y = os.path.normpath(x), os.path.normpath(y)
        return x == y

    refused = {k: (a[k], b[k]) for k in a if not same(k) and k not in RESUME_MAY_CHANGE}
    if b["steps"] < a["steps"]:
        refused["steps"] = (a["steps"], b["steps"])
    if refused:
        listed = "; ".join(f"{k}: saved {v[0]!r}, asked {v[1]!r}" for k, v in sorted(refused.items()))
        raise ValueError(f"--resume continues the run as {where} describes it, and cannot change "
                         f"{sorted(refused)} ({listed}). A resume may change only {', '.join(RESUME_MAY_CHANGE[1:-1])} "
                         f"and raise steps; to change anything else, start a new run from this one "
                         f"(--out NEW --init-from RUN)")
    kept = {k: a[k] for k in ("data_source", "tokenizer", "init_from") if a[k] != b[k]}  # same(k) by now
    return new.replace(**kept) if kept else new


# -- presets ------------------------------------------------------------------------------------
# CPU presets are sized for minutes to hours on a laptop (float32). GPU presets follow the
# paper's recipe (Ye et al. 2025, appendix: AdamW beta=(0.9, 0.95), weight decay 0.1, 1000
# warmup steps then decay, peak lr 3.2e-4 at 3B, bf16) with batch sizes scaled down to one
# node; docs/training.md lists what is taken from the paper and what is adapted.
TRAIN_PRESETS: dict[str, TrainConfig] = {}


def _register(name: str, **kw) -> None:
    TRAIN_PRESETS[name] = TrainConfig(out_dir=f"runs/{name}", **kw)


_register("test", model="test", batch_size=4, seq_len=32, steps=20, lr=1e-3, min_lr=1e-4, warmup_steps=2,
          eval_interval=10, eval_batches=2, log_interval=5, ckpt_interval=10, keep_last=2, device="cpu",
          tensorboard=False)
_register("tiny", model="tiny", batch_size=16, seq_len=256, steps=2000, lr=2e-3, min_lr=2e-4, warmup_steps=100,
          eval_interval=200, eval_batches=8, ckpt_interval=500)
_register("cpu-5m", model="cpu-5m", batch_size=16, seq_len=256, steps=5000, lr=1e-3, min_lr=1e-4,
          warmup_steps=200, eval_interval=250, eval_batches=16, ckpt_interval=500)
_register("cpu-17m", model="cpu-17m", batch_size=16, seq_len=256, steps=10000, lr=6e-4, min_lr=6e-5,
          warmup_steps=500, eval_interval=500, eval_batches=16, ckpt_interval=1000)
# GPU presets: 2048-token context, about 0.5M tokens per step on 8 GPUs (batch_size * grad_accum * 8 * 2048).
_register("gpu-120m", model="gpu-120m", batch_size=16, seq_len=2048, grad_accum=2, steps=20000, lr=6e-4,
          min_lr=6e-5, warmup_steps=1000, eval_interval=1000, eval_batches=20, ckpt_interval=1000,
          device="cuda", dtype="bfloat16")
_register("gpu-350m", model="gpu-350m", batch_size=8, seq_len=2048, grad_accum=4, steps=40000, lr=3.2e-4,
          min_lr=3.2e-5, warmup_steps=1000, eval_interval=1000, eval_batches=20, ckpt_interval=1000,
          device="cuda", dtype="bfloat16")
_register("gpu-1b", model="gpu-1b", batch_size=4, seq_len=2048, grad_accum=8, steps=60000, lr=3.2e-4,
          min_lr=3.2e-5, warmup_steps=1000, eval_interval=1000, eval_batches=20, ckpt_interval=1000,
          device="cuda", dtype="bfloat16", parallel="fsdp")


def train_preset(name: str, **overrides) -> TrainConfig:
    """A named training preset (see :data:`TRAIN_PRESETS`), with fields replaced."""
    if name not in TRAIN_PRESETS:
        raise ValueError(f"unknown training preset {name!r}; choose one of {sorted(TRAIN_PRESETS)}")
    return TRAIN_PRESETS[name].replace(**overrides) if overrides else TRAIN_PRESETS[name]
