"""Training a DIFF model and its matched baseline on the comparison's tasks, through
:func:`difftx.training.train` (atomic checkpoints, exact mid-training resume, NaN stop, GPU
placement, DDP / FSDP2 under torchrun).

The batches come from :class:`difftx.compare.stream.CompareStream`: the multi-needle task,
every ``lm_every``-th step a language-modelling batch of bundled Shakespeare bytes, every
``icl_every``-th other step an in-context classification batch, drawn from a generator seeded
by the comparison seed alone, so DIFF and its baseline see exactly the same batches in the same
order (a paired comparison). Each task has its own block of ids in one shared vocabulary
(:class:`TaskSpace`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..checkpoint import atomic_write, load_model, save_model
from ..config import ModelConfig, baseline_config
from ..eval.icl import ICLTask
from ..eval.needle import NeedleTask
from ..training.config import TrainConfig
from .presets import ComparePreset
from .stream import (  # noqa: F401 - re-exported: the stream's pieces were defined here before
    BATCH_KINDS, CompareStream, batch_for_step, batch_shares, lm_batch, lm_streams, step_kind,
)

MODEL_KINDS = ("diff", "baseline")
PROBE_SEED = 4321  # the needle prompts probed during training (not the evaluation's)
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
                      max_needles=preset.max_needles, max_query=preset.max_query)
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


def batch_loss(model: torch.nn.Module, tokens: torch.Tensor, loss_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean next-token cross-entropy of ``tokens`` ``(B, T+1)`` over the positions where
    ``loss_mask`` ``(B, T)`` is True (every position when None): the loss the trainer takes on one
    batch of the stream in one process. The LM head runs on those positions alone
    (``forward(logits_at=...)``): a needle batch takes its loss on a few answer tokens per sequence."""
    from ..model import lm_loss
    from ..training.trainer import masked_lm_loss

    x, y = tokens[:, :-1], tokens[:, 1:]  # (B, T) each
    if loss_mask is None:
        return lm_loss(model(x), y)
    return masked_lm_loss(model(x, logits_at=loss_mask), y[loss_mask], int(loss_mask.sum()))


def train_config(preset: ComparePreset, seed: int, model: ModelConfig, out_dir: str | os.PathLike,
                 world_size: int = 1, progress: bool = False) -> TrainConfig:
    """The trainer's config of one compare model: the preset's optimizer, schedule (cosine after
    warmup), batch (``preset.batch_size`` is the global batch: ``batch_size // world_size`` per
    process), logging every ``log_every`` steps, a checkpoint every ~10% of the steps (a multiple
    of ``log_every``, so a resumed run logs the same records), no validation passes."""
    if preset.batch_size % world_size:
        raise ValueError(f"ComparePreset.batch_size: {preset.batch_size} is not divisible by the {world_size} "
                         "processes (each takes an equal share of every batch)")
    ckpt_every = max(1, round(preset.steps / 10 / preset.log_every)) * preset.log_every
    return TrainConfig(model=model.to_dict(), seq_len=model.max_seq_len, batch_size=preset.batch_size // world_size,
                       steps=preset.steps, lr=preset.lr, min_lr=preset.min_lr, warmup_steps=preset.warmup_steps,
                       decay="cosine", weight_decay=preset.weight_decay, grad_clip=preset.grad_clip, seed=seed,
                       eval_interval=0, log_interval=preset.log_every, ckpt_interval=ckpt_every, keep_last=1,
                       out_dir=str(out_dir), tensorboard=False, progress=progress, device=preset.device)


class TrainingInterrupted(RuntimeError):
    """A signal (SIGTERM, SIGUSR1) stopped a model's training after a checkpoint; re-running the
    comparison continues it."""


def train_model(kind: str, preset: ComparePreset, seed: int, folder: Path, *, progress: bool = True,
                position: int = 0) -> dict:
    """Train one model (``kind`` in :data:`MODEL_KINDS`) with :func:`difftx.training.train` and
    save it to ``folder/model`` (a difftx checkpoint, with its task vocabulary in
    ``compare_task.json``); ``folder/train.json`` (written last, atomically) marks it finished
    and holds the loss history (per batch kind, gradient norm, λ per layer, every ``log_every``
    steps), the needle probes (every ``preset.probe_every`` steps, see :func:`needle_probe`) and
    the wall / CPU time. Returns that record.

    The trainer's run folder is ``folder/train``: an interrupted model continues there from its
    last checkpoint (every ~10% of the steps) on the next call, exactly as if uninterrupted. Its
    checkpoints are deleted once ``train.json`` is written (``metrics.jsonl`` stays).

    Under torchrun every process calls this (each trains on its share of every batch); rank 0
    writes the files, and the function returns the record on every rank."""
    from ..training import train
    from ..training.distributed import destroy_distributed, init_distributed, is_initialized, on_main
    from ..training.metrics import read_metrics
    from ..training.trainer import TrainingDivergedError

    if kind not in MODEL_KINDS:
        raise ValueError(f"kind: must be one of {MODEL_KINDS}, got {kind!r}")
    if preset.threads:
        torch.set_num_threads(preset.threads)
    space = task_space(preset)
    cfg = model_configs(preset, space)[kind]
    folder = Path(folder)
    run_dir = folder / "train"
    owns_group = not is_initialized()
    dist = init_distributed(preset.device)
    try:
        tc = train_config(preset, seed, cfg, run_dir, dist.world_size, progress)
        stream = CompareStream(preset, space, seed)
        t0, c0 = time.time(), time.process_time()
        try:
            # resume=True continues an interrupted run (without a checkpoint folder: a quiet fresh start)
            result = train(tc, resume=(run_dir / "checkpoints").is_dir(), data=stream, model_config=cfg,
                           probes=(preset.probe_every, lambda m: needle_probe(m, preset, space)),
                           progress_bar={"desc": f"train {kind} seed {seed}", "position": position, "leave": False})
        except TrainingDivergedError as e:
            raise TrainingDivergedError(f"training {kind} (seed {seed}) diverged: {e}") from e
        if result.step < tc.steps:  # a signal (or stop_at) ended it early, after writing a checkpoint
            raise TrainingInterrupted(f"training {kind} (seed {seed}) stopped by {result.stopped_by or 'request'} "
                                      f"after step {result.step} (checkpoint {result.last_checkpoint}); run the same "
                                      "command again to continue it")

        def finish() -> dict:
            model = load_model(result.last_checkpoint)
            save_model(model, folder / "model", {"seed": seed, "kind": kind, "preset": preset.name})
            task_info = {"needle_task": space.needle.to_dict(), "lm": space.lm, "lm_offset": space.lm_offset,
                         "lm_seq_len": preset.lm_seq_len, "icl_task": space.icl.to_dict() if space.icl else None}
            atomic_write(folder / "model" / TASK_FILE,
                         lambda p: Path(p).write_text(json.dumps(task_info, indent=1) + "\n"))
            history, probes, probe_s = [], [], 0.0
            for r in read_metrics(run_dir / "metrics.jsonl"):  # one trajectory, also across resumes
                if "probe" in r:
                    probes.append({"step": r["step"], "accuracy": r["probe"]})
                    probe_s += r.get("probe_s", 0.0)
                elif "loss" in r:
                    history.append({"step": r["step"], "lr": r["lr"],
                                    **{f"{k}_loss": r[f"{k}_loss"] for k in BATCH_KINDS if f"{k}_loss" in r},
                                    "grad_norm": r["grad_norm"], "lambda": r.get("lambda")})
            record = {"kind": kind, "seed": seed, "config": cfg.to_dict(), "parameters": model.num_parameters(),
                      "steps": preset.steps, "history": history, "probes": probes, "probe_s": probe_s,
                      "wall_s": time.time() - t0, "cpu_s": time.process_time() - c0, "device": str(dist.device),
                      "threads": torch.get_num_threads(), "world_size": dist.world_size,
                      "resumed_from": result.resumed_from}
            atomic_write(folder / "train.json", lambda p: Path(p).write_text(json.dumps(record, indent=1) + "\n"))
            shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the model is in folder/model now
            return record

        return on_main(finish, share=True)
    finally:
        if owns_group:
            destroy_distributed()


def needle_probe(model: torch.nn.Module, preset: ComparePreset, space: TaskSpace) -> dict[str, float]:
    """Needle accuracy per grid cell (``{"N/R": acc}``) on ``probe_samples`` fixed prompts per cell
    at depth 50%, greedy; the model is put back in its previous mode. Touches no random state."""
    from ..eval.needle import evaluate_needles

    was = model.training
    model.eval()
    try:
        with torch.no_grad():
            res = evaluate_needles(model, space.needle, grid=preset.grid, depths=(0.5,),
                                   samples_per_cell=preset.probe_samples, seed=PROBE_SEED)
    finally:
        model.train(was)
    return res.accuracy_table()
