"""The tokenizer files of a Hugging Face folder: copied from a difftx model or run folder, or written
for difftx's byte tokenizer (:func:`difftx.data.tokenizer.byte_tokenizer_json`), with the
``tokenizer_config.json`` that ``AutoTokenizer`` reads."""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path
from typing import Optional

from ..data.tokenizer import EOS_CANDIDATES, META_FILE, TOKENIZER_FILE, byte_tokenizer_json
from ..io import atomic_write, write_json
from .state import ConversionError

TOKENIZER_FILES = (TOKENIZER_FILE, "tokenizer_config.json", "special_tokens_map.json")


def copy_tokenizer(src: Optional[Path], dst: Path) -> list[str]:
    """Copy the :data:`TOKENIZER_FILES` that ``src`` holds into ``dst``; return their names."""
    copied = []
    if src is None:
        return copied
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            atomic_write(dst / name, lambda p, s=src / name: shutil.copyfile(s, p))
            copied.append(name)
    return copied


def find_eos(tokenizer_json: Path) -> tuple[Optional[str], Optional[int]]:
    """The first of :data:`~difftx.data.tokenizer.EOS_CANDIDATES` among the special tokens of a
    ``tokenizer.json``, and its id (None, None: none, or not readable)."""
    try:
        added = {t["content"]: t["id"] for t in json.loads(tokenizer_json.read_text()).get("added_tokens", [])}
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
        return None, None
    for name in EOS_CANDIDATES:
        if name in added:
            return name, int(added[name])
    return None, None


def tokenizer_size(path: Path) -> Optional[int]:
    """One more than the largest id a ``tokenizer.json`` can produce (its model's vocabulary and its added tokens),
    or None when the file does not say (an unreadable or unusual file: transformers will judge it)."""
    try:
        data = json.loads(Path(path).read_text())
        vocab = (data.get("model") or {}).get("vocab")
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab))) if isinstance(vocab, list) \
            else []
        ids += [t["id"] for t in data.get("added_tokens") or [] if isinstance(t, dict) and isinstance(t.get("id"), int)]
        return max(ids) + 1 if ids and all(isinstance(i, int) for i in ids) else None
    except (OSError, ValueError, AttributeError, TypeError, KeyError):
        return None


def export_tokenizer(src: Optional[Path], out: Path, max_len: int,
                     vocab_size: Optional[int] = None) -> tuple[Optional[str], Optional[int]]:
    """Copy (or, for difftx's byte tokenizer, write) the tokenizer files of ``src`` into ``out``, with a
    ``tokenizer_config.json`` of ``model_max_length = max_len`` when ``src`` has none; return the eos
    token and id (None, None without a tokenizer: a warning says why). A tokenizer that produces ids beyond
    ``vocab_size`` (the model's) is refused with a ConversionError."""
    copied = copy_tokenizer(src, out)
    if TOKENIZER_FILE not in copied and src is not None and (src / META_FILE).is_file():
        try:
            meta = json.loads((src / META_FILE).read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            meta = {}
        if meta.get("type") == "byte" and meta.get("eos_id", 256) == 256:
            try:
                text = byte_tokenizer_json()
            except ImportError:
                warnings.warn("the 'tokenizers' package is missing: exported without a tokenizer "
                              "(pip install 'difftx[hf]')", stacklevel=3)
                return None, None
            atomic_write(out / TOKENIZER_FILE, lambda p: Path(p).write_text(text))
            copied.append(TOKENIZER_FILE)
        else:
            warnings.warn(f"{src / META_FILE}: not difftx's standard byte tokenizer ({meta}); exported without "
                          "a tokenizer", stacklevel=3)
    if TOKENIZER_FILE not in copied:
        return None, None
    size = tokenizer_size(out / TOKENIZER_FILE)
    if vocab_size is not None and size is not None and size > vocab_size:
        raise ConversionError(f"{src}: the tokenizer produces ids up to {size - 1}, but the model's vocabulary has "
                              f"{vocab_size} rows (ids 0-{vocab_size - 1}); transformers would fail on ordinary text "
                              f"with an IndexError: export with the tokenizer the model was trained with")
    eos, eos_id = find_eos(out / TOKENIZER_FILE)
    if "tokenizer_config.json" not in copied:
        tk = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_len,
              "clean_up_tokenization_spaces": False}
        if eos is not None:
            tk["eos_token"] = eos
        write_json(out / "tokenizer_config.json", tk, indent=2)
    return eos, eos_id
