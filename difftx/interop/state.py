"""What every interop module shares, below them all: :class:`ConversionError`, and a difftx state dict checked
against the one its config expects (:func:`_expected_state`, :func:`_check_shapes`). :mod:`.hf` (transformers
folders) and :mod:`.fold` (exact folds) both take them from here, so neither imports the other's internals."""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..config import ModelConfig
from ..model import Transformer


class ConversionError(ValueError):
    """A model or folder that cannot be converted exactly; the message says why."""


def _expected_state(config: ModelConfig) -> dict[str, Tensor]:
    """difftx state dict on the meta device (shapes and dtypes only), as a folder stores it."""
    with torch.device("meta"):
        sd = Transformer(config).state_dict()
    if config.tie_embeddings:
        sd.pop("lm_head.weight")
    return sd


def _check_shapes(got: dict[str, Tensor], expected: dict[str, Tensor], source: str,
                  ignore: Callable[[str], bool] = lambda k: False) -> None:
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(k for k in set(got) - set(expected) if not ignore(k))
    wrong = sorted(f"{k} {tuple(got[k].shape)} != {tuple(expected[k].shape)}"
                   for k in set(expected) & set(got) if tuple(got[k].shape) != tuple(expected[k].shape))
    if missing or unexpected or wrong:
        raise ConversionError(f"{source}: weights do not fit the config (missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}, wrong shape {wrong[:5]})")
