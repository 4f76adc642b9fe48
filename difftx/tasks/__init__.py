"""The evaluation tasks: one module each, listed once in :data:`TASKS`.

``difftx compare`` runs every registered task on every model, ``difftx eval NAME`` runs one
(its flags generated from the task's settings), and the report puts each task's section and
plots in registry order. Adding an evaluation is one new module defining a
:class:`~difftx.tasks.base.Task` instance ``TASK``, plus its name in :data:`BUILTIN` (or a call
to :func:`register`).
"""

from __future__ import annotations

import importlib

from .base import Metric, Task, settings_from_dict, settings_to_dict
from .common import EVAL_SEED
from .subject import Subject, load_subject

# built-in task modules, in report order
BUILTIN = ("needle", "training", "lm", "attention", "outliers", "quant", "icl", "diagnostics", "recall")

TASKS: dict[str, Task] = {}


def register(task: Task, *, replace: bool = False) -> Task:
    """Add ``task`` to :data:`TASKS` (after the others). Its name must be new unless ``replace``."""
    if not isinstance(task, Task):
        raise TypeError(f"register expects a difftx.tasks.Task, got {type(task).__name__}")
    if task.name in TASKS and not replace:
        raise ValueError(f"a task named {task.name!r} is already registered")
    TASKS[task.name] = task
    return task


def unregister(name: str) -> None:
    TASKS.pop(name, None)


def get_task(name: str) -> Task:
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; choose one of {list(TASKS)}")
    return TASKS[name]


for _name in BUILTIN:
    register(importlib.import_module(f".{_name}", __name__).TASK)

__all__ = ["BUILTIN", "EVAL_SEED", "Metric", "Subject", "TASKS", "Task", "get_task", "load_subject", "register",
           "settings_from_dict", "settings_to_dict", "unregister"]
