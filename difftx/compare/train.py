"""Training a DIFF model and its matched baseline on the comparison's tasks.

One small loop (not :func:`difftx.training.train`, which trains on packed text only): it reuses
the model, the AdamW parameter groups and the learning-rate schedule of ``difftx.training`` and
draws its batches from a ``random.Random`` seeded by the comparison seed alone, so DIFF and its
baseline see exactly the same batches in the same order (a paired comparison).

Batches: the synthetic multi-needle task (:func:`difftx.eval.needle.training_batch`, mixed N/R/
depths, loss on the answer tokens), every ``lm_every``-th step a language-modelling batch of
bundled Shakespeare bytes, and every ``icl_every``-th other step an in-context classification
batch (:func:`difftx.eval.icl.training_batch`); each task has its own block of ids in one
shared vocabulary (:class:`TaskSpace`).
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..checkpoint import atomic_write, save_model
from ..config import ModelConfig, baseline_config
from ..eval import icl as icl_task
from ..eval.icl import ICLTask
from ..eval.needle import NeedleTask, training_batch
from ..model import Transformer
from ..training.config import TrainConfig
from ..training.optim import build_optimizer, lr_at
from .presets import ComparePreset

MODEL_KINDS = ("diff", "baseline")
PROBE_SEED = 4321  # the needle prompts probed during training (not the evaluation's)
BATCH_KINDS = ("needle", "lm", "icl")
TASK_FILE = "compare_task.json"  # beside a compare model's config.json: its task vocabulary


BYTE_VOCAB = 257  # the byte tokenizer: 256 bytes and end-of-text


@dataclass(frozen=True)
class TaskSpace:
    """The shared vocabulary: needle-task ids first, then (with LM batches) UTF-8 bytes and the
    byte tokenizer's end-of-text shifted by ``lm_offset``, then (with ICL batches) the ICL task's
    ids, which start at ``icl.first_id``."""

    needle: NeedleTask
    lm: bool
    icl: ICLTask | None = None

    @property
    def lm_offset(self) -> int:
        return self.needle.vocab_size

    @property
    def vocab_size(self) -> int:
        return self.icl.vocab_size if self.icl else self.lm_offset + (BYTE_VOCAB if self.lm else 0)


def task_space(preset: ComparePreset) -> TaskSpace:
    task = NeedleTask(n_keys=preset.n_keys, n_filler=preset.n_filler, context_len=preset.context_len,
                      max_needles=preset.max_needles, max_query=max(r for _, r in preset.grid))
    lm = preset.lm_every > 0
    icl = preset.icl_task(task.vocab_size + (BYTE_VOCAB if lm else 0)) if preset.icl_every else None
    return TaskSpace(task, lm, icl)


def model_configs(preset: ComparePreset, space: TaskSpace) -> dict[str, ModelConfig]:
    """``{"diff": ..., "baseline": baseline_config(diff)}`` for the preset."""
    longest = max(space.needle.max_seq_len, preset.lm_seq_len if space.lm else 0,
                  space.icl.prompt_len + 1 if space.icl else 0)
    diff = ModelConfig(vocab_size=space.vocab_size, dim=preset.dim, n_layers=preset.n_layers, n_heads=preset.n_heads,
                       attention="diff", max_seq_len=longest)
    return {"diff": diff, "baseline": baseline_config(diff)}


def lm_streams(progress: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Train and validation byte streams of the bundled corpus (cached by ``prepare_data``)."""
    from ..data import prepare_data

    data = prepare_data(None, "byte", progress=progress)
    if data.val is None:
        raise ValueError("the bundled corpus has no validation split")
    return np.asarray(data.train.tokens), np.asarray(data.val.tokens)


def lm_batch(stream: np.ndarray, batch_size: int, seq_len: int, rng: random.Random, offset: int) -> torch.Tensor:
    """``(B, seq_len + 1)`` random windows of ``stream``, ids shifted by ``offset``."""
    starts = [rng.randrange(0, len(stream) - seq_len - 1) for _ in range(batch_size)]
    w = np.stack([stream[s:s + seq_len + 1].astype(np.int64) for s in starts])  # (B, T+1)
    return torch.from_numpy(w) + offset


def batch_for_step(step: int, preset: ComparePreset, space: TaskSpace, rng: random.Random,
                   lm_train: np.ndarray | None) -> tuple[str, torch.Tensor, torch.Tensor | None]:
    """``(kind, tokens (B, T+1), loss_mask (B, T) or None)`` for optimizer step ``step`` (from 1);
    depends only on the step, the preset and the state of ``rng``."""
    kind = step_kind(step, preset)
    if kind == "lm":
        assert lm_train is not None
        return "lm", lm_batch(lm_train, preset.batch_size, preset.lm_seq_len, rng, space.lm_offset), None
    if kind == "icl":
        assert space.icl is not None
        tokens, mask = icl_task.training_batch(space.icl, preset.batch_size, rng)
        return "icl", tokens, mask
    tokens, mask = training_batch(space.needle, preset.batch_size, rng)
    return "needle", tokens, mask


def batch_loss(model: Transformer, tokens: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean next-token cross-entropy of ``tokens`` ``(B, T+1)`` over the positions where
    ``loss_mask`` ``(B, T)`` is True (every position when None). The LM head runs on those
    positions alone: a needle batch takes its loss on a few answer tokens per sequence."""
    inp, tgt = tokens[:, :-1], tokens[:, 1:]  # (B, T), (B, T)
    h = model.hidden(inp)  # (B, T, D)
    if loss_mask is not None:
        h, tgt = h[loss_mask], tgt[loss_mask]  # (N, D), (N,)
    logits = model.lm_head(h)  # (..., V)
    return F.cross_entropy(logits.flatten(0, -2).float(), tgt.flatten())


def step_kind(step: int, preset: ComparePreset) -> str:
    """``"lm"``, ``"icl"`` or ``"needle"``: the kind of batch of optimizer step ``step`` (from 1)."""
    if preset.lm_every and step % preset.lm_every == 0:
        return "lm"
    if preset.icl_every and step % preset.icl_every == 0:
        return "icl"
    return "needle"


def batch_shares(preset: ComparePreset) -> dict[str, float]:
    """Share of the training steps of each batch kind (over one period of the schedule)."""
    period = math.lcm(preset.lm_every or 1, preset.icl_every or 1)
    kinds = [step_kind(s, preset) for s in range(1, period + 1)]
    return {k: kinds.count(k) / period for k in BATCH_KINDS}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def train_config(preset: ComparePreset, seed: int) -> TrainConfig:
    """The trainer's config carrying this loop's optimizer and schedule settings (for
    :func:`build_optimizer` / :func:`lr_at`)."""
    return TrainConfig(steps=preset.steps, lr=preset.lr, min_lr=preset.min_lr, warmup_steps=preset.warmup_steps,
                       weight_decay=preset.weight_decay, grad_clip=preset.grad_clip, batch_size=preset.batch_size,
                       seed=seed, decay="cosine", tensorboard=False)


def train_model(kind: str, preset: ComparePreset, seed: int, folder: Path, *, progress: bool = True,
                position: int = 0) -> dict:
    """Train one model (``kind`` in :data:`MODEL_KINDS`) and save it to ``folder/model``;
    ``folder/train.json`` (written last, atomically) marks it finished and holds the loss history,
    λ per layer over training, the needle probes (every ``preset.probe_every`` steps, see
    :func:`needle_probe`) and the wall / CPU time. Returns that record."""
    from tqdm.auto import tqdm

    if kind not in MODEL_KINDS:
        raise ValueError(f"kind: must be one of {MODEL_KINDS}, got {kind!r}")
    if preset.threads:
        torch.set_num_threads(preset.threads)
    space = task_space(preset)
    cfg = model_configs(preset, space)[kind]
    device = resolve_device(preset.device)
    torch.manual_seed(seed)
    model = Transformer(cfg).to(device)
    tc = train_config(preset, seed)
    opt = build_optimizer(model, tc)
    lm_train = lm_streams()[0] if space.lm else None
    rng = random.Random(f"difftx-compare-data:{seed}")  # the data order: a function of the seed only
    history: list[dict] = []
    probes: list[dict] = []
    probe_s = 0.0
    sums = {k: [0.0, 0] for k in BATCH_KINDS}
    t0, c0 = time.time(), time.process_time()
    if device.type == "cuda":  # bf16 autocast and TF32 on GPUs (never on CPU: bf16 is very slow there)
        torch.backends.cuda.matmul.allow_tf32 = True
        amp = lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    else:
        amp = contextlib.nullcontext
    model.train()
    bar = tqdm(range(1, preset.steps + 1), desc=f"train {kind} seed {seed}", disable=not progress, position=position,
               leave=False, dynamic_ncols=True)
    for step in bar:
        what, tokens, mask = batch_for_step(step, preset, space, rng, lm_train)
        tokens = tokens.to(device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, tc)
        with amp():
            loss = batch_loss(model, tokens, None if mask is None else mask.to(device))
        if not math.isfinite(loss.item()):
            raise RuntimeError(f"training {kind} (seed {seed}) diverged at step {step}: loss {loss.item()}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if preset.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), preset.grad_clip)
        opt.step()
        sums[what][0] += loss.item()
        sums[what][1] += 1
        if step % preset.log_every == 0 or step == preset.steps:
            rec = {"step": step, "lr": lr_at(step, tc)}
            for k, (s, n) in sums.items():
                if n:
                    rec[f"{k}_loss"] = s / n
            rec["lambda"] = _lambdas(model)
            history.append(rec)
            sums = {k: [0.0, 0] for k in BATCH_KINDS}
            bar.set_postfix({k: f"{v:.3f}" for k, v in rec.items() if k.endswith("_loss")})
        if preset.probe_every and (step % preset.probe_every == 0 or step == preset.steps):
            t_probe = time.time()
            probes.append({"step": step, "accuracy": needle_probe(model, preset, space)})
            probe_s += time.time() - t_probe
    bar.close()
    model.eval()
    save_model(model.cpu(), folder / "model", {"seed": seed, "kind": kind, "preset": preset.name})
    task_info = {"needle_task": space.needle.to_dict(), "lm": space.lm, "lm_offset": space.lm_offset,
                 "lm_seq_len": preset.lm_seq_len, "icl_task": space.icl.to_dict() if space.icl else None}
    atomic_write(folder / "model" / TASK_FILE, lambda p: Path(p).write_text(json.dumps(task_info, indent=1) + "\n"))
    record = {"kind": kind, "seed": seed, "config": cfg.to_dict(), "parameters": model.num_parameters(),
              "steps": preset.steps, "history": history, "probes": probes, "probe_s": probe_s,
              "wall_s": time.time() - t0,
              "cpu_s": time.process_time() - c0, "device": str(device), "threads": torch.get_num_threads()}
    atomic_write(folder / "train.json", lambda p: Path(p).write_text(json.dumps(record, indent=1) + "\n"))
    return record


def needle_probe(model: Transformer, preset: ComparePreset, space: TaskSpace) -> dict[str, float]:
    """Needle accuracy per grid cell (``{"N/R": acc}``) on ``probe_samples`` fixed prompts per cell
    at depth 50%, greedy; the model is put back in training mode. Touches no random state."""
    from ..eval.needle import evaluate_needles

    model.eval()
    try:
        with torch.no_grad():
            res = evaluate_needles(model, space.needle, grid=preset.grid, depths=(0.5,),
                                   samples_per_cell=preset.probe_samples, seed=PROBE_SEED)
    finally:
        model.train()
    return res.accuracy_table()


def _lambdas(model: torch.nn.Module) -> list[float] | None:
    from ..eval.capture import layer_lambdas

    lam = layer_lambdas(model)
    return None if all(v is None for v in lam) else [float(v) for v in lam]
