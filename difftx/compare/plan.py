"""A comparison resolved into plain parts: :func:`resolve` turns a :class:`ComparePreset` into a
:class:`ComparePlan` once, and each later step receives only its part:

- ``space`` (:class:`TaskSpace`): the shared vocabulary of the needle, LM and ICL tasks;
- ``arms``: the model config of every arm (``{"baseline": ..., "diff": ..., ...}``, see
  :data:`difftx.config.ARMS`);
- ``schedule`` (:class:`Schedule`): optimizer and learning-rate schedule, read by the trainer;
- ``mixture`` (:class:`Mixture`): which kind of batch each optimizer step draws, read by the
  batch source (:class:`difftx.compare.stream.CompareStream`);
- ``probes`` (:class:`Probes`): the needle probes taken during training;
- ``curve`` (:class:`Curve`): the held-out loss measured along training;
- ``text`` (:class:`TextData` or None): your own corpus, tokenizer and held-out text (``--data``);
- ``tasks``: every registered evaluation task's validated settings;
- ``execution`` (:class:`Execution`): threads, parallel workers and device (how it runs, not
  what it computes).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from ..config import ModelConfig, arm_config
from ..eval.icl import ICLTask
from ..eval.needle import NeedleTask

if TYPE_CHECKING:
    from ..training.config import TrainConfig
    from .presets import ComparePreset

BYTE_VOCAB = 257  # the byte tokenizer: 256 bytes and end-of-text
BATCH_KINDS = ("needle", "lm", "icl")


@dataclass(frozen=True)
class TaskSpace:
    """The shared vocabulary: needle-task ids first (none without needle batches), then (with LM
    batches) the text's ``lm_vocab`` ids (UTF-8 bytes and the byte tokenizer's end-of-text, or your
    tokenizer's) shifted by ``lm_offset``, then (with ICL batches) the ICL task's ids, which start
    at ``icl.first_id``."""

    needle: Optional[NeedleTask]
    lm: bool
    icl: Optional[ICLTask] = None
    lm_vocab: int = BYTE_VOCAB

    @property
    def lm_offset(self) -> int:
        return self.needle.vocab_size if self.needle is not None else 0

    @property
    def vocab_size(self) -> int:
        return self.icl.vocab_size if self.icl else self.lm_offset + (self.lm_vocab if self.lm else 0)


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


@dataclass(frozen=True)
class Curve:
    """Held-out loss along training: at ``steps`` (log-spaced, the last step included), the mean
    NLL of ``windows`` fixed held-out windows of the LM training length (none: no curve)."""

    steps: tuple
    windows: int


def curve_steps(total: int, points: int) -> tuple:
    """``points`` steps spaced geometrically from ~1% of ``total`` to ``total`` (rounded,
    duplicates dropped: fewer for a short run; ``()`` for ``points = 0``)."""
    if points <= 0:
        return ()
    first = max(1, round(total / 100))
    if points == 1 or first >= total:
        return (total,)
    ratio = (total / first) ** (1 / (points - 1))
    return tuple(sorted({min(total, round(first * ratio ** i)) for i in range(points - 1)} | {total}))


@dataclass(frozen=True)
class Mixture:
    """Which batch optimizer step ``s`` (from 1) draws: LM every ``lm_every``-th step, ICL every
    ``icl_every``-th other step, the needle task otherwise (0: never). ``batch_size`` is the
    global batch (all processes together); LM batches are windows of ``lm_seq_len`` predictions."""

    batch_size: int
    lm_every: int
    icl_every: int
    lm_seq_len: int

    def step_kind(self, step: int) -> str:
        """``"lm"``, ``"icl"`` or ``"needle"``: the kind of batch of optimizer step ``step`` (from 1)."""
        if self.lm_every and step % self.lm_every == 0:
            return "lm"
        if self.icl_every and step % self.icl_every == 0:
            return "icl"
        return "needle"

    def shares(self) -> dict[str, float]:
        """Share of the training steps of each batch kind (over one period of the schedule)."""
        period = math.lcm(self.lm_every or 1, self.icl_every or 1)
        kinds = [self.step_kind(s) for s in range(1, period + 1)]
        return {k: kinds.count(k) / period for k in BATCH_KINDS}


@dataclass(frozen=True)
class Schedule:
    """Optimizer and schedule of every model: AdamW, linear warmup then cosine decay to ``min_lr``
    over ``steps``, a log record every ``log_every`` steps."""

    steps: int
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    log_every: int

    def train_config(self, *, model: ModelConfig, batch_size: int, seed: int, out_dir: str | os.PathLike,
                     device: str = "auto", world_size: int = 1, progress: bool = False) -> TrainConfig:
        """The trainer's config of one model: ``batch_size`` is the global batch
        (``batch_size // world_size`` per process); a checkpoint every ~10% of the steps (a multiple
        of ``log_every``, so a resumed run logs the same records); no validation passes."""
        from ..training.config import TrainConfig

        if batch_size % world_size:
            raise ValueError(f"ComparePreset.batch_size: {batch_size} is not divisible by the {world_size} "
                             "processes (each takes an equal share of every batch)")
        ckpt_every = max(1, round(self.steps / 10 / self.log_every)) * self.log_every
        return TrainConfig(model=model.to_dict(), seq_len=model.max_seq_len, batch_size=batch_size // world_size,
                           steps=self.steps, lr=self.lr, min_lr=self.min_lr, warmup_steps=self.warmup_steps,
                           decay="cosine", weight_decay=self.weight_decay, grad_clip=self.grad_clip, seed=seed,
                           eval_interval=0, log_interval=self.log_every, ckpt_interval=ckpt_every, keep_last=1,
                           out_dir=str(out_dir), tensorboard=False, progress=progress, device=device)


@dataclass(frozen=True)
class Probes:
    """Needle accuracy on ``samples`` fixed prompts per ``grid`` cell every ``every`` steps of
    training (0: none)."""

    every: int
    samples: int
    grid: tuple


@dataclass(frozen=True)
class Execution:
    """How models are run: torch threads per process (None: as is), models trained side by side
    in separate processes, device, and the largest stack of one arm's seeds trained as one model
    (0: chosen by :func:`difftx.compare.run.stack_size`; 1: none)."""

    threads: Optional[int]
    workers: int
    device: str
    stack: int = 0


@dataclass(frozen=True)
class ComparePlan:
    """A preset resolved (see the module doc)."""

    name: str
    space: TaskSpace
    arms: dict
    schedule: Schedule
    mixture: Mixture
    probes: Probes
    tasks: dict
    execution: Execution
    curve: Curve = Curve((), 0)
    text: Optional[TextData] = None


def resolve(preset: ComparePreset) -> ComparePlan:
    """The parts of ``preset`` (already validated at its construction)."""
    from pathlib import Path

    from ..data import load_tokenizer

    tasks = preset.task_settings()
    grid = tasks["needle"].grid
    needle = NeedleTask(n_keys=preset.n_keys, n_filler=preset.n_filler, context_len=preset.context_len,
                        max_needles=preset.max_needles, max_query=max(r for _, r in grid)) \
        if preset.needle_batches else None
    lm = preset.lm_every > 0
    text, lm_vocab = None, BYTE_VOCAB
    if preset.data is not None:
        tok = preset.tokenizer or "byte"
        text = TextData(str(Path(preset.data).expanduser().resolve()),
                        tok if tok == "byte" else str(Path(tok).expanduser().resolve()),
                        None if preset.heldout is None else str(Path(preset.heldout).expanduser().resolve()))
        lm_vocab = load_tokenizer(text.tokenizer).vocab_size
    first_icl = (needle.vocab_size if needle else 0) + (lm_vocab if lm else 0)
    icl = preset.icl_task(first_icl) if preset.icl_every else None
    space = TaskSpace(needle, lm, icl, lm_vocab)
    longest = max(needle.max_seq_len if needle else 0, preset.lm_seq_len if lm else 0,
                  icl.prompt_len + 1 if icl else 0)
    diff = ModelConfig(vocab_size=space.vocab_size, dim=preset.dim, n_layers=preset.n_layers, n_heads=preset.n_heads,
                       attention="diff", max_seq_len=longest)
    return ComparePlan(
        name=preset.name, space=space, arms={a: arm_config(diff, a) for a in preset.arms},
        schedule=Schedule(steps=preset.steps, lr=preset.lr, min_lr=preset.min_lr, warmup_steps=preset.warmup_steps,
                          weight_decay=preset.weight_decay, grad_clip=preset.grad_clip, log_every=preset.log_every),
        mixture=Mixture(batch_size=preset.batch_size, lm_every=preset.lm_every, icl_every=preset.icl_every,
                        lm_seq_len=preset.lm_seq_len),
        probes=Probes(every=preset.probe_every if needle else 0, samples=preset.probe_samples, grid=grid),
        tasks=tasks, execution=Execution(threads=preset.threads, workers=preset.workers, device=preset.device,
                                                stack=preset.stack),
        curve=Curve(curve_steps(preset.steps, preset.curve_points) if lm else (), preset.curve_windows), text=text)
