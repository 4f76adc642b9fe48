"""Where documents come from: plain text, folders of it, JSONL, the bundled corpus, and
(optionally) Hugging Face ``datasets`` on local disk.

A *document* is one plain-text file, one JSONL record, one dataset row, or one work of the
bundled corpus. Documents are read in a fixed order (folders recursively, paths sorted), so
the same sources always give the same token stream.

Bad input raises :class:`DataError` (a ``ValueError``) naming the file and the place: an empty
file, bytes that are not UTF-8 (with the byte offset), a JSONL line that is not JSON or lacks
the text field (with the line number). Nothing is skipped silently.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import os
import re
import warnings
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence, Union

BUNDLED_CORPUS = Path(__file__).resolve().parent / "corpus" / "shakespeare.jsonl.gz"
BUNDLED_PROVENANCE = BUNDLED_CORPUS.parent / "PROVENANCE.md"

TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
COMPRESSION_SUFFIXES = (".gz", ".xz")
HF_FILE_SUFFIXES = {".parquet": "parquet", ".arrow": "arrow"}


class DataError(ValueError):
    """Bad input data; the message names the file (and line or byte offset where it applies)."""


@dataclass(frozen=True)
class Document:
    text: str
    origin: str  # "path", "path:LINE" or "dataset[ROW]": where the document came from, for messages
    split: Optional[str] = None  # "train"/"val" when the source fixes the split (bundled corpus, DatasetDict)


@dataclass
class Source:
    """One input. ``kind``: ``"text"``, ``"jsonl"``, ``"bundled"``, ``"hf"``."""

    kind: str
    path: Optional[Path] = None
    dataset: Any = None  # a datasets.Dataset / DatasetDict for kind "hf" given as an object
    fingerprint: dict = field(default_factory=dict)

    @property
    def has_fixed_split(self) -> bool:
        if self.kind == "bundled":
            return True
        if self.kind != "hf":
            return False
        if self.dataset is not None:
            return _is_dataset_dict(self.dataset)
        return self.path is not None and (self.path / "dataset_dict.json").is_file()


def looks_like_text(s: str) -> bool:
    """A ``str`` is taken as text rather than a path when it has a newline or is very long."""
    return "\n" in s or len(s) > 1024


def _base_suffix(path: Path) -> tuple[str, Optional[str]]:
    """(".jsonl", ".gz") for "x.jsonl.gz"; (".txt", None) for "x.txt"."""
    suffixes = [s.lower() for s in path.suffixes]
    if suffixes and suffixes[-1] in COMPRESSION_SUFFIXES:
        return (suffixes[-2] if len(suffixes) > 1 else ""), suffixes[-1]
    return (suffixes[-1] if suffixes else ""), None


def _file_fingerprint(path: Path) -> dict:
    """What names a file's content for the cache: its path, size, mtime and change time. An edit that keeps the size
    with the mtime set back (``cp -p``, ``rsync -t``, ``touch -r``, an archive's extraction) reused the old tokens;
    the change time is the kernel's, which no tool sets back (a ``chmod`` moves it too: a new entry, never stale)."""
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def _is_dataset_dict(obj: Any) -> bool:
    return obj is not None and type(obj).__name__ in ("DatasetDict", "IterableDatasetDict")


def _file_source(path: Path, explicit: bool = False) -> Source:
    base, _ = _base_suffix(path)
    if base in JSONL_SUFFIXES or (explicit and base == ".json"):  # a named .json file is read as JSON lines
        kind = "jsonl"
    elif base in HF_FILE_SUFFIXES:
        kind = "hf"
    else:
        kind = "text"  # any explicitly named file is read as plain text
    return Source(kind=kind, path=path, fingerprint={"kind": kind, **_file_fingerprint(path)})


def _is_saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file())


def _walk(folder: Path) -> list[Path]:
    """Every entry below ``folder``, in the order of ``sorted(folder.rglob("*"))``, into folders reached through a
    symbolic link too (``rglob`` skipped them in silence), each real folder once; a link to ``folder`` itself or to a
    folder above it (a loop) is not followed."""
    out: list[Path] = []
    root = folder.resolve()
    seen: set[Path] = set()

    def visit(d: Path) -> None:
        real = d.resolve()
        if real in seen or d != folder and (real == root or real in root.parents):
            return
        seen.add(real)
        for p in sorted(d.iterdir()):
            out.append(p)
            if p.is_dir():  # a link to a folder too
                visit(p)

    visit(folder)
    return sorted(out)


def _folder_sources(folder: Path) -> list[Source]:
    if _is_saved_dataset(folder):
        return [Source(kind="hf", path=folder, fingerprint={"kind": "hf-disk", "files": [
            _file_fingerprint(p) for p in sorted(folder.rglob("*")) if p.is_file()]})]
    found: list[Source] = []
    ignored: list[Path] = []
    broken: list[Path] = []
    for p in _walk(folder):
        rel = p.relative_to(folder)
        if any(part.startswith(".") for part in rel.parts):
            continue  # hidden files and folders (.git, .DS_Store) are never data
        if not p.exists():  # a link to nothing
            broken.append(rel)
            continue
        if not p.is_file():
            continue
        base, _ = _base_suffix(p)
        if base in TEXT_SUFFIXES or base in JSONL_SUFFIXES:
            found.append(_file_source(p))
        else:
            ignored.append(rel)
    for what, paths in (("file(s) without a text suffix (" + "/".join(TEXT_SUFFIXES + JSONL_SUFFIXES)
                         + ", optionally .gz/.xz)", ignored), ("link(s) to nothing", broken)):
        if paths:
            shown = ", ".join(str(r) for r in paths[:5]) + (" ..." if len(paths) > 5 else "")
            warnings.warn(f"data folder {folder}: ignoring {len(paths)} {what}: {shown}", stacklevel=3)
    if not found:
        raise DataError(f"data folder {folder} holds no text files ({'/'.join(TEXT_SUFFIXES + JSONL_SUFFIXES)})")
    return found


_BUNDLED_SHA: Optional[str] = None


def bundled_source() -> Source:
    """The bundled Shakespeare corpus (see ``corpus/PROVENANCE.md``), keyed by its content hash."""
    global _BUNDLED_SHA
    if not BUNDLED_CORPUS.is_file():
        raise FileNotFoundError(f"the bundled corpus {BUNDLED_CORPUS} is missing from this installation")
    if _BUNDLED_SHA is None:
        _BUNDLED_SHA = hashlib.sha256(BUNDLED_CORPUS.read_bytes()).hexdigest()
    return Source(kind="bundled", path=BUNDLED_CORPUS, fingerprint={"kind": "bundled", "sha256": _BUNDLED_SHA})


SourceSpec = Union[None, str, os.PathLike, Sequence[Union[str, os.PathLike]], Any]


def resolve_sources(source: SourceSpec) -> list[Source]:
    """Turn ``prepare_data``'s ``source`` into an ordered list of :class:`Source`.

    ``None`` -> the bundled corpus; a path (file or folder) or a list of paths; a
    ``datasets.Dataset`` / ``DatasetDict`` object. Folders are walked recursively in sorted
    order; a list keeps the order given.
    """
    if source is None:
        return [bundled_source()]
    if type(source).__name__ in ("Dataset", "DatasetDict"):
        fp = getattr(source, "_fingerprint", None)
        if fp is None and _is_dataset_dict(source):
            fp = {k: getattr(v, "_fingerprint", None) for k, v in source.items()}
        if fp is None or (isinstance(fp, dict) and None in fp.values()):
            raise DataError("a datasets object without a fingerprint cannot be cached; save it with save_to_disk "
                            "and pass the folder")
        return [Source(kind="hf", dataset=source, fingerprint={"kind": "hf-object", "fingerprint": fp})]
    items = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    if not items:
        raise DataError("no data source given (an empty list)")
    out: list[Source] = []
    for item in items:
        if isinstance(item, str) and looks_like_text(item):
            raise DataError("prepare_data takes paths, not texts; write the text to a file first")
        path = Path(item).expanduser()
        if path.is_dir():
            out.extend(_folder_sources(path))
        elif path.is_file():
            out.append(_file_source(path, explicit=True))
        else:
            raise FileNotFoundError(f"data source {str(item)!r}: no such file or folder")
    return out


# ---------------------------------------------------------------------------------------------
# reading


def _open_binary(path: Path):
    _, comp = _base_suffix(path)
    if comp == ".gz":
        return gzip.open(path, "rb")
    if comp == ".xz":
        return lzma.open(path, "rb")
    return open(path, "rb")


def _decode(data: bytes, where: str, base_offset: int = 0) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{where}: not valid UTF-8 at byte offset {base_offset + e.start} "
                        f"(byte 0x{data[e.start]:02x}); convert the file to UTF-8") from None


# what reading a (compressed) file can raise: a damaged gzip stream is a zlib.error, which OSError does not cover
READ_ERRORS = (OSError, EOFError, lzma.LZMAError, zlib.error)
_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON's \ud800 escapes decode to these, which no UTF-8 holds


def read_text_file(path: Path) -> str:
    """The whole file as one document. Empty (or whitespace-only) and non-UTF-8 files raise."""
    try:
        with _open_binary(path) as f:
            data = f.read()
    except READ_ERRORS as e:
        raise DataError(f"{path}: cannot be read: {e}") from e
    bom = 3 if data.startswith(b"\xef\xbb\xbf") else 0  # a UTF-8 byte-order mark is not text
    text = _decode(data[bom:], str(path), bom)  # offsets in the file, the mark counted
    if not text.strip():
        raise DataError(f"{path}: the file is empty" + (" (whitespace only)" if data else ""))
    return text


def iter_jsonl(path: Path, text_field: str) -> Iterator[tuple[int, str]]:
    """(line number, text) for each record. Blank lines are allowed (they are not records)."""
    n = 0
    offset = 0
    try:
        with _open_binary(path) as f:
            for lineno, raw in enumerate(f, start=1):
                line = _decode(raw, f"{path} line {lineno}", offset)
                offset += len(raw)
                if lineno == 1 and line.startswith("\ufeff"):
                    line = line[1:]
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path} line {lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
                if not isinstance(record, dict) or text_field not in record:
                    what = f"keys: {', '.join(sorted(record))[:200]}" if isinstance(record, dict) else \
                        f"a JSON {type(record).__name__}, not an object"
                    raise DataError(f"{path} line {lineno}: no text field {text_field!r} ({what}); choose the "
                                    "field with text_field= (difftx train: --set text_field=NAME; difftx tokenizer "
                                    "train: --text-field NAME; difftx compare reads the field 'text')")
                text = record[text_field]
                if not isinstance(text, str):
                    raise DataError(f"{path} line {lineno}: field {text_field!r} is a {type(text).__name__}, "
                                    f"not a string")
                lone = _SURROGATE.search(text)
                if lone is not None:
                    raise DataError(f"{path} line {lineno}: field {text_field!r} holds a lone surrogate "
                                    f"(\\u{ord(lone.group()):04x} at character {lone.start()}), which is not text")
                n += 1
                yield lineno, text
    except READ_ERRORS as e:
        raise DataError(f"{path}: cannot be read: {e}") from e
    if n == 0:
        raise DataError(f"{path}: the file is empty (no JSONL records)")


def _load_hf(src: Source):
    try:
        import datasets
    except ImportError as e:
        raise ImportError(f"reading {src.path or 'a datasets object'} needs the optional `datasets` package "
                          f"(pip install 'difftx[hf]')") from e
    if src.dataset is not None:
        return src.dataset
    assert src.path is not None
    if src.path.is_dir():
        return datasets.load_from_disk(str(src.path))
    base, _ = _base_suffix(src.path)
    return datasets.load_dataset(HF_FILE_SUFFIXES[base], data_files=str(src.path), split="train")


HF_VAL_SPLITS = ("validation", "val", "test")


def _iter_hf(src: Source, text_field: str) -> Iterator[Document]:
    ds = _load_hf(src)
    where = str(src.path) if src.path is not None else "datasets object"
    if _is_dataset_dict(ds):
        if "train" not in ds:
            raise DataError(f"{where}: a DatasetDict needs a 'train' split (has {', '.join(ds)})")
        parts = [("train", "train", ds["train"])]
        val_name = next((n for n in HF_VAL_SPLITS if n in ds), None)
        if val_name is not None:
            parts.append((val_name, "val", ds[val_name]))
    else:
        parts = [(None, None, ds)]
    for name, split, part in parts:
        if text_field not in part.column_names:
            raise DataError(f"{where}{'[' + name + ']' if name else ''}: no column {text_field!r} "
                            f"(columns: {', '.join(part.column_names)})")
        for i, text in enumerate(part[text_field]):
            if not isinstance(text, str):
                raise DataError(f"{where} row {i}: column {text_field!r} holds a {type(text).__name__}, not a string")
            yield Document(text, f"{where}{'[' + name + ']' if name else ''} row {i}", split)


def _iter_bundled(path: Path) -> Iterator[Document]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            r = json.loads(line)
            yield Document(r["text"], f"{path.name}:{lineno} ({r['id']})", r["split"])


def iter_documents(sources: Sequence[Source], *, text_field: str = "text") -> Iterator[Document]:
    """Every document of ``sources`` in order (``Document.split`` is set where the source fixes it)."""
    for src in sources:
        if src.kind == "text":
            assert src.path is not None
            yield Document(read_text_file(src.path), str(src.path))
        elif src.kind == "jsonl":
            assert src.path is not None
            for lineno, text in iter_jsonl(src.path, text_field):
                yield Document(text, f"{src.path}:{lineno}")
        elif src.kind == "bundled":
            assert src.path is not None
            yield from _iter_bundled(src.path)
        elif src.kind == "hf":
            yield from _iter_hf(src, text_field)
        else:  # pragma: no cover - Source is built only by resolve_sources
            raise ValueError(f"unknown source kind {src.kind!r}")


def bundled_manifest() -> list[dict]:
    """id, title, source_url, split and character count of each bundled document, in order."""
    out = []
    with gzip.open(BUNDLED_CORPUS, "rt", encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            out.append({k: r[k] for k in ("id", "title", "source_url", "split")} | {"chars": len(r["text"])})
    return out


def count_documents(sources: Sequence[Source], text_field: str = "text") -> int:
    """Number of documents without tokenizing (JSONL is scanned for non-blank lines)."""
    n = 0
    for src in sources:
        if src.kind == "text":
            n += 1
        elif src.kind in ("jsonl", "bundled"):
            assert src.path is not None
            try:
                with _open_binary(src.path) as f:
                    n += sum(1 for raw in f if raw.strip())
            except READ_ERRORS as e:
                raise DataError(f"{src.path}: cannot be read: {e}") from e
        else:
            ds = _load_hf(src)
            n += sum(len(part) for part in ds.values()) if _is_dataset_dict(ds) else len(ds)
    return n
