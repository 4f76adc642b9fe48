"""What an evaluation runs on: one trained model and the vocabulary it was trained with.

Two kinds of checkpoint are understood, and both ``difftx compare`` and ``difftx eval`` load
them through :func:`load_subject`, so they score a model with the very same code:

- a model trained by ``difftx compare`` (its folder holds ``compare_task.json``): the synthetic
  needle task with its own token ids (when it was trained on needle batches), held-out
  Shakespeare bytes or your held-out text (``compare --data``) shifted past them (when it was
  trained on LM batches), the synthetic ICL task (when it was trained on ICL batches) and
  associative recall in its own ids (when it was trained on recall batches);
- a text model trained by ``difftx train`` (a tokenizer saved with it, or given): held-out text
  and the natural-language needle form.

Held-out text of a text model: with ``data=None`` the run's own validation split (read from the
``train_config.json`` saved with the checkpoint: its data source, tokenizer and split), else the
whole of ``data`` (no split: every token of the file is scored once).

What ``difftx compare`` hands to the tasks is typed here, each with JSON in and out:
:class:`CompareTask` (``compare_task.json`` beside a compare model: its :class:`TaskSpace`,
LM window length and :class:`TextData`) and :class:`TrainRecord` (``train.json``, its training
record).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from ..io import check_record, read_json, write_json

if TYPE_CHECKING:  # torch is imported where a model is loaded: `difftx --help` stays light
    import torch

    from ..eval.icl import ICLBlock
    from ..eval.needle import NeedleBlock
    from ..eval.recall import RecallBlock

TASK_FILE = "compare_task.json"  # beside a compare model's config.json: its task vocabulary
TRAIN_RECORD = "train.json"  # beside a compare model's folder: its training record
BYTE_VOCAB = 257  # the byte tokenizer: 256 bytes and end-of-text


@dataclass(frozen=True)
class TextBlock:
    """The text's ids in a compare model's vocabulary: ``size`` ids (UTF-8 bytes and the byte tokenizer's
    end-of-text, or your tokenizer's) from ``first_id``."""

    first_id: int
    size: int = BYTE_VOCAB

    @property
    def end(self) -> int:
        return self.first_id + self.size


@dataclass(frozen=True)
class BlockKind:
    """How the block of one training task is written to ``compare_task.json`` and read back, registered by the
    module that evaluates the task (:func:`register_block`): ``write(block, space)`` gives its keys (``block``
    None: the task has no batches in ``space``), ``read(data, before)`` the block or None (``before``: the blocks
    read so far), ``end(block)`` the id after its last, and ``what`` names it in an error."""

    write: Callable[[Any, "TaskSpace"], dict]
    read: Callable[[dict, dict], Any]
    end: Callable[[Any], int]
    what: str


# {training task name: its BlockKind}, in the order the blocks are written and read
BLOCK_KINDS: dict[str, BlockKind] = {}


def register_block(name: str, kind: BlockKind) -> None:
    """Say how training task ``name``'s block is written and read (:class:`BlockKind`)."""
    BLOCK_KINDS[name] = kind


def block_end(name: str, block: Any) -> int:
    """The id after the last of ``block`` (a task's without a :class:`BlockKind`: a ``range``)."""
    return BLOCK_KINDS[name].end(block) if name in BLOCK_KINDS else block.stop


def first_free(blocks: dict) -> int:
    """The first id after every block of ``blocks``."""
    return max([0, *(block_end(n, b) for n, b in blocks.items())])


@dataclass(frozen=True)
class TaskSpace:
    """The shared vocabulary of a compare model: ``{training task name: its block of ids}`` for the tasks it
    was trained on, in id order (a task without batches has no block). The ids of a block are its own: each
    kind of block is written and read as its :class:`BlockKind` says; a task without one (a training task
    registered in :mod:`difftx.compare.training_tasks`) has a ``range``."""

    blocks: dict = field(default_factory=dict)

    def block(self, name: str) -> Any:
        """The block of training task ``name`` (None: it has none here)."""
        return self.blocks.get(name)

    def before(self, name: str) -> dict:
        """The blocks of the kinds written before ``name``'s (:data:`BLOCK_KINDS` order)."""
        kinds = list(BLOCK_KINDS)
        earlier = set(kinds[:kinds.index(name)]) if name in kinds else set(kinds)
        return {n: b for n, b in self.blocks.items() if n in earlier}

    @property
    def vocab_size(self) -> int:
        return first_free(self.blocks)

    def ids(self, name: str) -> Optional[range]:
        """The ids of a training task that has a ``range`` (None: it has no such block here)."""
        block = self.blocks.get(name)
        return block if isinstance(block, range) else None

    def to_dict(self) -> dict:
        """JSON-ready: each :class:`BlockKind`'s keys, then ``blocks`` (``[name, first_id, size]`` of each
        ``range``); :meth:`from_dict` reads it back."""
        out: dict = {}
        for name, kind in BLOCK_KINDS.items():
            out.update(kind.write(self.blocks.get(name), self))
        ranges = [[n, b.start, len(b)] for n, b in self.blocks.items() if n not in BLOCK_KINDS]
        return {**out, **({"blocks": ranges} if ranges else {})}

    @classmethod
    def from_dict(cls, data: dict) -> TaskSpace:
        blocks: dict = {}
        for name, kind in BLOCK_KINDS.items():
            block = kind.read(data, blocks)
            if block is not None:
                blocks[name] = block
        for n, first, size in data.get("blocks", ()):
            blocks[str(n)] = range(int(first), int(first) + int(size))
        return cls(blocks)


@dataclass(frozen=True)
class TextData:
    """Your own text (``difftx compare --data``): ``source`` as ``difftx train --data`` takes it, its
    ``tokenizer`` ("byte" or a path) and ``heldout``, a file scored whole (None: the corpus's
    validation split). Paths are absolute."""

    source: str
    tokenizer: str
    heldout: Optional[str] = None

    def prepare(self, progress: bool = False):
        """The corpus's token stores (:func:`difftx.data.prepare_data`, cached)."""
        from ..data import prepare_data

        return prepare_data(self.source, self.tokenizer, progress=progress)

    def heldout_tokens(self, progress: bool = False):
        """The held-out stream (uint ids, 1-D) and what it is: every token of ``heldout``, else the
        corpus's validation split."""
        from ..data import prepare_data

        if self.heldout is not None:
            return prepare_data(self.heldout, self.tokenizer, val_fraction=0.0, progress=progress).train.tokens, \
                f"all of {self.heldout}"
        val = self.prepare(progress).val
        if val is None:
            raise ValueError(f"--data {self.source}: no validation split; give --heldout FILE")
        return val.tokens, f"the validation split of {self.source}"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    # the fields that name files (the tokenizer is read from the copy saved beside a compare model)
    FILE_FIELDS = ("source", "heldout")

    def relative_to(self, folder: str | os.PathLike) -> dict:
        """``{field: path relative to folder}`` of :data:`FILE_FIELDS` (where a folder moved together with
        its text finds it again); a field without a relative form (another drive) is left out."""
        out = {}
        for name in self.FILE_FIELDS:
            value = getattr(self, name)
            if value is not None:
                try:
                    out[name] = os.path.relpath(value, os.path.abspath(folder))
                except ValueError:
                    pass
        return out

    def found_from(self, folder: str | os.PathLike, relative: dict) -> TextData:
        """This text with each file that is no longer at its saved absolute path looked up at its saved
        path relative to ``folder`` (where the comparison is now); a file found nowhere keeps its path,
        and reading it names it."""
        moved = {}
        for name in self.FILE_FIELDS:
            value, rel = getattr(self, name), relative.get(name)
            if value is not None and not os.path.exists(value) and isinstance(rel, str):
                candidate = os.path.normpath(os.path.join(os.path.abspath(folder), rel))
                if os.path.exists(candidate):
                    moved[name] = candidate
        return dataclasses.replace(self, **moved) if moved else self


@dataclass(frozen=True)
class CompareTask:
    """What a compare model was trained on, saved beside its ``config.json`` as ``compare_task.json``
    (:data:`TASK_FILE`): its task vocabulary, the length of its LM windows, and your text
    (``compare --data``; None: the bundled Shakespeare bytes)."""

    space: TaskSpace
    lm_seq_len: Optional[int] = None
    text: Optional[TextData] = None

    def to_dict(self) -> dict:
        return {**self.space.to_dict(), "lm_seq_len": self.lm_seq_len,
                "text": self.text.to_dict() if self.text is not None else None}

    @classmethod
    def from_dict(cls, data: dict) -> CompareTask:
        return cls(TaskSpace.from_dict(data), data.get("lm_seq_len"),
                   TextData(**data["text"]) if data.get("text") else None)

    def write(self, folder: str | os.PathLike) -> Path:
        """``folder/compare_task.json``; your text's files also relative to ``folder`` (``text_relative``)."""
        data = self.to_dict()
        if self.text is not None:
            data["text_relative"] = self.text.relative_to(folder)
        return write_json(Path(folder) / TASK_FILE, data, sort_keys=False)

    @classmethod
    def read(cls, folder: str | os.PathLike) -> CompareTask:
        """The task of the compare model in ``folder`` (``ValueError`` naming the file when it is
        missing, not JSON or not a compare task). A text file gone from its absolute path is looked up
        relative to ``folder`` (:meth:`TextData.found_from`): a comparison moved together with its text."""
        path = Path(folder) / TASK_FILE
        data = read_json(path, "the task vocabulary of a compare model")
        try:
            task = cls.from_dict(data)
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: does not describe a compare task ({e})") from None
        relative = data.get("text_relative")
        if task.text is not None and isinstance(relative, dict):
            task = dataclasses.replace(task, text=task.text.found_from(folder, relative))
        return task


def arm_record(data: dict) -> dict:
    """A training record (``train.json``, or ``runs.{seed}.{arm}.train`` of ``results.json``) as any difftx wrote
    it, with today's keys: the arm it was trained as under ``arm``, also in its ``request``, where older records
    wrote ``kind`` (the key's place in the record kept). Anything else is returned as it is."""
    def renamed(d: dict) -> dict:
        return {("arm" if k == "kind" and "arm" not in d else k): v for k, v in d.items()}

    if not isinstance(data, dict):
        return data
    out = renamed(data)
    if isinstance(out.get("request"), dict):
        out["request"] = renamed(out["request"])
    return out


@dataclass
class TrainRecord:
    """A compare model's training record, ``train.json`` (:data:`TRAIN_RECORD`) beside its model
    folder: written by ``difftx compare`` when the model is trained (its presence marks the training
    finished), read by the training task and into ``results.json``. ``history`` holds a record every
    ``log_every`` steps (step, lr, loss per batch kind, gradient norms, tokens, time, λ per layer),
    ``probes`` the needle probes taken during training; ``probes_skipped`` (why there are none),
    ``heldout_curve`` (the held-out loss along training), ``stacked`` and ``request`` are written
    only when set. ``arm`` is the arm of the comparison the model was trained as (older records call it
    ``kind``: :func:`arm_record` reads them)."""

    arm: str
    seed: int
    config: dict
    parameters: int
    steps: int
    history: list
    probes: list = field(default_factory=list)
    probe_s: float = 0.0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    device: Optional[str] = None
    threads: Optional[int] = None
    world_size: Optional[int] = None
    resumed_from: Optional[int] = None
    invocation: Optional[str] = None  # the compare run that trained it (throughput is compared within one)
    probes_skipped: Optional[str] = None
    heldout_curve: Optional[dict] = None
    stacked: Optional[int] = None  # trained in a stack of this many seeds (wall_s, cpu_s: its share)
    # what it was trained with (the settings that decide its weights, its text; see
    # difftx.compare.folder.training_request): a reuse must ask for the same
    request: Optional[dict] = None

    REQUIRED = ("arm", "seed", "config", "parameters", "steps", "history", "wall_s", "cpu_s")
    WHEN_SET = ("probes_skipped", "heldout_curve", "stacked", "request")
    # the kinds its readers (the training task, the report) rely on (difftx.io.check_record)
    FIELDS = {"arm": "str", "seed": "int", "config": "dict", "parameters": "int", "steps": "posint",
              "history": "list", "history[].step": "int", "history[].lr": "number?", "history[].lm_loss": "number?",
              "history[].needle_loss": "number?", "history[].icl_loss": "number?", "history[].grad_norm": "number?",
              "history[].grad_norms": "list?", "history[].tokens": "int?", "history[].time_s": "number?",
              "history[].lambda": "list?", "probes": "list?", "probes[].step": "int", "probes[].accuracy": "dict?",
              "probes[].recall": "dict?", "probes[].attention_output_ratio": "list?", "probes[].lambda": "list?",
              "probe_s": "number?", "wall_s": "number", "cpu_s": "number", "device": "str?", "threads": "int?",
              "world_size": "int?", "resumed_from": "int?", "invocation": "str?", "probes_skipped": "str?",
              "heldout_curve": "dict?", "heldout_curve.steps": "list?", "heldout_curve.tokens": "list?",
              "heldout_curve.loss": "list?", "stacked": "int?", "request": "dict?"}

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: v for k, v in out.items() if v is not None or k not in self.WHEN_SET}

    @classmethod
    def from_dict(cls, data: dict, where: str = "TrainRecord") -> TrainRecord:
        if not isinstance(data, dict):
            raise ValueError(f"{where}: not a training record (not a JSON object)")
        data = arm_record(data)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown, missing = sorted(set(data) - known), [k for k in cls.REQUIRED if k not in data]
        if unknown or missing:
            raise ValueError(f"{where}: not a training record (unknown field(s) {unknown}, missing {missing})")
        return cls(**check_record(data, cls.FIELDS, where, "a training record"))

    def write(self, folder: str | os.PathLike) -> Path:
        return write_json(Path(folder) / TRAIN_RECORD, self.to_dict(), sort_keys=False)

    @classmethod
    def read(cls, folder: str | os.PathLike) -> TrainRecord:
        """The record in ``folder`` (``ValueError`` naming the file when it is missing, not JSON or
        not a training record)."""
        path = Path(folder) / TRAIN_RECORD
        return cls.from_dict(read_json(path, "the training record of a compare model"), str(path))


@dataclass
class HeldOut:
    """A held-out token stream in the model's ids: ``tokens`` (1-D), what it is, its bytes per
    token (1 for bytes), the training length (the default LM window) and, where the text's
    documents are known, their starts in ``tokens`` (then its length; blocks of whole documents
    in the LM intervals: ``difftx.eval.blocks``)."""

    tokens: torch.Tensor
    source: str
    bytes_per_token: float
    train_len: int
    doc_offsets: Any = None
    train_len_known: bool = True  # False: no training record says it (an imported model): its maximum length


@dataclass
class Subject:
    """A loaded model with what the tasks need (``needle``/``icl`` task definitions for a
    compare model, ``tokenizer`` for a text model)."""

    model: Any
    folder: Path
    compare: Optional[CompareTask] = None  # a compare model: what it was trained on
    tokenizer: Any = None  # text model
    data: Any = None  # text model: the held-out source given by the user (None: the run's own split)
    train_config: dict = field(default_factory=dict)  # text model: its train_config.json, if saved
    missing_paths: dict = field(default_factory=dict)  # text model: saved paths found nowhere (field -> why)
    _heldout: Optional[HeldOut] = None

    @property
    def is_compare_model(self) -> bool:
        return self.compare is not None

    @property
    def from_source(self) -> bool:
        """A compare model of a comparison from a pretrained source (``compare --from``): its training record's
        request names the source."""
        if self.compare is None:
            return False
        rec = self.history()
        return rec is not None and bool((rec.request or {}).get("source"))

    @property
    def needle(self) -> Optional[NeedleBlock]:
        """The synthetic needle task of a compare model trained on needle batches."""
        return self.compare.space.block("needle") if self.compare is not None else None

    @property
    def icl(self) -> Optional[ICLBlock]:
        """The synthetic ICL task of a compare model trained on ICL batches."""
        return self.compare.space.block("icl") if self.compare is not None else None

    @property
    def recall(self) -> Optional[RecallBlock]:
        """The associative-recall task of a compare model trained on recall batches."""
        return self.compare.space.block("recall") if self.compare is not None else None

    @property
    def lm_offset(self) -> Optional[int]:
        """Where the text ids of a compare model trained on LM batches start."""
        text = self.compare.space.block("lm") if self.compare is not None else None
        return text.first_id if text is not None else None

    @property
    def lm_seq_len(self) -> Optional[int]:
        return self.compare.lm_seq_len if self.compare is not None else None

    @property
    def text(self) -> Optional[TextData]:
        """Your own text of a compare model trained on it (compare --data)."""
        return self.compare.text if self.compare is not None else None

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
        return HeldOut(ids, what, _text_bytes_per_token(self.tokenizer, ids), train_len, store.doc_offsets,
                       train_len_known=bool(tc.get("seq_len")))

    def _text_heldout(self) -> HeldOut:
        """A compare model trained on your own text: every token of its held-out file, else its
        corpus's validation split, in the model's ids."""
        import torch

        from ..data import load_tokenizer
        from ..training.checkpointing import TOKENIZER_DIR

        text = self.text
        gone = next((f for f in (text.heldout, text.source) if f is not None and not Path(f).exists()), None)
        if gone is not None and (gone == text.heldout or text.heldout is None):
            raise FileNotFoundError(2, "the held-out text of this compare model is not there (nor at the same place "
                                       "relative to the model); score a file with --data FILE", gone)
        if (self.folder / TOKENIZER_DIR).is_dir():  # the copy saved with the model
            text = dataclasses.replace(text, tokenizer=str(self.folder / TOKENIZER_DIR))
        tokens, what = text.heldout_tokens()
        ids = torch.from_numpy(tokens[:].astype("int64"))
        bpt = _text_bytes_per_token(load_tokenizer(text.tokenizer), ids)
        return HeldOut(ids + self.lm_offset, what, bpt, int(self.lm_seq_len))

    def history(self) -> Optional[TrainRecord]:
        """The training record (``train.json`` of a compare model), or ``None``."""
        return TrainRecord.read(self.folder.parent) if (self.folder.parent / TRAIN_RECORD).is_file() else None

    def describe(self) -> dict:
        m = self.model
        return {"checkpoint": str(self.folder), "attention": m.config.attention, "parameters": m.num_parameters(),
                "kind": "compare model" if self.is_compare_model else "text model"}


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
    from ..training.checkpointing import (
        TOKENIZER_DIR, TRAIN_CONFIG_NAME, read_train_config, resolve_checkpoint, run_folder_of,
    )
    from ..training.config import resolve_saved_paths
    from ..training.distributed import resolve_device

    folder = resolve_checkpoint(path)
    model = load_model(folder, device=device if isinstance(device, torch.device) else resolve_device(device)).eval()
    if (folder / TASK_FILE).is_file():
        task = CompareTask.read(folder)
        if data is not None and tokenizer is None and task.text is not None and isinstance(data, (str, os.PathLike)):
            # a compare model trained on your text: --data names the held-out text to score instead of its own
            task = dataclasses.replace(task, text=dataclasses.replace(task.text, heldout=str(
                Path(data).expanduser().resolve())))
        elif tokenizer is not None or data is not None:
            raise ValueError(f"{folder}: a compare model has its own task vocabulary (and tokenizer); --tokenizer "
                             "applies to text models only, and --data to text models and to compare models trained "
                             "on your text (compare --data)")
        space = task.space
        for name, block in space.blocks.items():
            need = block_end(name, block)
            what = BLOCK_KINDS[name].what if name in BLOCK_KINDS else f"training task {name!r}"
            if need > model.config.vocab_size:
                raise ValueError(f"{folder}: the {what} needs {need} token ids, the model has only "
                                 f"{model.config.vocab_size}")
        return Subject(model, folder, compare=task)
    from ..data.tokenizer import check_tokenizer_compatible, load_tokenizer

    tc = read_train_config(folder / TRAIN_CONFIG_NAME, error=ValueError) if (folder / TRAIN_CONFIG_NAME).is_file() \
        else {}
    tc, missing = resolve_saved_paths(tc, run_folder_of(folder), str(folder / TRAIN_CONFIG_NAME))  # moved runs
    saved = folder / TOKENIZER_DIR if (folder / TOKENIZER_DIR).exists() else None  # the one it was trained with
    tok = load_tokenizer(tokenizer or saved or "byte")
    check_tokenizer_compatible(tok, model.config.vocab_size, folder, given=tokenizer, saved=saved)
    return Subject(model, folder, tokenizer=tok, data=data, train_config=tc, missing_paths=missing)
