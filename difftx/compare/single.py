"""Evaluating one trained checkpoint (``difftx eval <task> CHECKPOINT``).

Two kinds of checkpoint are understood:

- a model trained by ``difftx compare`` (its folder holds ``compare_task.json``): the synthetic
  needle task with its own vocabulary, and held-out Shakespeare bytes shifted past it;
- a text model trained by ``difftx train`` (its ``tokenizer/`` folder, or ``tokenizer=``): LM
  metrics on held-out text (the bundled corpus unless ``data=`` names another source) and the
  natural-language (LWM-style) needle form.

Tasks (:data:`TASKS`), each one small function here calling :mod:`difftx.eval`: ``lm``,
``needle``, ``attention`` (attention to the answer / noise on needle prompts), ``outliers``,
``quant``, ``diagnostics`` (lambda and head redundancy per layer) and ``icl`` (order robustness; only
for a compare model trained on the synthetic ICL task, whose ``compare_task.json`` has
``icl_task``). The probe prompts of ``attention``, ``diagnostics`` and ``icl`` use the seed of
``difftx compare``'s evaluations.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .evaluate import EVAL_SEED
from .train import TASK_FILE

DEFAULT_CELL = (4, 2)  # attention / diagnostics probe cell N/R (clipped to what the model's task has)
PROBE_DEPTH = 0.5  # of the answer needle in the probe prompts
DIAGNOSTICS_BATCH = 4  # sequences per forward for head redundancy (bounds the captured maps' memory)


class _Subject:
    """A loaded checkpoint with what each task needs: LM windows and a needle evaluator."""

    def __init__(self, path: str | os.PathLike, tokenizer: str | None, data: str | None,
                 seq_len: int | None, n_windows: int) -> None:
        from ..checkpoint import load_model
        from ..training.checkpointing import TOKENIZER_DIR, resolve_checkpoint

        self.folder = resolve_checkpoint(path)
        self.model = load_model(self.folder).eval()
        self.task_info: dict | None = None
        self.tokenizer: Any = None
        if (self.folder / TASK_FILE).is_file():
            try:
                self.task_info = json.loads((self.folder / TASK_FILE).read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{self.folder / TASK_FILE}: not valid JSON ({e})") from None
        else:
            from ..data import load_tokenizer

            spec = tokenizer or (self.folder / TOKENIZER_DIR if (self.folder / TOKENIZER_DIR).exists() else "byte")
            self.tokenizer = load_tokenizer(spec)
            if self.tokenizer.vocab_size > self.model.config.vocab_size:
                raise ValueError(f"{self.folder}: tokenizer {spec} has {self.tokenizer.vocab_size} tokens, the model "
                                 f"only {self.model.config.vocab_size}")
        self.data, self.n_windows = data, n_windows
        default_len = self.task_info["lm_seq_len"] if self.task_info else self.model.config.max_seq_len
        self.seq_len = seq_len or default_len

    def needle_task(self):
        from ..eval.needle import NeedleTask

        return NeedleTask(**self.task_info["needle_task"]) if self.task_info else None

    def lm_stream(self) -> tuple[torch.Tensor, float]:
        """Held-out token stream (in the model's ids) and its bytes per token."""
        from ..data import prepare_data
        from ..eval.lm import bytes_per_token

        if self.task_info is not None:
            if not self.task_info.get("lm"):
                raise ValueError(f"{self.folder}: this compare model was trained without LM batches")
            val = prepare_data(None, "byte", progress=False).val
            return torch.from_numpy(val.tokens[:].astype("int64")) + int(self.task_info["lm_offset"]), 1.0
        data = prepare_data(self.data, self.tokenizer, progress=False)
        store = data.val if data.val is not None else data.train
        ids = torch.from_numpy(store.tokens[: self.n_windows * (self.seq_len + 1) * 4].astype("int64"))
        if getattr(self.tokenizer, "name", "") == "byte":
            return ids, 1.0
        text = self.tokenizer.decode(ids.tolist())
        return ids, bytes_per_token(text, ids.numel())

    def windows(self, n: int | None = None) -> tuple[torch.Tensor, float]:
        from ..eval.lm import windows_from_stream

        stream, bpt = self.lm_stream()
        return windows_from_stream(stream, self.seq_len + 1, n or self.n_windows), bpt


@dataclass(frozen=True)
class _Options:
    """The settings of one ``evaluate_checkpoint`` call that the task functions read."""

    windows: int
    samples: int
    context_len: int
    bits: tuple
    cell: tuple[int, int] | None
    episodes: int
    orders: int
    progress: bool


def evaluate_checkpoint(task: str, path: str | os.PathLike, *, tokenizer: str | None = None,
                        data: str | None = None, seq_len: int | None = None, windows: int = 32,
                        samples_per_cell: int = 20, context_len: int = 256, bits: tuple = (16, 8, 6, 4, 3),
                        cell: tuple[int, int] | None = None, episodes: int = 100, orders: int = 5,
                        progress: bool = True) -> dict:
    """Run one evaluation (``task`` in :data:`TASKS`) on the checkpoint at ``path`` (a checkpoint
    folder or a training run folder, whose latest checkpoint is used) and return its JSON-ready
    result. ``context_len`` is used by the text needle form only. ``attention`` and
    ``diagnostics`` probe with ``samples_per_cell`` needle prompts of ``cell`` (N needles, R
    queried keys; default 4/2 or the most the model's task has) at depth 0.5; ``icl`` scores
    ``episodes`` episodes in ``orders`` orders per order kind."""
    if task not in TASKS:
        raise ValueError(f"task: must be one of {TASKS}, got {task!r}")
    s = _Subject(path, tokenizer, data, seq_len, windows)
    m = s.model
    out: dict = {"task": task, "checkpoint": str(s.folder), "attention": m.config.attention,
                 "parameters": m.num_parameters()}
    opts = _Options(windows, samples_per_cell, context_len, tuple(bits), cell, episodes, orders, progress)
    with torch.no_grad():
        out.update(_TASK_FUNCTIONS[task](s, opts))
    return out


def _lm(s: _Subject, o: _Options) -> dict:
    from ..eval.lm import evaluate_lm, length_extrapolation

    w, bpt = s.windows()
    heldout = evaluate_lm(s.model, w, bytes_per_token=bpt, progress=o.progress).to_dict()
    stream, _ = s.lm_stream()
    ext = length_extrapolation(s.model, stream, s.seq_len, max_windows=max(1, o.windows // 4), bytes_per_token=bpt,
                               progress=o.progress)
    return {"heldout": heldout, "extrapolation": {str(f): r.to_dict() for f, r in ext.items()}}


def _needle_task(s: _Subject, o: _Options) -> dict:
    return {"needle": _needle(s, o.samples, o.context_len, None, o.progress).to_dict()}


def _outliers(s: _Subject, o: _Options) -> dict:
    from ..eval.outliers import activation_outliers

    w, _ = s.windows()
    return activation_outliers(s.model, w[:, :-1], progress=o.progress)


def _quant(s: _Subject, o: _Options) -> dict:
    from ..eval.lm import evaluate_lm
    from ..eval.quant import quantization_sweep

    w, bpt = s.windows()
    out = {"nll": quantization_sweep(lambda b: evaluate_lm(s.model, w, backend=b).nll, bits=o.bits)}
    if s.task_info is not None:
        out["needle_accuracy_4_2"] = quantization_sweep(
            lambda b: _needle(s, o.samples, o.context_len, b, False, grid=((4, 2),),
                              use_cache=False).accuracy(4, 2), bits=o.bits)
    return out


def _attention(s: _Subject, o: _Options) -> dict:
    from ..eval.attention_noise import attention_report

    probes, info = _probes(s, o)
    return {"attention_to_answer": {**info, **attention_report(s.model, probes)}}


def _diagnostics(s: _Subject, o: _Options) -> dict:
    from ..eval.diagnostics import lambda_summary, model_head_redundancy

    if s.task_info is not None:
        probes, info = _probes(s, o)
        tokens = torch.tensor([p.prompt for p in probes])  # (samples, context_len)
        source = {"source": "needle prompts", **info}
    else:
        tokens = s.windows()[0][:, :-1]  # (windows, seq_len)
        source = {"source": "held-out text windows", "n_samples": len(tokens), "seq_len": s.seq_len}
    redundancy = model_head_redundancy(s.model, tokens, batch_size=DIAGNOSTICS_BATCH)
    return {**lambda_summary(s.model), "head_redundancy": [None if math.isnan(v) else v for v in redundancy],
            "head_redundancy_on": source}


def _icl(s: _Subject, o: _Options) -> dict:
    from ..eval.icl import ICLTask, evaluate_icl_order

    spec = (s.task_info or {}).get("icl_task")
    if not spec:
        why = f"it is a text model (no {TASK_FILE})" if s.task_info is None else f"its {TASK_FILE} has no icl_task"
        raise ValueError(f"{s.folder}: ICL order robustness needs a model trained on the synthetic ICL task; {why}. "
                         "Train one with `difftx compare` with ICL batches (`--set icl_every=4`)")
    try:
        task = ICLTask(**spec)
    except TypeError as e:
        raise ValueError(f"{s.folder / TASK_FILE}: icl_task: {e}") from None
    if task.vocab_size > s.model.config.vocab_size:
        raise ValueError(f"{s.folder}: the ICL task needs {task.vocab_size} token ids, the model has only "
                         f"{s.model.config.vocab_size}")
    return {"icl": evaluate_icl_order(s.model, task, n_episodes=o.episodes, n_orders=o.orders, seed=EVAL_SEED,
                                      progress=o.progress)}


_TASK_FUNCTIONS: dict[str, Callable[[_Subject, _Options], dict]] = {
    "lm": _lm, "needle": _needle_task, "attention": _attention, "outliers": _outliers, "quant": _quant,
    "diagnostics": _diagnostics, "icl": _icl}
TASKS = tuple(_TASK_FUNCTIONS)  # `difftx eval`'s choices (difftx/cli/eval.py) list the same names


def _cell(s: _Subject, cell: tuple[int, int] | None) -> tuple[int, int]:
    """The probe cell N/R: ``cell``, or 4/2 clipped to what the model's needle task has."""
    from ..eval.needle import CITIES

    task = s.needle_task()
    max_n, max_r = (task.max_needles, task.max_query) if task is not None else (len(CITIES), len(CITIES))
    if cell is None:
        n = min(DEFAULT_CELL[0], max_n)
        return n, min(DEFAULT_CELL[1], max_r, n)
    n, r = cell
    form = "the model's needle task" if task is not None else "the natural-language needle form"
    if n > max_n:
        raise ValueError(f"cell {n}/{r}: {form} has at most {max_n} needles")
    if not 1 <= r <= min(n, max_r):
        raise ValueError(f"cell {n}/{r}: need 1 <= R <= N (and R <= {max_r}, the most keys {form} queries)")
    return n, r


def _probes(s: _Subject, o: _Options) -> tuple[list, dict]:
    """``o.samples`` needle prompts (with a role per position) of the probe cell at depth 0.5 and
    what they are: synthetic ones for a compare model, natural-language ones for a text model."""
    from ..eval.needle import needle_samples, text_needle_probes

    n, r = _cell(s, o.cell)
    task = s.needle_task()
    if task is not None:
        probes = needle_samples(task, n, r, PROBE_DEPTH, o.samples, seed=EVAL_SEED)
        form = "synthetic"
    else:
        tok = s.tokenizer
        probes = text_needle_probes(tok.encode, tok.decode, n, r, PROBE_DEPTH, o.samples, o.context_len,
                                    seed=EVAL_SEED)
        form = "text"
    return probes, {"form": form, "cell": f"{n}/{r}", "depth": PROBE_DEPTH, "n_samples": len(probes)}


def _needle(s: _Subject, samples: int, context_len: int, backend: str | None, progress: bool,
            grid=None, use_cache: bool = True):
    from ..eval.needle import DEFAULT_GRID, evaluate_needles, evaluate_needles_text

    grid = grid or DEFAULT_GRID
    task = s.needle_task()
    if task is not None:
        grid = [(n, r) for n, r in grid if n <= task.max_needles and r <= task.max_query]
        return evaluate_needles(s.model, task, grid=grid, samples_per_cell=samples, backend=backend,
                                use_cache=use_cache, progress=progress)
    tok = s.tokenizer
    return evaluate_needles_text(s.model, tok.encode, tok.decode, context_len=context_len, grid=grid,
                                 samples_per_cell=samples, stop_tokens=[tok.eos_id], backend=backend,
                                 progress=progress)
