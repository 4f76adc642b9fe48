"""Model files: ``config.json`` + ``model.safetensors`` in a folder, written atomically.

This is the model part of every checkpoint (the trainer adds optimizer and run state beside
it). A missing, corrupt or mismatched file raises :class:`CheckpointError` with the path.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Union

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


def load_config(folder: PathLike) -> ModelConfig:
    path = Path(folder) / CONFIG_NAME
    data = read_json(path, "the model config of a difftx checkpoint", error=CheckpointError)
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
