"""Every registered evaluation task on one trained model, each result stored in its own file
(``evals/NAME.json``, strict JSON) so an interrupted comparison resumes where it stopped.

The tasks load the model through :func:`difftx.tasks.load_subject`, exactly as ``difftx eval``
does, and their prompts and windows depend only on their settings (never on the model), so
DIFF and its baseline are scored on the very same examples."""

from __future__ import annotations

import json
from pathlib import Path

from ..io import atomic_write, dumps_strict, own_folder
from ..tasks import TASKS, load_subject
from ..tasks.runner import run_task
from ..training.distributed import resolve_device

EVALS_DIR = "evals"  # beside a compare model's folder: one NAME.json per task


def evaluate_model(folder: Path, settings: dict, *, device: str = "auto", progress: bool = True,
                   only: tuple | None = None, position: int = 0) -> dict:
    """Run every task of ``settings`` (``{task: Settings}``, as ``ComparePreset.task_settings()``
    resolves them) not yet stored in ``folder/evals/`` on the model in ``folder/model``; returns
    ``{name: result}`` for all of them (stored ones read back). A task that does not apply to the
    model is stored as ``{"skipped": reason}``; each result carries ``wall_s``."""
    from tqdm.auto import tqdm

    out_dir = own_folder(folder / EVALS_DIR)
    subject = None
    results = {}
    names = list(only or settings)
    bar = tqdm(names, desc=f"evaluate {folder.parent.name}/{folder.name}", disable=not progress, leave=False,
               position=position, dynamic_ncols=True)
    for name in bar:
        bar.set_postfix_str(name)
        path = out_dir / f"{name}.json"
        if path.is_file():
            try:
                stored = json.loads(path.read_text())
                if isinstance(stored, dict) and stored:  # else (empty, not an object): evaluate again
                    results[name] = stored
                    continue
            except json.JSONDecodeError:  # a torn file from an older run: evaluate again
                pass
        if subject is None:
            subject = load_subject(folder / "model", device=resolve_device(device))
        res = run_task(TASKS[name], subject, settings[name])
        text = dumps_strict(res)
        atomic_write(path, lambda p, text=text: Path(p).write_text(text + "\n"))
        results[name] = json.loads(text)
    return results
