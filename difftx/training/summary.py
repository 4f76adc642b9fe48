"""What a training run did, read back from its folder: the summary behind ``difftx train``'s
closing ``done:`` line and ``difftx runs`` (runs side by side, and their curves).

Everything comes from the files a run writes (``train_config.json``, ``metrics.jsonl``, the
latest checkpoint's ``config.json`` and ``trainer_state.json``); nothing is recomputed, so a
summary is cheap and works on a finished, interrupted or still-running run.

The table is a list of :class:`Column`: a header and a function of a :class:`RunSummary`. Other
measurements (a held-out NLL with its interval, say) join it by passing more columns to
:func:`format_table`, or by storing values in ``RunSummary.extra`` and adding a column that
reads them.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from ..checkpoint import CONFIG_NAME, CheckpointError, load_config
from ..io import atomic_write, read_record
from ..model import Transformer
from . import checkpointing as ckpt
from .config import TrainConfig
from .metrics import METRICS_NAME, read_metrics  # METRICS_NAME: where compare and the CLI import it from

PathLike = Union[str, os.PathLike]


@dataclass
class RunSummary:
    """One run folder, summarised. Losses are ``(step, loss)`` pairs in nats per token."""

    path: Path
    attention: Optional[str] = None  # diff | diff_v2 | standard
    params: Optional[int] = None
    steps_done: int = 0
    steps_total: Optional[int] = None
    tokens_seen: int = 0
    train_time_s: Optional[float] = None  # time in training steps over the whole run (resumes included)
    tokens_per_s: Optional[float] = None  # tokens_seen / train_time_s (else the mean of the logged rates)
    final_train: Optional[tuple[int, float]] = None
    best_val: Optional[tuple[int, float]] = None
    final_val: Optional[tuple[int, float]] = None
    val_tokens: Optional[int] = None  # tokens scored by one validation pass
    val_split_tokens: Optional[int] = None  # tokens of the held-out split
    data_source: Optional[str] = None  # None: the bundled corpus
    tokenizer: Optional[str] = None
    saved_paths: dict = field(default_factory=dict)  # train_config.json's: what identifies the data and tokenizer
    checkpoint: Optional[Path] = None
    train_curve: list[tuple[int, float]] = field(default_factory=list)
    val_curve: list[tuple[int, float]] = field(default_factory=list)
    final_lambda: Optional[list[float]] = None  # the learned λ per layer at the last log record (DIFF kinds)
    extra: dict[str, Any] = field(default_factory=dict)  # values added by other measurements

    @property
    def label(self) -> str:
        return str(self.path)


CONFIG_FIELDS = {"steps": "posint", "data_source": "str?", "tokenizer": "str?", "saved_paths": "dict?"}


def _read_config(path: Path) -> dict:
    """A run's ``train_config.json`` ({} when there is none), its fields checked (a ``ValueError``
    naming the file and the field)."""
    return read_record(path, "the training config of a difftx run", CONFIG_FIELDS) if path.is_file() else {}


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def summarize_run(run_dir: PathLike) -> RunSummary:
    """Summarise the run in ``run_dir`` (a ``difftx train --out`` folder). ``ValueError`` naming
    the folder when it is not one."""
    path = Path(run_dir)
    if not path.exists():
        raise ValueError(f"{path}: no such run folder")
    if not path.is_dir():
        raise ValueError(f"{path}: not a run folder (a file); give the folder a `difftx train --out` wrote")
    cfg_path, metrics_path = path / ckpt.TRAIN_CONFIG_NAME, path / METRICS_NAME
    if not (cfg_path.is_file() or metrics_path.is_file() or ckpt.checkpoints_dir(path).is_dir()):
        hint = ""
        if (path / CONFIG_NAME).is_file():
            try:  # a transformers folder says so (what reads it), a difftx checkpoint names its run
                load_config(path)
                hint = " (it is a checkpoint folder: give the run folder that holds its checkpoints/)"
            except CheckpointError as e:
                if "transformers folder" in str(e) or "transformers-style config" in str(e):
                    raise ValueError(str(e)) from None
        raise ValueError(f"{path}: not a difftx run folder: no {ckpt.TRAIN_CONFIG_NAME}, {METRICS_NAME} or "
                         f"{ckpt.CHECKPOINTS}/{hint}; give a folder written by `difftx train --out`")
    s = RunSummary(path=path)
    train_cfg = _read_config(cfg_path)
    s.steps_total = train_cfg.get("steps")
    s.data_source, s.tokenizer = train_cfg.get("data_source"), train_cfg.get("tokenizer")
    s.saved_paths = train_cfg.get("saved_paths") or {}

    try:
        latest = ckpt.latest_checkpoint(path)
    except CheckpointError:
        latest = None
    state: dict = {}
    if latest is not None:
        s.checkpoint = latest
        state = ckpt.read_trainer_state(latest)
        train_cfg = train_cfg or _read_config(latest / ckpt.TRAIN_CONFIG_NAME)
        s.steps_total = s.steps_total or train_cfg.get("steps")
        try:
            model_cfg = load_config(latest)
        except CheckpointError:
            model_cfg = None
        if model_cfg is not None:
            s.attention, s.params = model_cfg.attention, _count_params(model_cfg)
        if (latest / ckpt.TOKENIZER_DIR).is_dir() and s.tokenizer is None:
            s.tokenizer = state.get("tokenizer")
    model_dir = path.parent / "model"  # a compare model's run (seedS/ARM/train): its model beside it, no checkpoint
    if s.params is None and latest is None and path.name == "train" and (model_dir / CONFIG_NAME).is_file():
        try:
            model_cfg = load_config(model_dir)
            s.attention, s.params = model_cfg.attention, _count_params(model_cfg)
        except CheckpointError:
            pass
    if s.attention is None and train_cfg:
        try:
            s.attention = TrainConfig.from_dict(train_cfg).model_config().attention
        except (TypeError, ValueError):
            pass

    records = read_metrics(metrics_path)
    s.train_curve = [(r["step"], float(r["loss"])) for r in records if _finite(r.get("loss"))]
    s.val_curve = [(r["step"], float(r["val_loss"])) for r in records if _finite(r.get("val_loss"))]
    if s.train_curve:
        s.final_train = s.train_curve[-1]
    lambdas = [r["lambda"] for r in records if isinstance(r.get("lambda"), list) and r["lambda"]
               and all(_finite(x) for x in r["lambda"])]
    s.final_lambda = [float(x) for x in lambdas[-1]] if lambdas else None
    if s.val_curve:
        s.final_val = s.val_curve[-1]
        s.best_val = min(s.val_curve, key=lambda p: (p[1], p[0]))
    val_sizes = [r["val_tokens"] for r in records if isinstance(r.get("val_tokens"), int)]
    s.val_tokens = val_sizes[-1] if val_sizes else None
    s.val_split_tokens = state.get("val_split_tokens")

    s.steps_done = int(state.get("step", 0)) or (s.train_curve[-1][0] if s.train_curve else 0)
    s.tokens_seen = int(state.get("tokens_seen", 0)) or max((int(r["tokens"]) for r in records
                                                              if isinstance(r.get("tokens"), int)), default=0)
    t = state.get("train_time_s")
    if not (_finite(t) and t > 0):  # no checkpoint (a compare model's run): the time the log records last
        t = next((r["time_s"] for r in reversed(records) if _finite(r.get("time_s"))), None)
    if _finite(t) and t > 0:  # tokens seen / time in training steps, as the table's footnote says
        s.train_time_s = float(t)
        s.tokens_per_s = s.tokens_seen / s.train_time_s
    else:  # a checkpoint from before train_time_s was recorded: the mean of the logged rates
        rates = [float(r["tokens_per_s"]) for r in records if _finite(r.get("tokens_per_s"))]
        s.tokens_per_s = sum(rates) / len(rates) if rates else None
    return s


def _count_params(model_cfg) -> int:
    with torch.device("meta"):
        return Transformer(model_cfg).num_parameters()


# -- the table ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Column:
    header: str
    value: Callable[[RunSummary], str]
    align: str = ">"  # ">" right, "<" left


def _loss_at(pair: Optional[tuple[int, float]]) -> str:
    return "n/a" if pair is None else f"{pair[1]:.4f} @{pair[0]}"


def _loss_last(s: "RunSummary", pair: Optional[tuple[int, float]]) -> str:
    """The loss, with its step only when that is not the run's last (the usual case needs no step)."""
    if pair is None:
        return "n/a"
    return f"{pair[1]:.4f}" if pair[0] == s.steps_done else f"{pair[1]:.4f} @{pair[0]}"


def _int(v: Optional[int]) -> str:
    return "n/a" if v is None else f"{v:,}"


def _short(v: Optional[int]) -> str:
    """A count in 3 significant digits with K / M / B / T (exact below 10,000): 30,720 -> 30.7K."""
    if v is None:
        return "n/a"
    if v < 10_000:
        return f"{v:,}"
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if v >= scale:
            x = v / scale
            return f"{x:.3g}{unit}" if x < 1000 else f"{x:,.0f}{unit}"
    return f"{v:,}"


def lambda_text(values: Optional[Sequence[float]], most: int = 8) -> str:
    """``0.21, 0.37``: λ per layer, the first ``most`` layers and "..." after them; "n/a" without any."""
    if not values:
        return "n/a"
    return ", ".join(f"{x:.2f}" for x in values[:most]) + (", ..." if len(values) > most else "")


# narrow enough that a row of two typical runs fits in about 100 characters
DEFAULT_COLUMNS: tuple[Column, ...] = (
    Column("run", lambda s: s.label, "<"),
    Column("attention", lambda s: s.attention or "n/a", "<"),
    Column("params", lambda s: _int(s.params)),
    Column("steps", lambda s: f"{s.steps_done}/{s.steps_total if s.steps_total is not None else '?'}"),
    Column("tokens", lambda s: _short(s.tokens_seen)),
    Column("tok/s", lambda s: "n/a" if s.tokens_per_s is None else f"{s.tokens_per_s:,.0f}"),
    Column("train loss", lambda s: _loss_last(s, s.final_train)),
    Column("val loss", lambda s: _loss_last(s, s.final_val)),
    Column("best val @step", lambda s: _loss_at(s.best_val)),
    Column("val tok", lambda s: _int(s.val_tokens)),
)


def format_table(summaries: Sequence[RunSummary], columns: Sequence[Column] = DEFAULT_COLUMNS,
                 extra: Sequence[Column] = ()) -> str:
    """The runs as a plain-text table, one row per run; ``extra`` columns are appended."""
    cols = [*columns, *extra]
    rows = [[c.header for c in cols]] + [[c.value(s) for c in cols] for s in summaries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]

    def line(cells):
        return "  ".join(f"{cell:{c.align}{w}}" for cell, c, w in zip(cells, cols, widths, strict=True)).rstrip()

    return "\n".join([line(rows[0]), "  ".join("-" * w for w in widths)] + [line(r) for r in rows[1:]])


def comparability_notes(summaries: Sequence[RunSummary]) -> list[str]:
    """Sentences naming what differs between the runs' data (source, tokenizer, validation size):
    their losses are then not on the same footing. Data and tokenizer are compared by content (the
    SHA-256 / name each run recorded), so runs moved or copied with their data stay comparable."""
    def content(s: RunSummary, name: str, path: Optional[str]):
        record = s.saved_paths.get(name) or {}
        return record.get("sha256") or record.get("name") or (os.path.normpath(path) if path else None)

    notes = []
    for what, get, key in (
            ("data", lambda s: os.path.normpath(s.data_source) if s.data_source else "the bundled corpus",
             lambda s: content(s, "data_source", s.data_source)),
            ("tokenizer", lambda s: os.path.normpath(s.tokenizer) if s.tokenizer else "byte",
             lambda s: content(s, "tokenizer", s.tokenizer) or "byte"),
            ("validation tokens per pass", lambda s: s.val_tokens, lambda s: s.val_tokens)):
        values = {s.label: get(s) for s in summaries}
        if len({str(key(s)) for s in summaries}) > 1:
            listed = ", ".join(f"{k}: {v}" for k, v in values.items())
            notes.append(f"the runs differ in {what} ({listed}); their losses are not directly comparable")
    return notes


LEGEND = ("losses: mean next-token NLL in nats on the run's own data, at the last step (else @ the step);\n"
          "validation on its held-out split, `val tok` tokens per pass; tokens: tokens seen;\n"
          "tok/s: tokens seen / time in training steps over the whole run")


# -- the curves -----------------------------------------------------------------------------------
def plot_runs(summaries: Sequence[RunSummary], path: PathLike, *, title: Optional[str] = None) -> Path:
    """Training and validation loss against the step, one line per run, as a PNG (or any format
    matplotlib infers from the suffix). Needs matplotlib (``pip install 'difftx[eval]'``)."""
    try:
        import matplotlib  # optional (difftx[eval]): only --plot needs it

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # optional, as above
    except ImportError as e:
        raise ModuleNotFoundError(f"plotting needs matplotlib, which is not installed ({e}); "
                                  f"pip install matplotlib (or difftx[eval])", name="matplotlib") from None
    path = Path(path)
    fig, (ax_t, ax_v) = plt.subplots(1, 2, figsize=(11, 4))
    try:
        for i, s in enumerate(summaries):
            label = f"{s.label} ({s.attention})" if s.attention else s.label
            color = f"C{i % 10}"
            if s.train_curve:
                ax_t.plot(*zip(*s.train_curve), color=color, label=label)
            if s.val_curve:
                ax_v.plot(*zip(*s.val_curve), color=color, marker="o", markersize=3, label=label)
        for ax, name in ((ax_t, "training loss"), (ax_v, "validation loss")):
            ax.set_xlabel("step")
            ax.set_ylabel(f"{name} (nats/token)")
            ax.set_title(name)
            ax.grid(alpha=0.3)
            if ax.lines:
                ax.legend(fontsize=8)
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        atomic_write(path, lambda p: fig.savefig(p, dpi=120, format=path.suffix[1:] or "png"))  # a link is replaced
    finally:
        plt.close(fig)
    return path
