"""Checks shared by the subcommands: argparse ``type=`` callables that refuse a bad value while
the command line is parsed (before any model is loaded or any work starts), and the device
check. A refusal names the flag (argparse adds it) and the fix; the exit code is 2.

Light on purpose: importing this module must not import torch.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

from ..tasks.subject import TASK_FILE, TRAIN_RECORD


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def seed_int(text: str) -> int:
    """A random seed: an integer torch.manual_seed takes (-2**63 to 2**64 - 1)."""
    value = _int(text)
    if not -2 ** 63 <= value < 2 ** 64:
        raise argparse.ArgumentTypeError(f"must be an integer from -2**63 to 2**64 - 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0 (``nan`` and ``inf`` are refused)."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def probability(text: str) -> float:
    """A number in (0, 1]."""
    value = _float(text)
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _writable_parent(path: Path, text: str) -> None:
    """The nearest existing ancestor of ``path`` must be a folder this process can write into
    (missing folders in between are created when the output is written)."""
    parent = path.absolute().parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {parent} is a file, not a folder; choose another path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: cannot write into {parent} (permission denied); "
                                         f"choose a writable location")


def output_file(text: str) -> str:
    """A file path to write: not an existing folder, inside a writable folder. Checked at parse
    time, so a bad path is refused before the work whose result it would hold."""
    path = Path(text)
    if not text or path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; give a file path (for example "
                                         f"{os.path.join(text or '.', 'result.json')})")
    _writable_parent(path, text)
    return text


# files difftx keeps in its folders: a run, a checkpoint, a tokenizer, a comparison
OWN_FILES = ("train_config.json", "metrics.jsonl", "model.safetensors", "config.json", "optimizer.pt",
             "trainer_state.json", "tokenizer.json", "results.json", "compare.json", TRAIN_RECORD, "report.md",
             TASK_FILE, "scale.json", "scale.md", "map.json", "map.md")


def owner_of(path: Path) -> str | None:
    """What an existing file at ``path`` belongs to (a training run, a checkpoint, a tokenizer, a
    comparison), so that writing over it would damage that folder; ``None`` for any other file."""
    if not path.is_file():
        return None
    folder = path.absolute().parent
    for marker, what in (("train_config.json", "the training run"), ("checkpoints", "the training run"),
                         ("model.safetensors", "the checkpoint"), ("compare.json", "the comparison"),
                         (TRAIN_RECORD, "the compare model"), ("tokenizer.json", "the tokenizer"),
                         ("scale.json", "the scale study"), ("map.json", "the regime map")):
        if (folder / marker).exists():
            return f"{what} in {folder}"
    return f"a difftx folder ({path.name} is one of its files)" if path.name in OWN_FILES else None


def check_not_owned(path, flag: str, overwrite: bool = False) -> None:
    """Refuse (ValueError naming ``flag``) to write over a file of a run, checkpoint, tokenizer or
    comparison unless ``overwrite``; a new file, or any other existing file, is fine."""
    owner = None if path is None or overwrite else owner_of(Path(path))
    if owner:
        raise ValueError(f"{flag} {path}: that file belongs to {owner}, and writing over it would damage it; "
                         "choose another path, or pass --overwrite to replace it")


def _resolved(path) -> Path:
    """``path`` with every link followed (for the test alone; nothing is written through it here)."""
    return Path(path).expanduser().resolve()


def _inside(a: Path, b: Path) -> bool:
    """Whether ``a`` is ``b`` or lies inside it."""
    return a == b or b in a.parents


def managed_folder(path) -> str | None:
    """The folder difftx manages and prunes that ``path`` would lie inside, said in words, or None: a training
    run's ``checkpoints/`` (pruned on resume) or a comparison's ``seedS/ARM/`` folder (rewritten when its model is
    trained again)."""
    p = _resolved(path)
    for up in (p, *p.parents):
        if up.name == "checkpoints" and ((up.parent / "train_config.json").is_file() or (up / "latest").exists()):
            return f"{up}, the checkpoints folder of a training run (`difftx train --resume` prunes it)"
        if up.name.startswith("seed") and up.name[4:].isdigit() and (up.parent / "compare.json").is_file():
            return f"{up}, a seed folder of the comparison in {up.parent} (compare rewrites it)"
    return None


def kinds_files() -> list[str]:
    """The Python files ``--kinds`` / ``DIFFTX_KINDS`` names: inputs of every command. A module named by its import
    name counts by the file it was imported from."""
    from ..attention.registry import KINDS_ENV  # lazy: torch; --help stays fast

    items = [part.strip() for part in os.environ.get(KINDS_ENV, "").split(",")]
    files = []
    for item in filter(None, items):
        if item.endswith(".py") or os.sep in item:
            files.append(item)
        elif getattr(sys.modules.get(item), "__file__", None):  # imported by load_kinds before any output is checked
            files.append(sys.modules[item].__file__)
    return files


def check_not_input(out, flag: str, inputs: dict, folder: bool = False) -> None:
    """Refuse (one-line ValueError naming ``flag``) an output ``out`` that is or contains anything the same command
    reads (``inputs``: ``{its flag or name: path, a list of paths, or None}``: a file, or a folder such as a model
    or a tokenizer; the kinds files of ``--kinds`` are added), or that lies inside a folder difftx manages and
    prunes (:func:`managed_folder`). A new file or folder inside an input folder is fine (``eval lm RUN --json
    RUN/lm.json``); the files difftx keeps there are guarded by :func:`check_not_owned`. Paths are compared with
    links followed. ``None`` (not given) passes. A link to nothing is refused; ``folder``: the output is a folder
    written as a whole, which is never a symbolic link (one to a folder is refused too) nor the current folder or
    one that holds it (it is renamed into place)."""
    if out is None:
        return
    if Path(out).is_symlink() and (folder or not Path(out).exists()):
        target = os.readlink(out)
        if not Path(out).exists():
            raise ValueError(f"{flag} {out}: is a symbolic link to {target}, which does not exist; difftx does not "
                             f"write through a link to nothing: give the output's own path")
        raise ValueError(f"{flag} {out}: is a symbolic link to {target} (a folder elsewhere); difftx does not write "
                         f"a model folder through a link: give the folder's own path")
    o = _resolved(out)
    if folder and _inside(Path.cwd().resolve(), o):
        how = "is the current folder" if o == Path.cwd().resolve() else "holds the current folder"
        raise ValueError(f"{flag} {out}: {how}; difftx writes a model folder whole beside it and renames it into "
                         f"place, which cannot be done to a folder in use: give a new folder's name (e.g. "
                         f"{Path(out) / 'model'})")
    named = [(name, p) for name, paths in {**inputs, "the kinds file": kinds_files()}.items()
             for p in (paths if isinstance(paths, (list, tuple)) else [paths])]
    for name, path in named:
        if path is None or str(path) in ("", "byte"):
            continue
        i = _resolved(path)
        if _inside(i, o):
            how = "is" if o == i else "contains"
            raise ValueError(f"{flag} {out}: {how} {name} {path}, which this command reads; writing there would "
                             f"replace or damage it: choose another path")
    managed = managed_folder(out)
    if managed:
        raise ValueError(f"{flag} {out}: lies inside {managed}; what is written there can be deleted: choose "
                         f"another path")


def check_output_file(path, flag: str) -> None:
    """:func:`output_file` for a value already parsed (``None``: not given): a ValueError naming
    ``flag`` when ``path`` cannot be written."""
    if path is not None:
        try:
            output_file(str(path))
        except argparse.ArgumentTypeError as e:
            raise ValueError(f"{flag}: {e}") from None


def plot_file(path):
    """The file a ``--plot`` value names (``None``: not given): without a suffix, with ``.png`` added (what matplotlib
    writes for such a name), so that the checks and the message name the file written."""
    return None if path is None else str(path) if Path(path).suffix else f"{path}.png"


def check_plot_format(path, flag: str) -> None:
    """Before any work, after the checks that a plot may not land on an input or a run's file: a suffix that is not
    an image format matplotlib writes is a ValueError naming ``flag`` (matplotlib refused ``.txt`` only after the
    work, or wrote PNG bytes into it)."""
    if path is None:
        return
    from matplotlib.figure import Figure  # lazy; a missing matplotlib is said here, before the work

    formats = Figure().canvas.get_supported_filetypes()
    if Path(path).suffix[1:].lower() not in formats:
        raise ValueError(f"{flag} {path}: not an image format matplotlib writes; use one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")


def output_dir(text: str) -> str:
    """A folder path to write into: not an existing file, inside a writable folder."""
    path = Path(text)
    if not text:
        raise argparse.ArgumentTypeError("an empty path; give a folder")
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} exists and is not a folder; choose a folder path")
    if not path.exists():
        _writable_parent(path, text)
    return text


def check_device(device: str, flag: str = "--device") -> str:
    """``device`` if this machine has it (``auto`` resolves to ``cuda`` when available, else
    ``cpu``); a ValueError naming ``flag`` otherwise."""
    import torch  # lazy: torch; --help stays fast

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{flag} {device}: not a device torch knows (cpu, cuda, cuda:N, mps, ...)") from None
    if str(device).startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"{flag} {device}: no CUDA device is available here (torch.cuda.is_available() is False); "
                         f"use {flag} cpu (or auto)")
    return device
