"""The synthetic multi-needle task (:func:`difftx.eval.needle.training_batch`: mixed N/R/depths, loss on the
answer tokens): every step no other task takes. Its block (a :class:`~difftx.eval.needle.NeedleBlock`) has the
first ids of the task space."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...eval.needle import training_batch
from ...io import eval_mode
from .base import PROBE_SEED, TaskSettings, TrainingTask, setting


@dataclass(frozen=True)
class NeedleTrainingSettings(TaskSettings):
    """The needle task's prompts: ``context_len`` tokens, ``n_keys`` key ids, ``n_filler`` filler ids, at most
    ``max_needles`` needles (:class:`difftx.eval.needle.NeedleBlock`)."""

    context_len: int = setting(128, "context_len", least=1)
    n_keys: int = setting(64, "n_keys", least=1)
    n_filler: int = setting(256, "n_filler", least=1)
    max_needles: int = setting(6, "max_needles", least=1)


class NeedleTraining(TrainingTask):
    name, label, rest = "needle", "needle", True
    Settings = NeedleTrainingSettings

    def make_batch(self, draw, batch_size, rng):
        tokens, mask = training_batch(self.block(draw.space), batch_size, rng)
        return tokens, mask, None

    def probe(self, model, space, probes) -> dict:
        """What is probed during training, on fixed prompts at depth 50%: ``accuracy``, greedy needle
        accuracy per grid cell (``{"N/R": acc}``, ``probes.samples`` prompts per cell), and
        ``max_attention_logit``, the largest ``|scaled pre-softmax attention logit|`` of each layer on
        the prompts of the grid's last (hardest) cell. The model is put back in its previous mode;
        touches no random state."""
        from ...eval.capture import max_abs_attention_logits
        from ...eval.needle import evaluate_needles, needle_samples

        with eval_mode(model), torch.no_grad():
            needle = self.block(space)
            res = evaluate_needles(model, needle, grid=probes.grid, depths=(0.5,),
                                   samples_per_cell=probes.samples, seed=PROBE_SEED)
            n, r = probes.grid[-1]
            prompts = torch.tensor([p.prompt for p in needle_samples(needle, n, r, 0.5, probes.samples,
                                                                     seed=PROBE_SEED)])
            logits = max_abs_attention_logits(model, prompts.to(next(model.parameters()).device))
        return {"accuracy": res.accuracy_table(), "max_attention_logit": logits}


TASK = NeedleTraining()
