"""Model files: ``config.json`` + ``model.safetensors`` in a folder, written atomically.

This is the model part of every checkpoint (the trainer adds optimizer and run state beside
it). A missing, corrupt or mismatched file raises :class:`CheckpointError` with the path.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .model import Transformer

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
PathLike = Union[str, os.PathLike]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit the model."""


def umask_mode(folder: bool = False) -> int:
    """The mode a plain ``open`` / ``mkdir`` would give under the process's umask (``0o666`` /
    ``0o777`` less the umask). ``tempfile`` creates owner-only files and folders; the atomic
    writers chmod their results to this so colleagues can read checkpoints as the umask allows."""
    mask = os.umask(0)
    os.umask(mask)
    return (0o777 if folder else 0o666) & ~mask


def _likely_write_errno(path: PathLike) -> Optional[int]:
    """Why a write under ``path`` failed when the error does not say: a (nearly) full disk, else a
    file-size limit on this process, else ``None``."""
    import errno

    folder = next((p for p in Path(path).parents if p.is_dir()), Path("."))
    try:
        fs = os.statvfs(folder)
        if fs.f_bavail * fs.f_frsize < 1 << 20:
            return errno.ENOSPC
    except (OSError, AttributeError):
        pass
    try:
        import resource

        if resource.getrlimit(resource.RLIMIT_FSIZE)[0] != resource.RLIM_INFINITY:
            return errno.EFBIG
    except (ImportError, OSError, ValueError):
        pass
    return None


def write_error(e: BaseException, path: PathLike) -> Optional[OSError]:
    """``e`` as an :class:`OSError` naming ``path`` and the cause (the errno text: "No space left on
    device", "File too large", ...), if it is a failed write: an ``OSError`` (full disk, file too
    large, read-only, no permission) or the ``RuntimeError`` that ``torch.save`` / safetensors wrap
    one in (``unexpected pos``, ``Os { code: N``); else ``None``."""
    if isinstance(e, OSError):
        return OSError(e.errno, e.strerror or str(e), str(path))
    if isinstance(e, RuntimeError) or type(e).__name__ == "SafetensorError":
        text = str(e)
        found = re.search(r"Os \{ code: (\d+)", text)
        if found:
            code = int(found.group(1))
            return OSError(code, os.strerror(code), str(path))
        if "unexpected pos" in text or "inline_container" in text:  # torch.save hides the errno: look for it
            code = _likely_write_errno(path)
            return OSError(code, (os.strerror(code) if code else "the write failed") + " (torch.save: unexpected pos)",
                           str(path))
    return None


def atomic_write(path: PathLike, write) -> None:
    """Call ``write(tmp_path)`` then rename over ``path``: readers never see a partial file. The
    file gets the permissions the umask allows (:func:`umask_mode`), not ``tempfile``'s 0600.
    A failed write (full disk, file too large, read-only, ...) is an :class:`OSError` naming
    ``path`` and the cause (:func:`write_error`); ``path`` is then left as it was."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(e.filename or path.parent)) from e
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, umask_mode())
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except Exception as e:
        if isinstance(e, OSError) and e.filename is not None and os.fspath(e.filename) != tmp:
            raise  # another file's error (a source being copied): it names that file
        failed = write_error(e, path)
        if failed is None:
            raise
        raise failed from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _weights(model: Transformer) -> dict[str, torch.Tensor]:
    sd = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if model.config.tie_embeddings:
        sd.pop("lm_head.weight", None)  # stored once, as tok_embeddings.weight
    return sd


def save_model(model: Transformer, folder: PathLike, metadata: dict | None = None) -> Path:
    """Write ``config.json`` and ``model.safetensors`` into ``folder`` (created if needed)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"format": "difftx", **{k: str(v) for k, v in (metadata or {}).items()}}
    atomic_write(folder / WEIGHTS_NAME, lambda p: save_file(_weights(model), p, metadata=meta))
    atomic_write(folder / CONFIG_NAME, lambda p: Path(p).write_text(model.config.to_json() + "\n"))
    return folder


def read_json(path: Path, missing: str, corrupt: str):
    """Parsed JSON of ``path``; :class:`CheckpointError` with ``missing`` / ``corrupt`` otherwise."""
    if not path.is_file():
        raise CheckpointError(f"{path}: {missing}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: {corrupt} ({e})") from e


def load_config(folder: PathLike) -> ModelConfig:
    path = Path(folder) / CONFIG_NAME
    data = read_json(path, f"no model config here (is {folder} a difftx checkpoint folder?)", "not valid JSON")
    try:
        return ModelConfig.from_dict(data)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid model config: {e}") from e


def load_state(folder: PathLike) -> dict[str, torch.Tensor]:
    path = Path(folder) / WEIGHTS_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: weights file missing")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read weights ({e})") from e


def check_weights_fit(config: ModelConfig, state: dict[str, torch.Tensor], source: str = "state dict"
                      ) -> dict[str, torch.Tensor]:
    """``state`` completed for tied embeddings, after checking it has exactly the keys and shapes
    of a model built from ``config`` (built on the meta device: no memory, no init)."""
    if config.tie_embeddings:
        state = {**state, "lm_head.weight": state.get("tok_embeddings.weight")}
    with torch.device("meta"):
        expected = Transformer(config).state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = sorted(k for k in set(expected) & set(state)
                   if state[k] is None or tuple(state[k].shape) != tuple(expected[k].shape))
    if missing or unexpected or wrong:
        raise CheckpointError(f"{source}: weights do not fit the model config (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]})")
    return state


def load_weights_into(model: Transformer, state: dict[str, torch.Tensor], source: str = "state dict") -> None:
    model.load_state_dict(check_weights_fit(model.config, state, source))


def load_model(folder: PathLike, device: str | torch.device = "cpu") -> Transformer:
    """Build the model from ``folder/config.json`` and load ``folder/model.safetensors``."""
    model = Transformer(load_config(folder))
    load_weights_into(model, load_state(folder), str(Path(folder) / WEIGHTS_NAME))
    return model.to(device)
