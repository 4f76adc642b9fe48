"""Export of any built-in attention kind with difftx's own modeling code (``trust_remote_code=True``).

``modeling_difftx.py`` and ``configuration_difftx.py`` beside this file are copied into the exported folder; they
import only torch, transformers and the standard library (never difftx), and compute every built-in kind: one class
per kind in the modeling file's ``KINDS``, which a kind names in its ``remote_kind``. The folder's ``config.json``
carries the :class:`~difftx.config.ModelConfig` fields under their own names (``attention`` as the kind's
``remote_kind``, ``tie_embeddings`` as transformers' ``tie_word_embeddings``) and an ``auto_map`` naming the two
files; the weights
are difftx's state dict with every name but ``lm_head.weight`` under ``model.`` (a tied model stores no
``lm_head.weight``). This module only writes files: it does not import transformers.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from typing import Optional

import torch
from torch import Tensor

from ... import __version__
from ...attention.registry import BUILTIN_KINDS
from ...config import ModelConfig

HERE = Path(__file__).resolve().parent
FILES = ("configuration_difftx.py", "modeling_difftx.py")  # what export copies beside the weights
MODEL_TYPE = "difftx"
AUTO_MAP = {"AutoConfig": "configuration_difftx.DifftxConfig",
            "AutoModelForCausalLM": "modeling_difftx.DifftxForCausalLM"}


def refusal(config: ModelConfig) -> Optional[str]:
    """Why ``config`` cannot be exported with the modeling file, in one line, or None when it can (its kind names
    its class there, ``remote_kind``)."""
    if config.kind_class.remote_kind is not None:
        return None
    names = ", ".join(name for name, cls in BUILTIN_KINDS.items() if cls.remote_kind is not None)
    return (f"attention={config.attention!r} cannot be exported: {config.kind_class.__name__} is a registered kind "
            f"with no code in difftx's modeling file (remote_kind); no transformers class computes it, and that "
            f"file, for trust_remote_code, computes the built-in kinds only ({names})")


def remote_config(config: ModelConfig, dtype: torch.dtype = torch.float32) -> dict:
    """The ``config.json`` (as a dict) of ``config`` exported with the modeling file."""
    fields = dataclasses.asdict(config)
    tie = fields.pop("tie_embeddings")
    fields["attention"] = config.kind_class.remote_kind
    name = str(dtype).removeprefix("torch.")
    return {"architectures": ["DifftxForCausalLM"], "model_type": MODEL_TYPE, "auto_map": dict(AUTO_MAP), **fields,
            "tie_word_embeddings": tie, "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
            "use_cache": True, "dtype": name, "torch_dtype": name, "difftx_version": __version__}


def remote_state(config: ModelConfig, state: dict[str, Tensor]) -> dict[str, Tensor]:
    """difftx state dict -> the modeling file's: the same tensors, every name but ``lm_head.weight`` under
    ``model.``; a tied model's head is left out (transformers ties it to ``model.tok_embeddings.weight``)."""
    out = {}
    for name, t in state.items():
        if name == "lm_head.weight":
            if not config.tie_embeddings:
                out[name] = t.contiguous()
        else:
            out["model." + name] = t.contiguous()
    return out


def copy_code(folder: Path) -> None:
    """Copy the modeling and configuration files into ``folder``."""
    for name in FILES:
        shutil.copyfile(HERE / name, Path(folder) / name)
