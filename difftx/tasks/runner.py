"""Running a task on a model: the one code path of ``difftx compare`` and ``difftx eval``."""

from __future__ import annotations

import os
import time
from typing import Any, Optional

from .base import Task
from .subject import Subject, load_subject


def run_task(task: Task, subject: Subject, settings: Any, *, progress: bool = False) -> dict:
    """``task`` on ``subject``: its JSON-ready result with ``wall_s``, or ``{"skipped": reason}``
    when the task does not apply to the model."""
    import torch

    t0 = time.time()
    why = task.applies(subject, settings)
    if why is not None:
        res = {"skipped": why}
    else:
        with torch.no_grad():
            res = task.run(subject, settings, progress=progress)
    res["wall_s"] = time.time() - t0
    return res


def evaluate_checkpoint(name: str, path: str | os.PathLike, *, settings: Optional[Any] = None,
                        tokenizer: Optional[str] = None, data: Any = None, device: str = "cpu",
                        progress: bool = True) -> dict:
    """Run the registered task ``name`` on the checkpoint at ``path`` (a checkpoint folder or a
    run folder) with ``settings`` (default: the task's defaults). A task that does not apply to
    the model is a ``ValueError`` naming the reason. Returns the result with the subject's
    description (checkpoint, attention kind, parameters) and the settings used."""
    from . import get_task, settings_to_dict

    task = get_task(name)
    settings = task.Settings() if settings is None else settings
    subject = load_subject(path, tokenizer=tokenizer, data=data, device=device)
    res = run_task(task, subject, settings, progress=progress)
    if "skipped" in res:
        raise ValueError(f"{subject.folder}: cannot run {name}: {res['skipped']}")
    return {"task": name, **subject.describe(), "settings": settings_to_dict(settings), **res}
