"""The evaluations of one trained model, each stored in its own JSON file (resumable).

Every evaluation is a thin call into :mod:`difftx.eval` on inputs that depend only on the preset
(never on the model), so DIFF and its baseline are scored on the very same prompts and windows.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..checkpoint import atomic_write, load_model
from .presets import ComparePreset
from .train import TaskSpace, lm_streams, resolve_device, task_space

EVALUATIONS = ("lm", "needle", "attention", "outliers", "quant", "icl", "diagnostics")
EVAL_SEED = 1234  # prompts and windows of every evaluation (fixed: the same for every model and seed)


def lm_windows(space: TaskSpace, seq_len: int, n: int) -> torch.Tensor:
    """``(n, seq_len + 1)`` evenly spaced windows of the validation bytes, shifted into the model's
    vocabulary."""

    val = lm_streams()[1]
    stride = max(seq_len + 1, (len(val) - 1) // n)
    starts = range(0, len(val) - seq_len - 1, stride)
    w = torch.stack([torch.from_numpy(val[s:s + seq_len + 1].astype("int64")) for s in list(starts)[:n]])
    return w + space.lm_offset  # (n, seq_len + 1)


def _probe_samples(preset: ComparePreset, space: TaskSpace, n: int):
    from ..eval.needle import needle_samples

    N, R = preset.quant_needle_cell
    return needle_samples(space.needle, N, R, 0.5, n, seed=EVAL_SEED)


def eval_lm(model, preset: ComparePreset, space: TaskSpace, progress: bool) -> dict:
    from ..eval.lm import evaluate_lm, length_extrapolation

    if not space.lm:
        return {"skipped": "the preset trains no language-modelling batches (lm_every = 0)"}
    res = evaluate_lm(model, lm_windows(space, preset.lm_seq_len, preset.lm_eval_windows), progress=progress)
    val = torch.from_numpy(lm_streams()[1].astype("int64")) + space.lm_offset
    ext = length_extrapolation(model, val, preset.lm_seq_len, factors=preset.extrapolation_factors,
                               max_windows=preset.extrapolation_windows, progress=progress)
    return {"heldout": res.to_dict(), "extrapolation": {str(f): r.to_dict() for f, r in ext.items()},
            "train_len": preset.lm_seq_len,
            "note": "bits per byte: the byte vocabulary gives one token per UTF-8 byte (bytes_per_token = 1)"}


def eval_needle(model, preset: ComparePreset, space: TaskSpace, progress: bool) -> dict:
    from ..eval.needle import evaluate_needles

    res = evaluate_needles(model, space.needle, grid=preset.grid, depths=preset.depths,
                           samples_per_cell=preset.samples_per_cell, seed=EVAL_SEED, progress=progress)
    out = {"grid": res.to_dict()}
    if preset.heatmap_lengths:
        N, R = preset.quant_needle_cell
        hm = evaluate_needles(model, space.needle, grid=((N, R),), depths=preset.depths,
                              lengths=preset.heatmap_lengths, samples_per_cell=preset.samples_per_cell,
                              seed=EVAL_SEED, progress=progress)
        depths, lengths, acc = hm.heatmap(N, R)
        out["heatmap"] = {"cell": f"{N}/{R}", "depths": depths, "lengths": lengths, "accuracy": acc}
    return out


def eval_attention(model, preset: ComparePreset, space: TaskSpace, progress: bool) -> dict:
    from ..eval.attention_noise import attention_report

    res = attention_report(model, _probe_samples(preset, space, preset.attention_samples))
    res["cell"] = "{}/{}".format(*preset.quant_needle_cell)
    return res


def eval_outliers(model, preset: ComparePreset, space: TaskSpace, progress: bool) -> dict:
    from ..eval.outliers import activation_outliers

    if space.lm:
        w = lm_windows(space, preset.lm_seq_len, max(1, preset.outlier_tokens // preset.lm_seq_len))[:, :-1]
        source = "held-out Shakespeare bytes"
    else:
        w = torch.tensor([s.prompt for s in _probe_samples(preset, space, max(1, preset.outlier_tokens
                                                                             // space.needle.context_len))])
        source = "needle prompts"
    res = activation_outliers(model, w, token_budget=preset.outlier_tokens, progress=progress)
    res["source"] = source
    return res


def eval_quant(model, preset: ComparePreset, space: TaskSpace, progress: bool) -> dict:
    from ..eval.lm import evaluate_lm
    from ..eval.needle import evaluate_needles
    from ..eval.quant import quantization_sweep

    out: dict = {"bits": list(preset.quant_bits)}
    if space.lm:
        w = lm_windows(space, preset.lm_seq_len, preset.quant_lm_windows)
        out["nll"] = quantization_sweep(lambda b: evaluate_lm(model, w, backend=b).nll, bits=preset.quant_bits)
    N, R = preset.quant_needle_cell
    out["needle_cell"] = f"{N}/{R}"
    out["needle_accuracy"] = quantization_sweep(
        lambda b: evaluate_needles(model, space.needle, grid=((N, R),), depths=preset.depths,
                                   samples_per_cell=preset.quant_needle_samples, seed=EVAL_SEED, backend=b,
                                   use_cache=False).accuracy(N, R), bits=preset.quant_bits)
    return out


def eval_icl(model, preset: ComparePreset, space: TaskSpace, progress: bool) -> dict:
    from ..eval.icl import evaluate_icl_order

    if space.icl is None:
        return {"skipped": "the preset trains no in-context classification batches (icl_every = 0)"}
    return evaluate_icl_order(model, space.icl, n_episodes=preset.icl_episodes, n_orders=preset.icl_orders,
                              seed=EVAL_SEED, progress=progress)


def eval_diagnostics(model, preset: ComparePreset, space: TaskSpace, progress: bool) -> dict:
    from ..eval.diagnostics import lambda_summary, model_head_redundancy

    prompts = torch.tensor([s.prompt for s in _probe_samples(preset, space, 8)])  # (8, context_len)
    lam = lambda_summary(model)
    return {"lambda": lam["lambda"], "lambda_init": lam["lambda_init"],
            "head_redundancy": model_head_redundancy(model, prompts)}


EVALUATORS: dict[str, Callable] = {"lm": eval_lm, "needle": eval_needle, "attention": eval_attention,
                                   "outliers": eval_outliers, "quant": eval_quant, "icl": eval_icl,
                                   "diagnostics": eval_diagnostics}


def evaluate_model(folder: Path, preset: ComparePreset, *, progress: bool = True,
                   only: tuple | None = None, position: int = 0) -> dict:
    """Run every evaluation not yet stored in ``folder/evals/`` on the model in ``folder/model``;
    returns ``{name: result}`` for all of them (stored ones read back). Each result carries its
    ``wall_s``."""
    space = task_space(preset)
    out_dir = folder / "evals"
    out_dir.mkdir(parents=True, exist_ok=True)
    model = None
    results = {}
    from tqdm.auto import tqdm

    names = list(only or EVALUATIONS)
    bar = tqdm(names, desc=f"evaluate {folder.parent.name}/{folder.name}", disable=not progress, leave=False,
               position=position, dynamic_ncols=True)
    for name in bar:
        bar.set_postfix_str(name)
        path = out_dir / f"{name}.json"
        if path.is_file():
            results[name] = json.loads(path.read_text())
            continue
        if model is None:
            model = load_model(folder / "model", device=resolve_device(preset.device)).eval()
        t0 = time.time()
        with torch.no_grad():
            res = EVALUATORS[name](model, preset, space, False)
        res["wall_s"] = time.time() - t0
        atomic_write(path, lambda p, res=res: Path(p).write_text(json.dumps(res) + "\n"))
        results[name] = res
    return results
