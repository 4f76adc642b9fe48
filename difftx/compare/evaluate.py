"""Every registered evaluation task on one trained model, each result stored in its own file
(``evals/NAME.json``, strict JSON, sealed with the SHA-256 of its content: :func:`difftx.io.seal`)
so an interrupted comparison resumes where it stopped, and a file changed since (by hand, by a
tool) is never read as a result: :func:`read_eval` refuses it, and the comparison redoes it.

The tasks load the model through :func:`difftx.tasks.load_subject`, exactly as ``difftx eval``
does, and their prompts and windows depend only on their settings (never on the model), so
DIFF and its baseline are scored on the very same examples."""

from __future__ import annotations

import json
from pathlib import Path

from ..io import SEAL_KEY, atomic_write, dumps_strict, own_folder, read_json, seal, unsealed
from ..tasks import TASKS, load_subject
from ..tasks.runner import run_task
from ..training.distributed import resolve_device

EVALS_DIR = "evals"  # beside a compare model's folder: one NAME.json per task


def read_eval(path: Path, task: str) -> dict:
    """The stored result of ``task`` at ``path``; a ``ValueError`` naming the file when it is missing,
    not JSON, empty or not an object, changed since it was written (its seal does not match), or
    written without a seal (by a difftx before 2026-11-28: its types were never checked, so it is
    redone like a damaged one; an evaluation gives the same result again)."""
    data = read_json(path, f"the {task} evaluation of a compare model")
    if not isinstance(data, dict) or not data:
        raise ValueError(f"{path}: empty or not a JSON object")
    if SEAL_KEY not in data:
        raise ValueError(f"{path}: written without its {SEAL_KEY} seal (by an older difftx)")
    return unsealed(data, str(path))


def write_eval(path: Path, result: dict) -> dict:
    """Store ``result`` at ``path`` (strict JSON, sealed, atomically); returns it as it reads back."""
    data = json.loads(dumps_strict(result))
    text = json.dumps(seal(data), allow_nan=False)
    atomic_write(path, lambda p: Path(p).write_text(text + "\n"))
    return data


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
                results[name] = read_eval(path, name)
                continue
            except ValueError:  # torn, empty, not an object, changed since written: evaluate again
                pass
        if subject is None:
            subject = load_subject(folder / "model", device=resolve_device(device))
        results[name] = write_eval(path, run_task(TASKS[name], subject, settings[name]))
    return results
