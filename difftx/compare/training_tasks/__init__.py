"""The training tasks of ``difftx compare``: one module each, listed once in :data:`TRAINING_TASKS`.

A comparison's training mixture (:class:`difftx.compare.plan.Mixture`) is built from this registry:
each optimizer step draws a batch of the first task, in registry order, whose ``every`` divides the
step, else of the ``rest`` task (the needle task). Adding a training task is one module defining a
:class:`~difftx.compare.training_tasks.base.TrainingTask` instance ``TASK``, plus its name in
:data:`BUILTIN` (or a call to :func:`register_training_task`); docs/training-tasks.md walks through one.
"""

from __future__ import annotations

import importlib

from .base import Draw, Made, TaskSettings, TrainingTask, setting

# built-in task modules, in registry order (the order of the task space's ids and of the mixture's shares)
BUILTIN = ("needle", "lm", "icl", "recall")

TRAINING_TASKS: dict[str, TrainingTask] = {}


def register_training_task(task: TrainingTask, *, replace: bool = False) -> TrainingTask:
    """Add ``task`` to :data:`TRAINING_TASKS` (after the others). Its name must be new unless ``replace``;
    a built-in task cannot be replaced."""
    if not isinstance(task, TrainingTask):
        raise TypeError(f"register_training_task expects a TrainingTask, got {type(task).__name__}")
    if not isinstance(task.name, str) or not task.name.isidentifier():
        raise ValueError(f"a training task's name must be an identifier (it names the loss {{name}}_loss), "
                         f"got {task.name!r}")
    if task.name in TRAINING_TASKS and (not replace or task.name in BUILTIN):
        raise ValueError(f"a training task named {task.name!r} is already registered")
    if task.rest and any(t.rest for n, t in TRAINING_TASKS.items() if n != task.name):
        raise ValueError(f"training task {task.name!r}: only one task takes the rest of the steps")
    if task.Settings is not None:
        if not (isinstance(task.Settings, type) and issubclass(task.Settings, TaskSettings)):
            raise TypeError(f"training task {task.name!r}: Settings must be a TaskSettings dataclass")
        taken = {s for n, t in TRAINING_TASKS.items() if n != task.name and t.Settings is not None
                 for s in t.Settings.spelling()}
        clash = sorted(taken & set(task.Settings.spelling()))
        if clash:
            raise ValueError(f"training task {task.name!r}: setting(s) {clash} are spelled as another task's")
    TRAINING_TASKS[task.name] = task
    return task


def unregister_training_task(name: str) -> None:
    """Remove a registered task (not a built-in one)."""
    if name in BUILTIN:
        raise ValueError(f"{name!r} is a built-in training task")
    TRAINING_TASKS.pop(name, None)


for _name in BUILTIN:
    register_training_task(importlib.import_module(f".{_name}", __name__).TASK)

__all__ = ["BUILTIN", "TRAINING_TASKS", "Draw", "Made", "TaskSettings", "TrainingTask", "register_training_task",
           "setting", "unregister_training_task"]
