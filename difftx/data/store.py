"""Token stores: documents tokenized once into memory-mapped files, cached and reused.

Layout of a packed stream (one per split)::

    [eos] doc0 tokens... [eos] doc1 tokens... [eos] doc2 tokens...
    ^ doc_offsets[0]=0   ^ doc_offsets[1]      ^ doc_offsets[2]        ... doc_offsets[-1] = len

Every document *starts* with the tokenizer's ``eos_id`` (the separator acts as a beginning-of-
document token), so with block-diagonal attention the first text token of a document is
predicted from the separator of its own document, and the last token of a document predicts
the separator that opens the next one (learning where documents end).

A cache entry is a folder ``<cache_dir>/<key>/`` holding ``train.bin``, ``train.offsets.npy``,
``val.bin``, ``val.offsets.npy``, ``meta.json`` and the tokenizer; ``key`` hashes the sources
(paths, sizes, mtimes; the bundled corpus by content), the tokenizer's identity and the split
settings. Entries are built in a temporary folder and renamed into place (atomic), and are
checked when opened (file sizes, offsets, every token id < vocab_size).
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import os
import time
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from ..io import atomic_folder
from .sources import (
    HF_VAL_SPLITS,
    DataError,
    Document,
    Source,
    SourceSpec,
    count_documents,
    iter_documents,
    resolve_sources,
)
from . import tokenizer as tokenizer_module
from .tokenizer import Tokenizer, TokenizerSpec, UncuttableTextError, load_tokenizer

FORMAT_VERSION = 1
DEFAULT_VAL_FRACTION = 0.05
DOC_SPLIT_MIN_VAL_DOCS = 5  # split by whole documents only when that gives at least this many val docs
SPLITS = ("train", "val")
_BATCH_DOCS, _BATCH_CHARS = 256, 1 << 20  # texts are encoded in batches of at most this many docs / characters

# number of texts (documents, or document pieces when split) tokenized by this process;
# tests use it to prove that a cached entry is reused without tokenizing
TOKENIZED_DOCUMENTS = 0


def default_cache_dir() -> Path:
    """``$DIFFTX_CACHE_DIR``, else ``$XDG_CACHE_HOME/difftx/data``, else ``~/.cache/difftx/data``."""
    if os.environ.get("DIFFTX_CACHE_DIR"):
        return Path(os.environ["DIFFTX_CACHE_DIR"]).expanduser()
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "difftx" / "data"


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab < 65,536), else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


class TokenStore:
    """One split: a 1-D token memmap and its document boundaries.

    ``tokens``       ``np.memmap`` (N,) of uint16/uint32, read-only
    ``doc_offsets``  ``np.ndarray`` (num_docs + 1,) int64: document starts, then N
    ``len(store)``   N, the number of tokens (separators included)
    """

    def __init__(self, tokens: np.ndarray, doc_offsets: np.ndarray, *, vocab_size: int, eos_id: int,
                 name: str = "<memory>", fingerprint: str = "", origin: str = "") -> None:
        self.tokens = tokens
        self.doc_offsets = np.asarray(doc_offsets, dtype=np.int64)
        self.vocab_size = int(vocab_size)
        self.eos_id = int(eos_id)
        self.name = name  # the file, for messages
        self.origin = origin or name  # what it was tokenized from, for messages
        self.fingerprint = fingerprint or name
        self._check_offsets()

    # ------------------------------------------------------------------ construction
    @classmethod
    def open(cls, folder: Union[str, os.PathLike], split: str, *, verify: bool = True) -> "TokenStore":
        """Open ``folder/{split}.bin`` with the metadata in ``folder/meta.json``; ``verify`` scans
        every token id against the vocabulary."""
        folder = Path(folder)
        meta_path = folder / "meta.json"
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise DataError(f"{meta_path}: cannot read the token store's metadata: {e}") from e
        if meta.get("format") != FORMAT_VERSION or split not in meta.get("splits", {}):
            raise DataError(f"{meta_path}: not a difftx token store of format {FORMAT_VERSION} with split {split!r}")
        info = meta["splits"][split]
        dtype = np.dtype(meta["dtype"])
        bin_path = folder / f"{split}.bin"
        n = int(info["tokens"])
        size = bin_path.stat().st_size if bin_path.exists() else -1
        if size != n * dtype.itemsize:
            raise DataError(f"{bin_path}: expected {n} {dtype} tokens ({n * dtype.itemsize} bytes), "
                            f"found {size} bytes; the cache entry is damaged (delete {folder})")
        tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n,)) if n else np.zeros(0, dtype)
        offsets = np.load(folder / f"{split}.offsets.npy")
        store = cls(tokens, offsets, vocab_size=meta["vocab_size"], eos_id=meta["eos_id"], name=str(bin_path),
                    fingerprint=f"{meta.get('key', folder.name)}/{split}",
                    origin=f"the {split} split of {_describe_sources(meta.get('sources', []))}")
        if verify:
            store.check_vocab(meta["vocab_size"])
        return store

    @classmethod
    def from_token_file(cls, path: Union[str, os.PathLike], *, vocab_size: int, eos_id: int,
                        dtype: Optional[str] = None) -> "TokenStore":
        """A user's token file: ``.npy`` (1-D integer array) or raw ``.bin`` (``dtype``, default
        uint16). Documents are delimited by ``eos_id`` (each starting with it); ids are checked."""
        path = Path(path)
        if path.suffix == ".npy":
            arr = np.load(path, mmap_mode="r")
        else:
            arr = np.memmap(path, dtype=np.dtype(dtype or "uint16"), mode="r")
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise DataError(f"{path}: a token file must be a 1-D integer array, got {arr.dtype} of shape {arr.shape}")
        if len(arr) == 0:
            raise DataError(f"{path}: the token file is empty")
        starts = np.flatnonzero(np.asarray(arr) == eos_id).astype(np.int64)
        if len(starts) == 0 or starts[0] != 0:
            starts = np.concatenate([[0], starts])
        offsets = np.concatenate([starts, [len(arr)]]).astype(np.int64)
        store = cls(arr, offsets, vocab_size=vocab_size, eos_id=eos_id, name=str(path))
        store.check_vocab(vocab_size)
        return store

    # ------------------------------------------------------------------ checks
    def _check_offsets(self) -> None:
        o = self.doc_offsets
        n = len(self.tokens)
        if o.ndim != 1 or len(o) < 1 or o[0] != 0 or o[-1] != n or (len(o) > 1 and np.any(np.diff(o) <= 0)):
            raise DataError(f"{self.name}: document offsets must rise strictly from 0 to the token count {n}")

    def check_vocab(self, vocab_size: int) -> None:
        """Raise :class:`DataError` naming the file, the first bad id and its position when a
        token id is >= ``vocab_size`` (a damaged file, or a tokenizer/model mismatch)."""
        chunk = 1 << 24
        for start in range(0, len(self.tokens), chunk):
            part = np.asarray(self.tokens[start:start + chunk])
            if part.size and int(part.max()) >= vocab_size:
                pos = int(np.flatnonzero(part >= vocab_size)[0])
                raise DataError(f"{self.name}: token id {int(part[pos])} at position {start + pos} is outside the "
                                f"vocabulary of size {vocab_size} (tokenizer and model disagree, or the file "
                                f"is damaged)")
            if part.size and int(part.min()) < 0:
                raise DataError(f"{self.name}: negative token id at position {start + int(np.argmin(part))}")

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return int(len(self.tokens))

    @property
    def num_docs(self) -> int:
        return int(len(self.doc_offsets) - 1)

    def doc_index(self, positions: np.ndarray) -> np.ndarray:
        """Index of the document holding each stream position (same shape, int64)."""
        return np.searchsorted(self.doc_offsets, positions, side="right").astype(np.int64) - 1

    def window(self, start: int, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens ``[start, start+length)`` (int64) and their doc_ids, numbered from 0 in the window."""
        toks = np.asarray(self.tokens[start:start + length], dtype=np.int64)
        docs = self.doc_index(np.arange(start, start + length, dtype=np.int64))
        return toks, docs - docs[0]

    def eval_batches(self, batch_size: int, seq_len: int, *, max_batches: Optional[int] = None,
                     rank: int = 0, world_size: int = 1):
        """Deterministic, non-overlapping windows for validation loss.

        Window ``k`` covers tokens ``[k*T, k*T + T + 1)`` for ``k < (N - 1) // T``; batches take
        consecutive windows; the last batch may be smaller. With ``world_size`` > 1, rank ``r``
        gets batches ``r, r + W, ...`` of the same sequence. Yields ``(tokens, doc_ids)``, both
        ``torch.int64`` of shape ``(b, T+1)``.
        """
        import torch

        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be >= 1, got {batch_size} and {seq_len}")
        n_windows = (len(self) - 1) // seq_len
        if n_windows < 1:
            raise DataError(f"{self.name} ({self.origin}): {len(self)} tokens; evaluation with seq_len={seq_len} needs "
                            f"at least "
                            f"{seq_len + 1}")
        n_batches = -(-n_windows // batch_size)
        if max_batches is not None:
            n_batches = min(n_batches, max_batches)
        for b in range(rank, n_batches, world_size):
            ks = range(b * batch_size, min((b + 1) * batch_size, n_windows))
            rows = [self.window(k * seq_len, seq_len + 1) for k in ks]
            toks = torch.from_numpy(np.stack([r[0] for r in rows]))  # (b, T+1)
            docs = torch.from_numpy(np.stack([r[1] for r in rows]))  # (b, T+1)
            yield toks, docs

    def decode_doc(self, i: int, tokenizer: Tokenizer) -> str:
        """Document ``i`` as text (its leading separator dropped)."""
        a, b = int(self.doc_offsets[i]), int(self.doc_offsets[i + 1])
        return tokenizer.decode(np.asarray(self.tokens[a + 1:b]).tolist())

    def __repr__(self) -> str:
        return f"TokenStore({self.name!r}, tokens={len(self):,}, docs={self.num_docs:,}, vocab={self.vocab_size})"


def _describe_sources(fingerprints: Sequence[dict]) -> str:
    """'the bundled corpus', 'a.txt', 'a.txt, b.txt and 3 more' from cached source fingerprints."""
    names = ["the bundled corpus" if f.get("kind") == "bundled" else
             f.get("path") or ("a saved dataset" if "files" in f else "a datasets object") for f in fingerprints]
    if not names:
        return "unknown sources"
    return ", ".join(names[:2]) + (f" and {len(names) - 2} more" if len(names) > 2 else "")


@dataclass
class PreparedData:
    """What :func:`prepare_data` returns."""

    train: TokenStore
    val: Optional[TokenStore]  # None when val_fraction == 0
    tokenizer: Tokenizer
    path: Path  # the cache entry
    from_cache: bool  # True when the entry existed and nothing was tokenized
    meta: dict


# ---------------------------------------------------------------------------------------------
# building


class _Writer:
    """Appends ``[eos] + ids`` documents to ``{split}.bin`` and records offsets."""

    def __init__(self, path: Path, dtype: np.dtype, eos_id: int) -> None:
        self.path = path
        self.f = open(path, "wb")
        self.dtype = dtype
        self.eos = np.array([eos_id], dtype=dtype)
        self.offsets = array("q", [0])  # int64, compact for millions of documents
        self.max_id = -1

    def add(self, ids) -> None:
        arr = np.asarray(ids)
        if arr.size:
            self.max_id = max(self.max_id, int(arr.max()))
        self.eos.tofile(self.f)
        arr.astype(self.dtype, copy=False).tofile(self.f)
        self.offsets.append(self.offsets[-1] + 1 + int(arr.size))

    def close(self) -> dict:
        self.f.close()
        np.save(self.path.with_name(self.path.stem + ".offsets.npy"), np.frombuffer(self.offsets, dtype=np.int64))
        return {"tokens": self.offsets[-1], "docs": len(self.offsets) - 1, "max_id": max(self.max_id, int(self.eos[0]))}


def _cut_tail(text: str, val_fraction: float) -> int:
    """Where to cut a document so the tail holds ~``val_fraction`` of its characters: the first
    newline at or after the exact point (the exact point when no newline follows)."""
    cut = int(round(len(text) * (1.0 - val_fraction)))
    nl = text.find("\n", cut)
    cut = nl + 1 if nl != -1 and nl + 1 < len(text) else cut
    return max(1, min(cut, len(text) - 1))


def _split_rule(sources: Sequence[Source], val_fraction: Optional[float], text_field: str) -> dict:
    """Decide how documents are split (before reading them), as a JSON-able record."""
    if val_fraction is None and all(s.has_fixed_split for s in sources):
        return {"rule": "fixed"}
    if any(s.has_fixed_split for s in sources) and val_fraction is None and len(sources) > 1:
        raise DataError("mixing a source with a fixed split (bundled corpus / DatasetDict) and other sources needs "
                        "an explicit val_fraction")
    frac = DEFAULT_VAL_FRACTION if val_fraction is None else float(val_fraction)
    if not 0.0 <= frac < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
    if frac == 0.0:
        return {"rule": "none", "val_fraction": 0.0}
    every = max(2, int(round(1.0 / frac)))
    n_docs = count_documents(sources, text_field)
    if n_docs is not None and n_docs // every >= DOC_SPLIT_MIN_VAL_DOCS:
        return {"rule": "every_kth_document", "every": every, "val_fraction": frac, "documents": n_docs}
    return {"rule": "document_tails", "val_fraction": frac}


def _cache_key(sources: Sequence[Source], tokenizer: Tokenizer, val_fraction: Optional[float],
               text_field: str) -> str:
    blob = json.dumps({"format": FORMAT_VERSION, "sources": [s.fingerprint for s in sources],
                       "tokenizer": tokenizer.name, "vocab_size": tokenizer.vocab_size, "eos_id": tokenizer.eos_id,
                       "val_fraction": val_fraction, "text_field": text_field,
                       # a special token's string in the text is text (entries built before parsed it: see
                       # BPETokenizer.encode_arrays), so those entries are not reused
                       "special_tokens": "literal"}, sort_keys=True)
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:20]


def _encode_many(tokenizer: Tokenizer, texts: list[str]) -> list:
    global TOKENIZED_DOCUMENTS
    TOKENIZED_DOCUMENTS += len(texts)
    if hasattr(tokenizer, "encode_arrays"):  # many at once, in bounded memory
        return tokenizer.encode_arrays(texts)  # type: ignore[attr-defined]
    if hasattr(tokenizer, "encode_array"):
        return [tokenizer.encode_array(t) for t in texts]  # type: ignore[attr-defined]
    if hasattr(tokenizer, "encode_batch"):
        return tokenizer.encode_batch(texts)  # type: ignore[attr-defined]
    return [tokenizer.encode(t) for t in texts]


def _routed(docs: Iterator[Document], rule: dict) -> Iterator[tuple[str, str, str]]:
    """(split, text, where it came from) pieces in stream order according to the split rule."""
    for i, doc in enumerate(docs):
        kind = rule["rule"]
        if kind == "fixed":
            if doc.split not in SPLITS:
                raise DataError(f"{doc.origin}: document without a train/val split in a fixed-split source")
            yield doc.split, doc.text, doc.origin
        elif kind == "none":
            yield "train", doc.text, doc.origin
        elif kind == "every_kth_document":
            yield ("val" if i % rule["every"] == rule["every"] - 1 else "train"), doc.text, doc.origin
        else:  # document_tails
            if len(doc.text) < 2:
                yield "train", doc.text, doc.origin
                continue
            cut = _cut_tail(doc.text, rule["val_fraction"])
            yield "train", doc.text[:cut], doc.origin
            yield "val", doc.text[cut:], doc.origin


# ``False`` hides the tokenizing bar whatever ``progress=`` says: how ``difftx train --no-progress``
# hides every progress bar while the trainer, run with progress=True, still prints its start and
# validation lines (its own bar is hidden through ``train(progress_bar={"disable": True})``)
PROGRESS_BARS: contextvars.ContextVar[bool] = contextvars.ContextVar("difftx_progress_bars", default=True)


def _build(entry: Path, sources: Sequence[Source], tokenizer: Tokenizer, rule: dict, text_field: str,
           key: str, progress: bool) -> dict:
    from tqdm.auto import tqdm

    dtype = token_dtype(tokenizer.vocab_size)
    writers = {s: _Writer(entry / f"{s}.bin", dtype, tokenizer.eos_id) for s in SPLITS}
    total = rule.get("documents") or count_documents(sources, text_field)
    bar = tqdm(total=total, unit="doc", desc="tokenizing", disable=not (progress and PROGRESS_BARS.get()),
               dynamic_ncols=True)
    pending: list[tuple[str, str, str]] = []  # (split, text, where it came from)
    pending_chars = 0
    n_tokens = 0

    def flush() -> None:
        nonlocal pending, pending_chars, n_tokens
        try:
            encoded = _encode_many(tokenizer, [t for _, t, _ in pending])
        except UncuttableTextError as e:  # named by the texts long enough to hold such a stretch (every source before)
            longest = tokenizer_module.MAX_UNCUT_CHARS
            where = ", ".join(dict.fromkeys(o for _, t, o in pending if len(t) > longest)) or "a text"
            raise DataError(f"{where}: {e}") from None
        for (split, _, _), ids in zip(pending, encoded, strict=True):
            writers[split].add(ids)
            n_tokens += len(ids) + 1
        bar.update(sum(1 for s, _, _ in pending if s == "train" or rule["rule"] != "document_tails"))
        bar.set_postfix(tokens=f"{n_tokens:,}", refresh=False)
        pending, pending_chars = [], 0

    try:
        for split, text, origin in _routed(iter_documents(sources, text_field=text_field), rule):
            pending.append((split, text, origin))
            pending_chars += len(text)
            if len(pending) >= _BATCH_DOCS or pending_chars >= _BATCH_CHARS:
                flush()
        flush()
    finally:
        bar.close()
        infos = {s: w.close() for s, w in writers.items()}
    where = ", ".join(str(s.path or "datasets object") for s in sources)
    if infos["train"]["docs"] == 0:
        raise DataError(f"no training documents in {where}")
    if infos["val"]["docs"] == 0 and rule["rule"] != "none":
        if rule["rule"] == "fixed":
            raise DataError(f"{where}: the source's fixed split has no validation documents (a DatasetDict needs a "
                            f"{'/'.join(HF_VAL_SPLITS)} split); pass val_fraction to split it")
        raise DataError(f"{where}: no validation text (every document is shorter than 2 characters); "
                        f"pass val_fraction=0 to train without validation")
    for s, info in infos.items():
        if info["max_id"] >= tokenizer.vocab_size:
            raise DataError(f"{entry / (s + '.bin')}: the tokenizer produced id {info['max_id']} >= its vocab_size "
                            f"{tokenizer.vocab_size}")
    meta = {"format": FORMAT_VERSION, "key": key, "dtype": dtype.name, "vocab_size": tokenizer.vocab_size,
            "eos_id": tokenizer.eos_id, "tokenizer": tokenizer.name, "text_field": text_field, "split": rule,
            "sources": [s.fingerprint for s in sources], "splits": infos,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    tokenizer.save(entry / "tokenizer")
    (entry / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return meta


def prepare_data(source: SourceSpec = None, tokenizer: TokenizerSpec = "byte",
                 cache_dir: Union[None, str, os.PathLike] = None, val_fraction: Optional[float] = None,
                 text_field: str = "text", *, progress: bool = True) -> PreparedData:
    """Tokenize ``source`` once (or reuse the cache) and return its train/val token stores.

    source        ``None`` (the bundled Shakespeare corpus with its fixed split), a plain-text
                  file, a folder (recursive, sorted), a ``.jsonl`` file, a list of these, a saved
                  ``datasets`` folder / ``.parquet`` file / ``Dataset`` object (needs ``datasets``)
    tokenizer     ``"byte"``, a path to a ``tokenizer.json`` or its folder, or a tokenizer object
    cache_dir     where entries live (default :func:`default_cache_dir`)
    val_fraction  ``None``: the source's fixed split if it has one, else 0.05. Otherwise: every
                  ``round(1/val_fraction)``-th document goes to validation when that yields at
                  least 5 of them, else the last ``val_fraction`` of every document (cut at a
                  newline). ``0``: no validation split (``.val`` is ``None``).
    text_field    the JSONL / dataset field holding the text

    Errors (empty or non-UTF-8 files, bad JSONL, ids outside the vocabulary) raise
    :class:`DataError` naming the file.
    """
    if val_fraction is not None and not (isinstance(val_fraction, (int, float)) and 0.0 <= val_fraction < 1.0):
        raise ValueError(f"val_fraction must be None or a number in [0, 1), got {val_fraction!r}")
    if not isinstance(text_field, str) or not text_field:
        raise ValueError(f"text_field must be a non-empty string, got {text_field!r}")
    tok = load_tokenizer(tokenizer)
    sources = resolve_sources(source)
    key = _cache_key(sources, tok, val_fraction, text_field)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    entry = root / key
    from_cache = (entry / "meta.json").is_file()
    if not from_cache:
        rule = _split_rule(sources, val_fraction, text_field)
        # another process may finish the same entry first: then its entry is kept
        with atomic_folder(entry, kept=lambda e: (e / "meta.json").is_file()) as tmp:
            try:
                _build(tmp, sources, tok, rule, text_field, key, progress)
            except OSError as e:  # a full disk while writing the cache: name it (numpy's write error does not)
                if e.filename is not None:
                    raise
                raise OSError(e.errno, f"{e.strerror or e} (writing the token cache; set cache_dir or "
                                       f"DIFFTX_CACHE_DIR to put it elsewhere)", str(entry)) from e
    meta = json.loads((entry / "meta.json").read_text(encoding="utf-8"))
    if meta["tokenizer"] != tok.name or meta["vocab_size"] != tok.vocab_size:
        raise DataError(f"{entry}: cached with tokenizer {meta['tokenizer']} (vocab {meta['vocab_size']}), "
                        f"asked for {tok.name} (vocab {tok.vocab_size})")
    train = TokenStore.open(entry, "train")
    val = TokenStore.open(entry, "val") if meta["splits"]["val"]["docs"] > 0 else None
    return PreparedData(train=train, val=val, tokenizer=tok, path=entry, from_cache=from_cache, meta=meta)
