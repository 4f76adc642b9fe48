"""A local lm-evaluation-harness task built from the bundled Shakespeare corpus (no hub access).

``write_next_line_task(out_dir)`` writes ``next_line.jsonl`` (one multiple-choice item per
line: a line of verse or prose, and the line that follows it in the play among distractor
lines from elsewhere in the same work) and ``difftx_next_line.yaml``, a task definition that
reads that file with the ``datasets`` ``json`` builder. Then, offline::

    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 lm_eval --model hf \\
        --model_args pretrained=EXPORTED_DIR,dtype=float32 --device cpu \\
        --include_path OUT_DIR --tasks difftx_next_line

Items come from the corpus's held-out (``val``) works by default, so a model trained on the
``train`` split has not seen them. Run as ``python -m difftx.interop.lm_eval_task OUT_DIR``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
from importlib import resources
from pathlib import Path
from typing import Optional, Sequence, Union

from ..io import atomic_write

TASK_NAME = "difftx_next_line"
DATA_NAME = "next_line.jsonl"
YAML_NAME = f"{TASK_NAME}.yaml"


def corpus_path() -> Path:
    """The bundled corpus file (``difftx/data/corpus/shakespeare.jsonl.gz``)."""
    path = Path(str(resources.files("difftx.data") / "corpus" / "shakespeare.jsonl.gz"))
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the bundled corpus is missing (is difftx installed with its data?)")
    return path


def _lines(text: str, min_chars: int, max_chars: int) -> list[str]:
    out = []
    for raw in text.splitlines():
        line = " ".join(raw.split())
        # skip speaker names, stage directions in capitals and very short or long lines
        if min_chars <= len(line) <= max_chars and not line.isupper():
            out.append(line)
    return out


def next_line_items(n_items: int = 100, n_choices: int = 4, split: str = "val", seed: int = 0,
                    min_chars: int = 20, max_chars: int = 80) -> list[dict]:
    """``n_items`` multiple-choice items ``{"context", "choices", "label"}`` from the corpus.

    The context is a line, the correct choice is the line after it (consecutive non-empty
    lines of the same work); the others are random lines of that work.
    """
    if n_items <= 0 or n_choices < 2:
        raise ValueError(f"n_items must be positive and n_choices >= 2, got {n_items}, {n_choices}")
    with gzip.open(corpus_path(), "rt", encoding="utf-8") as f:
        works = [json.loads(line) for line in f]
    works = [w for w in works if w.get("split") == split]
    if not works:
        raise ValueError(f"split: no works in the bundled corpus have split={split!r}")
    rng = random.Random(seed)
    items: list[dict] = []
    pools = [_lines(w["text"], min_chars, max_chars) for w in works]
    pools = [p for p in pools if len(p) > n_choices + 1]
    while len(items) < n_items:
        pool = pools[rng.randrange(len(pools))]
        i = rng.randrange(len(pool) - 1)
        answer = pool[i + 1]
        wrong: list[str] = []
        while len(wrong) < n_choices - 1:
            cand = pool[rng.randrange(len(pool))]
            if cand not in (answer, pool[i]) and cand not in wrong:
                wrong.append(cand)
        label = rng.randrange(n_choices)
        choices = wrong[:label] + [answer] + wrong[label:]
        items.append({"context": pool[i], "choices": choices, "label": label})
    return items


def task_yaml(data_file: Union[str, os.PathLike], task: str = TASK_NAME) -> str:
    """The lm-evaluation-harness task definition for a JSONL of :func:`next_line_items`."""
    data = json.dumps(str(Path(data_file).resolve()))
    return "\n".join([
        f"task: {task}",
        "dataset_path: json",
        "dataset_kwargs:",
        "  data_files:",
        f"    test: {data}",
        "test_split: test",
        "output_type: multiple_choice",
        'doc_to_text: "{{context}}\\n"',
        'target_delimiter: ""',
        'doc_to_choice: "{{choices}}"',
        'doc_to_target: "{{label}}"',
        "metric_list:",
        "  - metric: acc",
        "    aggregation: mean",
        "    higher_is_better: true",
        "  - metric: acc_norm",
        "    aggregation: mean",
        "    higher_is_better: true",
        "metadata:",
        "  version: 1.0",
        "",
    ])


def write_next_line_task(out_dir: Union[str, os.PathLike], n_items: int = 100, n_choices: int = 4,
                         split: str = "val", seed: int = 0) -> Path:
    """Write ``next_line.jsonl`` and ``difftx_next_line.yaml`` into ``out_dir``; return the YAML path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    items = next_line_items(n_items, n_choices, split, seed)
    text = "".join(json.dumps(it) + "\n" for it in items)
    atomic_write(out / DATA_NAME, lambda p: Path(p).write_text(text))
    yaml_text = task_yaml(out / DATA_NAME)
    atomic_write(out / YAML_NAME, lambda p: Path(p).write_text(yaml_text))
    return out / YAML_NAME


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m difftx.interop.lm_eval_task",
                                description="Write a local lm-evaluation-harness task from the bundled corpus.")
    p.add_argument("out_dir")
    p.add_argument("--items", type=int, default=100)
    p.add_argument("--choices", type=int, default=4)
    p.add_argument("--split", default="val")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    path = write_next_line_task(a.out_dir, a.items, a.choices, a.split, a.seed)
    print(f"wrote {path} and {path.parent / DATA_NAME}; run lm_eval with --include_path {path.parent} "
          f"--tasks {TASK_NAME}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
