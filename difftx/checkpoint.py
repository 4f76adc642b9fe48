"""Model files: ``config.json`` + ``model.safetensors`` in a folder, written atomically.

This is the model part of every checkpoint (the trainer adds optimizer and run state beside
it). A missing, corrupt or mismatched file raises :class:`CheckpointError` with the path.

Every weights file carries its own SHA-256 (:data:`DIGEST_KEY` in the safetensors metadata: the
digest of the file with that value zeroed), written with the file; :func:`load_state` checks it
on every load (:func:`verify_digest`, the one check, also used for the trainer's optimizer state).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import ModelConfig
from .io import atomic_write, read_json
from .model import Transformer

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
PathLike = Union[str, os.PathLike]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or does not fit the model."""


# -- digests: the bytes written are the bytes read ---------------------------------------------------
DIGEST_KEY = "difftx_sha256"  # safetensors metadata: SHA-256 of the file with this value written as 64 zeros
_ZEROS = b"0" * 64
_DIGEST_FIELD = re.compile(rb'"' + DIGEST_KEY.encode() + rb'"\s*:\s*"([0-9a-f]{64})"')
_CHUNK = 1 << 23
_noticed: set[str] = set()  # files without a recorded digest already named on stderr (once per file)


def _digest_span(f) -> tuple[Optional[tuple[int, int]], bytes]:
    """Where a safetensors file's recorded digest lies (byte offsets in the file; ``None`` for none or
    another kind of file) and the bytes read so far (from the start of ``f``)."""
    head = f.read(8)
    if len(head) < 8:
        return None, head
    n = int.from_bytes(head, "little")
    size = os.fstat(f.fileno()).st_size
    if not 2 <= n <= min(size - 8, 100_000_000):
        return None, head
    header = f.read(n)
    found = _DIGEST_FIELD.search(header) if header[:1] == b"{" else None
    return (None if found is None else (8 + found.start(1), 8 + found.end(1))), head + header


def _sha256(path: Path) -> tuple[Optional[str], str]:
    """``(recorded, actual)``: the digest a safetensors file records in its header (``None`` if none,
    or for any other file) and the SHA-256 of the file, with that recorded value read as zeros."""
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb") as f:
        span, start = _digest_span(f)
        recorded = None
        if span is not None:
            recorded = start[span[0]:span[1]].decode()
            start = start[:span[0]] + _ZEROS + start[span[1]:]
        h.update(start)
        while True:
            got = f.readinto(buf)
            if not got:
                break
            h.update(view[:got])
    return recorded, h.hexdigest()


def file_sha256(path: PathLike) -> str:
    """The digest :func:`verify_digest` compares with: a file's SHA-256 (for a safetensors file that
    records its own, with that value read as zeros)."""
    return _sha256(Path(path))[1]


def verify_digest(path: PathLike, recorded: Optional[str] = None, *, notice: bool = True) -> None:
    """The check every load of weights (and of a training checkpoint's optimizer state) goes
    through: the file's SHA-256 must be the one recorded when it was written, in its own header
    (``model.safetensors``) or, for other files, ``recorded`` (what the checkpoint holds for it).
    A mismatch is a :class:`CheckpointError` naming the file; a file with no recorded digest
    (written by an older difftx) is accepted, with a one-line notice on stderr once per file
    (none with ``notice=False``)."""
    path = Path(path)
    try:
        in_file, actual = _sha256(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    recorded = recorded or in_file
    if recorded is None:
        key = os.path.abspath(path)
        if notice and key not in _noticed:
            _noticed.add(key)
            print(f"difftx: note: {path}: no SHA-256 recorded (written by an older difftx or another tool); loaded "
                  f"without checking its bytes", file=sys.stderr, flush=True)
        return
    if actual != recorded:
        raise CheckpointError(f"{path}: the bytes changed since they were written (SHA-256 {actual[:12]}..., recorded "
                              f"{recorded[:12]}...): the file is damaged or was edited; it is not used")


def save_weights(path: PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write a safetensors file atomically, with its SHA-256 in its own metadata (:data:`DIGEST_KEY`),
    so the file and its digest are one write."""
    meta = {**metadata, DIGEST_KEY: _ZEROS.decode()}

    def write(tmp: str) -> None:
        save_file(tensors, tmp, metadata=meta)
        _, digest = _sha256(Path(tmp))
        with open(tmp, "r+b") as f:
            span, _ = _digest_span(f)
            if span is None:  # pragma: no cover - safetensors wrote the metadata elsewhere than its header
                raise CheckpointError(f"{path}: the written header holds no {DIGEST_KEY}")
            f.seek(span[0])
            f.write(digest.encode())

    atomic_write(path, write)


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
    save_weights(folder / WEIGHTS_NAME, _weights(model), meta)
    atomic_write(folder / CONFIG_NAME, lambda p: Path(p).write_text(model.config.to_json() + "\n"))
    return folder


# fields of a transformers config.json that a difftx config never has
HF_CONFIG_KEYS = ("architectures", "hidden_size", "model_type", "num_attention_heads", "num_hidden_layers",
                  "intermediate_size", "torch_dtype", "transformers_version")


def load_config(folder: PathLike) -> ModelConfig:
    path = Path(folder) / CONFIG_NAME
    data = read_json(path, "the model config of a difftx checkpoint", error=CheckpointError)
    try:
        return ModelConfig.from_dict(data)
    except (TypeError, ValueError) as e:
        hf = sorted(k for k in HF_CONFIG_KEYS if isinstance(data, dict) and k in data)
        if hf and "model_type" not in data:  # transformers' keys without the field that names the class
            raise CheckpointError(f"{path}: a transformers-style config (it has {', '.join(hf[:3])}) without the "
                                  f"'model_type' field that names its architecture: add it (\"llama\", \"mistral\", "
                                  f"\"qwen2\" or \"diffllama\"), then `difftx import` or `difftx convert` reads the "
                                  f"folder") from e
        if hf:  # a Hub-style folder where a difftx checkpoint was expected: say what it is and what reads it
            raise CheckpointError(f"{path}: this looks like a Hugging Face transformers folder (its config has "
                                  f"{', '.join(hf[:3])}), not a difftx checkpoint: read it with `difftx import "
                                  f"{Path(folder)} OUT`, or make it differential with `difftx convert {Path(folder)} "
                                  f"OUT`, then use OUT") from e
        raise CheckpointError(f"{path}: invalid model config: {e}") from e


def load_state(folder: PathLike) -> dict[str, torch.Tensor]:
    """The tensors of ``folder/model.safetensors``, after checking its bytes are the ones written
    (:func:`verify_digest`). Every reader of weights (eval, resume, init_from, export, runs,
    compare's reuse) comes through here."""
    path = Path(folder) / WEIGHTS_NAME
    if not path.is_file():
        raise CheckpointError(f"{path}: weights file missing")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read weights ({e})") from e
    verify_digest(path)
    return state


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
    """Build the model from ``folder/config.json`` and load ``folder/model.safetensors``; a training run folder
    (no ``config.json``, checkpoints inside) means its latest checkpoint, as on the command line."""
    folder = Path(folder)
    if folder.is_dir() and not (folder / CONFIG_NAME).is_file():
        folder = resolve_checkpoint(folder)
    model = Transformer(load_config(folder))
    load_weights_into(model, load_state(folder), str(Path(folder) / WEIGHTS_NAME))
    return model.to(device)


# -- a training run's checkpoints (the run folder's layout: difftx.training.checkpointing) --------------------------
CHECKPOINTS = "checkpoints"
LATEST = "latest"
_STEP_RE = re.compile(r"^step_(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def checkpoints_dir(run_dir: PathLike) -> Path:
    return Path(run_dir) / CHECKPOINTS


def _step_of(folder: Path) -> int:
    return int(_STEP_RE.match(folder.name).group(1))


def list_checkpoints(run_dir: PathLike) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first (temporary folders excluded)."""
    root = checkpoints_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(_step_of(p), p) for p in root.iterdir() if p.is_dir() and _STEP_RE.match(p.name)]
    return [p for _, p in sorted(found)]


def latest_checkpoint(run_dir: PathLike) -> Optional[Path]:
    """The folder named by ``checkpoints/latest``, or a newer step folder where there is one (a step folder is moved
    into place whole before the pointer is rewritten, so a crash between the two left the pointer one checkpoint
    behind, and the run could not go on: its next save found that step's folder there); the newest step folder if
    the pointer is missing; ``None`` when the run has none. A dangling pointer is a :class:`CheckpointError`."""
    root = checkpoints_dir(run_dir)
    pointer = root / LATEST
    if pointer.is_file():
        try:
            name = pointer.read_text(encoding="utf-8").strip()
        except UnicodeDecodeError:
            raise CheckpointError(f"{pointer}: not a text file (it should hold a checkpoint folder's name)") from None
        if not _STEP_RE.match(name):
            raise CheckpointError(f"{pointer}: does not name a checkpoint folder (got {name[:80]!r})")
        target = root / name
        if not target.is_dir():
            raise CheckpointError(f"{pointer}: points to {target}, which does not exist")
        newest = list_checkpoints(run_dir)[-1]
        return newest if _step_of(newest) > _step_of(target) else target
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1] if ckpts else None


def resolve_checkpoint(path: PathLike) -> Path:
    """A checkpoint folder from either itself or a run folder (whose latest checkpoint is used)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint or run folder")
    if (path / CONFIG_NAME).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path}: neither a checkpoint folder (no {CONFIG_NAME}) nor a run folder with "
                              f"checkpoints")
    return latest
