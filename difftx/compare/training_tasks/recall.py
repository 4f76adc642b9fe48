"""Multi-query associative recall (:meth:`difftx.eval.recall.RecallBlock.training_batch`: a pair count drawn
per batch, loss on the queries): every ``recall_every``-th step that is neither LM nor ICL. Its ids come last
(a :class:`~difftx.eval.recall.RecallBlock`, from its ``first_id``; a comparison from a source: the source's own ids
from 0)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...io import eval_mode
from .base import PROBE_SEED, TaskSettings, TrainingTask, setting


@dataclass(frozen=True)
class RecallTrainingSettings(TaskSettings):
    """Every ``every``-th step that is neither LM nor ICL a recall batch (0: no recall training or grid):
    ``vocab`` tokens (keys from the lower half, values from the upper half), ``seq_len`` positions (the training
    length; the evaluation grid also goes beyond it), a pair count of ``pairs`` drawn per batch."""

    every: int = setting(0, "recall_every", least=0, mixture=True)
    vocab: int = setting(256, "recall_vocab", least=1)
    seq_len: int = setting(64, "recall_len", least=1)
    pairs: tuple = setting((4, 8, 16), "recall_pairs")

    def __post_init__(self) -> None:
        super().__post_init__()
        pairs = self.pairs
        if isinstance(pairs, int) and not isinstance(pairs, bool):
            pairs = (pairs,)
        elif isinstance(pairs, str):  # --set recall_pairs=4,8,16
            try:
                pairs = tuple(int(x) for x in pairs.split(","))
            except ValueError:
                raise self.error("pairs", f"must be positive pair counts, got {pairs!r}") from None
        if not isinstance(pairs, (tuple, list)) or not pairs or \
                not all(isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in pairs):
            raise self.error("pairs", f"must be positive pair counts, got {self.pairs!r}")
        object.__setattr__(self, "pairs", tuple(pairs))


class RecallTraining(TrainingTask):
    name, label = "recall", "associative recall (MQAR)"
    probe_at_start = True  # its mechanism at initialisation
    Settings = RecallTrainingSettings

    def make_batch(self, draw, batch_size, rng):
        block = self.block(draw.space)
        assert block is not None
        return block.training_batch(batch_size, rng)

    def probe(self, model, space, probes) -> dict:
        """Recall during training, on ``probes.samples`` fixed examples of plain MQAR at the training length
        with the most training pairs: ``recall`` (``{cell: accuracy}``, greedy accuracy at every query),
        ``attention_output_ratio`` (per layer, the RMS of the attention output against the residual stream it
        is added to, mean over the queries: :func:`difftx.eval.residual.attention_residual_ratio`) and, for a
        model with a learned λ, ``lambda`` per layer (as the training history logs it). The model is put back
        in its previous mode; touches no random state."""
        from ...eval.recall import IGNORE, generate, score
        from ...eval.residual import attention_residual_ratio
        from ...tasks.recall import cell_name
        from ...training.metrics import lambda_per_layer

        block = self.block(space)
        spec = block.spec(max(block.pairs))
        examples = block.shifted(generate(spec, probes.samples, seed=PROBE_SEED))
        device = next(model.parameters()).device
        with eval_mode(model), torch.no_grad():
            res = score(model, examples, batch_size=64, device=device)
            ratio = attention_residual_ratio(model, examples.inputs, examples.labels != IGNORE, device=device)
            lambdas = lambda_per_layer(model)  # a collective under FSDP2, as the probe is
        out = {"recall": {cell_name((spec.variant, spec.seq_len, spec.n_pairs)): res["accuracy"]},
               "attention_output_ratio": ratio["ratio"]}
        if lambdas:
            out["lambda"] = lambdas
        return out


TASK = RecallTraining()
