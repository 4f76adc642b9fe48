"""In-context classification (:func:`difftx.eval.icl.training_batch`: label maps drawn per sequence, loss on
every label token): every ``icl_every``-th step that is not an LM step. Its ids follow the text's
(a :class:`~difftx.eval.icl.ICLBlock`, from its ``first_id``)."""

from __future__ import annotations

from dataclasses import dataclass

from ...eval.icl import training_batch
from .base import TaskSettings, TrainingTask, setting


@dataclass(frozen=True)
class ICLTrainingSettings(TaskSettings):
    """Every ``every``-th step that is not an LM step an ICL batch (0: no ICL training or evaluation): ``classes``
    classes of ``features_per_class`` feature tokens each (1: each class is one feature token, recall of the label
    map), inputs of ``input_len`` tokens, ``demos`` demonstrations per prompt (a multiple of ``classes``)."""

    every: int = setting(0, "icl_every", least=0, mixture=True)
    classes: int = setting(4, "icl_classes", least=1)
    features_per_class: int = setting(1, "icl_features_per_class", least=1)
    input_len: int = setting(1, "icl_input_len", least=1)
    demos: int = setting(8, "icl_demos", least=1)


class ICLTraining(TrainingTask):
    name, label = "icl", "ICL"
    Settings = ICLTrainingSettings

    def make_batch(self, draw, batch_size, rng):
        block = self.block(draw.space)
        assert block is not None
        tokens, mask = training_batch(block, batch_size, rng)
        return tokens, mask, None


TASK = ICLTraining()
