"""Multi-query associative recall (:meth:`difftx.eval.recall.RecallBlock.training_batch`: a pair count drawn
per batch, loss on the queries): every ``recall_every``-th step that is neither LM nor ICL. Its ids come last
(``space.recall``, from ``recall.first_id``; a comparison from a source: the source's own ids from 0)."""

from __future__ import annotations

import torch

from ...io import eval_mode
from .base import PROBE_SEED, TrainingTask


class RecallTraining(TrainingTask):
    name, label = "recall", "associative recall (MQAR)"
    probe_at_start = True  # its mechanism at initialisation

    def every(self, mixture) -> int:
        return mixture.recall_every

    def block(self, space):
        return space.recall

    def make_batch(self, draw, batch_size, rng):
        assert draw.space.recall is not None
        return draw.space.recall.training_batch(batch_size, rng)

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

        block = space.recall
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
