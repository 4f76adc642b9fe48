"""What an evaluation runs on: one trained model and the vocabulary it was trained with.

Two kinds of checkpoint are understood, and both ``difftx compare`` and ``difftx eval`` load
them through :func:`load_subject`, so they score a model with the very same code:

- a model trained by ``difftx compare`` (its folder holds ``compare_task.json``): the synthetic
  needle task with its own token ids (when it was trained on needle batches), held-out
  Shakespeare bytes or your held-out text (``compare --data``) shifted past them (when it was
  trained on LM batches) and the synthetic ICL task (when it was trained on ICL batches);
- a text model trained by ``difftx train`` (a tokenizer saved with it, or given): held-out text
  and the natural-language needle form.

Held-out text of a text model: with ``data=None`` the run's own validation split (read from the
``train_config.json`` saved with the checkpoint: its data source, tokenizer and split), else the
whole of ``data`` (no split: every token of the file is scored once).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # torch is imported where a model is loaded: `difftx --help` stays light
    import torch

TASK_FILE = "compare_task.json"  # beside a compare model's config.json: its task vocabulary
TRAIN_RECORD = "train.json"  # beside a compare model's folder: its training record


@dataclass
class HeldOut:
    """A held-out token stream in the model's ids: ``tokens`` (1-D), what it is, its bytes per
    token (1 for bytes) and the training length (the default LM window)."""

    tokens: torch.Tensor
    source: str
    bytes_per_token: float
    train_len: int


@dataclass
class Subject:
    """A loaded model with what the tasks need (``needle``/``icl`` task definitions for a
    compare model, ``tokenizer`` for a text model)."""

    model: Any
    folder: Path
    needle: Any = None  # difftx.eval.needle.NeedleTask (compare model)
    icl: Any = None  # difftx.eval.icl.ICLTask (compare model trained on ICL batches)
    lm_offset: Optional[int] = None  # compare model trained on LM batches: byte ids start here
    lm_seq_len: Optional[int] = None
    tokenizer: Any = None  # text model
    data: Any = None  # text model: the held-out source given by the user (None: the run's own split)
    train_config: dict = field(default_factory=dict)  # text model: its train_config.json, if saved
    missing_paths: dict = field(default_factory=dict)  # text model: saved paths found nowhere (field -> why)
    text: Optional[dict] = None  # compare model on your own text (compare --data): source, tokenizer, heldout
    compare: bool = False  # a compare model (with or without a needle task)
    _heldout: Optional[HeldOut] = None

    @property
    def is_compare_model(self) -> bool:
        return self.compare or self.needle is not None

    @property
    def has_text(self) -> bool:
        """Whether the model was trained on text (so LM metrics mean something)."""
        return self.tokenizer is not None or self.lm_offset is not None

    def heldout(self) -> HeldOut:
        """The held-out stream (cached)."""
        if self._heldout is None:
            self._heldout = self._load_heldout()
        return self._heldout

    def _load_heldout(self) -> HeldOut:
        import torch

        from ..data import prepare_data

        if self.is_compare_model:
            if self.lm_offset is None:
                raise ValueError(f"{self.folder}: this compare model was trained without LM batches")
            if self.text is not None:
                return self._text_heldout()
            val = prepare_data(None, "byte", progress=False).val
            ids = torch.from_numpy(val.tokens[:].astype("int64")) + self.lm_offset
            return HeldOut(ids, "held-out bundled Shakespeare (bytes)", 1.0, int(self.lm_seq_len))
        tc = self.train_config
        train_len = int(tc.get("seq_len") or self.model.config.max_seq_len)
        if self.data is not None:
            data = prepare_data(self.data, self.tokenizer, val_fraction=0.0, progress=False)
            store, what = data.train, str(self.data)
        else:
            if "data_source" in self.missing_paths:
                raise ValueError(f"{self.missing_paths['data_source']}; the run's validation split is rebuilt from "
                                 f"it: put it back there, or score a file with --data FILE (every token of it)")
            data = prepare_data(tc.get("data_source"), self.tokenizer, val_fraction=tc.get("val_fraction"),
                                text_field=tc.get("text_field", "text"), progress=False)
            name = tc.get("data_source") or "the bundled corpus"
            store, what = (data.val, f"the validation split of {name}") if data.val is not None else \
                (data.train, f"{name} (it has no validation split)")
        ids = torch.from_numpy(store.tokens[:].astype("int64"))
        return HeldOut(ids, what, _text_bytes_per_token(self.tokenizer, ids), train_len)

    def _text_heldout(self) -> HeldOut:
        """A compare model trained on your own text: every token of its held-out file, else its
        corpus's validation split, in the model's ids."""
        import dataclasses

        import torch

        from ..compare.plan import TextData
        from ..data import load_tokenizer

        text = TextData(**self.text)
        if (self.folder / "tokenizer").is_dir():  # the copy saved with the model
            text = dataclasses.replace(text, tokenizer=str(self.folder / "tokenizer"))
        tokens, what = text.heldout_tokens()
        ids = torch.from_numpy(tokens[:].astype("int64"))
        bpt = _text_bytes_per_token(load_tokenizer(text.tokenizer), ids)
        return HeldOut(ids + self.lm_offset, what, bpt, int(self.lm_seq_len))

    def history(self) -> Optional[dict]:
        """The training record (``train.json`` of a compare model), or ``None``."""
        path = self.folder.parent / TRAIN_RECORD
        if not path.is_file():
            return None
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None

    def describe(self) -> dict:
        m = self.model
        return {"checkpoint": str(self.folder), "attention": m.config.attention, "parameters": m.num_parameters(),
                "kind": "compare model" if self.is_compare_model else "text model"}


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None


def _text_bytes_per_token(tokenizer: Any, ids) -> float:
    """UTF-8 bytes of the text per token of ``ids`` (1 for the byte tokenizer). A document separator
    (``eos_id``) is no text and has no bytes: decoded, ``<|endoftext|>`` would count as 13."""
    from ..eval.lm import bytes_per_token

    if getattr(tokenizer, "name", "") == "byte":
        return 1.0
    eos = getattr(tokenizer, "eos_id", None)
    return bytes_per_token(tokenizer.decode([i for i in ids.tolist() if i != eos]), ids.numel())


def load_subject(path: str | os.PathLike, *, tokenizer: Optional[str] = None, data: Any = None,
                 device: str | torch.device = "cpu") -> Subject:
    """Load the checkpoint at ``path`` (a checkpoint folder, or a run folder whose latest
    checkpoint is used) with what the tasks need."""
    import torch

    from ..checkpoint import load_model
    from ..eval.icl import ICLTask
    from ..eval.needle import NeedleTask
    from ..training.checkpointing import TOKENIZER_DIR, TRAIN_CONFIG_NAME, resolve_checkpoint, run_folder_of
    from ..training.config import resolve_saved_paths
    from ..training.distributed import resolve_device

    folder = resolve_checkpoint(path)
    model = load_model(folder, device=device if isinstance(device, torch.device) else resolve_device(device)).eval()
    if (folder / TASK_FILE).is_file():
        info = _read_json(folder / TASK_FILE)
        if tokenizer is not None or data is not None:
            raise ValueError(f"{folder}: a compare model has its own task vocabulary; --tokenizer and --data "
                             "apply to text models only")
        try:
            needle = NeedleTask(**info["needle_task"]) if info.get("needle_task") else None
            icl = ICLTask(**info["icl_task"]) if info.get("icl_task") else None
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{folder / TASK_FILE}: does not describe a compare task ({e})") from None
        for need, what in ((needle.vocab_size if needle else 0, "needle task"),
                           (icl.vocab_size if icl else 0, "ICL task"),
                           (info.get("lm_offset", 0) + info.get("lm_vocab", 0), "text")):
            if need > model.config.vocab_size:
                raise ValueError(f"{folder}: the {what} needs {need} token ids, the model has only "
                                 f"{model.config.vocab_size}")
        return Subject(model, folder, needle=needle, icl=icl, lm_offset=info["lm_offset"] if info.get("lm") else None,
                       lm_seq_len=info.get("lm_seq_len"), text=info.get("text"), compare=True)
    from ..data import load_tokenizer

    tc = _read_json(folder / TRAIN_CONFIG_NAME) if (folder / TRAIN_CONFIG_NAME).is_file() else {}
    tc, missing = resolve_saved_paths(tc, run_folder_of(folder), str(folder / TRAIN_CONFIG_NAME))  # moved runs
    spec = tokenizer or (folder / TOKENIZER_DIR if (folder / TOKENIZER_DIR).exists() else "byte")
    tok = load_tokenizer(spec)
    if tokenizer is not None and (folder / TOKENIZER_DIR).exists():  # the one it was trained with is saved beside it
        own = load_tokenizer(folder / TOKENIZER_DIR)
        if own.name != tok.name:
            raise ValueError(f"{folder}: --tokenizer {tokenizer} ({tok.name}, {tok.vocab_size} tokens) is not the "
                             f"tokenizer this model was trained with ({own.name}, {own.vocab_size} tokens, saved in "
                             f"{folder / TOKENIZER_DIR}); leave --tokenizer out to use that one")
    if tok.vocab_size > model.config.vocab_size:
        raise ValueError(f"{folder}: tokenizer {spec} has {tok.vocab_size} tokens, the model only "
                         f"{model.config.vocab_size}")
    return Subject(model, folder, tokenizer=tok, data=data, train_config=tc, missing_paths=missing)
