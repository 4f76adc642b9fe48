"""Training configuration: a typed dataclass validated on construction, named presets, and
loading from YAML / JSON files with dotted ``key=value`` overrides.

Precedence when the CLI builds a config: preset (default ``tiny``; ``finetune`` when the command fine-tunes
with ``--init-from`` and names no preset or file) < config file < ``--set`` overrides < dedicated flags
(``--out``, ``--init-from``, ``--attention``).
"""

from __future__ import annotations

import dataclasses
import filecmp
import hashlib
import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional, Union

from ..config import PRESETS as MODEL_PRESETS
from ..config import ModelConfig, preset
from ..data.tokenizer import load_tokenizer
from ..overrides import parse_value, split_override

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DECAYS = ("cosine", "linear", "constant")
PARALLEL_MODES = ("ddp", "fsdp")


def _err(name: str, rule: str) -> ValueError:
    return ValueError(f"TrainConfig.{name}: {rule}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


MAX_STEPS = 10 ** 9  # far beyond any run, small enough that what is sized by steps (schedules, logs) can be planned


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
    allow_new_data: bool = False  # a resume may continue on a data_source whose content changed (recorded)
    # -- batch ----------------------------------------------------------------------------------
    batch_size: int = 16
    seq_len: int = 256
    grad_accum: int = 1
    steps: int = 1000
    # -- optimizer (AdamW) and schedule ---------------------------------------------------------
    lr: float = 1e-3
    min_lr: float = 1e-4  # decayed to at the last step
    warmup_steps: int = 100
    # steps over which the subtracted lambda of a differential model is ramped linearly from 0 to its own (a
    # factor lambda_scale = (step - 1) / lambda_warmup, 0 at the first step); 0: no warm-up
    lambda_warmup: int = 0
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
        if self.val_fraction is not None and not (_is_num(self.val_fraction) and 0 <= self.val_fraction < 1):
            raise _err("val_fraction", f"must be in [0, 1) (0: no validation) or null, got {self.val_fraction!r}")
        # booleans
        for name in ("doc_mask", "allow_new_data", "tensorboard", "progress", "compile"):
            if not isinstance(getattr(self, name), bool):
                raise _err(name, f"must be true or false, got {getattr(self, name)!r}")
        # positive / non-negative integers
        for name in ("batch_size", "seq_len", "grad_accum", "steps", "log_interval", "keep_last", "eval_batches"):
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                raise _err(name, f"must be a positive integer, got {v!r}")
        for name in ("warmup_steps", "eval_interval", "ckpt_interval", "seed", "lambda_warmup"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                raise _err(name, f"must be a non-negative integer, got {v!r}")
        if self.seed >= 2 ** 64:  # what torch.manual_seed takes ("Overflow when unpacking long long" otherwise)
            raise _err("seed", f"must be below 2**64, got {self.seed}")
        if self.steps > MAX_STEPS:
            raise _err("steps", f"{self.steps:,} is more optimizer steps than a run can take (at most {MAX_STEPS:,})")
        if self.lambda_warmup >= self.steps:
            raise _err("lambda_warmup", f"lambda_warmup={self.lambda_warmup} must be below steps={self.steps} (the "
                                        f"last step would still scale lambda down, unlike the saved model)")
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
        """The text of ``train_config.json``: :meth:`to_dict` with its paths saved so that a moved run
        folder still finds them (absolute, plus a fallback relative to the run folder; see
        :func:`saved_form`). :meth:`from_dict` reads it back."""
        return json.dumps(saved_form(self.to_dict()), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict) -> "TrainConfig":
        if not isinstance(data, dict):
            raise ValueError(f"TrainConfig: expected a mapping, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known - {SAVED_PATHS})
        if unknown:
            raise ValueError(f"TrainConfig: unknown field(s) {unknown}; known fields are {sorted(known)}")
        data = {k: v for k, v in data.items() if k != SAVED_PATHS}  # a record of where paths were (saved_form)
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


def set_dotted(data: dict, key: str, value: Any) -> None:
    """``set_dotted(d, "model_overrides.dim", 128)`` sets ``d["model_overrides"]["dim"]``: where a dotted
    ``--set`` key lands in a :class:`TrainConfig`'s fields (the grammar is :mod:`difftx.overrides`)."""
    parts = key.split(".")
    if len(parts) > 1 and parts[0] == "model" and (isinstance(data.get("model"), str) or data.get("init_from")):
        # a preset name's fields are changed through model_overrides; so are a fine-tune's (init_from), whose saved
        # model is the source's config: its resume, given the command's --set model.X again, lands where the first
        # run put X, not in the source's mapping (refused as a model change before)
        parts = ["model_overrides", *parts[1:]]
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
    if path.is_dir():
        raise ValueError(f"{path}: a folder, not a config file (a JSON or YAML file); to continue a run in a folder, "
                         f"use --out FOLDER --resume")
    if not path.is_file():
        raise FileNotFoundError(f"{path}: config file not found")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not a text file ({e}); a training config is JSON or YAML") from None
    if path.suffix.lower() in (".yaml", ".yml"):
        try:
            import yaml  # optional (difftx[train]): JSON configs need no PyYAML
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
                      preset_name: Optional[str] = None, *, notes: Optional[list[str]] = None,
                      init_from: Optional[str] = None) -> TrainConfig:
    """Preset (``preset_name``, default ``tiny``), then the file's fields, then ``overrides``.

    A file may name its base preset with a top-level ``preset:`` key. Errors name the file.

    ``notes``: when given, a ``warmup_steps`` inherited from the preset or file that exceeds the
    ``steps`` of the overrides is scaled down (see :func:`fit_warmup`) and a sentence saying so is
    appended; without it (and for a ``warmup_steps`` set in ``overrides``) that is an error.

    ``init_from`` (``--init-from``) is set last. With it (or an ``init_from`` override) and neither
    ``preset_name`` nor a file, the base preset is ``finetune``; that preset without an ``init_from``
    is an error.
    """
    data: dict = {}
    if path is not None:
        data = read_config_file(path)
        file_preset = data.pop("preset", None)  # the command line's --preset wins over the file's
        preset_name = preset_name or file_preset
    elif preset_name is None and (init_from or _sets_init_from(overrides or [])):
        preset_name = FINETUNE_PRESET  # fine-tuning with no preset or file named: its schedule, not tiny's
    base = train_preset(preset_name or "tiny")
    try:
        cfg = TrainConfig.from_dict({**base.to_dict(), **data}) if data else base
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    if overrides:
        cfg = fit_warmup(cfg, overrides, notes) if notes is not None else cfg.with_overrides(overrides)
    if init_from:
        cfg = cfg.replace(init_from=init_from)
    if preset_name == FINETUNE_PRESET and cfg.init_from is None:
        raise ValueError(FINETUNE_NEEDS_INIT)
    return cfg


def _sets_init_from(overrides: list[str]) -> bool:
    """Whether ``overrides`` set ``init_from`` to a checkpoint (``--set init_from=PATH``)."""
    return any(key.strip() == "init_from" and parse_value(value) is not None
               for key, value in (split_override(o) for o in overrides))


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


# -- paths saved with a run -----------------------------------------------------------------------
# A run folder may be moved or copied, and commands on it run from any working directory. So
# ``train_config.json`` stores these fields as absolute paths, and under ``saved_paths`` the path
# as it was given, the path relative to the run folder (the fallback once the absolute path is
# gone: a project folder moved with its data) and what identifies the content (the data's size and
# SHA-256, the tokenizer's name, a hash of its file), so that a path given anew can be checked.
PATH_FIELDS = ("data_source", "tokenizer")
SAVED_PATHS = "saved_paths"
PATH_FLAGS = {"data_source": "--data", "tokenizer": "--tokenizer"}


def _is_path(name: str, value: Any) -> bool:
    return isinstance(value, str) and bool(value) and not (name == "tokenizer" and value == "byte")


_identities: dict = {}


def path_identity(name: str, path: Union[str, Path]) -> Optional[dict]:
    """What identifies the content at ``path`` (``None`` if nothing there): for ``data_source`` its
    size in bytes, number of files and SHA-256 (:func:`_content_sha256`), for ``tokenizer`` the
    tokenizer's name (a hash of its ``tokenizer.json``). Computed once per path and modification time
    (for a ``data_source`` folder, those of every file in it: a file edited in place changes no folder's)."""
    path = Path(path)
    try:
        st = path.stat()
    except OSError:
        return None
    key: tuple = (name, str(path.absolute()), st.st_mtime_ns, st.st_size)
    files: list = []
    if name != "tokenizer" and path.is_dir():
        for root, dirs, names in os.walk(path):
            dirs.sort()
            for n in sorted(names):
                try:
                    f = os.stat(os.path.join(root, n))
                    files.append((Path(root, n), f.st_size, f.st_mtime_ns))
                except OSError:
                    pass
        key += (tuple((str(p), size, mtime) for p, size, mtime in files),)
    if key in _identities:
        return _identities[key]
    found: Optional[dict] = None
    if name == "tokenizer":
        try:
            found = {"name": load_tokenizer(str(path)).name}
        except Exception:  # noqa: BLE001 - an unreadable tokenizer has no identity; loading it names the problem
            found = None
    elif path.is_file():
        found = {"bytes": st.st_size, "files": 1, "sha256": _content_sha256(path, [path])}
    elif path.is_dir():
        found = {"bytes": sum(size for _, size, _ in files), "files": len(files),
                 "sha256": _content_sha256(path, [p for p, _, _ in files])}
    _identities[key] = found
    return found


def _content_sha256(root: Path, paths: list) -> Optional[str]:
    """SHA-256 of the file ``root`` (``sha256sum``'s), or for a folder over each file's path relative to it
    and its bytes (None when one cannot be read)."""
    h = hashlib.sha256()
    try:
        for p in paths:
            if Path(p) != Path(root):
                h.update(f"{os.path.relpath(p, root)}\0".encode("utf-8", "surrogateescape"))
            with open(p, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


def saved_form(data: dict, run_dir: Union[None, str, Path] = None) -> dict:
    """``data`` (:meth:`TrainConfig.to_dict`) as a run saves it: :data:`PATH_FIELDS` absolute, and
    ``saved_paths`` recording for each the path as given, relative to the run folder (``run_dir``,
    default ``data["out_dir"]``) and the identity of its content (:func:`path_identity`)."""
    out = {k: v for k, v in data.items() if k != SAVED_PATHS}
    run = os.path.abspath(os.path.expanduser(str(run_dir if run_dir is not None else data.get("out_dir") or ".")))
    records = {}
    for name in PATH_FIELDS:
        value = data.get(name)
        if not _is_path(name, value):
            continue
        absolute = os.path.abspath(os.path.expanduser(value))
        record = {"as_given": value}
        try:
            record["relative_to_run"] = os.path.relpath(absolute, run)
        except ValueError:  # another drive (Windows): no relative path
            pass
        record.update(path_identity(name, absolute) or {})
        out[name], records[name] = absolute, record
    if records:
        out[SAVED_PATHS] = records
    return out


def _candidates(name: str, data: dict, run_dir: Optional[Path]) -> list[str]:
    """Where the saved ``name`` may be now, in order of preference."""
    value = data[name]
    record = (data.get(SAVED_PATHS) or {}).get(name) or {}
    if os.path.isabs(value):
        found = [value]
        rel = record.get("relative_to_run")
        if run_dir is not None and isinstance(rel, str):
            found.append(os.path.normpath(os.path.join(os.path.abspath(run_dir), rel)))
        return found
    # a run saved before paths were made absolute: the path as typed, relative to the working
    # directory, then relative to the folder the run was started from (as many levels above the run
    # folder as its relative out_dir has parts)
    found = [value]
    out_dir = data.get("out_dir")
    if run_dir is not None and isinstance(out_dir, str) and out_dir and not os.path.isabs(out_dir):
        depth = len(Path(os.path.normpath(out_dir)).parts)
        parents = Path(os.path.abspath(run_dir)).parents
        if 0 < depth <= len(parents):
            found.append(os.path.normpath(os.path.join(parents[depth - 1], value)))
    return found


def resolve_saved_paths(data: dict, run_dir: Union[None, str, Path] = None,
                        where: str = "the run's train_config.json") -> tuple[dict, dict[str, str]]:
    """``data`` (a saved ``train_config.json``) with each of :data:`PATH_FIELDS` pointing at where
    it is now: the saved absolute path if it exists, else the same place relative to ``run_dir``
    (the run folder, wherever it is now). Returns the mapping (``saved_paths`` kept) and, for each
    field found nowhere, a sentence naming it, the config file (``where``) and the places tried;
    such a field keeps its saved value."""
    out, missing = dict(data), {}
    run = Path(run_dir) if run_dir is not None else None
    for name in PATH_FIELDS:
        value = data.get(name)
        if not _is_path(name, value):
            continue
        tried = list(dict.fromkeys(_candidates(name, data, run)))
        found = next((p for p in tried if os.path.exists(os.path.expanduser(p))), None)
        if found is not None:
            out[name] = found
            continue
        others = f" (nor at {', '.join(tried[1:])}, relative to the run folder)" if len(tried) > 1 else ""
        missing[name] = f"{name} {value!r}, saved in {where}, does not exist{others}"
    return out, missing


def same_content(name: str, a: str, b: str) -> bool:
    """Whether the existing paths ``a`` and ``b`` hold the same data (files compared byte by byte)
    or the same tokenizer (same name)."""
    a, b = os.path.expanduser(a), os.path.expanduser(b)
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    if name == "tokenizer":
        x, y = path_identity(name, a), path_identity(name, b)
        return x is not None and x == y
    if path_identity(name, a) != path_identity(name, b):
        return False
    if os.path.isfile(a) and os.path.isfile(b):
        return filecmp.cmp(a, b, shallow=False)
    if os.path.isdir(a) and os.path.isdir(b):
        def files(root: str) -> list[str]:
            return sorted(os.path.relpath(os.path.join(r, n), root) for r, _d, ns in os.walk(root) for n in ns)

        names = files(a)
        return names == files(b) and all(filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False)
                                         for n in names)
    return False


def differs_from_record(name: str, path: str, record: Optional[dict]) -> Optional[str]:
    """Why ``path`` is not what a run saved as ``name`` (``record``: its ``saved_paths`` entry),
    or ``None`` when its identity matches, or cannot be checked (a run saved before identities
    were recorded: the resume still checks the token counts and the tokenizer's name)."""
    record = record or {}
    keys = ("name",) if name == "tokenizer" else ("bytes", "files", "sha256")
    saved = {k: record[k] for k in keys if k in record}
    if not saved:
        return None
    got = path_identity(name, os.path.expanduser(path))
    if got is None:
        return f"{path} does not exist"
    got = {k: got.get(k) for k in saved}
    if got == saved:
        return None

    def show(d: dict) -> str:
        if name == "tokenizer":
            return f"the name {d['name']}"
        files = d.get("files")
        return f"{d.get('bytes', 0):,} bytes" + (f" in {files:,} file{'s' if files != 1 else ''}" if files else "")

    if name != "tokenizer" and got.get("sha256") != saved.get("sha256") and show(got) == show(saved):
        return f"{path} has the run's size ({show(got)}) but other content (its SHA-256 differs)"
    return f"{path} has {show(got)}, the run's had {show(saved)}"


# Fields that ``difftx train --resume`` may change from the run's saved train_config.json: they
# decide where and how the run executes and what it logs, not what it computes (``batch_size``
# only with another number of processes and the same global batch, which the trainer checks).
# ``steps`` may be raised: the run then continues longer (its decay follows the new length).
# ``allow_new_data`` is the permission of one command (``--allow-new-data``), not a property of the run.
RESUME_MAY_CHANGE = ("out_dir", "device", "dtype", "compile", "parallel", "batch_size", "progress", "tensorboard",
                     "cache_dir", "log_interval", "eval_interval", "ckpt_interval", "keep_last", "allow_new_data",
                     "steps")


def check_resume_changes(saved: TrainConfig, new: TrainConfig, where: str = "the run's train_config.json", *,
                         missing: Optional[dict] = None, records: Optional[dict] = None) -> TrainConfig:
    """``new``, with the saved spelling of paths that name the same thing (``tok/`` for ``tok``, an
    unset tokenizer for ``byte``, a copy of the same file); ``ValueError`` naming every field in
    which it differs from the ``saved`` config of the run it resumes, except
    :data:`RESUME_MAY_CHANGE` (``steps`` only upwards).

    ``saved`` has its paths resolved (:func:`resolve_saved_paths`); ``missing`` names the path
    fields found nowhere and ``records`` is the run's ``saved_paths``. A missing path given anew
    is accepted when its content is the run's (:func:`differs_from_record`); one not given anew is
    an error saying how to pass it."""
    missing, records = missing or {}, records or {}
    a, b = saved.to_dict(), new.to_dict()
    not_same: dict[str, str] = {}  # a missing path given anew, whose content is not the run's: why

    def same(k: str) -> bool:  # paths spelled differently ("tok/", "./tok") and byte == the default are the same
        x, y = a[k], b[k]
        if k == "tokenizer" and a["init_from"] is None and b["init_from"] is None:
            x, y = x or "byte", y or "byte"
        if k not in ("data_source", "tokenizer", "init_from") or not (isinstance(x, str) and isinstance(y, str)):
            return x == y
        if x == y or os.path.abspath(os.path.expanduser(x)) == os.path.abspath(os.path.expanduser(y)):
            return True
        if k not in PATH_FIELDS or not (_is_path(k, x) and _is_path(k, y)):
            return False
        if k in missing:  # the saved path is gone: is the given one the same content?
            why = differs_from_record(k, y, records.get(k))
            if why is not None:
                not_same[k] = why
            return why is None
        return os.path.exists(x) and os.path.exists(y) and same_content(k, x, y)

    refused = {k: (a[k], b[k]) for k in a if not same(k) and k not in RESUME_MAY_CHANGE}
    if not_same:
        k, why = next(iter(not_same.items()))
        raise ValueError(f"{missing[k]}; {PATH_FLAGS[k]} {b[k]} is not the same "
                         f"{'data' if k == 'data_source' else 'tokenizer'} ({why}); give the one the run was "
                         f"trained with, or start a new run from this one (--out NEW --init-from RUN)")
    if b["steps"] < a["steps"]:
        refused["steps"] = (a["steps"], b["steps"])
    if refused:
        listed = "; ".join(f"{k}: saved {v[0]!r}, asked {v[1]!r}" for k, v in sorted(refused.items()))
        raise ValueError(f"--resume continues the run as {where} describes it, and cannot change "
                         f"{sorted(refused)} ({listed}). A resume may change only {', '.join(RESUME_MAY_CHANGE[1:-1])} "
                         f"and raise steps; to change anything else, start a new run from this one "
                         f"(--out NEW --init-from RUN)")
    gone = [k for k in missing if a[k] == b[k]]  # not given anew
    if gone:
        how = " and ".join(f"{PATH_FLAGS[k]} PATH (or --set {k}=PATH)" for k in gone)
        where_now = "it is" if len(gone) == 1 else "they are"
        raise ValueError(f"{'; '.join(missing[k] for k in gone)}; pass where {where_now} now with {how}")
    kept = {k: a[k] for k in ("data_source", "tokenizer", "init_from")
            if a[k] != b[k] and k not in missing}  # same(k) by now
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


# Fine-tuning a pretrained model (``--init-from``; the default preset there). The architecture is the
# checkpoint's: ``model`` here is a placeholder, replaced by the checkpoint's config when the run starts.
# - lr 2e-4, a tenth of tiny's 2e-3: a pretraining peak would move the trained weights far in the
#   first steps and undo much of what they learned; min_lr keeps the usual 10% of the peak.
# - 20 warm-up steps: the optimizer starts fresh, and its moment estimates need a few steps before
#   the full lr; the weights are already trained, so a long warm-up is not needed.
# - 500 steps, a quarter of tiny's run: a fine-tune adapts a model, it does not train one.
#   Validation every 50 steps and a checkpoint every 100 show the short run and can resume it.
# - batch and sequence length as tiny's (16 x 256): CPU-sized, and within the CPU models' max_seq_len.
FINETUNE_PRESET = "finetune"
FINETUNE_NEEDS_INIT = ("the finetune preset fine-tunes a model: give --init-from CHECKPOINT "
                       "(or init_from in the config)")
_register(FINETUNE_PRESET, model="tiny", batch_size=16, seq_len=256, steps=500, lr=2e-4, min_lr=2e-5,
          warmup_steps=20, eval_interval=50, eval_batches=8, ckpt_interval=100)


def train_preset(name: str, **overrides) -> TrainConfig:
    """A named training preset (see :data:`TRAIN_PRESETS`), with fields replaced."""
    if name not in TRAIN_PRESETS:
        raise ValueError(f"unknown training preset {name!r}; choose one of {sorted(TRAIN_PRESETS)}")
    return TRAIN_PRESETS[name].replace(**overrides) if overrides else TRAIN_PRESETS[name]
