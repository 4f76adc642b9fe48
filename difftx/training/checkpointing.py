"""Training checkpoints: one folder per step, made visible atomically, keep-last-N, a ``latest`` pointer.

Layout of a run folder::

    OUT/
      train_config.json          the run's TrainConfig
      metrics.jsonl              one JSON record per log step / validation pass
      checkpoints/
        latest                   the name of the newest complete checkpoint (written atomically)
        step_00000200/
          config.json            ModelConfig              } difftx.checkpoint.save_model: the folder
          model.safetensors      weights                  } loads with difftx.checkpoint.load_model
          tokenizer/             the tokenizer the run used
          optimizer.pt           AdamW state (full, keyed by parameter name)
          trainer_state.json     step, tokens seen, data-loader and RNG state of every rank,
                                 optimizer.pt's SHA-256 (model.safetensors holds its own)
          train_config.json      the TrainConfig of the run that wrote it

While a run writes to ``OUT`` it holds ``OUT/.lock`` (:func:`lock_run`): a second run on the
same folder is refused; a lock left by a process that has died is taken over.

Every file is written to a temporary name and renamed; the whole folder is first assembled
in a staging folder ``checkpoints/.step_....tmp-...`` (:func:`difftx.io.atomic_folder`) and
renamed into place, then ``latest`` is rewritten. A crash at any point leaves the previous
checkpoint and pointer untouched; staging folders are ignored, and stale ones
(:func:`difftx.io.staging_is_stale`) are removed by the next run. An existing checkpoint folder is
never overwritten. Every load checks the weights' and the optimizer state's SHA-256 against the
one recorded when they were written (:func:`difftx.checkpoint.verify_digest`).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import socket
import zipfile
from pathlib import Path
from typing import Any, Optional, Union

import numpy as np
import torch

from ..attention.registry import code_change
from ..checkpoint import (  # noqa: F401  (the run-folder lookups live with the checkpoint format, named here too)
    _STEP_RE, CHECKPOINTS, CONFIG_NAME, LATEST, WEIGHTS_NAME, CheckpointError, check_weights_fit, checkpoints_dir,
    file_sha256, latest_checkpoint, list_checkpoints, load_config, load_state, resolve_checkpoint, save_model,
    step_dir_name, verify_digest,
)
from ..config import ModelConfig
from ..io import (
    atomic_folder, atomic_write, check_record, open_lock_file, own_folder, pid_alive, read_json, read_record,
    remove_stale_staging, write_error, write_json,
)
from ..model import Transformer
from .config import (
    PATH_FIELDS, SAVED_PATHS, differs_from_record, path_identity, resolve_saved_paths, same_content, saved_form,
)

PathLike = Union[str, os.PathLike]
FORMAT = "difftx-train"
FORMAT_VERSION = 1
STATE_NAME = "trainer_state.json"
OPTIM_NAME = "optimizer.pt"
DIGESTS = "digests"  # trainer_state.json: {file name: SHA-256} of the checkpoint's files that cannot hold their own
TRAIN_CONFIG_NAME = "train_config.json"
TOKENIZER_DIR = "tokenizer"
LOCK_NAME = ".lock"

# fields of TrainConfig that must match for an exact resume (others, e.g. steps or lr, may change);
# batch_size may change with the number of processes as long as the global batch stays the same. The optimizer's
# settings too: its saved state puts back its own (a changed one was recorded as applied, and ignored)
RESUME_MUST_MATCH = ("seq_len", "grad_accum", "data_source", "text_field", "doc_mask", "seed",
                     "beta1", "beta2", "eps", "weight_decay")


# -- a damaged checkpoint and the intact ones beside it ----------------------------------------------
def checkpoint_problem(folder: PathLike) -> Optional[str]:
    """Why ``folder`` is not a complete training checkpoint, from a look that parses no tensor
    (``None`` when it looks complete): each file is there, the JSON files parse, the tokenizer saved with it
    reads, the weights file is as long as its header says, ``optimizer.pt`` is a whole zip archive, and both have
    the SHA-256 recorded when they were written (where one was)."""
    from ..data.tokenizer import load_tokenizer

    folder = Path(folder)
    try:
        load_config(folder)
        read_trainer_state(folder)
        if (folder / TRAIN_CONFIG_NAME).exists():
            read_train_config(folder / TRAIN_CONFIG_NAME)
    except CheckpointError as e:
        return str(e)
    if (folder / TOKENIZER_DIR).is_dir():
        try:
            load_tokenizer(folder / TOKENIZER_DIR)
        except (OSError, ValueError) as e:  # an emptied difftx_tokenizer.json had no hint to the older checkpoint
            return f"{folder / TOKENIZER_DIR}: cannot be read ({e})"
    weights = folder / WEIGHTS_NAME
    try:
        with open(weights, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n)) if 0 < n < 100_000_000 else None
        ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"] if isinstance(
            header, dict) else None
        if not ends or weights.stat().st_size != 8 + n + max(ends):
            return f"{weights}: incomplete or not a safetensors file"
    except (OSError, ValueError, KeyError, TypeError, IndexError) as e:
        return f"{weights}: cannot be read ({e})"
    optim = folder / OPTIM_NAME
    try:
        with open(optim, "rb") as f:
            is_zip = f.read(4) == b"PK\x03\x04"
        if is_zip:
            zipfile.ZipFile(optim).close()  # reads the central directory at the end: a cut file has none
    except (OSError, zipfile.BadZipFile) as e:
        return f"{optim}: incomplete ({e})"
    try:
        verify_digest(weights, notice=False)  # a look for the error's hint: nothing said about older files
        verify_digest(optim, recorded_digest(folder, OPTIM_NAME), notice=False)
    except CheckpointError as e:
        return str(e)
    return None


def recovery_hint(message: str) -> Optional[str]:
    """For an error ``message`` naming a file of a run's checkpoint (``RUN/checkpoints/step_N/...``)
    or its ``latest`` pointer, when that checkpoint (or pointer) is damaged: a sentence naming the
    newest older checkpoint that is intact and how to resume from it (nothing is deleted); else
    ``None``."""
    found = re.search(r"(\S*?)[/\\]?" + CHECKPOINTS + r"[/\\](" + _STEP_RE.pattern[1:-1] + "|" + LATEST + ")",
                      message)
    if found is None:
        return None
    run = Path(found.group(1) or ".")
    root = checkpoints_dir(run)
    if not root.is_dir():
        return None
    named = found.group(2)
    pointer = root / LATEST
    if named == LATEST:
        damaged = None
        older = list_checkpoints(run)
    else:
        damaged = root / named
        if not damaged.is_dir() or checkpoint_problem(damaged) is None:
            return None  # an intact checkpoint refused for another reason (another model, another data)
        older = [p for p in list_checkpoints(run) if p.name < named]
    intact = next((p for p in reversed(older) if checkpoint_problem(p) is None), None)
    if intact is None:
        return f"no older checkpoint of {run} is intact" if damaged is not None else None
    which = "the older checkpoint" if damaged is not None else "the newest intact checkpoint is"
    move = f"move {damaged} out of {root} (e.g. to {run / ('damaged-' + named)}) and " if damaged is not None else ""
    return (f"{which} {intact}{' is intact' if damaged is not None else ''}: to resume from it, {move}write "
            f"{intact.name} into {pointer}, then --resume; to evaluate, generate from or export it, give that folder")


# -- the run-folder lock -------------------------------------------------------------------------
try:
    import fcntl
except ImportError:  # pragma: no cover - Windows: a pid file checked for a live process instead
    fcntl = None

_locks: dict[str, tuple[int, Path, bool]] = {}  # resolved run folder -> (fd, lock file, folder created by us)


def _holder(path: Path) -> str:
    try:
        text = path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        text = ""
    return text or "a process that has not written its pid yet"


def lock_run(run_dir: PathLike) -> None:
    """Mark ``run_dir`` (created if needed) as written to by this process until
    :func:`unlock_run`: :class:`CheckpointError` naming the holder when another live process
    holds it. The lock is an OS lock on ``run_dir/.lock`` (which records the holder's pid and
    host), so the lock of a process that died is released by the OS and taken over."""
    run_dir = Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise CheckpointError(f"{run_dir}: exists and is not a folder; choose a folder for out_dir (--out)")
    created = not run_dir.exists()
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{run_dir}: cannot write the run folder ({e.strerror or e}); choose another out_dir "
                              f"(--out)") from None
    key, path = str(run_dir.resolve()), run_dir / LOCK_NAME
    if key in _locks:
        raise CheckpointError(f"{run_dir}: already being written by this process (a run is still going on in it)")
    busy = (f"{run_dir}: in use by another difftx run ({{}}; lock file {path}); wait for it to finish or stop it, "
            f"or choose another out_dir (--out)")
    for _ in range(10):
        if fcntl is None:  # pragma: no cover - no flock: a pid file, taken over when its process is gone
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                text = _holder(path)
                m = re.match(r"pid (\d+) host (\S+)", text)
                if m and (m.group(2) != socket.gethostname() or pid_alive(int(m.group(1)))):
                    raise CheckpointError(busy.format(text)) from None
                path.unlink(missing_ok=True)
                continue
        else:
            try:
                fd = open_lock_file(path)  # a symbolic link is not followed (its target is not ours to rewrite)
            except OSError as e:
                raise CheckpointError(f"{path}: cannot open the run folder's lock file ({e.strerror or e}); "
                                      f"choose another out_dir (--out)") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise CheckpointError(busy.format(_holder(path))) from None
            try:  # the file may have been removed (by a run that just finished) before we locked it
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} host {socket.gethostname()}\n".encode())
        _locks[key] = (fd, path, created)
        return
    raise CheckpointError(f"{path}: could not take the lock (the file keeps changing); try again")


def unlock_run(run_dir: PathLike) -> None:
    """Release :func:`lock_run`'s lock (a no-op when this process does not hold it); a folder the
    lock created is removed again if nothing else was written into it."""
    run_dir = Path(run_dir)
    try:
        key = str(run_dir.resolve())
    except OSError:
        return
    entry = _locks.pop(key, None)
    if entry is None:
        return
    fd, path, created = entry
    try:
        path.unlink(missing_ok=True)  # while still holding the lock (see the inode check in lock_run)
    finally:
        os.close(fd)
    if created:
        try:
            run_dir.rmdir()  # only when empty
        except OSError:
            pass


def clean_stale(run_dir: PathLike) -> None:
    """Remove the stale staging folders a crash while saving left (:func:`difftx.io.staging_is_stale`)."""
    root = checkpoints_dir(run_dir)
    if root.is_dir():
        remove_stale_staging(root)


def _save_weights(model_state: dict, config: ModelConfig, folder: Path) -> None:
    """Write ``model.safetensors`` + ``config.json`` through difftx.checkpoint.save_model, with a
    meta-device model holding the (already gathered) tensors, so the format stays the lead's."""
    # the shell's construction draws from the global RNG, whose state the checkpoint has already recorded: forked,
    # so that writing a checkpoint leaves the run's draws (a batch source's, a dropout's) as they were
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        shell = Transformer(config)
    shell.load_state_dict(model_state, assign=True, strict=False)
    missing = set(shell.state_dict()) - set(model_state)
    if config.tie_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise CheckpointError(f"cannot save {folder}: model state lacks {sorted(missing)[:5]}")
    save_model(shell, folder)


def write_failure(e: BaseException, path: Path, previous: Optional[Path]) -> Optional[OSError]:
    """``e`` as an :class:`OSError` naming ``path``, the cause and the last good checkpoint, if it is
    a failed write (:func:`difftx.checkpoint.write_error`); else ``None``."""
    failed = write_error(e, path)
    if failed is None:
        return None
    good = f"the last good checkpoint is {previous}" if previous is not None else "no checkpoint was written before"
    return OSError(failed.errno, f"{failed.strerror}; nothing of this checkpoint was kept, {good}", str(path))


def save_checkpoint(run_dir: PathLike, step: int, *, model_state: dict, model_config: ModelConfig,
                    optim_state: dict, trainer_state: dict, train_config: dict, tokenizer: Any = None,
                    keep_last: int = 3) -> Path:
    """Write checkpoint ``step`` of the run in ``run_dir`` atomically, point ``latest`` at it and
    prune all but the newest ``keep_last``. Returns the checkpoint folder."""
    root = own_folder(checkpoints_dir(run_dir))
    final = root / step_dir_name(step)
    if final.exists():
        raise CheckpointError(f"{final}: a checkpoint for step {step} already exists; refusing to overwrite it")
    previous = latest_checkpoint(run_dir) if list_checkpoints(run_dir) else None
    writing = ""  # the part of the checkpoint being written, for the error
    try:
        with atomic_folder(final) as tmp:
            writing = WEIGHTS_NAME
            _save_weights(model_state, model_config, tmp)
            writing = OPTIM_NAME
            atomic_write(tmp / writing, lambda p: torch.save(optim_state, p))
            digests = {OPTIM_NAME: file_sha256(tmp / writing)}  # in the same folder, made visible with it
            writing = STATE_NAME
            write_json(tmp / writing, {"format": FORMAT, "version": FORMAT_VERSION, **trainer_state,
                                       DIGESTS: digests})
            writing = TRAIN_CONFIG_NAME
            write_json(tmp / writing, saved_form(train_config, run_dir) if train_config else train_config)
            if tokenizer is not None:
                writing = TOKENIZER_DIR
                tokenizer.save(tmp / writing)
            writing = ""
    except BaseException as e:
        failed = write_failure(e, final / writing, previous)
        if failed is not None:
            raise failed from e
        raise
    atomic_write(root / LATEST, lambda p: Path(p).write_text(final.name + "\n"))
    prune_checkpoints(run_dir, keep_last)
    return final


def prune_checkpoints(run_dir: PathLike, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` checkpoints of the run (never the one ``latest`` names)."""
    latest = latest_checkpoint(run_dir)
    for old in list_checkpoints(run_dir)[:-keep_last]:
        if old != latest:
            shutil.rmtree(old, ignore_errors=True)


# train_config.json (a run's, and the copy in each checkpoint): the fields read without TrainConfig
TRAIN_CONFIG_FIELDS = {"steps": "posint", "batch_size": "posint", "seq_len": "posint?", "ckpt_interval": "int?",
                       "data_source": "str?", "tokenizer": "str?", "saved_paths": "dict?"}


def read_train_config(path: PathLike, *, error: type[Exception] = CheckpointError) -> dict:
    """The training config saved at ``path`` (a run's ``train_config.json`` or a checkpoint's copy),
    its fields checked (:data:`TRAIN_CONFIG_FIELDS`): ``error`` naming the file and the field."""
    return read_record(path, "the training config of a difftx run", TRAIN_CONFIG_FIELDS, error=error)


# trainer_state.json: what its readers (resume, `difftx runs`) rely on
STATE_FIELDS = {"step": "int", "world_size": "posint", "loaders": "list", "rng": "list", "tokens_seen": "int~",
                "train_time_s": "number?", "val_split_tokens": "int?", "tokenizer": "str?", DIGESTS: "dict?",
                "machine": "dict?", "difftx": "str?", "kind_code": "dict?"}


def read_trainer_state(folder: PathLike) -> dict:
    path = Path(folder) / STATE_NAME
    state = read_json(path, "the trainer state of a difftx training checkpoint", error=CheckpointError)
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        found = state.get("format") if isinstance(state, dict) else None
        raise CheckpointError(f"{path}: not a difftx training state (format {found!r})")
    if state.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: unsupported trainer-state version {state.get('version')!r} "
                              f"(this difftx reads version {FORMAT_VERSION})")
    try:
        return check_record(state, STATE_FIELDS, str(path), "a difftx training state")
    except ValueError as e:
        raise CheckpointError(str(e)) from None


def recorded_digest(folder: PathLike, name: str) -> Optional[str]:
    """The SHA-256 the checkpoint's ``trainer_state.json`` recorded for its file ``name`` (``None``
    when it has none: written by an older difftx, or unreadable, which reading it names)."""
    try:
        state = json.loads((Path(folder) / STATE_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    digests = state.get(DIGESTS) if isinstance(state, dict) else None
    value = digests.get(name) if isinstance(digests, dict) else None
    return value if isinstance(value, str) and value else None


def read_optimizer_state(folder: PathLike) -> dict:
    """``optimizer.pt`` of a training checkpoint, its bytes checked against the SHA-256 its
    ``trainer_state.json`` recorded (:func:`difftx.checkpoint.verify_digest`)."""
    path = Path(folder) / OPTIM_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: optimizer state missing")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises several types for truncated / foreign files
        raise CheckpointError(f"{path}: cannot read optimizer state ({type(e).__name__}: {e})") from e
    if not isinstance(state, dict) or "state" not in state or "param_groups" not in state:
        raise CheckpointError(f"{path}: not an optimizer state dict")
    verify_digest(path, recorded_digest(folder, OPTIM_NAME))
    return state


def check_compatible(folder: PathLike, model_config: ModelConfig, train_config: dict, world_size: int,
                     tokenizer_name: Optional[str], state: dict) -> None:
    """Raise :class:`CheckpointError` naming the file and field when ``folder`` cannot be resumed
    exactly by a run with this model, config and world size."""
    folder = Path(folder)
    saved = load_config(folder)
    if saved != model_config:
        diff = {k: (v, getattr(model_config, k)) for k, v in saved.to_dict().items() if getattr(model_config, k) != v}
        raise CheckpointError(f"{folder / CONFIG_NAME}: incompatible model (checkpoint vs this run: {diff})")
    path = folder / TRAIN_CONFIG_NAME
    saved_train = read_train_config(path)
    diff = {k: (saved_train.get(k), train_config.get(k)) for k in RESUME_MUST_MATCH
            if not _same_setting(k, saved_train, train_config.get(k), folder)}
    if diff:
        raise CheckpointError(f"{path}: cannot resume exactly with a different {sorted(diff)} "
                              f"(checkpoint vs this run: {diff})")
    saved_global = saved_train.get("batch_size", 0) * state["world_size"]
    if saved_global != train_config.get("batch_size") * world_size:
        raise CheckpointError(
            f"{path}: the global batch (batch_size x processes) was {saved_train.get('batch_size')} x "
            f"{state['world_size']} = {saved_global}, now {train_config.get('batch_size')} x {world_size}; "
            f"resuming needs the same global batch (start a new run with init_from instead)")
    if tokenizer_name is not None and state.get("tokenizer") not in (None, tokenizer_name):
        raise CheckpointError(f"{folder / STATE_NAME}: tokenizer {state.get('tokenizer')!r} in the checkpoint, "
                              f"{tokenizer_name!r} in this run")


def check_kind_code(folder: PathLike, attention: str, recorded: Optional[dict]) -> None:
    """Raise :class:`CheckpointError` (one line) when checkpoint ``folder`` was trained with attention kind
    ``attention`` from a file of your own (``recorded``: its ``trainer_state.json``'s ``kind_code``) that has changed
    since (:func:`difftx.attention.registry.code_change`): resuming would continue the model with other code."""
    change = code_change(attention, recorded)
    if change is not None:
        raise CheckpointError(f"{Path(folder) / STATE_NAME}: attention kind {attention!r} was trained with the code "
                              f"in {change}; resuming would continue it with other code: put the file back as it "
                              f"was, or start a new run from this checkpoint (--init-from)")


def text_change(folder: PathLike, train_config: dict) -> Optional[dict]:
    """How the training text at the place checkpoint ``folder`` was trained from has changed since it
    was written: ``None`` when its SHA-256 is the one the checkpoint's ``train_config.json``
    recorded, or when that cannot be told (the bundled corpus, no SHA-256 recorded, the text given
    at another path, which :func:`check_compatible` compares). Else the path and the old and new
    SHA-256 and sizes."""
    value = train_config.get("data_source")
    if not isinstance(value, str):
        return None
    folder = Path(folder)
    saved = read_train_config(folder / TRAIN_CONFIG_NAME)
    records = saved.get(SAVED_PATHS) if isinstance(saved, dict) else None
    record = records.get("data_source") if isinstance(records, dict) else None
    if not (isinstance(record, dict) and isinstance(record.get("sha256"), str)
            and isinstance(saved.get("data_source"), str)):
        return None
    found, missing = resolve_saved_paths(saved, run_folder_of(folder))
    here = os.path.abspath(os.path.expanduser(value))
    if "data_source" in missing or os.path.abspath(os.path.expanduser(found["data_source"])) != here:
        return None
    now = path_identity("data_source", here)
    if now is None or now.get("sha256") in (None, record["sha256"]):
        return None
    return {"data_source": here, "old_sha256": record["sha256"], "new_sha256": now["sha256"],
            "old_bytes": record.get("bytes"), "new_bytes": now.get("bytes")}


def text_change_error(folder: PathLike, change: dict) -> str:
    """The one-line refusal of a resume on the changed text :func:`text_change` found."""
    old, new = change.get("old_bytes"), change.get("new_bytes")
    size = "the same size" if old == new else f"{old:,} bytes then, {new:,} now" if isinstance(old, int) and \
        isinstance(new, int) else "another size"
    return (f"{change['data_source']}: the training text changed since the checkpoint {Path(folder).name} was written "
            f"(SHA-256 {change['old_sha256'][:12]} then, {change['new_sha256'][:12]} now; {size}), so resuming would "
            f"train on other text; put the run's text back, or pass --allow-new-data (TrainConfig.allow_new_data) to "
            f"continue on the new text (the checkpoints record it)")


def run_folder_of(checkpoint: PathLike) -> Optional[Path]:
    """The run folder holding ``checkpoint`` (``RUN/checkpoints/step_N``), else ``None``."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent if checkpoint.parent.name == CHECKPOINTS else None


def _same_setting(key: str, saved: dict, value: Any, folder: Path) -> bool:
    """Whether a checkpoint's saved ``key`` and this run's ``value`` are the same setting: a path
    (:data:`~difftx.training.config.PATH_FIELDS`) is found where it is now (the run folder may have
    moved) and compared as a path, or by content: a copy of the same data is the same, and so is a
    path given anew whose content is the run's when the saved one is gone."""
    if key not in PATH_FIELDS or not (isinstance(saved.get(key), str) and isinstance(value, str)):
        return saved.get(key) == value
    found, missing = resolve_saved_paths(saved, run_folder_of(folder))
    here = os.path.abspath(os.path.expanduser(value))
    if key in missing:
        return differs_from_record(key, here, (saved.get(SAVED_PATHS) or {}).get(key)) is None
    there = os.path.abspath(os.path.expanduser(found[key]))
    return there == here or (os.path.exists(there) and os.path.exists(here) and same_content(key, there, here))


def load_model_state(folder: PathLike, model_config: ModelConfig) -> dict:
    """Weights of ``folder`` as a full state dict, validated against ``model_config``."""
    state = load_state(folder)
    path = Path(folder) / WEIGHTS_NAME
    return check_weights_fit(model_config, state, str(path))


# -- RNG state (per process) --------------------------------------------------------------------
def rng_state() -> dict:
    """Python, NumPy and torch (CPU and CUDA) generator states as JSON-serialisable values."""
    py = random.getstate()
    np_state = np.random.get_state()
    out = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": torch.get_rng_state().tolist(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state().tolist()
    return out


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    n = state["numpy"]
    np.random.set_state((n[0], np.asarray(n[1], dtype=np.uint32), n[2], n[3], n[4]))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
