"""The contract of a training task: one kind of batch of ``difftx compare``'s training mixture.

A training task (:class:`TrainingTask`) says four things (and may own its settings, :class:`TaskSettings`):

- its share of the steps (:meth:`~TrainingTask.every`): every k-th optimizer step that no task before it
  takes, or (``rest``) every step no other task takes;
- its block of token ids in the models' shared vocabulary (:meth:`~TrainingTask.ids` and
  :meth:`~TrainingTask.block`);
- how it makes a batch (:meth:`~TrainingTask.make_batch`), drawn from the comparison's one generator;
- what it probes during training (:meth:`~TrainingTask.probe`), if anything.

Each task's block is kept in :class:`~difftx.tasks.subject.TaskSpace` under its name: the built-in tasks' typed
blocks (needle, text, ICL and recall ids, in that order, each written as its evaluation module registers), and a
registered task's ``range`` of the next ``ids(preset)`` ids after them.
"""

from __future__ import annotations

import dataclasses
import random
from typing import TYPE_CHECKING, Any, ClassVar, Optional

if TYPE_CHECKING:
    import numpy as np
    import torch

    from ...tasks.subject import TaskSpace

PROBE_SEED = 4321  # the fixed examples probed during training (not the evaluation's)

# what make_batch returns: tokens (B, T+1), loss_mask (B, T) or None (every position), targets (B, T) or None
# (the next input tokens)
Made = tuple["torch.Tensor", Optional["torch.Tensor"], Optional["torch.Tensor"]]


def setting(default: Any, preset: str, *, least: Optional[int] = None, mixture: bool = False) -> Any:
    """A field of a training task's :class:`TaskSettings`: its ``default``, its ``preset`` spelling (the
    :class:`~difftx.compare.presets.ComparePreset` field and ``--set`` name it is given as), ``least``, the
    smallest whole number it may be (None: no such rule), and ``mixture``: recorded with the mixture in
    ``results.json``."""
    return dataclasses.field(default=default, metadata={"preset": preset, "least": least, "mixture": mixture})


class TaskSettings:
    """Base of a training task's settings dataclass (``TrainingTask.Settings``): each field made by
    :func:`setting`. Construction checks each field on its own (an error names its preset spelling);
    :func:`difftx.compare.plan.resolve` checks what ties them to the rest of the preset."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            least, v = f.metadata.get("least"), getattr(self, f.name)
            if least is not None and (not isinstance(v, int) or isinstance(v, bool) or v < least):
                raise self.error(f.name, f"must be a {'positive' if least else 'non-negative'} integer, got {v!r}")

    @classmethod
    def spelling(cls) -> dict:
        """``{preset spelling: field}`` of every field."""
        return {f.metadata["preset"]: f.name for f in dataclasses.fields(cls)}

    def error(self, name: str, rule: str) -> ValueError:
        """The error of field ``name`` (named by its preset spelling) that breaks ``rule``."""
        spelled = {f.name: f.metadata["preset"] for f in dataclasses.fields(self)}
        return ValueError(f"ComparePreset.{spelled.get(name, name)}: {rule}")

    def mixture_record(self) -> dict:
        """The fields recorded with the mixture (``results.json``), by their preset spelling."""
        return {f.metadata["preset"]: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["mixture"]}


class Draw:
    """What a task's :meth:`TrainingTask.make_batch` may read besides the generator: the task space
    (``space``), the mixture (``mixture``: the batch size and each task's settings) and the text stream of LM batches
    (``lm_train``, a 1-D array of ids, or None)."""

    def __init__(self, space: "TaskSpace", mixture: Any, lm_train: Optional["np.ndarray"] = None):
        self.space, self.mixture, self.lm_train = space, mixture, lm_train


class TrainingTask:
    """One kind of batch of the training mixture (see the module doc). Subclass it, set ``name`` (the batch
    kind: the trainer logs its mean loss as ``{name}_loss``) and ``label`` (the report's words for it), and
    register an instance (:func:`difftx.compare.training_tasks.register_training_task`)."""

    name: ClassVar[str] = ""
    label: ClassVar[str] = ""
    # True for the one task that takes every step no other task takes (the needle task)
    rest: ClassVar[bool] = False
    # True: the probe also reads the initial model (step 0)
    probe_at_start: ClassVar[bool] = False
    # its settings dataclass (a TaskSettings; None: the task keeps its settings on its instance)
    Settings: ClassVar[Optional[type]] = None

    def every(self, mixture: Any) -> int:
        """Its share of the steps: every ``every``-th optimizer step (from 1) that no task before it in the
        registry takes (0: never). ``mixture`` (:class:`~difftx.compare.plan.Mixture`) holds each task's settings
        (``mixture.settings[name]``); by default, the ``every`` of this task's settings, else 0."""
        return getattr(mixture.settings.get(self.name), "every", 0)

    def ids(self, preset: Any) -> int:
        """How many token ids its batches use (a registered task's block: the next ids after the built-in
        tasks'). The built-in tasks' blocks are made by :func:`difftx.compare.plan.resolve`."""
        return 0

    def seq_len(self, preset: Any) -> int:
        """Its longest training sequence (predictions): the models' ``max_seq_len`` covers it."""
        return 0

    def block(self, space: "TaskSpace") -> Any:
        """Its block of ids in ``space`` (None: the comparison has no batches of it): a registered task's
        ``range`` of ids."""
        return space.block(self.name)

    def make_batch(self, draw: Draw, batch_size: int, rng: random.Random) -> Made:
        """``(tokens (B, T+1), loss_mask (B, T) or None, targets (B, T) or None)``: one global batch of
        ``batch_size`` rows, every random choice drawn from ``rng`` (a ``random.Random``: its state is
        checkpointed, so a resumed run continues the same stream). ``loss_mask`` None: the loss at every
        position; ``targets`` None: the next input tokens."""
        raise NotImplementedError(f"training task {self.name!r} has no make_batch")

    def probe(self, model: "torch.nn.Module", space: "TaskSpace", probes: Any) -> dict:
        """What to record during training, every ``probes.every`` steps (``probes``:
        :class:`~difftx.compare.plan.Probes`): a JSON-ready dict merged into the probe record ({}: nothing).
        Leave the model as it was (eval mode, no gradients) and touch no random state."""
        return {}

    def has_probe(self) -> bool:
        return type(self).probe is not TrainingTask.probe
