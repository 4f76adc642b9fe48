"""What ``auto`` (and ``sdpa``'s choice of form) runs on a CUDA card: a table of measured choices.

The table is a JSON file, by default ``gpu_choices.json`` beside this module (shipped with the package; the
environment variable ``DIFFTX_GPU_CHOICES`` names another). It holds a list of entries under the key
``"choices"`` (a bare list is read too), each one measurement of the DIFF attention core on one card::

    {"card": "NVIDIA H200", "dtype": "bfloat16", "d": 128, "T": 4096, "mode": "train",
     "backend": "sdpa_pad", "ratio": 3.50, "candidates": {"sdpa_pad": 3.50, "triton": 6.95},
     "source": "docs/results.md 2026-11-28"}

``mode`` is ``"train"`` (forward plus backward) or ``"infer"`` (forward only); ``ratio`` is the backend's time
over the fastest baseline kernel's; ``candidates`` every measured backend's ratio. The GPU suite writes exactly
these entries under ``"choices"`` of its output; :func:`merge` folds them in.

:func:`choose` picks a backend for a call: entries of the same card model first (``H100``, ``H200``, ``A100``:
the first token of the name with a digit), else any card; then the same dtype if any, the nearest ``d``, the
nearest ``T`` on a log scale. Of the best such entry, its ``backend`` and then its other candidates by ratio,
the first that is registered and can take the call wins; where none can, the next entry is asked; where
nothing is eligible, ``sdpa_pad``.

Command line::

    python -m difftx.attention.gpu_table show [--table PATH]
    python -m difftx.attention.gpu_table merge SUITE.json [--table PATH]
    python -m difftx.attention.gpu_table choose --card "NVIDIA H100 80GB HBM3" --dtype bfloat16 --d 128 --T 4096 --train
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence, Union

import torch
from torch import Tensor

from ..ops import records_grad

TABLE = Path(__file__).with_name("gpu_choices.json")
ENV = "DIFFTX_GPU_CHOICES"
MODES = ("train", "infer")
FALLBACK = "sdpa_pad"  # what runs where nothing measured is eligible
_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
           "fp64": "float64", "double": "float64"}


@dataclass
class Choice:
    """One measured entry of the table (see the module doc)."""

    card: str
    dtype: str
    d: int
    T: int
    mode: str
    backend: str
    ratio: Optional[float] = None
    candidates: dict = field(default_factory=dict)
    source: str = ""

    def ranked(self) -> list[str]:
        """Its backend, then the other candidates from the lowest ratio up."""
        rest = sorted((n for n in self.candidates if n != self.backend), key=lambda n: self.candidates[n])
        return [self.backend, *rest]

    def key(self) -> tuple:
        """What a merge replaces an entry by: the same card (its full name), dtype, d, T and mode."""
        return self.card.strip().lower(), self.dtype, self.d, self.T, self.mode


def dtype_name(dtype: Union[str, torch.dtype]) -> str:
    """``torch.bfloat16`` / ``"bf16"`` / ``"torch.bfloat16"`` -> ``"bfloat16"``."""
    name = str(dtype).removeprefix("torch.").strip().lower()
    return _DTYPES.get(name, name)


def model_token(card: str) -> str:
    """The card's model, upper case: the first token of its name with a digit that is not a memory size or
    type (``"NVIDIA H100 80GB HBM3"`` -> ``"H100"``, ``"NVIDIA A100-SXM4-80GB"`` -> ``"A100"``); the whole
    name where there is none."""
    for tok in re.split(r"[^A-Za-z0-9]+", card):
        if re.search(r"\d", tok) and not re.fullmatch(r"\d+GB|HBM\d*E?|SXM\d*|PCIE\d*|GDDR\d*X?", tok, re.I):
            return tok.upper()
    return card.strip().upper()


def _entry(raw, where: str, i: int) -> Choice:
    def bad(msg: str) -> ValueError:
        return ValueError(f"{where}: choices[{i}]: {msg}")

    if not isinstance(raw, dict):
        raise bad(f"expected an object, got {type(raw).__name__}")
    missing = [key for key in ("card", "dtype", "d", "T", "mode", "backend") if key not in raw]
    if missing:
        raise bad(f"missing {missing}")
    for key in ("card", "dtype", "backend"):
        if not isinstance(raw[key], str) or not raw[key].strip():
            raise bad(f"{key!r} must be a non-empty string, got {raw[key]!r}")
    for key in ("d", "T"):
        if isinstance(raw[key], bool) or not isinstance(raw[key], int) or raw[key] < 1:
            raise bad(f"{key!r} must be a positive integer, got {raw[key]!r}")
    if raw["mode"] not in MODES:
        raise bad(f"'mode' must be one of {list(MODES)}, got {raw['mode']!r}")
    ratio = raw.get("ratio")
    if ratio is not None and (isinstance(ratio, bool) or not isinstance(ratio, (int, float))):
        raise bad(f"'ratio' must be a number, got {ratio!r}")
    cands = raw.get("candidates") or {}
    if not isinstance(cands, dict) or not all(
            isinstance(n, str) and isinstance(r, (int, float)) and not isinstance(r, bool) for n, r in cands.items()):
        raise bad(f"'candidates' must map backend names to ratios, got {cands!r}")
    source = raw.get("source", "")
    if not isinstance(source, str):
        raise bad(f"'source' must be a string, got {source!r}")
    return Choice(raw["card"].strip(), dtype_name(raw["dtype"]), raw["d"], raw["T"], raw["mode"],
                  raw["backend"].strip(), None if ratio is None else float(ratio),
                  {n: float(r) for n, r in cands.items()}, source)


def parse(obj, where: str) -> list[Choice]:
    """The entries of a decoded table or suite output (``{"choices": [...]}`` or a bare list); ``where`` names
    the file in errors."""
    if isinstance(obj, dict):
        if "choices" not in obj:
            raise ValueError(f"{where}: no 'choices' key (expected {{\"choices\": [entries]}})")
        obj = obj["choices"]
    if not isinstance(obj, list):
        raise ValueError(f"{where}: 'choices' must be a list of entries, got {type(obj).__name__}")
    return [_entry(raw, where, i) for i, raw in enumerate(obj)]


def _read_json(path: Path):
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"{path}: cannot read the table ({e.strerror or e})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: malformed JSON ({e})") from None


def table_path(path: Union[str, Path, None] = None) -> Path:
    """``path``, else ``$DIFFTX_GPU_CHOICES``, else the shipped ``gpu_choices.json``."""
    return Path(path or os.environ.get(ENV) or TABLE)


_loaded: dict[Path, list[Choice]] = {}


def read(path: Union[str, Path, None] = None) -> list[Choice]:
    """The table's entries (read once per path; :func:`reload` forgets them)."""
    p = table_path(path)
    if p not in _loaded:
        _loaded[p] = parse(_read_json(p), str(p))
    return _loaded[p]


def reload() -> None:
    """Forget every table read and every choice made (after the file or ``$DIFFTX_GPU_CHOICES`` changed)."""
    _loaded.clear()
    _memo.clear()


def choose(card: str, dtype: Union[str, torch.dtype], d: int, T: int, training: bool,
           eligible: Optional[Callable[[str], bool]] = None, table: Optional[Sequence[Choice]] = None) -> str:
    """The backend for a call of ``T`` query rows of component width ``d`` in ``dtype`` on the card named
    ``card``, for training (forward and backward) or inference, by the table (see the module doc).
    ``eligible(name)``: whether a backend can take the call (default: every name; the call-time dispatch of
    :mod:`difftx.attention.kernels` passes the registered backends that take the call)."""
    entries = read() if table is None else table
    eligible = eligible or (lambda name: True)
    mode = "train" if training else "infer"
    pool = [e for e in entries if e.mode == mode] or list(entries)
    tok, dt = model_token(card), dtype_name(dtype)
    d, T = max(int(d), 1), max(int(T), 1)

    def rank(item):
        i, e = item
        return model_token(e.card) != tok, e.dtype != dt, abs(math.log(e.d / d)), abs(math.log(e.T / T)), i

    for _, e in sorted(enumerate(pool), key=rank):
        for name in e.ranked():
            if eligible(name):
                return name
    return FALLBACK


# -- call time: the dispatcher of ``auto`` on CUDA and ``sdpa``'s form ---------------------------------------------

_cards: dict = {}
_memo: dict = {}
_MEMO_MAX = 4096
# Under torch.compile a choice is made once, at trace time, and is a constant of the graph (no guards on the memo).
_constant = getattr(torch.compiler, "assume_constant_result", lambda fn: fn)


def card_name(index: int) -> str:
    """The name of CUDA card ``index`` (``torch.cuda.get_device_name``), asked once."""
    if index not in _cards:
        _cards[index] = torch.cuda.get_device_name(index)
    return _cards[index]


@_constant
def _picked(kind: str, index: int, dtype: str, d: int, T: int, train: bool, names: frozenset) -> str:
    """The table's choice among the backends ``names``, memoised (``kind``: ``"sdpa"``, a form of ``sdpa``, or
    ``"auto"``)."""
    key = (kind, index, dtype, d, T, train, names)
    name = _memo.get(key)
    if name is None:
        if len(_memo) >= _MEMO_MAX:
            _memo.clear()
        name = _memo[key] = choose(card_name(index), dtype, d, T, train, eligible=names.__contains__)
    return name


def _call_key(q: Tensor, k: Tensor, v: Tensor, lam: Optional[Tensor]) -> tuple:
    index = q.device.index if q.device.index is not None else torch.cuda.current_device() if q.is_cuda else 0
    train = records_grad(*(t for t in (q, k, v, lam) if t is not None))
    return index, dtype_name(q.dtype), int(q.shape[-1]), int(q.shape[1]), train


def sdpa_form_for(q: Tensor, k: Tensor, v: Tensor, lam: Optional[Tensor], forms: Iterable[str]) -> str:
    """The form of ``sdpa`` (one of ``forms``, :data:`difftx.attention.kernels.SDPA_FORMS`) for this call on its card:
    the table's best ``sdpa_*`` backend for the card, dtype, ``d``, ``T`` and training; ``pad`` where none was
    measured."""
    names = frozenset(f"sdpa_{form}" for form in forms)
    return _picked("sdpa", *_call_key(q, k, v, lam), names).removeprefix("sdpa_")


def backend_for(q: Tensor, k: Tensor, v: Tensor, lam: Tensor, names: Iterable[str]) -> str:
    """The backend ``auto`` runs for this differential-attention call on its CUDA card: the table's choice, among
    ``names`` (the backends that take the call: :func:`difftx.attention.kernels.cuda_choice`), for the card, dtype,
    ``d``, ``T`` and training."""
    return _picked("auto", *_call_key(q, k, v, lam), frozenset(names))


# -- merging a suite run, and the command line ---------------------------------------------------------------------


def write(entries: Sequence[Choice], path: Union[str, Path, None] = None, about: Optional[str] = None) -> Path:
    """Write ``entries`` as the table at ``path`` (one entry a line, sorted by card, dtype, mode, d, T)."""
    p = table_path(path)
    rows = sorted(entries, key=lambda e: (e.card, e.dtype, e.mode, e.d, e.T))
    lines = [json.dumps(asdict(e)) for e in rows]
    head = "" if about is None else f' "about": {json.dumps(about)},\n'
    p.write_text("{\n" + head + ' "choices": [\n  ' + ",\n  ".join(lines) + "\n ]\n}\n")
    reload()
    return p


def merge(suite: Union[str, Path], table: Union[str, Path, None] = None) -> tuple[int, int]:
    """Fold the ``"choices"`` of a GPU suite's JSON output into the table: an entry of the same card, dtype,
    d, T and mode is replaced, others are added. Returns ``(added, replaced)``."""
    suite = Path(suite)
    new = parse(_read_json(suite), str(suite))
    p = table_path(table)
    about = None
    old: list[Choice] = []
    if p.exists():
        raw = _read_json(p)
        old = parse(raw, str(p))
        about = raw.get("about") if isinstance(raw, dict) else None
    keys = {e.key() for e in new}
    replaced = sum(e.key() in keys for e in old)
    merged = {e.key(): e for e in old}
    merged.update((e.key(), e) for e in new)
    write(list(merged.values()), p, about)
    return len(merged) - len(old), replaced


def format_table(entries: Sequence[Choice]) -> str:
    lines = ["| card | dtype | mode | d | T | backend | ratio | candidates | source |",
             "|---|---|---|---|---|---|---|---|---|"]
    for e in sorted(entries, key=lambda e: (e.card, e.dtype, e.mode, e.d, e.T)):
        cands = ", ".join(f"{n} {r:.2f}" for n, r in sorted(e.candidates.items(), key=lambda x: x[1]))
        ratio = "" if e.ratio is None else f"{e.ratio:.2f}"
        lines.append(f"| {e.card} | {e.dtype} | {e.mode} | {e.d} | {e.T} | {e.backend} | {ratio} | {cands} | "
                     f"{e.source} |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m difftx.attention.gpu_table",
                                     description="The measured table that 'auto' and 'sdpa' consult on CUDA.")
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser("show", help="print the table")
    show.add_argument("--table", default=None, help=f"the table (default ${ENV} or the shipped {TABLE.name})")
    mg = sub.add_parser("merge", help="fold a GPU suite run's 'choices' into the table")
    mg.add_argument("suite", help="the suite's JSON output")
    mg.add_argument("--table", default=None, help=f"the table to update (default ${ENV} or the shipped one)")
    ch = sub.add_parser("choose", help="the backend the table picks for one call")
    ch.add_argument("--table", default=None)
    ch.add_argument("--card", required=True, help="a CUDA card's name, e.g. 'NVIDIA H100 80GB HBM3'")
    ch.add_argument("--dtype", default="bfloat16")
    ch.add_argument("--d", type=int, required=True, help="component width (q/k head width)")
    ch.add_argument("--T", type=int, required=True, help="query rows of the call")
    ch.add_argument("--train", action="store_true", help="forward and backward (default: inference)")
    args = parser.parse_args(argv)
    try:
        if args.command == "show":
            print(f"{table_path(args.table)}:")
            print(format_table(read(args.table)))
        elif args.command == "merge":
            added, replaced = merge(args.suite, args.table)
            print(f"{table_path(args.table)}: {added} entries added, {replaced} replaced from {args.suite}")
        else:
            print(choose(args.card, args.dtype, args.d, args.T, args.train, table=read(args.table)))
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
