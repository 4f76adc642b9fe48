"""What :func:`difftx.training.train` accepts as data besides prepared text: a *batch source*.

A batch source is any object with a method ``make_loader(config, dist) -> loader`` (``config``:
the run's :class:`~difftx.training.TrainConfig`; ``dist``: its
:class:`~difftx.training.distributed.DistInfo`, rank and world size). The loader provides

``next_batch()``
    this rank's share of the next global batch: a :class:`Batch`, or a ``(tokens, doc_ids)``
    pair as :class:`~difftx.data.PackedLoader` returns.
``state_dict()`` / ``load_state_dict(state)``
    its position, JSON-serialisable (it is stored in ``trainer_state.json``), restoring the exact
    stream on resume.

Rank ``r`` must take rows ``r*B:(r+1)*B`` of the global batch of ``W*B`` rows (``B`` =
``config.batch_size``, ``W`` = world size), so that ``W`` processes follow the same data as one
process with ``W*B`` rows. An optional attribute ``tokenizer`` is saved with the checkpoints
(a source without one trains a model on its own vocabulary; then give ``train(...,
model_config=...)``). Text data keeps its own path: ``train(config, data=prepare_data(...))``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..model import loss_rows


@dataclass
class Batch:
    """One rank's batch.

    ``tokens`` ``(B, T+1)`` int64: inputs ``tokens[:, :-1]``, next-token targets ``tokens[:, 1:]``.
    ``doc_ids`` ``(B, T+1)`` or None: packed documents (used when ``TrainConfig.doc_mask``).
    ``loss_mask`` ``(B, T)`` bool or None: the loss is taken at the True positions only (aligned
    with the targets), and the LM head runs there alone (:func:`batch_loss_rows`); None: every
    position.
    ``kind``: a name for the batch's task (``"needle"``, ``"lm"``...); the trainer logs the mean
    loss of each kind over each log interval as ``{kind}_loss``. Every rank's batch of one step
    must have the same kind.
    ``mask_total``: the number of True ``loss_mask`` positions in the whole global batch (every
    rank's rows). The masked loss is then ``sum / mask_total`` over the global batch, as one
    process with ``W*B`` rows would compute it, even when the ranks hold different numbers of
    loss positions; None: this rank's own mean.
    ``targets`` ``(B, T)`` int64 or None: the token to predict at each input position, when it is not
    the next input token (associative recall: the value of a queried key, where the next input is
    noise); None: ``tokens[:, 1:]``.
    """

    tokens: torch.Tensor
    doc_ids: Optional[torch.Tensor] = None
    loss_mask: Optional[torch.Tensor] = None
    kind: Optional[str] = None
    mask_total: Optional[int] = None
    targets: Optional[torch.Tensor] = None

    def target_tokens(self) -> torch.Tensor:
        """``(B, T)``: :attr:`targets`, else the next input tokens."""
        return self.tokens[:, 1:] if self.targets is None else self.targets


def as_batch(item: Any) -> Batch:
    """A loader's ``next_batch()`` result as a :class:`Batch`."""
    if isinstance(item, Batch):
        return item
    tokens, doc_ids = item
    return Batch(tokens, doc_ids)


def batch_loss_rows(batch: Batch, device=None, world_size: int = 1) -> dict:
    """The loss arguments of :meth:`difftx.model.Transformer.forward` for ``batch``: none (the mean over
    every position), or ``loss_rows`` / ``loss_weights`` of its loss mask (:func:`difftx.model.loss_rows`)."""
    if batch.loss_mask is None:
        return {}
    rows, weights = loss_rows(batch.loss_mask.to(device), batch.mask_total, world_size)
    return {"loss_rows": rows, "loss_weights": weights}


def is_batch_source(data: Any) -> bool:
    return callable(getattr(data, "make_loader", None))
