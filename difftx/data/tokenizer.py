"""Tokenizers: one small interface, two implementations.

``ByteTokenizer``   UTF-8 bytes 0..255 plus one special token ``<|endoftext|>`` (id 256); no
                    training, no files; the default for tiny models.
``BPETokenizer``    a ``tokenizer.json`` of the Hugging Face ``tokenizers`` library, trained
                    locally with :func:`train_bpe` or supplied by the user. Nothing is fetched
                    from a hub.

Every tokenizer has ``encode(str) -> list[int]``, ``decode(list[int]) -> str``, ``vocab_size``,
``eos_id`` (the document separator: each packed document *starts* with it, see
``difftx.data.store``), ``name`` (a stable identity used in cache keys) and ``save(folder)``.
``load_tokenizer(spec)`` builds one from ``"byte"`` or a path.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Iterable, Iterator, Optional, Protocol, Sequence, Union, runtime_checkable

from ..io import atomic_write

EOS_TOKEN = "<|endoftext|>"
# special-token spellings recognised as the document separator in a user tokenizer.json, in order
EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|eos|>", "[EOS]", "<|end_of_text|>", "[SEP]")
TOKENIZER_FILE = "tokenizer.json"
META_FILE = "difftx_tokenizer.json"


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map (what ``ByteLevel`` pre-tokenizers use)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), ord("\xff") + 1)]
    out, extra = {b: chr(b) for b in keep}, 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def byte_tokenizer_json(eos_token: str = EOS_TOKEN) -> str:
    """A ``tokenizer.json`` equal to :class:`ByteTokenizer`: UTF-8 byte ``b`` is id ``b``, ``eos_token``
    is id 256 (a byte-level BPE with no merges, no regex split, no prefix space). Needs ``tokenizers``."""
    from tokenizers import AddedToken, Tokenizer as HFTokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(eos_token, special=True)])
    return tok.to_str(pretty=True)


@runtime_checkable
class Tokenizer(Protocol):
    """What the rest of difftx needs from a tokenizer."""

    name: str

    @property
    def vocab_size(self) -> int: ...

    @property
    def eos_id(self) -> int: ...

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def save(self, folder: Union[str, os.PathLike]) -> Path: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then ``<|endoftext|>`` = 256. ``vocab_size`` = 257.

    ``encode`` never produces the special token (a literal ``"<|endoftext|>"`` in the text is
    encoded as its bytes); ``decode`` renders it as ``"<|endoftext|>"`` and replaces invalid
    UTF-8 (a model can sample a partial character) with U+FFFD.
    """

    name = "byte"
    specials = (EOS_TOKEN,)

    @property
    def vocab_size(self) -> int:
        return 256 + len(self.specials)

    @property
    def eos_id(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str):
        """Fast path for the data pipeline: the ids as a ``uint8`` numpy array (no specials)."""
        import numpy as np

        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Sequence[int]) -> str:
        out: list[str] = []
        run = bytearray()
        for i in ids:
            i = int(i)
            if 0 <= i < 256:
                run.append(i)
                continue
            if not 256 <= i < self.vocab_size:
                raise ValueError(f"token id {i} is outside the byte tokenizer's vocabulary (0..{self.vocab_size - 1})")
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            out.append(self.specials[i - 256])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def save(self, folder: Union[str, os.PathLike]) -> Path:
        """Write ``difftx_tokenizer.json`` saying ``{"type": "byte"}``; ``load_tokenizer(folder)`` reads it."""
        path = Path(folder) / META_FILE
        text = json.dumps({"type": "byte", "vocab_size": self.vocab_size, "eos_id": self.eos_id}, indent=2) + "\n"
        atomic_write(path, lambda p: Path(p).write_text(text, encoding="utf-8"))
        return path

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size}, eos_id={self.eos_id})"


class BPETokenizer:
    """A ``tokenizers.Tokenizer`` (from a ``tokenizer.json``) behind the difftx interface.

    ``name`` is ``"bpe-<first 16 hex of sha256(tokenizer.json)>"``, so two different files never
    share a data cache entry. ``eos_id`` is the first of :data:`EOS_CANDIDATES` present in the
    vocabulary, or the token named by ``eos_token``.
    """

    def __init__(self, tok, *, source: str = "<memory>", eos_token: Optional[str] = None) -> None:
        self._tok = tok
        self.source = source
        blob = tok.to_str()
        self.name = "bpe-" + hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]
        candidates = (eos_token,) if eos_token else EOS_CANDIDATES
        eos = None
        for c in candidates:
            eos = tok.token_to_id(c)
            if eos is not None:
                self.eos_token = c
                break
        if eos is None:
            raise ValueError(f"tokenizer {source}: no document-separator token found (looked for "
                             f"{', '.join(candidates)}); pass eos_token= naming one of its special tokens")
        self._eos_id = int(eos)

    @classmethod
    def from_file(cls, path: Union[str, os.PathLike], *, eos_token: Optional[str] = None) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the library raises a bare Exception on malformed JSON
            raise ValueError(f"tokenizer {path}: cannot be read as a tokenizers tokenizer.json: {e}") from e
        return cls(tok, source=str(path), eos_token=eos_token)

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def eos_id(self) -> int:
        return self._eos_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def _chunkable(self) -> bool:
        """True for GPT-2 style byte-level pre-tokenization without a prefix space, where a
        newline between two non-space characters always ends a pre-token (so cutting there
        cannot change the ids)."""
        pre = self._tok.pre_tokenizer
        return (type(pre).__name__ == "ByteLevel" and not getattr(pre, "add_prefix_space", True)
                and getattr(pre, "use_regex", False))

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        """Several texts at once (the library parallelises this across cores); see :meth:`encode_arrays`."""
        return [a.tolist() for a in self.encode_arrays(texts)]

    def encode_arrays(self, texts: Sequence[str]) -> list:
        """The ids of several texts, as ``int32`` numpy arrays, in bounded memory: texts longer than
        ``CHUNK_CHARS`` are cut at safe points first (byte-level tokenizers only), which also spreads
        one long document over all cores (the ids are the same), and the library is given at most
        about ``ENCODE_CHARS`` characters per call (it keeps several objects per token: all of a
        31 MB text at once took 3 GB).

        The texts are read literally: a special token's string in them (``<|endoftext|>`` in TinyStories) is encoded
        as the characters it is, never as the document separator. Parsed, it split a document in two where it stood
        whole in a piece, and not where a cut fell inside it (:meth:`encode`, for prompts, parses them as
        transformers does)."""
        import numpy as np

        texts = list(texts)
        chunkable = self._chunkable()
        parts: list[list] = [[] for _ in texts]
        group: list[str] = []
        owner: list[int] = []

        def flush() -> None:
            before = self._tok.encode_special_tokens
            self._tok.encode_special_tokens = True  # special tokens' strings are text here
            try:
                batch = self._tok.encode_batch(group, add_special_tokens=False)
            finally:
                self._tok.encode_special_tokens = before
            for i, enc in zip(owner, batch, strict=True):
                parts[i].append(np.asarray(enc.ids, dtype=np.int32))
            group.clear()
            owner.clear()

        size = 0
        for i, t in enumerate(texts):
            for piece in (_safe_pieces(t, CHUNK_CHARS) if chunkable else [t]):
                group.append(piece)
                owner.append(i)
                size += len(piece)
                if size >= ENCODE_CHARS:
                    flush()
                    size = 0
        if group:
            flush()
        return [np.concatenate(p) if p else np.zeros(0, dtype=np.int32) for p in parts]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def save(self, folder: Union[str, os.PathLike]) -> Path:
        """Write ``tokenizer.json`` into ``folder`` (atomically) and return its path."""
        path = Path(folder) / TOKENIZER_FILE
        text = self._tok.to_str(pretty=True)
        atomic_write(path, lambda p: Path(p).write_text(text, encoding="utf-8"))
        return path

    def __repr__(self) -> str:
        return f"BPETokenizer({self.source!r}, vocab_size={self.vocab_size}, eos_id={self.eos_id})"


CHUNK_CHARS = 1 << 16  # long texts are encoded in pieces of about this many characters
ENCODE_CHARS = 1 << 20  # characters given to the library per call (its per-token objects stay small)
# where a GPT-2 style pre-tokenizer always starts a pre-token, whatever comes before or after: after a
# newline with non-space on both sides; before a space followed by a non-space (a pre-token holds
# non-spaces after at most one leading space, and a run of spaces leaves its last one to the word);
# between an ASCII letter or digit and ASCII punctuation (a letter or digit run ends there, and a
# punctuation run or a contraction like 's starts there), so that minified text has places too
_SAFE_CUT = re.compile(r"(?<=\S\n)(?=\S)|(?= \S)|(?<=[A-Za-z0-9])(?=[!-/:-@\[-`{-~])")
MAX_UNCUT_CHARS = 1 << 22  # a longer stretch with no safe cut is one pre-token: ~100 bytes per character to encode


class UncuttableTextError(ValueError):
    """A text with a stretch longer than :data:`MAX_UNCUT_CHARS` that a byte-level BPE tokenizer
    would have to take at once (no place in it where :data:`_SAFE_CUT` may cut)."""


def _safe_pieces(text: str, size: int) -> list[str]:
    """``text`` cut at the first safe point after every ``size`` characters (whole if none).
    :class:`UncuttableTextError` when a piece would be longer than :data:`MAX_UNCUT_CHARS`."""
    out: list[str] = []
    start = 0
    while len(text) - start > size:
        m = _SAFE_CUT.search(text, start + size)
        if m is None:
            break
        out.append(text[start:m.start()])
        start = m.start()
    out.append(text[start:])
    k = max(range(len(out)), key=lambda i: len(out[i]))
    longest = out[k]
    if len(longest) > max(size, MAX_UNCUT_CHARS):
        at = sum(len(p) for p in out[:k])
        raise UncuttableTextError(
            f"a text has {len(longest):,} characters with no space before a word, no newline between lines and "
            f"no ASCII punctuation after a letter (from character {at:,}: {longest[:40]!r}...): a byte-level BPE "
            f"tokenizer cannot take it in smaller pieces and would need about {len(longest) * 100 / 1e9:.1f} GB "
            f"for it; break the text into lines or words, or use the byte tokenizer")
    return out


TokenizerSpec = Union[str, os.PathLike, Tokenizer]


def load_tokenizer(spec: TokenizerSpec = "byte", *, eos_token: Optional[str] = None) -> Tokenizer:
    """Return a tokenizer from ``"byte"``, a ``tokenizer.json`` path, or a folder holding
    ``tokenizer.json`` (or a ``difftx_tokenizer.json`` written by ``ByteTokenizer.save``).
    A tokenizer object is returned unchanged."""
    if not isinstance(spec, (str, os.PathLike)):
        if isinstance(spec, Tokenizer):
            return spec
        raise TypeError(f"tokenizer must be 'byte', a path or a tokenizer object, got {type(spec).__name__}")
    if isinstance(spec, str) and spec == "byte":
        return ByteTokenizer()
    path = Path(spec)
    if path.name == META_FILE and path.is_file():  # the file ByteTokenizer.save writes, named itself: its folder
        path = path.parent
    if path.is_dir():
        if (path / TOKENIZER_FILE).is_file():
            return BPETokenizer.from_file(path / TOKENIZER_FILE, eos_token=eos_token)
        if (path / META_FILE).is_file():
            try:
                meta = json.loads((path / META_FILE).read_text(encoding="utf-8"))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"tokenizer {path / META_FILE}: not valid JSON ({e})") from None
            if not isinstance(meta, dict):
                raise ValueError(f"tokenizer {path / META_FILE}: expected a JSON object")
            if meta.get("type") == "byte":
                return ByteTokenizer()
            raise ValueError(f"tokenizer {path / META_FILE}: unknown type {meta.get('type')!r}")
        raise FileNotFoundError(f"tokenizer folder {path} holds neither {TOKENIZER_FILE} nor {META_FILE}")
    if path.is_file():
        return BPETokenizer.from_file(path, eos_token=eos_token)
    raise FileNotFoundError(f"tokenizer {str(spec)!r} is not 'byte' and no such file or folder exists")


def not_the_models_tokenizer(tok: Tokenizer, given: TokenizerSpec, saved: Union[str, os.PathLike],
                             folder: Union[str, os.PathLike]) -> Optional[str]:
    """Why ``tok`` (loaded from ``given``, ``--tokenizer``) cannot read or write the text of the model in ``folder``,
    whose own tokenizer is saved in ``saved``: it is another tokenizer (its text would be garbage); None if the same."""
    own = load_tokenizer(saved)
    if own.name == tok.name:
        return None
    return (f"{folder}: --tokenizer {given} ({tok.name}, {tok.vocab_size} tokens) is not the tokenizer this model was "
            f"trained with ({own.name}, {own.vocab_size} tokens, saved in {saved}); its text would be garbage: leave "
            f"--tokenizer out (tokenizer=None) to use that one")


def check_tokenizer_compatible(tok: Tokenizer, vocab_size: int, folder: Union[str, os.PathLike], *,
                               given: Optional[TokenizerSpec] = None,
                               saved: Union[None, str, os.PathLike] = None) -> None:
    """Refuse a tokenizer the model in ``folder`` (``vocab_size`` token ids) cannot be read with:
    one ``given`` (``--tokenizer``) that is not the one saved beside the model (``saved``: that copy's
    folder, None where none is saved), or one with more tokens than the model has ids (``ValueError``,
    one line). A ``given`` one that no saved copy vouches for and whose size differs from the model's
    is a warning: unless it is the one the model was trained with, its text is garbage."""
    if given is not None and saved is not None:
        other = not_the_models_tokenizer(tok, given, saved, folder)
        if other is not None:
            raise ValueError(other)
    if tok.vocab_size > vocab_size:
        spec = given if isinstance(given, (str, os.PathLike)) else saved
        what = tok.name if spec is None or str(spec) == tok.name else f"{spec} ({tok.name})"
        raise ValueError(f"{folder}: tokenizer {what} has {tok.vocab_size:,} tokens, more than the model's "
                         f"{vocab_size:,} token ids; use the tokenizer the model was trained with")
    if given is not None and saved is None and tok.vocab_size != vocab_size:
        import warnings

        warnings.warn(f"{folder} has no tokenizer saved with it to check --tokenizer {given} against, and their "
                      f"sizes differ (the model has {vocab_size:,} token ids, the tokenizer {tok.vocab_size:,}): "
                      f"unless it is the tokenizer the model was trained with, the text is garbage", stacklevel=3)


def _iter_training_texts(files_or_texts, text_field: str,
                         texts: Optional[Iterable[str]]) -> Iterator[tuple[str, str]]:
    """(where it comes from, text) of every training text."""
    from .sources import iter_documents, looks_like_text, resolve_sources

    if texts is not None:
        for i, t in enumerate(texts):
            yield f"text {i} of texts=", t
    if files_or_texts is None:
        if texts is None:  # nothing given at all: the bundled corpus's training split
            for doc in iter_documents(resolve_sources(None)):
                if doc.split == "train":
                    yield doc.origin, doc.text
        return
    items = [files_or_texts] if isinstance(files_or_texts, (str, os.PathLike)) else list(files_or_texts)
    paths = []
    for i, item in enumerate(items):
        if isinstance(item, str) and looks_like_text(item):
            yield f"text {i} of files_or_texts", item
        else:
            paths.append(item)
    if paths:
        for doc in iter_documents(resolve_sources(paths), text_field=text_field):
            yield doc.origin, doc.text


def train_bpe(files_or_texts=None, vocab_size: int = 4096, out_dir: Union[None, str, os.PathLike] = None, *,
              texts: Optional[Iterable[str]] = None, text_field: str = "text", min_frequency: int = 2,
              show_progress: bool = True) -> BPETokenizer:
    """Train a byte-level BPE tokenizer locally and save ``out_dir/tokenizer.json`` (kept in
    memory only when ``out_dir`` is None).

    ``files_or_texts``: ``None`` (the bundled corpus's training split), or one or more paths
    (plain-text files, folders, ``.jsonl`` with ``text_field``). A ``str`` item that contains a
    newline or is longer than 1,024 characters is taken as a text, any other ``str`` as a path
    (missing paths raise ``FileNotFoundError``); ``texts=`` passes in-memory texts explicitly.

    The tokenizer splits like GPT-2 (byte-level pre-tokenizer, all 256 bytes in the initial
    alphabet, so any string encodes) and has one special token, ``<|endoftext|>``, the document
    separator. ``vocab_size`` counts it and is an upper bound: a small text may run out of
    pairs seen ``min_frequency`` times before reaching it.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if not isinstance(vocab_size, int) or vocab_size < 257 + 1:
        raise ValueError(f"vocab_size must be an int > 257 (256 bytes + <|endoftext|> + merges), got {vocab_size!r}")
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  # the library's bar writes blank lines to a stdout that is not a terminal
                                  show_progress=show_progress and sys.stdout.isatty())
    n_texts = 0

    def counted() -> Iterator[str]:
        nonlocal n_texts
        for origin, t in _iter_training_texts(files_or_texts, text_field, texts):
            n_texts += 1
            # in pieces cut where a pre-token ends anyway: the same word counts, so the same tokenizer,
            # in bounded memory (one 31 MB line took the library 2.8 GB, and far more as it grows)
            try:
                pieces = _safe_pieces(t, CHUNK_CHARS)
            except UncuttableTextError as e:
                raise UncuttableTextError(f"{origin}: {e}") from None
            yield from pieces

    tok.train_from_iterator(counted(), trainer=trainer)
    if n_texts == 0:
        raise ValueError("train_bpe: no training text was given")
    out = BPETokenizer(tok, source=str(Path(out_dir) / TOKENIZER_FILE) if out_dir is not None else "<trained>")
    if out_dir is not None:
        out.save(out_dir)
    return out
