"""Language modelling: every ``lm_every``-th step, random windows of ``lm_seq_len`` predictions of the bundled
Shakespeare bytes or of your text (``--data``), loss on every token. Its ids follow the needle task's
(a :class:`~difftx.tasks.subject.TextBlock`: ``size`` ids from ``first_id``)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from .base import TaskSettings, TrainingTask, setting


def lm_batch(stream: np.ndarray, batch_size: int, seq_len: int, rng: random.Random, offset: int) -> torch.Tensor:
    """``(B, seq_len + 1)`` random windows of ``stream``, ids shifted by ``offset``."""
    starts = [rng.randrange(0, len(stream) - seq_len - 1) for _ in range(batch_size)]
    w = np.stack([stream[s:s + seq_len + 1].astype(np.int64) for s in starts])  # (B, T+1)
    return torch.from_numpy(w) + offset


@dataclass(frozen=True)
class LMTrainingSettings(TaskSettings):
    """Every ``every``-th step an LM batch (0: none) of windows of ``seq_len`` predictions."""

    every: int = setting(4, "lm_every", least=0, mixture=True)
    seq_len: int = setting(128, "lm_seq_len", least=1, mixture=True)


class LMTraining(TrainingTask):
    name, label = "lm", "LM"
    Settings = LMTrainingSettings

    def make_batch(self, draw, batch_size, rng):
        if draw.lm_train is None:
            raise ValueError("an LM step needs the byte stream (lm_train)")
        seq_len = draw.mixture.settings[self.name].seq_len
        return lm_batch(draw.lm_train, batch_size, seq_len, rng, self.block(draw.space).first_id), None, None


TASK = LMTraining()
