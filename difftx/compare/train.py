"""Training the model of each arm (DIFF and its matched baseline) on the comparison's tasks, through
:func:`difftx.training.train` (atomic checkpoints, exact mid-training resume, NaN stop, GPU
placement, DDP / FSDP2 under torchrun).

It reads only the training parts of a resolved plan (:mod:`difftx.compare.plan`): the arm's
model config, the schedule, the batch mixture, the probes, the task vocabulary and the device.
The batches come from :class:`difftx.compare.stream.CompareStream`, drawn from a generator
seeded by the comparison seed alone, so every arm sees exactly the same batches in the same
order (a paired comparison).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import load_model, save_model
from ..data import load_tokenizer
from ..io import own_folder
from ..provenance import write_machine
from ..tasks.common import FROM_SOURCE, no_needles
from ..tasks.subject import CompareTask, TrainRecord
from ..training.checkpointing import TOKENIZER_DIR
from ..training.summary import METRICS_NAME
from .jobs import stacks
from .plan import ComparePlan, Mixture
from .stream import CompareStream, lm_streams


class TrainingInterrupted(RuntimeError):
    """A signal (SIGTERM, SIGUSR1) stopped a model's training after a checkpoint; re-running the
    comparison continues it."""


def train_model(arm: str, plan: ComparePlan, seed: int, folder: Path, *, progress: bool = True,
                position: int = 0, invocation: str | None = None) -> dict:
    """Train the model of ``arm`` (a key of ``plan.arms``) with :func:`difftx.training.train`
    on ``plan``'s schedule, batch mixture and probes, and
    save it to ``folder/model`` (a difftx checkpoint, with its task vocabulary in
    ``compare_task.json``, :class:`~difftx.tasks.subject.CompareTask`); ``folder/train.json``
    (:class:`~difftx.tasks.subject.TrainRecord`, written last, atomically) marks it finished
    and holds the loss history (per batch kind, gradient norm, λ per layer, every ``log_every``
    steps), the needle probes (every ``plan.probes.every`` steps, see :func:`needle_probe`), the
    wall / CPU time and ``invocation`` (the id of the compare run that trained it: throughput is
    compared only between models of one invocation). Returns that record (as a dict).

    The trainer's run folder is ``folder/train``: an interrupted model continues there from its
    last checkpoint (every ~10% of the steps) on the next call, exactly as if uninterrupted. Its
    checkpoints are deleted once ``train.json`` is written (``metrics.jsonl`` stays).

    Under torchrun every process calls this (each trains on its share of every batch); rank 0
    writes the files, and the function returns the record on every rank."""
    return train_models(arm, plan, [seed], [folder], progress=progress, position=position,
                        invocation=invocation)[0]


def train_models(arm: str, plan: ComparePlan, seeds: list[int], folders: list[Path], *, progress: bool = True,
                 position: int = 0, invocation: str | None = None, request: dict | None = None) -> list[dict]:
    """:func:`train_model` for several seeds of ``arm`` (``folders[i]`` for ``seeds[i]``): more
    than one are trained together as one stacked model (:func:`difftx.training.train_stacked`; one
    process, and all at the same checkpoint step), each with its own batches, probes, checkpoints and
    record, as separate training would make them to float32 rounding. A stacked model's ``wall_s`` /
    ``cpu_s`` are its share (the stack's / K) and its record says ``stacked``: K. ``request``
    (:func:`difftx.compare.run.training_request`) is kept in each record with its seed and arm."""
    from ..training.distributed import destroy_distributed, init_distributed, is_initialized, on_main
    from ..training.trainer import TrainingDivergedError, stop_hint

    if arm not in plan.arms:
        raise ValueError(f"arm: must be one of {tuple(plan.arms)}, got {arm!r}")
    if plan.execution.threads:
        torch.set_num_threads(plan.execution.threads)
    cfg, device = plan.arms[arm], plan.execution.device
    folders = [Path(f) for f in folders]
    owns_group = not is_initialized()
    dist = init_distributed(device)
    try:
        if len(seeds) > 1 and dist.distributed:
            raise ValueError("train_models: a stack of seeds trains in one process, not under torchrun")
        setups = [_Setup.make(arm, plan, seed, folder, dist.world_size, progress)
                  for seed, folder in zip(seeds, folders)]
        resume = setups[0].has_checkpoints
        if any(s.has_checkpoints != resume for s in setups):
            raise ValueError(f"train_models: the seeds {seeds} of a stack must all have checkpoints or none")
        for s in setups:
            if not s.has_checkpoints:  # interrupted before its first checkpoint: compare owns the folder, so start over
                on_main(lambda s=s: (s.run_dir / METRICS_NAME).unlink(missing_ok=True))
        t0, c0 = time.time(), time.process_time()
        what = f"{arm} seed {seeds[0]}" if len(seeds) == 1 else f"{arm} seeds {', '.join(map(str, seeds))}"
        bar = {"desc": f"train {what}", "position": position, "leave": False}
        what = f"{arm} ({what[len(arm) + 1:]})"
        try:  # a signal's line says what compare needs: its command again (it has no --resume)
            with stop_hint("run the same compare command again to continue"):
                results = _train(setups, cfg, resume, bar, stacks(plan, dist.distributed))
        except TrainingDivergedError as e:
            raise TrainingDivergedError(f"training {what} diverged: {e}") from e
        for s, result in zip(setups, results):
            if result.step < s.config.steps:  # a signal (or stop_at) ended it early, after writing a checkpoint
                raise TrainingInterrupted(f"training {what} stopped by {result.stopped_by or 'request'} after step "
                                          f"{result.step} (checkpoint {result.last_checkpoint}); run the same command "
                                          "again to continue it")
        share = {"wall_s": (time.time() - t0) / len(seeds), "cpu_s": (time.process_time() - c0) / len(seeds),
                 "device": str(dist.device), "threads": torch.get_num_threads(), "world_size": dist.world_size,
                 "invocation": invocation, "stacked": len(seeds) if len(seeds) > 1 else None}
        return [on_main(lambda s=s, r=r: _finish(arm, plan, s, r, share, request), share=True)
                for s, r in zip(setups, results)]
    finally:
        if owns_group:
            destroy_distributed()


def _train(setups: list, cfg, resume: bool, bar: dict, stacked: bool) -> list:
    """Train the models of ``setups`` (one alone unless ``stacked``, more as a stack); resume=True
    continues an interrupted run (without a checkpoint folder: a quiet fresh start)."""
    from ..training import train, train_stacked

    if len(setups) == 1 and not stacked:
        s = setups[0]
        return [train(s.config, resume=resume, data=s.stream, model_config=cfg, probes=s.probes.probes,
                      progress_bar=bar)]
    return train_stacked([s.config for s in setups], data=[s.stream for s in setups], model_config=cfg, resume=resume,
                         probes=[s.probes.probes for s in setups], progress_bar=bar)


@dataclass
class _Setup:
    """One model's trainer config, batch stream and probes."""

    seed: int
    folder: Path
    run_dir: Path
    config: object
    stream: CompareStream
    probes: "TrainingProbes"
    has_checkpoints: bool

    @classmethod
    def make(cls, arm: str, plan: ComparePlan, seed: int, folder: Path, world_size: int, progress: bool) -> "_Setup":
        space, run_dir = plan.space, own_folder(folder / "train")
        tc = plan.schedule.train_config(model=plan.arms[arm], batch_size=plan.mixture.batch_size, seed=seed,
                                        out_dir=run_dir, device=plan.execution.device, world_size=world_size,
                                        progress=progress)
        if plan.source is not None:  # compare --from: the source, or its conversion with this seed
            from .source import initial_weights

            tc = tc.replace(init_from=str(initial_weights(plan.source, arm, seed, folder)))
        stream = CompareStream(plan.mixture, space, seed,
                               lm_streams(text=plan.text)[0] if plan.text is not None and space.block("lm") else None)
        return cls(seed, folder, run_dir, tc, stream, training_probes(plan, stream),
                   (run_dir / "checkpoints").is_dir())


def _finish(arm: str, plan: ComparePlan, setup: _Setup, result, share: dict, request: dict | None = None) -> dict:
    """Save the trained model with its task vocabulary, write ``train.json`` (last, atomically) and
    delete the checkpoints; returns the record."""
    from ..training.metrics import read_metrics

    space, folder, run_dir, seed = plan.space, setup.folder, setup.run_dir, setup.seed
    model = load_model(result.last_checkpoint)
    save_model(model, own_folder(folder / "model"), {"seed": seed, "arm": arm, "preset": plan.name})
    if plan.text is not None:  # your own text: its tokenizer saved beside the model
        load_tokenizer(plan.text.tokenizer).save(own_folder(folder / "model" / TOKENIZER_DIR))
    CompareTask(space, plan.mixture.settings["lm"].seq_len, plan.text).write(folder / "model")
    history, probes, probe_s, curve = [], [], 0.0, []
    for r in read_metrics(run_dir / METRICS_NAME):  # one trajectory, also across resumes
        if "probe" in r:
            got = dict(r["probe"])
            loss, curve_s = got.pop("heldout_loss", None), got.pop("heldout_s", 0.0)
            if loss is not None:
                curve.append((r["step"], loss, curve_s))
            if got:
                probes.append({"step": r["step"], **got})
                probe_s += r.get("probe_s", 0.0) - curve_s
        elif "loss" in r:
            history.append({"step": r["step"], "lr": r["lr"],
                            **{f"{k}_loss": r[f"{k}_loss"] for k in plan.mixture.kinds() if f"{k}_loss" in r},
                            "grad_norm": r["grad_norm"], "grad_norms": r.get("grad_norms"),
                            "tokens": r.get("tokens"), "time_s": r.get("time_s"), "lambda": r.get("lambda"),
                            **({"lambda_scale": r["lambda_scale"]} if "lambda_scale" in r else {})})
    heldout_curve = {**setup.probes.curve, "steps": [c[0] for c in curve],
                     "tokens": [lm_tokens(plan.mixture, c[0]) for c in curve],
                     "loss": [c[1] for c in curve], "s": sum(c[2] for c in curve)} if plan.curve.steps else None
    record = TrainRecord(
        arm=arm, seed=seed, config=plan.arms[arm].to_dict(), parameters=model.num_parameters(),
        steps=plan.schedule.steps, history=history, probes=probes, probe_s=probe_s, resumed_from=result.resumed_from,
        probes_skipped=None if space.block("needle") is not None else FROM_SOURCE.format(task="needle")
        if plan.source is not None else no_needles(k for k, share in plan.mixture.shares().items() if share > 0),
        heldout_curve=heldout_curve,
        request=None if request is None else {**request, "arm": arm, "seed": seed}, **share)
    write_machine(folder, share.get("device"))  # before train.json, which marks the model finished
    record.write(folder)
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # the model is in folder/model now
    if plan.source is not None:
        from .source import drop_initial_weights

        drop_initial_weights(folder)
    return record.to_dict()


@dataclass
class TrainingProbes:
    """What the trainer runs during training: ``probes`` (its ``(every or steps, fn)``) and
    ``curve``, the description of the held-out windows of the loss curve (empty without one)."""

    probes: tuple
    curve: dict


def training_probes(plan: ComparePlan, stream: CompareStream) -> TrainingProbes:
    """The probes of the training tasks that have batches (every ``plan.probes.every`` steps and the last;
    a task's ``probe_at_start`` also on the initial model, step 0: the recall probe) and the held-out loss
    curve (at ``plan.curve.steps``, :func:`heldout_loss`) as one trainer probe. They leave training as it
    was: eval mode, no gradients, no random state. The curve's windows are fixed: ``plan.curve.windows``
    disjoint windows of the LM training length spread evenly over the held-out stream
    (:func:`difftx.eval.lm.spread_windows`; the file given, the corpus's validation split, or the bundled
    Shakespeare's)."""
    space = plan.space
    probing = [t for t in plan.mixture.tasks if t.has_probe() and t.block(space) is not None]

    def every_probe(m: torch.nn.Module) -> dict:  # the probes of the tasks the model trains on, in registry order
        return {k: v for t in probing for k, v in t.probe(m, space, plan.probes).items()}

    def at_start(m: torch.nn.Module) -> dict:
        return {k: v for t in probing if t.probe_at_start for k, v in t.probe(m, space, plan.probes).items()}

    every, last = plan.probes.every, plan.schedule.steps
    # the recall probe also reads the initial model (step 0): its mechanism at initialisation
    start = {0} if every and any(t.probe_at_start for t in probing) else set()
    if not plan.curve.steps and not start:
        return TrainingProbes((every, every_probe), {})
    windows, info = None, {}
    if plan.curve.steps:
        from ..eval.lm import spread_windows

        if plan.text is not None:
            held, source = plan.text.heldout_tokens()
        else:
            held, source = lm_streams()[1], "held-out bundled Shakespeare (bytes)"
        stream_ids = torch.from_numpy(np.asarray(held).astype(np.int64)) + space.block("lm").first_id
        window = plan.mixture.settings["lm"].seq_len
        windows, _ = spread_windows(stream_ids, window, plan.curve.windows)  # (N, T+1)
        info = {"source": source, "windows": int(windows.shape[0]), "window": window,
                "distinct_tokens": int(windows.shape[0]) * window}
    needle_steps = set(range(every, last + 1, every)) | {last} if every else set()
    curve_steps = set(plan.curve.steps)

    def probe(model: torch.nn.Module) -> dict:
        step = stream.loader.step  # one batch per optimizer step: the step just taken (0: none yet)
        if step in needle_steps:
            out = every_probe(model)
        elif step in start:
            out = at_start(model)
        else:
            out = {}
        if step in curve_steps:
            t = time.perf_counter()
            out["heldout_loss"] = heldout_loss(model, windows)
            out["heldout_s"] = time.perf_counter() - t
        return out

    return TrainingProbes((tuple(sorted(start | needle_steps | curve_steps)), probe), info)


def heldout_loss(model: torch.nn.Module, windows: torch.Tensor) -> float:
    """Mean next-token NLL (nats) of ``windows`` ``(N, T+1)``: every prediction of every window,
    in eval mode, without gradients (the model's mode is restored)."""
    from ..eval.lm import token_nll

    device = next(model.parameters()).device
    return float(token_nll(model, windows.to(device)).double().mean())


def lm_tokens(mixture: Mixture, step: int) -> int:
    """Text tokens trained on by the end of optimizer step ``step`` (LM batches only: needle and
    ICL batches are not counted)."""
    lm_steps = sum(1 for s in range(1, step + 1) if mixture.step_kind(s) == "lm")
    return lm_steps * mixture.batch_size * mixture.settings["lm"].seq_len
