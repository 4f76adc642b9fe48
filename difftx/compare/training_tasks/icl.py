"""In-context classification (:func:`difftx.eval.icl.training_batch`: label maps drawn per sequence, loss on
every label token): every ``icl_every``-th step that is not an LM step. Its ids follow the text's
(``space.icl``, from ``icl.first_id``)."""

from __future__ import annotations

from ...eval.icl import training_batch
from .base import TrainingTask


class ICLTraining(TrainingTask):
    name, label = "icl", "ICL"

    def every(self, mixture) -> int:
        return mixture.icl_every

    def block(self, space):
        return space.icl

    def make_batch(self, draw, batch_size, rng):
        assert draw.space.icl is not None
        tokens, mask = training_batch(draw.space.icl, batch_size, rng)
        return tokens, mask, None


TASK = ICLTraining()
