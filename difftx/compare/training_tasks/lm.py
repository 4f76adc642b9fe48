"""Language modelling: every ``lm_every``-th step, random windows of ``lm_seq_len`` predictions of the bundled
Shakespeare bytes or of your text (``--data``), loss on every token. Its ids follow the needle task's
(``space.lm_offset``, ``space.lm_vocab`` of them)."""

from __future__ import annotations

import random

import numpy as np
import torch

from .base import TrainingTask


def lm_batch(stream: np.ndarray, batch_size: int, seq_len: int, rng: random.Random, offset: int) -> torch.Tensor:
    """``(B, seq_len + 1)`` random windows of ``stream``, ids shifted by ``offset``."""
    starts = [rng.randrange(0, len(stream) - seq_len - 1) for _ in range(batch_size)]
    w = np.stack([stream[s:s + seq_len + 1].astype(np.int64) for s in starts])  # (B, T+1)
    return torch.from_numpy(w) + offset


class LMTraining(TrainingTask):
    name, label = "lm", "LM"

    def every(self, mixture) -> int:
        return mixture.lm_every

    def block(self, space):
        return range(space.lm_offset, space.lm_offset + space.lm_vocab) if space.lm else None

    def make_batch(self, draw, batch_size, rng):
        if draw.lm_train is None:
            raise ValueError("an LM step needs the byte stream (lm_train)")
        return lm_batch(draw.lm_train, batch_size, draw.mixture.lm_seq_len, rng, draw.space.lm_offset), None, None


TASK = LMTraining()
