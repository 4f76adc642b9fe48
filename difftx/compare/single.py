"""Evaluating one trained checkpoint (``difftx eval <task> CHECKPOINT``).

Two kinds of checkpoint are understood:

- a model trained by ``difftx compare`` (its folder holds ``compare_task.json``): the synthetic
  needle task with its own vocabulary, and held-out Shakespeare bytes shifted past it;
- a text model trained by ``difftx train`` (its ``tokenizer/`` folder, or ``tokenizer=``): LM
  metrics on held-out text (the bundled corpus unless ``data=`` names another source) and the
  natural-language (LWM-style) needle form.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from .train import TASK_FILE

TASKS = ("lm", "needle", "outliers", "quant")


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


def evaluate_checkpoint(task: str, path: str | os.PathLike, *, tokenizer: str | None = None,
                        data: str | None = None, seq_len: int | None = None, windows: int = 32,
                        samples_per_cell: int = 20, context_len: int = 256, bits: tuple = (16, 8, 6, 4, 3),
                        progress: bool = True) -> dict:
    """Run one evaluation (``task`` in :data:`TASKS`) on the checkpoint at ``path`` (a checkpoint
    folder or a training run folder, whose latest checkpoint is used) and return its JSON-ready
    result. ``context_len`` is used by the text needle form only."""
    if task not in TASKS:
        raise ValueError(f"task: must be one of {TASKS}, got {task!r}")
    s = _Subject(path, tokenizer, data, seq_len, windows)
    m = s.model
    out: dict = {"task": task, "checkpoint": str(s.folder), "attention": m.config.attention,
                 "parameters": m.num_parameters()}
    with torch.no_grad():
        if task == "lm":
            from ..eval.lm import evaluate_lm, length_extrapolation

            w, bpt = s.windows()
            out["heldout"] = evaluate_lm(m, w, bytes_per_token=bpt, progress=progress).to_dict()
            stream, _ = s.lm_stream()
            ext = length_extrapolation(m, stream, s.seq_len, max_windows=max(1, windows // 4), bytes_per_token=bpt,
                                       progress=progress)
            out["extrapolation"] = {str(f): r.to_dict() for f, r in ext.items()}
        elif task == "needle":
            out["needle"] = _needle(s, samples_per_cell, context_len, None, progress).to_dict()
        elif task == "outliers":
            from ..eval.outliers import activation_outliers

            w, _ = s.windows()
            out.update(activation_outliers(m, w[:, :-1], progress=progress))
        else:
            from ..eval.lm import evaluate_lm
            from ..eval.quant import quantization_sweep

            w, bpt = s.windows()
            out["nll"] = quantization_sweep(lambda b: evaluate_lm(m, w, backend=b).nll, bits=bits)
            if s.task_info is not None:
                out["needle_accuracy_4_2"] = quantization_sweep(
                    lambda b: _needle(s, samples_per_cell, context_len, b, False, grid=((4, 2),),
                                      use_cache=False).accuracy(4, 2), bits=bits)
    return out


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
