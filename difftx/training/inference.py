"""Sampling from a training checkpoint: the model, its tokenizer, and KV-cached generation."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional, Union

from ..checkpoint import CheckpointError, load_model
from ..data.tokenizer import check_tokenizer_compatible, load_tokenizer
from ..generation import generate
from ..model import Transformer
from .checkpointing import TOKENIZER_DIR, resolve_checkpoint
from .distributed import resolve_device


def load_for_generation(path: Union[str, os.PathLike], tokenizer: Optional[str] = None,
                        device: str = "cpu") -> tuple[Transformer, Any, Path]:
    """The model and tokenizer of a checkpoint folder (or of a run folder's latest checkpoint).

    ``tokenizer`` overrides the one saved in the checkpoint's ``tokenizer/`` folder.
    """
    folder = resolve_checkpoint(path)
    model = load_model(folder, device=device)
    model.eval()
    saved = folder / TOKENIZER_DIR if (folder / TOKENIZER_DIR).exists() else None  # the one it was trained with
    if tokenizer is None and saved is None:
        raise CheckpointError(f"{folder / TOKENIZER_DIR}: no tokenizer saved with this checkpoint; "
                              f"pass one (tokenizer='byte' or a tokenizer.json path)")
    tok = load_tokenizer(tokenizer or saved)
    check_tokenizer_compatible(tok, model.config.vocab_size, folder, given=tokenizer, saved=saved)
    return model, tok, folder


def generate_text(path: Union[str, os.PathLike], prompt: str, *, max_new_tokens: int = 200,
                  temperature: float = 0.8, top_k: Optional[int] = None, top_p: Optional[float] = None,
                  seed: Optional[int] = 0, tokenizer: Optional[str] = None, device: str = "auto") -> str:
    """Continue ``prompt`` with the checkpoint at ``path``; returns only the new text.

    The prompt is preceded by the tokenizer's document separator (as every training document
    is) and sampling stops early when the model emits it. Uses the KV cache.
    """
    check_utf8(prompt, "prompt")
    model, tok, _ = load_for_generation(path, tokenizer, resolve_device(device))
    ids = [tok.eos_id] + list(tok.encode(prompt))
    out = generate(model, [ids], max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                   stop_tokens=[tok.eos_id], seed=seed)[0]
    if out and out[-1] == tok.eos_id:
        out = out[:-1]
    return tok.decode(out)


def check_utf8(text: str, name: str) -> None:
    """``ValueError`` naming ``name`` when ``text`` is not valid Unicode text: a command-line argument
    in another encoding (Python keeps its non-UTF-8 bytes as lone surrogates, which no tokenizer can
    encode)."""
    if not isinstance(text, str):
        raise TypeError(f"{name}: expected a str, got {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = text[:e.start].encode("utf-8", "surrogateescape")
        bad = text[e.start]
        byte = f"byte 0x{ord(bad) - 0xDC00:02x}" if 0xDC80 <= ord(bad) <= 0xDCFF else f"character U+{ord(bad):04X}"
        raise ValueError(f"{name}: not valid UTF-8 text ({byte} at byte offset {len(raw)}); give it in UTF-8 (a "
                         f"terminal or file in another encoding: convert it, e.g. with iconv -t UTF-8, or use a "
                         f"UTF-8 locale)") from None
