"""The comparison's multi-task training stream, as a batch source of :func:`difftx.training.train`
(see :mod:`difftx.training.batches`).

Optimizer step ``s`` (from 1) draws one global batch of the training task
``mixture.task_of(s)`` (:class:`~difftx.compare.plan.Mixture`, built from the registry of
:mod:`difftx.compare.training_tasks`): the synthetic multi-needle task (loss on the answer tokens),
every ``lm_every``-th step a language-modelling batch of bundled Shakespeare bytes or of your text
(``--data``; loss on every token), every ``icl_every``-th other step an in-context classification
batch (loss on the label tokens), every ``recall_every``-th step that is neither an
associative-recall batch (loss on the queries), and the steps of any task you register; each task
has its own block of ids in one shared vocabulary (:class:`difftx.tasks.subject.TaskSpace`).

Every batch comes from one ``random.Random`` seeded by the comparison seed alone
(:func:`data_rng`), so DIFF and its baseline see exactly the same batches in the same order (a
paired comparison). The loader's state (that generator's state and the step) goes into the
trainer's checkpoints, so a resumed model continues the same stream. Every rank draws the whole
global batch and keeps its rows ``r*B:(r+1)*B``: W processes see what one process with W*B rows
sees.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from ..training.batches import Batch
from .plan import Mixture
from .training_tasks import Draw

if TYPE_CHECKING:
    from ..tasks.subject import TaskSpace, TextData

STATE_VERSION = 1


def data_rng(seed: int) -> random.Random:
    """The generator of a seed's training batches (a function of the seed only)."""
    return random.Random(f"difftx-compare-data:{seed}")


def lm_streams(progress: bool = False, text: Optional[TextData] = None) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation token streams of the bundled corpus as bytes, or of ``text`` (your
    corpus with its tokenizer; cached by ``prepare_data``)."""
    from ..data import prepare_data

    data = prepare_data(None, "byte", progress=progress) if text is None else text.prepare(progress)
    if data.val is None:
        raise ValueError(f"{'the bundled corpus' if text is None else text.source} has no validation split")
    return np.asarray(data.train.tokens), np.asarray(data.val.tokens)


Drawn = tuple[str, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]


def draw_batch(step: int, mixture: Mixture, space: TaskSpace, rng: random.Random,
               lm_train: Optional[np.ndarray], batch_size: int) -> Drawn:
    """``(kind, tokens (B, T+1), loss_mask (B, T) or None, targets (B, T) or None)``: the global batch
    of step ``step`` (from 1), ``batch_size`` rows, made by the step's training task; depends only on the
    step, the mixture and the state of ``rng``. ``targets`` (recall batches) is the token to predict where
    it is not the next input."""
    task = mixture.task_of(step)
    return (task.name, *task.make_batch(Draw(space, mixture, lm_train), batch_size, rng))


def batch_for_step(step: int, mixture: Mixture, space: TaskSpace, rng: random.Random,
                   lm_train: Optional[np.ndarray]) -> Drawn:
    """:func:`draw_batch` with the mixture's (global) batch size."""
    return draw_batch(step, mixture, space, rng, lm_train, mixture.batch_size)


class CompareStream:
    """The batch source of one compare model: ``train(config, data=CompareStream(...))``.
    ``lm_train``: the byte stream of LM batches (default: :func:`lm_streams`, when the mixture
    has LM batches)."""

    def __init__(self, mixture: Mixture, space: TaskSpace, seed: int, lm_train: Optional[np.ndarray] = None):
        self.mixture, self.space, self.seed = mixture, space, int(seed)
        self.lm_train = lm_streams()[0] if space.block("lm") is not None and lm_train is None else lm_train

    def make_loader(self, config: Any = None, dist: Any = None, *, batch_size: Optional[int] = None,
                    rank: int = 0, world_size: int = 1) -> CompareLoader:
        """This rank's loader: ``config.batch_size`` rows per rank of global batches of
        ``config.batch_size * dist.world_size`` rows (or the given sizes)."""
        if dist is not None:
            rank, world_size = dist.rank, dist.world_size
        b = batch_size if batch_size is not None else (config.batch_size if config is not None else
                                                       self.mixture.batch_size // world_size)
        self.loader = CompareLoader(self, b, rank, world_size)  # its step is the trainer's step (one batch a step)
        return self.loader


class CompareLoader:
    """Batches of :class:`CompareStream`: ``next_batch() -> Batch`` with the kind, the loss mask
    (None for LM batches: every position) and the global batch's loss-position count."""

    def __init__(self, stream: CompareStream, batch_size: int, rank: int = 0, world_size: int = 1):
        if batch_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"CompareLoader: need batch_size >= 1 and 0 <= rank < world_size, got {batch_size}, "
                             f"{rank}, {world_size}")
        self.stream, self.batch_size, self.rank, self.world_size = stream, int(batch_size), int(rank), int(world_size)
        self.global_batch = self.batch_size * self.world_size
        self.rng = data_rng(stream.seed)
        self.step = 0  # batches drawn so far

    def next_batch(self) -> Batch:
        self.step += 1
        s = self.stream
        kind, tokens, mask, targets = draw_batch(self.step, s.mixture, s.space, self.rng, s.lm_train,
                                                 self.global_batch)
        lo, hi = self.rank * self.batch_size, (self.rank + 1) * self.batch_size
        if mask is None:
            return Batch(tokens[lo:hi], kind=kind)
        return Batch(tokens[lo:hi], loss_mask=mask[lo:hi], kind=kind, mask_total=int(mask.sum()),
                     targets=None if targets is None else targets[lo:hi])

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready: the generator's state and the step (the same on every rank)."""
        version, internal, gauss = self.rng.getstate()
        return {"version": STATE_VERSION, "seed": self.stream.seed, "global_batch": self.global_batch,
                "step": self.step, "rng": [version, list(internal), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"compare stream state has version {state.get('version')!r}, expected {STATE_VERSION}")
        for key, mine in (("seed", self.stream.seed), ("global_batch", self.global_batch)):
            if state.get(key) != mine:
                raise ValueError(f"compare stream state has {key}={state.get(key)!r}, this stream {mine!r}")
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.step = int(state["step"])
